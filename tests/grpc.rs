//! gRPC through sluice with real libraries: a grpcio server behind sluice
//! (`protocol = "h2c"`, and `"h2"` over TLS with a generated CA), grpcio
//! clients in front (h2c: sluice's HTTP listener has no TLS of its own),
//! all child processes on loopback.

mod support;

use std::ffi::OsStr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use support::{KillOnDrop, PyServer, Sluice, TempFile, TestCa, clients_dir, python_for};

/// grpc_server.py: its port, and each call's arrival (ns, payload).
struct GrpcServer(PyServer);

impl GrpcServer {
    fn start(tls: Option<&(TempFile, TempFile)>) -> GrpcServer {
        let args: Vec<&OsStr> = match tls {
            Some((cert, key)) => vec![
                OsStr::new("--tls-cert"),
                cert.as_os_str(),
                OsStr::new("--tls-key"),
                key.as_os_str(),
            ],
            None => Vec::new(),
        };
        GrpcServer(PyServer::start("grpc", "grpc_server.py", &args))
    }

    fn port(&self) -> u16 {
        self.0.port
    }

    /// The calls it took (monotonic ns, payload), once it has taken at
    /// least `n` (or after 10 s).
    fn calls(&self, n: usize) -> Vec<(u64, String)> {
        self.0
            .lines_once("call ", n)
            .iter()
            .filter_map(|l| {
                let (ns, payload) = l.strip_prefix("call ")?.split_once(' ')?;
                Some((ns.parse().ok()?, payload.to_owned()))
            })
            .collect()
    }
}

/// Run grpc_client.py to the end: its JSON lines.
fn client(target: &str, args: &[&str]) -> Vec<Value> {
    let out = client_cmd(target, args).output().unwrap();
    parse(&String::from_utf8_lossy(&out.stdout))
}

fn client_cmd(target: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(python_for("grpc"));
    cmd.arg(clients_dir().join("grpc_client.py"))
        .args(["--target", target]);
    cmd.args(args).stdin(Stdio::null()).stderr(Stdio::null());
    cmd
}

fn parse(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

fn config(upstream: &str, protocol: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[admin]
listen = "127.0.0.1:0"

[[upstream]]
name = "grpc"
url = "{upstream}"
protocol = "{protocol}"

[[route]]
name = "calls"
upstream = "grpc"
key = "ip"
rate = "5/s"
capacity = 10
ratelimit_headers = true
"#
    )
}

/// 20 unary calls at once, one client, r = 5/s, b = 10, through sluice
/// to a grpcio server: DESIGN section 1's outcome (the first departs, 10
/// wait, 9 are refused), refusals are RESOURCE_EXHAUSTED with a pushback
/// trailer and come at once, the admitted calls reach the server 1/r
/// apart with their trailers intact; then a server-streaming call streams,
/// and a call whose deadline ends before its turn is refused at once.
fn shaped_calls(sluice: &Sluice, server: &GrpcServer) {
    let target = sluice.addr.to_string();
    let results = client(&target, &["unary", "--count", "20"]);
    assert_eq!(results.len(), 20, "{results:?}");
    let ok: Vec<&Value> = results.iter().filter(|r| r["code"] == "OK").collect();
    let refused: Vec<&Value> = results
        .iter()
        .filter(|r| r["code"] == "RESOURCE_EXHAUSTED")
        .collect();
    assert_eq!(ok.len(), 11, "{results:?}");
    assert_eq!(refused.len(), 9, "{results:?}");
    for r in &ok {
        assert_eq!(r["trailers"]["x-echo-trailer"], "yes", "{r}");
    }
    for r in &refused {
        let pushback: u64 = r["trailers"]["grpc-retry-pushback-ms"]
            .as_str()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no pushback: {r}"));
        assert!((1..=2_000).contains(&pushback), "{r}");
        // `ratelimit_headers`: the budget is in the refusal's metadata;
        // ten waiting of ten, so none remains.
        assert_eq!(
            r["trailers"]["ratelimit-policy"], "\"calls\";q=10;w=2",
            "{r}"
        );
        let left = r["trailers"]["ratelimit"].as_str().unwrap_or("");
        assert!(left.starts_with("\"calls\";r=0;t="), "{r}");
        assert!(
            r["details"].as_str().unwrap_or("").contains("retry in"),
            "{r}"
        );
        assert!(
            r["elapsed_ms"].as_f64().unwrap() < 1_000.0,
            "refused late: {r}"
        );
    }
    let calls = server.calls(11);
    assert_eq!(calls.len(), 11);
    let gaps: Vec<u64> = calls
        .windows(2)
        .map(|w| (w[1].0 - w[0].0) / 1_000_000)
        .collect();
    // DESIGN section 1: a 200 ms grid; a departure the machine delayed
    // (the first also opens the upstream connection: 139 ms was seen on a
    // busy machine) is caught up no faster than twice the rate, so no gap
    // is under 100 ms; the span of the 10 intervals checks the rate. A
    // late first call shortens the span by its lateness: 300 ms of it is
    // allowed, where twice the rate would take 1,000 ms.
    assert!(
        gaps.iter().all(|&g| (100..=420).contains(&g)),
        "gaps at the server (ms): {gaps:?}"
    );
    let span = (calls[10].0 - calls[0].0) / 1_000_000;
    assert!(
        (1_700..=2_350).contains(&span),
        "10 intervals at the server took {span} ms: {gaps:?}"
    );

    // The queue drains (the last admitted departed 2 s after the first);
    // a new client key is not needed: wait for the schedule to pass.
    std::thread::sleep(Duration::from_millis(2_300));
    let stream = client(&target, &["stream", "--n", "3"]);
    let msgs: Vec<f64> = stream
        .iter()
        .filter(|v| v.get("msg").is_some())
        .map(|v| v["elapsed_ms"].as_f64().unwrap())
        .collect();
    assert_eq!(msgs.len(), 3, "{stream:?}");
    assert!(msgs[2] - msgs[0] >= 150.0, "not streamed: {stream:?}");
    assert_eq!(stream.last().unwrap()["code"], "OK", "{stream:?}");

    deadline_refused_at_once(sluice);
}

