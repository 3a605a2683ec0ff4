//! Cluster mode: several sluice instances share each client's schedule D
//! (and each capped upstream's slot calendar) in a store, so one client's
//! output stays smooth across the fleet.
//!
//! Admission is one atomic round trip per request that reads the store's
//! own clock, applies the rules of DESIGN section 1 to the stored D,
//! advances it, and returns the delay or the retry-after; the instance
//! then holds the request until its departure with its own precise pacer.
//! With an upstream cap the request also takes the first free slot of the
//! cap's calendar at or after its own due time, in the same round trip, so
//! one client's backlog never pushes other clients' departures back.
//!
//! This module is the facade: timeouts, health, metrics and `on_failure`;
//! the store is [`redis`] (standalone or Redis Cluster) or [`postgres`].

pub mod postgres;
mod redis;
mod refusals;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tracing::warn;

use crate::config::{ClusterConfig, OnFailure, Store};
use crate::metrics as m;
use refusals::{Refusals, Why};

/// Why a shared-schedule call failed (then `on_failure` applies).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("the shared schedule did not answer within {0:?}")]
    Timeout(Duration),
    #[error("redis: {0}")]
    Redis(#[from] ::redis::RedisError),
    #[error("postgres: {}", chain(.0))]
    Postgres(#[from] tokio_postgres::Error),
    #[error("unexpected reply from the admission script")]
    Reply,
    #[error("the store ran the admission after its caller stopped waiting")]
    Late,
    #[error("{0}")]
    Setup(String),
}

/// What is wrong with the store, while something is.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Trouble {
    /// Not usable as configured (a standalone client pointed at a cluster
    /// node): `/readyz` is 503 whatever `on_failure` says.
    Misconfigured(String),
    /// Down or unreachable: `on_failure` decides, and only `reject`
    /// makes the instance unready.
    Unavailable(String),
    /// Part of it down (a Redis Cluster master without a replica): the
    /// clients whose slots it held follow `on_failure`, and the instance
    /// stays ready for the others (every instance unready would fail
    /// every client).
    Partial(String),
}

impl Trouble {
    fn text(&self) -> &str {
        match self {
            Trouble::Misconfigured(t) | Trouble::Unavailable(t) | Trouble::Partial(t) => t,
        }
    }
}

/// The background check's last finding (logged when it changes), and when
/// the last check that found the store usable began.
#[derive(Default)]
struct Problem {
    now: std::sync::Mutex<Option<Trouble>>,
    /// When the check under way began.
    began: std::sync::Mutex<Option<Instant>>,
    /// When the last check that found the store usable (whole, or all
    /// but the part that is down) began.
    good: std::sync::Mutex<Option<Instant>>,
}

impl Problem {
    /// A check begins (its finding is [`Problem::set`]).
    pub(super) fn begin(&self) {
        *self.began.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
    }

    fn set(&self, problem: Option<Trouble>) -> Result<(), String> {
        let mut p = self.now.lock().unwrap_or_else(|e| e.into_inner());
        if problem != *p {
            match &problem {
                Some(why) => tracing::error!("cluster mode: {}", why.text()),
                None if p.is_some() => tracing::info!("cluster mode: the store is usable again"),
                None => {}
            }
        }
        if matches!(problem, None | Some(Trouble::Partial(_))) {
            let began = *self.began.lock().unwrap_or_else(|e| e.into_inner());
            *self.good.lock().unwrap_or_else(|e| e.into_inner()) = began;
        }
        *p = problem.clone();
        problem.map_or(Ok(()), |t| Err(t.text().to_owned()))
    }

