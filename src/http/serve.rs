//! Workers, listeners, accept and drain.
//!
//! Each worker is an OS thread running a current-thread runtime with its
//! own listening socket per address (`SO_REUSEPORT`: the kernel spreads
//! new connections over the workers). HTTP/1.1 requests without a body
//! are served by [`super::h1`]; it hands everything else (a body, a
//! protocol switch, h2c) to hyper; [`super::conn`] closes idle ones.
//!
//! Shutdown: the cancellation token stops every accept loop and asks every
//! connection to finish what it holds and close (hyper's graceful
//! shutdown); queued requests are in hand, so they keep departing at their
//! pace. Connections and workers are tracked by `TaskTracker`s: when all
//! are done the drain is over; at the drain timeout the requests still
//! queued are answered 503, and in-flight upstream calls get a last grace
//! period.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use futures_util::FutureExt;
use http::Request;
use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use socket2::{Domain, Protocol, Socket, TcpKeepalive, Type};
use tokio::net::{TcpListener, TcpStream};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::Concurrency;
use super::conn::{ConnState, Conns, Guarded, OwnedPermit, Reason, Unanswered};
use super::h1::{self, RequestBody, Rewind};
use super::handler::Handler;
use super::route::App;
use super::{Handle, ServeError, Shared, limits, lock, unix_now, unrouted_counter};
use crate::admission::Admission;
use crate::config::Config;
use crate::metrics as m;

/// HTTP/2 flow-control windows and stream limit of client connections.
const H2_STREAM_WINDOW: u32 = 256 * 1024;
const H2_CONNECTION_WINDOW: u32 = 1024 * 1024;
const H2_MAX_STREAMS: u32 = 256;
/// What an answer may buffer on its HTTP/2 stream beyond what the client's
/// window lets out (h2's default is 400 KiB): a client that opens large
/// windows and never reads held 100 MiB per connection (256 streams).
const H2_SEND_BUF: usize = 64 * 1024;
/// How long an HTTP/2 client connection may be silent before sluice
/// pings it, and how long it then has to answer.
const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// The protocols served, configured once.
#[derive(Clone)]
struct Protocols {
    http1: http1::Builder,
    http2: http2::Builder<TokioExecutor>,
}

/// A client connection hyper serves: HTTP/2 (prior knowledge), or
/// HTTP/1.1 from a request [`h1`] leaves to hyper on.
// Boxed, both: the connection's task is as large as its largest state, and
// every HTTP/1.1 connection's task (which holds its waiting request) would
// otherwise carry room for hyper's, which only connections handed over
// use (one allocation for their life).
enum Conn<S>
where
    S: hyper::service::HttpService<hyper::body::Incoming>,
{
    H1(Pin<Box<http1::UpgradeableConnection<TokioIo<Rewind>, S>>>),
    H2(Pin<Box<http2::Connection<TokioIo<Rewind>, S, TokioExecutor>>>),
}

/// How often refusals are summarised in the log (one line per route per
/// interval instead of one per refusal).
const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A bound, not yet running server.
pub struct Server {
    shared: Arc<Shared>,
    /// Per worker, one listening socket per configured address.
    listeners: Vec<Vec<std::net::TcpListener>>,
    addrs: Vec<SocketAddr>,
    http: Protocols,
    max_connections: usize,
    max_head: usize,
    header_read_timeout: Duration,
    keepalive_timeout: Duration,
    send_timeout: Duration,
}

/// Workers for this machine: one per core, at most `configured` when set.
fn worker_count(configured: Option<usize>) -> usize {
    configured.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// An unbound socket for `addr`. An IPv6 one takes IPv6 only (nginx's
/// `ipv6only=on`): on Linux's default, `[::]:P` would also take IPv4 and
/// clash with a `0.0.0.0:P` listener beside it, which `check` accepts.
fn socket_for(addr: SocketAddr) -> std::io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    socket.set_reuse_address(true)?;
    // Accepted connections inherit it: a client that vanished without a
    // FIN or RST (a NAT that forgot it, a machine switched off) is found
    // out within about 90 s, so its held requests leave the queue instead
    // of keeping their places and being forwarded when they come due.
    socket.set_tcp_keepalive(&client_keepalive())?;
    Ok(socket)
}

/// TCP keepalive of client connections: probes after 60 s of silence,
/// then every 10 s; three unanswered close the connection.
fn client_keepalive() -> TcpKeepalive {
    TcpKeepalive::new()
        .with_time(Duration::from_secs(60))
        .with_interval(Duration::from_secs(10))
        .with_retries(3)
}

