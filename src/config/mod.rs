//! Configuration: the TOML file parsed into raw structs (unknown keys are
//! errors), then validated once into typed ones. Nothing downstream of
//! [`Config::from_toml`] re-checks or unwraps.
//!
//! Every problem is collected, not just the first, and each names its field
//! path: `route 'api': rate '5/x': unit must be s, m, h or d`.

pub mod postgres;
mod raw;
mod smtp;

use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::HeaderName;
use ipnet::IpNet;

use crate::shaper::Rate;
use raw::{RawConfig, RawCost, RawKey, RawRoute, RawSize, RawUpstream};
pub use smtp::{
    Credentials, MAX_HOLD, Secret, SmtpCost, SmtpKeyPart, SmtpListener, SmtpTls, SmtpUpstream,
};

/// `[admin]`: the admin listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admin {
    pub listen: SocketAddr,
    /// Show client keys in `/status` as they are; otherwise each part that
    /// is not an address shows as a fingerprint (keys may be API tokens).
    pub show_keys: bool,
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: Server,
    /// The admin listener (`/metrics`, `/healthz`, `/readyz`, `/status`);
    /// `None` without an `[admin]` table (opt-in, as in Envoy and HAProxy).
    pub admin: Option<Admin>,
    /// `[cluster]`: share schedules through Redis; `None`: local only.
    pub cluster: Option<ClusterConfig>,
    pub upstreams: Vec<Upstream>,
    pub routes: Vec<Route>,
    /// `[[smtp_upstream]]`: where SMTP listeners relay.
    pub smtp_upstreams: Vec<SmtpUpstream>,
    /// `[[smtp]]`: SMTP listeners, each with its shaping policy.
    pub smtp: Vec<SmtpListener>,
    pub limits: Limits,
}

/// `[server]`: the proxy listeners and their defences.
#[derive(Debug, Clone)]
pub struct Server {
    pub listen: Vec<SocketAddr>,
    pub header_read_timeout: Duration,
    /// The longest pause between two reads of a request body that is
    /// staged while its request waits (nginx's `client_body_timeout`);
    /// past it, the body must come at `admission::MIN_DATA_RATE`.
    pub body_read_timeout: Duration,
    /// The longest a write of a response to a client may wait for the
    /// client to read (nginx's `send_timeout`).
    pub send_timeout: Duration,
    /// How long a connection may stay idle after a request (HTTP/1.1
    /// keep-alive and HTTP/2 alike).
    pub keepalive_timeout: Duration,
    pub max_header_size: usize,
    pub max_connections: usize,
    /// Worker threads (one runtime each); `None`: one per core.
    pub workers: Option<usize>,
    /// On SIGTERM, how long queued requests keep departing at their pace
    /// before the rest are answered 503.
    pub drain_timeout: Duration,
    /// On SIGTERM, how long sluice goes on serving (accepting too) with
    /// `/readyz` at 503 before the drain starts, so that a load balancer
    /// takes it out of rotation first; zero: none.
    pub shutdown_delay: Duration,
    /// Open Upgrade tunnels (WebSocket...) at most; past it, 503.
    pub max_tunnels: usize,
    /// Proxies whose `X-Forwarded-For` entries are believed (`forwarded`
    /// keys).
    pub trusted_proxies: Vec<IpNet>,
    /// Where each HTTP request's line is appended; `None`: no access log.
    pub access_log: Option<PathBuf>,
}

/// `[[upstream]]`: where routes forward to.
#[derive(Debug, Clone)]
pub struct Upstream {
    pub name: String,
    /// Scheme and authority (the URL's path is in [`Upstream::path`]).
    pub url: http::Uri,
    /// The URL's path, prepended to every forwarded path; empty for none,
    /// never ending in '/'.
    pub path: String,
    pub rate: Option<Rate>,
    pub connect_timeout: Duration,
    pub request_timeout: Duration,
    /// The longest pause between two parts of an answer's body (nginx's
    /// `proxy_read_timeout`).
    pub read_timeout: Duration,
    /// Most upstream calls in flight at once; `None`: no cap.
    pub max_concurrency: Option<usize>,
    /// Which `Host` the upstream is sent.
    pub host: HostMode,
    /// Certificates that verify an https upstream instead of the system's
    /// roots (`ca_file`), already read and parsed.
    pub ca: Option<Vec<rustls::pki_types::CertificateDer<'static>>>,
    pub on_throttle: OnThrottle,
    /// The longest pause an upstream may ask for.
    pub max_pause: Duration,
    pub protocol: UpstreamProtocol,
    /// Whether `X-Forwarded-For`, `-Proto` and `-Host` are added (off for a
    /// third party that has no use for the callers' internal addresses:
    /// then those the callers sent, `X-Real-IP` and `Forwarded` are removed).
    pub forwarded_headers: bool,
}

/// How sluice speaks to an upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UpstreamProtocol {
    /// HTTP/1.1 (the default).
    Http1,
    /// HTTP/2 with prior knowledge over plain TCP (gRPC servers).
    H2c,
    /// HTTP/2 over TLS (ALPN `h2`, required).
    H2,
    /// Over TLS, what ALPN picks (`h2` or `http/1.1`); HTTP/1.1 over
    /// plain TCP.
    Auto,
}

/// The `Host` header sent upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMode {
    /// The upstream URL's own host and port (nginx's `$proxy_host`).
    Upstream,
    /// The client's `Host` (Traefik's `passHostHeader`).
    Client,
    /// A fixed value.
    Fixed(http::HeaderValue),
}

/// What a 429 or 503 from the upstream does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnThrottle {
    /// Pass it to the client; keep releasing.
    Pass,
    /// Pause releases to this upstream for as long as it asks, and retry
    /// the refused request when that is safe.
    Pause,
}

/// `[[route]]`: which requests, keyed how, shaped how, sent where.
#[derive(Debug, Clone)]
pub struct Route {
    pub name: String,
    /// Host the request must be for (lower-case, without port).
    pub host: Option<String>,
    pub path_prefix: String,
    /// Exact path the request must have.
    pub path: Option<String>,
    /// Methods the request must use; `None`: any.
    pub methods: Option<Vec<http::Method>>,
    /// Index into [`Config::upstreams`].
    pub upstream: usize,
    pub key: KeySpec,
    pub on_missing_key: OnMissingKey,
    pub rate: Rate,
    pub capacity: u32,
    pub cost: Cost,
    /// Requests that may pass un-paced after idle (0: only the first).
    pub burst: u32,
    pub max_wait: Option<Duration>,
    pub dry_run: bool,
    pub ratelimit_headers: bool,
    /// Removed from the front of the path before it is forwarded.
    pub strip_prefix: Option<String>,
    /// Upgrade tunnels (WebSocket) one client key may hold open at once
    /// on this route; `None`: only `server.max_tunnels` bounds them.
    pub max_tunnels_per_key: Option<usize>,
}

/// How a request's client key is derived: one part, or several joined
/// (`["header:X-Tenant", "ip"]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeySpec(pub Vec<KeyPart>);

/// One part of a client key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyPart {
    /// The peer's IP address.
    Ip,
    /// One queue for everyone.
    Global,
    /// A request header's value.
    Header(HeaderName),
    /// The rightmost `X-Forwarded-For` address that is not a trusted proxy.
    Forwarded,
}

/// What one request costs, in capacity and spacing units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cost {
    Fixed(u32),
    /// Read from a header; a value above `max` or unparsable is a 400.
    Header {
        name: HeaderName,
        default: u32,
        max: u32,
    },
}

/// What to do when the key header is missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnMissingKey {
    /// Answer 400.
    Reject,
    /// Key by the peer's IP address instead.
    Ip,
}

/// `[cluster]`: the store that holds the shared schedules.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    pub store: Store,
    pub key_prefix: String,
    /// Bound on every call to the store.
    pub timeout: Duration,
    pub on_failure: OnFailure,
    /// Instances sharing the schedule; with `on_failure = "local"` each
    /// shapes at r / instances (and an upstream's R / instances) while
    /// the store is unreachable.
    pub instances: u32,
}

/// Where the shared schedules live.
#[derive(Debug, Clone)]
pub enum Store {
    Redis {
        /// `redis://host:port/db` (or `rediss://`, `unix://`): one
        /// server, or seed nodes of a Redis Cluster.
        nodes: Vec<String>,
        mode: RedisMode,
        /// CA certificates (PEM) for `rediss://` nodes; the system's
        /// roots when absent.
        ca: Option<Vec<u8>>,
        /// A file holding the password (AUTH), when the URLs have none.
        password_file: Option<PathBuf>,
    },
    Postgres(Box<PostgresConfig>),
}