/// Queue 8 calls behind a ninth (r = 5/s, b = 10: 1.6 s of schedule,
/// room for 2 more); then a call with a 500 ms deadline is refused at once
/// for its deadline instead of expiring (not for want of room). The late
/// client connects before the queue is filled and starts its call on a
/// signal, so neither Python's start-up nor the connection is in the
/// deadline or the timing.
fn deadline_refused_at_once(sluice: &Sluice) {
    use std::io::{BufRead, BufReader, Write};
    let target = sluice.addr.to_string();
    std::thread::sleep(Duration::from_millis(300));
    let mut late = KillOnDrop::new(
        client_cmd(
            &target,
            &["--wait-go", "unary", "--count", "1", "--deadline-ms", "500"],
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let mut late_out = BufReader::new(late.child().stdout.take().unwrap());
    let mut line = String::new();
    late_out.read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "ready", "the late client did not connect");
    let _fill = KillOnDrop::new(
        client_cmd(&target, &["unary", "--count", "9"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    // At least 8 waiting: the next free slot is more than 1.4 s away, well
    // past the late call's 500 ms deadline.
    rt.block_on(sluice.wait_queued_at_least(8));
    let mut go = late.child().stdin.take().unwrap();
    go.write_all(b"go\n").unwrap();
    drop(go);
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut late_out, &mut rest).unwrap();
    let late = parse(&rest);
    assert_eq!(late.len(), 1, "{late:?}");
    assert_eq!(late[0]["code"], "RESOURCE_EXHAUSTED", "{late:?}");
    assert!(
        late[0]["details"]
            .as_str()
            .unwrap_or("")
            .contains("deadline"),
        "{late:?}"
    );
    // Refused at once; the bug (the call left to wait out its deadline)
    // would end it at 500 ms or later.
    assert!(late[0]["elapsed_ms"].as_f64().unwrap() < 400.0, "{late:?}");
    assert!(late[0]["trailers"].get("grpc-retry-pushback-ms").is_some());
}

/// Also: the access log has the calls' lines, over HTTP/2, with the gRPC
/// status of the refused ones (answered 200, as gRPC answers are).
#[test]
fn grpc_over_h2c_is_shaped_and_refused_in_grpc() {
    let server = GrpcServer::start(None);
    let log = support::temp_path("grpc-access.log");
    let toml = config(&format!("http://127.0.0.1:{}", server.port()), "h2c").replace(
        "[server]\n",
        &format!("[server]\naccess_log = \"{}\"\n", log.display()),
    );
    let sluice = Sluice::start(&toml);
    shaped_calls(&sluice, &server);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let lines = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let refused = lines.iter().filter(|l| l["grpc_status"] == 8).count();
        if refused >= 9 {
            break lines;
        }
        assert!(std::time::Instant::now() < deadline, "{text}");
        std::thread::sleep(Duration::from_millis(20));
    };
    let _ = std::fs::remove_file(&log);
    // (499: a call whose client the test ended while it waited.)
    assert!(
        lines.iter().all(|l| l["protocol"] == "HTTP/2"
            && (l["status"] == 200 || l["status"] == 499)
            && l["route"] == "calls"),
        "{lines:?}"
    );
    assert!(
        lines.iter().any(|l| l.get("grpc_status").is_none()),
        "{lines:?}"
    );
}

/// The same with the upstream over TLS (`protocol = "h2"`, ALPN h2, a
/// private CA); the client side stays h2c.
#[test]
fn grpc_to_a_tls_upstream_with_h2() {
    let ca = TestCa::new();
    let leaf = ca.leaf_files(&["localhost"]);
    let server = GrpcServer::start(Some(&leaf));
    let ca_file = ca.write();
    let cfg = config(&format!("https://localhost:{}", server.port()), "h2").replace(
        "url = ",
        &format!("ca_file = \"{}\"\nurl = ", ca_file.display()),
    );
    let sluice = Sluice::start(&cfg);
    shaped_calls(&sluice, &server);
}

/// An upstream with `on_throttle = "pause"` that pushes back in gRPC's own
/// terms (RESOURCE_EXHAUSTED with `grpc-retry-pushback-ms: 1500`, the
/// trailers-only answer grpcio sends): the client gets that answer, and the
/// next call, sent right after, reaches the server only when the pushback
/// has passed, then succeeds. gRPC calls are not staged for such an
/// upstream, so a call that cannot make its deadline is still refused at
/// once (a staged call would wait until its deadline).
#[test]
fn a_grpc_pushback_pauses_the_upstream() {
    let server = GrpcServer::start(None);
    let cfg = config(&format!("http://127.0.0.1:{}", server.port()), "h2c")
        .replace("url = ", "on_throttle = \"pause\"\nurl = ");
    let sluice = Sluice::start(&cfg);
    let target = sluice.addr.to_string();

    let busy = client(&target, &["unary", "--count", "1", "--method", "Busy"]);
    assert_eq!(busy.len(), 1, "{busy:?}");
    assert_eq!(busy[0]["code"], "RESOURCE_EXHAUSTED", "{busy:?}");
    assert_eq!(busy[0]["trailers"]["grpc-retry-pushback-ms"], "1500");

    let next = client(&target, &["unary", "--count", "1"]);
    assert_eq!(next.len(), 1, "{next:?}");
    assert_eq!(next[0]["code"], "OK", "{next:?}");
    let calls = server.calls(2);
    assert_eq!(calls.len(), 2, "{calls:?}");
    let paused_ms = (calls[1].0 - calls[0].0) / 1_000_000;
    assert!(
        (1_300..=3_000).contains(&paused_ms),
        "the next call reached the server {paused_ms} ms after the pushback"
    );

    deadline_refused_at_once(&sluice);
}

/// sluice in front of the recording downstream `ds` over HTTP/1.1 (gRPC
/// calls are told by their content type): one upstream with
/// `upstream_extra`, one route keyed by `X-Client` at `rate`, capacity 5.
fn recording(ds: &support::Downstream, upstream_extra: &str, rate: &str) -> Sluice {
    Sluice::start(&format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[[upstream]]
name = "api"
url = "http://{}"
{upstream_extra}

[[route]]
name = "default"
upstream = "api"
key = "header:X-Client"
rate = "{rate}"
capacity = 5
"#,
        ds.addr
    ))
}

/// A call that waits its turn tells the upstream what is left of its
/// deadline (a server plans by grpc-timeout): the second of two calls,
/// 1 s behind the first, reaches the upstream with about 4 s of its 5 s. (The recording downstream is enough: only the header is looked at.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_that_waited_reaches_the_upstream_with_its_deadline_spent() {
    let ds = support::Downstream::start().await;
    let s = recording(&ds, "", "1/s");
    let c = support::client();
    let headers = [
        ("x-client", "g"),
        ("content-type", "application/grpc"),
        ("grpc-timeout", "5S"),
    ];
    let calls: Vec<_> = (0..2)
        .map(|i| {
            let (c, url) = (c.clone(), s.url(&format!("/svc/M{i}")));
            tokio::spawn(async move { support::get(&c, &url, &headers).await })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().status, http::StatusCode::OK);
    }
    let mut left: Vec<u64> = ds
        .seen()
        .iter()
        .map(|r| {
            let v = r.headers["grpc-timeout"].to_str().unwrap();
            match v.strip_suffix('m') {
                Some(ms) => ms.parse().unwrap(),
                None => v.trim_end_matches('S').parse::<u64>().unwrap() * 1_000,
            }
        })
        .collect();
    left.sort();
    // The one that went at once has (nearly) all of it, the other what
    // it waited less (1 s, less the gap between their arrivals).
    assert_eq!(left.len(), 2);
    assert!(left[1] >= 4_700, "{left:?}");
    assert!((2_000..=4_800).contains(&left[0]), "{left:?}");
}