/// A listening socket on `addr` (not shared with other sockets).
pub fn listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket_for(addr)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// A listening socket on `addr` that other workers may share.
fn reuseport_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let socket = socket_for(addr)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    // The accept queue: past it the kernel drops a SYN, and its client
    // waits a second for the retransmission. Long enough for a burst of
    // connects while the workers are busy (the kernel caps it at
    // net.core.somaxconn, 4096 by default; nginx asks for 511, Go and
    // HAProxy for somaxconn).
    socket.listen(4096)?;
    Ok(socket.into())
}

/// One socket per worker on `addr`. The address is first taken without
/// `SO_REUSEPORT`, so that an address another process holds is refused as
/// usual instead of being shared with it; a port 0 becomes the port the
/// first socket got.
fn bind_group(addr: SocketAddr, workers: usize) -> std::io::Result<Vec<std::net::TcpListener>> {
    let probe = listener(addr)?;
    let addr = probe.local_addr()?;
    drop(probe);
    (0..workers).map(|_| reuseport_listener(addr)).collect()
}

impl Server {
    /// Build the admission layer and the routing tables from `config`,
    /// then bind every listener. Nothing is served until [`Server::start`].
    pub async fn bind(config: &Config) -> Result<Server, ServeError> {
        // Without HTTP listeners (a pure mail relay), no HTTP workers.
        let workers = if config.server.listen.is_empty() {
            0
        } else {
            worker_count(config.server.workers)
        };
        let admission = Arc::new(Admission::start(limits(config), config.cluster.as_ref())?);
        // The shared schedule's store is checked before serving: a wrong
        // topology is logged (and /readyz says why) until it is right; with
        // on_failure = "reject" sluice refuses to start instead.
        if let Err(why) = admission.check_backend().await
            && admission.backend_required()
        {
            return Err(ServeError::Backend(why));
        }
        let tls = crate::tls::client_config();
        let staging = Arc::new(super::stage::StageBudget::new(
            config.limits.max_staged_body,
            config.limits.max_staged_bytes,
        ));
        let smtp = Arc::new(crate::smtp::Front::bind(
            config,
            admission.clone(),
            staging.clone(),
            tls.clone(),
        )?);
        let mut concurrency = Concurrency::default();
        let apps = App::build_all(&admission, config, &tls, workers, &mut concurrency, &[])?;
        let access_log = match &config.server.access_log {
            Some(path) => Some(Arc::new(super::access::AccessLog::open(path).map_err(
                |source| ServeError::AccessLog {
                    path: path.clone(),
                    source,
                },
            )?)),
            None => None,
        };

        let mut listeners: Vec<Vec<std::net::TcpListener>> =
            (0..workers).map(|_| Vec::new()).collect();
        let mut addrs = Vec::with_capacity(config.server.listen.len());
        for &addr in &config.server.listen {
            let group =
                bind_group(addr, workers).map_err(|source| ServeError::Bind { addr, source })?;
            if let Some(first) = group.first() {
                addrs.push(first.local_addr().unwrap_or(addr));
            }
            for (i, l) in group.into_iter().enumerate() {
                listeners[i].push(l);
            }
        }

        let mut http1 = http1::Builder::new();
        http1
            .timer(TokioTimer::new())
            // Timed by the connection's task instead (`Conns::head_bytes`):
            // hyper's timer also runs while a keep-alive connection waits
            // for its next request, which closed it at this timeout rather
            // than at `keepalive_timeout`.
            .header_read_timeout(None)
            .max_buf_size(config.server.max_header_size);
        let mut http2 = http2::Builder::new(TokioExecutor::new());
        http2
            .timer(TokioTimer::new())
            .max_header_list_size(u32::try_from(config.server.max_header_size).unwrap_or(u32::MAX))
            // What a client may push before sluice reads it: bodies are
            // staged (and counted) as they arrive; the windows bound what
            // sits in HTTP/2's own buffers meanwhile.
            .initial_stream_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(H2_CONNECTION_WINDOW)
            .max_concurrent_streams(H2_MAX_STREAMS)
            .max_send_buf_size(H2_SEND_BUF)
            // A client gone silent (its held calls still queued) is found
            // out sooner than TCP keepalive alone would.
            .keep_alive_interval(Some(H2_PING_INTERVAL))
            .keep_alive_timeout(H2_PING_TIMEOUT);
        let http = Protocols { http1, http2 };

        metrics::gauge!(m::CONFIG_LOADED_TIMESTAMP_SECONDS).set(unix_now() as f64);
        Ok(Server {
            shared: Arc::new(Shared {
                admission,
                smtp,
                apps: apps.into_iter().map(ArcSwap::from_pointee).collect(),
                concurrency: Mutex::new(concurrency),
                staging,
                tls,
                draining: AtomicBool::new(false),
                stopping: AtomicBool::new(false),
                drain_timeout: Mutex::new(config.server.drain_timeout),
                shutdown_delay: Mutex::new(config.server.shutdown_delay),
                body_read_timeout: config.server.body_read_timeout,
                version: AtomicU64::new(1),
                loaded_at: AtomicU64::new(unix_now()),
                unrouted: unrouted_counter(),
                tunnels: super::tunnel::Tunnels::new(config.server.max_tunnels),
                workers,
                access_log,
                runtimes: std::sync::OnceLock::new(),
                fixed: super::fixed_at_start(config, workers),
            }),
            listeners,
            addrs,
            http,
            max_connections: config.server.max_connections,
            max_head: config.server.max_header_size,
            header_read_timeout: config.server.header_read_timeout,
            keepalive_timeout: config.server.keepalive_timeout,
            send_timeout: config.server.send_timeout,
        })
    }

