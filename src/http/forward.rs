//! The upstream side: a keep-alive connection pool per upstream and
//! worker (http, or https through rustls), so that a request never leaves
//! the thread that accepted it; request rewriting, and the 502/504 mapping.
//!
//! A request without a body to an HTTP/1.1 upstream (most of what a proxy
//! forwards; plain or TLS) is sent by sluice's own client ([`client`]);
//! the rest (bodies, HTTP/2, protocol switches) by hyper's.
//!
//! The pool is deliberately small: idle HTTP/1.1 connections in a stack
//! (the most recently used first, so a few stay warm), a connection goes
//! back when its response body has been read to the end, and a request
//! that a pooled connection never started to send is retried once on a
//! fresh one (with sluice's own client, also one the connection closed
//! without answering, when sending it twice is safe). HTTP/2 upstreams
//! (`h2c`, `h2`, or `auto` when ALPN picks h2) get a few multiplexed
//! connections per worker, each request on the least busy one; a new
//! connection is opened (one at a time) only when every open one carries
//! `H2_STREAMS` streams. HTTP/1.1 connections are driven with upgrades on,
//! so a `101` hands back the raw connection for a tunnel.

use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{
    CONNECTION, CONTENT_LENGTH, EXPECT, HOST, HeaderMap, HeaderName, HeaderValue, TE, TRAILER,
    TRANSFER_ENCODING, UPGRADE,
};
use http::request::Parts;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::{http1, http2};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_util::either::Either;
use tracing::debug;

use super::ServeError;
use super::client::{self, IDLE_TIMEOUT, MAX_IDLE};
use super::h1::RequestBody;
use super::handler::safe_to_repeat;
use super::headers::{
    accepts_trailers, add_forwarded, append_via, foreign_transfer_coding, join_cookies,
    name_te_in_connection, one_length, strip_forwarded, strip_hop_by_hop, upgrade_to,
};
use super::in_flight::{CallSlot, InFlight};
use super::response::{ProxyBody, deadline_passed, problem};
use super::stage::Begun;
use super::stall::Stalls;
use crate::admission::ReadDeadline;
use crate::config::{self, HostMode, OnThrottle, UpstreamProtocol};
use crate::metrics::{self as m, Outcome};

type Sender = http1::SendRequest<OutBody>;
type H2Sender = http2::SendRequest<OutBody>;

/// Streams per HTTP/2 connection before another is opened, and most
/// HTTP/2 connections per upstream and worker (past them, streams queue
/// on the least busy one).
const H2_STREAMS: usize = 100;
const H2_CONNECTIONS: usize = 4;

/// How long past a gRPC call's deadline its answer is waited for (the
/// upstream's own DEADLINE_EXCEEDED is on its way), and the longest wait
/// whatever the deadline.
const GRPC_GRACE: Duration = Duration::from_secs(1);
const GRPC_LONGEST: Duration = Duration::from_secs(30 * 86_400);

/// What an upstream HTTP/2 stream may send before its client reads it, and
/// what the whole connection may. The connection's window is shared by
/// streams of different clients: at hyper's defaults (2 MiB a stream,
/// 5 MiB the connection) three clients that stop reading large answers
/// froze every other call on the connection. With these, it takes 64.
const H2_UPSTREAM_STREAM_WINDOW: u32 = 256 * 1024;
const H2_UPSTREAM_CONNECTION_WINDOW: u32 = 64 * H2_UPSTREAM_STREAM_WINDOW;

/// Idle connections, most recently used last (hyper's, and sluice's own
/// client's); open HTTP/2 connections.
#[derive(Default)]
struct Pool {
    idle: Mutex<Vec<(Sender, Instant)>>,
    own: Arc<client::Idle>,
    h2: Mutex<Vec<(H2Sender, Arc<()>)>>,
    /// One HTTP/2 connect at a time.
    h2_connecting: tokio::sync::Mutex<()>,
    /// An `auto` upstream's ALPN chose HTTP/1.1: its connects need not
    /// wait for each other (each would be a connection of its own).
    alpn_h1: AtomicBool,
    /// HTTP/2 connects that failed: a request that waited for one that
    /// failed fails with it, instead of trying again after it (one
    /// `connect_timeout` after another behind an upstream that drops
    /// SYNs).
    h2_failures: AtomicU64,
}

impl Pool {
    /// The least busy open HTTP/2 connection with room, and a guard
    /// counting the stream on it (`Arc` strong count: 1 + streams); when
    /// all are full, the least busy once `H2_CONNECTIONS` are open.
    fn h2(&self) -> Option<(H2Sender, Arc<()>)> {
        self.h2_with_room(true)
    }

    /// The least busy open HTTP/2 connection, however busy.
    fn h2_least(&self) -> Option<(H2Sender, Arc<()>)> {
        self.h2_with_room(false)
    }

    fn h2_with_room(&self, room: bool) -> Option<(H2Sender, Arc<()>)> {
        let mut conns = self.h2.lock().unwrap_or_else(|e| e.into_inner());
        conns.retain(|(tx, _)| !tx.is_closed());
        let least = conns
            .iter()
            .min_by_key(|(_, streams)| Arc::strong_count(streams))?;
        let busy = Arc::strong_count(&least.1) > H2_STREAMS;
        if room && busy && conns.len() < H2_CONNECTIONS {
            return None;
        }
        Some((least.0.clone(), least.1.clone()))
    }

    fn add_h2(&self, tx: H2Sender) -> Arc<()> {
        let streams = Arc::new(());
        let mut conns = self.h2.lock().unwrap_or_else(|e| e.into_inner());
        conns.push((tx, streams.clone()));
        streams
    }

