//! The admin listener: `/metrics` (Prometheus text), `/healthz` (the
//! process is up), `/readyz` (503 while draining), `/status` (JSON). Meant
//! for loopback or a private interface; it has no authentication. On
//! loopback, what it tells (`/status`, `/metrics`, `/buckets`) it answers
//! only to requests that name a loopback host (DNS rebinding).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::admission::{Probe, Rejection};
use crate::http::Handle;
use crate::metrics::Outcome;

/// Serve the admin endpoints on `listener` until the task is dropped.
pub async fn serve(
    listener: std::sync::Arc<TcpListener>,
    server: Handle,
    metrics: PrometheusHandle,
    show_keys: bool,
) {
    let mut on_loopback = false;
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "admin listening");
        on_loopback = addr.ip().is_loopback();
        if !on_loopback {
            warn!(
                %addr,
                "the admin listener is not on loopback and has no authentication: \
                 firewall it, or listen on 127.0.0.1"
            );
        }
    }
    let open = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    // One `/status` walk at a time, on a blocking thread: it visits every
    // client slot, which at a million clients takes tens of milliseconds
    // that the runtime (SMTP sessions, signals, the watchdog) should not
    // wait on, and 64 connections asking at once should not multiply.
    let walk = std::sync::Arc::new(tokio::sync::Semaphore::new(1));
    // The open connections, oldest first, each with its way to close.
    let opened: Arc<Opened> = Arc::default();
    let mut next_id = 0u64;
    // New connections waiting for a place at the limit.
    let waiting = Arc::new(AtomicUsize::new(0));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                warn!(error = %e, "admin accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // At the limit (the admin listener's descriptors come out of the
        // proxy's), the oldest connection is asked to close (at once when
        // idle, after its answer otherwise), as the proxy's limit does: 64
        // connections kept open, by anyone who reaches the port, refused
        // every health check. Past a second, the new one is closed.
        // Registered in accept order (the oldest first).
        let place = match open.clone().try_acquire_owned() {
            Ok(place) => Some((place, register(&opened, next_id))),
            Err(_) if waiting.load(Ordering::Relaxed) >= MAX_WAITING => {
                debug!(%peer, "admin connection refused: {MAX_CONNECTIONS} open");
                continue;
            }
            Err(_) => {
                if let Some((_, oldest)) = lock(&opened).pop_front() {
                    oldest.cancel();
                }
                None
            }
        };
        let id = next_id;
        next_id += 1;
        let (open, waiting) = (open.clone(), waiting.clone());
        let opened = opened.clone();
        let server = server.clone();
        let metrics = metrics.clone();
        let walk = walk.clone();
        tokio::spawn(async move {
            // Waited for in the connection's own task: the accept loop
            // goes on (a flood of new connections at the limit must not
            // queue a health check behind each one's wait).
            let (place, evicted) = match place {
                Some(placed) => placed,
                None => {
                    waiting.fetch_add(1, Ordering::Relaxed);
                    let got = tokio::time::timeout(EVICT_WAIT, open.acquire_owned()).await;
                    waiting.fetch_sub(1, Ordering::Relaxed);
                    match got {
                        Ok(Ok(place)) => (place, register(&opened, id)),
                        _ => {
                            debug!(%peer, "admin connection refused: {MAX_CONNECTIONS} open");
                            return;
                        }
                    }
                }
            };
            let svc = service_fn(move |req: Request<Incoming>| {
                let probe = matches!(req.uri().path(), "/healthz" | "/readyz");
                let reply = if on_loopback && !probe && !loopback_host(&req) {
                    Reply::Now(text(
                        StatusCode::MISDIRECTED_REQUEST,
                        "text/plain",
                        "the admin listener answers loopback names only (localhost, *.localhost, 127.0.0.0/8, [::1])\n",
                    ))
                } else {
                    answer(&req, &server, &metrics)
                };
                let (server, walk) = (server.clone(), walk.clone());
                async move {
                    Ok::<_, Infallible>(match reply {
                        Reply::Now(response) => response,
                        Reply::Status => status_walk(server, walk, show_keys).await,
                    })
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(10))
                .serve_connection(TokioIo::new(stream), svc);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                () = evicted.cancelled() => {
                    // Within the new one's wait: a head sent slowly, or an
                    // answer never read, does not hold the place.
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(EVICT_WAIT / 2, conn.as_mut())
                        .await
                        .unwrap_or(Ok(()))
                }
                () = tokio::time::sleep(CONNECTION_LIFETIME) => {
                    // An answer under way is finished, then the
                    // connection closes; one the client never reads is
                    // dropped a little later.
                    conn.as_mut().graceful_shutdown();
                    tokio::time::timeout(CLOSE_GRACE, conn.as_mut())
                        .await
                        .unwrap_or(Ok(()))
                }
            };
            if let Err(e) = ended {
                debug!(%peer, error = %e, "admin connection ended with an error");
            }
            lock(&opened).retain(|(open_id, _)| *open_id != id);
            drop(place);
        });
    }
}

