//! One inbound SMTP connection (RFC 5321 ESMTP with PIPELINING, SIZE,
//! 8BITMIME, SMTPUTF8, ENHANCEDSTATUSCODES, STARTTLS and AUTH PLAIN/LOGIN).
//!
//! A message transaction is one request for the admission layer: admitted
//! at MAIL FROM (at DATA with `cost = "recipients"`, when the count is
//! known), refused there with `451 4.7.0` before any body is sent, or held.
//! Its data is read in full while it waits (bounded by `max_message_size`
//! and the shared staging budget), and at its departure it is relayed; the
//! client is answered with the upstream's own reply to the end of data, so
//! sluice never says 250 for a message the upstream has not taken. A
//! client that goes away while held is withdrawn (its slot goes to the
//! next message) and nothing is relayed; one that goes away mid-relay,
//! before the end of data is sent, aborts the relay; after it, the relay
//! finishes and counts as what it was (the upstream may have taken it).
//!
//! Commands are parsed by smtp-proto (Stalwart's parser): line by line from
//! one input buffer that is never flushed, so pipelined commands are
//! answered in order (RFC 2920 3.2); replies are flushed before every read
//! and before every wait.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use smtp_proto::{
    AUTH_LOGIN, AUTH_PLAIN, MAIL_BODY_7BIT, MAIL_BODY_8BITMIME, MAIL_SMTPUTF8, MailFrom, RcptTo,
    Request,
};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::client::Envelope;
use super::data::DataReader;
use super::io::{InBuf, Stream};
use super::pool::{Pool, client_reply, throttled_error};
use super::reply::{self, Reply};
use super::{Front, Listener};
use crate::admission::{Hold, HoldError, Key, ReadDeadline, Room, Rule, Verdict, compose};
use crate::config::{MAX_HOLD, SmtpCost, SmtpKeyPart};
use crate::metrics::Outcome;

/// How long a session refused at the greeting (554) is kept for the
/// client's QUIT: kept for `idle_timeout` (5 minutes), outsiders could
/// hold the listener's sessions at a few connections a second (Postfix,
/// under stress, gives such clients 10 s too).
const REFUSED_FOR: Duration = Duration::from_secs(10);
/// The longest command line taken (RFC 5321 4.5.3.1.4 asks for 512; MAIL
/// with every extension's parameters can be longer).
const MAX_COMMAND_LINE: usize = 4096;
/// RFC 4954 4: an AUTH response line may be 12288 octets.
const MAX_AUTH_LINE: usize = 12_288;
/// Errors after which a client is sent away (Postfix's
/// `smtpd_hard_error_limit`).
const MAX_ERRORS: u32 = 20;
/// Commands that move no mail (NOOP, RSET, VRFY, EXPN, HELP) a client may
/// send before each further one counts as an error (Postfix's
/// `smtpd_junk_command_limit`): a client cannot hold a session for ever
/// by sending one now and then.
const MAX_JUNK: u32 = 100;
/// How soon after its last bytes (a pipelined QUIT) a client's close
/// must come to be taken for a half-close (see `watch`).
const HALF_CLOSE_WITH_QUIT: Duration = Duration::from_secs(2);
/// What a client may send ahead while its message is held, kept to be
/// answered in order; past it, sluice stops reading until it answers.
const MAX_AHEAD: usize = 64 * 1024;
/// How long a failed AUTH is answered late (slows guessing).
const AUTH_FAILURE_DELAY: Duration = Duration::from_secs(1);
/// RCPTs past `max_recipients` answered `452` before each further one
/// counts as an error (Postfix's `smtpd_recipient_overshoot_limit`): a
/// client told to send the rest later may pipeline them, but cannot keep a
/// transaction open for ever.
const MAX_OVERSHOOT: u32 = 1000;

/// Message ids for the trace header.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Why a session ends.
enum End {
    /// The client went away (or its connection broke).
    Gone,
    /// sluice ends it (QUIT, timeout, errors, shutdown, overload); the
    /// last reply is queued.
    Closed,
}

/// A message transaction between MAIL FROM and the end of data.
struct Tx {
    from: String,
    eightbit: bool,
    smtputf8: bool,
    rcpts: Vec<String>,
    key: Key,
    listener: Arc<Listener>,
    /// The admission's verdict, once asked.
    admitted: Option<Admitted>,
    /// When it was asked.
    admitted_at: Instant,
}

/// What the admission layer said of a transaction.
enum Admitted {
    /// Departed at once.
    Now(AtOnce),
    /// Waits for its departure.
    Held(Hold),
}

impl Admitted {
    fn new(hold: Option<Hold>, rule: &Arc<Rule>) -> Admitted {
        match hold {
            Some(hold) => Admitted::Held(hold),
            None => Admitted::Now(AtOnce(Some(rule.clone()))),
        }
    }

    /// Its outcome is counted elsewhere from now on: the hold, if it
    /// waits (to wait on or withdraw).
    fn settle(self) -> Option<Hold> {
        match self {
            Admitted::Held(hold) => Some(hold),
            Admitted::Now(mut at_once) => {
                at_once.0 = None;
                None
            }
        }
    }
}

/// A transaction that departed at once, until its outcome is counted:
/// dropped before (RSET, EHLO, QUIT, a timeout, the client gone before
/// its data was in), it counts as cancelled, as a held one's dropped hold
/// does; every arrival gets an outcome.
struct AtOnce(Option<Arc<Rule>>);

impl Drop for AtOnce {
    fn drop(&mut self) {
        if let Some(rule) = self.0.take() {
            rule.count(Outcome::Cancelled);
        }
    }
}

impl Tx {
    /// What it costs: 1, or its recipients with `cost = "recipients"`
    /// (asked at DATA, when they are known).
    fn cost(&self) -> u32 {
        match self.listener.cfg.cost {
            SmtpCost::Message => 1,
            SmtpCost::Recipients => u32::try_from(self.rcpts.len()).unwrap_or(u32::MAX),
        }
    }
}