/// A call that waits for an upstream slot (`max_concurrency`) spends its
/// deadline there too: one whose deadline passes meanwhile ends with
/// DEADLINE_EXCEEDED at its deadline, and one that gets a slot reaches the
/// upstream with what is left (about 5 s of 10 s, behind a 5 s call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waiting_for_an_upstream_slot_spends_its_deadline() {
    let ds = support::Downstream::start().await;
    let s = recording(&ds, "max_concurrency = 1", "1000/s");
    let c = support::client();
    let slow = {
        let (c, url) = (c.clone(), s.url("/slow/a"));
        tokio::spawn(async move { support::get(&c, &url, &[("x-client", "a")]).await })
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while ds.seen().is_empty() {
        assert!(Instant::now() < deadline, "the slow call never arrived");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let call = |path: &'static str, key: &'static str, timeout: &'static str| {
        let (c, url) = (c.clone(), s.url(path));
        tokio::spawn(async move {
            let headers = [
                ("x-client", key),
                ("content-type", "application/grpc"),
                ("grpc-timeout", timeout),
            ];
            let sent = Instant::now();
            (support::get(&c, &url, &headers).await, sent.elapsed())
        })
    };
    let late = call("/delay/late", "l", "1S");
    let kept = call("/delay/kept", "k", "10S");
    let (late, took) = late.await.unwrap();
    assert_eq!(late.headers["grpc-status"], "4", "{:?}", late.headers);
    assert!(took < Duration::from_secs(4), "answered after {took:?}");
    let (kept, _) = kept.await.unwrap();
    assert_eq!(kept.status, http::StatusCode::OK);
    assert_eq!(slow.await.unwrap().status, http::StatusCode::OK);
    let seen = ds.seen();
    assert!(
        seen.iter().all(|r| r.path != "/delay/late"),
        "the late call went"
    );
    let kept = seen.iter().find(|r| r.path == "/delay/kept").expect("sent");
    let v = kept.headers["grpc-timeout"].to_str().unwrap();
    let ms: u64 = v
        .strip_suffix('m')
        .and_then(|m| m.parse().ok())
        .expect("in ms");
    // About 5 s: 10 s less its wait for the 5 s call to end (10 s if the
    // wait were not counted).
    assert!((2_000..=8_000).contains(&ms), "the upstream was told {v}");
}

