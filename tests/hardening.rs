//! Hardening (issue 12), each point reproduced on loopback against the
//! real binary: route bypass with unnormalized paths, configs at every
//! numeric bound, reloads that fail, client errors counted as the
//! client's. (Idle and silent connections: tests/idle_connections.rs.)

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use support::*;

fn base(ds: std::net::SocketAddr, server: &str, routes: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
{server}

[admin]
listen = "127.0.0.1:0"

[[upstream]]
name = "api"
url = "http://{ds}"
{routes}
"#
    )
}

/// The route `default` to `api` with this key, rate and capacity.
fn default_route(key: &str, rate: &str, capacity: u32) -> String {
    format!(
        "\n[[route]]\nname = \"default\"\nupstream = \"api\"\nkey = \"{key}\"\nrate = \"{rate}\"\ncapacity = {capacity}\n"
    )
}

const ONE_ROUTE: &str = r#"
[[route]]
name = "default"
upstream = "api"
key = "ip"
rate = "1000/s"
capacity = 10
"#;

/// Route limits cannot be bypassed with paths the upstream normalizes
/// back (or routes without their `;` parameters, as servlet containers
/// do): they match the /admin route (capacity 0: refused); paths that
/// cannot be normalized safely get 400; the upstream gets the normal path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unnormalized_paths_cannot_bypass_a_route() {
    let ds = Downstream::start().await;
    let routes = r#"
[[route]]
name = "admin"
match = { path_prefix = "/admin" }
upstream = "api"
key = "ip"
rate = "1/h"
capacity = 0

[[route]]
name = "default"
upstream = "api"
key = "ip"
rate = "1000/s"
capacity = 10
"#;
    let s = Sluice::start(&base(ds.addr, "", routes));
    let c = client();
    // The admin route admits one (idle) request, then refuses.
    assert_eq!(
        get(&c, &s.url("/admin/y"), &[]).await.status,
        StatusCode::OK
    );
    for p in [
        "/x/../admin/y",
        "/x/%2e%2e/admin/y",
        "/%61dmin/y",
        "//admin/y",
        "/./admin/y",
        // Parameters, which servlet containers drop before they route.
        "/admin;x/y",
        "/;x/admin/y",
    ] {
        let a = get(&c, &s.url(p), &[]).await;
        assert_eq!(a.status, StatusCode::TOO_MANY_REQUESTS, "{p}: {:?}", a.body);
    }
    for p in [
        "/x/%2Fadmin",
        "/a%5Cb",
        "/../admin/y",
        "/a%zz",
        "/x/..;/admin/y",
        "/x/%2e%2e;v=1/admin/y",
        "/x/.;/admin/y",
    ] {
        let a = get(&c, &s.url(p), &[]).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{p}");
    }
    let a = get(&c, &s.url("/docs//./a/%7Euser?q=%2e%2e"), &[]).await;
    assert_eq!(a.status, StatusCode::OK);
    let paths: Vec<String> = ds.seen().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, vec!["/admin/y", "/docs/a/~user"]);
}

/// Every numeric field at its documented maximum: `sluice check` says ok,
/// and `run` starts, forwards, reloads and drains without a panic. (A
/// cost's maximum is 10,000 here: in cluster mode under an upstream cap.
/// The engine's own maximum, 1,000,000, is covered by the config tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_config_with_every_number_at_its_maximum_runs() {
    let ds = Downstream::start().await;
    let dead = closed_port();
    let config = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
header_read_timeout = "1day"
body_read_timeout = "1day"
send_timeout = "1day"
keepalive_timeout = "1day"
max_header_size = 1048576
max_connections = 1000000
workers = 64
drain_timeout = "1day"

[admin]
listen = "127.0.0.1:0"

[cluster]
redis = "redis://127.0.0.1:{dead}"
timeout = "1day"
on_failure = "local"
instances = 10000

[[upstream]]
name = "api"
url = "http://{ds}"
rate = "1000000000/s"
connect_timeout = "1day"
request_timeout = "1day"
read_timeout = "1day"
max_concurrency = 1000000
on_throttle = "pause"
max_pause = "1day"

[[route]]
name = "default"
upstream = "api"
key = "ip"
rate = "1000000000/s"
capacity = 1000000000
cost = {{ header = "x-cost", default = 10000, max = 10000 }}
burst = 1000000
max_wait = "30days"
ratelimit_headers = true

