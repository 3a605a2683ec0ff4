//! Shared test harness: a real downstream HTTP server that records what
//! reaches it, a launcher for the real `sluice` binary on ephemeral ports,
//! and a small HTTP client.
#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

/// One request as the downstream saw it.
#[derive(Debug, Clone)]
pub struct Seen {
    pub at: Instant,
    pub method: String,
    pub path: String,
    pub headers: HeaderMap,
    pub body_len: usize,
}

/// A real HTTP/1.1 downstream on 127.0.0.1. Paths starting with `/slow`
/// answer after 5 s; `/echo` echoes the body; anything else answers "ok".
/// It counts requests in flight and remembers the most seen at once.
#[derive(Clone)]
pub struct Downstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    in_flight: Arc<AtomicUsize>,
    max_in_flight: Arc<AtomicUsize>,
}

impl Downstream {
    pub async fn start() -> Downstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let ds = Downstream {
            addr: listener.local_addr().unwrap(),
            seen: Arc::default(),
            in_flight: Arc::default(),
            max_in_flight: Arc::default(),
        };
        let state = ds.clone();
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, std::convert::Infallible>(state.serve(req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        ds
    }

    async fn serve(&self, req: Request<Incoming>) -> Response<Full<Bytes>> {
        let at = Instant::now();
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let (parts, body) = req.into_parts();
        let path = parts.uri.path().to_string();
        let body = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        self.seen.lock().unwrap().push(Seen {
            at,
            method: parts.method.to_string(),
            path: path.clone(),
            headers: parts.headers.clone(),
            body_len: body.len(),
        });
        if path.starts_with("/slow") {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
        let reply = if path.starts_with("/echo") {
            body
        } else {
            Bytes::from_static(b"ok")
        };
        Response::new(Full::new(reply))
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }
}

/// The real `sluice` binary, running on a config written for the test.
pub struct Sluice {
    child: Child,
    pub addr: SocketAddr,
    config: PathBuf,
}

static CONFIG_SEQ: AtomicUsize = AtomicUsize::new(0);

/// Write `toml` to a fresh temp file and return its path.
pub fn write_config(toml: &str) -> PathBuf {
    let n = CONFIG_SEQ.fetch_add(1, Ordering::SeqCst);
    let path = std::env::temp_dir().join(format!("sluice-test-{}-{n}.toml", std::process::id()));
    std::fs::write(&path, toml).unwrap();
    path
}

impl Sluice {
    /// Start `sluice run` on `toml` (whose listen address should be
    /// 127.0.0.1:0) and wait until it reports its bound address.
    pub fn start(toml: &str) -> Sluice {
        let config = write_config(toml);
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["--log-level", "info", "run", "--config"])
            .arg(&config)
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start sluice");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { return };
                if !sent
                    && line.contains("listening")
                    && let Some(addr) = line.split("addr=").nth(1)
                    && let Ok(addr) = addr.trim().parse::<SocketAddr>()
                {
                    let _ = tx.send(addr);
                    sent = true;
                }
                if std::env::var_os("SLUICE_TEST_LOG").is_some() {
                    eprintln!("[sluice] {line}");
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("sluice did not report a listening address");
        Sluice {
            child,
            addr,
            config,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.config);
    }
}

/// A plain HTTP/1.1 client (one pool shared by the test).
pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// What a response looked like.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub at: Instant,
}

/// Send a request with `headers`; panics only on transport failure.
pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Answer {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = client
        .request(req.body(Full::new(body)).unwrap())
        .await
        .expect("request failed");
    let status = resp.status();
    let headers = resp.headers().clone();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body,
        at: Instant::now(),
    }
}

/// GET with headers.
pub async fn get(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    headers: &[(&str, &str)],
) -> Answer {
    send(client, "GET", url, headers, Bytes::new()).await
}

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
pub fn closed_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().port()
}
