//! WebSocket (HTTP/1.1 Upgrade) through sluice with a real client and
//! server library (Python `websockets`), in child processes on loopback:
//! handshakes are paced 1/r per key, established tunnels pass unshaped.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{PyServer, Sluice, clients_dir, python_for};

/// ws_server.py, an echo server: what it printed (`open <ns> <path>`,
/// `closed <path>`).
struct WsServer(PyServer);

impl WsServer {
    fn start() -> WsServer {
        WsServer(PyServer::start("websockets", "ws_server.py", &[]))
    }

    fn port(&self) -> u16 {
        self.0.port
    }

    /// Handshake arrivals (monotonic ns), in order, once there are at
    /// least `n` (or after 10 s).
    fn opens(&self, n: usize) -> Vec<u64> {
        self.0
            .lines_once("open ", n)
            .iter()
            .filter_map(|l| l.strip_prefix("open "))
            .filter_map(|r| r.split(' ').next()?.parse().ok())
            .collect()
    }

    fn closed(&self) -> usize {
        self.0
            .lines()
            .iter()
            .filter(|l| l.starts_with("closed "))
            .count()
    }
}

fn ws_client(url: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(python_for("websockets"));
    cmd.arg(clients_dir().join("ws_client.py"))
        .args(["--url", url])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    cmd
}

/// One client's handshake to `url` is refused, its error naming `status`.
fn refused_with(url: &str, status: &str) {
    let out = ws_client(url, &["--count", "1", "--timeout", "8"])
        .output()
        .unwrap();
    let rs = results(&out);
    assert_eq!(rs.len(), 1, "{rs:?}");
    assert_eq!(rs[0]["opened"], false, "{rs:?}");
    assert!(
        rs[0]["error"].as_str().is_some_and(|e| e.contains(status)),
        "{rs:?}"
    );
}

fn results(out: &std::process::Output) -> Vec<Value> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

fn config(port: u16, drain: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
drain_timeout = "{drain}"

[admin]
listen = "127.0.0.1:0"

[[upstream]]
name = "ws"
url = "http://127.0.0.1:{port}"

[[route]]
name = "sockets"
upstream = "ws"
key = "ip"
rate = "10/s"
capacity = 40
"#
    )
}

/// `n` tunnels to `/held`, their clients keeping them open for 30 s
/// unless closed, once `/status` counts them; and a runtime for more
/// admin calls.
fn hold_tunnels(sluice: &Sluice, n: u64) -> (support::KillOnDrop, tokio::runtime::Runtime) {
    let url = format!("ws://{}/held", sluice.addr);
    let count = n.to_string();
    let client = support::KillOnDrop::new(
        ws_client(
            &url,
            &["--count", &count, "--hold", "30", "--timeout", "10"],
        )
        .spawn()
        .unwrap(),
    );
    (client, wait_tunnels(sluice, n))
}

