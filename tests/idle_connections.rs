//! Idle and silent client connections (issue 12, point 1), in their own
//! test binary so that no other binary's sluice shares their process
//! limits (the other tests of this file do run beside them, and CI's
//! machine is busy): 10,000 silent sockets and 2,000 idle HTTP/2
//! connections are closed within their timeouts, and a normal client is
//! never locked out meanwhile.

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use support::*;

/// A worker at its share of `max_connections` closes an idle keep-alive
/// connection only when a new connection has come for its place: with
/// none waiting, both idle connections stay open and serve again. (Room
/// made ahead of the next connection closed the older one as soon as the
/// limit was reached, and could close a connection just accepted, before
/// its first request was read.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_only_for_a_connection_that_came() {
    use std::io::{BufRead, BufReader, Read, Write};
    let ds = Downstream::start().await;
    let cfg = CONFIG.replace("DOWNSTREAM", &ds.addr.to_string()).replace(
        "keepalive_timeout = \"3s\"",
        "keepalive_timeout = \"30s\"\nworkers = 1\nmax_connections = 2",
    );
    let s = Sluice::start(&cfg);
    let ask = |conn: &mut BufReader<std::net::TcpStream>, path: &str| {
        let head = format!("GET {path} HTTP/1.1\r\nHost: t\r\n\r\n");
        if conn.get_mut().write_all(head.as_bytes()).is_err() {
            return String::new();
        }
        // The whole answer: its head, then its 2-byte body ("ok").
        let mut head = String::new();
        loop {
            let mut line = String::new();
            if conn.read_line(&mut line).unwrap_or(0) == 0 {
                return head;
            }
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        let mut body = [0u8; 2];
        let _ = conn.read_exact(&mut body);
        head
    };
    let open = || {
        let sock = std::net::TcpStream::connect(s.addr).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        BufReader::new(sock)
    };
    let (mut one, mut two) = (open(), open());
    assert!(ask(&mut one, "/one").starts_with("HTTP/1.1 200"));
    assert!(ask(&mut two, "/two").starts_with("HTTP/1.1 200"));
    // Both idle at the limit, and no third connection.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = ask(&mut one, "/one-again");
    assert!(again.starts_with("HTTP/1.1 200"), "{again:?}");
    assert!(ask(&mut two, "/two-again").starts_with("HTTP/1.1 200"));
    // A third closes the one idle longest (`one` was used before `two`).
    let mut three = open();
    assert!(ask(&mut three, "/three").starts_with("HTTP/1.1 200"));
    // Closed: an end of file now, not the read timeout (an error).
    let mut buf = [0u8; 1];
    let end = one.get_mut().read(&mut buf);
    assert!(
        matches!(end, Ok(0)),
        "the oldest idle is not closed: {end:?}"
    );
}

/// Let this test process open as many sockets as the machine allows.
fn raise_open_files() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
    }
}

async fn connections(s: &Sluice) -> u64 {
    s.status().await["connections"].as_u64().unwrap_or(u64::MAX)
}