/// `[cluster] postgres = "postgres://..."`.
#[derive(Debug, Clone)]
pub struct PostgresConfig {
    pub target: postgres::Target,
    /// `sslrootcert`'s certificates (else the system's roots).
    pub roots: Option<Vec<rustls::pki_types::CertificateDer<'static>>>,
    /// A file holding the password (else the URL's, else `PGPASSFILE` or
    /// `~/.pgpass`).
    pub password_file: Option<PathBuf>,
    /// A logged table (survives a crash of the database) instead of an
    /// unlogged one.
    pub durable: bool,
    /// Connections per instance.
    pub pool_size: usize,
}

/// Whether `redis` is one server or a Redis Cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisMode {
    Standalone,
    Cluster,
    /// Asked at start (`CLUSTER INFO`).
    Auto,
}

/// What to do with a request when Redis fails or times out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnFailure {
    /// Shape locally at r / instances (and an upstream's R / instances).
    Local,
    /// Answer 503.
    Reject,
    /// Forward unshaped.
    Allow,
}

impl OnFailure {
    /// The `policy` metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            OnFailure::Local => "local",
            OnFailure::Reject => "reject",
            OnFailure::Allow => "allow",
        }
    }
}

/// `[limits]`: bounds on memory.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_clients: usize,
    pub max_queued: usize,
    /// Largest body a waiting request may stage (larger: 413).
    pub max_staged_body: usize,
    /// All staged bodies together (past it: 503).
    pub max_staged_bytes: usize,
}

/// Parse a size: a whole number of bytes with an optional unit (`B`,
/// `kB`/`KB` = 1000, `KiB` = 1024, `MB`, `MiB`, `GB`, `GiB`, `TB`, `TiB`).
/// The bounds `check` holds a route's shape to, for a shape given some
/// other way (`sluice simulate`'s flags and trace): each problem found,
/// as `check` would name it.
pub fn shape_problems(rate: Rate, capacity: u32, burst: u32, most_cost: u32) -> Vec<String> {
    let mut v = Validator::default();
    if capacity > MAX_CAPACITY {
        v.problem(
            "--capacity",
            format!("{capacity} is more than {MAX_CAPACITY}"),
        );
    }
    if burst > MAX_BURST {
        v.problem("--burst", format!("{burst} is more than {MAX_BURST}"));
    }
    if most_cost > MAX_COST {
        v.problem(
            "cost",
            format!("{most_cost} in the trace is more than {MAX_COST}"),
        );
    }
    v.within_span(
        "--capacity",
        &format!("capacity {capacity}"),
        capacity,
        rate,
    );
    v.within_span(
        "--burst",
        &format!("burst {burst}"),
        burst.saturating_sub(1),
        rate,
    );
    v.within_span("cost", &format!("cost {most_cost}"), most_cost, rate);
    v.problems.iter().map(ToString::to_string).collect()
}

pub fn parse_size(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("'{text}' is not a size such as 1MiB, 512kB or 1048576"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "kB" | "KB" | "k" | "K" => 1_000,
        "KiB" | "Ki" => 1 << 10,
        "MB" | "M" => 1_000_000,
        "MiB" | "Mi" => 1 << 20,
        "GB" | "G" => 1_000_000_000,
        "GiB" | "Gi" => 1 << 30,
        "TB" | "T" => 1_000_000_000_000,
        "TiB" | "Ti" => 1 << 40,
        other => {
            return Err(format!(
                "'{text}': unknown unit '{other}' (use B, kB, KiB, MB, MiB, GB, GiB, TB or TiB)"
            ));
        }
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("'{text}' is too large"))
}

/// One thing wrong with a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// 1-based line, for syntax and type errors found while parsing.
    pub line: Option<usize>,
    /// Where: `route 'api'`, `server.listen`, `route[2]`.
    pub path: String,
    pub message: String,
}

impl Problem {
    fn new(path: impl Into<String>, message: impl Into<String>) -> Problem {
        Problem {
            line: None,
            path: path.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// A config that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}", render(path, problems))]
    Invalid {
        path: PathBuf,
        problems: Vec<Problem>,
    },
}

fn render(path: &Path, problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| match p.line {
            Some(line) => format!("{}:{line}: {p}", path.display()),
            None => format!("{}: {p}", path.display()),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// How a route or upstream is named in problems: by its name when it has
/// one (`route 'api'`), else by its place in the file (`route[2]`).
fn element_path(kind: &str, index: usize, name: Option<&str>) -> String {
    match name {
        Some(n) if !n.trim().is_empty() => format!("{kind} '{n}'"),
        _ => format!("{kind}[{index}]"),
    }
}

/// The largest cost of a request to a capped upstream in cluster mode:
/// the store writes one calendar entry per unit, in one call (10,000
/// take a few ms of Redis's single thread; a million, seconds, during
/// which every instance's calls time out).
const MAX_SHARED_CAPPED_COST: u32 = 10_000;

// === defaults ===

const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(75);
const DEFAULT_MAX_HEADER_SIZE: usize = 16 * 1024;
const MIN_HEADER_SIZE: usize = 8 * 1024;
const MAX_HEADER_SIZE: usize = 1024 * 1024;
const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
const MAX_WORKERS: usize = 1024;
/// Upper bounds of every numeric field (documented in the README's
/// "Limits and timeouts"); `sluice check` refuses anything above them.
const MAX_CONNECTIONS: usize = 1_000_000;
const MAX_CONCURRENCY: usize = 1_000_000;
const MAX_CLIENTS: usize = 100_000_000;
const MAX_QUEUED: usize = 10_000_000;
const MAX_CAPACITY: u32 = 1_000_000_000;
const MAX_COST: u32 = 1_000_000;
const MAX_BURST: u32 = 1_000_000;
/// The longest a burst, a full queue or one request's cost may span at its
/// rate (about 200 years; the engine counts nanoseconds in a u64, 584
/// years, and adds such spans to each other).
const MAX_SPAN: Duration = Duration::from_secs(200 * 365 * 86_400);
const MAX_INSTANCES: u32 = 10_000;
/// Connections to PostgreSQL per instance, by default and at most.
const DEFAULT_PG_POOL: usize = 8;
const MAX_PG_POOL: usize = 256;
/// Timeouts and pauses: at most a day.
const MAX_TIMEOUT: Duration = Duration::from_secs(86_400);
/// max_wait: at most the longest interval a rate may have (30 days).
const MAX_WAIT: Duration = Duration::from_secs(30 * 86_400);
const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// The longest `server.shutdown_delay` (a load balancer's health checks
/// notice within seconds; Kubernetes' default grace period is 30 s).
const MAX_SHUTDOWN_DELAY: Duration = Duration::from_secs(600);
const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_READ_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_MAX_PAUSE: Duration = Duration::from_secs(60);
const DEFAULT_MAX_CLIENTS: usize = 1_000_000;
const DEFAULT_MAX_QUEUED: usize = 100_000;
const DEFAULT_MAX_STAGED_BODY: usize = 1 << 20;
const DEFAULT_MAX_STAGED_BYTES: usize = 256 << 20;
/// Upper bound of both staging limits (a size that fits any platform).
const MAX_STAGED: u64 = 1 << 40;

// === impl Config ===

impl Config {
    /// Read and validate a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml(&text).map_err(|problems| ConfigError::Invalid {
            path: path.to_path_buf(),
            problems,
        })
    }

    /// Parse and validate config text, reporting every problem found.
    pub fn from_toml(text: &str) -> Result<Config, Vec<Problem>> {
        let raw: RawConfig = raw::parse(text).map_err(|p| vec![p])?;
        let mut v = Validator::default();
        let config = v.config(raw);
        match (config, v.problems.is_empty()) {
            (Some(c), true) => Ok(c),
            _ => Err(v.problems),
        }
    }
}

#[derive(Default)]
struct Validator {
    problems: Vec<Problem>,
}

impl Validator {
    fn problem(&mut self, path: &str, message: impl Into<String>) {
        self.problems.push(Problem::new(path, message));
    }