/// A gRPC call's answer is waited for as long as its deadline says, not
/// `request_timeout` (a server sends a long call's headers with its
/// answer): a 5 s call with a 10 s deadline through an upstream whose
/// request_timeout is 1 s is answered; without a deadline it is a 504
/// (UNAVAILABLE).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calls_deadline_not_request_timeout_bounds_its_wait_for_an_answer() {
    let ds = support::Downstream::start().await;
    let s = recording(&ds, "request_timeout = \"1s\"", "1000/s");
    let c = support::client();
    let grpc = |timeout: Option<&'static str>| {
        let mut h = vec![("x-client", "g"), ("content-type", "application/grpc")];
        if let Some(t) = timeout {
            h.push(("grpc-timeout", t));
        }
        h
    };
    let long = support::get(&c, &s.url("/slow/long"), &grpc(Some("10S"))).await;
    assert_eq!(long.status, http::StatusCode::OK);
    assert!(
        !long.headers.contains_key("grpc-status"),
        "{:?}",
        long.headers
    );
    assert_eq!(&long.body[..], b"ok");
    // Without a deadline the upstream's request_timeout ends it: sluice's
    // timeout, UNAVAILABLE (14), which a retry policy may retry; only the
    // call's own deadline is DEADLINE_EXCEEDED (4).
    let bare = support::get(&c, &s.url("/slow/bare"), &grpc(None)).await;
    assert_eq!(bare.headers["grpc-status"], "14", "{:?}", bare.headers);
}

