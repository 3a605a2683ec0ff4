//! The sessions to one upstream: at most `max_connections` at once, kept
//! open between messages (up to `max_messages_per_connection` each, closed
//! after `idle_timeout` unused), checked before reuse without a round trip
//! (a session the upstream closed or spoke on is dropped), and one retry
//! on a fresh session when a reused one turns out stale before anything
//! was sent.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rustls::pki_types::ServerName;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::client::{Envelope, RelayError, Session, Target};
use super::reply::Reply;
use crate::config::SmtpUpstream;
use crate::metrics as m;

/// How often idle sessions past their time are closed.
const REAP_EVERY: Duration = Duration::from_secs(5);

/// One upstream's sessions.
pub struct Pool {
    target: Target,
    idle: Mutex<Vec<Session>>,
    slots: Arc<Semaphore>,
    duration: Arc<m::Histogram>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Pool {
    /// A pool for `cfg`; closes its idle sessions in the background until
    /// it is dropped (a reload).
    pub fn new(cfg: &SmtpUpstream, roots: &Arc<rustls::ClientConfig>) -> Result<Arc<Pool>, String> {
        let tls = match &cfg.ca {
            None => roots.clone(),
            Some(certs) => crate::tls::private_ca_config(certs)
                .map_err(|e| format!("smtp_upstream '{}': ca_file: {e}", cfg.name))?,
        };
        let pool = Arc::new(Pool {
            target: Target {
                cfg: cfg.clone(),
                tls,
                server_name: ServerName::try_from(cfg.host.clone()).ok(),
            },
            idle: Mutex::new(Vec::new()),
            slots: Arc::new(Semaphore::new(cfg.max_connections)),
            duration: m::histogram(m::UPSTREAM_DURATION_SECONDS, &[("upstream", &cfg.name)]),
        });
        let weak = Arc::downgrade(&pool);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(reap(weak));
        }
        Ok(pool)
    }

    pub fn config(&self) -> &SmtpUpstream {
        &self.target.cfg
    }

    /// Relay one message by `deadline`: the upstream's reply to its end of
    /// data, or why there is none.
    pub async fn send(
        &self,
        env: &Envelope,
        body: &[u8],
        deadline: Instant,
    ) -> Result<Reply, RelayError> {
        let started = Instant::now();
        let _permit = match tokio::time::timeout_at(
            deadline.into(),
            self.slots.clone().acquire_owned(),
        )
        .await
        {
            Ok(Ok(p)) => p,
            _ => return Err(RelayError::Busy),
        };
        let result = self.send_on_a_session(env, body, deadline).await;
        self.duration.record(started.elapsed());
        result
    }

    async fn send_on_a_session(
        &self,
        env: &Envelope,
        body: &[u8],
        deadline: Instant,
    ) -> Result<Reply, RelayError> {
        let mut retried = false;
        loop {
            // The retry goes on a fresh session, as said: another pooled
            // one may be as stale (a middlebox that dropped every idle
            // flow), and its failure would reach the client.
            let pooled = if retried { None } else { self.checkout() };
            let (mut session, reused) = match pooled {
                Some(s) => (s, true),
                None => (Session::open(&self.target, deadline).await?, false),
            };
            let result = session.send(env, body, deadline).await;
            let cfg = &self.target.cfg;
            match result {
                Err(e)
                    if reused
                        && !retried
                        && e.stale_session(
                            env.committed.load(std::sync::atomic::Ordering::Relaxed),
                        )
                        && !throttled_error(&e)
                        && Instant::now() < deadline =>
                {
                    debug!(upstream = %cfg.name, error = %e, "stale pooled session; trying a fresh one");
                    retried = true;
                }
                result => {
                    self.checkin(session);
                    return result;
                }
            }
        }
    }

    /// An idle session still fit to use, if there is one; the others are
    /// closed.
    fn checkout(&self) -> Option<Session> {
        let cfg = &self.target.cfg;
        loop {
            let mut s = lock(&self.idle).pop()?;
            if s.reusable(cfg.max_messages_per_connection, cfg.idle_timeout) {
                return Some(s);
            }
            tokio::spawn(s.quit());
        }
    }

