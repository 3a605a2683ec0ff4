//! The HTTP front end: accept connections (HTTP/1.1 and h2c), pick a
//! route, derive the client key, ask the admission layer, then forward
//! upstream over a pooled keep-alive client.
//!
//! Split by job: [`serve`] (workers, listeners, accept, drain), [`h1`]
//! (HTTP/1.1 without hyper for requests without a body), [`route`]
//! (the routing table), [`key`] (client keys), [`handler`] (one request's
//! life and the mapping of verdicts to HTTP), [`forward`] (upstream pools),
//! [`headers`] and [`response`].
//!
//! Layout (the nginx worker model): one worker thread per core, each with
//! its own current-thread runtime, its own listening sockets on the shared
//! addresses (`SO_REUSEPORT`), its own copy of the routing table and its
//! own upstream pools, so that one request's whole life (accept, admit,
//! forward, answer) stays on one thread. Only a queued request crosses
//! threads: the pacer thread wakes it at its departure.

mod access;
mod client;
mod conn;
mod forward;
mod grpc;
mod h1;
mod handler;
mod headers;
mod in_flight;
pub mod key;
pub mod path;
pub mod response;
mod route;
mod serve;
mod stage;
mod stall;
mod throttle;
mod tunnel;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use metrics::Counter;

use crate::admission::{Admission, AdmissionError, ClientView, Key, Probe, Protocol};
use crate::config::Config;
use crate::metrics::{self as m, Outcome};
pub use in_flight::{Concurrency, InFlight};
use route::App;
pub use serve::{Running, Server, listener};

/// Errors starting or reloading the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error(transparent)]
    Admission(#[from] AdmissionError),
    #[error("cannot set up the upstream client: {0}")]
    Client(String),
    /// A reload that changes what only a restart applies.
    #[error("{0} changed: restart sluice to apply (nothing was reloaded)")]
    Restart(String),
    #[error("cannot start worker thread {0}: {1}")]
    Worker(usize, std::io::Error),
    #[error("cluster mode: {0}")]
    Backend(String),
    #[error("cannot open the access log {path}: {source}")]
    AccessLog {
        path: std::path::PathBuf,
        source: std::io::Error,
    },
}