    fn get(&self) -> Option<Trouble> {
        self.now.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn good(&self) -> Option<Instant> {
        *self.good.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An error and its causes, one after the other (tokio-postgres keeps
/// the reason, such as a certificate's, in the source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// One admission's parameters, in microseconds.
#[derive(Debug, Clone)]
pub struct Ask {
    /// Client key in the store.
    pub key: String,
    /// The capped upstream's slot calendar, when the upstream is capped.
    pub slots: Option<String>,
    pub step_us: u64,
    pub capacity: u32,
    pub cost: u32,
    pub tau_us: u64,
    pub slot_us: u64,
    pub max_wait_us: u64,
}

/// What the store decided.
#[derive(Debug)]
pub enum Verdict {
    /// Depart after `delay`; `reservation` undoes it if the client leaves.
    Go {
        delay: Duration,
        reservation: Reservation,
    },
    /// Queue full: 429.
    Full { retry_after: Duration },
    /// Departure past max_wait: 429.
    MaxWait { retry_after: Duration },
}

/// A reservation, for the cancel: the client's D as this admission left
/// it (given back when it is the client's last, or kept as a hole until
/// the later ones are given back too), and the cap slots it took (always
/// given back).
#[derive(Debug, Clone)]
pub struct Reservation {
    key: String,
    slots: Option<String>,
    new_d: i64,
    undo: i64,
    first_slot: i64,
    cost: u32,
}

/// The store behind the facade.
enum Backend {
    Redis(Box<redis::Redis>),
    Postgres(Box<postgres::Postgres>),
}

impl Backend {
    fn label(&self) -> &'static str {
        match self {
            Backend::Redis(_) => "redis",
            Backend::Postgres(_) => "postgres",
        }
    }

    async fn check(&self) -> Result<(), String> {
        match self {
            Backend::Redis(s) => s.check().await,
            Backend::Postgres(s) => s.check().await,
        }
    }

    async fn watch(&self) {
        match self {
            Backend::Redis(s) => s.watch().await,
            Backend::Postgres(s) => s.watch().await,
        }
    }

    fn problem(&self) -> &Problem {
        match self {
            Backend::Redis(s) => s.problem(),
            Backend::Postgres(s) => s.problem(),
        }
    }

    async fn admit(&self, ask: &Ask) -> Result<Vec<i64>, ClusterError> {
        match self {
            Backend::Redis(s) => s.admit(ask).await,
            Backend::Postgres(s) => s.admit(ask).await,
        }
    }

    async fn cancel(&self, r: &Reservation) -> Result<(), ClusterError> {
        match self {
            Backend::Redis(s) => s.cancel(r).await,
            Backend::Postgres(s) => s.cancel(r).await,
        }
    }
}

/// The shared-schedule client.
pub struct Cluster {
    store: Arc<Backend>,
    backend: &'static str,
    prefix: String,
    timeout: Duration,
    pub on_failure: OnFailure,
    pub instances: u32,
    /// The calls failing in a row now (see [`Cluster::is_healthy`]).
    streak: Mutex<Streak>,
    duration: Arc<m::Histogram>,
    /// Clients the store has just refused.
    refusals: Arc<Refusals>,
    remembered: metrics::Counter,
}

/// Calls failed in a row since the last that succeeded (or since a good
/// background check that began after the last of them), and since when.
#[derive(Default)]
struct Streak {
    failed: u32,
    /// When the first of them was told it failed.
    since: Option<Instant>,
    /// When the last of them was.
    last: Option<Instant>,
}

impl Streak {
    /// A call was told at `now` that it failed; `good` is when the last
    /// good background check began. One that ended the run (see
    /// [`Streak::cleared`]): this one starts another. A run is timed from
    /// when its first call was told (not from its start, which a
    /// `timeout` of a second or more would put past [`UNHEALTHY_FOR`]
    /// already).
    fn fail(&mut self, now: Instant, good: Option<Instant>) {
        if self.failed == 0 || self.cleared(now, good) {
            self.failed = 0;
            self.since = Some(now);
        }
        self.failed = self.failed.saturating_add(1);
        self.last = Some(now);
    }

    /// Whether a good background check ended the run at `now`: one that
    /// began after the last failure, when no call has failed for
    /// [`UNHEALTHY_FOR`] (an instance no traffic reaches, being unready,
    /// sees the store come back). While calls go on failing, they are
    /// the evidence: a store that answers the check and fails admissions
    /// (too slow for `timeout`, a role or an ACL without the script)
    /// counted as up after every check until three more calls had failed
    /// for a second, and `/readyz` flapped.
    fn cleared(&self, now: Instant, good: Option<Instant>) -> bool {
        match (good, self.last) {
            (Some(g), Some(l)) => g > l && now.saturating_duration_since(l) >= UNHEALTHY_FOR,
            _ => false,
        }
    }

    /// Whether the store counts as down at `now` (see
    /// [`Cluster::is_healthy`]).
    fn down(&self, now: Instant, good: Option<Instant>) -> bool {
        self.failed >= UNHEALTHY_AFTER
            && self
                .since
                .is_some_and(|t| now.saturating_duration_since(t) >= UNHEALTHY_FOR)
            && !self.cleared(now, good)
    }
}

/// Where a client's given-back reservations wait while a later one is
/// still ahead of them (see the stores' cancel): beside the client's key,
/// in its hash slot. No client key ends so (route names have no `:`).
fn holes_key(client: &str) -> String {
    format!("{client}:holes")
}

/// The key a background check writes (with the key prefix before it), to
/// see that the store takes writes as admissions need: a Redis out of
/// memory, or a PostgreSQL standby or a role without UPDATE, still
/// answers reads. Clients' keys all start with `{`.
fn health_key(prefix: &str) -> String {
    format!("{prefix}health")
}

/// A `password_file`'s password (its first line's end trimmed).
fn read_password(file: &std::path::Path) -> Result<String, ClusterError> {
    let text = std::fs::read_to_string(file).map_err(|e| {
        ClusterError::Setup(format!("cannot read password_file {}: {e}", file.display()))
    })?;
    Ok(text.trim_end_matches(['\r', '\n']).to_owned())
}

/// Hex of a key's bytes, safe inside a store key name.
fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0xf)]));
    }
    out
}