/// Whether the request names a loopback host (`localhost`, a name under
/// it, a loopback address; any port), or none. A listener on loopback
/// answers only those: a web page whose name an attacker's DNS turns to
/// 127.0.0.1 (DNS rebinding) reaches the port from the user's browser,
/// but names its own host, and must not read `/status` or `/metrics` or
/// probe keys through `/buckets`. (`/healthz` and `/readyz` tell nothing
/// and answer any name: a health checker's Host is its own business.)
fn loopback_host(req: &Request<Incoming>) -> bool {
    let named = match req.headers().get(http::header::HOST) {
        Some(host) => host
            .to_str()
            .ok()
            .and_then(|h| h.parse::<http::uri::Authority>().ok()),
        None => req.uri().authority().cloned(),
    };
    let Some(authority) = named else {
        // No name at all (HTTP/1.0): nothing a browser sends.
        return req.headers().get(http::header::HOST).is_none();
    };
    let host = authority.host().trim_end_matches('.').to_ascii_lowercase();
    if host == "localhost" || host.ends_with(".localhost") {
        return true;
    }
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .parse::<std::net::IpAddr>()
        .is_ok_and(|ip| ip.is_loopback())
}

/// Admin connections open at once.
const MAX_CONNECTIONS: usize = 64;
/// How long an admin connection takes requests (a scraper reconnects),
/// and how long it may then take to finish the answer under way (a client
/// that never reads its answer is dropped).
const CONNECTION_LIFETIME: std::time::Duration = std::time::Duration::from_secs(60);
const CLOSE_GRACE: std::time::Duration = std::time::Duration::from_secs(10);
/// How long a new admin connection at the limit waits for the oldest to
/// close.
const EVICT_WAIT: std::time::Duration = std::time::Duration::from_secs(1);
/// New admin connections that may wait so at once; past them, closed.
const MAX_WAITING: usize = 16;

/// The admin connections open, oldest first, each with the token that
/// closes it.
type Opened = Mutex<VecDeque<(u64, CancellationToken)>>;

/// Connection `id` at the end of `opened`; the token that closes it.
fn register(opened: &Opened, id: u64) -> CancellationToken {
    let evicted = CancellationToken::new();
    lock(opened).push_back((id, evicted.clone()));
    evicted
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Bind the admin address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = crate::http::listener(addr)?;
    socket.set_nonblocking(true)?;
    TcpListener::from_std(socket)
}

fn text(
    status: StatusCode,
    content_type: &'static str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    r
}