/// Wait until `s` has no connection open, at most 15 s after `since`.
async fn all_closed(s: &Sluice, since: Instant, what: &str) {
    while connections(s).await != 0 {
        assert!(
            since.elapsed() < Duration::from_secs(15),
            "{what}: still open after {:?}",
            since.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

const CONFIG: &str = r#"
[server]
listen = ["127.0.0.1:0"]
header_read_timeout = "2s"
keepalive_timeout = "3s"

[admin]
listen = "127.0.0.1:0"

[[upstream]]
name = "api"
url = "http://DOWNSTREAM"

[[route]]
name = "default"
upstream = "api"
key = "ip"
rate = "1000/s"
capacity = 10
"#;

/// 10,000 sockets that never send a byte (the default max_connections)
/// and 2,000 HTTP/2 connections that went idle after one request: all are
/// closed within their timeouts, and a normal client keeps getting answers
/// throughout (a new connection evicts an idle one): 95% in under 500 ms,
/// where a lock-out makes them wait for the 2 s header timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_idle_connections_are_closed_and_never_lock_clients_out() {
    raise_open_files();
    let ds = Downstream::start().await;
    let s = Sluice::start(&CONFIG.replace("DOWNSTREAM", &ds.addr.to_string()));
    let addr = s.addr;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));

    // The normal client: a fresh connection every 50 ms.
    let prober = {
        let (url, done) = (s.url("/probe"), done.clone());
        tokio::spawn(async move {
            let mut took = Vec::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let c = client();
                let t = Instant::now();
                let a = tokio::time::timeout(Duration::from_secs(5), get(&c, &url, &[])).await;
                assert!(
                    matches!(a, Ok(ref a) if a.status == StatusCode::OK),
                    "probe {} failed",
                    took.len()
                );
                took.push(t.elapsed());
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            took
        })
    };

    let silent: Vec<std::net::TcpStream> = tokio::task::spawn_blocking(move || {
        (0..10_000)
            .map(|_| std::net::TcpStream::connect(addr).expect("connect"))
            .collect()
    })
    .await
    .unwrap();
    let mut idle_h2 = Vec::new();
    for _ in 0..2_000 {
        let (mut h2, driver) = h2_connect(addr).await;
        let req = http::Request::get(format!("http://{addr}/h2"))
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        let _ = h2.send_request(req).await;
        idle_h2.push((h2, driver));
    }
    let opened = Instant::now();

    // Within the timeouts (2 s silent, 3 s idle; plus slack for this busy
    // machine) every one of them is closed.
    let deadline = opened + Duration::from_secs(12);
    loop {
        let n = connections(&s).await;
        if n <= 5 {
            break;
        }
        assert!(Instant::now() < deadline, "{n} connections still open");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let closed_after = opened.elapsed();
    done.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut took = prober.await.unwrap();
    took.sort();
    let p95 = took[took.len() * 95 / 100];
    let worst = took[took.len() - 1];
    println!(
        "12,000 connections closed within {closed_after:?}; {} probes: p95 {p95:?}, slowest {worst:?}",
        took.len()
    );
    // Locked out, a client would wait for the 2 s header timeout to free
    // a place (or forever), and so would most probes. The slowest may
    // have lost one SYN while 10,000 connects filled the accept queue on
    // a loaded machine: the kernel retransmits it after 1 s (seen once in
    // CI, at 1.07 s, with three release builds running beside it).
    // The p95 bound leaves room for a busy machine (12,000 connections
    // being opened beside the probes) and stays far from the 2 s a
    // lock-out gives.
    assert!(p95 < Duration::from_millis(500), "p95 of probes {p95:?}");
    assert!(
        worst < Duration::from_millis(1500),
        "a probe took {worst:?}"
    );
    // The silent sockets see their close.
    for mut sock in silent.into_iter().step_by(997) {
        use std::io::Read;
        sock.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut buf = [0u8; 1];
        assert!(matches!(sock.read(&mut buf), Ok(0) | Err(_)));
    }
    for (_, driver) in idle_h2 {
        assert!(driver.is_finished(), "an idle h2 connection is still open");
    }
}

/// A client that asks for a large answer and never reads it: the write
/// waits at most `server.send_timeout` for it, then the connection is
/// closed (nginx's `send_timeout`). It never counts as idle meanwhile.
/// Both on sluice's own HTTP/1.1 path and on hyper's (HTTP/1.0 here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_answer_is_closed_after_send_timeout() {
    use std::io::Write;
    let ds = Downstream::start().await;
    let config = CONFIG.replace("DOWNSTREAM", &ds.addr.to_string()).replace(
        "keepalive_timeout = \"3s\"",
        "keepalive_timeout = \"60s\"\nsend_timeout = \"1s\"",
    );
    let s = Sluice::start(&config);
    for (i, version) in ["HTTP/1.1", "HTTP/1.0"].into_iter().enumerate() {
        let mut sock = std::net::TcpStream::connect(s.addr).unwrap();
        sock.write_all(format!("GET /big {version}\r\nHost: t\r\n\r\n").as_bytes())
            .unwrap();
        let t = Instant::now();
        // Answered (the downstream saw it), then stuck writing.
        while ds.seen().len() <= i {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "{version}: never forwarded"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(connections(&s).await, 1, "{version}");
        all_closed(&s, t, version).await;
        drop(sock);
    }
}

/// A client that starts an HTTP/2 connection (the preface's first bytes)
/// and goes silent: once idle past its timeout it is asked to close, and
/// as it never finishes the handshake it is dropped `send_timeout` later,
/// instead of holding its place for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_started_http2_connection_is_dropped() {
    use std::io::Write;
    let ds = Downstream::start().await;
    let config = CONFIG.replace("DOWNSTREAM", &ds.addr.to_string()).replace(
        "keepalive_timeout = \"3s\"",
        "keepalive_timeout = \"1s\"\nsend_timeout = \"1s\"",
    );
    let s = Sluice::start(&config);
    let mut sock = std::net::TcpStream::connect(s.addr).unwrap();
    sock.write_all(b"PRI").unwrap();
    let t = Instant::now();
    while connections(&s).await != 1 {
        assert!(t.elapsed() < Duration::from_secs(10), "never counted");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    all_closed(&s, t, "the connection").await;
    drop(sock);
}

/// An HTTP/2 client that opens no flow-control window (initial stream
/// window 0) and asks for a large answer: nothing of it can be sent, and
/// after `send_timeout` without progress the connection is closed, which
/// frees what the call held (its upstream connection, a max_concurrency
/// slot). Meanwhile the connection is busy, not idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_takes_nothing_is_closed_after_send_timeout() {
    let ds = Downstream::start().await;
    let config = CONFIG.replace("DOWNSTREAM", &ds.addr.to_string()).replace(
        "keepalive_timeout = \"3s\"",
        "keepalive_timeout = \"60s\"\nsend_timeout = \"1s\"",
    );
    let s = Sluice::start(&config);
    let stream = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let (mut h2, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .initial_stream_window_size(0)
            .handshake::<_, http_body_util::Empty<Bytes>>(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    let conn = tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/big", s.addr))
        .body(http_body_util::Empty::new())
        .unwrap();
    let response = h2.send_request(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let t = Instant::now();
    assert_eq!(connections(&s).await, 1);
    all_closed(&s, t, "the connection").await;
    drop(response);
    conn.abort();
}

/// The held-back stream tests' sluice: `send_timeout` 1 s, and a route
/// `/wait` keyed by address at `rate` with room for two.
async fn held_back_setup(rate: &str) -> (Downstream, Sluice) {
    let ds = Downstream::start().await;
    let wait = format!(
        "[[route]]\nname = \"wait\"\nmatch = {{ path_prefix = \"/wait\" }}\nupstream = \"api\"\nkey = \"ip\"\nrate = \"{rate}\"\ncapacity = 2\n\n[[route]]\nname = \"default\""
    );
    let config = CONFIG
        .replace("DOWNSTREAM", &ds.addr.to_string())
        .replace(
            "keepalive_timeout = \"3s\"",
            "keepalive_timeout = \"60s\"\nsend_timeout = \"1s\"",
        )
        .replace("[[route]]\nname = \"default\"", &wait);
    let s = Sluice::start(&config);
    (ds, s)
}

/// A GET of `path` on `addr`, without a body.
fn get_request(
    addr: std::net::SocketAddr,
    path: &str,
) -> http::Request<http_body_util::Empty<Bytes>> {
    http::Request::get(format!("http://{addr}{path}"))
        .body(http_body_util::Empty::new())
        .unwrap()
}

/// On HTTP/2, a stream the client holds back (it reads nothing of a large
/// answer: flow control stops it) does not close the connection while
/// another request on it waits its turn in the queue: that one is
/// forwarded and answered when it comes due, long after `send_timeout`.
/// Once nothing but the held-back stream is left, `send_timeout` closes
/// the connection as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_back_http2_stream_does_not_cost_the_requests_queued_beside_it() {
    let (_ds, s) = held_back_setup("12/m").await;
    let (mut h2, conn) = h2_connect::<http_body_util::Empty<Bytes>>(s.addr).await;
    let request = |path: &str| get_request(s.addr, path);
    // A large answer, never read: its stream's window closes.
    let big = h2.send_request(request("/big")).await.unwrap();
    assert_eq!(big.status(), StatusCode::OK);
    // The route's one departure now goes to another connection, so the
    // next request on this one waits an interval (5 s).
    let first = get(&client(), &s.url("/wait/first"), &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    let t = Instant::now();
    let waited = h2.send_request(request("/wait/second")).await;
    let waited = waited.expect("the connection stayed open while the request waited");
    assert_eq!(waited.status(), StatusCode::OK);
    assert!(
        t.elapsed() > Duration::from_secs(2),
        "it did wait: {:?}",
        t.elapsed()
    );
    let body = http_body_util::BodyExt::collect(waited.into_body())
        .await
        .unwrap();
    assert_eq!(&body.to_bytes()[..], b"ok");
    // Now only the held-back stream is left: closed after send_timeout.
    all_closed(&s, Instant::now(), "the connection").await;
    drop(big);
    conn.abort();
}

/// Two streams held back are not borne, even with a request waiting
/// beside them: a client that holds back many answers holds their
/// upstream connections and buffers. The connection is closed after
/// `send_timeout`, and the waiting request goes with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_held_back_http2_streams_close_the_connection_after_send_timeout() {
    let (ds, s) = held_back_setup("6/m").await;
    let (mut h2, conn) = h2_connect::<http_body_util::Empty<Bytes>>(s.addr).await;
    let request = |path: &str| get_request(s.addr, path);
    let big = [
        h2.send_request(request("/big")).await.unwrap(),
        h2.send_request(request("/big")).await.unwrap(),
    ];
    let first = get(&client(), &s.url("/wait/first"), &[]).await;
    assert_eq!(first.status, StatusCode::OK);
    // Due 10 s on: the connection is closed long before.
    let waited = h2.send_request(request("/wait/second")).await;
    assert!(
        waited.is_err(),
        "answered on a connection that held back two streams"
    );
    assert!(
        ds.seen().iter().all(|r| r.path != "/wait/second"),
        "the waiting request left the queue with its connection"
    );
    drop(big);
    conn.abort();
}

/// The kernel's timer for the server side of the connection from
/// `client` to `server` (both 127.0.0.1): its kind (`/proc/net/tcp`'s
/// `tr`: 2 is the keepalive timer) and when it fires, in seconds.
fn server_side_timer(
    server: std::net::SocketAddr,
    client: std::net::SocketAddr,
) -> Option<(u32, f64)> {
    let table = std::fs::read_to_string("/proc/net/tcp").ok()?;
    // Local and remote as the table writes them: 0100007F:PORT in hex.
    let local = format!("0100007F:{:04X}", server.port());
    let remote = format!("0100007F:{:04X}", client.port());
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // Established (01): a socket still in SYN_RECV has a timer of its own.
        if f.len() < 6 || f[1] != local || f[2] != remote || f[3] != "01" {
            return None;
        }
        let (kind, when) = f[5].split_once(':')?;
        let kind = u32::from_str_radix(kind, 16).ok()?;
        // In clock ticks (USER_HZ, 100 a second on Linux).
        let when = u64::from_str_radix(when, 16).ok()? as f64 / 100.0;
        Some((kind, when))
    })
}

/// Client connections carry TCP keepalive, first probe after 60 s of
/// silence (the kernel's default is two hours): a client that vanished
/// without a FIN or RST is found out, and its held requests leave the
/// queue. HTTP and SMTP listeners are made the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_connections_are_probed_after_a_minute_of_silence() {
    let ds = Downstream::start().await;
    let s = Sluice::start(&CONFIG.replace("DOWNSTREAM", &ds.addr.to_string()));
    let conn = std::net::TcpStream::connect(s.addr).unwrap();
    let me = conn.local_addr().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    let timer = loop {
        // Accepted (the server's side is in the table) and idle.
        if let Some(t) = server_side_timer(s.addr, me) {
            break t;
        }
        assert!(Instant::now() < deadline, "no server side for {me}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (kind, when) = timer;
    assert_eq!(kind, 2, "the keepalive timer is armed");
    assert!(when > 30.0 && when <= 60.0, "first probe in {when} s");
    drop(conn);
}