struct Session {
    front: Arc<Front>,
    listener: Arc<Listener>,
    peer: SocketAddr,
    stream: Stream,
    inbuf: InBuf,
    out: Vec<u8>,
    /// The HELO/EHLO name; `None` before (and after STARTTLS).
    helo: Option<String>,
    /// EHLO (not HELO): enhanced status codes were offered.
    esmtp: bool,
    /// The user that authenticated.
    user: Option<String>,
    tx: Option<Tx>,
    /// The last MAIL was refused: the RCPTs and DATA a client pipelined
    /// behind it (this many at most: `max_recipients` and a DATA) are
    /// answered "need MAIL" without counting as errors (a rate-limit
    /// answer to MAIL is routine, and with 19 recipients its 503s alone
    /// reached [`MAX_ERRORS`]). Ends at the next MAIL, RSET, EHLO or HELO.
    excused: usize,
    /// A message is being read or relayed (its transaction is out of
    /// `tx` meanwhile).
    in_data: bool,
    errors: u32,
    /// Commands that moved no mail (see [`MAX_JUNK`]).
    junk: u32,
    /// RCPTs past `max_recipients` (see [`MAX_OVERSHOOT`]).
    overshoot: u32,
    /// The session ends by then whatever the client sends (421 4.4.2):
    /// set for a client refused at its greeting.
    ends_by: Option<Instant>,
    /// Discarding the rest of an over-long line.
    skipping: bool,
    stop: CancellationToken,
}

/// Serve one connection until it ends.
pub(super) async fn serve(
    front: Arc<Front>,
    listener: Arc<Listener>,
    tcp: TcpStream,
    peer: SocketAddr,
    stop: CancellationToken,
) {
    let _ = tcp.set_nodelay(true);
    let mut s = Session {
        front,
        listener,
        peer,
        stream: Stream::Plain(tcp),
        inbuf: InBuf::default(),
        out: Vec::new(),
        helo: None,
        esmtp: false,
        user: None,
        tx: None,
        excused: 0,
        in_data: false,
        errors: 0,
        junk: 0,
        overshoot: 0,
        ends_by: None,
        skipping: false,
        stop,
    };
    let listener = s.listener.clone();
    let cfg = &listener.cfg;
    let allowed = cfg.allows(peer.ip());
    if !allowed && cfg.auth.is_none() {
        debug!(%peer, listener = %cfg.name, "relay access denied");
        s.say(&Reply::owned(
            554,
            [0, 0, 0],
            format!("{} {}", cfg.hostname, reply::RELAY_DENIED.text),
        ));
        s.refused().await;
    } else {
        s.say(&Reply::owned(
            220,
            [0, 0, 0],
            format!("{} ESMTP sluice", cfg.hostname),
        ));
        match s.run().await {
            End::Gone => debug!(%peer, "client went away"),
            End::Closed => {}
        }
    }
    let _ = s.flush().await;
    let _ = tokio::time::timeout(Duration::from_secs(1), s.stream.shutdown()).await;
}

impl Session {
    /// Queue a reply.
    fn say(&mut self, r: &Reply) {
        r.write(&mut self.out, self.esmtp);
    }

    /// A protocol error: answered, counted; too many end the session.
    fn error(&mut self, r: &Reply) -> Result<(), End> {
        self.say(r);
        self.count_error()
    }

    /// A command that moves no mail: answered; past [`MAX_JUNK`] of them,
    /// each counts as an error.
    fn junk(&mut self, r: &Reply) -> Result<(), End> {
        self.say(r);
        self.count_junk()
    }

    fn count_junk(&mut self) -> Result<(), End> {
        self.junk = self.junk.saturating_add(1);
        if self.junk > MAX_JUNK {
            return self.count_error();
        }
        Ok(())
    }

    /// RCPT or DATA with no transaction open.
    fn need_mail(&mut self) -> Result<(), End> {
        if self.excused > 0 {
            self.excused -= 1;
            self.say(&reply::NEED_MAIL);
            return Ok(());
        }
        self.error(&reply::NEED_MAIL)
    }