[limits]
max_clients = 100000000
max_queued = 10000000
max_staged_body = "1TiB"
max_staged_bytes = "1TiB"
"#,
        ds = ds.addr
    );
    let path = write_config(&config);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut s = Sluice::start(&config);
    let c = client();
    let a = get(&c, &s.url("/max"), &[("x-cost", "10000")]).await;
    assert_eq!(a.status, StatusCode::OK);
    s.signal("HUP");
    // The reload is applied when /status says version 2 (polled: a fixed
    // delay could end first on a busy machine).
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.status().await["config"]["version"] != 2 {
        assert!(Instant::now() < deadline, "the reload was not applied");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(get(&c, &s.url("/again"), &[]).await.status, StatusCode::OK);
    s.signal("TERM");
    let status = s.wait_exit(Duration::from_secs(20)).expect("exits");
    assert!(status.success(), "{status:?}");
    assert!(
        !s.log().iter().any(|l| l.contains("panicked")),
        "{:?}",
        s.log()
    );
}

/// `sluice_config_reloads_total{result="error"}`, 0 while absent.
async fn failed_reloads(s: &Sluice) -> u64 {
    let text = String::from_utf8_lossy(&get(&client(), &s.admin_url("/metrics"), &[]).await.body)
        .into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("sluice_config_reloads_total{result=\"error\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// A reload that fails (here: a file that no longer parses, then one with
/// a value out of range) is logged and counted; the running config stays,
/// and the next good reload still works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_reload_never_disables_reloading() {
    let ds = Downstream::start().await;
    let good = base(ds.addr, "", ONE_ROUTE);
    let s = Sluice::start(&good);
    // Each failed reload is waited for (its count in /metrics) before the
    // next signal: signals sent closer together could be taken as one.
    for (failed, bad) in [
        good.replace("[[route]]", "[[route"),
        good.replace("capacity = 10", "capacity = 10\nburst = 99999999999"),
    ]
    .into_iter()
    .enumerate()
    {
        std::fs::write(&s.config, bad).unwrap();
        s.signal("HUP");
        let deadline = Instant::now() + Duration::from_secs(10);
        while failed_reloads(&s).await < failed as u64 + 1 {
            assert!(
                Instant::now() < deadline,
                "reload {} not counted",
                failed + 1
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(s.status().await["config"]["version"], 1);
    }
    std::fs::write(&s.config, good.replace("capacity = 10", "capacity = 11")).unwrap();
    s.signal("HUP");
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.status().await["config"]["version"] != 2 {
        assert!(Instant::now() < deadline, "the good reload was not applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(s.status().await["routes"][0]["capacity"], 11);
    let text = String::from_utf8_lossy(&get(&client(), &s.admin_url("/metrics"), &[]).await.body)
        .into_owned();
    assert!(
        text.contains("sluice_config_reloads_total{result=\"error\"} 2"),
        "{text}"
    );
    assert!(
        text.contains("sluice_config_reloads_total{result=\"ok\"} 1"),
        "{text}"
    );
}

/// An invalid chunked body is the client's error: 400 and `invalid`,
/// never 502 and `upstream_error` (which would trip upstream alerts).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_chunked_body_is_the_clients_error() {
    use std::io::{Read, Write};
    let ds = Downstream::start().await;
    let s = Sluice::start(&base(ds.addr, "", ONE_ROUTE));
    let mut sock = std::net::TcpStream::connect(s.addr).unwrap();
    sock.write_all(
        b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nnot a chunk\r\n\r\n",
    )
    .unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = vec![0u8; 1024];
    let n = sock.read(&mut buf).unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 400"), "{head}");
    let totals = s.status().await["totals"].clone();
    assert_eq!(totals["upstream_error"], 0, "{totals}");
    assert_eq!(totals["invalid"], 1, "{totals}");
}

/// The bucket query refuses keys the proxy itself refuses (an empty or
/// over-long header value) instead of answering "admitted now", and shows
/// a key that is not text, percent-encoded, exactly as /status lists it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_query_knows_which_keys_exist() {
    let ds = Downstream::start().await;
    let routes = default_route("header:X-Client", "1/h", 5);
    let toml = base(ds.addr, "", &routes).replace("[admin]\n", "[admin]\nshow_keys = true\n");
    let s = Sluice::start(&toml);
    let c = client();
    let long = "a".repeat(257);
    for key in ["", long.as_str()] {
        let a = get(&c, &s.admin_url(&format!("/buckets/default/{key}")), &[]).await;
        assert_eq!(a.status, StatusCode::NOT_FOUND, "key {key:?}");
    }
    // A key of raw bytes: the first request departs, the second waits.
    let raw = http::HeaderValue::from_bytes(b"\xff\xfe").unwrap();
    let send_raw = |c: support::HttpClient, url: String| {
        let raw = raw.clone();
        async move {
            let req = http::Request::get(url)
                .header("x-client", raw)
                .body(http_body_util::Full::new(Bytes::new()))
                .unwrap();
            c.request(req).await.map(|r| r.status())
        }
    };
    assert_eq!(
        send_raw(c.clone(), s.url("/a")).await.unwrap(),
        StatusCode::OK
    );
    let waiting = tokio::spawn(send_raw(c.clone(), s.url("/b")));
    s.wait_queued(1).await;
    let status = s.status().await;
    assert_eq!(status["deepest_queues"][0]["key"], "%FF%FE", "{status}");
    let b = get(&c, &s.admin_url("/buckets/default/%25FF%25FE"), &[]).await;
    assert_eq!(b.status, StatusCode::OK);
    let doc: serde_json::Value = serde_json::from_slice(&b.body).unwrap();
    assert_eq!(doc["waiting"], 1, "{doc}");
    waiting.abort();
}

/// `/status` (open to whoever reaches the admin listener) does not show
/// keys that may be secrets unless `admin.show_keys`: a header key is
/// listed as a fingerprint, which the bucket query for the key names too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_masks_keys_unless_told() {
    let ds = Downstream::start().await;
    let routes = default_route("header:Authorization", "1/h", 5);
    let s = Sluice::start(&base(ds.addr, "", &routes));
    let c = client();
    let token = [("authorization", "Bearer sk_live_0123456789")];
    assert_eq!(get(&c, &s.url("/a"), &token).await.status, StatusCode::OK);
    let waiting = tokio::spawn({
        let (c, url) = (c.clone(), s.url("/b"));
        async move { get(&c, &url, &token).await }
    });
    s.wait_queued(1).await;
    let status = s.status().await;
    let shown = status["deepest_queues"][0]["key"]
        .as_str()
        .expect("a key")
        .to_owned();
    assert!(!status.to_string().contains("sk_live"), "{status}");
    assert!(shown.starts_with('#') && shown.len() == 13, "{shown}");
    let b = get(
        &c,
        &s.admin_url("/buckets/default/Bearer%20sk_live_0123456789"),
        &[],
    )
    .await;
    let doc: serde_json::Value = serde_json::from_slice(&b.body).unwrap();
    assert_eq!(doc["fingerprint"], shown.as_str(), "{doc}");
    assert_eq!(doc["waiting"], 1, "{doc}");
    waiting.abort();
}

/// The status code of the answer to `request`, sent as it is on a
/// connection of its own, read to the connection's end.
fn raw_status(addr: std::net::SocketAddr, request: &str) -> String {
    use std::io::{Read, Write};
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    sock.write_all(request.as_bytes()).unwrap();
    let mut got = Vec::new();
    let _ = sock.read_to_end(&mut got);
    String::from_utf8_lossy(&got)
        .get(9..12)
        .unwrap_or("")
        .to_owned()
}

/// A key header (or cost header) the client names in `Connection` is a
/// header for this hop, which the upstream never gets: the request is
/// filed as one without it (here `on_missing_key = "ip"`: by its
/// address). Keyed by it, every request with a fresh value got a fresh
/// bucket, past the route's limit, and the upstream saw no key at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_header_named_in_connection_is_no_key() {
    let ds = Downstream::start().await;
    let routes = default_route("header:X-Api-Key", "1/m", 0) + "on_missing_key = \"ip\"\n";
    let s = Sluice::start(&base(ds.addr, "", &routes));
    let status = |request: String| raw_status(s.addr, &request);
    let statuses: Vec<String> = (0..3)
        .map(|i| {
            status(format!(
                "GET /k/{i} HTTP/1.1\r\nHost: t\r\nX-Api-Key: fresh-{i}\r\nConnection: close, x-api-key\r\n\r\n"
            ))
        })
        .collect();
    // One departure for the address; the others find its slot taken.
    assert_eq!(statuses, ["200", "429", "429"]);
    // Keyed by its header when it is not named.
    let named = status(
        "GET /k/named HTTP/1.1\r\nHost: t\r\nX-Api-Key: real\r\nConnection: close\r\n\r\n"
            .to_owned(),
    );
    assert_eq!(named, "200");
    assert_eq!(ds.seen().len(), 2);
}

/// The admin listener on loopback answers only requests that name a
/// loopback host: a web page whose name an attacker's DNS turns to
/// 127.0.0.1 (DNS rebinding) names itself, and must not read `/status`
/// or probe keys through `/buckets` from the user's browser.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_answers_loopback_names_only() {
    let ds = Downstream::start().await;
    let s = Sluice::start(&base(ds.addr, "", ONE_ROUTE));
    let c = client();
    let port = s.admin.unwrap().port();
    for host in ["evil.example", "evil.example:80", "127.0.0.1.evil.example"] {
        for path in ["/status", "/buckets/default/k", "/metrics"] {
            let a = get(&c, &s.admin_url(path), &[("host", host)]).await;
            assert_eq!(a.status, StatusCode::MISDIRECTED_REQUEST, "{host} {path}");
        }
        // Health probes tell nothing, and answer any name.
        let a = get(&c, &s.admin_url("/healthz"), &[("host", host)]).await;
        assert_eq!(a.status, StatusCode::OK, "{host}");
    }
    for host in [
        format!("127.0.0.1:{port}"),
        format!("localhost:{port}"),
        "LOCALHOST.".to_owned(),
        "[::1]".to_owned(),
        "127.0.0.2".to_owned(),
    ] {
        let a = get(&c, &s.admin_url("/status"), &[("host", &host)]).await;
        assert_eq!(a.status, StatusCode::OK, "{host}");
    }
}