    /// The most recently used idle connection that is ready for a
    /// request. A connection whose answer came before its request's body
    /// was all sent (an upstream that answers early) is back in the pool
    /// while that body still uploads, and is not ready until it is done:
    /// the next request takes another, or a new one, rather than wait
    /// behind a slow client's upload. (One whose answer was read to its
    /// end is ready by then: hyper's connection task asks for the next
    /// request as it delivers the last of the answer.)
    fn take(&self) -> Option<Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        // Worn-out ones off the top (the most recent is the usual pick).
        while let Some((sender, since)) = idle.last() {
            if since.elapsed() < IDLE_TIMEOUT && !sender.is_closed() {
                break;
            }
            idle.pop();
        }
        let ready = idle
            .iter()
            .rposition(|(s, since)| s.is_ready() && since.elapsed() < IDLE_TIMEOUT)?;
        Some(idle.remove(ready).0)
    }

    /// Whether an `auto` upstream has HTTP/1.1 connections (ALPN chose
    /// it).
    fn has_h1(&self) -> bool {
        !self
            .idle
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_empty()
    }

    fn put(&self, sender: Sender) {
        if sender.is_closed() {
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push((sender, Instant::now()));
        }
    }
}

/// Why no connection could be had.
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    #[error("connect timed out")]
    Timeout,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("handshake: {0}")]
    Http(#[from] hyper::Error),
    #[error("the upstream did not agree to HTTP/2 (ALPN)")]
    NoH2,
    #[error("the new HTTP/2 connection closed at once")]
    Closed,
    #[error("the connect this request waited for failed")]
    FailedMeanwhile,
}

/// A new upstream connection.
enum Connected {
    H1(Sender),
    H2(H2Sender),
}

/// What a response needs to hand its connection back: an HTTP/1.1
/// sender for the pool, or an HTTP/2 stream's count.
enum Back {
    H1(Sender),
    H2(Arc<()>),
}

/// A response body from hyper's client (and what gives its connection
/// back), or from sluice's own.
enum Answer {
    Hyper(Incoming, Back),
    Own(client::Incoming),
}

/// What a request's head keeps from its arrival for its departure's
/// rewrite: the client's address and the host it asked for.
pub struct Origin {
    peer: IpAddr,
    /// The peer is one of `trusted_proxies`: the scheme and host it
    /// forwards for are believed.
    trusted: bool,
    host: Option<HeaderValue>,
}

/// What an upstream's connections are made to and with (the rest of its
/// settings apply per call).
#[derive(PartialEq)]
struct Connects {
    /// Scheme and authority.
    url: http::Uri,
    protocol: UpstreamProtocol,
    ca: Option<Vec<rustls::pki_types::CertificateDer<'static>>>,
}

/// One configured upstream, as one worker sees it.
pub struct Upstream {
    name: String,
    scheme: Scheme,
    authority: Authority,
    /// The host to connect to (the URL's, without brackets).
    addr_host: String,
    port: u16,
    /// The URL's path, prepended to forwarded paths ("" for none).
    path: String,
    host: HostMode,
    on_throttle: OnThrottle,
    max_pause: Duration,
    /// `X-Forwarded-*` added (`forwarded_headers`).
    forwarded_headers: bool,
    /// TLS for https upstreams, with the name to verify.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    protocol: UpstreamProtocol,
    connect_timeout: Duration,
    request_timeout: Duration,
    /// `read_timeout`: the longest pause within an answer's body.
    read_timeout: Duration,
    /// This worker's idle connections.
    pool: Arc<Pool>,
    /// What its connections are made to and with: a reload that leaves
    /// it the same keeps them (the pool).
    connects: Connects,
    duration: Arc<m::Histogram>,
    /// `max_concurrency`: a slot per call in flight, held until the
    /// response body has been sent.
    concurrency: Option<Arc<InFlight>>,
}

impl Upstream {
    pub fn new(
        cfg: &config::Upstream,
        tls: &Arc<rustls::ClientConfig>,
        concurrency: Option<Arc<InFlight>>,
    ) -> Result<Upstream, ServeError> {
        let scheme = cfg.url.scheme().cloned().unwrap_or(Scheme::HTTP);
        let authority = cfg.url.authority().cloned().ok_or_else(|| {
            ServeError::Client(format!("upstream '{}': url has no host", cfg.name))
        })?;
        let https = scheme == Scheme::HTTPS;
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
        let tls = if https {
            let name = ServerName::try_from(host.clone())
                .map_err(|e| ServeError::Client(format!("upstream '{}': {host}: {e}", cfg.name)))?;
            let config = match &cfg.ca {
                Some(certs) => crate::tls::private_ca_config(certs).map_err(|e| {
                    ServeError::Client(format!("upstream '{}': ca_file: {e}", cfg.name))
                })?,
                None => tls.clone(),
            };
            // ALPN: what the protocol setting offers.
            let alpn: &[&[u8]] = match cfg.protocol {
                UpstreamProtocol::H2 => &[b"h2"],
                UpstreamProtocol::Auto => &[b"h2", b"http/1.1"],
                UpstreamProtocol::Http1 | UpstreamProtocol::H2c => &[],
            };
            let config = if alpn.is_empty() {
                config
            } else {
                let mut c = (*config).clone();
                c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
                Arc::new(c)
            };
            Some((TlsConnector::from(config), name))
        } else {
            None
        };
        Ok(Upstream {
            name: cfg.name.clone(),
            scheme,
            authority,
            addr_host: host,
            path: cfg.path.clone(),
            host: cfg.host.clone(),
            on_throttle: cfg.on_throttle,
            max_pause: cfg.max_pause,
            forwarded_headers: cfg.forwarded_headers,
            port,
            tls,
            // `auto` without TLS has no ALPN to ask: HTTP/1.1.
            protocol: match cfg.protocol {
                UpstreamProtocol::Auto if !https => UpstreamProtocol::Http1,
                p => p,
            },
            connect_timeout: cfg.connect_timeout,
            request_timeout: cfg.request_timeout,
            read_timeout: cfg.read_timeout,
            pool: Arc::default(),
            connects: Connects {
                url: cfg.url.clone(),
                protocol: cfg.protocol,
                ca: cfg.ca.clone(),
            },
            duration: m::histogram(m::UPSTREAM_DURATION_SECONDS, &[("upstream", &cfg.name)]),
            concurrency,
        })
    }