    fn checkin(&self, mut session: Session) {
        let cfg = &self.target.cfg;
        session.idle_since = Instant::now();
        if session.reusable(cfg.max_messages_per_connection, cfg.idle_timeout) {
            lock(&self.idle).push(session);
        } else {
            tokio::spawn(session.quit());
        }
    }

    /// Close the idle sessions past their time.
    fn reap(&self) {
        let cfg = &self.target.cfg;
        let expired: Vec<Session> = {
            let mut idle = lock(&self.idle);
            let (keep, expired) = idle
                .drain(..)
                .partition(|s| s.idle_since.elapsed() < cfg.idle_timeout);
            *idle = keep;
            expired
        };
        for s in expired {
            tokio::spawn(s.quit());
        }
    }
}

async fn reap(pool: Weak<Pool>) {
    loop {
        tokio::time::sleep(REAP_EVERY).await;
        match pool.upgrade() {
            Some(p) => p.reap(),
            None => return,
        }
    }
}

/// Whether a reply looks like the upstream asking to slow down: a 421, 451
/// or 454 whose enhanced code says congestion (4.4.5) or a policy deferral
/// of everything (4.7.0), or whose text speaks of rates or throttling
/// (Amazon SES says `454 Throttling failure: Maximum sending rate
/// exceeded`, Gmail `421 4.7.0 Try again later`, Microsoft `451 4.7.500
/// Server busy`). Words count where a word starts ("rate" in "rate
/// limited", not in "generate"). Not a pause: greylisting (`451 4.7.1
/// Greylisted`) and other 4.7.x policy deferrals without such words (`451
/// 4.7.1 SPF temperror`), which are about one sender or message; replies
/// about one address or mailbox (4.1.x, 4.2.x: `452 4.2.2 Mailbox quota
/// exceeded`); and a session's own idle timeout (Postfix's `421 4.4.2
/// Error: timeout exceeded`, met when a pooled session is taken as the
/// upstream closes it).
pub fn throttling(reply: &Reply) -> bool {
    if !matches!(reply.code, 421 | 451 | 454) {
        return false;
    }
    let text = reply.text.to_ascii_lowercase();
    let word = |w: &str| {
        text.match_indices(w)
            .any(|(i, _)| i == 0 || !text.as_bytes()[i - 1].is_ascii_alphanumeric())
    };
    if word("greylist") || word("graylist") {
        return false;
    }
    match reply.esc {
        [4, 4, 5] | [4, 7, 0] => return true,
        // A session's connection (4.4.2), one address (4.1.x) or one
        // mailbox (4.2.x: "Mailbox quota exceeded") is no pace to keep.
        [4, 4, 2] | [4, 1, _] | [4, 2, _] => return false,
        _ => {}
    }
    if word("timeout") || word("timed out") {
        return false;
    }
    [
        "throttl",
        "rate",
        "too many",
        "too fast",
        "slow down",
        "try again later",
        "limit",
        "exceeded",
        "busy",
    ]
    .into_iter()
    .any(word)
}

/// [`throttling`] for an error that carries a reply.
pub fn throttled_error(e: &RelayError) -> bool {
    match e {
        RelayError::Setup(r) | RelayError::Refused(r) => throttling(r),
        _ => false,
    }
}

