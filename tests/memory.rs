//! Memory (issue 12, point 5), with real clients in child processes:
//! resident memory while many requests are queued (HTTP/1.1, one
//! connection each, as many as this machine's 20,000-descriptor limit
//! allows; HTTP/2, 100,000 streams from h2load), and after they leave.
//! Figures are printed; the bounds asserted hold for this debug build.
//! BENCHMARKS.md has the release build's figures beside nginx.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::*;

const CONFIG: &str = r#"
[server]
listen = ["127.0.0.1:0"]
max_connections = 200000

[admin]
listen = "127.0.0.1:0"

[[upstream]]
name = "api"
url = "http://DOWNSTREAM"

[[route]]
name = "hold"
upstream = "api"
key = "header:X-Client"
rate = "1/h"
capacity = 1000000

[limits]
max_queued = 1000000
"#;

async fn queued(s: &Sluice) -> u64 {
    s.status().await["queued"].as_u64().unwrap_or(0)
}

async fn wait_queued(s: &Sluice, at_least: u64, within: Duration) -> u64 {
    let deadline = Instant::now() + within;
    loop {
        let q = queued(s).await;
        if q >= at_least || Instant::now() > deadline {
            return q;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Queue requests with `load`, report RSS per queued request, end the
/// load, and report RSS 20 s later.
async fn measure(
    what: &str,
    n: u64,
    load: impl FnOnce(&Sluice) -> std::process::Child,
) -> (u64, u64, u64) {
    let ds = Downstream::start().await;
    let s = Sluice::start(&CONFIG.replace("DOWNSTREAM", &ds.addr.to_string()));
    let warm = get(&client(), &s.url("/warm"), &[("x-client", "k")]).await;
    assert_eq!(
        warm.status,
        http::StatusCode::OK,
        "{what}: the warm-up request"
    );
    let idle = rss_kib(s.pid());
    let mut child = load(&s);
    let q = wait_queued(&s, n - 1, Duration::from_secs(240)).await;
    let held = rss_kib(s.pid());
    let per_request = (held.saturating_sub(idle)) * 1024 / q.max(1);
    let _ = child.kill();
    let _ = child.wait();
    let left = wait_queued_zero(&s).await;
    tokio::time::sleep(Duration::from_secs(20)).await;
    let after = rss_kib(s.pid());
    println!(
        "{what}: {q} queued: RSS {held} KiB ({per_request} bytes per queued request, idle {idle} KiB); \
         {left} left after the clients went; 20 s later RSS {after} KiB ({:.2} x idle)",
        after as f64 / idle as f64
    );
    assert!(q >= n - 1, "{what}: only {q} of {n} queued");
    assert_eq!(
        left, 0,
        "{what}: requests still queued 60 s after their clients went"
    );
    (idle, per_request, after)
}

async fn wait_queued_zero(s: &Sluice) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let q = queued(s).await;
        if q == 0 || Instant::now() > deadline {
            return q;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_of_queued_requests_is_bounded_and_comes_back() {
    // HTTP/2: 100,000 streams over 500 connections.
    let (idle, per_stream, after) = measure("HTTP/2", 100_000, |s| {
        Command::new("h2load")
            .args([
                "-c",
                "500",
                "-m",
                "200",
                "-n",
                "100000",
                "-H",
                "x-client: k",
            ])
            .arg(s.url("/hold"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("h2load is needed (bash .ci/run installs nghttp2-client)")
    })
    .await;
    assert!(
        per_stream < 12 * 1024,
        "{per_stream} bytes per HTTP/2 stream"
    );
    assert!(
        after < idle * 3,
        "RSS {after} KiB after the load, idle {idle} KiB"
    );

    // HTTP/1.1: one connection per request, within 20,000 descriptors.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/hold_http1.py");
    let (idle, per_request, after) = measure("HTTP/1.1", 8_000, |s| {
        Command::new("python3")
            .args([script, "127.0.0.1", &s.addr.port().to_string(), "8000"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .expect("python3")
    })
    .await;
    assert!(
        per_request < 32 * 1024,
        "{per_request} bytes per HTTP/1.1 request"
    );
    assert!(
        after < idle * 3,
        "RSS {after} KiB after the load, idle {idle} KiB"
    );
}