    /// Take `old`'s connections (open, idle) when it is this upstream as a
    /// reload found it: same name, connected to the same place the same
    /// way (Envoy keeps an unchanged cluster's the same). Its timeouts,
    /// Host and the rest may have changed: they apply per call.
    pub fn keep_connections_of(&mut self, old: &Upstream) {
        if self.name == old.name && self.connects == old.connects {
            self.pool = old.pool.clone();
        }
    }

    /// `read_timeout`: also how long a tunnel may stay silent both ways.
    pub fn read_timeout(&self) -> Duration {
        self.read_timeout
    }

    /// The longest an upstream's own pause is honoured (`max_pause`).
    pub fn max_pause(&self) -> Duration {
        self.max_pause
    }

    /// `max_concurrency`'s in-flight slots, if capped.
    pub fn concurrency(&self) -> Option<&Arc<InFlight>> {
        self.concurrency.as_ref()
    }

    /// The upstream's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Time allowed until response headers.
    pub fn request_timeout(&self) -> Duration {
        self.request_timeout
    }

    /// Point an inbound request at this upstream, on its arrival: the
    /// target in origin form (`/path?query`, RFC 9112 3.2.1, as nginx and
    /// HAProxy send it) with the upstream's path prefix (and the route's
    /// `strip_prefix` removed; the query byte for byte). HTTP/2 adds its
    /// `:scheme` and `:authority` when it sends ([`to_h2`]). `None`
    /// when the target cannot be forwarded (400). What the rest of the
    /// head needs from the client's target (its host) is returned for
    /// [`Upstream::rewrite`].
    pub fn retarget(
        &self,
        parts: &mut Parts,
        peer: SocketAddr,
        trusted: bool,
        strip: Option<&str>,
    ) -> Option<Origin> {
        // The target's authority first (RFC 9112 3.2.2), as routing does.
        let host = parts
            .uri
            .authority()
            .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
            .or_else(|| parts.headers.get(HOST).cloned());
        parts.uri = Uri::from(self.map_path(parts.uri.path_and_query(), strip)?);
        Some(Origin {
            peer: peer.ip(),
            trusted,
            host,
        })
    }

    /// Rewrite the headers of a request [`Upstream::retarget`]ed, on its
    /// departure: the `Host` its mode says, hop-by-hop headers and
    /// `Expect` removed (sluice answers `100-continue` itself),
    /// `X-Forwarded-*` and `Via` added. Done at the departure, not the
    /// arrival, so that a held request's header table is the client's
    /// alone (adding five headers to a small request doubles its table).
    pub fn rewrite(&self, parts: &mut Parts, origin: Origin) {
        let Origin {
            peer,
            trusted,
            host,
        } = origin;
        let upgrade = upgrade_to(&parts.headers);
        let trailers = accepts_trailers(&parts.headers);
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(EXPECT);
        // No HTTP client sends `Proxy`; a CGI-style upstream would read it
        // as `HTTP_PROXY`, its own outbound proxy (httpoxy, CVE-2016-5385).
        parts.headers.remove(PROXY);
        // Room for what is added below (X-Forwarded-For, -Proto, -Host,
        // Via, Host) in one growth of the table, not one per doubling (a
        // head sluice's own HTTP/1.1 server parsed has the room already).
        let _ = parts.headers.try_reserve(5);
        // Passed on as such: a protocol switch (tunnelled after a 101),
        // and the client's acceptance of trailers (gRPC needs it).
        if let Some(to) = upgrade {
            parts
                .headers
                .insert(CONNECTION, HeaderValue::from_static("upgrade"));
            parts.headers.insert(UPGRADE, to);
        }
        if trailers {
            parts
                .headers
                .insert(TE, HeaderValue::from_static("trailers"));
        }
        // The HTTP/1.1 client writes each field on a line of its own: one
        // `Cookie`, and one `Content-Length` (HTTP/2 lets a client repeat
        // an agreeing one, which a strict HTTP/1.1 server refuses).
        join_cookies(&mut parts.headers);
        one_length(&mut parts.headers);
        if self.forwarded_headers {
            add_forwarded(&mut parts.headers, peer, trusted, host.as_ref());
        } else {
            strip_forwarded(&mut parts.headers);
        }
        append_via(&mut parts.headers, parts.version);
        let host = match &self.host {
            HostMode::Upstream => HeaderValue::from_str(self.authority.as_str()).ok(),
            // A client that sent none (HTTP/1.0): the upstream's own, so
            // that the upstream always gets one.
            HostMode::Client => {
                host.or_else(|| HeaderValue::from_str(self.authority.as_str()).ok())
            }
            HostMode::Fixed(v) => Some(v.clone()),
        };
        match host {
            Some(host) => parts.headers.insert(HOST, host),
            None => parts.headers.remove(HOST),
        };
        parts.version = Version::HTTP_11;
    }

    /// The path sent upstream: the upstream URL's path, then the request's
    /// path without the route's `strip_prefix`, then the query unchanged.
    fn map_path(&self, pq: Option<&PathAndQuery>, strip: Option<&str>) -> Option<PathAndQuery> {
        let original = pq
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        if self.path.is_empty() && strip.is_none() {
            return Some(original);
        }
        let path = original.path();
        let rest = match strip.map(|s| path.strip_prefix(s)) {
            None | Some(None) => path,
            Some(Some(rest)) if rest.is_empty() || rest.starts_with('/') => rest,
            // The prefix ends inside a segment ("/api" of "/api../admin"):
            // what is left of the segment, after a '/', could be a dot
            // segment that takes the upstream out of its base path.
            Some(Some(_)) => return None,
        };
        let mut out = String::with_capacity(
            self.path.len() + rest.len() + 2 + original.query().map_or(0, str::len),
        );
        out.push_str(&self.path);
        if !rest.starts_with('/') {
            out.push('/');
        }
        out.push_str(rest);
        if let Some(q) = original.query() {
            out.push('?');
            out.push_str(q);
        }
        PathAndQuery::try_from(out).ok()
    }

