//! The HTTP layer around the shaper: accept connections (HTTP/1.1 and h2c),
//! pick a route, derive the client key, wait for the departure the shaper
//! grants, then forward upstream over a pooled keep-alive client.
//!
//! A queued request's body is not touched until it departs; a client that
//! disconnects while queued drops its future, which withdraws it from the
//! queue (the next in line takes its slot).

mod forward;
mod headers;
mod key;
pub mod response;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use crate::config::{Config, KeySpec, OnMissingKey};
use crate::shaper::{AcquireError, Admitted, Limits, Policy, Rejection, RouteId, Shaper};
pub use key::ClientKey;
use response::{ProxyBody, problem};

/// Errors starting the server.
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

/// A route as the request path sees it.
struct Route {
    name: String,
    path_prefix: String,
    id: RouteId,
    upstream: usize,
    key: KeySpec,
    on_missing_key: OnMissingKey,
}

/// Everything a request needs, shared by all connections.
struct App {
    routes: Vec<Route>,
    upstreams: Vec<forward::Upstream>,
    shaper: Shaper<ClientKey>,
}

/// A bound, not yet running server.
pub struct Server {
    app: Arc<App>,
    listeners: Vec<TcpListener>,
    http: Arc<auto::Builder<TokioExecutor>>,
    max_connections: usize,
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
        let tls = forward::tls_config();
        let mut upstreams = Vec::with_capacity(config.upstreams.len());
        let mut upstream_ids = Vec::with_capacity(config.upstreams.len());
        for u in &config.upstreams {
            upstream_ids.push(shaper.add_upstream(u.rate));
            upstreams.push(forward::Upstream::new(u, tls.clone())?);
        }
        let routes = config
            .routes
            .iter()
            .map(|r| Route {
                name: r.name.clone(),
                path_prefix: r.path_prefix.clone(),
                id: shaper.add_route(Policy::new(r.rate, r.capacity), upstream_ids[r.upstream]),
                upstream: r.upstream,
                key: r.key.clone(),
                on_missing_key: r.on_missing_key,
            })
            .collect();

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

        Ok(Server {
            app: Arc::new(App {
                routes,
                upstreams,
                shaper,
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

    /// Serve until `shutdown` resolves.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let limit = Arc::new(Semaphore::new(self.max_connections));
        let mut accept = tokio::task::JoinSet::new();
        for listener in self.listeners {
            if let Ok(addr) = listener.local_addr() {
                info!(%addr, "listening");
            }
            accept.spawn(accept_loop(
                listener,
                self.app.clone(),
                self.http.clone(),
                limit.clone(),
            ));
        }
        shutdown.await;
        accept.abort_all();
    }
}

async fn accept_loop(
    listener: TcpListener,
    app: Arc<App>,
    http: Arc<auto::Builder<TokioExecutor>>,
    limit: Arc<Semaphore>,
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
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let http = http.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let app = app.clone();
                async move { Ok::<_, Infallible>(app.handle(req, peer).await) }
            });
            if let Err(e) = http.serve_connection(TokioIo::new(stream), service).await {
                debug!(%peer, error = %e, "connection ended with an error");
            }
            drop(permit);
        });
    }
}

// === impl App ===

impl App {
    async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
        let path = req.uri().path();
        let Some(route) = self
            .routes
            .iter()
            .find(|r| path.starts_with(&r.path_prefix))
        else {
            return problem(StatusCode::NOT_FOUND, "no route matches this request", None);
        };
        let key = match key::extract(&route.key, route.on_missing_key, req.headers(), peer.ip()) {
            Ok(key) => key,
            Err(detail) => return problem(StatusCode::BAD_REQUEST, &detail, None),
        };
        match self.shaper.admit(route.id, key, 1) {
            Ok(Admitted::Now) => {}
            Ok(Admitted::Wait(waiting)) => {
                // If the client goes away, hyper drops this future and with it
                // `waiting`, which withdraws the request.
                if let Err(AcquireError::Closed | AcquireError::Rejected(_)) =
                    waiting.departed().await
                {
                    return problem(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "sluice is shutting down",
                        Some(Duration::from_secs(1)),
                    );
                }
            }
            Err(rejection) => return reject(&route.name, rejection),
        }
        self.upstreams[route.upstream].forward(req, peer).await
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