    fn count_error(&mut self) -> Result<(), End> {
        self.errors += 1;
        if self.errors >= MAX_ERRORS {
            self.say(&reply::TOO_MANY_ERRORS);
            return Err(End::Closed);
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), End> {
        if self.out.is_empty() {
            return Ok(());
        }
        let timeout = self.listener.cfg.idle_timeout;
        // Flushed: over TLS a write ends once rustls holds the bytes, and
        // what the socket had no room for would wait there while the
        // session waits for the client, which waits for these replies.
        let written = tokio::time::timeout(timeout, async {
            self.stream.write_all(&self.out).await?;
            self.stream.flush().await
        })
        .await;
        self.out.clear();
        match written {
            Ok(Ok(())) => Ok(()),
            _ => Err(End::Gone),
        }
    }

    /// Flush, then read more input; ends the session at the client's end,
    /// at `deadline` (421 4.4.2), or at shutdown (while no message is in
    /// hand; when the drain gives up, always).
    async fn read_more(&mut self, deadline: Instant) -> Result<(), End> {
        self.flush().await?;
        let closing = self.front.admission.closing().clone();
        let idle_only = self.tx.is_none() && !self.in_data;
        tokio::select! {
            n = self.inbuf.fill(&mut self.stream) => match n {
                Ok(0) | Err(_) => Err(End::Gone),
                Ok(_) => Ok(()),
            },
            () = tokio::time::sleep_until(deadline.into()) => {
                self.say(&reply::TIMEOUT);
                Err(End::Closed)
            }
            () = self.stop.cancelled(), if idle_only => {
                self.say(&reply::SHUTTING_DOWN);
                Err(End::Closed)
            }
            () = closing.cancelled() => {
                self.say(&reply::SHUTTING_DOWN);
                Err(End::Closed)
            }
        }
    }

    /// The next line (with its line end), at most `max` bytes; a longer
    /// one is answered `500 5.5.2` and skipped.
    async fn line(&mut self, max: usize, too_long: &Reply) -> Result<Vec<u8>, End> {
        loop {
            if let Some(line) = self.line_within(max, too_long).await? {
                return Ok(line);
            }
        }
    }

    /// The next line, or `None` once a line longer than `max` was
    /// answered `too_long` (the rest of it is skipped before the next).
    /// The whole line must come within `idle_timeout` of the wait for it
    /// (Postfix's `smtpd_per_request_deadline`): a byte now and then does
    /// not keep a session.
    async fn line_within(&mut self, max: usize, too_long: &Reply) -> Result<Option<Vec<u8>>, End> {
        let mut deadline = Instant::now() + self.listener.cfg.idle_timeout;
        if let Some(end) = self.ends_by {
            deadline = deadline.min(end);
        }
        loop {
            let unread = self.inbuf.unread();
            let lf = unread.iter().position(|&b| b == b'\n');
            if self.skipping {
                match lf {
                    Some(i) => {
                        self.inbuf.consume(i + 1);
                        self.skipping = false;
                    }
                    None => self.inbuf.discard(),
                }
                if self.skipping {
                    self.read_more(deadline).await?;
                }
                continue;
            }
            match lf {
                Some(i) if i < max => {
                    let line = unread[..=i].to_vec();
                    self.inbuf.consume(i + 1);
                    return Ok(Some(line));
                }
                Some(i) => {
                    self.inbuf.consume(i + 1);
                    self.error(too_long)?;
                    return Ok(None);
                }
                None if unread.len() >= max => {
                    self.inbuf.discard();
                    self.skipping = true;
                    self.error(too_long)?;
                    return Ok(None);
                }
                None => self.read_more(deadline).await?,
            }
        }
    }

    async fn run(&mut self) -> End {
        loop {
            let line = match self.line(MAX_COMMAND_LINE, &reply::LINE_TOO_LONG).await {
                Ok(l) => l,
                Err(end) => return end,
            };
            let parsed = match Request::parse(&mut line.iter()).map(Request::into_owned) {
                // The parser gives `<>` and `<postmaster>` alike; only the
                // second is a recipient (RFC 5321 4.1.1.3).
                Ok(Request::Rcpt { to }) if to.address.is_empty() && !names_postmaster(&line) => {
                    Err(smtp_proto::Error::InvalidRecipientAddress)
                }
                // A reverse-path is `<>` or a mailbox with a domain: a
                // `<postmaster>` sender would go upstream as the null
                // sender (no bounces).
                Ok(Request::Mail { from })
                    if from.address.is_empty() && names_postmaster(&line) =>
                {
                    Err(smtp_proto::Error::InvalidSenderAddress)
                }
                other => other,
            };
            let step = match parsed {
                Ok(request) => self.command(request).await,
                Err(e) => self.parse_error(e),
            };
            if let Err(end) = step {
                return end;
            }
        }
    }

    /// After a `554` greeting: every command but QUIT is answered `503`
    /// until the client quits (RFC 5321 3.1), [`REFUSED_FOR`] (or
    /// `idle_timeout`, if shorter) has passed since the greeting, or its
    /// errors pass the limit.
    async fn refused(&mut self) {
        let lasts = self.listener.cfg.idle_timeout.min(REFUSED_FOR);
        self.ends_by = Some(Instant::now() + lasts);
        loop {
            let Ok(line) = self.line(MAX_COMMAND_LINE, &reply::LINE_TOO_LONG).await else {
                return;
            };
            if matches!(Request::parse(&mut line.iter()), Ok(Request::Quit)) {
                self.say(&reply::BYE);
                return;
            }
            if self.error(&reply::REFUSED_SESSION).is_err() {
                return;
            }
        }
    }

    fn parse_error(&mut self, e: smtp_proto::Error) -> Result<(), End> {
        use smtp_proto::Error as E;
        let r = match e {
            E::UnknownCommand | E::NeedsMoreData { .. } => reply::UNKNOWN_COMMAND,
            E::InvalidSenderAddress => reply::BAD_SENDER,
            E::InvalidRecipientAddress => reply::BAD_RECIPIENT,
            E::SyntaxError { syntax } => {
                Reply::owned(501, [5, 5, 4], format!("Syntax error, expected: {syntax}"))
            }
            E::InvalidParameter { param } => {
                Reply::owned(501, [5, 5, 4], format!("Invalid {param} parameter"))
            }
            E::UnsupportedParameter { .. } => reply::UNSUPPORTED_PARAMETER,
            E::ResponseTooLong => reply::LINE_TOO_LONG,
            E::InvalidResponse { .. } => reply::SYNTAX,
        };
        self.error(&r)
    }

    async fn command(&mut self, request: Request<String>) -> Result<(), End> {
        match request {
            Request::Ehlo { host } => {
                self.tx = None;
                self.excused = 0;
                self.helo = Some(host);
                self.esmtp = true;
                let ehlo = self.ehlo_reply();
                // The EHLO reply carries no enhanced code.
                ehlo.write(&mut self.out, false);
                // Counted like NOOP: a client repeating it now and then
                // cannot hold a session for ever.
                self.count_junk()?;
            }
            Request::Helo { host } => {
                self.tx = None;
                self.excused = 0;
                self.helo = Some(host);
                self.esmtp = false;
                let name = self.listener.cfg.hostname.clone();
                self.say(&Reply::owned(250, [0, 0, 0], name));
                self.count_junk()?;
            }
            Request::Mail { from } => self.mail(from).await?,
            Request::Rcpt { to } => self.rcpt(to)?,
            Request::Data => self.data().await?,
            Request::Rset => {
                self.tx = None;
                self.excused = 0;
                self.junk(&reply::OK)?;
            }
            Request::Noop { .. } => self.junk(&reply::OK)?,
            Request::Quit => {
                // An open transaction ends here (counted now, not when
                // the connection is gone).
                self.tx = None;
                self.say(&reply::BYE);
                return Err(End::Closed);
            }
            Request::Vrfy { .. } => self.junk(&reply::VRFY_REFUSED)?,
            Request::Expn { .. } => self.junk(&reply::EXPN_REFUSED)?,
            Request::Help { .. } => self.junk(&reply::HELP)?,
            Request::StartTls => self.starttls().await?,
            Request::Auth {
                mechanism,
                initial_response,
            } => self.auth(mechanism, initial_response).await?,
            Request::Lhlo { .. } => self.error(&reply::UNKNOWN_COMMAND)?,
            Request::Bdat { .. }
            | Request::Etrn { .. }
            | Request::Atrn { .. }
            | Request::Burl { .. } => self.error(&reply::NOT_IMPLEMENTED)?,
        }
        Ok(())
    }

    fn tls_offered(&self) -> bool {
        self.listener.acceptor.is_some() && !self.stream.is_tls()
    }

    /// AUTH is offered over TLS, or to a client on this machine.
    fn auth_offered(&self) -> bool {
        self.listener.cfg.auth.is_some() && (self.stream.is_tls() || self.peer.ip().is_loopback())
    }

    fn ehlo_reply(&self) -> Reply {
        let cfg = &self.listener.cfg;
        let mut lines = vec![
            format!(
                "{} greets {}",
                cfg.hostname,
                self.helo.as_deref().unwrap_or("")
            ),
            "PIPELINING".to_owned(),
            format!("SIZE {}", cfg.max_message_size),
            "8BITMIME".to_owned(),
            "SMTPUTF8".to_owned(),
            "ENHANCEDSTATUSCODES".to_owned(),
        ];
        if self.tls_offered() {
            lines.push("STARTTLS".to_owned());
        }
        if self.auth_offered() {
            lines.push("AUTH PLAIN LOGIN".to_owned());
        }
        lines.push("HELP".to_owned());
        Reply::owned(250, [0, 0, 0], lines.join("\n"))
    }

    async fn mail(&mut self, from: MailFrom<String>) -> Result<(), End> {
        if self.helo.is_none() {
            return self.error(&reply::NEED_HELO);
        }
        if self.tx.is_some() {
            // The open transaction goes on: its RCPTs are its own.
            return self.error(&reply::NESTED_MAIL);
        }
        // Until this MAIL opens its transaction.
        self.excused = self.listener.cfg.max_recipients.saturating_add(1);
        self.refresh_listener()?;
        let listener = self.listener.clone();
        let cfg = &listener.cfg;
        if cfg.require_tls && !self.stream.is_tls() {
            return self.error(&reply::TLS_REQUIRED);
        }
        // A user a reload took out of `auth_file` authenticates again
        // (and fails).
        if let (Some(users), Some(user)) = (&cfg.auth, &self.user)
            && !users.knows(user)
        {
            self.user = None;
        }
        if cfg.auth.is_some() && self.user.is_none() {
            return self.error(&reply::AUTH_REQUIRED);
        }
        // Who may relay without AUTH, as the listener says now: greeted
        // when `auth_file` let anyone in, or from an address a reload took
        // out of `allow_from`, a connection kept open was an open relay.
        if cfg.auth.is_none() && !cfg.allows(self.peer.ip()) {
            return self.error(&reply::RELAY_DENIED);
        }
        let known = MAIL_BODY_7BIT | MAIL_BODY_8BITMIME | MAIL_SMTPUTF8;
        let extra = from.flags & !known != 0
            || from.env_id.is_some()
            || from.trans_id.is_some()
            || from.solicit.is_some()
            || from.mtrk.is_some()
            || from.by != 0
            || from.hold_for != 0
            || from.hold_until != 0
            || from.mt_priority != 0;
        if extra || (!self.esmtp && from.flags != 0) {
            return self.error(&reply::UNSUPPORTED_PARAMETER);
        }
        if !sound_address(&from.address) {
            return self.error(&reply::BAD_SENDER);
        }
        if !from.address.is_ascii() && from.flags & MAIL_SMTPUTF8 == 0 {
            return self.error(&reply::UTF8_UNDECLARED);
        }
        if from.size > cfg.max_message_size {
            return self.error(&reply::TOO_BIG);
        }
        let key = self.key(&from.address);
        let mut tx = Tx {
            from: from.address,
            eightbit: from.flags & MAIL_BODY_8BITMIME != 0,
            smtputf8: from.flags & MAIL_SMTPUTF8 != 0,
            rcpts: Vec::new(),
            key,
            listener: self.listener.clone(),
            admitted: None,
            admitted_at: Instant::now(),
        };
        if cfg.cost == SmtpCost::Message {
            match self.admit(&tx).await? {
                Some(hold) => tx.admitted = Some(Admitted::new(hold, &tx.listener.rule)),
                // Refused for the rate (answered): it moved no mail.
                None => return self.count_junk(),
            }
        }
        self.tx = Some(tx);
        self.excused = 0;
        self.say(&reply::SENDER_OK);
        Ok(())
    }

    /// The client key of a transaction from `sender`.
    fn key(&self, sender: &str) -> Key {
        let sender = sender.to_lowercase();
        let domain = match sender.rsplit_once('@') {
            Some((_, d)) => d,
            None => "",
        };
        let shown = |s: &str| {
            if s.is_empty() {
                b"<>".to_vec()
            } else {
                s.as_bytes().to_vec()
            }
        };
        let user = self.user.clone().unwrap_or_default();
        let peer = self.peer.ip();
        compose(&self.listener.cfg.key, |part, out| {
            match part {
                SmtpKeyPart::Global => {}
                SmtpKeyPart::Ip => out.ip(peer),
                SmtpKeyPart::Sender => out.text(&shown(&sender)),
                SmtpKeyPart::SenderDomain => out.text(&shown(domain)),
                SmtpKeyPart::Auth => out.text(user.as_bytes()),
            }
            Ok::<(), ()>(())
        })
        .unwrap_or_else(|()| Key::new(b""))
    }

    /// Ask the admission layer for a message of `cost`: `Some(None)` goes
    /// now, `Some(Some(hold))` waits, `None` was refused (answered).
    async fn admit(&mut self, tx: &Tx) -> Result<Option<Option<Hold>>, End> {
        // Replies so far go out before a wait on the shared schedule.
        self.flush().await?;
        let rule = &tx.listener.rule;
        match self
            .front
            .admission
            .admit(rule, tx.key.clone(), tx.cost(), Instant::now())
            .await
        {
            Verdict::Go => Ok(Some(None)),
            Verdict::Wait(hold) => Ok(Some(Some(hold))),
            Verdict::Refused { retry_after, .. } => {
                let secs = retry_after.as_secs_f64().ceil().max(1.0);
                self.say(&Reply::owned(
                    451,
                    [4, 7, 0],
                    format!(
                        "Rate limited: too much mail waiting for '{}'; try again in {secs:.0} seconds",
                        tx.listener.cfg.name
                    ),
                ));
                Ok(None)
            }
            Verdict::Overloaded(_) => {
                self.say(&reply::OVERLOADED);
                Err(End::Closed)
            }
        }
    }

    fn rcpt(&mut self, to: RcptTo<String>) -> Result<(), End> {
        // Costed by recipients, a message of more than `capacity` could
        // only go from an idle queue (451 at DATA otherwise, again on
        // every retry on a busy key): the client is told 452 at the
        // recipient past it and sends the rest in a further transaction.
        let cfg = &self.listener.cfg;
        let max = match cfg.cost {
            // (`capacity = 0`: nothing waits, any cost goes from an idle
            // queue alone.)
            SmtpCost::Recipients if cfg.capacity > 0 => cfg
                .max_recipients
                .min(usize::try_from(cfg.capacity).unwrap_or(usize::MAX)),
            SmtpCost::Recipients | SmtpCost::Message => cfg.max_recipients,
        };
        let Some(tx) = self.tx.as_mut() else {
            return self.need_mail();
        };
        if to.orcpt.is_some() || to.flags != 0 || to.rrvs != 0 {
            return self.error(&reply::UNSUPPORTED_PARAMETER);
        }
        if !sound_address(&to.address) {
            return self.error(&reply::BAD_RECIPIENT);
        }
        if !to.address.is_ascii() && !tx.smtputf8 {
            return self.error(&reply::UTF8_UNDECLARED);
        }
        if tx.rcpts.len() >= max {
            self.say(&reply::TOO_MANY_RECIPIENTS);
            self.overshoot = self.overshoot.saturating_add(1);
            if self.overshoot > MAX_OVERSHOOT {
                return self.count_error();
            }
            return Ok(());
        }
        // `<postmaster>` comes out of the parser empty.
        let address = if to.address.is_empty() {
            "postmaster".to_owned()
        } else {
            to.address
        };
        tx.rcpts.push(address);
        self.say(&reply::RECIPIENT_OK);
        Ok(())
    }

    async fn data(&mut self) -> Result<(), End> {
        let Some(mut tx) = self.tx.take() else {
            return self.need_mail();
        };
        if tx.rcpts.is_empty() {
            self.tx = Some(tx);
            return self.error(&reply::NEED_RCPT);
        }
        if tx.admitted.is_none() {
            tx.admitted_at = Instant::now();
            match self.admit(&tx).await? {
                Some(hold) => tx.admitted = Some(Admitted::new(hold, &tx.listener.rule)),
                // Refused: the transaction is over, the client starts
                // again. It moved no mail.
                None => return self.count_junk(),
            }
        }
        // The message is read while it waits (a client gone meanwhile
        // drops the transaction, and its hold with it).
        self.say(&reply::START_DATA);
        self.in_data = true;
        let answer = self.take_message(tx).await;
        self.in_data = false;
        let answer = answer?;
        if answer.is_positive() {
            // Errors and junk count until mail is delivered (Postfix's
            // `smtpd_hard_error_limit` and `smtpd_junk_command_limit`): a
            // long-lived connection is not closed for those of its
            // earlier transactions.
            self.errors = 0;
            self.junk = 0;
            self.overshoot = 0;
        }
        self.say(&answer);
        Ok(())
    }

    /// Read the message and relay it at its departure: the answer to its
    /// end of data.
    async fn take_message(&mut self, mut tx: Tx) -> Result<Reply, End> {
        let max = self.listener.cfg.max_message_size;
        let (message, room) = match self.read_data(max).await? {
            Ok(m) => m,
            Err(refusal) => {
                if let Some(hold) = tx.admitted.take().and_then(Admitted::settle) {
                    hold.withdraw();
                }
                // No room to hold it is an overload, not the client's
                // fault.
                let outcome = if refusal.code == reply::NO_STORAGE.code {
                    Outcome::Overloaded
                } else {
                    Outcome::Invalid
                };
                tx.listener.rule.count(outcome);
                return Ok(refusal);
            }
        };
        self.deliver(tx, message, room).await
    }

    /// Read the message to its end of data: the message with a trace
    /// header, and the room it holds; or, for one over `max` or the
    /// staging budget, the refusal (after its end, as RFC 1870 wants).
    async fn read_data(&mut self, max: usize) -> Result<Result<(Vec<u8>, Room), Reply>, End> {
        // The message is read in after its trace header: one copy, all of
        // it counted in the staging budget.
        let mut message = self.trace_header().into_bytes();
        let trace_len = message.len();
        let mut rx = DataReader::new();
        let mut room = self.front.budget.room();
        let mut refused: Option<Reply> = None;
        // A message must come within `idle_timeout`, then at
        // MIN_DATA_RATE on average (Postfix's `smtpd_min_data_rate`).
        let mut deadline = ReadDeadline::new(Instant::now(), self.listener.cfg.idle_timeout);
        // The message's room grows by doubling, as a Vec's would, but
        // never past the largest message: left to itself it doubled past
        // it, and a message was charged up to twice its size (one of
        // `max_message_size` could not be held in a budget of that size).
        // One byte past it is refused. The trace header's room (a few
        // hundred bytes) is not charged, so that a budget of
        // `max_message_size` holds a message that size, as `check` says.
        let limit = trace_len.saturating_add(max).saturating_add(1);
        loop {
            let mut unread = self.inbuf.unread();
            if refused.is_none() {
                // What is taken of the input at once adds no more than its
                // length (unstuffing only removes), and no more than up to
                // the limit, so the room never grows on its own.
                // (At least a byte: past the limit is refused below.)
                let room = limit.saturating_sub(message.len()).max(1);
                unread = &unread[..unread.len().min(room)];
                let want = message.len() + unread.len();
                if want > message.capacity() {
                    let to = want.max(message.capacity().saturating_mul(2)).min(limit);
                    message.reserve_exact(to - message.len());
                }
            }
            let sink = refused.is_none().then_some(&mut message);
            let used = rx.ingest(unread, sink);
            self.inbuf.consume(used);
            deadline.read(used, Instant::now());
            if refused.is_none() {
                let why = if message.len().saturating_sub(trace_len) > max {
                    Some(reply::TOO_BIG)
                } else if !room.grow_to(message.capacity().min(max)) {
                    Some(reply::NO_STORAGE)
                } else {
                    None
                };
                if let Some(why) = why {
                    // What it held goes back now: the rest is only read
                    // to its end and dropped (a client sending an
                    // over-size message slowly kept room others need).
                    message = Vec::new();
                    room.set_to(0);
                    refused = Some(why);
                }
            }
            if rx.done() {
                break;
            }
            if self.inbuf.unread().is_empty() {
                self.read_more(deadline.at()).await?;
            }
        }
        if let Some(why) = refused {
            return Ok(Err(why));
        }
        Ok(Ok((message, room)))
    }

    /// The `Received:` line a relay puts before the message (RFC 5321
    /// 4.4).
    fn trace_header(&self) -> String {
        let with = match (self.esmtp, self.stream.is_tls(), self.user.is_some()) {
            (false, _, _) => "SMTP",
            (true, false, false) => "ESMTP",
            (true, true, false) => "ESMTPS",
            (true, false, true) => "ESMTPA",
            (true, true, true) => "ESMTPSA",
        };
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        let date = httpdate::fmt_http_date(std::time::SystemTime::now()).replace(" GMT", " +0000");
        let helo: String = self
            .helo
            .as_deref()
            .unwrap_or("unknown")
            .chars()
            .filter(|c| !c.is_control())
            // 7-bit, as the header goes to upstreams without SMTPUTF8 or
            // 8BITMIME too.
            .map(|c| if c.is_ascii_graphic() { c } else { '?' })
            .take(255)
            .collect();
        // RFC 5321 4.1.3: an IPv6 address literal is tagged.
        let ip = match self.peer.ip() {
            std::net::IpAddr::V4(v4) => v4.to_string(),
            std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
                Some(v4) => v4.to_string(),
                None => format!("IPv6:{v6}"),
            },
        };
        format!(
            "Received: from {helo} ([{ip}])\r\n\tby {} (sluice) with {with} id {id:x};\r\n\t{date}\r\n",
            self.listener.cfg.hostname,
        )
    }