    /// Whether every body for this upstream is staged before it is sent,
    /// so that a throttled request can be sent again.
    pub fn stages_everything(&self) -> bool {
        self.on_throttle == OnThrottle::Pause
    }

    /// Send a prepared request and stream the response back; 502 when the
    /// upstream cannot be reached, 504 when it does not answer in time.
    /// With `on_throttle = "pause"`, a 429 or 503 that says when to come
    /// back also returns that instant.
    /// `permit` is the request's `max_concurrency` slot, held until its
    /// response body has been sent. A `101` also returns the upstream's
    /// side of the protocol switch, and the slot with it: the tunnel
    /// holds it while it is open (as Envoy's and HAProxy's connection
    /// limits count upgraded connections).
    pub async fn forward(
        &self,
        parts: Parts,
        body: OutBody,
        mut permit: Option<CallSlot>,
        deadline: Option<Instant>,
    ) -> (
        Response<ProxyBody>,
        Outcome,
        Option<Instant>,
        Option<(OnUpgrade, Option<CallSlot>)>,
    ) {
        let started = Instant::now();
        // A gRPC call with a deadline waits for its answer as long as the
        // deadline says (a server sends a streamed upload's or a long
        // call's headers late, with its answer), not request_timeout.
        let limit = match deadline {
            Some(d) => (d.saturating_duration_since(started) + GRPC_GRACE).min(GRPC_LONGEST),
            None => self.request_timeout,
        };
        let progress = deadline.is_none().then(|| body.progress()).flatten();
        let result = match progress {
            None => tokio::time::timeout(limit, self.send(parts, body))
                .await
                .map_err(|_| Late::Upstream),
            Some(progress) => within_after(limit, started, &progress, self.send(parts, body)).await,
        };
        self.duration.record(started.elapsed());
        match result {
            Err(Late::Body) => {
                debug!(upstream = %self.name, "the client's body came too slowly");
                (
                    problem(
                        StatusCode::REQUEST_TIMEOUT,
                        "the request body came too slowly (server.body_read_timeout, then 500 bytes/s)",
                        None,
                    ),
                    Outcome::Invalid,
                    None,
                    None,
                )
            }
            Err(Late::Upstream) => {
                debug!(upstream = %self.name, "upstream timed out");
                let detail = "the upstream did not answer in time";
                (
                    // (A gRPC call waits as long as its own deadline
                    // says: at most GRPC_LONGEST, past which the deadline
                    // has not passed, sluice gave up.)
                    if deadline.is_some_and(|d| d <= Instant::now()) {
                        deadline_passed(detail)
                    } else {
                        problem(StatusCode::GATEWAY_TIMEOUT, detail, None)
                    },
                    Outcome::UpstreamError,
                    None,
                    None,
                )
            }
            // The client's body failed while it streamed upstream: its
            // error (400), not the upstream's.
            Ok(Err(SendError::Request(e))) if e.is_user() => {
                debug!(upstream = %self.name, error = %e, "client body failed");
                (
                    problem(
                        StatusCode::BAD_REQUEST,
                        "the request body is malformed",
                        None,
                    ),
                    Outcome::Invalid,
                    None,
                    None,
                )
            }
            Ok(Err(e)) => {
                debug!(upstream = %self.name, error = %e, "upstream request failed");
                (
                    problem(StatusCode::BAD_GATEWAY, e.detail(), None),
                    Outcome::UpstreamError,
                    None,
                    None,
                )
            }
            Ok(Ok((parts, _))) if foreign_transfer_coding(&parts.headers) => {
                debug!(upstream = %self.name, "upstream answered with a transfer coding other than chunked");
                (
                    problem(
                        StatusCode::BAD_GATEWAY,
                        "the upstream answered with a transfer coding other than chunked",
                        None,
                    ),
                    Outcome::UpstreamError,
                    None,
                    None,
                )
            }
            Ok(Ok((mut parts, answer))) => {
                let throttle = match self.on_throttle {
                    OnThrottle::Pause => {
                        super::throttle::pause_until(parts.status, &parts.headers, self.max_pause)
                    }
                    OnThrottle::Pass => None,
                };
                // A switch: the connection is the tunnel's now, never the
                // pool's; the client is told the same protocol.
                let switched = parts.status == StatusCode::SWITCHING_PROTOCOLS;
                let upgrade = if switched {
                    parts
                        .extensions
                        .remove::<OnUpgrade>()
                        .map(|u| (u, permit.take()))
                } else {
                    None
                };
                let to = switched
                    .then(|| parts.headers.get(UPGRADE).cloned())
                    .flatten();
                strip_hop_by_hop(&mut parts.headers);
                if let Some(to) = to {
                    parts
                        .headers
                        .insert(CONNECTION, HeaderValue::from_static("upgrade"));
                    parts.headers.insert(UPGRADE, to);
                }
                append_via(&mut parts.headers, parts.version);
                let body = match answer {
                    Answer::Hyper(body, back) => {
                        one_length(&mut parts.headers);
                        let (sender, stream) = match back {
                            Back::H1(s) if !switched => (Some(s), None),
                            Back::H1(_) => (None, None),
                            Back::H2(streams) => (None, Some(streams)),
                        };
                        let body = Returning {
                            body,
                            sender,
                            pool: self.pool.clone(),
                            _stream: stream,
                            _permit: permit,
                        };
                        Stalls::new(body, self.read_timeout).boxed()
                    }
                    Answer::Own(mut body) => {
                        body.hold(permit);
                        Stalls::new(body, self.read_timeout).boxed()
                    }
                };
                (
                    Response::from_parts(parts, body),
                    Outcome::Forwarded,
                    throttle,
                    upgrade,
                )
            }
        }
    }