/// Requests sent together on one HTTP/2 connection (streams written in one
/// go) are admitted in stream order: the downstream sees them in order.
/// One call in flight at a time (`max_concurrency = 1`, its waits first
/// come, first served): released in order, they are forwarded in order
/// even when one needs a new upstream connection and the next finds one
/// pooled (on a busy machine, 20 ms apart, one overtook the other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_streams_sent_together_are_admitted_in_stream_order() {
    let ds = Downstream::start().await;
    let routes = r#"max_concurrency = 1

[[route]]
name = "default"
upstream = "api"
key = "global"
rate = "50/s"
capacity = 20
"#;
    let s = Sluice::start(&base(ds.addr, "", routes));
    let (mut h2, _driver) = h2_connect(s.addr).await;
    // Queue every stream before any is written: one write carries them.
    let pending: Vec<_> = (0..10)
        .map(|i| {
            let req = http::Request::get(format!("http://{}/s/{i}", s.addr))
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            h2.send_request(req)
        })
        .collect();
    for p in pending {
        assert_eq!(p.await.unwrap().status(), StatusCode::OK);
    }
    let paths: Vec<String> = ds.seen().into_iter().map(|r| r.path).collect();
    let want: Vec<String> = (0..10).map(|i| format!("/s/{i}")).collect();
    assert_eq!(paths, want);
}