    /// Wait for the message's departure, then relay it; the reply for the
    /// client. Watches the client all along: gone before the end of data
    /// is relayed, nothing is relayed.
    async fn deliver(&mut self, tx: Tx, message: Vec<u8>, room: Room) -> Result<Reply, End> {
        let data_end = Instant::now();
        let cost = tx.cost();
        let Tx {
            from,
            eightbit,
            smtputf8,
            rcpts,
            key,
            listener,
            admitted,
            admitted_at,
        } = tx;
        // From here every way out counts its outcome itself.
        let admitted = admitted.and_then(Admitted::settle);
        let rule = listener.rule.clone();
        let mut slot = admitted_at;
        if let Some(mut hold) = admitted {
            slot = hold.departure().unwrap_or(slot);
            self.flush().await?;
            let waited = tokio::select! {
                w = hold.wait() => w,
                () = watch(&mut self.inbuf, &mut self.stream, data_end) => {
                    // The dropped hold withdraws the message, counted as
                    // cancelled; its slot goes to the next in line.
                    drop(hold);
                    return Err(End::Gone);
                }
            };
            match waited {
                Ok(()) => {}
                Err(HoldError::Expired) => return Ok(reply::EXPIRED),
                Err(HoldError::Closed) => {
                    self.say(&reply::SHUTTING_DOWN);
                    return Err(End::Closed);
                }
            }
        }
        // A message whose data came after its slot starts late: the next
        // one of this client keeps c·T/2 from it (DESIGN 1's late
        // releases), instead of following at once; under an upstream cap,
        // the next one to the upstream c/(2R); none starts while the
        // upstream is paused.
        // It starts in time for its whole relay to end by the answer's
        // deadline (MAX_HOLD after the end of data, inside the client's 10
        // minutes), or not at all.
        let admission = &self.front.admission;
        let pool = listener.pool.clone();
        let latest = (data_end + MAX_HOLD)
            .checked_sub(pool.config().relay_timeout)
            .unwrap_or(data_end);
        let spaced = admission.space_relay(&rule, &key, cost, slot, latest);
        tokio::select! {
            in_time = spaced => if !in_time {
                rule.count(Outcome::Expired);
                return Ok(reply::PAUSED_TOO_LONG);
            },
            () = watch(&mut self.inbuf, &mut self.stream, data_end) => {
                rule.count(Outcome::Cancelled);
                return Err(End::Gone);
            }
            () = admission.closing().cancelled() => {}
        }
        // The drain gave up: no relay starts now (one cut short by the
        // exit after its end of data could be delivered twice).
        if admission.closing().is_cancelled() {
            // As a held one the drain ends is counted.
            rule.count(Outcome::Expired);
            self.say(&reply::SHUTTING_DOWN);
            return Err(End::Closed);
        }
        let env = Envelope {
            from,
            eightbit,
            smtputf8,
            rcpts,
            committed: AtomicBool::new(false),
            reply_by: data_end + MAX_HOLD,
        };
        let deadline = Instant::now() + pool.config().relay_timeout;
        let relay = pool.send(&env, &message, deadline);
        tokio::pin!(relay);
        let closing = admission.closing();
        let relayed = tokio::select! {
            r = &mut relay => Some(r),
            () = watch(&mut self.inbuf, &mut self.stream, data_end) => None,
            // The drain gives up while the relay waits for a connection
            // (every one of `max_connections` busy) or sends the envelope:
            // it is dropped, as one not started. One past its end of data
            // finishes.
            () = closing.cancelled() => {
                if !env.committed.load(Ordering::Relaxed) {
                    rule.count(Outcome::Expired);
                    self.say(&reply::SHUTTING_DOWN);
                    return Err(End::Closed);
                }
                Some((&mut relay).await)
            }
        };
        let gone = relayed.is_none();
        let relayed = match relayed {
            Some(r) => r,
            // Dropping the relay closes its upstream session: a message
            // whose end of data was not sent is not taken.
            None if !env.committed.load(Ordering::Relaxed) => {
                rule.count(Outcome::Cancelled);
                return Err(End::Gone);
            }
            // The end of data is on its way: the upstream may take the
            // message whatever happens now, so the relay finishes (within
            // its deadline) and counts as what it was.
            None => relay.await,
        };
        drop(room);
        let reply = self.outcome(&rule, &listener, &pool, relayed);
        if gone { Err(End::Gone) } else { Ok(reply) }
    }