    /// The addresses actually bound (useful with port 0).
    pub fn local_addrs(&self) -> Vec<SocketAddr> {
        self.addrs.clone()
    }

    /// A handle for reload, status and readiness.
    pub fn handle(&self) -> Handle {
        Handle(self.shared.clone())
    }

    /// Start the workers: each one's runtime built and its listeners
    /// registered before this returns, so that a worker that cannot start
    /// (a thread limit, a runtime's descriptors) is an error at start, not
    /// a warning after the service said it is ready with fewer workers.
    pub async fn start(self) -> Result<Running, ServeError> {
        for addr in &self.addrs {
            info!(%addr, workers = self.listeners.len(), "proxy listening");
        }
        let stop = CancellationToken::new();
        // Accepting begins once every worker is up: a start that fails
        // has served nobody (a request queued meanwhile kept it waiting).
        let go = CancellationToken::new();
        let workers = TaskTracker::new();
        // Each worker gets its share of max_connections.
        let share = self.max_connections.div_ceil(self.listeners.len().max(1));
        let mut started = Vec::with_capacity(self.listeners.len());
        let mut failed = None;
        for (i, listeners) in self.listeners.into_iter().enumerate() {
            let worker = Worker {
                handler: Arc::new(Handler {
                    shared: self.shared.clone(),
                    worker: i,
                    tunnels: TaskTracker::new(),
                }),
                max_head: self.max_head,
                http: self.http.clone(),
                conns: Arc::new(Conns::new(
                    share,
                    self.header_read_timeout,
                    self.keepalive_timeout,
                    self.send_timeout,
                )),
                stop: stop.clone(),
                go: go.clone(),
            };
            let token = workers.token();
            let (ready, up) = tokio::sync::oneshot::channel();
            let spawned = std::thread::Builder::new()
                .name(format!("sluice-worker-{i}"))
                .spawn(move || {
                    worker.run(listeners, ready);
                    drop(token);
                });
            match spawned {
                Ok(_) => started.push((i, up)),
                Err(e) => {
                    failed = Some(ServeError::Worker(i, e));
                    break;
                }
            }
        }
        let mut runtimes = Vec::with_capacity(started.len());
        for (i, up) in started {
            let up = up.await.unwrap_or_else(|_| {
                Err(std::io::Error::other("the thread ended before it served"))
            });
            match up {
                Ok(runtime) => runtimes.push(runtime),
                Err(e) => {
                    failed.get_or_insert(ServeError::Worker(i, e));
                }
            }
        }
        workers.close();
        if let Some(e) = failed {
            // The workers that did start end at once: none has accepted a
            // connection.
            stop.cancel();
            workers.wait().await;
            return Err(e);
        }
        let _ = self.shared.runtimes.set(runtimes);
        go.cancel();
        Ok(Running {
            shared: self.shared,
            stop,
            workers,
        })
    }
}

/// The workers serving, as [`Server::start`] left them.
pub struct Running {
    shared: Arc<Shared>,
    stop: CancellationToken,
    workers: TaskTracker,
}

