//! The HTTP layer around the shaper: accept connections (HTTP/1.1 and h2c),
//! pick a route, derive the client key, wait for the departure the shaper
//! grants, then forward upstream over a pooled keep-alive client.
//!
//! A queued request's body is not touched until it departs; a client that
//! disconnects while queued drops its future, which withdraws it from the
//! queue (the next in line takes its slot).
//!
//! The routing table ([`App`]) is swapped whole on reload; requests already
//! in flight keep the table they started with, so a removed route's queue
//! drains at its old rate. Shutdown stops accepting, lets the queues drain
//! at their pace until the drain timeout, answers what remains 503, and
//! waits for in-flight upstream calls.

mod forward;
mod headers;
mod key;
pub mod response;

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http::{HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use ipnet::IpNet;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::cluster::{Ask, Cluster, Reservation, Verdict};
use crate::config::{Config, Cost, KeySpec, OnFailure, OnMissingKey};
use crate::metrics::{self as m, Outcome};
use crate::shaper::{
    AcquireError, Admitted, Limits, Policy, Probe, Rate, Rejection, RouteId, Shaper, UpstreamId,
};
pub use key::ClientKey;
use response::{ProxyBody, problem};

/// Errors starting or reloading the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the pacer thread: {0}")]
    Pacer(std::io::Error),
    #[error("cannot set up the upstream client: {0}")]
    Client(String),
}

/// How often refusals are summarised in the log (one line per route per
/// interval instead of one per refusal).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A route as the request path sees it.
struct Route {
    name: String,
    host: Option<String>,
    path_prefix: String,
    path: Option<String>,
    methods: Option<Vec<Method>>,
    id: RouteId,
    /// The local route used while Redis fails with `on_failure = "local"`
    /// (rate r / instances); `None` outside cluster mode.
    fallback: Option<RouteId>,
    upstream: usize,
    upstream_name: String,
    /// The upstream cap's interval per cost unit, if capped.
    cap_step: Option<u64>,
    /// Whether the upstream has a global cap (departures then unknown at
    /// admission, so `max_wait` is also enforced while waiting).
    capped: bool,
    key: KeySpec,
    on_missing_key: OnMissingKey,
    cost: Cost,
    policy: Policy,
    max_wait: Option<Duration>,
    dry_run: bool,
    ratelimit_headers: bool,
    /// Refusals since the last log summary.
    refused: AtomicU64,
}

/// The routing table: swapped whole on reload.
struct App {
    routes: Vec<Route>,
    upstreams: Vec<forward::Upstream>,
    trusted_proxies: Vec<IpNet>,
}

impl Route {
    /// Whether this route takes `req`: every criterion it has must match.
    fn matches<B>(&self, req: &Request<B>) -> bool {
        let path = req.uri().path();
        if !path.starts_with(&self.path_prefix) {
            return false;
        }
        if self.path.as_deref().is_some_and(|p| p != path) {
            return false;
        }
        if self
            .methods
            .as_ref()
            .is_some_and(|m| !m.contains(req.method()))
        {
            return false;
        }
        match &self.host {
            None => true,
            Some(host) => request_host(req).is_some_and(|h| h.eq_ignore_ascii_case(host)),
        }
    }

    /// The request's cost: fixed, or read from a header (400 when it is not
    /// a whole number from 1 to the configured max).
    fn cost(&self, headers: &http::HeaderMap) -> Result<u32, String> {
        match &self.cost {
            Cost::Fixed(n) => Ok(*n),
            Cost::Header { name, default, max } => match headers.get(name) {
                None => Ok(*default),
                Some(v) => match v.to_str().ok().and_then(|t| t.trim().parse::<u32>().ok()) {
                    Some(n) if (1..=*max).contains(&n) => Ok(n),
                    _ => Err(format!(
                        "the {name} header must be a whole number from 1 to {max}"
                    )),
                },
            },
        }
    }
}