/// State shared by every worker, the admin listener and the signal
/// handlers.
pub(crate) struct Shared {
    admission: Arc<Admission>,
    /// The SMTP relay's listeners and table (empty without `[[smtp]]`).
    smtp: Arc<crate::smtp::Front>,
    /// Each worker's own routing table (its own pools), swapped on reload.
    apps: Vec<ArcSwap<App>>,
    concurrency: Mutex<Concurrency>,
    staging: Arc<stage::StageBudget>,
    /// `server.body_read_timeout` (fixed at start, like `[server]`).
    body_read_timeout: Duration,
    tls: Arc<rustls::ClientConfig>,
    draining: AtomicBool,
    /// A stop signal came and `shutdown_delay` runs: still serving, not
    /// ready.
    stopping: AtomicBool,
    drain_timeout: Mutex<Duration>,
    shutdown_delay: Mutex<Duration>,
    version: AtomicU64,
    loaded_at: AtomicU64,
    unrouted: Counter,
    tunnels: tunnel::Tunnels,
    /// The HTTP workers running (0 for a pure mail relay).
    workers: usize,
    /// `server.access_log`, if set.
    access_log: Option<Arc<access::AccessLog>>,
    /// Each worker's runtime, once they all started.
    runtimes: std::sync::OnceLock<Vec<tokio::runtime::Handle>>,
    /// The settings read once at start, as [`fixed_at_start`] gives them.
    fixed: Vec<(&'static str, String)>,
}

/// The settings read once at start (sockets, worker runtimes, connection
/// handling, the admin listener, the shared store), each with its value
/// as text: a reload that changes one is refused whole. The same
/// addresses in another order, or `workers` written out as the count
/// running (`running`) or left unset, are no change (unset is not read
/// again: the cores available may have changed since, by a CPU quota).
pub(crate) fn fixed_at_start(config: &Config, running: usize) -> Vec<(&'static str, String)> {
    let s = &config.server;
    let mut listen = s.listen.clone();
    listen.sort_unstable();
    vec![
        ("server.listen", format!("{listen:?}")),
        ("server.workers", s.workers.unwrap_or(running).to_string()),
        ("server.max_connections", s.max_connections.to_string()),
        (
            "server.header_read_timeout",
            format!("{:?}", s.header_read_timeout),
        ),
        (
            "server.body_read_timeout",
            format!("{:?}", s.body_read_timeout),
        ),
        ("server.send_timeout", format!("{:?}", s.send_timeout)),
        (
            "server.keepalive_timeout",
            format!("{:?}", s.keepalive_timeout),
        ),
        ("server.max_header_size", s.max_header_size.to_string()),
        ("server.max_tunnels", s.max_tunnels.to_string()),
        ("server.access_log", format!("{:?}", s.access_log)),
        ("[admin]", format!("{:?}", config.admin)),
        ("[cluster]", format!("{:?}", config.cluster)),
        (
            "[cluster] password",
            match config.cluster.as_ref().map(|c| &c.store) {
                Some(crate::config::Store::Postgres(pg)) => pg.target.password_digest().to_string(),
                _ => String::new(),
            },
        ),
    ]
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// How long HTTP calls in flight get once the drain gives up: the
    /// longest `request_timeout`, and a second.
    fn http_grace(&self) -> Duration {
        self.app(0).longest_request_timeout() + Duration::from_secs(1)
    }

    /// How long relays in flight get once the drain gives up: what a
    /// relay under way may still take, and a second (none without an
    /// SMTP upstream).
    fn smtp_grace(&self) -> Duration {
        self.smtp.longest_relay() + Duration::from_secs(1)
    }

    /// The longer of the two: each front end gets its own, so that a
    /// streaming HTTP answer is not kept for the 9 minutes a relay may
    /// take.
    fn in_flight_grace(&self) -> Duration {
        self.http_grace().max(self.smtp_grace())
    }

    /// The routing table of worker `i` (the first for callers that are not
    /// a worker).
    fn app(&self, worker: usize) -> Arc<App> {
        self.apps
            .get(worker)
            .or_else(|| self.apps.first())
            .map(ArcSwap::load_full)
            .unwrap_or_else(|| Arc::new(App::empty()))
    }

    fn count_unrouted(&self) {
        self.unrouted.increment(1);
        self.admission.totals().add(Outcome::Invalid);
    }
}

/// A handle for reloading, status and readiness, usable while the server
/// runs.
#[derive(Clone)]
pub struct Handle(Arc<Shared>);

/// One route as `/status` shows it.
#[derive(Debug, Clone)]
pub struct RouteSummary {
    pub name: String,
    pub protocol: &'static str,
    /// HTTP routes: the path prefix they take.
    pub path_prefix: Option<String>,
    /// SMTP listeners: their addresses.
    pub listen: Vec<SocketAddr>,
    pub upstream: String,
    pub rate_per_second: f64,
    pub capacity: u32,
}

/// One queue as `/status` shows it.
#[derive(Debug, Clone)]
pub struct QueueSummary {
    pub route: String,
    pub key: String,
    pub view: ClientView,
}

/// What the bucket query answers.
#[derive(Debug, Clone)]
pub struct Bucket {
    pub route: String,
    /// The key as `/status` shows it masked.
    pub fingerprint: String,
    pub view: Option<ClientView>,
    pub probe: Probe,
    /// Nanoseconds on the engine's clock (to turn departures into waits).
    pub now: u64,
}

impl Handle {
    /// Whether the pacer thread is alive and taking messages.
    pub async fn pacer_answers(&self) -> bool {
        self.0.admission.pacer_answers().await
    }

    /// Open the access log again (log rotation moved it away), if there
    /// is one.
    pub fn reopen_access_log(&self) {
        if let Some(log) = &self.0.access_log {
            log.reopen();
        }
    }

    /// Flush the access log and stop its writer (at the exit).
    pub fn close_access_log(&self) {
        if let Some(log) = &self.0.access_log {
            log.close();
        }
    }

    /// The HTTP workers (by number) that do not run a task within
    /// `within`: stuck (see [`serve::stuck`]).
    pub async fn workers_stuck(&self, within: Duration) -> Vec<usize> {
        match self.0.runtimes.get() {
            Some(runtimes) => serve::stuck(runtimes, within).await,
            None => Vec::new(),
        }
    }

