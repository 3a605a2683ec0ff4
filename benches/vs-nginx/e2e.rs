//! End-to-end load tool for the sluice vs nginx `limit_req` comparison
//! (driven by `benches/vs-nginx/run.sh`). Loopback only; every loop is
//! bounded in count and time.
//!
//! `e2e downstream PORT`   a fast HTTP/1.1 downstream that records arrival
//!                         times twice: when its handler runs, and when
//!                         the kernel received the request's last bytes
//!                         (`SO_TIMESTAMPNS`; on loopback that is inside the
//!                         sender's `send`, so it is the departure without
//!                         the downstream's own wake-up); `GET /__arrivals`
//!                         returns them (µs, `handler kernel` per line) and
//!                         clears the record.
//! `e2e grpc-downstream PORT` a fast gRPC downstream (HTTP/2 prior
//!                         knowledge) for `benches/grpc/run.sh`: every call
//!                         gets a unary reply, one message and
//!                         `grpc-status: 0` in trailers.
//! `e2e SCENARIO URL DOWNSTREAM_PORT [ARGS]` runs one scenario against the
//!                         proxy at URL and prints one JSON line.
//! `e2e clear DS_PORT`     forgets the downstream's arrivals.
//! `e2e intervals DS_PORT RATE` prints the interval statistics of the
//!                         arrivals since then (a backlog driven by wrk).
//! `e2e direct DS_PORT RATE N` the end-to-end floor of a pacing scenario:
//!                         no proxy, one thread sends N requests straight to
//!                         the downstream on one kept-alive connection, each
//!                         at its absolute deadline (sleep, then spin the
//!                         last 100 µs), and prints the arrivals' interval
//!                         statistics as `pacing` does.
//!
//! With `E2E_DUMP=FILE`, `pacing` also writes the downstream's arrival
//! times (µs, `handler kernel` per line) to FILE (`benches/vs-nginx/ab.sh` reads them in
//! its `burst` and `pacing` modes).

use std::io::IoSliceMut;
use std::os::fd::AsRawFd;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg, setsockopt, sockopt};
use serde_json::json;
use tokio::io::Interest;
use tokio::net::{TcpListener, TcpStream};

type Fail = Box<dyn std::error::Error + Send + Sync>;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("e2e: runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(dispatch(args));
    if let Err(e) = result {
        eprintln!("e2e: {e}");
        std::process::exit(1);
    }
}

async fn dispatch(args: Vec<String>) -> Result<(), Fail> {
    let arg = |i: usize| {
        args.get(i)
            .cloned()
            .ok_or_else(|| format!("missing argument {i}: see the module doc"))
    };
    let num = |i: usize| -> Result<u64, Fail> { Ok(arg(i)?.parse::<u64>()?) };
    match args.first().map(String::as_str) {
        Some("downstream") => downstream(num(1)? as u16).await,
        Some("grpc-downstream") => grpc_downstream(num(1)? as u16).await,
        Some("seed") => seed(&arg(1)?, num(2)? as u16).await,
        Some("pacing") => pacing(&arg(1)?, num(2)? as u16, num(3)?, num(4)?).await,
        Some("passthrough") => passthrough(&arg(1)?, num(3)?, Duration::from_secs(num(4)?)).await,
        Some("flood") => flood(&arg(1)?, num(3)?, Duration::from_secs(num(4)?)).await,
        Some("many") => many(&arg(1)?, num(2)? as u16, num(3)?).await,
        Some("intervals") => intervals(num(1)? as u16, num(2)?).await,
        Some("clear") => arrivals(num(1)? as u16).await.map(|_| ()),
        Some("direct") => direct(num(1)? as u16, num(2)?, num(3)?).await,
        _ => Err(
            "usage: e2e downstream PORT | e2e (seed|pacing|passthrough|flood|many) URL DS_PORT ..."
                .into(),
        ),
    }
}

// === the downstream ===