/// The host a request is for, without port: `Host`, or the URI authority
/// (HTTP/2).
fn request_host<B>(req: &Request<B>) -> Option<&str> {
    let raw = req
        .headers()
        .get(http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))?;
    let host = match raw.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => match raw.rsplit_once(':') {
            Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
            _ => raw,
        },
    };
    Some(host)
}

/// Engine ids by name, kept across reloads so that a route that still
/// exists keeps its queues.
#[derive(Default)]
struct Registry {
    routes: HashMap<String, (RouteId, UpstreamId)>,
    upstreams: HashMap<String, UpstreamId>,
    /// `max_concurrency` semaphores by upstream name, so that calls in
    /// flight across a reload still count against the same cap.
    concurrency: HashMap<String, (usize, Arc<Semaphore>)>,
}

/// Outcome totals, for `/status`.
#[derive(Default)]
struct Totals([AtomicU64; 7]);

impl Totals {
    fn add(&self, o: Outcome) {
        self.0[o as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn get(&self, o: Outcome) -> u64 {
        self.0[o as usize].load(Ordering::Relaxed)
    }
}

/// State shared by every connection, the admin listener and the signal
/// handlers.
struct Shared {
    shaper: Shaper<ClientKey>,
    /// Cluster mode (fixed at start; a reload does not change it).
    cluster: Option<Arc<Cluster>>,
    app: RwLock<Arc<App>>,
    registry: Mutex<Registry>,
    tls: Arc<rustls::ClientConfig>,
    draining: AtomicBool,
    drain_timeout: Mutex<Duration>,
    version: AtomicU64,
    loaded_at: AtomicU64,
    totals: Totals,
}

/// A bound, not yet running server.
pub struct Server {
    shared: Arc<Shared>,
    listeners: Vec<TcpListener>,
    http: Arc<auto::Builder<TokioExecutor>>,
    max_connections: usize,
}

/// A handle for reloading, status and readiness, usable while the server
/// runs.
#[derive(Clone)]
pub struct Handle(Arc<Shared>);

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Server {
    /// Build the shaper and the upstream clients from `config`, then bind
    /// every listener. Nothing is served until [`Server::run`].
    pub async fn bind(config: &Config) -> Result<Server, ServeError> {
        let shaper = Shaper::start(Limits {
            max_clients: config.limits.max_clients,
            max_queued: config.limits.max_queued,
        })
        .map_err(ServeError::Pacer)?;
        shaper.observe_lag(Box::new(|lag| {
            metrics::histogram!(m::RELEASE_LAG_SECONDS).record(lag.as_secs_f64());
        }));
        let cluster = match &config.cluster {
            Some(c) => Some(Arc::new(
                Cluster::new(c).map_err(|e| ServeError::Client(format!("cluster: {e}")))?,
            )),
            None => None,
        };
        let tls = forward::tls_config();
        let mut registry = Registry::default();
        let app = build_app(&shaper, &mut registry, config, &tls)?;

        let mut listeners = Vec::with_capacity(config.server.listen.len());
        for &addr in &config.server.listen {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|source| ServeError::Bind { addr, source })?;
            listeners.push(listener);
        }

        let mut http = auto::Builder::new(TokioExecutor::new());
        http.http1()
            .timer(TokioTimer::new())
            .header_read_timeout(config.server.header_read_timeout)
            .max_buf_size(config.server.max_header_size);
        http.http2()
            .timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(config.server.max_header_size).unwrap_or(u32::MAX));

        metrics::gauge!(m::CONFIG_LOADED_TIMESTAMP_SECONDS).set(unix_now() as f64);
        Ok(Server {
            shared: Arc::new(Shared {
                shaper,
                cluster,
                app: RwLock::new(Arc::new(app)),
                registry: Mutex::new(registry),
                tls,
                draining: AtomicBool::new(false),
                drain_timeout: Mutex::new(config.server.drain_timeout),
                version: AtomicU64::new(1),
                loaded_at: AtomicU64::new(unix_now()),
                totals: Totals::default(),
            }),
            listeners,
            http: Arc::new(http),
            max_connections: config.server.max_connections,
        })
    }