    fn config(&mut self, raw: RawConfig) -> Option<Config> {
        let has_trusted = raw
            .server
            .trusted_proxies
            .as_ref()
            .is_some_and(|t| !t.is_empty());
        let http = !raw.routes.is_empty();
        let server = self.server(raw.server, http);
        let admin = self.admin(raw.admin);
        let cluster = self.cluster(raw.cluster);
        let limits = Limits {
            max_clients: self.positive(
                "limits.max_clients",
                raw.limits.max_clients,
                DEFAULT_MAX_CLIENTS,
                MAX_CLIENTS,
            ),
            max_queued: self.positive(
                "limits.max_queued",
                raw.limits.max_queued,
                DEFAULT_MAX_QUEUED,
                MAX_QUEUED,
            ),
            max_staged_body: self.size(
                "limits.max_staged_body",
                raw.limits.max_staged_body,
                DEFAULT_MAX_STAGED_BODY,
            ),
            max_staged_bytes: self.size(
                "limits.max_staged_bytes",
                raw.limits.max_staged_bytes,
                DEFAULT_MAX_STAGED_BYTES,
            ),
        };
        if limits.max_staged_body > limits.max_staged_bytes {
            self.problem(
                "limits",
                format!(
                    "max_staged_body ({} bytes) is more than max_staged_bytes ({} bytes): a waiting request that large could never be staged, and would get 503 on every retry instead of 413",
                    limits.max_staged_body, limits.max_staged_bytes
                ),
            );
        }

        if raw.routes.is_empty() && raw.smtp.is_empty() {
            self.problem(
                "route",
                "at least one [[route]] (HTTP) or [[smtp]] listener is required",
            );
        }
        if http && raw.upstreams.is_empty() {
            self.problem("upstream", "at least one [[upstream]] is required");
        }
        let upstream_names: Vec<Option<String>> =
            raw.upstreams.iter().map(|u| u.name.clone()).collect();
        let smtp_upstream_names: Vec<Option<String>> =
            raw.smtp_upstreams.iter().map(|u| u.name.clone()).collect();
        // Routes and listeners label the same metrics, upstreams of both
        // kinds the same upstream metrics: one namespace each.
        let all_upstreams: Vec<Option<String>> = upstream_names
            .iter()
            .chain(&smtp_upstream_names)
            .cloned()
            .collect();
        self.unique("upstream", &all_upstreams);
        let route_names: Vec<Option<String>> = raw
            .routes
            .iter()
            .map(|r| r.name.clone())
            .chain(raw.smtp.iter().map(|s| s.name.clone()))
            .collect();
        self.unique("route", &route_names);
        let smtp_upstreams: Vec<Option<SmtpUpstream>> = raw
            .smtp_upstreams
            .into_iter()
            .enumerate()
            .map(|(i, u)| self.smtp_upstream(i, u))
            .collect();
        let smtp: Vec<Option<SmtpListener>> = raw
            .smtp
            .into_iter()
            .enumerate()
            .map(|(i, l)| self.smtp_listener(i, l, &smtp_upstream_names))
            .collect();
        self.check_listeners(&server, &admin, &smtp);
        for l in smtp.iter().flatten() {
            if l.max_message_size > limits.max_staged_bytes {
                self.problem(
                    &format!("smtp '{}'", l.name),
                    format!(
                        "max_message_size ({} bytes) is more than limits.max_staged_bytes ({} bytes): a message that size could never be held, and would be refused with a 4xx on every retry",
                        l.max_message_size, limits.max_staged_bytes
                    ),
                );
            }
        }

        let upstreams: Vec<Option<Upstream>> = raw
            .upstreams
            .into_iter()
            .enumerate()
            .map(|(i, u)| self.upstream(i, u))
            .collect();
        let routes: Vec<Option<Route>> = raw
            .routes
            .into_iter()
            .enumerate()
            .map(|(i, r)| self.route(i, r, &upstream_names, has_trusted))
            .collect();

        let upstreams: Option<Vec<Upstream>> = upstreams.into_iter().collect();
        let routes: Option<Vec<Route>> = routes.into_iter().collect();
        let smtp_upstreams: Option<Vec<SmtpUpstream>> = smtp_upstreams.into_iter().collect();
        let smtp: Option<Vec<SmtpListener>> = smtp.into_iter().collect();
        if let (Some(listeners), Some(ups)) = (&smtp, &smtp_upstreams) {
            self.check_holds(listeners, ups);
        }
        if let (Some(rs), Some(ups), Some(ls), Some(sups), Some(c)) =
            (&routes, &upstreams, &smtp, &smtp_upstreams, &cluster)
        {
            self.check_spans(rs, ups, ls, sups, c.as_ref());
        }
        Some(Config {
            server: server?,
            admin: admin?,
            cluster: cluster?,
            upstreams: upstreams?,
            routes: routes?,
            smtp_upstreams: smtp_upstreams?,
            smtp: smtp?,
            limits,
        })
    }

    /// The schedule's span under the other rates a route is shaped by: a
    /// request's cost at its upstream's cap, and, with `on_failure =
    /// "local"`, capacity, burst and cost at the fallback's rate /
    /// instances (each instance's share, 30 days apart at the slowest).
    /// Past [`MAX_SPAN`] one request would push a schedule to the end of
    /// time (the arithmetic saturates) and park its client or upstream.
    fn check_spans(
        &mut self,
        routes: &[Route],
        upstreams: &[Upstream],
        listeners: &[SmtpListener],
        smtp_upstreams: &[SmtpUpstream],
        cluster: Option<&ClusterConfig>,
    ) {
        let fallback = |rate: Rate| {
            let c = cluster.filter(|c| c.on_failure == OnFailure::Local)?;
            Some(rate.share(c.instances))
        };
        let shapes = routes
            .iter()
            .map(|r| {
                let most = match r.cost {
                    Cost::Fixed(n) => n,
                    Cost::Header { max, .. } => max,
                };
                let cap = upstreams.get(r.upstream).and_then(|u| u.rate);
                (
                    format!("route '{}'", r.name),
                    r.rate,
                    r.capacity,
                    r.burst,
                    most,
                    cap,
                )
            })
            .chain(listeners.iter().map(|l| {
                let most = match l.cost {
                    SmtpCost::Message => 1,
                    SmtpCost::Recipients => {
                        let most = u32::try_from(l.max_recipients).unwrap_or(u32::MAX);
                        if l.capacity > 0 {
                            most.min(l.capacity)
                        } else {
                            most
                        }
                    }
                };
                let cap = smtp_upstreams.get(l.upstream).and_then(|u| u.rate);
                (
                    format!("smtp '{}'", l.name),
                    l.rate,
                    l.capacity,
                    l.burst,
                    most,
                    cap,
                )
            }));
        for (path, rate, capacity, burst, most, cap) in shapes.collect::<Vec<_>>() {
            if cap.is_some() && cluster.is_some() && most > MAX_SHARED_CAPPED_COST {
                self.problem(
                    &path,
                    format!(
                        "cost {most} under its upstream's rate in cluster mode: at most {MAX_SHARED_CAPPED_COST} (each unit is a slot the store writes in one call, which holds every other instance's calls meanwhile)"
                    ),
                );
            }
            if let Some(cap) = cap {
                self.within_span(
                    &path,
                    &format!("cost {most} at the upstream's rate"),
                    most,
                    cap,
                );
            }
            if let Some(share) = cap.and_then(fallback) {
                let at = "at the upstream's rate / cluster.instances (on_failure = \"local\")";
                self.within_span(&path, &format!("cost {most} {at}"), most, share);
            }
            if let Some(share) = fallback(rate) {
                let at = "at rate / cluster.instances (on_failure = \"local\")";
                self.within_span(&path, &format!("cost {most} {at}"), most, share);
                self.within_span(&path, &format!("capacity {capacity} {at}"), capacity, share);
                let b = burst.saturating_sub(1);
                self.within_span(&path, &format!("burst {burst} {at}"), b, share);
            }
        }
    }

    /// Every listening address once: two sockets on one address would
    /// fail to start, or (both with SO_REUSEPORT) share its connections.
    /// A wildcard address overlaps every address of its family on its
    /// port; port 0 is any free port.
    fn check_listeners(
        &mut self,
        server: &Option<Server>,
        admin: &Option<Option<Admin>>,
        smtp: &[Option<SmtpListener>],
    ) {
        let mut all: Vec<(String, SocketAddr)> = Vec::new();
        if let Some(s) = server {
            all.extend(s.listen.iter().map(|a| ("server.listen".to_owned(), *a)));
        }
        if let Some(Some(a)) = admin {
            all.push(("admin.listen".to_owned(), a.listen));
        }
        for l in smtp.iter().flatten() {
            let owner = format!("smtp '{}': listen", l.name);
            all.extend(l.listen.iter().map(|a| (owner.clone(), *a)));
        }
        let overlap = |a: &SocketAddr, b: &SocketAddr| {
            a.port() == b.port()
                && a.port() != 0
                && a.is_ipv4() == b.is_ipv4()
                && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
        };
        for (i, (owner, addr)) in all.iter().enumerate() {
            // The same address twice in one list is reported with the list.
            let clash = |(other, b): &&(String, SocketAddr)| {
                overlap(addr, b) && !(other == owner && b == addr)
            };
            if let Some((other, theirs)) = all[..i].iter().find(clash) {
                self.problem(
                    owner,
                    format!("{addr} overlaps {theirs} in {other}: each listener needs an address of its own"),
                );
            }
        }
    }