/// A request released while the upstream's `max_concurrency` slots are
/// all taken waits for one: the wait counts against `max_queued`, and when
/// the drain gives up it is answered 503 rather than waiting on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_max_concurrency_wait_is_counted_and_ends_with_the_drain() {
    let ds = Downstream::start().await;
    let routes = r#"
[[route]]
name = "default"
upstream = "api"
key = "header:X-Client"
rate = "1000/s"
capacity = 10
"#;
    let config = base(ds.addr, "drain_timeout = \"1s\"", routes)
        .replace("url = ", "max_concurrency = 1\nurl = ");
    let mut s = Sluice::start(&config);
    let (slow, second) = one_in_flight_one_waiting(&s, &ds).await;
    let term = Instant::now();
    s.signal("TERM");
    let second = second.await.unwrap();
    assert_eq!(second.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_between(
        second.at - term,
        800,
        4_000,
        "answered at the drain timeout",
    );
    assert_eq!(
        slow.await.unwrap(),
        StatusCode::OK,
        "the call in flight finishes"
    );
    assert!(
        s.wait_exit(Duration::from_secs(15))
            .is_some_and(|st| st.success())
    );
    assert_eq!(
        ds.seen().len(),
        1,
        "the waiting one never reached the upstream"
    );
}

/// A request released while the upstream's slots are all taken, and
/// `max_queued` is used up by another waiting for one, gets 503 at once
/// and counts as `overloaded` (it was counted `expired`, which says the
/// drain gave up on it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_room_to_wait_for_an_upstream_slot_counts_as_overloaded() {
    let ds = Downstream::start().await;
    let routes = format!(
        "{}\n[limits]\nmax_queued = 1\n",
        default_route("header:X-Client", "1000/s", 10)
    );
    let config = base(ds.addr, "", &routes).replace("url = ", "max_concurrency = 1\nurl = ");
    let s = Sluice::start(&config);
    let c = client();
    let (slow, waiting) = one_in_flight_one_waiting(&s, &ds).await;
    let third = get(&c, &s.url("/third"), &[("x-client", "c")]).await;
    assert_eq!(third.status, StatusCode::SERVICE_UNAVAILABLE);
    let text =
        String::from_utf8_lossy(&get(&c, &s.admin_url("/metrics"), &[]).await.body).into_owned();
    let count = |outcome: &str| {
        let series = format!(
            "sluice_requests_total{{route=\"default\",protocol=\"http\",outcome=\"{outcome}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .map(str::to_owned)
    };
    assert_eq!(count("overloaded").as_deref(), Some("1"), "{text}");
    assert_eq!(count("expired").as_deref(), Some("0"), "{text}");
    assert_eq!(slow.await.unwrap(), StatusCode::OK);
    assert_eq!(waiting.await.unwrap().status, StatusCode::OK);
}