/// Calls failed in a row after which the store counts as down (for
/// `/readyz` under `on_failure = "reject"`, and `sluice_cluster_healthy`),
/// as Envoy's outlier detection counts consecutive errors, once they have
/// gone on for [`UNHEALTHY_FOR`].
const UNHEALTHY_AFTER: u32 = 3;

/// How long calls must have failed in a row for the store to count as
/// down. Under heavy traffic one stall longer than `timeout` fails every
/// call in flight at once (many in a row), and the next call succeeds:
/// that is not an outage, and counting alone made `/readyz` flap.
const UNHEALTHY_FOR: Duration = Duration::from_secs(1);

/// Client keys longer than this are named in the store by their digest.
const LONGEST_STORED_KEY: usize = 256;

/// A client key as the store names it: its bytes in hex; a longer key
/// than [`LONGEST_STORED_KEY`], `#` and the hex of its SHA-256. A key made
/// of several header parts can run to kilobytes, and PostgreSQL's index
/// takes 2,704 bytes an entry at most: such a key could never be stored,
/// and every request with it fell to `on_failure` (under `"allow"`,
/// unshaped, and each one marked the store unhealthy).
fn store_name(key: &[u8]) -> String {
    if key.len() <= LONGEST_STORED_KEY {
        return hex(key);
    }
    let digest = ring::digest::digest(&ring::digest::SHA256, key);
    format!("#{}", hex(digest.as_ref()))
}

impl Cluster {
    /// Set up the client. Connections are made in the background, so
    /// sluice starts (and follows `on_failure`) while the store is down;
    /// the store's topology is checked at start and every few seconds
    /// after ([`Cluster::misconfigured`]).
    pub fn new(cfg: &ClusterConfig) -> Result<Cluster, ClusterError> {
        let store = match &cfg.store {
            Store::Redis {
                nodes,
                mode,
                ca,
                password_file,
            } => {
                let password = password_file.as_deref().map(read_password).transpose()?;
                Backend::Redis(Box::new(redis::Redis::new(
                    nodes,
                    *mode,
                    (ca.clone(), password),
                    cfg.timeout,
                    &cfg.key_prefix,
                )))
            }
            Store::Postgres(pg) => Backend::Postgres(Box::new(postgres::Postgres::new(
                pg,
                cfg.timeout,
                &cfg.key_prefix,
            )?)),
        };
        let backend = store.label();
        // The series alerts watch exist from the start, at 0.
        for result in ["ok", "error", "timeout"] {
            metrics::counter!(m::CLUSTER_CALLS_TOTAL, "backend" => backend, "result" => result)
                .increment(0);
        }
        metrics::counter!(m::CLUSTER_FALLBACKS_TOTAL, "backend" => backend, "policy" => cfg.on_failure.as_str())
            .increment(0);
        let remembered =
            metrics::counter!(m::CLUSTER_REMEMBERED_REFUSALS_TOTAL, "backend" => backend);
        remembered.increment(0);
        Ok(Cluster {
            store: Arc::new(store),
            backend,
            prefix: cfg.key_prefix.clone(),
            timeout: cfg.timeout,
            on_failure: cfg.on_failure,
            instances: cfg.instances,
            streak: Mutex::default(),
            duration: m::histogram(m::CLUSTER_DURATION_SECONDS, &[("backend", backend)]),
            refusals: Arc::default(),
            remembered,
        })
    }