    fn unique(&mut self, kind: &str, names: &[Option<String>]) {
        let mut seen = HashSet::new();
        for name in names.iter().flatten() {
            if !seen.insert(name.as_str()) {
                self.problem(
                    &format!("{kind} '{name}'"),
                    format!("duplicate {kind} name '{name}'"),
                );
            }
        }
    }

    fn cluster(&mut self, raw: Option<raw::RawCluster>) -> Option<Option<ClusterConfig>> {
        let Some(raw) = raw else {
            return Some(None);
        };
        let store = match (raw.redis, raw.postgres) {
            (Some(_), Some(_)) => {
                self.problem(
                    "cluster",
                    "set either redis or postgres, not both: one store holds the shared schedules",
                );
                None
            }
            (None, None) => {
                self.problem(
                    "cluster.redis",
                    "is required, such as \"redis://127.0.0.1:6379\" (or a list of seed nodes of a Redis Cluster), unless cluster.postgres is set",
                );
                None
            }
            (Some(urls), None) => {
                for (set, name) in [
                    (raw.durable.is_some(), "cluster.durable"),
                    (raw.pool_size.is_some(), "cluster.pool_size"),
                ] {
                    if set {
                        self.problem(name, "applies to postgres only");
                    }
                }
                self.redis_store(
                    urls,
                    raw.mode.as_deref(),
                    raw.ca_file.as_deref(),
                    raw.password_file,
                )
            }
            (None, Some(url)) => {
                if raw.mode.is_some() {
                    self.problem("cluster.mode", "applies to redis only");
                }
                if raw.ca_file.is_some() {
                    self.problem(
                        "cluster.ca_file",
                        "applies to redis only (postgres takes sslrootcert in its URL)",
                    );
                }
                self.postgres_store(&url, raw.password_file, raw.durable, raw.pool_size)
            }
        };
        let timeout = self.duration(
            "cluster.timeout",
            raw.timeout.as_deref(),
            Duration::from_millis(50),
        );
        let on_failure = match raw.on_failure.as_deref() {
            None | Some("local") => Some(OnFailure::Local),
            Some("reject") => Some(OnFailure::Reject),
            Some("allow") => Some(OnFailure::Allow),
            Some(other) => {
                self.problem(
                    "cluster.on_failure",
                    format!("'{other}' must be \"local\", \"reject\" or \"allow\""),
                );
                None
            }
        };
        // With on_failure = "local" every instance shapes at rate /
        // instances while the store is unreachable: a missing count would
        // let a fleet of N send N x r. Required then.
        let instances = match raw.instances.map(u32::try_from) {
            None if on_failure == Some(OnFailure::Local) => {
                self.problem(
                    "cluster.instances",
                    "is required with on_failure = \"local\": how many instances share the schedule (each shapes at rate / instances, and an upstream's rate / instances, while the store is unreachable)",
                );
                None
            }
            None => Some(1),
            Some(Ok(n)) if (1..=MAX_INSTANCES).contains(&n) => Some(n),
            _ => {
                self.problem(
                    "cluster.instances",
                    format!("must be a whole number from 1 to {MAX_INSTANCES}"),
                );
                None
            }
        };
        let key_prefix = raw.key_prefix.unwrap_or_else(|| "sluice:".to_owned());
        if key_prefix.contains(['{', '}']) {
            // Redis Cluster hashes only what is inside the first {...}: a
            // brace here would put every client on one slot.
            self.problem(
                "cluster.key_prefix",
                format!("'{key_prefix}' must not contain '{{' or '}}' (Redis Cluster hash tags)"),
            );
        }
        Some(Some(ClusterConfig {
            store: store?,
            key_prefix,
            timeout: timeout?,
            on_failure: on_failure?,
            instances: instances?,
        }))
    }

    fn redis_store(
        &mut self,
        urls: raw::RawUrls,
        mode: Option<&str>,
        ca_file: Option<&str>,
        password_file: Option<String>,
    ) -> Option<Store> {
        use redis::IntoConnectionInfo;
        let raw::RawUrls(urls) = urls;
        let mut ok = !urls.is_empty();
        // The password out of the config (which the service's dynamic
        // user can read only if everyone can): a file, refused if everyone
        // may read it, as a systemd credential is not.
        let password_file = password_file.map(PathBuf::from);
        if let Some(path) = &password_file {
            let file = path.display().to_string();
            self.secret_file("cluster.password_file", "password_file", &file);
            let in_url = urls.iter().any(|u| {
                u.as_str()
                    .into_connection_info()
                    .is_ok_and(|i| i.redis_settings().password().is_some())
            });
            if in_url {
                self.problem(
                    "cluster.password_file",
                    "a node's URL has a password too: give it once",
                );
                ok = false;
            }
        }
        if urls.is_empty() {
            self.problem("cluster.redis", "the list of nodes must not be empty");
        }
        for (i, url) in urls.iter().enumerate() {
            if !["redis://", "rediss://", "unix://", "redis+unix://"]
                .iter()
                .any(|s| url.starts_with(s))
            {
                // Node n, not the URL: a mistyped scheme (`reds://:pw@h`)
                // still holds the password, and this goes to the journal.
                self.problem(
                    "cluster.redis",
                    format!(
                        "node {}: must start with redis://, rediss:// or unix://",
                        i + 1
                    ),
                );
                ok = false;
            } else if let Err(e) = url.as_str().into_connection_info() {
                // What the client will make of it at start (a bad port,
                // database number or fragment); the URL is not shown, for
                // the password it may hold.
                self.problem("cluster.redis", format!("node {}: {e}", i + 1));
                ok = false;
            }
        }
        let mode = match mode {
            None | Some("auto") => Some(RedisMode::Auto),
            Some("standalone") => Some(RedisMode::Standalone),
            Some("cluster") => Some(RedisMode::Cluster),
            Some(other) => {
                self.problem(
                    "cluster.mode",
                    format!("'{other}' must be \"standalone\", \"cluster\" or \"auto\""),
                );
                None
            }
        };
        if mode == Some(RedisMode::Standalone) && urls.len() > 1 {
            self.problem(
                "cluster.redis",
                "a list of nodes needs mode = \"cluster\" or \"auto\"",
            );
            ok = false;
        }
        let ca = match ca_file {
            None => Some(None),
            Some(_) if !urls.iter().all(|u| u.starts_with("rediss://")) => {
                self.problem(
                    "cluster.ca_file",
                    "applies to rediss:// (TLS) nodes, and every node must be one",
                );
                None
            }
            // Checked as the other CA files are; the client takes the PEM.
            Some(file) => match self.ca_file("cluster", "ca_file", file) {
                None => None,
                Some(_) => match std::fs::read(file) {
                    Ok(pem) => Some(Some(pem)),
                    Err(e) => {
                        self.problem("cluster", format!("ca_file '{file}': cannot read: {e}"));
                        None
                    }
                },
            },
        };
        Some(Store::Redis {
            nodes: ok.then_some(urls)?,
            mode: mode?,
            ca: ca?,
            password_file,
        })
    }

    fn postgres_store(
        &mut self,
        url: &str,
        password_file: Option<String>,
        durable: Option<bool>,
        pool_size: Option<i64>,
    ) -> Option<Store> {
        let target = match postgres::parse(url) {
            Ok(t) => Some(t),
            Err(why) => {
                self.problem("cluster.postgres", why);
                None
            }
        };
        let roots = match target.as_ref().and_then(|t| t.root_cert.clone()) {
            Some(file) => Some(self.ca_file(
                "cluster.postgres",
                "sslrootcert",
                &file.display().to_string(),
            )?),
            None => None,
        };
        let password_file = password_file.map(PathBuf::from);
        // Opened, not only looked at: a file `check` can see but the
        // service's user cannot read would pass here and fail at start.
        // Refused if everyone may read it, as the SMTP secrets are.
        if let Some(path) = &password_file {
            let file = path.display().to_string();
            self.secret_file("cluster.password_file", "password_file", &file);
        }
        let pool_size = match pool_size.map(usize::try_from) {
            None => Some(DEFAULT_PG_POOL),
            Some(Ok(n)) if (1..=MAX_PG_POOL).contains(&n) => Some(n),
            _ => {
                self.problem(
                    "cluster.pool_size",
                    format!("must be a whole number from 1 to {MAX_PG_POOL}"),
                );
                None
            }
        };
        Some(Store::Postgres(Box::new(PostgresConfig {
            target: target?,
            roots,
            password_file,
            durable: durable.unwrap_or(false),
            pool_size: pool_size?,
        })))
    }