    /// The longest a drain can take: `drain_timeout`, then the grace for
    /// what is in flight.
    pub fn longest_stop(&self) -> Duration {
        *lock(&self.0.drain_timeout) + self.0.in_flight_grace()
    }

    /// `server.shutdown_delay` as configured now.
    pub fn shutdown_delay(&self) -> Duration {
        *lock(&self.0.shutdown_delay)
    }

    /// A stop signal came: `/readyz` answers 503 from now on, while
    /// everything is still served until the drain starts.
    pub fn announce_stop(&self) {
        self.0.stopping.store(true, Ordering::Release);
    }

    /// Whether a stop was announced.
    pub fn stopping(&self) -> bool {
        self.0.stopping.load(Ordering::Acquire)
    }

    /// Swap in a new config. Queued requests keep their place and their
    /// departure times; new rates and capacities apply to new arrivals.
    /// A config that changes what is read only at start (listeners,
    /// `[server]` connection handling, `[cluster]`) is refused whole.
    pub fn reload(&self, config: &Config) -> Result<(), ServeError> {
        let shared = &self.0;
        // Everything that can fail first: all or nothing.
        let changed: Vec<&str> = fixed_at_start(config, shared.workers)
            .iter()
            .zip(&shared.fixed)
            .filter(|(new, old)| new != old)
            .map(|((name, _), _)| *name)
            .collect();
        if !changed.is_empty() {
            return Err(ServeError::Restart(changed.join(", ")));
        }
        if !shared.smtp.same_listeners(config) {
            let what = "[[smtp]] listeners (their names and addresses)";
            return Err(ServeError::Restart(what.to_owned()));
        }
        let smtp_pools = shared.smtp.prepare(config).map_err(ServeError::Client)?;
        let mut concurrency = lock(&shared.concurrency).clone();
        let old: Vec<Arc<App>> = shared.apps.iter().map(ArcSwap::load_full).collect();
        let apps = App::build_all(
            &shared.admission,
            config,
            &shared.tls,
            shared.apps.len(),
            &mut concurrency,
            &old,
        )?;
        lock(&shared.concurrency).commit(concurrency);
        shared.admission.set_limits(limits(config));
        shared.staging.set(
            config.limits.max_staged_body,
            config.limits.max_staged_bytes,
        );
        *lock(&shared.drain_timeout) = config.server.drain_timeout;
        *lock(&shared.shutdown_delay) = config.server.shutdown_delay;
        for (slot, app) in shared.apps.iter().zip(apps) {
            slot.store(Arc::new(app));
        }
        shared.smtp.install(config, smtp_pools);
        shared.version.fetch_add(1, Ordering::Relaxed);
        shared.loaded_at.store(unix_now(), Ordering::Relaxed);
        metrics::gauge!(m::CONFIG_LOADED_TIMESTAMP_SECONDS).set(unix_now() as f64);
        Ok(())
    }

    /// Whether the server is draining (not ready for new traffic).
    pub fn is_draining(&self) -> bool {
        self.0.draining.load(Ordering::Acquire)
    }

    /// Why the instance should not get traffic now, if it should not:
    /// draining, or the shared schedule failing while `on_failure =
    /// "reject"`.
    pub fn not_ready(&self) -> Option<String> {
        if self.is_draining() {
            return Some("draining".to_owned());
        }
        if self.0.stopping.load(Ordering::Acquire) {
            return Some("shutting down: serving until shutdown_delay passes".to_owned());
        }
        self.0.admission.backend_not_ready()
    }