    /// Count, log and answer a relay's result.
    fn outcome(
        &self,
        rule: &Rule,
        listener: &Listener,
        pool: &Pool,
        relayed: Result<Reply, super::client::RelayError>,
    ) -> Reply {
        match relayed {
            Ok(r) => {
                rule.count(Outcome::Forwarded);
                info!(
                    listener = %listener.cfg.name,
                    upstream = %pool.config().name,
                    code = r.code,
                    reply = %r.text,
                    "relayed"
                );
                r
            }
            Err(e) => {
                // A refused session (its greeting, EHLO or AUTH: a wrong
                // password, say) fails every message alike: an upstream
                // error, not a message the upstream answered. A message
                // the upstream cannot take as it is (past the SIZE it
                // offers, 8-bit to a 7-bit one) never reached it: refused
                // as the client sent it.
                use super::client::RelayError::{Incapable, Refused};
                let answered = matches!(e, Refused(_) | Incapable(_));
                rule.count(match e {
                    Refused(_) => Outcome::Forwarded,
                    Incapable(_) => Outcome::Invalid,
                    _ => Outcome::UpstreamError,
                });
                if throttled_error(&e) {
                    let pause = pool.config().throttle_pause;
                    self.front.admission.pause(rule, Instant::now() + pause);
                    warn!(
                        upstream = %pool.config().name,
                        pause = %humantime::format_duration(pause),
                        error = %e,
                        "the upstream is throttling: releases to it are paused"
                    );
                } else if answered {
                    debug!(upstream = %pool.config().name, error = %e, "relay refused");
                } else {
                    warn!(upstream = %pool.config().name, error = %e, "relay failed");
                }
                client_reply(&e)
            }
        }
    }