    fn admin(&mut self, raw: Option<raw::RawAdmin>) -> Option<Option<Admin>> {
        let Some(raw) = raw else {
            return Some(None);
        };
        let text = raw.listen.as_deref().unwrap_or(DEFAULT_ADMIN_LISTEN);
        match text.parse::<SocketAddr>() {
            Ok(listen) if mapped(&listen).is_some() => {
                let v4 = mapped(&listen).unwrap_or(listen);
                self.problem(
                    "admin.listen",
                    format!("'{text}' is an IPv4 address written as IPv6 (IPv6 listeners take IPv6 only): write {v4}"),
                );
                None
            }
            Ok(listen) => Some(Some(Admin {
                listen,
                show_keys: raw.show_keys.unwrap_or(false),
            })),
            Err(_) => {
                self.problem(
                    "admin.listen",
                    format!("'{text}' is not an address with a port, such as 127.0.0.1:9090"),
                );
                None
            }
        }
    }

    /// `[server]`; `http` tells whether there are HTTP routes: without
    /// any, and without `listen`, no HTTP listener is opened (a pure SMTP
    /// relay).
    fn server(&mut self, raw: raw::RawServer, http: bool) -> Option<Server> {
        let listen_raw = match raw.listen {
            Some(l) => l,
            None if http => vec![DEFAULT_LISTEN.to_owned()],
            None => Vec::new(),
        };
        if listen_raw.is_empty() && http {
            self.problem("server.listen", "at least one address is required");
        }
        let listen = self.addresses("server.listen", &listen_raw);
        let mut ok = listen.is_some();
        let listen = listen.unwrap_or_default();
        let header_read_timeout = self.duration(
            "server.header_read_timeout",
            raw.header_read_timeout.as_deref(),
            DEFAULT_HEADER_READ_TIMEOUT,
        );
        let body_read_timeout = self.duration(
            "server.body_read_timeout",
            raw.body_read_timeout.as_deref(),
            DEFAULT_BODY_READ_TIMEOUT,
        );
        let send_timeout = self.duration(
            "server.send_timeout",
            raw.send_timeout.as_deref(),
            DEFAULT_SEND_TIMEOUT,
        );
        let keepalive_timeout = self.duration(
            "server.keepalive_timeout",
            raw.keepalive_timeout.as_deref(),
            DEFAULT_KEEPALIVE_TIMEOUT,
        );
        let max_header_size = match raw.max_header_size {
            None => DEFAULT_MAX_HEADER_SIZE,
            Some(n) => match usize::try_from(n) {
                Ok(n) if (MIN_HEADER_SIZE..=MAX_HEADER_SIZE).contains(&n) => n,
                _ => {
                    self.problem(
                        "server.max_header_size",
                        format!("{n} is out of range: must be {MIN_HEADER_SIZE} to {MAX_HEADER_SIZE} bytes"),
                    );
                    ok = false;
                    DEFAULT_MAX_HEADER_SIZE
                }
            },
        };
        let max_connections = self.positive(
            "server.max_connections",
            raw.max_connections,
            DEFAULT_MAX_CONNECTIONS,
            MAX_CONNECTIONS,
        );
        let workers = raw
            .workers
            .map(|n| self.bounded("server.workers", n, 1, MAX_WORKERS));
        let max_tunnels = self.positive(
            "server.max_tunnels",
            raw.max_tunnels,
            DEFAULT_MAX_CONNECTIONS,
            MAX_CONNECTIONS,
        );
        let drain_timeout = self.duration(
            "server.drain_timeout",
            raw.drain_timeout.as_deref(),
            DEFAULT_DRAIN_TIMEOUT,
        );
        let shutdown_delay = match raw.shutdown_delay.as_deref() {
            // Zero turns it off (the default).
            Some(text) if humantime::parse_duration(text).is_ok_and(|d| d.is_zero()) => {
                Some(Duration::ZERO)
            }
            text => self.duration_up_to(
                "server.shutdown_delay",
                text,
                Duration::ZERO,
                MAX_SHUTDOWN_DELAY,
            ),
        };
        let mut trusted_proxies = Vec::new();
        for text in raw.trusted_proxies.unwrap_or_default() {
            match text
                .parse::<IpNet>()
                .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
            {
                Ok(net) => trusted_proxies.push(net),
                Err(_) => {
                    self.problem(
                        "server.trusted_proxies",
                        format!("'{text}' is not an address or CIDR block, such as 10.0.0.0/8 or 192.0.2.7"),
                    );
                    ok = false;
                }
            }
        }
        let access_log = match raw.access_log {
            Some(text) if text.is_empty() || !Path::new(&text).is_absolute() => {
                self.problem(
                    "server.access_log",
                    format!("'{text}' is not an absolute path, such as /var/log/sluice/access.log"),
                );
                ok = false;
                None
            }
            text => text.map(PathBuf::from),
        };
        ok.then_some(Server {
            listen,
            header_read_timeout: header_read_timeout?,
            body_read_timeout: body_read_timeout?,
            send_timeout: send_timeout?,
            keepalive_timeout: keepalive_timeout?,
            max_header_size,
            max_connections,
            workers,
            drain_timeout: drain_timeout?,
            shutdown_delay: shutdown_delay?,
            max_tunnels,
            trusted_proxies,
            access_log,
        })
    }

    /// Socket addresses, each listed once.
    fn addresses(&mut self, path: &str, list: &[String]) -> Option<Vec<SocketAddr>> {
        let mut out = Vec::new();
        let mut ok = true;
        for a in list {
            match a.parse::<SocketAddr>() {
                Ok(addr) if out.contains(&addr) => {
                    self.problem(path, format!("'{a}' is listed twice"));
                    ok = false;
                }
                Ok(addr) if mapped(&addr).is_some() => {
                    let v4 = mapped(&addr).unwrap_or(addr);
                    self.problem(
                        path,
                        format!("'{a}' is an IPv4 address written as IPv6 (IPv6 listeners take IPv6 only): write {v4}"),
                    );
                    ok = false;
                }
                Ok(addr) => out.push(addr),
                Err(_) => {
                    self.problem(
                        path,
                        format!("'{a}' is not an address with a port, such as 127.0.0.1:8080 or [::1]:8080"),
                    );
                    ok = false;
                }
            }
        }
        ok.then_some(out)
    }

    /// A whole number from `min` to `max` (reported, and `min` used, when
    /// outside).
    fn bounded(&mut self, path: &str, n: i64, min: usize, max: usize) -> usize {
        match usize::try_from(n) {
            Ok(n) if (min..=max).contains(&n) => n,
            _ => {
                self.problem(
                    path,
                    format!("{n} is out of range: must be a whole number from {min} to {max}"),
                );
                min
            }
        }
    }

    /// A size in bytes from 1 to [`MAX_STAGED`], or the default.
    fn size(&mut self, path: &str, raw: Option<RawSize>, default: usize) -> usize {
        let parsed = match raw {
            None => return default,
            Some(RawSize::Bytes(n)) => u64::try_from(n).map_err(|_| format!("{n} must be >= 1")),
            Some(RawSize::Text(t)) => parse_size(&t),
        };
        match parsed {
            Ok(n) if (1..=MAX_STAGED).contains(&n) => usize::try_from(n).unwrap_or(usize::MAX),
            Ok(n) => {
                self.problem(path, format!("{n} bytes is out of range: 1 byte to 1TiB"));
                default
            }
            Err(e) => {
                self.problem(path, e);
                default
            }
        }
    }

    /// A whole number from 1 to `max`, or the default when absent.
    fn positive(&mut self, path: &str, raw: Option<i64>, default: usize, max: usize) -> usize {
        match raw {
            None => default,
            Some(n) => self.bounded(path, n, 1, max),
        }
    }

    /// A humantime duration > 0 and at most a day, or the default.
    fn duration(&mut self, path: &str, raw: Option<&str>, default: Duration) -> Option<Duration> {
        self.duration_up_to(path, raw, default, MAX_TIMEOUT)
    }

    /// A humantime duration > 0 and at most `max`, or the default.
    fn duration_up_to(
        &mut self,
        path: &str,
        raw: Option<&str>,
        default: Duration,
        max: Duration,
    ) -> Option<Duration> {
        let Some(text) = raw else {
            return Some(default);
        };
        match humantime::parse_duration(text) {
            Ok(d) if d > max => {
                self.problem(
                    path,
                    format!(
                        "'{text}' is too long: at most {}",
                        humantime::format_duration(max)
                    ),
                );
                None
            }
            Ok(d) if d > Duration::ZERO => Some(d),
            Ok(_) => {
                self.problem(path, format!("'{text}' must be longer than zero"));
                None
            }
            Err(e) => {
                use humantime::DurationError as E;
                let why = match e {
                    E::UnknownUnit { unit, .. } if unit.is_empty() => {
                        " (a unit is required: ms, s, m, h or d)".to_owned()
                    }
                    E::UnknownUnit { unit, .. } => {
                        format!(" (unknown unit '{unit}'; use ms, s, m, h or d)")
                    }
                    E::NumberOverflow => " (too large or too precise)".to_owned(),
                    E::InvalidCharacter(_) | E::NumberExpected(_) | E::Empty => String::new(),
                };
                self.problem(
                    path,
                    format!("'{text}' is not a duration such as 250ms or 2s{why}"),
                );
                None
            }
        }
    }