    /// The addresses actually bound (useful with port 0).
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.listeners
            .iter()
            .filter_map(|l| l.local_addr().ok())
            .collect()
    }

    /// A handle for reload, status and readiness.
    pub fn handle(&self) -> Handle {
        Handle(self.shared.clone())
    }

    /// Serve until `shutdown` resolves, then drain: stop accepting, let
    /// queued requests depart at their pace until the queues are empty or
    /// the drain timeout passes, answer the rest 503, and wait for requests
    /// in flight to finish.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let limit = Arc::new(Semaphore::new(self.max_connections));
        let (drain_tx, drain_rx) = tokio::sync::watch::channel(false);
        let mut accept = tokio::task::JoinSet::new();
        for listener in self.listeners {
            if let Ok(addr) = listener.local_addr() {
                info!(%addr, "proxy listening");
            }
            accept.spawn(accept_loop(
                listener,
                self.shared.clone(),
                self.http.clone(),
                limit.clone(),
                drain_rx.clone(),
            ));
        }
        let summaries = tokio::spawn(log_refusals(self.shared.clone()));

        shutdown.await;
        self.shared.draining.store(true, Ordering::Release);
        let timeout = *lock(&self.shared.drain_timeout);
        let queued = self.shared.shaper.stats().1;
        info!(
            queued,
            ?timeout,
            "draining: no new connections; queued requests keep their pace"
        );
        let _ = drain_tx.send(true);
        accept.abort_all();
        while accept.join_next().await.is_some() {}

        // Connections finish the request in hand and close; queued requests
        // are in hand, so they keep departing at their rate meanwhile. Every
        // connection holds a permit: all permits back means all closed.
        let all = u32::try_from(self.max_connections).unwrap_or(u32::MAX);
        let connections = limit.acquire_many_owned(all);
        let deadline = tokio::time::Instant::now() + timeout;
        while self.shared.shaper.stats().1 > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let refused = self.shared.shaper.close_waiting();
        if refused > 0 {
            warn!(refused, "drain timeout passed: answering the rest 503");
        }
        let in_flight_grace = self.shared.longest_request_timeout() + Duration::from_secs(1);
        if tokio::time::timeout(in_flight_grace, connections)
            .await
            .is_err()
        {
            warn!("connections still open after the in-flight grace period; closing");
        }
        summaries.abort();
        info!("drained");
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Build a routing table, reusing engine ids for routes and upstreams that
/// keep their name (and, for routes, their upstream).
fn build_app(
    shaper: &Shaper<ClientKey>,
    registry: &mut Registry,
    config: &Config,
    tls: &Arc<rustls::ClientConfig>,
) -> Result<App, ServeError> {
    let mut upstreams = Vec::with_capacity(config.upstreams.len());
    let mut upstream_ids = Vec::with_capacity(config.upstreams.len());
    for u in &config.upstreams {
        let id = match registry.upstreams.get(&u.name) {
            Some(&id) => {
                shaper.set_upstream_cap(id, u.rate);
                id
            }
            None => {
                let id = shaper.add_upstream(u.rate);
                registry.upstreams.insert(u.name.clone(), id);
                id
            }
        };
        upstream_ids.push(id);
        let concurrency = u
            .max_concurrency
            .map(|limit| match registry.concurrency.get(&u.name) {
                Some((n, sem)) if *n == limit => sem.clone(),
                _ => {
                    let sem = Arc::new(Semaphore::new(limit));
                    registry
                        .concurrency
                        .insert(u.name.clone(), (limit, sem.clone()));
                    sem
                }
            });
        upstreams.push(forward::Upstream::new(u, tls.clone(), concurrency)?);
    }
    let mut routes = Vec::with_capacity(config.routes.len());
    for r in &config.routes {
        let policy = Policy {
            rate: r.rate,
            capacity: r.capacity,
            burst: r.burst,
            max_wait: r
                .max_wait
                .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        };
        let upstream_id = upstream_ids[r.upstream];
        let id = match registry.routes.get(&r.name) {
            Some(&(id, up)) if up == upstream_id => {
                shaper.set_policy(id, policy);
                id
            }
            _ => {
                let id = shaper.add_route(policy, upstream_id);
                registry.routes.insert(r.name.clone(), (id, upstream_id));
                id
            }
        };
        let fallback = config.cluster.as_ref().map(|c| {
            let local = Policy {
                rate: Rate::from_interval_nanos(
                    r.rate
                        .interval_nanos()
                        .saturating_mul(u64::from(c.instances)),
                )
                .unwrap_or(r.rate),
                ..policy
            };
            let name = format!("{}\0local", r.name);
            match registry.routes.get(&name) {
                Some(&(id, up)) if up == upstream_id => {
                    shaper.set_policy(id, local);
                    id
                }
                _ => {
                    let id = shaper.add_route(local, upstream_id);
                    registry.routes.insert(name, (id, upstream_id));
                    id
                }
            }
        });
        routes.push(Route {
            name: r.name.clone(),
            host: r.host.clone(),
            path_prefix: r.path_prefix.clone(),
            path: r.path.clone(),
            methods: r.methods.clone(),
            id,
            fallback,
            upstream: r.upstream,
            upstream_name: config.upstreams[r.upstream].name.clone(),
            cap_step: config.upstreams[r.upstream].rate.map(Rate::interval_nanos),
            capped: config.upstreams[r.upstream].rate.is_some(),
            key: r.key.clone(),
            on_missing_key: r.on_missing_key,
            cost: r.cost.clone(),
            policy,
            max_wait: r.max_wait,
            dry_run: r.dry_run,
            ratelimit_headers: r.ratelimit_headers,
            refused: AtomicU64::new(0),
        });
    }
    Ok(App {
        routes,
        upstreams,
        trusted_proxies: config.server.trusted_proxies.clone(),
    })
}