/// Behind an upstream with `max_concurrency = 1` (route key X-Client): a
/// call to `/slow` (5 s) in flight, then one to `/second` released and
/// waiting for the slot (counted in `/status` as queued). Their answers.
async fn one_in_flight_one_waiting(
    s: &Sluice,
    ds: &Downstream,
) -> (
    tokio::task::JoinHandle<StatusCode>,
    tokio::task::JoinHandle<support::Answer>,
) {
    let c = client();
    let slow = {
        let (c, url) = (c.clone(), s.url("/slow"));
        tokio::spawn(async move { get(&c, &url, &[("x-client", "a")]).await.status })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while ds.seen().is_empty() {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let second = {
        let (c, url) = (c.clone(), s.url("/second"));
        tokio::spawn(async move { get(&c, &url, &[("x-client", "b")]).await })
    };
    s.wait_queued(1).await;
    (slow, second)
}

/// A sluice pacing its client at 1/s with `body_read_timeout = "1s"`, the
/// client's slot taken by a first request (`/first`): a request sent now
/// on the socket returned waits about 1 s, staging its body meanwhile.
async fn queued_behind_a_first_request(ds: &Downstream) -> (Sluice, std::net::TcpStream) {
    let routes = default_route("ip", "1/s", 5);
    let s = Sluice::start(&base(ds.addr, "body_read_timeout = \"1s\"", &routes));
    assert_eq!(
        get(&client(), &s.url("/first"), &[]).await.status,
        StatusCode::OK
    );
    let sock = std::net::TcpStream::connect(s.addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    (s, sock)
}

/// The request sent on `sock` at `t` is answered 408 within `within`.
fn answered_408(sock: &mut std::net::TcpStream, t: Instant, within: Duration) {
    use std::io::Read;
    let mut buf = vec![0u8; 1024];
    let n = sock.read(&mut buf).unwrap_or(0);
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(
        head.starts_with("HTTP/1.1 408"),
        "{head:?} after {:?}",
        t.elapsed()
    );
    assert!(t.elapsed() < within, "{:?}", t.elapsed());
}

/// Its room in the staging budget given back, and nothing left at the
/// upstream: a request that departed meanwhile went with what had come of
/// its body, the rest streamed, and its upstream call was cut with it
/// (not left waiting for the rest).
async fn nothing_staged_nor_left_upstream(s: &Sluice, ds: &Downstream) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.status().await["staged_bytes"] != 0 || ds.in_flight() > 0 {
        assert!(
            Instant::now() < deadline,
            "room kept or a call left open upstream: {} in flight",
            ds.in_flight()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen = ds.seen();
    assert_eq!(seen[0].path, "/first");
    for cut in &seen[1..] {
        assert_eq!(cut.body_len, 0, "{} reached the upstream whole", cut.path);
    }
}

/// A declared length is not taken from the staging budget before its
/// bytes come: two queued uploads declaring 30 kB and sending 10 bytes
/// hold a few bytes, not 60 kB of a 64 KiB budget, and a third with a
/// 20 kB body sent whole is staged beside them (it was refused 503).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_length_is_taken_as_its_bytes_come() {
    use std::io::Write;
    let ds = Downstream::start().await;
    let routes = default_route("ip", "1/m", 5);
    let s = Sluice::start(
        &base(ds.addr, "body_read_timeout = \"30s\"", &routes).replace(
            "[[upstream]]",
            "[limits]\nmax_staged_body = \"32KiB\"\nmax_staged_bytes = \"64KiB\"\n\n[[upstream]]",
        ),
    );
    assert_eq!(
        get(&client(), &s.url("/first"), &[]).await.status,
        StatusCode::OK
    );
    let mut held = Vec::new();
    for i in 0..2 {
        let mut sock = std::net::TcpStream::connect(s.addr).unwrap();
        write!(
            sock,
            "POST /drip{i} HTTP/1.1\r\nHost: t\r\nContent-Length: 30000\r\n\r\n0123456789"
        )
        .unwrap();
        s.wait_queued(i + 1).await;
        held.push(sock);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.status().await["staged_bytes"].as_u64().unwrap_or(0) < 20 {
        assert!(Instant::now() < deadline, "the drips were not staged");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(s.status().await["staged_bytes"].as_u64().unwrap_or(0) < 1_000);
    let mut third = std::net::TcpStream::connect(s.addr).unwrap();
    write!(
        third,
        "POST /whole HTTP/1.1\r\nHost: t\r\nContent-Length: 20000\r\n\r\n"
    )
    .unwrap();
    third.write_all(&[b'w'; 20_000]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let status = s.status().await;
        if status["staged_bytes"].as_u64().unwrap_or(0) >= 20_000 && status["queued"] == 3 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the whole body was not staged: {status}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A queued request whose body stops arriving is answered 408 after
/// `server.body_read_timeout` with no new part, and gives its room in the
/// staging budget back (nginx's `client_body_timeout`): a client cannot
/// keep a declared length reserved by sending nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_body_that_stops_arriving_gets_408() {
    use std::io::Write;
    let ds = Downstream::start().await;
    let (s, mut sock) = queued_behind_a_first_request(&ds).await;
    let t = Instant::now();
    sock.write_all(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        .unwrap();
    answered_408(&mut sock, t, Duration::from_secs(10));
    nothing_staged_nor_left_upstream(&s, &ds).await;
}

/// A queued request whose body drips (a byte every 100 ms, each within
/// `body_read_timeout` of the one before) is cut off with 408 once its
/// first `body_read_timeout` is spent and it has not kept up 500 bytes/s
/// (Apache's `mod_reqtimeout` MinRate, from its departure on as the
/// rest of its body streams): it departs meanwhile, and nothing else
/// would bound it (before, 1,000 bytes took 100 s and kept their room
/// in the staging budget all along).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staged_body_that_drips_is_cut_off_after_its_first_timeout() {
    use std::io::Write;
    let ds = Downstream::start().await;
    let (s, mut sock) = queued_behind_a_first_request(&ds).await;
    let t = Instant::now();
    sock.write_all(b"POST /drip HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n")
        .unwrap();
    let mut writer = sock.try_clone().unwrap();
    let drip = std::thread::spawn(move || {
        for _ in 0..1000 {
            std::thread::sleep(Duration::from_millis(100));
            if writer.write_all(b"x").is_err() {
                return;
            }
        }
    });
    // About 1 s; the old rule would have taken 100 s.
    answered_408(&mut sock, t, Duration::from_secs(5));
    drop(sock);
    drip.join().unwrap();
    nothing_staged_nor_left_upstream(&s, &ds).await;
}

/// A body sent in 1-byte chunks costs what its bytes cost: the staged
/// copy is one buffer, counted whole in the budget. (Kept as the chunks
/// came, each byte held a 32-byte entry and its share of a read buffer:
/// 74 MiB resident for these four 300 kB bodies, against 1.8 MiB now.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_in_one_byte_chunks_is_staged_at_its_size() {
    use std::io::Write;
    const CHUNKS: usize = 300_000;
    const CLIENTS: usize = 4;
    let ds = Downstream::start().await;
    let routes = default_route("ip", "1/h", 10);
    let s = Sluice::start(&base(ds.addr, "", &routes));
    let c = client();
    // Takes the client's slot: the others wait (an hour), staging bodies.
    assert_eq!(get(&c, &s.url("/first"), &[]).await.status, StatusCode::OK);
    let before = rss_kib(s.pid());
    let mut body = Vec::with_capacity(CHUNKS * 6);
    for _ in 0..CHUNKS {
        body.extend_from_slice(b"1\r\nA\r\n");
    }
    let socks: Vec<std::net::TcpStream> = (0..CLIENTS)
        .map(|_| {
            let mut sock = std::net::TcpStream::connect(s.addr).unwrap();
            sock.write_all(
                b"POST /chunks HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n",
            )
            .unwrap();
            sock.write_all(&body).unwrap();
            sock
        })
        .collect();
    // Every byte staged (the last chunk never comes: they stay held).
    let want = (CLIENTS * CHUNKS) as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let staged = s.status().await["staged_bytes"].as_u64().unwrap_or(0);
        if staged >= want {
            break;
        }
        assert!(Instant::now() < deadline, "{staged} of {want} bytes staged");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let grown = rss_kib(s.pid()).saturating_sub(before);
    println!("{CLIENTS} bodies of {CHUNKS} 1-byte chunks: resident memory +{grown} KiB");
    assert!(
        grown < 16 * 1024,
        "{CLIENTS} bodies of {CHUNKS} bytes took {grown} KiB"
    );
    drop(socks);
}

/// `strip_prefix` removes whole segments only: a path whose prefix ends
/// inside a segment (`/api../admin`, which is not itself a dot segment)
/// is refused, where stripping `/api` would have sent the upstream
/// `/base/../admin`, outside its base path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strip_prefix_never_leaves_part_of_a_segment() {
    let ds = Downstream::start().await;
    let config = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[[upstream]]
name = "api"
url = "http://{}/base"

[[route]]
name = "api"
match = {{ path_prefix = "/api" }}
strip_prefix = "/api"
upstream = "api"
key = "ip"
rate = "1000/s"
capacity = 10
"#,
        ds.addr
    );
    let s = Sluice::start(&config);
    let c = client();
    for bad in ["/api../admin", "/api%2e%2e/admin", "/api-docs"] {
        let a = get(&c, &s.url(bad), &[]).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{bad}");
    }
    for good in ["/api", "/api/", "/api/v1/x"] {
        let a = get(&c, &s.url(good), &[]).await;
        assert_eq!(a.status, StatusCode::OK, "{good}");
    }
    let paths: Vec<String> = ds.seen().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/base/", "/base/", "/base/v1/x"]);
}

/// A host route cannot be skipped by the root's trailing dot
/// (`api.example.` is `api.example`) or raw UTF-8 in the name (sound, as
/// nginx takes it, and under a wildcard like any other name), and userinfo
/// in the target or in Host is a 400 (RFC 9110 4.2.4), never a host to
/// route by; so is a host that is not a name or address with a port (RFC
/// 9112 3.2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_route_cannot_be_skipped_by_a_trailing_dot_userinfo_or_a_bad_port() {
    let ds = Downstream::start().await;
    let routes = r#"
[[route]]
name = "strict"
match = { host = "api.example" }
upstream = "api"
key = "global"
rate = "1/h"
capacity = 0

[[route]]
name = "shops"
match = { host = "*.shop.example" }
upstream = "api"
key = "global"
rate = "1/h"
capacity = 0

[[route]]
name = "other"
upstream = "api"
key = "ip"
rate = "1000/s"
capacity = 10
"#;
    let s = Sluice::start(&base(ds.addr, "", routes));
    let status = |request: &str| raw_status(s.addr, request);
    // The strict route's one departure, then refusals (capacity 0).
    let first = status("GET /a HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n");
    assert_eq!(first, "200");
    let dotted = status("GET /b HTTP/1.1\r\nHost: API.example.\r\nConnection: close\r\n\r\n");
    assert_eq!(dotted, "429", "the trailing dot took another route");
    let target = status(
        "GET http://x@api.example/c HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(target, "400");
    let host = status("GET /d HTTP/1.1\r\nHost: x@api.example\r\nConnection: close\r\n\r\n");
    assert_eq!(host, "400");
    // A port that is not one (routing would take the whole as a name, an
    // upstream cutting at the colon api.example), and names no host has.
    for bad in [
        "api.example:x",
        "api.example:80:80",
        "api.example:123456",
        "evil.example/.api.example",
        "api..example",
        "[::1",
        "[::1]x",
    ] {
        let got = status(&format!(
            "GET /e HTTP/1.1\r\nHost: {bad}\r\nConnection: close\r\n\r\n"
        ));
        assert_eq!(got, "400", "Host: {bad}");
    }
    let target = status(
        "GET http://api.example:x/f HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(target, "400", "an absolute target with a bad port");
    // A port is not another host: still the strict route.
    let port = status("GET /g HTTP/1.1\r\nHost: api.example:8080\r\nConnection: close\r\n\r\n");
    assert_eq!(port, "429");
    let shop = status("GET /h HTTP/1.1\r\nHost: b.shop.example\r\nConnection: close\r\n\r\n");
    assert_eq!(shop, "200");
    let raw = status("GET /i HTTP/1.1\r\nHost: bücher.shop.example\r\nConnection: close\r\n\r\n");
    assert_eq!(raw, "429", "a raw UTF-8 name took another route");
    let paths: Vec<String> = ds.seen().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/a", "/h"]);
}

/// The admin listener holds at most 64 connections (its descriptors are
/// the proxy's): past them a new one closes the oldest, at once when it
/// is idle or a head comes slowly, so that connections held open by
/// anyone who reaches the port never lock out a health check; the 64
/// are never more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_bounds_its_connections() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let ds = Downstream::start().await;
    let s = Sluice::start(&base(ds.addr, "", ONE_ROUTE));
    let admin = s.admin.expect("admin");
    // 64 held: half silent, half in the middle of a head.
    let mut held = Vec::new();
    for i in 0..64 {
        let mut c = tokio::net::TcpStream::connect(admin).await.unwrap();
        if i % 2 == 1 {
            c.write_all(b"GET /healthz HTTP/1.1\r\nHo").await.unwrap();
        }
        held.push(c);
    }
    // Each probe on a new connection is answered, in the time the
    // oldest takes to close.
    for i in 0..4 {
        let started = std::time::Instant::now();
        let mut c = tokio::net::TcpStream::connect(admin).await.unwrap();
        c.write_all(b"GET /readyz HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut answer)).await;
        assert!(
            matches!(read, Ok(Ok(_))) && answer.starts_with(b"HTTP/1.1 200"),
            "probe {i}: {read:?} {:?}",
            String::from_utf8_lossy(&answer)
        );
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "probe {i}: {:?}",
            started.elapsed()
        );
    }
    // The oldest was closed for the first (the others took the place
    // each probe before them left): a read sees the end.
    let mut buf = [0u8; 16];
    let read = tokio::time::timeout(Duration::from_secs(5), held[0].read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "the oldest connection is still open: {read:?}"
    );
    // A probe while a connection in the middle of its head is the oldest
    // (64 open again).
    held.push(tokio::net::TcpStream::connect(admin).await.unwrap());
    let mut c = tokio::net::TcpStream::connect(admin).await.unwrap();
    let started = std::time::Instant::now();
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut first = [0u8; 12];
    let read = tokio::time::timeout(Duration::from_secs(5), c.read_exact(&mut first)).await;
    assert!(
        matches!(read, Ok(Ok(_))) && &first == b"HTTP/1.1 200",
        "{read:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    let read = tokio::time::timeout(Duration::from_secs(5), held[1].read(&mut buf)).await;
    assert!(
        matches!(read, Ok(Ok(0)) | Ok(Err(_))),
        "the connection in the middle of its head is still open: {read:?}"
    );
}

/// HTTP/2 lets a client repeat an agreeing `Content-Length` (two `0`s on
/// a GET); the upstream, over HTTP/1.1, gets one (a strict server, Node's
/// llhttp, refuses two with 400). Read off the upstream's socket: hyper's
/// server would show one either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_length_from_an_http2_client_reaches_the_upstream_once() {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = listener.local_addr().unwrap();
    let raw = std::thread::spawn(move || {
        let (mut conn, _) = listener.accept().unwrap();
        conn.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 4096];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).unwrap();
            assert!(n > 0, "closed before a head");
            head.extend_from_slice(&buf[..n]);
        }
        conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            .unwrap();
        String::from_utf8_lossy(&head).to_ascii_lowercase()
    });
    let s = Sluice::start(&base(upstream, "", &default_route("global", "100/s", 10)));
    let (mut h2, _driver) = h2_connect(s.addr).await;
    let req = http::Request::get(format!("http://{}/twice", s.addr))
        .header("content-length", "0")
        .header("content-length", "0")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    assert_eq!(h2.send_request(req).await.unwrap().status(), StatusCode::OK);
    let head = tokio::task::spawn_blocking(move || raw.join().unwrap())
        .await
        .unwrap();
    assert_eq!(head.matches("content-length").count(), 1, "{head}");
}