    async fn starttls(&mut self) -> Result<(), End> {
        if !self.tls_offered() {
            return self.error(&reply::NOT_IMPLEMENTED);
        }
        if self.tx.is_some() {
            return self.error(&reply::IN_TRANSACTION);
        }
        let Some(acceptor) = self.listener.acceptor.clone() else {
            return self.error(&reply::TLS_UNAVAILABLE);
        };
        self.say(&reply::TLS_READY);
        self.flush().await?;
        // RFC 3207 4.2: what the client sent before the handshake must
        // not be acted on.
        self.inbuf.discard();
        let timeout = self.listener.cfg.idle_timeout;
        match tokio::time::timeout(timeout, self.stream.accept_tls(&acceptor)).await {
            Ok(Ok(())) => {}
            _ => return Err(End::Gone),
        }
        // Everything learned before TLS is forgotten.
        self.helo = None;
        self.esmtp = false;
        self.user = None;
        Ok(())
    }

    /// Take the listener's policy as it is now: each transaction and each
    /// AUTH uses it (a reload applies to kept-open connections too).
    fn refresh_listener(&mut self) -> Result<(), End> {
        match self.front.listener(&self.listener.cfg.name) {
            Some(l) => {
                self.listener = l;
                Ok(())
            }
            None => {
                self.say(&reply::SHUTTING_DOWN);
                Err(End::Closed)
            }
        }
    }