    /// Send on a pooled connection, or a new one; a request a pooled
    /// connection never started to send (it was closing) goes once more on
    /// a new connection. A request without a body to an HTTP/1.1 upstream
    /// goes through sluice's own client ([`client`]).
    async fn send(
        &self,
        parts: Parts,
        body: OutBody,
    ) -> Result<(http::response::Parts, Answer), SendError> {
        let sent = if self.protocol != UpstreamProtocol::Http1 {
            Box::pin(self.send_h2(Request::from_parts(parts, body))).await
        } else if client::takes(&parts, body.is_end_stream()) {
            let mut parts = parts;
            name_te_in_connection(&mut parts.headers);
            return self.send_own(&parts).await;
        } else {
            self.send_h1(Request::from_parts(parts, body), None).await
        };
        let (response, back) = sent?;
        let (parts, body) = response.into_parts();
        Ok((parts, Answer::Hyper(body, back)))
    }

    /// On sluice's own client: a pooled connection, else a new one. When
    /// a pooled connection turns out closed (the upstream closed it as it
    /// was taken), the request goes once more on a new connection: always
    /// when its head could not be written, and when the connection closed
    /// without a byte of answer only if sending it twice is safe.
    async fn send_own(&self, parts: &Parts) -> Result<(http::response::Parts, Answer), SendError> {
        if let Some(conn) = self.pool.own.take() {
            match client::exchange(conn, parts, &self.pool.own).await {
                Err(client::Error::Unsent(e)) => {
                    debug!(upstream = %self.name, error = %e, "pooled connection closed; sending again");
                }
                Err(client::Error::Unanswered) if safe_to_repeat(parts) => {
                    debug!(upstream = %self.name, "pooled connection closed unanswered; sending again");
                }
                other => {
                    return other
                        .map(|(p, b)| (p, Answer::Own(b)))
                        .map_err(SendError::Own);
                }
            }
        }
        let conn = client::Conn::new(self.connect_own().await?);
        client::exchange(conn, parts, &self.pool.own)
            .await
            .map(|(p, b)| (p, Answer::Own(b)))
            .map_err(SendError::Own)
    }

    /// A new connection for sluice's own client: TCP, and TLS for https
    /// (no ALPN: an HTTP/1.1 upstream), within `connect_timeout`.
    async fn connect_own(&self) -> Result<client::Io, ConnectError> {
        let connect = async {
            let tcp = self.tcp().await?;
            Ok::<client::Io, std::io::Error>(match &self.tls {
                None => Either::Left(tcp),
                Some((connector, name)) => {
                    Either::Right(Box::new(connector.connect(name.clone(), tcp).await?))
                }
            })
        };
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| ConnectError::Timeout)?
            .map_err(ConnectError::Io)
    }

    /// TCP to the upstream, without delay on small writes.
    async fn tcp(&self) -> std::io::Result<TcpStream> {
        let tcp = TcpStream::connect((self.addr_host.as_str(), self.port)).await?;
        tcp.set_nodelay(true)?;
        Ok(tcp)
    }

    async fn send_h1(
        &self,
        req: Request<OutBody>,
        fresh: Option<Sender>,
    ) -> Result<(Response<Incoming>, Back), SendError> {
        let (mut sender, pooled) = match (fresh, self.pool.take()) {
            (Some(s), _) => (s, false),
            (None, Some(s)) => (s, true),
            (None, None) => match Box::pin(self.connect()).await? {
                Connected::H1(s) => (s, false),
                Connected::H2(tx) => return Box::pin(self.send_on_h2_anew(tx, req)).await,
            },
        };
        let req = match sender.ready().await {
            Ok(()) => match sender.try_send_request(framed_for_h1(req)).await {
                Ok(response) => return Ok((response, Back::H1(sender))),
                Err(mut e) => match e.take_message() {
                    Some(req) if pooled => req,
                    _ => return Err(SendError::Request(e.into_error())),
                },
            },
            Err(_) if pooled => req,
            Err(e) => return Err(SendError::Request(e)),
        };
        let mut sender = match Box::pin(self.connect()).await? {
            Connected::H1(s) => s,
            Connected::H2(tx) => return Box::pin(self.send_on_h2_anew(tx, req)).await,
        };
        sender.ready().await.map_err(SendError::Request)?;
        let response = sender
            .send_request(framed_for_h1(req))
            .await
            .map_err(SendError::Request)?;
        Ok((response, Back::H1(sender)))
    }

    /// HTTP/2 (or `auto`): on the least busy open connection, else a new
    /// one (one connect at a time per upstream and worker). `auto` falls
    /// back to HTTP/1.1 when ALPN picked it.
    async fn send_h2(
        &self,
        req: Request<OutBody>,
    ) -> Result<(Response<Incoming>, Back), SendError> {
        let req = match self.pool.h2() {
            Some((tx, streams)) => match self.send_on_h2(tx, Some(streams), req).await {
                Err(SendError::Unsent(req)) => *req,
                other => return other,
            },
            None => req,
        };
        let auto_h1 = || {
            self.protocol == UpstreamProtocol::Auto
                && (self.pool.has_h1() || self.pool.alpn_h1.load(Ordering::Relaxed))
        };
        if auto_h1() {
            return self.send_h1(req, None).await;
        }
        // One connect at a time: whoever waited here uses the connection
        // the one before it made (it is in the pool before the lock goes),
        // or, once ALPN chose HTTP/1.1, connects on its own.
        let failures = self.pool.h2_failures.load(Ordering::Relaxed);
        let connected = {
            let _one = self.pool.h2_connecting.lock().await;
            match self.pool.h2() {
                Some((tx, streams)) => Some((Connected::H2(tx), Some(streams))),
                None if auto_h1() => None,
                // A connect failed while this one waited: on the least
                // busy open connection, however busy (the connect was
                // for one more), else a 502 with it.
                None if self.pool.h2_failures.load(Ordering::Relaxed) != failures => {
                    match self.pool.h2_least() {
                        Some((tx, streams)) => Some((Connected::H2(tx), Some(streams))),
                        None => return Err(SendError::Connect(ConnectError::FailedMeanwhile)),
                    }
                }
                None => match Box::pin(self.connect()).await.inspect_err(|_| {
                    self.pool.h2_failures.fetch_add(1, Ordering::Relaxed);
                })? {
                    Connected::H2(tx) => {
                        let streams = self.pool.add_h2(tx.clone());
                        Some((Connected::H2(tx), Some(streams)))
                    }
                    h1 => {
                        self.pool.alpn_h1.store(true, Ordering::Relaxed);
                        Some((h1, None))
                    }
                },
            }
        };
        let Some(connected) = connected else {
            return self.send_h1(req, None).await;
        };
        match connected {
            (Connected::H2(tx), streams) => match self.send_on_h2(tx, streams, req).await {
                Err(SendError::Unsent(_)) => Err(SendError::Connect(ConnectError::Closed)),
                other => other,
            },
            (Connected::H1(sender), _) => self.send_h1(req, Some(sender)).await,
        }
    }

    /// The first stream on a new HTTP/2 connection an `auto` upstream's
    /// ALPN chose where it had chosen HTTP/1.1 before: its connects wait
    /// for each other again (each would be a connection of its own).
    async fn send_on_h2_anew(
        &self,
        tx: H2Sender,
        req: Request<OutBody>,
    ) -> Result<(Response<Incoming>, Back), SendError> {
        self.pool.alpn_h1.store(false, Ordering::Relaxed);
        self.send_on_h2(tx, None, req).await
    }

    /// One stream on `tx` (added to the pool when new): the request in
    /// HTTP/2 form (`:authority` from the `Host` sluice chose).
    async fn send_on_h2(
        &self,
        mut tx: H2Sender,
        streams: Option<Arc<()>>,
        mut req: Request<OutBody>,
    ) -> Result<(Response<Incoming>, Back), SendError> {
        if req.headers().contains_key(UPGRADE) {
            return Err(SendError::NoSwitch);
        }
        let streams = match streams {
            Some(s) => s,
            None => self.pool.add_h2(tx.clone()),
        };
        to_h2(&mut req, &self.scheme, &self.authority);
        match tx.try_send_request(req).await {
            Ok(response) => Ok((response, Back::H2(streams))),
            Err(mut e) => match e.take_message() {
                Some(mut req) => {
                    to_h1(&mut req);
                    Err(SendError::Unsent(Box::new(req)))
                }
                None => Err(SendError::Request(e.into_error())),
            },
        }
    }

    /// A new connection: TCP, TLS for https, the HTTP/1.1 or HTTP/2
    /// handshake; the connection is driven by a task on this worker.
    async fn connect(&self) -> Result<Connected, ConnectError> {
        let connect = async {
            let tcp = self.tcp().await?;
            let (io, h2) = match &self.tls {
                None => (Either::Left(tcp), self.protocol == UpstreamProtocol::H2c),
                Some((connector, name)) => {
                    let tls = connector.connect(name.clone(), tcp).await?;
                    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                    if self.protocol == UpstreamProtocol::H2 && !h2 {
                        return Err(ConnectError::NoH2);
                    }
                    (Either::Right(tls), h2)
                }
            };
            let name = self.name.clone();
            let ended = move |e: hyper::Error| {
                debug!(upstream = %name, error = %e, "upstream connection ended with an error");
            };
            if h2 {
                let mut builder = http2::Builder::new(TokioExecutor::new());
                builder
                    .timer(TokioTimer::new())
                    .keep_alive_interval(Duration::from_secs(30))
                    .keep_alive_timeout(Duration::from_secs(10))
                    .initial_stream_window_size(H2_UPSTREAM_STREAM_WINDOW)
                    .initial_connection_window_size(H2_UPSTREAM_CONNECTION_WINDOW);
                let (tx, conn) = builder.handshake(TokioIo::new(io)).await?;
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        ended(e);
                    }
                });
                return Ok(Connected::H2(tx));
            }
            let (sender, conn) = http1::handshake(TokioIo::new(io)).await?;
            tokio::spawn(async move {
                if let Err(e) = conn.with_upgrades().await {
                    ended(e);
                }
            });
            Ok::<_, ConnectError>(Connected::H1(sender))
        };
        tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| ConnectError::Timeout)?
    }
}