async fn accept_loop(
    listener: TcpListener,
    shared: Arc<Shared>,
    http: Arc<auto::Builder<TokioExecutor>>,
    limit: Arc<Semaphore>,
    draining: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        // Past max_connections we stop accepting; the kernel backlog holds
        // the rest, as HAProxy's maxconn does.
        let Ok(permit) = limit.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // EMFILE and friends: back off rather than spin.
                warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if *draining.borrow() {
            return;
        }
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        let http = http.clone();
        let mut draining = draining.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(shared.handle(req, peer).await) }
            });
            let conn = http.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            // Serve until the drain begins, then let the connection finish
            // what it holds and close.
            let mut signalled = false;
            loop {
                tokio::select! {
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            debug!(%peer, error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    changed = draining.changed(), if !signalled => {
                        signalled = true;
                        if changed.is_ok() {
                            conn.as_mut().graceful_shutdown();
                        }
                    }
                }
            }
            drop(permit);
        });
    }
}

// === impl Shared ===

impl Shared {
    fn app(&self) -> Arc<App> {
        self.app
            .read()
            .map(|a| a.clone())
            .unwrap_or_else(|e| e.into_inner().clone())
    }

    fn longest_request_timeout(&self) -> Duration {
        self.app()
            .upstreams
            .iter()
            .map(forward::Upstream::request_timeout)
            .max()
            .unwrap_or(Duration::ZERO)
    }

    fn finish(&self, route: &str, outcome: Outcome) {
        self.totals.add(outcome);
        m::count(route, outcome);
    }