/// `GET /buckets/{route}/{key}?cost=N` (the key percent-encoded, as
/// `/status` shows it).
fn bucket(req: &Request<Incoming>, path: &str, server: &Handle) -> Response<Full<Bytes>> {
    if let Some(store) = server.backend() {
        // The schedule is the store's; this instance's engine would answer
        // "idle, admitted now" for every client.
        return text(
            StatusCode::NOT_IMPLEMENTED,
            "text/plain",
            format!(
                "cluster mode: each client's schedule is in {store}; the bucket query sees only one instance\n"
            ),
        );
    }
    let rest = &path["/buckets/".len()..];
    let Some((route, key)) = rest.split_once('/') else {
        return text(
            StatusCode::NOT_FOUND,
            "text/plain",
            "use /buckets/{route}/{key}?cost=N\n",
        );
    };
    let cost = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .find_map(|kv| kv.strip_prefix("cost="))
        .map_or(Some(1), |v| v.parse::<u32>().ok().filter(|&c| c >= 1));
    let Some(cost) = cost else {
        return text(
            StatusCode::BAD_REQUEST,
            "text/plain",
            "cost must be a whole number >= 1\n",
        );
    };
    // The path's own percent-encoding is undone once here; the key's
    // display form may itself hold escapes (bytes that are not text).
    let Some(key) = percent_encoding::percent_decode_str(key)
        .decode_utf8()
        .ok()
        .map(|k| k.into_owned())
    else {
        return text(
            StatusCode::BAD_REQUEST,
            "text/plain",
            "the key is not valid percent-encoded UTF-8\n",
        );
    };
    match server.bucket(route, &key, cost) {
        Some(b) => {
            let (verdict, admitted, retry_after_ms) = match b.probe {
                Probe::Depart => ("depart", true, None),
                Probe::Queue { .. } => ("queue", true, None),
                Probe::Reject(
                    Rejection::Full { retry_after } | Rejection::MaxWait { retry_after },
                ) => ("reject", false, Some(retry_after.div_ceil(1_000_000))),
                Probe::Reject(_) => ("overloaded", false, None),
            };
            let view = b.view;
            let doc = serde_json::json!({
                "route": b.route,
                "key": key,
                "fingerprint": b.fingerprint,
                "cost": cost,
                "waiting": view.map_or(0, |v| v.waiting),
                "waiting_cost": view.map_or(0, |v| v.waiting_cost),
                "next_departure_ms": view.map_or(0, |v| v.next_departure.saturating_sub(b.now) / 1_000_000),
                "admitted_now": admitted,
                "verdict": verdict,
                "retry_after_ms": retry_after_ms,
            });
            text(StatusCode::OK, "application/json", doc.to_string())
        }
        None => text(
            StatusCode::NOT_FOUND,
            "text/plain",
            "no such route, or not a key of that route\n",
        ),
    }
}