/// A request prepared for HTTP/1.1 (origin form, `Host`), in HTTP/2 form:
/// `:scheme` the upstream's, `:authority` the `Host` sluice chose (RFC
/// 9113 8.3.1: never both, never different) or, with none, the upstream's;
/// the version says h2.
fn to_h2<B>(req: &mut Request<B>, scheme: &Scheme, upstream: &Authority) {
    *req.version_mut() = Version::HTTP_2;
    let authority = req
        .headers_mut()
        .remove(HOST)
        .and_then(|host| Authority::try_from(host.as_bytes()).ok())
        .unwrap_or_else(|| upstream.clone());
    let mut target = http::uri::Parts::default();
    target.scheme = Some(scheme.clone());
    target.authority = Some(authority);
    target.path_and_query = req.uri().path_and_query().cloned();
    if let Ok(uri) = Uri::from_parts(target) {
        *req.uri_mut() = uri;
    }
    req.headers_mut().remove(CONNECTION);
    req.headers_mut().remove(UPGRADE);
}

/// A request [`to_h2`] made, back in HTTP/1.1 form (origin form, its
/// `:authority` as `Host`): for one an HTTP/2 connection closed before
/// taking it, which goes next on another connection, HTTP/1.1 or HTTP/2
/// (which converts it again, to the same `:authority`).
fn to_h1<B>(req: &mut Request<B>) {
    *req.version_mut() = Version::HTTP_11;
    if let Some(host) = req
        .uri()
        .authority()
        .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
    {
        req.headers_mut().insert(HOST, host);
    }
    let target = req
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *req.uri_mut() = Uri::from(target);
}