    async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
        let arrival = Instant::now();
        let app = self.app();
        let Some(route) = app.routes.iter().find(|r| r.matches(&req)) else {
            self.finish("", Outcome::Invalid);
            return problem(StatusCode::NOT_FOUND, "no route matches this request", None);
        };
        let headers = req.headers();
        let key = key::extract(
            &route.key,
            route.on_missing_key,
            headers,
            peer.ip(),
            &app.trusted_proxies,
        );
        let (key, cost) = match (key, route.cost(headers)) {
            (Ok(key), Ok(cost)) => (key, cost),
            (Err(detail), _) | (_, Err(detail)) => {
                self.finish(&route.name, Outcome::Invalid);
                return problem(StatusCode::BAD_REQUEST, &detail, None);
            }
        };
        let mut local_id = route.id;
        if let Some(cluster) = &self.cluster {
            match self.admit_cluster(cluster, route, &key, cost).await {
                ClusterPath::Forward => {
                    return self.forward(&app, route, req, peer, arrival, None).await;
                }
                ClusterPath::Respond(response) => return response,
                ClusterPath::Local => local_id = route.fallback.unwrap_or(route.id),
            }
        }
        let probe_key = route.ratelimit_headers.then(|| key.clone());
        match self.shaper.admit(local_id, key, cost) {
            Ok(Admitted::Now) => {}
            Ok(Admitted::Wait(waiting)) if route.dry_run => waiting.detach(),
            Ok(Admitted::Wait(waiting)) => {
                // If the client goes away, hyper drops this future and with
                // it `waiting` (which withdraws the request) and `gone`
                // (which counts it as cancelled).
                let gone = CountOnDrop {
                    shared: self,
                    route: &route.name,
                };
                let departed = match route.max_wait.filter(|_| route.capped) {
                    // Under an upstream cap the departure is unknown at
                    // admission: enforce max_wait while waiting.
                    Some(max_wait) => {
                        let left = max_wait.saturating_sub(arrival.elapsed());
                        tokio::time::timeout(left, waiting.departed())
                            .await
                            .unwrap_or(Err(AcquireError::Rejected(Rejection::MaxWait {
                                retry_after: 0,
                            })))
                    }
                    None => waiting.departed().await,
                };
                std::mem::forget(gone);
                match departed {
                    Ok(()) => {}
                    Err(AcquireError::Rejected(_)) => {
                        self.finish(&route.name, Outcome::Expired);
                        let wait = route.max_wait.unwrap_or(Duration::from_secs(1));
                        return problem(
                            StatusCode::SERVICE_UNAVAILABLE,
                            &format!("route '{}': still queued after max_wait", route.name),
                            Some(wait),
                        );
                    }
                    Err(AcquireError::Closed) => {
                        self.finish(&route.name, Outcome::Expired);
                        return problem(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "sluice is shutting down; this request was not forwarded",
                            Some(Duration::from_secs(1)),
                        );
                    }
                }
            }
            Err(rejection) if route.dry_run => {
                route.refused.fetch_add(1, Ordering::Relaxed);
                metrics::counter!(m::DRY_RUN_REFUSALS_TOTAL, "route" => route.name.clone())
                    .increment(1);
                debug!(route = %route.name, ?rejection, "dry run: would have refused");
            }
            Err(rejection) => {
                route.refused.fetch_add(1, Ordering::Relaxed);
                let outcome = match rejection {
                    Rejection::Full { .. } | Rejection::MaxWait { .. } => Outcome::Rejected,
                    Rejection::TooManyClients | Rejection::TooManyQueued => Outcome::Overloaded,
                };
                self.finish(&route.name, outcome);
                let mut response = reject(&route.name, rejection);
                self.add_ratelimit_headers(route, probe_key.as_ref(), &mut response);
                return response;
            }
        }
        self.forward(&app, route, req, peer, arrival, probe_key.as_ref())
            .await
    }

    async fn forward(
        &self,
        app: &App,
        route: &Route,
        req: Request<Incoming>,
        peer: SocketAddr,
        arrival: Instant,
        probe_key: Option<&ClientKey>,
    ) -> Response<ProxyBody> {
        metrics::histogram!(m::QUEUE_WAIT_SECONDS, "route" => route.name.clone())
            .record(arrival.elapsed().as_secs_f64());
        let (mut response, outcome) = app.upstreams[route.upstream].forward(req, peer).await;
        self.finish(&route.name, outcome);
        self.add_ratelimit_headers(route, probe_key, &mut response);
        response
    }

    /// Cluster mode: one Redis round trip decides; a request that must
    /// wait is held by our own pacer until its departure. When Redis fails,
    /// `on_failure` decides.
    async fn admit_cluster(
        &self,
        cluster: &Cluster,
        route: &Route,
        key: &[u8],
        cost: u32,
    ) -> ClusterPath {
        let us = |ns: u64| ns / 1_000;
        let step = route.policy.rate.interval_nanos();
        let (k, global) = cluster.keys(
            &route.name,
            key,
            route.capped.then_some(route.upstream_name.as_str()),
        );
        let ask = Ask {
            key: k,
            global,
            step_us: us(step),
            capacity: route.policy.capacity,
            cost,
            tau_us: us(u64::from(route.policy.burst.saturating_sub(1)).saturating_mul(step)),
            global_step_us: route.cap_step.map_or(0, us),
            max_wait_us: route.policy.max_wait.map_or(0, us),
        };
        match cluster.admit(ask).await {
            Ok(Verdict::Go { delay, reservation }) => {
                if delay.is_zero() || route.dry_run {
                    return ClusterPath::Forward;
                }
                // If the client leaves while held, give the slot back (when
                // it is still the client's last) and count it as cancelled.
                let mut undo = Undo {
                    cluster,
                    reservation: Some(reservation),
                    gone: CountOnDrop {
                        shared: self,
                        route: &route.name,
                    },
                };
                let at = self
                    .shaper
                    .now()
                    .saturating_add(u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX));
                self.shaper.sleep_until(at).await;
                undo.reservation = None;
                std::mem::forget(undo);
                ClusterPath::Forward
            }
            Ok(Verdict::Full { retry_after } | Verdict::MaxWait { retry_after }) => {
                route.refused.fetch_add(1, Ordering::Relaxed);
                if route.dry_run {
                    metrics::counter!(m::DRY_RUN_REFUSALS_TOTAL, "route" => route.name.clone())
                        .increment(1);
                    return ClusterPath::Forward;
                }
                self.finish(&route.name, Outcome::Rejected);
                let ns = u64::try_from(retry_after.as_nanos()).unwrap_or(u64::MAX);
                ClusterPath::Respond(reject(&route.name, Rejection::Full { retry_after: ns }))
            }
            Err(e) => {
                let policy = cluster.on_failure;
                debug!(error = %e, ?policy, "redis failed; applying on_failure");
                let label = match policy {
                    OnFailure::Local => "local",
                    OnFailure::Reject => "reject",
                    OnFailure::Allow => "allow",
                };
                metrics::counter!(m::REDIS_FALLBACKS_TOTAL, "policy" => label).increment(1);
                match policy {
                    OnFailure::Local => ClusterPath::Local,
                    OnFailure::Allow => ClusterPath::Forward,
                    OnFailure::Reject => {
                        self.finish(&route.name, Outcome::Overloaded);
                        ClusterPath::Respond(problem(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "the shared rate-limit store is unavailable; retry later",
                            Some(Duration::from_secs(1)),
                        ))
                    }
                }
            }
        }
    }

    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-
    /// headers-10, Structured Fields): the quota is the route's capacity
    /// over the time its rate takes to drain it; remaining is the capacity
    /// not waiting now; reset is the time until this client's queue has
    /// drained. Whole seconds.
    fn add_ratelimit_headers<B>(
        &self,
        route: &Route,
        key: Option<&ClientKey>,
        response: &mut Response<B>,
    ) {
        let Some(key) = key else {
            return;
        };
        let capacity = u64::from(route.policy.capacity);
        let window = response::ceil_secs(
            route
                .policy
                .rate
                .interval_nanos()
                .saturating_mul(capacity.max(1)),
        );
        let (waiting, reset) = match self.shaper.view(route.id, key) {
            Some(v) => (
                v.waiting_cost,
                response::ceil_secs(v.next_departure.saturating_sub(self.shaper.now())),
            ),
            None => (0, 0),
        };
        let remaining = capacity.saturating_sub(waiting);
        let name = &route.name;
        let headers = response.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&format!("\"{name}\";q={capacity};w={window}")) {
            headers.insert("ratelimit-policy", v);
        }
        if let Ok(v) = HeaderValue::from_str(&format!("\"{name}\";r={remaining};t={reset}")) {
            headers.insert("ratelimit", v);
        }
    }
}