/// Calls waiting their turn do not stall the other calls on their HTTP/2
/// connection: what a waiting call sends is read, so its bytes do not
/// hold the connection's flow-control window (1 MiB), which every call on
/// the connection shares. Twenty 64 KiB calls wait on one key at 1/min;
/// another key's call on the same connection is answered at once, whole.
/// And what waiting calls sent reaches the upstream intact once they
/// depart (a second route at 4/s, its bodies echoed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_calls_do_not_stall_their_connection() {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};

    let ds = support::Downstream::start().await;
    let s = Sluice::start(&format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[admin]
listen = "127.0.0.1:0"

[[upstream]]
name = "api"
url = "http://{}"

[[route]]
name = "echo"
match = {{ path_prefix = "/echo" }}
upstream = "api"
key = "header:X-Client"
rate = "4/s"
capacity = 10

[[route]]
name = "slow"
upstream = "api"
key = "header:X-Client"
rate = "1/m"
capacity = 30
"#,
        ds.addr
    ));
    let (h2, _driver) = support::h2_connect::<Full<Bytes>>(s.addr).await;
    let call = |path: &str, key: &str, body: Bytes| {
        let req = http::Request::post(format!("http://{}{path}", s.addr))
            .header("x-client", key)
            .header("content-type", "application/grpc")
            .body(Full::new(body))
            .unwrap();
        let mut h2 = h2.clone();
        tokio::spawn(async move {
            let answer = h2.send_request(req).await?;
            let status = answer.status();
            let body = answer.into_body().collect().await?.to_bytes();
            Ok::<_, hyper::Error>((status, body))
        })
    };
    let body = |tag: u8| Bytes::from(vec![tag; 64 * 1024]);
    // The first goes at once; the other nineteen (1.2 MiB) wait.
    let waiting: Vec<_> = (0..20).map(|_| call("/w", "a", body(b'a'))).collect();
    s.wait_queued(19).await;
    let other = tokio::time::timeout(Duration::from_secs(10), call("/b", "b", body(b'b'))).await;
    let (status, _) = other
        .expect("another key's call was not stalled behind the waiting ones")
        .unwrap()
        .unwrap();
    assert_eq!(status, http::StatusCode::OK);
    let seen = ds.seen();
    let b = seen.iter().find(|r| r.path == "/b").expect("forwarded");
    assert_eq!(b.body_len, 64 * 1024);
    drop(waiting);

    // What waiting calls hold is counted as what they sent: twenty more
    // of 200 bytes (unary calls are small) add about 4 kB to the staging
    // budget, not room for a frame each (16 kB).
    let staged = || async { s.status().await["staged_bytes"].as_u64().unwrap_or(0) };
    let before = staged().await;
    let small: Vec<_> = (0..21)
        .map(|_| call("/c", "c", Bytes::from(vec![b'c'; 200])))
        .collect();
    s.wait_queued(39).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut after = staged().await;
    while after < before + 20 * 200 {
        assert!(Instant::now() < deadline, "read ahead: {before} -> {after}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        after = staged().await;
    }
    assert!(after - before < 20 * 1024, "{before} -> {after}");
    drop(small);

    // Four at once at 4/s: three wait (their bodies read meanwhile), and
    // each reaches the upstream whole.
    let echoes: Vec<_> = (0..4u8)
        .map(|i| call("/echo", "e", body(b'0' + i)))
        .collect();
    for (i, echo) in echoes.into_iter().enumerate() {
        let (status, echoed) = tokio::time::timeout(Duration::from_secs(10), echo)
            .await
            .expect("answered")
            .unwrap()
            .unwrap();
        assert_eq!(status, http::StatusCode::OK);
        assert_eq!(echoed, body(b'0' + i as u8), "call {i}'s body");
    }
}