/// Why a request could not be sent.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("cannot connect: {0}")]
    Connect(#[from] ConnectError),
    #[error("{0}")]
    Request(hyper::Error),
    #[error("{0}")]
    Own(client::Error),
    /// An HTTP/2 connection closed before it took the request.
    #[error("the connection closed before the request was sent")]
    Unsent(Box<Request<OutBody>>),
    /// A protocol switch (WebSocket) to an upstream spoken to in HTTP/2,
    /// which has no `Upgrade` (RFC 9113 8.2.2): sent as a plain request,
    /// the upstream would answer it as one.
    #[error("a protocol switch needs an HTTP/1.1 upstream")]
    NoSwitch,
}

impl SendError {
    /// What the client is told (502).
    fn detail(&self) -> &'static str {
        match self {
            SendError::Connect(_) => "the upstream could not be reached",
            SendError::Request(_) | SendError::Unsent(_) | SendError::Own(_) => {
                "the upstream connection failed"
            }
            SendError::NoSwitch => {
                "a protocol switch (WebSocket) needs an upstream spoken to in HTTP/1.1; this one is HTTP/2"
            }
        }
    }
}

/// A request body on its way upstream: streamed from the client (a request
/// that departed at once), or staged (read while it waited) and written in
/// one go.
#[derive(Debug)]
pub enum OutBody {
    /// A body streamed as the client sends it, and (unless it is empty)
    /// when it last moved on.
    Stream(RequestBody, Option<Progress>),
    Staged {
        data: Option<Bytes>,
        trailers: Option<Box<HeaderMap>>,
    },
    /// What the request sent while it waited (a gRPC call, an upload that
    /// waited for a slot or was still coming at its departure), then the
    /// rest (and when that last moved on).
    Begun(Box<Begun>, RequestBody, Progress),
}

/// When a streamed request body last moved on (a frame, or its end): an
/// upload the client sends slowly is not cut at `request_timeout` while
/// it moves, which counts from the last of it (nginx's
/// `proxy_send_timeout` and `proxy_read_timeout`, in one). An upload's
/// body (not a gRPC call's, which may stream for as long as the call
/// lasts) must also come as a staged one must: something within
/// `server.body_read_timeout`, and 500 bytes/s on average once that has
/// passed ([`ReadDeadline`]); a client that dripped a byte now and then
/// held its upstream connection and `max_concurrency` slot for ever.
#[derive(Debug, Clone, Default)]
pub struct Progress(Arc<Mutex<Moved>>);

#[derive(Debug, Default)]
struct Moved {
    last: Option<Instant>,
    /// The body's pace, while it has not ended.
    pace: Option<ReadDeadline>,
}

impl Progress {
    /// With `pace`: a body held to that `body_read_timeout` and
    /// [`crate::admission::MIN_DATA_RATE`] from now.
    fn new(pace: Option<Duration>) -> Progress {
        Progress(Arc::new(Mutex::new(Moved {
            last: None,
            pace: pace.map(|timeout| ReadDeadline::new(Instant::now(), timeout)),
        })))
    }

    fn moved(&self) -> std::sync::MutexGuard<'_, Moved> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A frame of `bytes` came, or (`None`) the body ended.
    fn mark(&self, bytes: Option<usize>) {
        let now = Instant::now();
        let mut moved = self.moved();
        moved.last = Some(now);
        match bytes {
            Some(n) => {
                if let Some(pace) = &mut moved.pace {
                    pace.read(n, now);
                }
            }
            None => moved.pace = None,
        }
    }

    fn last(&self) -> Option<Instant> {
        self.moved().last
    }

    /// When the body must have moved on by, if it is paced and still
    /// coming.
    fn due(&self) -> Option<Instant> {
        self.moved().pace.as_ref().map(ReadDeadline::at)
    }
}

impl OutBody {
    /// A body streamed as the client sends it; `pace`: held to
    /// `server.body_read_timeout` (see [`Progress`]).
    pub fn stream(body: RequestBody, pace: Option<Duration>) -> OutBody {
        let progress = (!body.is_end_stream()).then(|| Progress::new(pace));
        OutBody::Stream(body, progress)
    }

    /// A body of which what was sent while the request waited goes first.
    /// (`pace` as for [`OutBody::stream`]: an upload is held to it from
    /// its departure.)
    pub fn begun(first: Box<Begun>, rest: RequestBody, pace: Option<Duration>) -> OutBody {
        OutBody::Begun(first, rest, Progress::new(pace))
    }

    fn progress(&self) -> Option<Progress> {
        match self {
            OutBody::Stream(_, progress) => progress.clone(),
            OutBody::Begun(.., progress) => Some(progress.clone()),
            OutBody::Staged { .. } => None,
        }
    }

    /// A staged body, sent again as often as needed.
    pub fn staged(data: Bytes, trailers: Option<Box<HeaderMap>>) -> OutBody {
        OutBody::Staged {
            data: (!data.is_empty()).then_some(data),
            trailers,
        }
    }
}

impl Body for OutBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            OutBody::Stream(body, progress) => {
                let frame = Pin::new(&mut *body).poll_frame(cx);
                if let (Poll::Ready(f), Some(p)) = (&frame, progress) {
                    p.mark(match f {
                        Some(Ok(f)) if !body.is_end_stream() => {
                            Some(f.data_ref().map_or(0, Bytes::len))
                        }
                        _ => None,
                    });
                }
                frame
            }
            OutBody::Staged { data, trailers } => Poll::Ready(
                data.take()
                    .map(|d| Ok(Frame::data(d)))
                    .or_else(|| trailers.take().map(|t| Ok(Frame::trailers(*t)))),
            ),
            OutBody::Begun(first, rest, progress) => {
                let frame = match first.next_frame() {
                    Some(frame) => Poll::Ready(Some(Ok(frame))),
                    None if first.ended() => Poll::Ready(None),
                    None => Pin::new(&mut *rest).poll_frame(cx),
                };
                if let Poll::Ready(f) = &frame {
                    let ended = first.is_empty() && (first.ended() || rest.is_end_stream());
                    progress.mark(match f {
                        Some(Ok(f)) if !ended => Some(f.data_ref().map_or(0, Bytes::len)),
                        _ => None,
                    });
                }
                frame
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            OutBody::Stream(body, _) => body.is_end_stream(),
            OutBody::Staged { data, trailers } => data.is_none() && trailers.is_none(),
            OutBody::Begun(first, rest, _) => {
                first.is_empty() && (first.ended() || rest.is_end_stream())
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            OutBody::Stream(body, _) => body.size_hint(),
            OutBody::Staged { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            OutBody::Begun(first, rest, _) => {
                let read = first.len() as u64;
                if first.ended() {
                    return SizeHint::with_exact(read);
                }
                let rest = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(rest.lower().saturating_add(read));
                if let Some(upper) = rest.upper() {
                    hint.set_upper(upper.saturating_add(read));
                }
                hint
            }
        }
    }
}

