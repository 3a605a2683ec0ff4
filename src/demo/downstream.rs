//! The demo's built-in downstream: a small HTTP/1.1 server on
//! 127.0.0.1:0 that answers every request "ok" at once and records when it
//! arrived and for which client (`X-Client`, plus the demo's own
//! `X-Demo-Seq` to match it with the request that was sent).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::record::Recorder;

/// The header carrying the demo's request sequence number.
pub const SEQ_HEADER: &str = "x-demo-seq";

/// A running downstream; stops when dropped.
pub struct Downstream {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for Downstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Bind 127.0.0.1:0 and serve until dropped.
pub async fn start(recorder: Arc<Recorder>) -> std::io::Result<Downstream> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let mut connections = tokio::task::JoinSet::new();
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(_) => {
                    // Out of descriptors or the like: back off, do not spin.
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let recorder = recorder.clone();
            connections.spawn(async move {
                let service = service_fn(move |req| {
                    let recorder = recorder.clone();
                    async move { Ok::<_, Infallible>(serve(&recorder, req)) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
            // Reap finished connections so the set does not grow.
            while connections.try_join_next().is_some() {}
        }
    });
    Ok(Downstream { addr, task })
}

fn serve(recorder: &Recorder, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let at = Instant::now();
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    let client = header("x-client").unwrap_or_default();
    let seq = header(SEQ_HEADER).and_then(|s| s.parse().ok());
    recorder.arrived(at, client, seq);
    Response::new(Full::new(Bytes::from_static(b"ok\n")))
}