    /// Check the store's topology now (and keep checking in the
    /// background); the error when it is not usable as configured.
    pub async fn check(&self) -> Result<(), String> {
        self.store.check().await
    }

    /// Keep checking the topology in the background.
    pub fn watch(&self) {
        let store = self.store.clone();
        tokio::spawn(async move { store.watch().await });
    }

    /// Why the store cannot be used as configured, while it cannot
    /// (`/readyz` is 503 meanwhile).
    pub fn misconfigured(&self) -> Option<String> {
        match self.store.problem().get()? {
            Trouble::Misconfigured(why) => Some(why),
            Trouble::Unavailable(_) | Trouble::Partial(_) => None,
        }
    }

    /// Why the store is down, as the background check last found it
    /// (not when only part of it is).
    pub fn unavailable(&self) -> Option<String> {
        match self.store.problem().get()? {
            Trouble::Unavailable(why) => Some(why),
            Trouble::Misconfigured(_) | Trouble::Partial(_) => None,
        }
    }

    /// Whether the background check last found part of the store down (a
    /// Redis Cluster master without a replica): its clients' calls fail,
    /// and do not make the instance unready.
    pub fn partly_down(&self) -> bool {
        matches!(self.store.problem().get(), Some(Trouble::Partial(_)))
    }

    /// Whatever the background check last found wrong (for `/status`).
    pub fn problem(&self) -> Option<String> {
        self.store.problem().get().map(|t| t.text().to_owned())
    }

    /// The `backend` metric label.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    /// Whether the store answers: fewer than [`UNHEALTHY_AFTER`] calls
    /// failed in a row, or less than [`UNHEALTHY_FOR`] passed since the
    /// first of them failed (one slow call, or one stall that failed the
    /// calls in flight together, is not an outage: it made `/readyz`
    /// flap), or a background check succeeded since the last call failed
    /// (so an instance that no traffic reaches, being unready, sees the
    /// store come back).
    pub fn is_healthy(&self) -> bool {
        let good = self.store.problem().good();
        !self.streak().down(Instant::now(), good)
    }