/// How the cluster path wants a request handled.
enum ClusterPath {
    Forward,
    Respond(Response<ProxyBody>),
    /// Redis failed and `on_failure = "local"`: shape with the local engine.
    Local,
}

/// Withdraws a cluster reservation if the held request is dropped.
struct Undo<'a> {
    cluster: &'a Cluster,
    reservation: Option<Reservation>,
    gone: CountOnDrop<'a>,
}

impl Drop for Undo<'_> {
    fn drop(&mut self) {
        if let Some(r) = self.reservation.take() {
            self.cluster.cancel(r);
        }
        let _ = &self.gone;
    }
}

/// Counts a queued request as cancelled if its future is dropped before
/// departure (the client went away).
struct CountOnDrop<'a> {
    shared: &'a Shared,
    route: &'a str,
}

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        self.shared.finish(self.route, Outcome::Cancelled);
    }
}

fn reject(route: &str, rejection: Rejection) -> Response<ProxyBody> {
    match rejection {
        Rejection::Full { retry_after } => problem(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("route '{route}': this client's queue is full; retry later"),
            Some(Duration::from_nanos(retry_after)),
        ),
        Rejection::MaxWait { retry_after } => problem(
            StatusCode::TOO_MANY_REQUESTS,
            &format!("route '{route}': the wait would exceed max_wait; retry later"),
            Some(Duration::from_nanos(retry_after)),
        ),
        Rejection::TooManyClients => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many clients are being shaped; retry later",
            Some(Duration::from_secs(1)),
        ),
        Rejection::TooManyQueued => problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "too many requests are queued; retry later",
            Some(Duration::from_secs(1)),
        ),
    }
}