    async fn auth(&mut self, mechanism: u64, initial: String) -> Result<(), End> {
        self.refresh_listener()?;
        let Some(credentials) = self.listener.cfg.auth.clone() else {
            return self.error(&reply::NOT_IMPLEMENTED);
        };
        if self.helo.is_none() || !self.esmtp {
            return self.error(&reply::NEED_HELO);
        }
        if self.user.is_some() {
            return self.error(&reply::ALREADY_AUTHENTICATED);
        }
        if self.tx.is_some() {
            return self.error(&reply::IN_TRANSACTION);
        }
        if !self.auth_offered() {
            return self.error(&reply::AUTH_NEEDS_TLS);
        }
        let pair = match mechanism {
            AUTH_PLAIN => {
                let token = match initial.as_str() {
                    "" => self.challenge("").await?,
                    "=" => Some(Vec::new()),
                    t => self.decoded(t)?,
                };
                let Some(token) = token else {
                    return Ok(());
                };
                // authzid NUL authcid NUL password (RFC 4616). An authzid
                // other than the user asks to act as someone else, which
                // sluice grants nobody: it fails (RFC 4616 2).
                let mut parts = token.split(|&b| b == 0);
                match (parts.next(), parts.next(), parts.next(), parts.next()) {
                    (Some(authzid), Some(user), Some(password), None) => (
                        user.to_vec(),
                        password.to_vec(),
                        authzid.is_empty() || authzid == user,
                    ),
                    _ => return self.error(&reply::AUTH_BAD_BASE64),
                }
            }
            AUTH_LOGIN => {
                let user = match initial.as_str() {
                    "" => self.challenge("VXNlcm5hbWU6").await?,
                    t => self.decoded(t)?,
                };
                let Some(user) = user else {
                    return Ok(());
                };
                let Some(password) = self.challenge("UGFzc3dvcmQ6").await? else {
                    return Ok(());
                };
                (user, password, true)
            }
            _ => return self.error(&reply::AUTH_MECHANISM),
        };
        let (user, password, as_self) = pair;
        let user = String::from_utf8_lossy(&user).into_owned();
        if credentials.check(&user, &password) && as_self {
            info!(peer = %self.peer, %user, "authenticated");
            self.user = Some(user);
            self.say(&reply::AUTH_OK);
            Ok(())
        } else {
            warn!(peer = %self.peer, ?user, "authentication failed");
            self.flush().await?;
            tokio::time::sleep(AUTH_FAILURE_DELAY).await;
            self.error(&reply::AUTH_FAILED)
        }
    }