    fn streak(&self) -> std::sync::MutexGuard<'_, Streak> {
        self.streak.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Store keys for a client of `route` (and its capped upstream, with
    /// its slot length in µs). With a cap, all clients of the upstream
    /// share its hash tag, so that one script touches both keys on Redis
    /// Cluster (one slot per capped upstream); without one, each client
    /// key has its own tag (spread over every master). The calendar is
    /// named by its slot length too: slots are numbered in it, and
    /// instances with different caps for one upstream (a rolling reload)
    /// would read each other's numbers as other times (and trim them as
    /// past).
    pub fn keys(
        &self,
        route: &str,
        key: &[u8],
        capped_upstream: Option<(&str, u64)>,
    ) -> (String, Option<String>) {
        let p = &self.prefix;
        match capped_upstream {
            Some((up, slot_us)) => (
                format!("{p}{{u:{up}}}:c:{route}:{}", store_name(key)),
                Some(format!("{p}{{u:{up}}}:slots:{slot_us}")),
            ),
            None => (format!("{p}{{c:{route}:{}}}", store_name(key)), None),
        }
    }

    fn record(&self, started: Instant, ok: bool, result: &'static str) {
        {
            let mut streak = self.streak();
            if ok {
                *streak = Streak::default();
            } else {
                streak.fail(Instant::now(), self.store.problem().good());
            }
        }
        self.duration.record(started.elapsed());
        metrics::counter!(m::CLUSTER_CALLS_TOTAL, "backend" => self.backend, "result" => result)
            .increment(1);
    }

    /// One admission round trip, bounded by the configured timeout. The
    /// call runs in a task of its own: a reservation the store makes after
    /// the caller gave up (the timeout, then `on_failure`; or its client
    /// left) is given back, instead of holding a departure that nobody
    /// takes and, after the timeout, counting the request twice.
    ///
    /// A client the store refused (a full queue, `max_wait`) less than
    /// its Retry-After ago, and less than [`refusals::REMEMBERED_FOR`],
    /// is refused without a call (see [`refusals`]).
    pub async fn admit(&self, ask: Ask) -> Result<Verdict, ClusterError> {
        let started = Instant::now();
        if let Some((why, retry_after)) = self.refusals.refused(&ask, started) {
            self.remembered.increment(1);
            return Ok(match why {
                Why::Full => Verdict::Full { retry_after },
                Why::MaxWait => Verdict::MaxWait { retry_after },
            });
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        let (store, timeout, refusals) = (self.store.clone(), self.timeout, self.refusals.clone());
        let mut rx = Answer {
            rx,
            store: store.clone(),
            refusals: refusals.clone(),
            timeout,
        };
        tokio::spawn(async move {
            // The store's own calls give up at orphan_limit; this bounds
            // the task, a little later so as not to lose their answer.
            let limit = orphan_limit(timeout).saturating_add(timeout);
            let verdict = match tokio::time::timeout(limit, store.admit(&ask)).await {
                Ok(Ok(reply)) => decode(ask, &reply, |ask, why, retry_after| {
                    refusals.remember(ask, why, started, retry_after);
                }),
                Ok(Err(e)) => Err(e),
                Err(_) => Err(ClusterError::Timeout(timeout)),
            };
            if let Err(Ok(Verdict::Go { reservation, .. })) = tx.send(verdict) {
                withdraw(&store, &refusals, timeout, &reservation).await;
            }
        });
        let verdict = match tokio::time::timeout(self.timeout, &mut rx.rx).await {
            Ok(Ok(v)) => v,
            Ok(Err(_)) => Err(ClusterError::Setup(
                "the store call ended without an answer".into(),
            )),
            Err(_) => Err(ClusterError::Timeout(self.timeout)),
        };
        let result = match &verdict {
            Ok(_) => "ok",
            Err(ClusterError::Timeout(_)) => "timeout",
            Err(_) => "error",
        };
        self.record(started, verdict.is_ok(), result);
        verdict
    }

    /// Give a reservation back (the client left before its departure), in
    /// the background and bounded by the timeout.
    pub fn cancel(&self, r: Reservation) {
        // The client's next request asks the store (which refuses it
        // again if the give-back has not landed yet), and so does the
        // one after the give-back lands.
        self.refusals.forget(&r.key);
        let (store, timeout, refusals) = (self.store.clone(), self.timeout, self.refusals.clone());
        tokio::spawn(async move { withdraw(&store, &refusals, timeout, &r).await });
    }
}

/// The caller's end of an admission call. Dropped before it took the
/// verdict (the client left while the call was answered), it gives back
/// a reservation that had arrived.
struct Answer {
    rx: tokio::sync::oneshot::Receiver<Result<Verdict, ClusterError>>,
    store: Arc<Backend>,
    refusals: Arc<Refusals>,
    timeout: Duration,
}

impl Drop for Answer {
    fn drop(&mut self) {
        self.rx.close();
        // (Outside a runtime, a runtime shutting down, there is nothing to
        // run the withdrawal on: the reservation lapses with its D.)
        if let Ok(Ok(Verdict::Go { reservation, .. })) = self.rx.try_recv()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let (store, refusals) = (self.store.clone(), self.refusals.clone());
            let timeout = self.timeout;
            runtime.spawn(async move { withdraw(&store, &refusals, timeout, &reservation).await });
        }
    }
}

/// How long a store connection may take to be made: the call's timeout
/// is for a round trip, and a connection takes several (TCP, TLS, AUTH,
/// set-up), which a store a few ms away cannot make in the default 50 ms.
/// Connections are made in the background: no caller waits longer.
pub(crate) fn connect_limit(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(1))
}

/// How long a store call may run on after its caller gave up (at
/// `timeout`): long enough for a slow store to answer, so that a
/// reservation it made is known and given back, bounded so that a store
/// that never answers leaks no task. The Redis client's own response
/// timeouts are this, not `timeout`: a reply it stopped waiting for could
/// not be given back, and its cluster client retried a script that had
/// run (a second reservation).
pub(crate) fn orphan_limit(timeout: Duration) -> Duration {
    timeout.saturating_mul(4).max(Duration::from_secs(2))
}