    fn upstream(&mut self, index: usize, raw: RawUpstream) -> Option<Upstream> {
        let path = element_path("upstream", index, raw.name.as_deref());
        let name = self.upstream_name(&path, raw.name);
        let url = match raw.url {
            None => {
                self.problem(&path, "url is required, such as http://127.0.0.1:9000");
                None
            }
            Some(text) => self.upstream_url(&path, &text),
        };
        let rate = self.optional_rate(&path, raw.rate);
        let host = self.host_mode(&path, raw.host.as_deref(), url.as_ref());
        let ca = match raw.ca_file {
            None => Some(None),
            Some(file) => self.ca_file(&path, "ca_file", &file).map(Some),
        };
        let on_throttle = match raw.on_throttle.as_deref() {
            None | Some("pass") => Some(OnThrottle::Pass),
            Some("pause") => Some(OnThrottle::Pause),
            Some(other) => {
                self.problem(
                    &path,
                    format!("on_throttle '{other}' must be \"pass\" or \"pause\""),
                );
                None
            }
        };
        let max_pause = self.duration(
            &format!("{path}: max_pause"),
            raw.max_pause.as_deref(),
            DEFAULT_MAX_PAUSE,
        );
        let connect_timeout = self.duration(
            &format!("{path}: connect_timeout"),
            raw.connect_timeout.as_deref(),
            DEFAULT_CONNECT_TIMEOUT,
        );
        let request_timeout = self.duration(
            &format!("{path}: request_timeout"),
            raw.request_timeout.as_deref(),
            DEFAULT_REQUEST_TIMEOUT,
        );
        let read_timeout = self.duration(
            &format!("{path}: read_timeout"),
            raw.read_timeout.as_deref(),
            DEFAULT_READ_TIMEOUT,
        );
        let https = url
            .as_ref()
            .is_some_and(|(u, _)| u.scheme() == Some(&http::uri::Scheme::HTTPS));
        let protocol = match raw.protocol.as_deref() {
            None | Some("http1") => Some(UpstreamProtocol::Http1),
            Some("h2c") if url.is_some() && https => {
                self.problem(&path, "protocol \"h2c\" is HTTP/2 without TLS: the url must be http:// (use \"h2\" for https://)");
                None
            }
            Some("h2c") => Some(UpstreamProtocol::H2c),
            Some("h2") if url.is_some() && !https => {
                self.problem(&path, "protocol \"h2\" is HTTP/2 over TLS: the url must be https:// (use \"h2c\" for http://)");
                None
            }
            Some("h2") => Some(UpstreamProtocol::H2),
            Some("auto") => Some(UpstreamProtocol::Auto),
            Some(other) => {
                self.problem(
                    &path,
                    format!("protocol '{other}' must be \"http1\", \"h2c\", \"h2\" or \"auto\""),
                );
                None
            }
        };
        let (url, url_path) = url?;
        Some(Upstream {
            protocol: protocol?,
            name: name?,
            url,
            path: url_path,
            host: host?,
            ca: ca?,
            on_throttle: on_throttle?,
            max_pause: max_pause?,
            forwarded_headers: raw.forwarded_headers.unwrap_or(true),
            rate: rate?,
            connect_timeout: connect_timeout?,
            request_timeout: request_timeout?,
            read_timeout: read_timeout?,
            max_concurrency: raw.max_concurrency.map(|n| {
                self.positive(
                    &format!("{path}: max_concurrency"),
                    Some(n),
                    1,
                    MAX_CONCURRENCY,
                )
            }),
        })
    }

    /// The `Host` mode: "upstream", "client", or a literal host; by
    /// default the upstream's host when its URL names a DNS host (an https
    /// partner needs it), the client's when it is an IP address.
    fn host_mode(
        &mut self,
        path: &str,
        raw: Option<&str>,
        url: Option<&(http::Uri, String)>,
    ) -> Option<HostMode> {
        match raw {
            Some("upstream") => Some(HostMode::Upstream),
            Some("client") => Some(HostMode::Client),
            Some(literal) => match http::uri::Authority::try_from(literal) {
                Ok(a)
                    if !a.as_str().contains('@')
                        && !literal.is_empty()
                        && !matches!(port_of(&a), Some(Err(_))) =>
                {
                    http::HeaderValue::from_str(literal)
                        .ok()
                        .map(HostMode::Fixed)
                }
                _ => {
                    self.problem(
                        path,
                        format!(
                            "host '{literal}' must be \"upstream\", \"client\" or a host name (with an optional port)"
                        ),
                    );
                    None
                }
            },
            None => {
                let ip = url
                    .and_then(|(u, _)| u.host())
                    .map(|h| h.trim_start_matches('[').trim_end_matches(']'))
                    .is_some_and(|h| h.parse::<std::net::IpAddr>().is_ok());
                Some(if ip {
                    HostMode::Client
                } else {
                    HostMode::Upstream
                })
            }
        }
    }

    /// Certificates read from a PEM file, for an https upstream with a
    /// private CA.
    fn ca_file(
        &mut self,
        path: &str,
        option: &str,
        file: &str,
    ) -> Option<Vec<rustls::pki_types::CertificateDer<'static>>> {
        use rustls::pki_types::CertificateDer;
        use rustls::pki_types::pem::PemObject;
        let pem = match std::fs::read(file) {
            Ok(b) => b,
            Err(e) => {
                self.problem(path, format!("{option} '{file}': cannot read: {e}"));
                return None;
            }
        };
        match CertificateDer::pem_slice_iter(&pem).collect::<Result<Vec<_>, _>>() {
            Ok(certs) if !certs.is_empty() => {
                // What the TLS client will do with them at start.
                let mut roots = rustls::RootCertStore::empty();
                for c in &certs {
                    if let Err(e) = roots.add(c.clone()) {
                        self.problem(path, format!("{option} '{file}': {e}"));
                        return None;
                    }
                }
                Some(certs)
            }
            Ok(_) => {
                self.problem(path, format!("{option} '{file}': has no PEM certificate"));
                None
            }
            Err(e) => {
                self.problem(path, format!("{option} '{file}': {e}"));
                None
            }
        }
    }

    /// An absolute `http` or `https` URL naming a host, with an optional
    /// path (prepended to forwarded paths), without query or credentials;
    /// each violation is its own problem. Returns the URL without its path,
    /// and the path without a trailing '/'.
    fn upstream_url(&mut self, path: &str, text: &str) -> Option<(http::Uri, String)> {
        if text.trim().is_empty() {
            self.problem(
                path,
                "url must not be empty: give one such as http://127.0.0.1:9000",
            );
            return None;
        }
        let uri = match text.parse::<http::Uri>() {
            Ok(u) => u,
            Err(e) => {
                self.problem(path, format!("url '{text}': is not a URL ({e})"));
                return None;
            }
        };
        let Some(authority) = uri.authority().filter(|_| uri.scheme().is_some()) else {
            // A relative or scheme-less URL: the rest of the checks would
            // only restate this.
            self.problem(
                path,
                format!("url '{text}': must start with http:// or https://"),
            );
            return None;
        };
        let mut ok = true;
        if let Some(other) = uri.scheme_str().filter(|s| !matches!(*s, "http" | "https")) {
            self.problem(
                path,
                format!("url '{text}': scheme '{other}' must be http or https"),
            );
            ok = false;
        }
        // (http::Uri takes any text after the host's colon, and a port
        // that is no number was then no port: the scheme's own, 80 or
        // 443, perhaps another service.)
        if let Some(Err(e)) = port_of(authority) {
            self.problem(path, format!("url '{text}': {e}"));
            ok = false;
        }
        if authority.host().is_empty() {
            self.problem(path, format!("url '{text}': a host is required"));
            ok = false;
        } else if uri.scheme_str() == Some("https") {
            // The name TLS verifies the upstream's certificate against.
            let host = authority
                .host()
                .trim_start_matches('[')
                .trim_end_matches(']');
            if let Err(e) = rustls::pki_types::ServerName::try_from(host) {
                self.problem(path, format!("url '{text}': {host}: {e}"));
                ok = false;
            }
        }
        if authority.as_str().contains('@') {
            self.problem(
                path,
                format!("url '{text}': must not contain user info (user:password@)"),
            );
            ok = false;
        }
        if uri.query().is_some() || text.contains('#') {
            self.problem(
                path,
                format!("url '{text}': must not have a query or fragment"),
            );
            ok = false;
        }
        let prefix = uri.path().trim_end_matches('/').to_owned();
        let base = http::Uri::builder()
            .scheme(uri.scheme_str().unwrap_or("http"))
            .authority(authority.clone())
            .path_and_query("/")
            .build();
        match base {
            Ok(base) if ok => Some((base, prefix)),
            _ => None,
        }
    }