    /// Set the queue gauges from the engine (before a scrape).
    pub fn refresh_gauges(&self) {
        if let (Some(backend), Some(healthy)) = (self.backend(), self.backend_healthy()) {
            let up = healthy && self.backend_problem().is_none();
            metrics::gauge!(m::CLUSTER_HEALTHY, "backend" => backend).set(if up {
                1.0
            } else {
                0.0
            });
        }
        let (clients, queued) = self.0.admission.stats();
        metrics::gauge!(m::ACTIVE_CLIENTS).set(clients as f64);
        metrics::gauge!(m::QUEUED_REQUESTS).set(queued as f64);
        metrics::gauge!(m::STAGED_BYTES).set(self.0.staging.used() as f64);
        metrics::gauge!(m::TUNNELS).set(self.tunnels() as f64);
        metrics::gauge!(m::QUEUED_REQUESTS_LIMIT).set(self.0.admission.limits().max_queued as f64);
        metrics::gauge!(m::CONNECTIONS, "protocol" => "http").set(self.connections() as f64);
        metrics::gauge!(m::CONNECTIONS, "protocol" => "smtp").set(self.smtp_sessions() as f64);
        if let Some(u) = crate::memory::usage() {
            metrics::gauge!(m::MEMORY_ALLOCATED_BYTES).set(u.allocated as f64);
            metrics::gauge!(m::MEMORY_RESIDENT_BYTES).set(u.resident as f64);
        }
    }

    /// HTTP client connections open now.
    pub fn connections(&self) -> usize {
        conn::OPEN.load(Ordering::Relaxed)
    }

    /// Upgrade tunnels open now.
    pub fn tunnels(&self) -> usize {
        self.0.tunnels.open()
    }

    /// SMTP client sessions open now.
    pub fn smtp_sessions(&self) -> usize {
        self.0.smtp.sessions()
    }

    /// The SMTP listeners' bound addresses, by listener name.
    pub fn smtp_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.0.smtp.local_addrs()
    }

    /// Bytes of request bodies staged now.
    pub fn staged_bytes(&self) -> usize {
        self.0.staging.used()
    }

    /// Every upstream (HTTP, then SMTP) with its protocol, and how long it
    /// stays paused if it is.
    pub fn upstreams(&self) -> Vec<(String, &'static str, Option<Duration>)> {
        let app = self.0.app(0);
        let http = app.upstreams.iter().map(|u| {
            let paused = app
                .routes
                .iter()
                .filter(|r| r.rule.upstream() == u.name())
                .find_map(|r| self.0.admission.paused_for(&r.rule));
            (u.name().to_owned(), "http", paused)
        });
        let smtp = self
            .0
            .smtp
            .upstreams()
            .into_iter()
            .map(|(name, paused)| (name, "smtp", paused));
        http.chain(smtp).collect()
    }

    /// Each upstream with `max_concurrency`: its name, the cap, and the
    /// calls holding and waiting for its slots now.
    pub fn upstream_slots(&self) -> Vec<(String, usize, (usize, usize))> {
        let app = self.0.app(0);
        app.upstreams
            .iter()
            .filter_map(|u| {
                let cap = u.concurrency()?;
                Some((u.name().to_owned(), cap.limit(), cap.load()))
            })
            .collect()
    }

    /// The config version (1 at start, +1 per reload) and when it loaded.
    pub fn version(&self) -> (u64, u64) {
        (
            self.0.version.load(Ordering::Relaxed),
            self.0.loaded_at.load(Ordering::Relaxed),
        )
    }

    /// Client states held and requests waiting.
    pub fn stats(&self) -> (usize, usize) {
        self.0.admission.stats()
    }

    /// Outcome totals since start.
    pub fn total(&self, outcome: Outcome) -> u64 {
        self.0.admission.totals().get(outcome)
    }

    /// The shared schedule's health: `None` outside cluster mode.
    pub fn backend_healthy(&self) -> Option<bool> {
        self.0.admission.backend_healthy()
    }