async fn downstream(port: u16) -> Result<(), Fail> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    // Accepted sockets inherit the flag, so even a request whose bytes
    // came before the accept is stamped.
    setsockopt(&listener, sockopt::ReceiveTimestampns, &true)?;
    let start = Instant::now();
    let start_real = SystemTime::now().duration_since(UNIX_EPOCH)?;
    let log: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    // Bounded: a downstream left running ends by itself after 30 minutes.
    let deadline = tokio::time::sleep(Duration::from_secs(1_800));
    tokio::pin!(deadline);
    loop {
        let (stream, _) = tokio::select! {
            a = listener.accept() => a?,
            _ = &mut deadline => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        let log = log.clone();
        let stamp = Arc::new(AtomicU64::new(0));
        let io = Stamped {
            io: stream,
            last: stamp.clone(),
            cmsg: nix::cmsg_space!(nix::sys::time::TimeSpec),
        };
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                let (log, stamp) = (log.clone(), stamp.clone());
                async move {
                    let body = if req.uri().path() == "/__arrivals" {
                        let mut l = log.lock().map_err(|_| "poisoned")?;
                        let text: String = l.iter().map(|(h, k)| format!("{h} {k}\n")).collect();
                        l.clear();
                        Bytes::from(text)
                    } else {
                        let at = start.elapsed().as_micros() as u64;
                        // No stamp (0) stays 0; the reader then drops the
                        // kernel's column.
                        let kernel = match stamp.swap(0, Ordering::Relaxed) {
                            0 => 0,
                            ns => (ns / 1_000)
                                .saturating_sub(start_real.as_micros() as u64)
                                .max(1),
                        };
                        log.lock().map_err(|_| "poisoned")?.push((at, kernel));
                        Bytes::from_static(b"ok")
                    };
                    Ok::<_, &'static str>(Response::new(Full::new(body)))
                }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(io), svc)
                .await;
        });
    }
}

/// A downstream connection that keeps the kernel's receive time of the
/// last bytes it read (`SO_TIMESTAMPNS`, ns since the Unix epoch).
struct Stamped {
    io: TcpStream,
    last: Arc<AtomicU64>,
    cmsg: Vec<u8>,
}