impl Running {
    /// Serve until `shutdown` resolves, then drain: stop accepting, let
    /// queued requests depart at their pace until every connection has
    /// closed or the drain timeout passes, answer the rest 503, and give
    /// in-flight upstream calls a last grace period.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let Running {
            shared,
            stop,
            workers,
        } = self;
        let smtp_sessions = TaskTracker::new();
        shared.smtp.run(&stop, &smtp_sessions);
        smtp_sessions.close();
        let summaries = tokio::spawn(log_refusals(Handle(shared.clone())));

        shutdown.await;
        shared.draining.store(true, Ordering::Release);
        let timeout = *lock(&shared.drain_timeout);
        let queued = shared.admission.stats().1;
        info!(
            queued,
            ?timeout,
            "draining: no new connections; queued requests keep their pace"
        );
        stop.cancel();
        let all = async {
            workers.wait().await;
            smtp_sessions.wait().await;
        };
        if tokio::time::timeout(timeout, all).await.is_err() {
            shared.tunnels.close();
            let refused = shared.admission.close_waiting();
            if refused > 0 {
                warn!(refused, "drain timeout passed: answering the rest 503");
            }
            // Calls and relays in flight finish (no relay starts now),
            // each front end within its own grace.
            let (http, smtp) = tokio::join!(
                tokio::time::timeout(shared.http_grace(), workers.wait()),
                tokio::time::timeout(shared.smtp_grace(), smtp_sessions.wait()),
            );
            if http.is_err() || smtp.is_err() {
                warn!("connections still open after the in-flight grace period; closing");
            }
        }
        shared.tunnels.close();
        summaries.abort();
        info!("drained");
    }
}

/// A worker's word that it serves, or why it cannot.
/// Whether a worker is up: its runtime, or why not.
type Ready = tokio::sync::oneshot::Sender<std::io::Result<tokio::runtime::Handle>>;

/// What one worker thread needs.
struct Worker {
    handler: Arc<Handler>,
    /// `server.max_header_size`.
    max_head: usize,
    http: Protocols,
    conns: Arc<Conns>,
    stop: CancellationToken,
    /// Cancelled when every worker is up: accept from then on.
    go: CancellationToken,
}