/// Why [`within_after`] gave up.
enum Late {
    /// No answer within `limit` of the start or of the body's last part.
    Upstream,
    /// The client's body came too slowly ([`Progress`]).
    Body,
}

/// `fut` within `limit` of `started` or of the last time `progress` moved
/// on, whichever is later, and while a paced body still comes, by the
/// time its pace says.
async fn within_after<F: Future>(
    limit: Duration,
    started: Instant,
    progress: &Progress,
    fut: F,
) -> Result<F::Output, Late> {
    tokio::pin!(fut);
    loop {
        let from = progress.last().map_or(started, |last| last.max(started));
        let until = progress.due().map_or(from + limit, |d| d.min(from + limit));
        if let Ok(out) = tokio::time::timeout_at(until.into(), &mut fut).await {
            return Ok(out);
        }
        let now = Instant::now();
        if progress.due().is_some_and(|d| d <= now) {
            return Err(Late::Body);
        }
        if progress.last().is_none_or(|last| last <= from) && from + limit <= now {
            return Err(Late::Upstream);
        }
    }
}

/// A request as hyper frames it for HTTP/1.1, where its own choice would
/// lose part of it: a body of unknown length goes chunked whatever the
/// method (hyper sends a `GET`, `HEAD` or `CONNECT` of unknown length as
/// if it had none), and so does a staged body with trailers (a known
/// length has no room for them), as nginx and HAProxy pass them on.
///
/// (An HTTP/2 `GET` that ends its stream with an empty DATA frame, not on
/// its HEADERS, is not known to be empty when it departs: it goes with
/// an empty chunked body, as Envoy sends it.)
fn framed_for_h1(mut req: Request<OutBody>) -> Request<OutBody> {
    name_te_in_connection(req.headers_mut());
    let body = req.body();
    let chunked = match body {
        OutBody::Staged { trailers, .. } => trailers.is_some(),
        _ => {
            !body.is_end_stream()
                && body.size_hint().exact().is_none()
                && !req.headers().contains_key(CONTENT_LENGTH)
        }
    };
    if chunked && !req.headers().contains_key(TRANSFER_ENCODING) {
        req.headers_mut()
            .insert(TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
    }
    // hyper writes only the trailers a `Trailer` field names: a staged
    // body's are known, and named when the client did not (an HTTP/2
    // client never has to).
    if let OutBody::Staged {
        trailers: Some(trailers),
        ..
    } = req.body()
        && !req.headers().contains_key(TRAILER)
    {
        let names: Vec<&str> = trailers.keys().map(HeaderName::as_str).collect();
        if let Ok(value) = HeaderValue::from_str(&names.join(", ")) {
            req.headers_mut().insert(TRAILER, value);
        }
    }
    req
}

/// `Proxy` (see [`Upstream::rewrite`]).
const PROXY: HeaderName = HeaderName::from_static("proxy");

/// A response body that gives its connection back to the pool once it has
/// been read to the end (and its `max_concurrency` slot when dropped); on
/// HTTP/2, it counts as its connection's stream until dropped.
struct Returning {
    body: Incoming,
    sender: Option<Sender>,
    pool: Arc<Pool>,
    _stream: Option<Arc<()>>,
    _permit: Option<CallSlot>,
}

impl Returning {
    fn give_back(&mut self) {
        if let Some(sender) = self.sender.take() {
            self.pool.put(sender);
        }
    }
}

impl Body for Returning {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => self.give_back(),
            Poll::Ready(Some(Err(_))) => self.sender = None,
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Returning {
    fn drop(&mut self) {
        // A body nobody needed to read (HEAD, 204, empty) still ends its
        // exchange; one dropped midway takes its connection with it.
        if self.body.is_end_stream() {
            self.give_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request as `retarget` and `rewrite` leave it.
    fn h1_request(host: Option<&'static str>) -> Request<()> {
        let mut req = Request::new(());
        *req.uri_mut() = Uri::from_static("/a/b?c=d");
        if let Some(host) = host {
            req.headers_mut()
                .insert(HOST, HeaderValue::from_static(host));
        }
        req.headers_mut()
            .insert("x-forwarded-for", HeaderValue::from_static("127.0.0.1"));
        req
    }

    #[test]
    fn a_request_not_taken_by_http2_goes_on_in_the_form_it_had() {
        let upstream = Authority::from_static("up.example:8443");
        for host in [Some("client.example"), None] {
            let mut req = h1_request(host);
            to_h2(&mut req, &Scheme::HTTPS, &upstream);
            let authority = host.unwrap_or("up.example:8443");
            assert_eq!(req.version(), Version::HTTP_2);
            assert_eq!(
                req.uri().to_string(),
                format!("https://{authority}/a/b?c=d")
            );
            assert!(req.headers().get(HOST).is_none());
            to_h1(&mut req);
            assert_eq!(req.version(), Version::HTTP_11);
            assert_eq!(req.uri(), "/a/b?c=d");
            assert_eq!(req.headers()[HOST], authority);
            assert_eq!(req.headers()["x-forwarded-for"], "127.0.0.1");
            // And to HTTP/2 again, on another connection: the same
            // :authority.
            to_h2(&mut req, &Scheme::HTTPS, &upstream);
            assert_eq!(
                req.uri().to_string(),
                format!("https://{authority}/a/b?c=d")
            );
        }
    }
}