/// One log line per route per interval for refusals, never one per
/// refusal: a flood must not become a log flood.
async fn log_refusals(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(REFUSAL_LOG_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        for route in &shared.app().routes {
            let n = route.refused.swap(0, Ordering::Relaxed);
            if n > 0 {
                warn!(route = %route.name, refused = n, interval = ?REFUSAL_LOG_INTERVAL, "requests refused (429/503)");
            }
        }
    }
}

// === impl Handle ===

impl Handle {
    /// Swap in a new config. Queued requests keep their place and their
    /// departure times; new rates and capacities apply to new arrivals.
    /// Listener addresses and `[server]` limits need a restart.
    pub fn reload(&self, config: &Config) -> Result<(), ServeError> {
        let shared = &self.0;
        let app = {
            let mut registry = lock(&shared.registry);
            build_app(&shared.shaper, &mut registry, config, &shared.tls)?
        };
        shared.shaper.set_limits(Limits {
            max_clients: config.limits.max_clients,
            max_queued: config.limits.max_queued,
        });
        *lock(&shared.drain_timeout) = config.server.drain_timeout;
        match shared.app.write() {
            Ok(mut a) => *a = Arc::new(app),
            Err(e) => *e.into_inner() = Arc::new(app),
        }
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
    /// draining, or Redis failing while `on_failure = "reject"`.
    pub fn not_ready(&self) -> Option<&'static str> {
        if self.is_draining() {
            return Some("draining");
        }
        match &self.0.cluster {
            Some(c) if !c.is_healthy() && c.on_failure == OnFailure::Reject => {
                Some("redis unavailable")
            }
            _ => None,
        }
    }

