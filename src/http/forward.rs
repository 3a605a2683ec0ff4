//! The upstream side: a keep-alive connection pool per upstream and
//! worker (http, or https through rustls), so that a request never leaves
//! the thread that accepted it; request rewriting, and the 502/504 mapping.
//!
//! The pool is deliberately small: idle HTTP/1.1 connections in a stack
//! (the most recently used first, so a few stay warm), a connection goes
//! back when its response body has been read to the end, and a request
//! that a pooled connection never started to send is retried once on a
//! fresh one.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{EXPECT, HOST, HeaderMap, HeaderValue};
use http::request::Parts;
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::TlsConnector;
use tokio_util::either::Either;
use tracing::debug;

use super::ServeError;
use super::headers::{add_forwarded, append_via, strip_hop_by_hop};
use super::response::{ProxyBody, problem};
use crate::config::{self, HostMode, OnThrottle};
use crate::metrics::{self as m, Outcome};

/// Idle connections older than this are closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Most idle connections kept per upstream and worker.
const MAX_IDLE: usize = 512;

type Sender = http1::SendRequest<OutBody>;

/// Idle connections, most recently used last.
#[derive(Default)]
struct Pool {
    idle: Mutex<Vec<(Sender, Instant)>>,
}

impl Pool {
    fn take(&self) -> Option<Sender> {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((sender, since)) = idle.pop() {
            if since.elapsed() < IDLE_TIMEOUT && !sender.is_closed() {
                return Some(sender);
            }
        }
        None
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
    /// TLS for https upstreams, with the name to verify.
    tls: Option<(TlsConnector, ServerName<'static>)>,
    connect_timeout: Duration,
    request_timeout: Duration,
    /// This worker's idle connections.
    pool: Arc<Pool>,
    duration: Arc<m::Histogram>,
    /// `max_concurrency`: a permit per call in flight, held until the
    /// response body has been sent.
    concurrency: Option<Arc<Semaphore>>,
}

impl Upstream {
    pub fn new(
        cfg: &config::Upstream,
        tls: &Arc<rustls::ClientConfig>,
        concurrency: Option<Arc<Semaphore>>,
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
            port,
            tls,
            connect_timeout: cfg.connect_timeout,
            request_timeout: cfg.request_timeout,
            pool: Arc::default(),
            duration: m::histogram(m::UPSTREAM_DURATION_SECONDS, &[("upstream", &cfg.name)]),
            concurrency,
        })
    }