/// The `/status` document: routes, config version and load time, totals,
/// and the 20 deepest queues.
fn status(server: &Handle, show_keys: bool) -> serde_json::Value {
    let (clients, queued) = server.stats();
    let (version, loaded_at) = server.version();
    let (deepest, now) = server.deepest(20, show_keys);
    let deepest: Vec<serde_json::Value> = deepest
        .into_iter()
        .map(|q| {
            serde_json::json!({
                "route": q.route,
                "key": q.key,
                "waiting": q.view.waiting,
                "waiting_cost": q.view.waiting_cost,
                "drains_in_ms": q.view.next_departure.saturating_sub(now) / 1_000_000,
            })
        })
        .collect();
    let routes: Vec<serde_json::Value> = server
        .routes()
        .into_iter()
        .map(|r| {
            let mut route = serde_json::json!({
                "name": r.name,
                "protocol": r.protocol,
                "upstream": r.upstream,
                "rate_per_second": r.rate_per_second,
                "capacity": r.capacity,
            });
            match r.path_prefix {
                Some(prefix) => route["path_prefix"] = prefix.into(),
                None => {
                    route["listen"] = r
                        .listen
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .into();
                }
            }
            route
        })
        .collect();
    let slots = server.upstream_slots();
    let upstreams: Vec<serde_json::Value> = server
        .upstreams()
        .into_iter()
        .map(|(name, protocol, paused)| {
            let mut upstream = serde_json::json!({
                "name": name,
                "protocol": protocol,
                "paused_for_ms": paused.map(|d| d.as_millis() as u64),
            });
            if protocol == "http"
                && let Some((_, cap, (busy, waiting))) = slots.iter().find(|s| s.0 == name)
            {
                upstream["max_concurrency"] = (*cap).into();
                upstream["in_flight"] = (*busy).into();
                upstream["waiting_for_slot"] = (*waiting).into();
            }
            upstream
        })
        .collect();
    let totals: serde_json::Map<String, serde_json::Value> = Outcome::ALL
        .iter()
        .map(|&o| (o.as_str().to_owned(), server.total(o).into()))
        .collect();
    serde_json::json!({
        "config": { "version": version, "loaded_at_unix": loaded_at },
        "draining": server.is_draining(),
        "cluster": server.backend().map(|backend| serde_json::json!({
            "backend": backend,
            "state": if server.backend_healthy() == Some(true) && server.backend_problem().is_none() {
                "ok"
            } else {
                "failing"
            },
            "problem": server.backend_problem(),
        })),
        // Before PostgreSQL, the only store: kept for existing probes.
        "redis": (server.backend() == Some("redis"))
            .then(|| server.backend_healthy().map(|ok| if ok { "ok" } else { "failing" }))
            .flatten(),
        "redis_problem": (server.backend() == Some("redis"))
            .then(|| server.backend_problem())
            .flatten(),
        "routes": routes,
        "upstreams": upstreams,
        "clients": clients,
        "staged_bytes": server.staged_bytes(),
        "connections": server.connections(),
        "smtp_sessions": server.smtp_sessions(),
        "tunnels": server.tunnels(),
        "memory": crate::memory::usage().map(|u| serde_json::json!({
            "allocated_bytes": u.allocated,
            "resident_bytes": u.resident,
        })),
        "queued": queued,
        "totals": totals,
        "deepest_queues": deepest,
    })
}

/// An admin answer: made at once, or the `/status` document, which is
/// walked off the runtime ([`status_walk`]).
enum Reply {
    Now(Response<Full<Bytes>>),
    Status,
}

/// The `/status` answer, walked on a blocking thread, one walk at a time.
async fn status_walk(
    server: Handle,
    walk: std::sync::Arc<tokio::sync::Semaphore>,
    show_keys: bool,
) -> Response<Full<Bytes>> {
    // The place goes with the walk: a client that leaves does not free it
    // while its walk still runs.
    let one = walk.acquire_owned().await;
    let walked = tokio::task::spawn_blocking(move || {
        let _one = one;
        status(&server, show_keys).to_string()
    });
    match walked.await {
        Ok(doc) => text(StatusCode::OK, "application/json", doc),
        Err(_) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            "the status walk failed\n",
        ),
    }
}

fn answer(req: &Request<Incoming>, server: &Handle, metrics: &PrometheusHandle) -> Reply {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        // RFC 9110 15.5.6: a 405 says what is allowed.
        let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "GET only\n");
        r.headers_mut().insert(
            http::header::ALLOW,
            http::HeaderValue::from_static("GET, HEAD"),
        );
        return Reply::Now(r);
    }
    if req.uri().path() == "/status" {
        return Reply::Status;
    }
    Reply::Now(match req.uri().path() {
        "/metrics" => {
            server.refresh_gauges();
            text(
                StatusCode::OK,
                "text/plain; version=0.0.4",
                crate::metrics::render(metrics, &server.upstream_slots()),
            )
        }
        "/healthz" => text(StatusCode::OK, "text/plain", "ok\n"),
        "/readyz" => match server.not_ready() {
            Some(why) => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("{why}\n"),
            ),
            None => text(StatusCode::OK, "text/plain", "ready\n"),
        },
        path if path.starts_with("/buckets/") => bucket(req, path, server),
        _ => text(
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: try /metrics, /healthz, /readyz or /status\n",
        ),
    })
}