    /// Set the queue gauges from the engine (before a scrape).
    pub fn refresh_gauges(&self) {
        let (clients, queued) = self.0.shaper.stats();
        metrics::gauge!(m::ACTIVE_CLIENTS).set(clients as f64);
        metrics::gauge!(m::QUEUED_REQUESTS).set(queued as f64);
    }

    /// The bucket query: a client's waiting cost, next departure, and
    /// whether a request of `cost` would be admitted now. Changes nothing.
    /// `None` when the route does not exist or `key` cannot be its key.
    pub fn bucket(&self, route: &str, key: &str, cost: u32) -> Option<serde_json::Value> {
        let shared = &self.0;
        let app = shared.app();
        let r = app.routes.iter().find(|r| r.name == route)?;
        let k = key::from_display(&r.key, key)?;
        let now = shared.shaper.now();
        let view = shared.shaper.view(r.id, &k);
        let (verdict, admitted, retry_after_ms) = match shared.shaper.probe(r.id, &k, cost) {
            Probe::Depart => ("depart", true, None),
            Probe::Queue { .. } => ("queue", true, None),
            Probe::Reject(Rejection::Full { retry_after } | Rejection::MaxWait { retry_after }) => {
                ("reject", false, Some(retry_after.div_ceil(1_000_000)))
            }
            Probe::Reject(_) => ("overloaded", false, None),
        };
        Some(serde_json::json!({
            "route": r.name,
            "key": key,
            "cost": cost,
            "waiting": view.map_or(0, |v| v.waiting),
            "waiting_cost": view.map_or(0, |v| v.waiting_cost),
            "next_departure_ms": view.map_or(0, |v| v.next_departure.saturating_sub(now) / 1_000_000),
            "admitted_now": admitted,
            "verdict": verdict,
            "retry_after_ms": retry_after_ms,
        }))
    }

    /// The `/status` document: routes, config version and load time,
    /// totals, and the 20 deepest queues.
    pub fn status(&self) -> serde_json::Value {
        let shared = &self.0;
        let app = shared.app();
        let (clients, queued) = shared.shaper.stats();
        let now = shared.shaper.now();
        let names: HashMap<RouteId, &str> =
            app.routes.iter().map(|r| (r.id, r.name.as_str())).collect();
        let deepest: Vec<serde_json::Value> = shared
            .shaper
            .deepest(20)
            .into_iter()
            .map(|(route, k, view)| {
                serde_json::json!({
                    "route": names.get(&route).copied().unwrap_or("(removed)"),
                    "key": key::display(&k),
                    "waiting": view.waiting,
                    "waiting_cost": view.waiting_cost,
                    "drains_in_ms": view.next_departure.saturating_sub(now) / 1_000_000,
                })
            })
            .collect();
        let routes: Vec<serde_json::Value> = app
            .routes
            .iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name,
                    "path_prefix": r.path_prefix,
                    "upstream": app.upstreams[r.upstream].name(),
                    "rate_per_second": r.policy.rate.per_second_f64(),
                    "capacity": r.policy.capacity,
                })
            })
            .collect();
        let t = &shared.totals;
        serde_json::json!({
            "config": {
                "version": shared.version.load(Ordering::Relaxed),
                "loaded_at_unix": shared.loaded_at.load(Ordering::Relaxed),
            },
            "draining": self.is_draining(),
            "redis": self.0.cluster.as_ref().map(|c| if c.is_healthy() { "ok" } else { "failing" }),
            "routes": routes,
            "clients": clients,
            "queued": queued,
            "totals": {
                "forwarded": t.get(Outcome::Forwarded),
                "rejected": t.get(Outcome::Rejected),
                "overloaded": t.get(Outcome::Overloaded),
                "cancelled": t.get(Outcome::Cancelled),
                "expired": t.get(Outcome::Expired),
                "upstream_error": t.get(Outcome::UpstreamError),
                "invalid": t.get(Outcome::Invalid),
            },
            "deepest_queues": deepest,
        })
    }
}