impl tokio::io::AsyncRead for Stamped {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        loop {
            std::task::ready!(this.io.poll_read_ready(cx))?;
            let fd = this.io.as_raw_fd();
            let (cmsg, last) = (&mut this.cmsg, &this.last);
            let dst = buf.initialize_unfilled();
            let read = this.io.try_io(Interest::READABLE, || {
                let mut iov = [IoSliceMut::new(dst)];
                let msg = recvmsg::<()>(fd, &mut iov, Some(cmsg), MsgFlags::empty())
                    .map_err(std::io::Error::from)?;
                for c in msg.cmsgs().into_iter().flatten() {
                    if let ControlMessageOwned::ScmTimestampns(ts) = c {
                        let ns = u64::try_from(ts.tv_sec()).unwrap_or(0) * 1_000_000_000
                            + u64::try_from(ts.tv_nsec()).unwrap_or(0);
                        last.store(ns, Ordering::Relaxed);
                    }
                }
                Ok(msg.bytes)
            });
            match read {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl tokio::io::AsyncWrite for Stamped {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

/// A gRPC unary server as fast as hyper allows (HTTP/2 prior knowledge),
/// bounded in time like the HTTP/1.1 downstream.
async fn grpc_downstream(port: u16) -> Result<(), Fail> {
    let listener = TcpListener::bind(("127.0.0.1", port)).await?;
    // Bounded: a downstream left running ends by itself after 30 minutes.
    let deadline = tokio::time::sleep(Duration::from_secs(1_800));
    tokio::pin!(deadline);
    loop {
        let (stream, _) = tokio::select! {
            a = listener.accept() => a?,
            _ = &mut deadline => return Ok(()),
        };
        let _ = stream.set_nodelay(true);
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(grpc_reply);
            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                .max_concurrent_streams(1_000)
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

/// One unary call: read the request message, then answer with one message
/// (a `grpc.health.v1` SERVING reply: field 1 = 1) and `grpc-status: 0` in
/// trailers, as a real server does.
async fn grpc_reply(
    req: Request<Incoming>,
) -> Result<
    Response<impl hyper::body::Body<Data = Bytes, Error = std::convert::Infallible>>,
    hyper::Error,
> {
    const SERVING: &[u8] = &[0, 0, 0, 0, 2, 0x08, 0x01];
    let _ = req.into_body().collect().await?;
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let body =
        Full::new(Bytes::from_static(SERVING)).with_trailers(async move { Some(Ok(trailers)) });
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    Ok(resp)
}

/// The downstream's record since it was last read: each arrival as its
/// handler saw it and as the kernel stamped it (µs, each list sorted).
struct Arrivals {
    handler: Vec<u64>,
    /// `None` when any arrival lacks a stamp.
    kernel: Option<Vec<u64>>,
}

async fn arrivals(ds_port: u16) -> Result<Arrivals, Fail> {
    let c = client();
    let url = format!("http://127.0.0.1:{ds_port}/__arrivals");
    let resp = c.request(Request::get(url).body(Empty::new())?).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    let (mut handler, mut kernel) = (Vec::new(), Vec::new());
    for line in String::from_utf8_lossy(&body).lines() {
        let mut cols = line.split(' ').map(|c| c.parse::<u64>().ok());
        if let Some(Some(h)) = cols.next() {
            handler.push(h);
            kernel.push(cols.next().flatten().unwrap_or(0));
        }
    }
    handler.sort_unstable();
    kernel.sort_unstable();
    let stamped = kernel.first().is_some_and(|&k| k > 0);
    Ok(Arrivals {
        handler,
        kernel: stamped.then_some(kernel),
    })
}

// === clients ===

fn client() -> Client<HttpConnector, Empty<Bytes>> {
    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(1_024)
        .build(http)
}

async fn get(
    c: &Client<HttpConnector, Empty<Bytes>>,
    url: &str,
    key: &str,
) -> Result<StatusCode, Fail> {
    let req = Request::get(url)
        .header("x-client", key)
        .body(Empty::new())?;
    let resp = c.request(req).await?;
    let status = resp.status();
    let _ = resp.into_body().collect().await?;
    Ok(status)
}

fn pct(sorted: &[u64], p: f64) -> u64 {
    sorted
        .get(((sorted.len().saturating_sub(1)) as f64 * p).round() as usize)
        .copied()
        .unwrap_or(0)
}

/// DESIGN section 1 seed: one client, 20 requests 25 ms apart.
async fn seed(url: &str, ds_port: u16) -> Result<(), Fail> {
    let c = client();
    let _ = arrivals(ds_port).await?;
    let start = Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::new();
    for i in 0..20u64 {
        tokio::time::sleep_until((start + Duration::from_millis(25 * i)).into()).await;
        let (c, url) = (c.clone(), format!("{url}/seed/{i}"));
        tasks.push(tokio::spawn(async move { get(&c, &url, "seed").await }));
    }
    let mut admitted = Vec::new();
    let mut refused = 0;
    for (i, t) in tasks.into_iter().enumerate() {
        match t.await?? {
            StatusCode::OK => admitted.push(i + 1),
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => refused += 1,
            s => return Err(format!("seed request {}: {s}", i + 1).into()),
        }
    }
    let times = arrivals(ds_port).await?.handler;
    let gaps: Vec<u64> = times.windows(2).map(|w| w[1] - w[0]).collect();
    println!(
        "{}",
        json!({"scenario": "seed", "admitted": admitted, "admitted_count": admitted.len(), "refused": refused,
               "gap_min_ms": gaps.iter().min().map(|g| *g as f64 / 1e3),
               "gap_max_ms": gaps.iter().max().map(|g| *g as f64 / 1e3),
               "last_ms": times.last().zip(times.first()).map(|(l, f)| (l - f) as f64 / 1e3)})
    );
    Ok(())
}

/// Inter-arrival statistics of downstream arrival times (µs, sorted) for
/// a target rate: percentiles of abs(interval - 1/r) skipping the first
/// `skip` intervals (connection set-up), and the mean interval over the
/// whole run (first to last arrival) with its error against 1/r.
fn interval_stats(times: &[u64], rate: u64, skip: usize) -> serde_json::Value {
    let t = 1_000_000 / rate.max(1);
    let intervals: Vec<u64> = times.windows(2).skip(skip).map(|w| w[1] - w[0]).collect();
    let mut dev: Vec<u64> = intervals.iter().map(|i| i.abs_diff(t)).collect();
    dev.sort_unstable();
    // Over the same intervals as the percentiles: the skipped first ones
    // (the load tool's connections still opening, requests arriving
    // slower than the rate) are arrivals, not the proxy's departures.
    let kept = times.get(skip..).unwrap_or_default();
    let mean = match (kept.first(), kept.last()) {
        (Some(first), Some(last)) if kept.len() > 1 => {
            (last - first) as f64 / (kept.len() - 1) as f64
        }
        _ => 0.0,
    };
    json!({"rate": rate, "intervals": dev.len(),
           "p50_us": pct(&dev, 0.5), "p90_us": pct(&dev, 0.9), "p99_us": pct(&dev, 0.99), "max_us": dev.last(),
           "mean_interval_us": mean, "mean_error_pct": (mean - t as f64) / t as f64 * 100.0})
}

/// [`interval_stats`] of the arrivals as the handler saw them, and under
/// `kernel` the same of the kernel's stamps (the departures from the
/// sender, without the downstream's own wake-up).
fn arrival_stats(a: &Arrivals, rate: u64, skip: usize) -> serde_json::Value {
    let mut line = interval_stats(&a.handler, rate, skip);
    if let Some(k) = &a.kernel {
        line["kernel"] = interval_stats(k, rate, skip);
    }
    line
}

/// The downstream's arrivals since the last call, as interval statistics
/// (after an external load such as wrk drove a backlog through a proxy).
async fn intervals(ds_port: u16, rate: u64) -> Result<(), Fail> {
    let mut line = arrival_stats(&arrivals(ds_port).await?, rate, 10);
    line["scenario"] = json!("intervals");
    println!("{line}");
    Ok(())
}

/// What a perfect pacer would show through this downstream on this
/// machine: `n` requests sent `1/rate` apart by one thread that sleeps and
/// then spins to each absolute deadline, on one connection opened before.
/// Every wake-up a proxy adds is absent; what remains is the loopback and
/// the downstream's own wake-up.
async fn direct(ds_port: u16, rate: u64, n: u64) -> Result<(), Fail> {
    let _ = arrivals(ds_port).await?;
    tokio::task::spawn_blocking(move || direct_send(ds_port, rate, n)).await??;
    let mut line = arrival_stats(&arrivals(ds_port).await?, rate, 10);
    line["scenario"] = json!("direct");
    println!("{line}");
    Ok(())
}

fn direct_send(ds_port: u16, rate: u64, n: u64) -> Result<(), Fail> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", ds_port))?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let spin = Duration::from_micros(100);
    let interval = Duration::from_nanos(1_000_000_000 / rate.max(1));
    let start = Instant::now() + Duration::from_millis(20);
    let mut buf = [0u8; 1024];
    for i in 0..n.min(100_000) {
        let at = start + interval * u32::try_from(i)?;
        let now = Instant::now();
        if at > now + spin {
            std::thread::sleep(at - now - spin);
        }
        while Instant::now() < at {
            std::hint::spin_loop();
        }
        s.write_all(b"GET /direct HTTP/1.1\r\nHost: downstream\r\n\r\n")?;
        // The downstream answers "ok" with a Content-Length: read to it.
        let mut got = 0;
        while !(buf[..got].windows(4).any(|w| w == b"\r\n\r\n") && buf[..got].ends_with(b"ok")) {
            if got == buf.len() {
                return Err("an unexpected answer from the downstream".into());
            }
            let k = s.read(&mut buf[got..])?;
            if k == 0 {
                return Err("the downstream closed the connection".into());
            }
            got += k;
        }
    }
    Ok(())
}

/// A full queue paced at `rate`/s: the downstream's inter-arrival deviation
/// from 1/r.
async fn pacing(url: &str, ds_port: u16, rate: u64, n: u64) -> Result<(), Fail> {
    let c = client();
    let _ = arrivals(ds_port).await?;
    let mut tasks = Vec::new();
    for i in 0..n {
        let (c, url) = (c.clone(), format!("{url}/pace/{i}"));
        tasks.push(tokio::spawn(async move { get(&c, &url, "pace").await }));
    }
    let mut ok = 0;
    for t in tasks {
        if matches!(t.await, Ok(Ok(StatusCode::OK))) {
            ok += 1;
        }
    }
    let times = arrivals(ds_port).await?;
    if let Some(path) = std::env::var_os("E2E_DUMP") {
        let kernel = times.kernel.as_deref().unwrap_or_default();
        let text: Vec<String> = (times.handler.iter().enumerate())
            .map(|(i, h)| format!("{h} {}", kernel.get(i).copied().unwrap_or(0)))
            .collect();
        std::fs::write(path, text.join("\n"))?;
    }
    // Skip the first 10 intervals: connection set-up of the flood.
    let mut line = arrival_stats(&times, rate, 10);
    line["scenario"] = json!("pacing");
    line["forwarded"] = json!(ok);
    println!("{line}");
    Ok(())
}

/// `conns` keep-alive connections, each its own client key (never shaped),
/// sending back to back for `dur`.
async fn passthrough(url: &str, conns: u64, dur: Duration) -> Result<(), Fail> {
    let lat = Arc::new(Mutex::new(Vec::new()));
    let until = Instant::now() + dur;
    let mut tasks = Vec::new();
    for k in 0..conns {
        let (url, lat) = (url.to_string(), lat.clone());
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            let mut sender = connect(&url).await?;
            while Instant::now() < until {
                let t = Instant::now();
                match send(&mut sender, &url, &format!("p{k}")).await {
                    Ok(StatusCode::OK) => mine.push(t.elapsed().as_micros() as u64),
                    Ok(_) => {}
                    // The proxy closed the keep-alive connection: reconnect.
                    Err(_) => sender = connect(&url).await?,
                }
            }
            lat.lock().map_err(|_| "poisoned")?.extend(mine);
            Ok::<_, Fail>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let mut l = lat.lock().map_err(|_| "poisoned")?.clone();
    l.sort_unstable();
    println!(
        "{}",
        json!({"scenario": "passthrough", "connections": conns, "requests_per_s": l.len() as f64 / dur.as_secs_f64(),
               "p50_us": pct(&l, 0.5), "p99_us": pct(&l, 0.99)})
    );
    Ok(())
}

/// `conns` keep-alive connections hammering one key: responses per second
/// by status.
async fn flood(url: &str, conns: u64, dur: Duration) -> Result<(), Fail> {
    let refused = Arc::new(AtomicU64::new(0));
    let ok = Arc::new(AtomicU64::new(0));
    let until = Instant::now() + dur;
    let mut tasks = Vec::new();
    for _ in 0..conns {
        let (url, refused, ok) = (url.to_string(), refused.clone(), ok.clone());
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(&url).await?;
            while Instant::now() < until {
                match send(&mut sender, &url, "flood").await {
                    Ok(StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                    // The proxy closed the keep-alive connection: reconnect.
                    Err(_) => sender = connect(&url).await?,
                }
            }
            Ok::<_, Fail>(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    let secs = dur.as_secs_f64();
    println!(
        "{}",
        json!({"scenario": "flood", "connections": conns,
               "refused_per_s": refused.load(Ordering::Relaxed) as f64 / secs,
               "forwarded_per_s": ok.load(Ordering::Relaxed) as f64 / secs})
    );
    Ok(())
}

/// `clients` distinct clients, each on its own keep-alive connection,
/// sending 2 requests: the first departs at once, the second queues, so
/// all clients have one request queued at the same time.
async fn many(url: &str, ds_port: u16, clients: u64) -> Result<(), Fail> {
    let _ = arrivals(ds_port).await?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..clients {
        let url = url.to_string();
        tasks.push(tokio::spawn(async move {
            let mut sender = connect(&url).await?;
            let mut statuses = Vec::new();
            for _ in 0..2 {
                statuses.push(send(&mut sender, &url, &format!("m{k}")).await?);
            }
            Ok::<_, Fail>(statuses)
        }));
    }
    let (mut ok, mut other, mut failed) = (0u64, 0u64, 0u64);
    // Any answer other than 200, by status: which one says why.
    let mut others = std::collections::BTreeMap::<String, u64>::new();
    for t in tasks {
        match t.await {
            Ok(Ok(statuses)) => {
                for s in statuses {
                    if s == StatusCode::OK {
                        ok += 1;
                    } else {
                        other += 1;
                        *others.entry(s.as_str().to_string()).or_default() += 1;
                    }
                }
            }
            _ => failed += 1,
        }
    }
    println!(
        "{}",
        json!({"scenario": "many", "clients": clients, "ok": ok, "refused": other,
               "refused_by_status": others, "failed_clients": failed,
               "seconds": t0.elapsed().as_secs_f64()})
    );
    Ok(())
}

// === one connection, sequential requests ===

type Sender = hyper::client::conn::http1::SendRequest<Empty<Bytes>>;

async fn connect(url: &str) -> Result<Sender, Fail> {
    let authority = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .ok_or("bad url")?
        .to_string();
    let stream = TcpStream::connect(&authority).await?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

async fn send(sender: &mut Sender, url: &str, key: &str) -> Result<StatusCode, Fail> {
    let path = url
        .trim_start_matches("http://")
        .split_once('/')
        .map_or("/", |x| x.1);
    let host = url
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or("");
    let req = Request::get(format!("/{path}"))
        .header("host", host)
        .header("x-client", key)
        .body(Empty::new())?;
    sender.ready().await?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let _ = resp.into_body().collect().await?;
    Ok(status)
}