    /// Send a `334` challenge and read the answer: its decoded bytes, or
    /// `None` when it was cancelled or undecodable (answered).
    async fn challenge(&mut self, text: &'static str) -> Result<Option<Vec<u8>>, End> {
        self.say(&Reply::new(334, [0, 0, 0], text));
        // A response too long ends the exchange (RFC 4954 4): the next
        // line is a command again.
        let Some(line) = self
            .line_within(MAX_AUTH_LINE, &reply::AUTH_LINE_TOO_LONG)
            .await?
        else {
            return Ok(None);
        };
        let answer = String::from_utf8_lossy(&line);
        let answer = answer.trim_end_matches(['\r', '\n']);
        if answer == "*" {
            self.error(&reply::AUTH_CANCELLED)?;
            return Ok(None);
        }
        self.decoded(answer)
    }

    /// `text` decoded from base64, or `None` (answered) when it is not.
    fn decoded(&mut self, text: &str) -> Result<Option<Vec<u8>>, End> {
        match decode(text) {
            Some(bytes) => Ok(Some(bytes)),
            None => {
                self.error(&reply::AUTH_BAD_BASE64)?;
                Ok(None)
            }
        }
    }
}

fn decode(text: &str) -> Option<Vec<u8>> {
    BASE64.decode(text.trim()).ok()
}

/// Resolve when the client has gone away. What it sends meanwhile (its
/// next pipelined commands) is kept, up to [`MAX_AHEAD`]; past that
/// nothing more is read until it is answered.
///
/// A client that pipelined QUIT after its message and then closed its
/// sending side (a TCP half-close, which RFC 2920 clients may do) has not
/// gone: it reads its answers, and is answered. Told apart from a client
/// that sent QUIT and later went away (which must not have its message
/// relayed: it would send it again) by its QUIT coming with its message
/// (within [`HALF_CLOSE_WITH_QUIT`] of `data_end`, the end of its data)
/// and its close with its QUIT (within as long of its last bytes): a
/// client that gave up waiting says QUIT later, and closes at once.
async fn watch(inbuf: &mut InBuf, stream: &mut Stream, data_end: Instant) {
    loop {
        if inbuf.len() >= MAX_AHEAD {
            std::future::pending::<()>().await;
        }
        match inbuf.fill(stream).await {
            Ok(0)
                if ends_with_quit(inbuf.unread())
                    && inbuf.last_data().is_some_and(|t| {
                        t.saturating_duration_since(data_end) < HALF_CLOSE_WITH_QUIT
                    })
                    && inbuf
                        .end_after_data()
                        .is_some_and(|d| d < HALF_CLOSE_WITH_QUIT) =>
            {
                std::future::pending::<()>().await;
            }
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}

/// Whether the last line of `input` is a whole QUIT command.
fn ends_with_quit(input: &[u8]) -> bool {
    let Some(body) = input.strip_suffix(b"\n") else {
        return false;
    };
    let body = body.strip_suffix(b"\r").unwrap_or(body);
    let last = body.rsplit(|&b| b == b'\n').next().unwrap_or(body);
    last.eq_ignore_ascii_case(b"QUIT")
}

/// Whether an address the parser gave can go into an upstream command
/// as it is: no control characters, and a domain (after the last `@`)
/// that is a name: letters, digits, hyphens, dots, or UTF-8 (and no byte
/// that was not UTF-8). The parser
/// accepts a quoted domain and drops its quotes, so
/// `u@"x.com> NOTIFY=NEVER"` would otherwise reach the upstream as extra
/// parameters of the command. (It refuses address literals itself.)
fn sound_address(address: &str) -> bool {
    // U+FFFD: the parser's stand-in for bytes that are not UTF-8, which
    // RFC 6531 does not allow (relayed, the address would be another).
    if address.chars().any(|c| c.is_control() || c == '\u{FFFD}') {
        return false;
    }
    let Some((_, domain)) = address.rsplit_once('@') else {
        return true;
    };
    !domain.is_empty()
        && domain
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || !c.is_ascii())
}

/// Whether a command line names `<postmaster>` (any case).
fn names_postmaster(line: &[u8]) -> bool {
    line.windows(12)
        .any(|w| w.eq_ignore_ascii_case(b"<postmaster>"))
}

#[cfg(test)]
mod tests {
    use super::{ends_with_quit, sound_address};

    #[test]
    fn a_quit_is_seen_only_as_the_whole_last_line() {
        assert!(ends_with_quit(b"QUIT\r\n"));
        assert!(ends_with_quit(b"NOOP\r\nquit\n"));
        assert!(!ends_with_quit(b"QUIT"));
        assert!(!ends_with_quit(b"QUIT\r\nNOOP\r\n"));
        assert!(!ends_with_quit(b"NOQUIT\r\n"));
        assert!(!ends_with_quit(b""));
    }

    #[test]
    fn an_address_goes_upstream_only_with_a_plain_domain() {
        for ok in [
            "",
            "postmaster",
            "a@example.com",
            "a.b+c@mail-1.example.com",
            "\"odd local\"@example.com",
            "ü@bücher.example",
        ] {
            assert!(sound_address(ok), "{ok}");
        }
        for bad in [
            "u@x.com> NOTIFY=NEVER",
            "u@\"x.com\"",
            "u@",
            "u@[127.0.0.1]",
            "u@x.com\r\nRSET",
            "u@x,y",
            "\u{FFFD}@example.com",
        ] {
            assert!(!sound_address(bad), "{bad}");
        }
    }
}