    fn route(
        &mut self,
        index: usize,
        raw: RawRoute,
        upstreams: &[Option<String>],
        trusted_proxies: bool,
    ) -> Option<Route> {
        let path = element_path("route", index, raw.name.as_deref());
        let name = self.policy_name(&path, raw.name);
        let matcher = raw.matcher.unwrap_or_default();
        let mut match_ok = true;
        let path_prefix = match matcher.path_prefix {
            None => "/".to_owned(),
            Some(p) if p.starts_with('/') => p,
            Some(p) => {
                self.problem(
                    &path,
                    format!("match.path_prefix '{p}' must start with '/'"),
                );
                match_ok = false;
                String::new()
            }
        };
        let exact = match matcher.path {
            Some(p) if !p.starts_with('/') => {
                self.problem(&path, format!("match.path '{p}' must start with '/'"));
                match_ok = false;
                None
            }
            p => p,
        };
        // Requests are matched by their normalized path: a value that
        // normalizes to something else could never match.
        for (field, value) in [
            ("path_prefix", Some(&path_prefix)),
            ("path", exact.as_ref()),
        ] {
            // A prefix is matched by what follows it too: "/." takes
            // "/.env", though "/." alone normalizes to "/".
            let tail = if field == "path_prefix" { "x" } else { "" };
            if let Some(v) = value.filter(|v| v.starts_with('/'))
                && let Some(normal) = normal_path(v, tail)
            {
                self.problem(
                    &path,
                    format!("match.{field} '{v}' would never match: requests are matched by their normalized path ({normal})"),
                );
                match_ok = false;
            }
        }
        let host = match matcher.host.map(|h| route_host(&h)) {
            Some(Err(why)) => {
                self.problem(&path, why);
                match_ok = false;
                None
            }
            h => h.and_then(Result::ok),
        };
        let methods = match matcher.methods {
            None => None,
            Some(list) if list.is_empty() => {
                self.problem(
                    &path,
                    "match.methods must not be empty (omit it to allow any)",
                );
                match_ok = false;
                None
            }
            Some(list) => {
                let mut methods = Vec::new();
                for m in list {
                    match http::Method::from_bytes(m.to_ascii_uppercase().as_bytes()) {
                        Ok(method) => methods.push(method),
                        Err(_) => {
                            self.problem(
                                &path,
                                format!("match.methods: '{m}' is not an HTTP method"),
                            );
                            match_ok = false;
                        }
                    }
                }
                Some(methods)
            }
        };
        let upstream = self.upstream_ref(&path, raw.upstream, upstreams);
        let key = match raw.key {
            None => {
                self.problem(
                    &path,
                    "key is required: \"ip\", \"forwarded\", \"global\", \"header:NAME\" or a list of them",
                );
                None
            }
            Some(RawKey::One(text)) => self.key(&path, &text).map(|p| KeySpec(vec![p])),
            Some(RawKey::Composite(list)) if list.is_empty() => {
                self.problem(&path, "key list must not be empty");
                None
            }
            Some(RawKey::Composite(list)) => {
                let parts: Vec<Option<KeyPart>> = list.iter().map(|t| self.key(&path, t)).collect();
                parts.into_iter().collect::<Option<Vec<_>>>().map(KeySpec)
            }
        };
        if let Some(k) = &key
            && k.0.contains(&KeyPart::Forwarded)
            && !trusted_proxies
        {
            self.problem(
                &path,
                "key 'forwarded' needs server.trusted_proxies (the proxies whose X-Forwarded-For is believed)",
            );
        }
        let on_missing_key = match raw.on_missing_key.as_deref() {
            None | Some("reject") => Some(OnMissingKey::Reject),
            Some("ip") => Some(OnMissingKey::Ip),
            Some(other) => {
                self.problem(
                    &path,
                    format!("on_missing_key '{other}' must be \"reject\" or \"ip\""),
                );
                None
            }
        };
        let (rate, capacity, burst) = self.shape(&path, raw.rate, raw.capacity, raw.burst);
        let cost = self.cost(&path, raw.cost);
        if let (Some(r), Some(c)) = (rate, &cost) {
            let most = match c {
                Cost::Fixed(n) => *n,
                Cost::Header { max, .. } => *max,
            };
            self.within_span(&path, &format!("cost {most}"), most, r);
        }
        if let (Some(Cost::Fixed(n)), Some(b)) = (&cost, capacity)
            && b > 0
            && *n > b
        {
            self.problem(
                &path,
                format!(
                    "cost {n} is more than capacity {b}: no request could ever wait; capacity = 0 says pure policing, or give at least {n}"
                ),
            );
        }
        let max_wait = match raw.max_wait {
            None => Some(None),
            Some(text) => self
                .duration_up_to(
                    &format!("{path}: max_wait"),
                    Some(&text),
                    Duration::ZERO,
                    MAX_WAIT,
                )
                .map(Some),
        };
        let strip_prefix = match raw.strip_prefix {
            None => Some(None),
            Some(p) if !p.starts_with('/') => {
                self.problem(&path, format!("strip_prefix '{p}' must start with '/'"));
                None
            }
            Some(p)
                if !path_prefix
                    .strip_prefix(p.trim_end_matches('/'))
                    .is_some_and(|rest| rest.is_empty() || rest.starts_with('/')) =>
            {
                self.problem(
                    &path,
                    format!(
                        "strip_prefix '{p}' must begin match.path_prefix '{path_prefix}' and end where a path segment does, so every request it takes has it whole"
                    ),
                );
                None
            }
            Some(p) => Some(Some(p.trim_end_matches('/').to_owned())),
        };
        let max_tunnels_per_key = raw.max_tunnels_per_key.map(|n| {
            self.bounded(
                &format!("{path}.max_tunnels_per_key"),
                n,
                1,
                MAX_CONNECTIONS,
            )
        });
        if !match_ok {
            return None;
        }
        Some(Route {
            name: name?,
            host,
            path_prefix,
            path: exact,
            methods,
            upstream: upstream?,
            key: key?,
            on_missing_key: on_missing_key?,
            rate: rate?,
            capacity: capacity?,
            cost: cost?,
            burst: burst?,
            max_wait: max_wait?,
            dry_run: raw.dry_run.unwrap_or(false),
            ratelimit_headers: raw.ratelimit_headers.unwrap_or(false),
            strip_prefix: strip_prefix?,
            max_tunnels_per_key,
        })
    }

    /// A route's or listener's name: it labels metrics and names queues in
    /// `/status`, so letters, digits, '-', '_' and '.' only.
    /// An upstream's name (`[[upstream]]`, `[[smtp_upstream]]`): any
    /// non-blank text.
    fn upstream_name(&mut self, path: &str, raw: Option<String>) -> Option<String> {
        match raw {
            Some(n) if !n.trim().is_empty() => Some(n),
            Some(_) => {
                self.problem(path, "name must not be empty");
                None
            }
            None => {
                self.problem(path, "name is required");
                None
            }
        }
    }