/// Wait (up to 10 s) until `/status` counts `n` tunnels open; a runtime
/// for more admin calls.
fn wait_tunnels(sluice: &Sluice, n: u64) -> tokio::runtime::Runtime {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = rt.block_on(sluice.status());
        if status["tunnels"].as_u64() == Some(n) {
            return rt;
        }
        assert!(Instant::now() < deadline, "{status}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A reconnect storm: 30 clients at once, r = 10/s, b = 40: all open,
/// their handshakes reach the server 100 ms apart, and every tunnel
/// echoes at once after opening; closes pass both ways.
#[test]
fn thirty_clients_open_paced_and_echo_at_once() {
    let server = WsServer::start();
    let sluice = Sluice::start(&config(server.port(), "5s"));
    let url = format!("ws://{}/chat", sluice.addr);
    let out = ws_client(&url, &["--count", "30", "--timeout", "15"])
        .output()
        .unwrap();
    let rs = results(&out);
    assert_eq!(rs.len(), 30, "{rs:?}");
    for r in &rs {
        assert_eq!(r["opened"], true, "{r}");
        let echo = r["echo_ms"].as_f64().unwrap();
        assert!(echo < 500.0, "slow echo through the tunnel: {r}");
    }
    let opens = server.opens(30);
    assert_eq!(opens.len(), 30);
    // Each handshake is a new upstream connection that the server's event
    // loop timestamps: a gap may shrink by what the one before it was
    // late, but 29 of them must span 29 intervals.
    let gaps: Vec<u64> = opens
        .windows(2)
        .map(|w| (w[1] - w[0]) / 1_000_000)
        .collect();
    assert!(
        gaps.iter().all(|&g| (50..=300).contains(&g)),
        "handshake gaps at the server (ms): {gaps:?}"
    );
    let total = (opens[29] - opens[0]) / 1_000_000;
    assert!((2_800..=3_500).contains(&total), "29 gaps took {total} ms");
    // The clients closed: every server side saw it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.closed() < 30 {
        assert!(Instant::now() < deadline, "{} closed", server.closed());
        std::thread::sleep(Duration::from_millis(50));
    }
    // The server closing reaches the client.
    let out = ws_client(&url, &["--count", "1", "--server-close"])
        .output()
        .unwrap();
    let rs = results(&out);
    assert_eq!(rs.len(), 1, "{rs:?}");
    assert_eq!(rs[0]["server_closed"], true, "{rs:?}");
    assert_eq!(rs[0]["close_code"], 1000, "{rs:?}");
    // All tunnels gone from the count.
    wait_tunnels(&sluice, 0);
}

/// SIGTERM with open tunnels: they stay until the drain timeout, then
/// close, and sluice exits 0.
#[test]
fn sigterm_closes_open_tunnels_after_the_drain_timeout() {
    let server = WsServer::start();
    let mut sluice = Sluice::start(&config(server.port(), "1s"));
    // Held for 30 s unless closed: sluice ignoring drain_timeout (1 s)
    // would wait for the clients and exit after about 30 s.
    let (client, rt) = hold_tunnels(&sluice, 2);
    let metrics = rt.block_on(support::get(
        &support::client(),
        &sluice.admin_url("/metrics"),
        &[],
    ));
    assert!(
        String::from_utf8_lossy(&metrics.body).contains("sluice_tunnels 2"),
        "the gauge"
    );
    let t = Instant::now();
    sluice.signal("TERM");
    let status = sluice.wait_exit(Duration::from_secs(15));
    let took = t.elapsed();
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(8),
        "exited after {took:?}"
    );
    // Both server sides saw their tunnel close.
    let deadline = Instant::now() + Duration::from_secs(10);
    while server.closed() < 2 {
        assert!(Instant::now() < deadline, "{} closed", server.closed());
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = client.wait_with_output().unwrap();
    let rs = results(&out);
    assert_eq!(rs.len(), 2, "{rs:?}");
    assert!(rs.iter().all(|r| r["opened"] == true), "{rs:?}");
    // Each client saw its tunnel closed before its 30 s hold ended.
    assert!(rs.iter().all(|r| r["hold_cut"] == true), "{rs:?}");
}

/// An open tunnel holds its upstream's `max_concurrency` slot until it
/// closes (as Envoy's and HAProxy's connection limits count upgraded
/// connections): with `max_concurrency = 1`, a second handshake waits for
/// the slot and gets 504 after `request_timeout`, and the server never
/// sees it. The slot went with the 101's empty body, so any number of
/// tunnels reached the upstream.
#[test]
fn an_open_tunnel_holds_its_max_concurrency_slot() {
    let server = WsServer::start();
    let cfg = config(server.port(), "1s").replace(
        "url = \"http://",
        "max_concurrency = 1\nrequest_timeout = \"1s\"\nurl = \"http://",
    );
    let sluice = Sluice::start(&cfg);
    let url = format!("ws://{}/held", sluice.addr);
    let _held = hold_tunnels(&sluice, 1);
    refused_with(&url, "504");
    assert_eq!(server.opens(1).len(), 1, "the second reached the server");
}

/// `max_tunnels_per_key`: a client key holding its route's share of
/// tunnels open gets 429 for another at once (nginx's `limit_conn`), and
/// gets one again once one of its tunnels closes.
#[test]
fn a_key_holds_at_most_its_routes_share_of_tunnels() {
    let server = WsServer::start();
    let cfg = config(server.port(), "1s").replace(
        "capacity = 40\n",
        "capacity = 40\nmax_tunnels_per_key = 2\n",
    );
    let sluice = Sluice::start(&cfg);
    let url = format!("ws://{}/more", sluice.addr);
    let held = hold_tunnels(&sluice, 2);
    refused_with(&url, "429");
    assert_eq!(server.opens(2).len(), 2, "the third reached the server");
    // Its tunnels closed, the key opens one again.
    drop(held);
    drop(wait_tunnels(&sluice, 0));
    let out = ws_client(&url, &["--count", "1", "--timeout", "8"])
        .output()
        .unwrap();
    let rs = results(&out);
    assert_eq!(rs[0]["opened"], true, "{rs:?}");
}

/// An open tunnel does not stand in the way of the connection limit: one
/// worker at `max_connections = 2` with two idle keep-alive connections
/// beside a tunnel, and a new connection closes the oldest idle one at
/// once. The tunnel kept its former connection's state alive, and an
/// eviction took that state's place in the idle queue, closing nothing:
/// the new connection waited for a keep-alive timeout (30 s here).
#[test]
fn an_open_tunnel_takes_no_eviction_meant_for_idle_connections() {
    use std::io::{BufRead, BufReader, Write};
    let server = WsServer::start();
    let cfg = config(server.port(), "1s").replace(
        "listen = [\"127.0.0.1:0\"]\n",
        "listen = [\"127.0.0.1:0\"]\nworkers = 1\nmax_connections = 2\nkeepalive_timeout = \"30s\"\n",
    );
    let sluice = Sluice::start(&cfg);
    let _held = hold_tunnels(&sluice, 1);
    let ask = |path: &str| {
        let sock = std::net::TcpStream::connect(sluice.addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let mut conn = BufReader::new(sock);
        let head = format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n");
        conn.get_mut().write_all(head.as_bytes()).unwrap();
        let mut line = String::new();
        let _ = conn.read_line(&mut line);
        (conn, line)
    };
    // Two idle keep-alive connections: the worker is at its limit.
    let idle: Vec<_> = ["/one", "/two"].into_iter().map(ask).collect();
    for (_, line) in &idle {
        assert!(line.starts_with("HTTP/1.1 "), "{line:?}");
    }
    let t = Instant::now();
    let (_, line) = ask("/three");
    let took = t.elapsed();
    assert!(line.starts_with("HTTP/1.1 "), "{line:?} after {took:?}");
    assert!(took < Duration::from_secs(5), "answered after {took:?}");
}