    /// The shared schedule's store: `None` outside cluster mode.
    pub fn backend(&self) -> Option<&'static str> {
        self.0.admission.backend()
    }

    /// What is wrong with the shared schedule's store, while something is.
    pub fn backend_problem(&self) -> Option<String> {
        self.0.admission.backend_problem()
    }

    /// The routes of the running config: HTTP routes, then SMTP
    /// listeners.
    pub fn routes(&self) -> Vec<RouteSummary> {
        let app = self.0.app(0);
        let http = app.routes.iter().map(|r| RouteSummary {
            name: r.name.clone(),
            protocol: r.rule.protocol().as_str(),
            path_prefix: Some(r.path_prefix().to_owned()),
            listen: Vec::new(),
            upstream: app
                .upstreams
                .get(r.upstream)
                .map_or_else(String::new, |u| u.name().to_owned()),
            rate_per_second: r.rule.policy().rate.per_second_f64(),
            capacity: r.rule.policy().capacity,
        });
        let smtp = self.0.smtp.summaries().into_iter().map(|l| RouteSummary {
            name: l.name,
            protocol: crate::admission::Protocol::Smtp.as_str(),
            path_prefix: None,
            listen: l.listen,
            upstream: l.upstream,
            rate_per_second: l.rate_per_second,
            capacity: l.capacity,
        });
        http.chain(smtp).collect()
    }

    /// The `n` deepest queues, deepest first, with the engine's clock;
    /// their keys masked ([`Key::masked`]) unless `show_keys`.
    pub fn deepest(&self, n: usize, show_keys: bool) -> (Vec<QueueSummary>, u64) {
        let admission = &self.0.admission;
        let app = self.0.app(0);
        let smtp = self.0.smtp.rules();
        let now = admission.now();
        let queues = admission
            .deepest(n)
            .into_iter()
            .map(|(id, key, view)| QueueSummary {
                route: app
                    .routes
                    .iter()
                    .map(|r| &r.rule)
                    .chain(&smtp)
                    .find(|r| admission.is_rule_route(r, id))
                    .map_or_else(|| "(removed)".to_owned(), |r| r.name().to_owned()),
                key: if show_keys {
                    key.display()
                } else {
                    key.masked()
                },
                view,
            })
            .collect();
        (queues, now)
    }

    /// The bucket query: a client's waiting cost, next departure, and
    /// what a request of `cost` would be answered now. Changes nothing.
    /// `None` when the route does not exist or `key` cannot be its key.
    pub fn bucket(&self, route: &str, key: &str, cost: u32) -> Option<Bucket> {
        let admission = &self.0.admission;
        let app = self.0.app(0);
        let r = app.routes.iter().find(|r| r.name == route)?;
        let k: Key = key::from_display(&r.key, key)?;
        Some(Bucket {
            route: r.name.clone(),
            fingerprint: k.masked(),
            view: admission.view(&r.rule, &k),
            probe: admission.probe(&r.rule, &k, cost),
            now: admission.now(),
        })
    }

    /// Refusals per route since the last call, for the log summary.
    fn take_refusals(&self) -> Vec<(String, Protocol, u64)> {
        let app = self.0.app(0);
        app.routes
            .iter()
            .map(|r| r.rule.clone())
            .chain(self.0.smtp.rules())
            .map(|r| (r.name().to_owned(), r.protocol(), r.take_refused()))
            .filter(|(_, _, n)| *n > 0)
            .collect()
    }
}

/// The engine's global bounds from a config.
pub(crate) fn limits(config: &Config) -> crate::admission::Limits {
    crate::admission::Limits {
        max_clients: config.limits.max_clients,
        max_queued: config.limits.max_queued,
    }
}

/// The counter for requests that matched no route (`route=""`).
fn unrouted_counter() -> Counter {
    metrics::counter!(m::REQUESTS_TOTAL, "route" => "", "protocol" => "http", "outcome" => Outcome::Invalid.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(server: &str) -> Vec<(&'static str, String)> {
        let text = format!(
            "[server]\n{server}\n[[upstream]]\nname = \"api\"\nurl = \"http://127.0.0.1:9000\"\n\n\
             [[route]]\nname = \"default\"\nupstream = \"api\"\nkey = \"ip\"\nrate = \"5/s\"\ncapacity = 10\n"
        );
        match Config::from_toml(&text) {
            Ok(config) => fixed_at_start(&config, 2),
            Err(problems) => panic!("{problems:?}"),
        }
    }

    #[test]
    fn the_same_start_time_settings_written_otherwise_are_no_change() {
        let a = fixed(r#"listen = ["127.0.0.1:8080", "127.0.0.1:8081"]"#);
        let b = fixed(r#"listen = ["127.0.0.1:8081", "127.0.0.1:8080"]"#);
        assert_eq!(a, b);
        // Two running: unset, or 2, is no change; 3 is.
        assert_eq!(fixed(""), fixed("workers = 2"));
        assert_ne!(fixed(""), fixed("workers = 3"));
        assert_ne!(a, fixed(r#"listen = ["127.0.0.1:8080"]"#));
    }
}
