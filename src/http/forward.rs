//! The upstream side: a pooled keep-alive client per upstream and worker
//! (http, or https through rustls), so that a request never leaves the
//! thread that accepted it; request rewriting, and the 502/504 mapping.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::header::{HOST, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, StatusCode, Uri, Version};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use metrics::Histogram;
use tokio::sync::Semaphore;
use tracing::{debug, warn};

use super::ServeError;
use super::headers::{add_forwarded, append_via, strip_hop_by_hop};
use super::response::{ProxyBody, problem};
use crate::config;
use crate::metrics::{self as m, Outcome};

type Pool = Client<HttpsConnector<HttpConnector>, Incoming>;

/// One configured upstream and its connection pools.
pub struct Upstream {
    name: String,
    scheme: Scheme,
    authority: Authority,
    request_timeout: Duration,
    /// This worker's pool: its connections stay on the worker's thread.
    pool: Pool,
    duration: Histogram,
    /// `max_concurrency`: a permit per call in flight, held until the
    /// response body has been sent.
    concurrency: Option<Arc<Semaphore>>,
}

/// TLS settings for https upstreams: the system's roots. A machine without
/// any still serves http upstreams; https ones then fail to verify (502).
pub fn tls_config() -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for cert in found.certs {
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        debug!("no system root certificates found; https upstreams will not verify");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map(|b| b.with_root_certificates(roots).with_no_client_auth());
    match config {
        Ok(c) => Arc::new(c),
        // The ring provider supports the default versions; this cannot fail
        // in practice, but if it does, https upstreams fail, not the daemon.
        Err(e) => {
            warn!(error = %e, "TLS set-up failed; https upstreams are unavailable");
            Arc::new(
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::ring::default_provider(),
                ))
                .with_protocol_versions(&[&rustls::version::TLS13])
                .map(|b| {
                    b.with_root_certificates(rustls::RootCertStore::empty())
                        .with_no_client_auth()
                })
                .unwrap_or_else(|_| unreachable_config()),
            )
        }
    }
}

fn unreachable_config() -> rustls::ClientConfig {
    // Only reached if rustls refuses TLS 1.3 with its own provider.
    rustls::ClientConfig::builder()
        .with_root_certificates(rustls::RootCertStore::empty())
        .with_no_client_auth()
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
        let pool = {
            let mut http = HttpConnector::new();
            http.enforce_http(false);
            http.set_nodelay(true);
            http.set_connect_timeout(Some(cfg.connect_timeout));
            let https = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config((**tls).clone())
                .https_or_http()
                .enable_http1()
                .wrap_connector(http);
            Client::builder(TokioExecutor::new())
                .pool_timer(TokioTimer::new())
                .pool_idle_timeout(Duration::from_secs(90))
                .build(https)
        };
        Ok(Upstream {
            name: cfg.name.clone(),
            scheme,
            authority,
            request_timeout: cfg.request_timeout,
            pool,
            duration: metrics::histogram!(m::UPSTREAM_DURATION_SECONDS, "upstream" => cfg.name.clone()),
            concurrency,
        })
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
    pub async fn forward(
        &self,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> (Response<ProxyBody>, Outcome) {
        let (mut parts, body) = req.into_parts();
        let inbound_version = parts.version;
        let host = parts.headers.get(HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        // The target in absolute form; its parts are shared, not copied.
        let mut target = http::uri::Parts::default();
        target.scheme = Some(self.scheme.clone());
        target.authority = Some(self.authority.clone());
        target.path_and_query = Some(
            parts
                .uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")),
        );
        parts.uri = match Uri::from_parts(target) {
            Ok(u) => u,
            Err(_) => {
                let detail = "the request target cannot be forwarded";
                return (
                    problem(StatusCode::BAD_REQUEST, detail, None),
                    Outcome::Invalid,
                );
            }
        };
        strip_hop_by_hop(&mut parts.headers);
        add_forwarded(&mut parts.headers, peer.ip(), host.as_ref());
        append_via(&mut parts.headers, inbound_version);
        if let Some(host) = host {
            parts.headers.insert(HOST, host);
        }
        parts.version = Version::HTTP_11;
        let req = Request::from_parts(parts, body);

        // Released by the shaper; now wait for an in-flight slot if capped.
        // This delays only this request: other clients' spacing is kept.
        let permit = match &self.concurrency {
            Some(sem) => sem.clone().acquire_owned().await.ok(),
            None => None,
        };
        let started = std::time::Instant::now();
        let result = tokio::time::timeout(self.request_timeout, self.pool.request(req)).await;
        self.duration.record(started.elapsed().as_secs_f64());
        match result {
            Err(_) => {
                debug!(upstream = %self.name, "upstream timed out");
                let detail = "the upstream did not answer in time";
                (
                    problem(StatusCode::GATEWAY_TIMEOUT, detail, None),
                    Outcome::UpstreamError,
                )
            }
            Ok(Err(e)) => {
                debug!(upstream = %self.name, error = %e, "upstream request failed");
                let detail = if e.is_connect() {
                    "the upstream could not be reached"
                } else {
                    "the upstream connection failed"
                };
                (
                    problem(StatusCode::BAD_GATEWAY, detail, None),
                    Outcome::UpstreamError,
                )
            }
            Ok(Ok(response)) => {
                let (mut parts, body) = response.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                append_via(&mut parts.headers, parts.version);
                let body = body.map_frame(move |frame| {
                    let _in_flight = &permit;
                    frame
                });
                (
                    Response::from_parts(parts, body.boxed()),
                    Outcome::Forwarded,
                )
            }
        }
    }
}