/// HTTP/2 "rapid reset" (CVE-2023-44487) past h2's own bound: a client
/// that resets its streams right after making them (each an admission and
/// a withdrawal here) has its connection closed (GOAWAY) once 250 of
/// them, and half its requests or more, were such resets (Envoy's rule).
/// Here rounds of 20 queued requests, each round reset together once
/// queued (well within 1 s of each request: a round takes milliseconds),
/// until the connection closes: after 250 resets, 260 with rounds of 20,
/// up to 320 if some came late on a loaded machine. Without the bound the
/// connection stays open for as many as the client cares to send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_resets_its_streams_as_it_makes_them_is_sent_away() {
    let ds = Downstream::start().await;
    let s = Sluice::start(&base(
        ds.addr,
        "",
        &default_route("header:X-Client", "1/h", 1000),
    ));
    let (mut h2, driver) = h2_connect(s.addr).await;
    let req = |i: usize| {
        http::Request::builder()
            .uri(format!("http://{}/r/{i}", s.addr))
            .header("x-client", "k")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap()
    };
    let first = h2.send_request(req(0)).await.unwrap();
    assert_eq!(first.status(), StatusCode::OK);
    // Rounds until the connection is closed: 13 reach the bound if every
    // reset counts, 16 if 70 came late.
    let mut resets = 0;
    for round in 0..16 {
        if driver.is_finished() {
            break;
        }
        let waiting: Vec<_> = (0..20)
            .map(|i| tokio::spawn(h2.send_request(req(round * 20 + i + 1))))
            .collect();
        // Each queued, or the connection closed meanwhile (GOAWAY).
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.status().await["queued"].as_u64() != Some(20) && !driver.is_finished() {
            assert!(Instant::now() < deadline, "round {round} never queued");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Dropping a response future resets its stream (RST_STREAM CANCEL).
        for w in &waiting {
            w.abort();
        }
        resets += waiting.len();
        s.wait_queued(0).await;
    }
    let ended = tokio::time::timeout(Duration::from_secs(10), driver).await;
    assert!(
        ended.is_ok(),
        "the connection is still open after {resets} resets of {} requests",
        resets + 1
    );
    assert!(resets >= 250, "closed after {resets} resets");
    s.wait_for_log("reset most of its requests").await;
    // Only the first request reached the downstream.
    assert_eq!(ds.seen().len(), 1);
}