    fn policy_name(&mut self, path: &str, raw: Option<String>) -> Option<String> {
        match raw {
            Some(n) if n.is_empty() => {
                self.problem(path, "name must not be empty");
                None
            }
            Some(n)
                if !n
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) =>
            {
                self.problem(path, "name may only use letters, digits, '-', '_' and '.'");
                None
            }
            Some(n) => Some(n),
            None => {
                self.problem(path, "name is required");
                None
            }
        }
    }

    /// The index of the upstream named `raw` among `upstreams`.
    fn upstream_ref(
        &mut self,
        path: &str,
        raw: Option<String>,
        upstreams: &[Option<String>],
    ) -> Option<usize> {
        let Some(u) = raw else {
            self.problem(path, "upstream is required");
            return None;
        };
        if let Some(i) = upstreams
            .iter()
            .position(|n| n.as_deref() == Some(u.as_str()))
        {
            return Some(i);
        }
        let known: Vec<String> = upstreams
            .iter()
            .flatten()
            .filter(|n| !n.trim().is_empty())
            .map(|n| format!("'{n}'"))
            .collect();
        let message = if known.is_empty() {
            format!("upstream '{u}' does not exist (no upstream has a name)")
        } else {
            format!(
                "upstream '{u}' does not exist (known: {})",
                known.join(", ")
            )
        };
        self.problem(path, message);
        None
    }

    /// The shaping policy's rate (required), capacity (required) and burst
    /// (default 0).
    fn shape(
        &mut self,
        path: &str,
        rate: Option<String>,
        capacity: Option<i64>,
        burst: Option<i64>,
    ) -> (Option<Rate>, Option<u32>, Option<u32>) {
        let rate = match rate {
            None => {
                self.problem(path, "rate is required, such as \"5/s\"");
                None
            }
            Some(text) => match text.parse::<Rate>() {
                Ok(r) => Some(r),
                Err(e) => {
                    self.problem(path, format!("rate '{text}': {e}"));
                    None
                }
            },
        };
        let capacity = match capacity {
            None => {
                self.problem(path, "capacity is required (a whole number >= 0)");
                None
            }
            Some(n) => match u32::try_from(n) {
                Ok(c) if c <= MAX_CAPACITY => Some(c),
                _ => {
                    self.problem(
                        path,
                        format!("capacity: {n} must be a whole number from 0 to {MAX_CAPACITY}"),
                    );
                    None
                }
            },
        };
        let burst = match burst.map(u32::try_from) {
            None => Some(0),
            Some(Ok(b)) if b <= MAX_BURST => Some(b),
            _ => {
                self.problem(
                    path,
                    format!("burst must be a whole number from 0 to {MAX_BURST}"),
                );
                None
            }
        };
        if let Some(r) = rate {
            if let Some(b) = burst {
                // Its credit: b − 1 intervals.
                self.within_span(path, &format!("burst {b}"), b.saturating_sub(1), r);
            }
            if let Some(c) = capacity {
                self.within_span(path, &format!("capacity {c}"), c, r);
            }
        }
        (rate, capacity, burst)
    }

    /// `n` intervals of `rate` (a burst's credit, a full queue, one
    /// request's cost) within [`MAX_SPAN`]: the schedule's arithmetic
    /// saturates past it, which would let everything through or keep a
    /// client's state for ever.
    pub(crate) fn within_span(&mut self, path: &str, field: &str, n: u32, rate: Rate) {
        let span = u128::from(n) * u128::from(rate.interval_nanos());
        if span > MAX_SPAN.as_nanos() {
            self.problem(
                path,
                format!(
                    "{field}: {n} intervals of {} (the rate's) span {} days, and the schedule holds at most {} days",
                    humantime::format_duration(rate.interval()),
                    span / 86_400_000_000_000,
                    MAX_SPAN.as_secs() / 86_400
                ),
            );
        }
    }

    /// An optional rate (an upstream's cap).
    fn optional_rate(&mut self, path: &str, raw: Option<String>) -> Option<Option<Rate>> {
        match raw {
            None => Some(None),
            Some(text) => match text.parse::<Rate>() {
                Ok(r) => Some(Some(r)),
                Err(e) => {
                    self.problem(path, format!("rate '{text}': {e}"));
                    None
                }
            },
        }
    }

    fn cost(&mut self, path: &str, raw: Option<RawCost>) -> Option<Cost> {
        let whole = |n: i64| {
            u32::try_from(n)
                .ok()
                .filter(|&n| (1..=MAX_COST).contains(&n))
        };
        let h = match raw {
            None => return Some(Cost::Fixed(1)),
            Some(RawCost::Fixed(n)) => {
                return match whole(n) {
                    Some(n) => Some(Cost::Fixed(n)),
                    None => {
                        self.problem(
                            path,
                            format!("cost: {n} must be a whole number from 1 to {MAX_COST}"),
                        );
                        None
                    }
                };
            }
            Some(RawCost::Header(h)) => h,
        };
        let name = match h.header.as_deref() {
            None => {
                self.problem(path, "cost.header is required in a cost table");
                None
            }
            Some(text) => match HeaderName::from_bytes(text.as_bytes()) {
                Ok(name) => Some(name),
                Err(_) => {
                    self.problem(
                        path,
                        format!("cost.header '{text}' is not a valid header name"),
                    );
                    None
                }
            },
        };
        let max = match h.max {
            None => {
                self.problem(
                    path,
                    "cost.max is required with cost.header (a client must not claim any cost it likes)",
                );
                None
            }
            Some(n) if whole(n).is_none() => {
                self.problem(
                    path,
                    format!("cost.max: {n} must be a whole number from 1 to {MAX_COST}"),
                );
                None
            }
            Some(n) => whole(n),
        };
        let default = match h.default {
            None => Some(1),
            Some(n) if whole(n).is_none() => {
                self.problem(
                    path,
                    format!("cost.default: {n} must be a whole number from 1 to {MAX_COST}"),
                );
                None
            }
            Some(n) => whole(n),
        };
        if let (Some(d), Some(m)) = (default, max)
            && d > m
        {
            self.problem(
                path,
                format!("cost.default {d} is larger than cost.max {m}"),
            );
            return None;
        }
        Some(Cost::Header {
            name: name?,
            default: default?,
            max: max?,
        })
    }

    fn key(&mut self, path: &str, text: &str) -> Option<KeyPart> {
        match text {
            "ip" => Some(KeyPart::Ip),
            "global" => Some(KeyPart::Global),
            "forwarded" => Some(KeyPart::Forwarded),
            _ => match text.split_once(':') {
                Some(("header", name)) => match HeaderName::from_bytes(name.trim().as_bytes()) {
                    Ok(h) => Some(KeyPart::Header(h)),
                    Err(_) => {
                        self.problem(
                            path,
                            format!("key 'header:{name}': '{name}' is not a valid header name"),
                        );
                        None
                    }
                },
                _ => {
                    self.problem(
                        path,
                        format!(
                            "key '{text}': must be \"ip\", \"forwarded\", \"global\" or \"header:NAME\""
                        ),
                    );
                    None
                }
            },
        }
    }
}

#[cfg(test)]
mod tests;

/// The IPv4 address an IPv4-mapped IPv6 one (`[::ffff:127.0.0.1]:80`)
/// stands for: a listener cannot take it (IPv6 sockets are IPv6 only).
fn mapped(addr: &SocketAddr) -> Option<SocketAddr> {
    match addr {
        SocketAddr::V6(v6) => v6
            .ip()
            .to_ipv4_mapped()
            .map(|v4| SocketAddr::from((v4, v6.port()))),
        SocketAddr::V4(_) => None,
    }
}

/// An authority's port, if it gives one: from 1 to 65535, or why not.
fn port_of(authority: &http::uri::Authority) -> Option<Result<u16, String>> {
    // (User info is refused apart: the text begins with the host.)
    let after = authority.as_str().strip_prefix(authority.host())?;
    let port = after.strip_prefix(':')?;
    Some(match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!("'{port}' is not a port (1 to 65535)")),
    })
}

/// A route's `match.host` as requests are compared with it: lower case,
/// an IPv6 literal without brackets, no root dot; `*.example.com` for any
/// name under example.com. A port is refused (a request's is ignored).
fn route_host(raw: &str) -> Result<String, String> {
    let h = raw.trim().to_ascii_lowercase();
    let not = |why: &str| Err(format!("match.host '{raw}' {why}"));
    if h.is_empty() || h.contains(['/', '@', ' ']) {
        return not("is not a host name");
    }
    if let Some(inner) = h.strip_prefix('[') {
        return match inner
            .strip_suffix(']')
            .map(str::parse::<std::net::Ipv6Addr>)
        {
            Some(Ok(ip)) => Ok(ip.to_string()),
            _ => not("is not an IPv6 address in brackets (a port is not part of the match)"),
        };
    }
    if let Ok(ip) = h.parse::<std::net::Ipv6Addr>() {
        return Ok(ip.to_string());
    }
    if h.contains(':') {
        return not("has a port: a request's port is ignored, give the host alone");
    }
    let h = h.strip_suffix('.').unwrap_or(&h);
    let name = h.strip_prefix("*.").unwrap_or(h);
    if name.is_empty() || name.contains('*') || name.split('.').any(str::is_empty) {
        return not("is not a host name (a wildcard may only start it: '*.example.com')");
    }
    Ok(h.to_owned())
}

/// What a route's path (followed by `tail`) becomes when normalized as a
/// request's is, if that is something else.
fn normal_path(p: &str, tail: &str) -> Option<String> {
    let whole = format!("{p}{tail}");
    match crate::http::path::normalize(&whole) {
        // Routes match the path without its `;` parameters.
        Ok(n) if n.contains(';') => Some(format!(
            "'{}', without its ';' parameters",
            crate::http::path::without_parameters(&n)
                .strip_suffix(tail)
                .unwrap_or(&n)
        )),
        Ok(n) if n == whole => None,
        Ok(n) => Some(format!("'{}'", n.strip_suffix(tail).unwrap_or(&n))),
        Err(e) => Some(format!("refused: {e}")),
    }
}