impl Worker {
    /// Serve on this thread; `ready` hears whether the runtime and the
    /// listeners are up.
    fn run(self, listeners: Vec<std::net::TcpListener>, ready: Ready) {
        match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime.block_on(self.serve(listeners, ready)),
            Err(e) => {
                let _ = ready.send(Err(e));
            }
        }
    }

    async fn serve(self, listeners: Vec<std::net::TcpListener>, ready: Ready) {
        let registered: std::io::Result<Vec<TcpListener>> =
            listeners.into_iter().map(TcpListener::from_std).collect();
        let listeners = match registered {
            Ok(l) => l,
            Err(e) => {
                let _ = ready.send(Err(e));
                return;
            }
        };
        let _ = ready.send(Ok(tokio::runtime::Handle::current()));
        tokio::select! {
            () = self.go.cancelled() => {}
            () = self.stop.cancelled() => return,
        }
        let connections = TaskTracker::new();
        let me = Arc::new(self);
        let mut loops = vec![tokio::spawn(crate::memory::return_cache_when_idle())];
        for l in listeners {
            loops.push(tokio::spawn(me.clone().accept_loop(l, connections.clone())));
        }
        me.stop.cancelled().await;
        me.conns.shut_down();
        for l in loops {
            l.abort();
        }
        // Every connection finishes what it holds and closes; tunnels
        // run until the drain timeout closes them.
        connections.close();
        connections.wait().await;
        me.handler.tunnels.close();
        me.handler.tunnels.wait().await;
    }

    async fn accept_loop(self: Arc<Self>, listener: TcpListener, connections: TaskTracker) {
        loop {
            let accepted = tokio::select! {
                () = self.stop.cancelled() => return,
                a = listener.accept() => a,
            };
            match accepted {
                Ok((stream, peer)) => {
                    // At its share of max_connections, a worker closes its
                    // oldest idle connection for the new one; with none
                    // idle, the new one waits for a place (and the kernel
                    // backlog holds the rest, as HAProxy's maxconn). Room
                    // is made once a connection has come, not ahead of
                    // it: made ahead, it closed an idle connection for one
                    // that might never come, and a connection accepted
                    // just before (idle until its first request is read)
                    // could be the one closed.
                    let permit = tokio::select! {
                        () = self.stop.cancelled() => return,
                        p = self.conns.admit() => match p {
                            Some(p) => p,
                            None => return,
                        },
                    };
                    let _ = stream.set_nodelay(true);
                    connections.spawn(self.clone().serve_connection(stream, peer, permit));
                }
                Err(e) => {
                    // EMFILE and friends: back off rather than spin.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Serve one connection until it ends, closing it gracefully (the
    /// request in hand finishes) on shutdown, when it has been idle too
    /// long, or when a new connection needs its place. (An `async` block,
    /// not an `async fn`, which would keep a dead copy of each argument
    /// in every connection's task.)
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps a second copy of each argument in every connection's task"
    )]
    fn serve_connection(
        self: Arc<Self>,
        stream: TcpStream,
        peer: SocketAddr,
        permit: OwnedPermit,
    ) -> impl Future<Output = ()> + Send {
        async move {
            let state = self.conns.opened();
            let session = h1::Session {
                handler: &self.handler,
                conns: &self.conns,
                state: &state,
                peer: &peer,
                max_head: self.max_head,
            };
            let (io, h2) = match h1::serve(session, stream).await {
                h1::Next::Closed => {
                    self.conns.closed(&state);
                    drop(permit);
                    return;
                }
                h1::Next::Hyper { io, h2 } => (io, h2),
            };
            let handler = self.handler.clone();
            let (conns, st) = (self.conns.clone(), state.clone());
            // The request counts as in flight until its answer is sent: a
            // connection streaming an answer is neither idle nor evicted.
            let service = service_fn(move |req: Request<Incoming>| {
                let guard = conns.request(&st);
                let unanswered = Unanswered::new(&st);
                handler
                    .handle(req.map(RequestBody::from), peer)
                    .map(move |response| {
                        unanswered.answered();
                        Ok::<_, Infallible>(response.map(|body| Guarded::new(body, guard)))
                    })
            });
            let conn = Conn::new(&self.http, io, h2, service);
            tokio::pin!(conn);
            let mut closing = false;
            // Once closing, how long it may take: past it with nothing in
            // flight (an HTTP/2 handshake or GOAWAY the client never
            // finishes), the connection is dropped.
            let mut give_up = Instant::now();
            let grace = self.conns.send_timeout;
            loop {
                let deadline = self.conns.idle_deadline(&state);
                let recheck = deadline
                    .unwrap_or_else(|| Instant::now() + self.conns.keepalive_timeout.min(grace));
                let timer = tokio::time::sleep_until(recheck.into());
                tokio::pin!(timer);
                tokio::select! {
                    // The connection first: the bytes it reads may bring
                    // the idle deadline forward (a head begun).
                    biased;
                    result = conn.as_mut() => {
                        if let Err(e) = result {
                            debug!(%peer, error = %e, "connection ended with an error");
                        }
                        break;
                    }
                    why = state.close.wait(), if !closing => {
                        match why {
                            Reason::Evicted => {
                                debug!(%peer, "idle connection closed for a new one");
                            }
                            Reason::Resets => warn!(
                                %peer,
                                "client reset most of its requests as it made them: connection closed (GOAWAY)"
                            ),
                            Reason::Shutdown | Reason::Idle => {}
                        }
                        conn.as_mut().graceful_shutdown();
                        closing = true;
                        give_up = Instant::now() + grace;
                    }
                    () = idle_timer(&self.conns, &state, timer.as_mut()), if !closing => {
                        if self.conns.stalled(&state) {
                            debug!(%peer, "client took nothing of its answers for send_timeout: closed");
                            break;
                        }
                        // Marked, so that eviction passes it over.
                        if self.conns.idle_deadline(&state).is_some_and(|d| d <= Instant::now())
                            && state.close.signal(Reason::Idle)
                        {
                            debug!(%peer, "idle connection closed");
                            conn.as_mut().graceful_shutdown();
                            closing = true;
                            give_up = Instant::now() + grace;
                        }
                    }
                    () = tokio::time::sleep_until(give_up.into()), if closing => {
                        if !self.conns.busy(&state) || self.conns.stalled(&state) {
                            debug!(%peer, "connection did not close in time: dropped");
                            break;
                        }
                        give_up = Instant::now() + grace;
                    }
                }
            }
            self.conns.closed(&state);
            drop(permit);
        }
    }
}

/// `timer`, brought forward to the connection's idle deadline when that
/// has come earlier since it was set (the first bytes of a head, read by
/// hyper, start the header timeout).
fn idle_timer<'a>(
    conns: &'a Conns,
    state: &'a ConnState,
    mut timer: Pin<&'a mut tokio::time::Sleep>,
) -> impl Future<Output = ()> + 'a {
    std::future::poll_fn(move |cx| {
        if let Some(due) = conns.idle_deadline(state)
            && due < timer.deadline().into_std()
        {
            timer.as_mut().reset(due.into());
        }
        timer.as_mut().poll(cx)
    })
}