/// The reply the client gets for a relay that failed. The upstream's own
/// refusals pass through (its text reaches the client's log), but never
/// as 421, which would oblige sluice to close the client's connection.
pub fn client_reply(e: &RelayError) -> Reply {
    let mut reply = match e {
        RelayError::Refused(r) | RelayError::Incapable(r) => r.clone(),
        RelayError::Setup(r) if r.is_transient() => r.clone(),
        RelayError::Setup(r) => {
            warn!(code = r.code, text = %r.text, "the upstream refused sluice's session");
            Reply::owned(
                451,
                [4, 4, 0],
                format!(
                    "The upstream refused the relay's session: {} {}",
                    r.code, r.text
                ),
            )
        }
        RelayError::Unsupported(why) => {
            warn!("{why}");
            Reply::owned(
                451,
                [4, 4, 0],
                format!("The relay cannot use the upstream: {why}"),
            )
        }
        RelayError::Unreachable(_) => super::reply::UPSTREAM_UNREACHABLE,
        RelayError::Lost { .. } => super::reply::UPSTREAM_LOST,
        RelayError::Busy => Reply::new(
            451,
            [4, 4, 5],
            "Every connection to the upstream is busy; try again later",
        ),
    };
    if reply.code == 421 {
        reply.code = 451;
        if reply.esc[0] == 4 && reply.esc[1] == 0 && reply.esc[2] == 0 {
            reply.esc = [4, 4, 2];
        }
    }
    if !(400..600).contains(&reply.code) {
        // A positive reply where the relay needed another (250 to DATA,
        // say): the message was not taken, and the client must not read
        // it as taken. Or a code SMTP has not (650): passed on, it was no
        // reply the client could read.
        warn!(code = reply.code, text = %reply.text, "the upstream answered out of turn");
        reply = Reply::owned(
            451,
            [4, 4, 0],
            format!(
                "The upstream answered out of turn: {} {}",
                reply.code, reply.text
            ),
        );
    }
    reply
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(code: u16, esc: [u16; 3], text: &'static str) -> Reply {
        Reply::new(code, esc, text)
    }

    #[test]
    fn a_failed_relay_is_told_as_a_refusal_smtp_has() {
        for e in [
            RelayError::Refused(r(250, [2, 0, 0], "Ok")),
            RelayError::Setup(r(220, [0, 0, 0], "again")),
            RelayError::Refused(r(354, [0, 0, 0], "go on")),
            RelayError::Refused(r(650, [0, 0, 0], "odd")),
        ] {
            let reply = client_reply(&e);
            assert_eq!(reply.code, 451, "{e}");
        }
        // Refusals pass through as they are.
        let refused = client_reply(&RelayError::Refused(r(550, [5, 1, 1], "no such user")));
        assert_eq!(refused.code, 550);
    }

    #[test]
    fn providers_throttling_replies_are_recognized() {
        assert!(throttling(&r(
            454,
            [0, 0, 0],
            "Throttling failure: Maximum sending rate exceeded."
        )));
        assert!(throttling(&r(
            421,
            [4, 7, 0],
            "Try again later, closing connection."
        )));
        assert!(throttling(&r(
            451,
            [4, 7, 500],
            "Server busy. Please try again later"
        )));
        assert!(throttling(&r(451, [4, 4, 5], "Mail system congestion")));
        assert!(!throttling(&r(451, [4, 3, 0], "Local error in processing")));
        assert!(!throttling(&r(550, [5, 7, 1], "Rate limit: permanent")));
        assert!(!throttling(&r(250, [2, 0, 0], "rate ok")));
        assert!(!throttling(&r(
            451,
            [4, 7, 1],
            "Greylisted, try again later"
        )));
        assert!(!throttling(&r(
            451,
            [4, 3, 0],
            "Could not generate a reply"
        )));
        assert!(throttling(&r(451, [4, 3, 0], "Sending rate-limited")));
        assert!(throttling(&r(421, [4, 3, 0], "Ratelimit reached")));
        assert!(throttling(&r(
            421,
            [4, 7, 0],
            "[TSS04] Messages temporarily deferred due to unexpected volume"
        )));
        assert!(throttling(&r(451, [4, 7, 1], "Rate limit exceeded")));
        // About one session or one message: nothing to pause.
        assert!(!throttling(&r(
            421,
            [4, 4, 2],
            "mx.example Error: timeout exceeded"
        )));
        assert!(!throttling(&r(421, [0, 0, 0], "Error: timeout exceeded")));
        assert!(!throttling(&r(451, [4, 7, 1], "SPF temperror")));
        assert!(!throttling(&r(451, [4, 2, 2], "Mailbox quota exceeded")));
        assert!(throttling(&r(
            451,
            [4, 4, 5],
            "Congestion: timed out waiting for a queue slot"
        )));
    }

    #[test]
    fn a_421_never_reaches_the_client_as_421() {
        let e = RelayError::Refused(r(421, [4, 7, 0], "Too many messages"));
        let reply = client_reply(&e);
        assert_eq!((reply.code, reply.esc), (451, [4, 7, 0]));
        assert_eq!(reply.text, "Too many messages");
        let e = RelayError::Refused(r(550, [5, 1, 1], "No such user"));
        assert_eq!(client_reply(&e).code, 550);
        let lost = RelayError::Lost {
            after_dot: true,
            why: String::new(),
        };
        assert_eq!(client_reply(&lost).code, 451);
    }
}