    /// `max_concurrency`'s in-flight slots, if capped.
    pub fn concurrency(&self) -> Option<&Arc<Semaphore>> {
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

    /// Forward `req` and stream the response back; 502 when the upstream
    /// cannot be reached, 504 when it does not answer in time.
    /// Rewrite an inbound request head for this upstream: the target in
    /// absolute form with the upstream's path prefix (and the route's
    /// `strip_prefix` removed; the query byte for byte), the `Host` its
    /// mode says, hop-by-hop headers and `Expect` removed (sluice answers
    /// `100-continue` itself), `X-Forwarded-*` and `Via` added. `None` when
    /// the target cannot be forwarded (400).
    pub fn prepare(&self, parts: &mut Parts, peer: SocketAddr, strip: Option<&str>) -> Option<()> {
        let client_host = parts.headers.get(HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let mut target = http::uri::Parts::default();
        target.scheme = Some(self.scheme.clone());
        target.authority = Some(self.authority.clone());
        target.path_and_query = Some(self.map_path(parts.uri.path_and_query(), strip)?);
        parts.uri = Uri::from_parts(target).ok()?;
        strip_hop_by_hop(&mut parts.headers);
        parts.headers.remove(EXPECT);
        add_forwarded(&mut parts.headers, peer.ip(), client_host.as_ref());
        append_via(&mut parts.headers, parts.version);
        let host = match &self.host {
            HostMode::Upstream => HeaderValue::from_str(self.authority.as_str()).ok(),
            HostMode::Client => client_host,
            HostMode::Fixed(v) => Some(v.clone()),
        };
        match host {
            Some(host) => parts.headers.insert(HOST, host),
            None => parts.headers.remove(HOST),
        };
        parts.version = Version::HTTP_11;
        Some(())
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
        let rest = strip.and_then(|s| path.strip_prefix(s)).unwrap_or(path);
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
    /// response body has been sent.
    pub async fn forward(
        &self,
        parts: Parts,
        body: OutBody,
        permit: Option<OwnedSemaphorePermit>,
    ) -> (Response<ProxyBody>, Outcome, Option<Instant>) {
        let req = Request::from_parts(parts, body);
        let started = Instant::now();
        let result = tokio::time::timeout(self.request_timeout, self.send(req)).await;
        self.duration.record(started.elapsed());
        match result {
            Err(_) => {
                debug!(upstream = %self.name, "upstream timed out");
                let detail = "the upstream did not answer in time";
                (
                    problem(StatusCode::GATEWAY_TIMEOUT, detail, None),
                    Outcome::UpstreamError,
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
                )
            }
            Ok(Err(e)) => {
                debug!(upstream = %self.name, error = %e, "upstream request failed");
                (
                    problem(StatusCode::BAD_GATEWAY, e.detail(), None),
                    Outcome::UpstreamError,
                    None,
                )
            }
            Ok(Ok((response, sender))) => {
                let (mut parts, body) = response.into_parts();
                let throttle = match self.on_throttle {
                    OnThrottle::Pause => {
                        super::throttle::pause_until(parts.status, &parts.headers, self.max_pause)
                    }
                    OnThrottle::Pass => None,
                };
                strip_hop_by_hop(&mut parts.headers);
                append_via(&mut parts.headers, parts.version);
                let body = Returning {
                    body,
                    sender: Some(sender),
                    pool: self.pool.clone(),
                    _permit: permit,
                };
                (
                    Response::from_parts(parts, body.boxed()),
                    Outcome::Forwarded,
                    throttle,
                )
            }
        }
    }

    /// Send on a pooled connection, or a new one; a request a pooled
    /// connection never started to send (it was closing) goes once more on
    /// a new connection.
    async fn send(&self, req: Request<OutBody>) -> Result<(Response<Incoming>, Sender), SendError> {
        let (mut sender, pooled) = match self.pool.take() {
            Some(s) => (s, true),
            None => (Box::pin(self.connect()).await?, false),
        };
        let req = match sender.ready().await {
            Ok(()) => match sender.try_send_request(req).await {
                Ok(response) => return Ok((response, sender)),
                Err(mut e) => match e.take_message() {
                    Some(req) if pooled => req,
                    _ => return Err(SendError::Request(e.into_error())),
                },
            },
            Err(_) if pooled => req,
            Err(e) => return Err(SendError::Request(e)),
        };
        let mut sender = Box::pin(self.connect()).await?;
        sender.ready().await.map_err(SendError::Request)?;
        let response = sender.send_request(req).await.map_err(SendError::Request)?;
        Ok((response, sender))
    }

    /// A new connection: TCP, TLS for https, the HTTP/1.1 handshake; the
    /// connection is driven by a task on this worker.
    async fn connect(&self) -> Result<Sender, ConnectError> {
        let connect = async {
            let tcp = TcpStream::connect((self.addr_host.as_str(), self.port)).await?;
            tcp.set_nodelay(true)?;
            let io = match &self.tls {
                None => Either::Left(tcp),
                Some((connector, name)) => {
                    Either::Right(connector.connect(name.clone(), tcp).await?)
                }
            };
            let (sender, conn) = http1::handshake(TokioIo::new(io)).await?;
            Ok::<_, ConnectError>((sender, conn))
        };
        let (sender, conn) = tokio::time::timeout(self.connect_timeout, connect)
            .await
            .map_err(|_| ConnectError::Timeout)??;
        let name = self.name.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                debug!(upstream = %name, error = %e, "upstream connection ended with an error");
            }
        });
        Ok(sender)
    }
}

/// Why a request could not be sent.
#[derive(Debug, thiserror::Error)]
enum SendError {
    #[error("cannot connect: {0}")]
    Connect(#[from] ConnectError),
    #[error("{0}")]
    Request(hyper::Error),
}

impl SendError {
    /// What the client is told (502).
    fn detail(&self) -> &'static str {
        match self {
            SendError::Connect(_) => "the upstream could not be reached",
            SendError::Request(_) => "the upstream connection failed",
        }
    }
}

/// A request body on its way upstream: streamed from the client (a request
/// that departed at once), or staged (read while it waited) and written in
/// one go.
pub enum OutBody {
    Stream(Incoming),
    Staged {
        data: Option<Bytes>,
        trailers: Option<HeaderMap>,
    },
}

impl OutBody {
    /// A staged body, sent again as often as needed.
    pub fn staged(data: Bytes, trailers: Option<HeaderMap>) -> OutBody {
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
            OutBody::Stream(body) => Pin::new(body).poll_frame(cx),
            OutBody::Staged { data, trailers } => Poll::Ready(
                data.take()
                    .map(|d| Ok(Frame::data(d)))
                    .or_else(|| trailers.take().map(|t| Ok(Frame::trailers(t)))),
            ),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            OutBody::Stream(body) => body.is_end_stream(),
            OutBody::Staged { data, trailers } => data.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            OutBody::Stream(body) => body.size_hint(),
            OutBody::Staged { data, .. } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}

/// A response body that gives its connection back to the pool once it has
/// been read to the end (and its `max_concurrency` slot when dropped).
struct Returning {
    body: Incoming,
    sender: Option<Sender>,
    pool: Arc<Pool>,
    _permit: Option<OwnedSemaphorePermit>,
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