impl<S, B> Conn<S>
where
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>
        + Clone
        + Send
        + Unpin
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    fn new(protocols: &Protocols, io: Rewind, h2: bool, service: S) -> Conn<S> {
        let io = TokioIo::new(io);
        if h2 {
            Conn::H2(Box::pin(protocols.http2.serve_connection(io, service)))
        } else {
            Conn::H1(Box::pin(
                protocols
                    .http1
                    .serve_connection(io, service)
                    .with_upgrades(),
            ))
        }
    }

    /// Finish what is in hand, then close.
    fn graceful_shutdown(self: std::pin::Pin<&mut Self>) {
        match self.get_mut() {
            Conn::H1(c) => c.as_mut().graceful_shutdown(),
            Conn::H2(c) => c.as_mut().graceful_shutdown(),
        }
    }
}

impl<S, B> std::future::Future for Conn<S>
where
    S: hyper::service::HttpService<hyper::body::Incoming, ResBody = B>
        + Clone
        + Send
        + Unpin
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Output = Result<(), hyper::Error>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        match self.get_mut() {
            Conn::H1(c) => c.as_mut().poll(cx),
            Conn::H2(c) => c.as_mut().poll(cx),
        }
    }
}

/// One log line per route per interval for refusals, never one per
/// refusal: a flood must not become a log flood.
async fn log_refusals(handle: Handle) {
    let mut tick = tokio::time::interval(REFUSAL_LOG_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        for (route, protocol, refused) in handle.take_refusals() {
            let answers = match protocol {
                crate::admission::Protocol::Http => "429/503",
                crate::admission::Protocol::Smtp => "451/421",
            };
            warn!(%route, refused, interval = ?REFUSAL_LOG_INTERVAL, "requests refused ({answers})");
        }
    }
}

/// Which of `runtimes` (by place) do not run a task within `within`: a
/// worker whose thread a task blocks, or a task that never yields, serves
/// none of its connections while the process looks well. A runtime that
/// has ended (its worker stopped) is not stuck.
pub(crate) async fn stuck(runtimes: &[tokio::runtime::Handle], within: Duration) -> Vec<usize> {
    let deadline = tokio::time::Instant::now() + within;
    let asks: Vec<_> = runtimes.iter().map(|rt| rt.spawn(async {})).collect();
    let mut stuck = Vec::new();
    for (i, ask) in asks.into_iter().enumerate() {
        if tokio::time::timeout_at(deadline, ask).await.is_err() {
            stuck.push(i);
        }
    }
    stuck
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the watchdog asks of the workers: a runtime whose thread is
    /// blocked is named; one that runs, or has ended, is not.
    #[tokio::test]
    async fn a_worker_runtime_whose_thread_is_blocked_is_stuck() {
        let worker = || {
            let (tx, rx) = std::sync::mpsc::channel();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let thread = std::thread::spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let _ = tx.send(runtime.handle().clone());
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            });
            (rx.recv().unwrap(), stop, thread)
        };
        let (running, stop_running, running_thread) = worker();
        let (blocked, stop_blocked, blocked_thread) = worker();
        let (ended, stop_ended, ended_thread) = worker();
        let _ = stop_ended.send(());
        ended_thread.join().unwrap();
        let within = Duration::from_secs(1);
        let all = [running.clone(), blocked.clone(), ended];
        assert!(stuck(&all, within).await.is_empty());
        blocked.spawn(async { std::thread::sleep(Duration::from_millis(2_500)) });
        assert_eq!(stuck(&all, within).await, [1]);
        let _ = stop_running.send(());
        let _ = stop_blocked.send(());
        running_thread.join().unwrap();
        blocked_thread.join().unwrap();
    }

    #[test]
    fn ipv6_listeners_take_ipv6_only() {
        let v6 = socket_for("[::1]:0".parse().unwrap()).unwrap();
        assert!(v6.only_v6().unwrap());
        let v4 = socket_for("127.0.0.1:0".parse().unwrap()).unwrap();
        assert!(v4.reuse_address().unwrap());
    }
}