/// Give a reservation back; a refusal of its client remembered meanwhile
/// is forgotten (a place may have freed).
async fn withdraw(store: &Backend, refusals: &Refusals, timeout: Duration, r: &Reservation) {
    match tokio::time::timeout(timeout, store.cancel(r)).await {
        Ok(Ok(())) => refusals.forget(&r.key),
        Ok(Err(e)) => warn!(error = %e, "cannot withdraw a cluster reservation"),
        Err(_) => warn!("withdrawing a cluster reservation timed out"),
    }
}

/// A store's admission reply as a verdict; `refused` is told of a
/// refusal.
fn decode(
    ask: Ask,
    reply: &[i64],
    refused: impl FnOnce(&Ask, Why, Duration),
) -> Result<Verdict, ClusterError> {
    let micros = |v: i64| Duration::from_micros(u64::try_from(v).unwrap_or(0));
    match reply {
        [1, delay, new_d, first_slot, ..] => Ok(Verdict::Go {
            delay: micros(*delay),
            reservation: Reservation {
                key: ask.key,
                slots: ask.slots,
                new_d: *new_d,
                undo: i64::from(ask.cost)
                    .saturating_mul(i64::try_from(ask.step_us.max(1)).unwrap_or(i64::MAX)),
                first_slot: *first_slot,
                cost: ask.cost,
            },
        }),
        [0, retry, ..] => {
            let retry_after = micros(*retry);
            refused(&ask, Why::Full, retry_after);
            Ok(Verdict::Full { retry_after })
        }
        [2, retry, ..] => {
            let retry_after = micros(*retry);
            refused(&ask, Why::MaxWait, retry_after);
            Ok(Verdict::MaxWait { retry_after })
        }
        // Run after its caller stopped waiting: nothing was reserved.
        [3, ..] => Err(ClusterError::Late),
        _ => Err(ClusterError::Reply),
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{LONGEST_STORED_KEY, Streak, hex, store_name};

    #[test]
    fn the_store_is_down_after_a_second_of_calls_failing_in_a_row() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut s = Streak::default();
        // One stall: eight calls in flight fail together.
        for _ in 0..8 {
            s.fail(at(0), None);
        }
        assert!(!s.down(at(999), None));
        assert!(s.down(at(1_000), None));
        // A good background check that began since: up, and the next
        // failure starts a run of its own (it was down at once on one
        // failed call).
        assert!(!s.down(at(1_000), Some(at(500))));
        s.fail(at(6_000), Some(at(500)));
        assert!(!s.down(at(6_001), Some(at(500))));
        s.fail(at(6_500), Some(at(500)));
        s.fail(at(6_900), Some(at(500)));
        assert!(!s.down(at(6_999), Some(at(500))));
        assert!(s.down(at(7_000), Some(at(500))));
        // A good check that began before the last failure (calls failing
        // while it ran) does not end the run; one that began after it
        // does, once no call has failed for a second.
        let mut s = Streak::default();
        for ms in [0, 100, 200] {
            s.fail(at(ms), None);
        }
        assert!(s.down(at(1_000), Some(at(150))));
        assert!(s.down(at(1_000), Some(at(250))));
        assert!(!s.down(at(1_200), Some(at(250))));
        assert!(s.down(at(1_200), Some(at(150))));
        // Two calls failing for a long time are not three.
        let mut s = Streak::default();
        s.fail(at(0), None);
        s.fail(at(5_000), None);
        assert!(!s.down(at(9_000), None));
    }

    #[test]
    fn a_key_is_named_by_its_hex_and_a_long_one_by_its_digest() {
        assert_eq!(hex(b"\x00\x7f\xffk"), "007fff6b");
        assert_eq!(store_name(b"hk"), "686b");
        let short = vec![b'a'; LONGEST_STORED_KEY];
        assert_eq!(store_name(&short), hex(&short));
        let long = vec![b'a'; LONGEST_STORED_KEY + 1];
        let mut other = long.clone();
        other[LONGEST_STORED_KEY] = b'b';
        let (a, b) = (store_name(&long), store_name(&other));
        assert_eq!(a.len(), 65, "{a}");
        assert!(a.starts_with('#'));
        assert_ne!(a, b);
        // Many kilobytes of key, one short name: PostgreSQL indexes it.
        assert_eq!(store_name(&vec![7u8; 64 << 10]).len(), 65);
    }
}
