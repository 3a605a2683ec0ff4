//! Route and policy options end to end on the real binary, with a real
//! downstream: route selection, forwarded keys, the fair upstream cap,
//! max_concurrency, cost, burst, max_wait, dry_run, RateLimit headers and
//! the bucket query.

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::{Answer, Downstream, Sluice, client, get};

/// A config with an admin listener, one upstream (with `upstream_extra`
/// lines) and the given routes.
fn config(ds: SocketAddr, upstream_extra: &str, routes: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]
trusted_proxies = ["127.0.0.1/32", "10.0.0.0/8"]

[admin]
listen = "127.0.0.1:0"

[[upstream]]
name = "api"
url = "http://{ds}"
{upstream_extra}

{routes}
"#
    )
}

fn route(name: &str, lines: &str) -> String {
    format!("[[route]]\nname = \"{name}\"\nupstream = \"api\"\n{lines}\n")
}

async fn burst(
    s: &Sluice,
    path: &str,
    n: usize,
    headers: &'static [(&'static str, &'static str)],
) -> Vec<Answer> {
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..n {
        let (c, url) = (c.clone(), s.url(&format!("{path}/{i}")));
        tasks.push(tokio::spawn(async move { get(&c, &url, headers).await }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

fn count(answers: &[Answer], status: StatusCode) -> usize {
    answers.iter().filter(|a| a.status == status).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_match_by_host_path_and_method_first_match_wins() {
    let ds = Downstream::start().await;
    let routes = [
        route("exact", "match = { path = \"/exact\" }\nkey = \"global\"\nrate = \"100/s\"\ncapacity = 0"),
        route("posts", "match = { path_prefix = \"/api\", methods = [\"POST\"] }\nkey = \"global\"\nrate = \"100/s\"\ncapacity = 0"),
        route("host", "match = { host = \"shop.example\", path_prefix = \"/api\" }\nkey = \"global\"\nrate = \"100/s\"\ncapacity = 0"),
        route("api", "match = { path_prefix = \"/api\" }\nkey = \"global\"\nrate = \"100/s\"\ncapacity = 0"),
    ]
    .concat();
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let c = client();
    assert_eq!(get(&c, &s.url("/exact"), &[]).await.status, StatusCode::OK);
    assert_eq!(
        get(&c, &s.url("/exact/more"), &[]).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        get(&c, &s.url("/other"), &[]).await.status,
        StatusCode::NOT_FOUND
    );
    let post = support::send(&c, "POST", &s.url("/api/x"), &[], bytes::Bytes::new()).await;
    assert_eq!(post.status, StatusCode::OK);
    assert_eq!(
        get(&c, &s.url("/api/x"), &[("host", "Shop.Example:8080")])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(get(&c, &s.url("/api/y"), &[]).await.status, StatusCode::OK);

    let metrics = get(&c, &s.admin_url("/metrics"), &[]).await.body;
    let text = String::from_utf8_lossy(&metrics);
    for (r, n) in [("exact", 1), ("posts", 1), ("host", 1), ("api", 1)] {
        let line = format!(
            "sluice_requests_total{{route=\"{r}\",protocol=\"http\",outcome=\"forwarded\"}} {n}"
        );
        assert!(text.contains(&line), "missing {line}\n{text}");
    }
    let nf = get(&c, &s.url("/nowhere"), &[]).await;
    assert_eq!(nf.headers["content-type"], "application/problem+json");
}

/// `forwarded` keys use the rightmost untrusted X-Forwarded-For address:
/// whatever a client writes on the left cannot move it to another queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spoofed_forwarded_for_cannot_change_the_key() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"forwarded\"\nrate = \"1/s\"\ncapacity = 0",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let c = client();
    let first = get(
        &c,
        &s.url("/a"),
        &[("x-forwarded-for", "203.0.113.9, 10.0.0.1")],
    )
    .await;
    assert_eq!(first.status, StatusCode::OK);
    for spoof in [
        "1.2.3.4, 203.0.113.9, 10.0.0.1",
        "9.9.9.9,203.0.113.9",
        "bogus, 203.0.113.9",
    ] {
        let a = get(&c, &s.url("/b"), &[("x-forwarded-for", spoof)]).await;
        assert_eq!(
            a.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{spoof} escaped its queue"
        );
    }
    // A different real client is a different queue.
    let other = get(
        &c,
        &s.url("/c"),
        &[("x-forwarded-for", "198.51.100.4, 10.0.0.1")],
    )
    .await;
    assert_eq!(other.status, StatusCode::OK);
}

/// Behind a trusted proxy (a TLS terminator), the scheme and host it
/// forwards for reach the upstream as it sent them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_proxys_scheme_and_host_are_kept() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"forwarded\"\nrate = \"10/s\"\ncapacity = 10",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let headers = [
        ("x-forwarded-for", "203.0.113.9"),
        ("x-forwarded-proto", "https"),
        ("x-forwarded-host", "shop.example"),
        ("x-forwarded-port", "443"),
        ("x-real-ip", "203.0.113.9"),
        ("forwarded", "for=203.0.113.9;proto=https"),
        ("proxy", "http://203.0.113.66:3128"),
    ];
    let a = get(&client(), &s.url("/tls"), &headers).await;
    assert_eq!(a.status, StatusCode::OK);
    let seen = ds.seen();
    let h = &seen.iter().find(|x| x.path == "/tls").unwrap().headers;
    assert_eq!(h["x-forwarded-proto"], "https");
    assert_eq!(h["x-forwarded-host"], "shop.example");
    assert_eq!(h["x-forwarded-for"], "203.0.113.9, 127.0.0.1");
    assert_eq!(h["x-forwarded-port"], "443");
    assert_eq!(h["x-real-ip"], "203.0.113.9");
    assert_eq!(h["forwarded"], "for=203.0.113.9;proto=https");
    // Never passed on, whoever sent it (httpoxy).
    assert!(!h.contains_key("proxy"));
}

/// K equal backlogged clients under a global cap R each get R/K; a light
/// client keeps its own rate beside them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_cap_is_shared_fairly() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"100/s\"\ncapacity = 100",
    );
    let s = Sluice::start(&config(ds.addr, "rate = \"40/s\"", &routes));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    let c = client();
    for k in ["h0", "h1", "h2", "h3"] {
        for i in 0..30 {
            let (c, url) = (c.clone(), s.url(&format!("/{k}/{i}")));
            tasks.push(tokio::spawn(async move {
                get(&c, &url, &[("x-client", k)]).await.status
            }));
        }
    }
    // The light client: 2 requests per second, each should pass promptly.
    let mut light_waits = Vec::new();
    for i in 0..4 {
        tokio::time::sleep_until((t0 + Duration::from_millis(300 + 500 * i)).into()).await;
        let sent = Instant::now();
        let a = get(&c, &s.url(&format!("/light/{i}")), &[("x-client", "light")]).await;
        assert_eq!(a.status, StatusCode::OK);
        light_waits.push(sent.elapsed());
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    for w in &light_waits {
        assert!(*w < Duration::from_millis(250), "light client waited {w:?}");
    }
    // Downstream arrivals per heavy client in a 2 s window mid-run: R/K =
    // 10/s each, so 20 +- 2 (one request per second).
    let seen = ds.seen();
    let start = seen.iter().map(|x| x.at).min().unwrap();
    let (from, to) = (
        start + Duration::from_millis(500),
        start + Duration::from_millis(2500),
    );
    let mut per: HashMap<String, usize> = HashMap::new();
    for x in seen.iter().filter(|x| x.at >= from && x.at < to) {
        let k = x.path.split('/').nth(1).unwrap_or("").to_string();
        *per.entry(k).or_default() += 1;
    }
    for k in ["h0", "h1", "h2", "h3"] {
        let n = per.get(k).copied().unwrap_or(0);
        assert!(
            (18..=22).contains(&n),
            "{k} got {n} in 2 s (expected 20 +- 2): {per:?}"
        );
    }
    // Spaced 1/R = 25 ms apart at the upstream. After a late release the
    // cap catches up no faster than twice its rate (DESIGN section 1), so
    // 12.5 ms gaps are correct; below 10 ms is a stall of this process
    // stamping arrivals late (a busy machine) or a broken cap. Without the
    // cap the 124 departures would come about 2.5 ms apart.
    let mut times: Vec<Instant> = seen.iter().map(|x| x.at).collect();
    times.sort();
    let close = times
        .windows(2)
        .filter(|w| w[1] - w[0] < Duration::from_millis(10))
        .count();
    assert!(
        close <= times.len() / 20,
        "{close} of {} upstream departures closer than 10 ms under a 40/s cap",
        times.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_concurrency_is_never_exceeded() {
    const KEYS: [&str; 8] = ["a", "b", "c", "d", "e", "f", "g", "h"];
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"100/s\"\ncapacity = 10",
    );
    let s = Sluice::start(&config(ds.addr, "max_concurrency = 2", &routes));
    let c = client();
    let mut tasks = Vec::new();
    for (i, key) in KEYS.into_iter().enumerate() {
        let (c, url) = (c.clone(), s.url(&format!("/delay/{i}")));
        tasks.push(tokio::spawn(async move {
            get(&c, &url, &[("x-client", key)]).await.status
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    assert_eq!(ds.seen().len(), 8);
    assert_eq!(
        ds.max_in_flight(),
        2,
        "the downstream saw more (or fewer) than 2 in flight"
    );
    // Those that waited for a slot (their heads packed meanwhile) arrive
    // with their own target and fields, as those that did not.
    for seen in ds.seen() {
        let i: usize = seen.path["/delay/".len()..].parse().unwrap();
        assert_eq!(seen.target, seen.path);
        assert_eq!(seen.headers["x-client"], KEYS[i]);
        assert_eq!(seen.headers["via"], "1.1 sluice");
        assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    }
}

/// A cost-5 request occupies 5 units of capacity and 5 departure slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cost_five_takes_five_slots() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"10/s\"\ncapacity = 5\ncost = { header = \"X-Cost\", default = 1, max = 10 }",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let c = client();
    // A first cost-5 request departs at once and holds the next 5 slots:
    // the cost-5 one after it waits 500 ms (long enough to see it queued).
    assert_eq!(
        get(&c, &s.url("/one"), &[("x-client", "k"), ("x-cost", "5")])
            .await
            .status,
        StatusCode::OK
    );
    let (c2, url) = (c.clone(), s.url("/five"));
    let five =
        tokio::spawn(async move { get(&c2, &url, &[("x-client", "k"), ("x-cost", "5")]).await });
    s.wait_queued_at_least(1).await;
    // 5 units wait: one more unit does not fit in capacity 5.
    let full = get(
        &c,
        &s.url("/refused"),
        &[("x-client", "k"), ("x-cost", "1")],
    )
    .await;
    assert_eq!(full.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(five.await.unwrap().status, StatusCode::OK);
    // The next request goes 5 slots (500 ms) after the cost-5 one.
    assert_eq!(
        get(&c, &s.url("/after"), &[("x-client", "k")]).await.status,
        StatusCode::OK
    );
    let seen = ds.seen();
    let at = |p: &str| seen.iter().find(|x| x.path == p).unwrap().at;
    // Each cost-5 request holds 5 slots of 100 ms: 500 ms to the next
    // departure. Counted as one slot (the bug), 100 ms; the lower bound
    // allows a late departure caught up (DESIGN section 1), the upper one
    // scheduling delay on a busy machine.
    for (from, to) in [("/one", "/five"), ("/five", "/after")] {
        let gap = at(to) - at(from);
        assert!(
            gap >= Duration::from_millis(400) && gap <= Duration::from_millis(800),
            "{from} to {to}: {gap:?}"
        );
    }
    // A cost above max, or not a number, is a 400.
    assert_eq!(
        get(&c, &s.url("/x"), &[("x-client", "z"), ("x-cost", "11")])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        get(&c, &s.url("/x"), &[("x-client", "z"), ("x-cost", "lots")])
            .await
            .status,
        StatusCode::BAD_REQUEST
    );
}

/// burst = 3: after idle exactly three pass at once, then the rest are
/// paced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_lets_exactly_n_pass_at_once_after_idle() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"2/s\"\ncapacity = 10\nburst = 3",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let answers = burst(&s, "/b", 5, &[("x-client", "k")]).await;
    assert_eq!(count(&answers, StatusCode::OK), 5);
    let mut times: Vec<Instant> = ds.seen().iter().map(|x| x.at).collect();
    times.sort();
    let t0 = times[0];
    let offsets: Vec<Duration> = times.iter().map(|t| *t - t0).collect();
    for o in &offsets[..3] {
        assert!(
            *o < Duration::from_millis(100),
            "first three at once: {offsets:?}"
        );
    }
    // The fourth waits for T = 500 ms (less what the first was late);
    // let through with the burst (the bug), it would be at 0.
    assert!(
        offsets[3] >= Duration::from_millis(300),
        "the fourth is paced: {offsets:?}"
    );
    // Then 500 ms apart: no closer than T/2 (DESIGN section 1: a late
    // release may be followed by an on-time one); unpaced (the burst
    // letting more than three through), the gap would be near 0.
    assert!(
        offsets[4] - offsets[3] >= Duration::from_millis(250),
        "then 500 ms apart: {offsets:?}"
    );
}

/// max_wait refuses at admission when the departure would be too late, and
/// under an upstream cap answers 503 to a request still waiting at max_wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_wait_refuses_late_departures() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"2/s\"\ncapacity = 10\nmax_wait = \"1s\"",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    // Departures at 0, 0.5, 1.0 s fit; 1.5 and 2.0 s do not.
    let answers = burst(&s, "/w", 5, &[("x-client", "k")]).await;
    assert_eq!(count(&answers, StatusCode::OK), 3);
    assert_eq!(count(&answers, StatusCode::TOO_MANY_REQUESTS), 2);
    for a in answers
        .iter()
        .filter(|a| a.status == StatusCode::TOO_MANY_REQUESTS)
    {
        assert!(a.headers.contains_key("retry-after"));
    }

    let capped = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"100/s\"\ncapacity = 10\nmax_wait = \"600ms\"",
    );
    let s = Sluice::start(&config(ds.addr, "rate = \"2/s\"", &capped));
    let c = client();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for k in ["a", "b", "c"] {
        let (c, url) = (c.clone(), s.url(&format!("/cap/{k}")));
        tasks.push(tokio::spawn(async move {
            get(&c, &url, &[("x-client", k)]).await
        }));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let answers: Vec<Answer> = futures_join(tasks).await;
    // Global slots at 0 and 0.5 s; the third would go at 1 s > 600 ms.
    assert_eq!(count(&answers, StatusCode::OK), 2);
    let late = answers
        .iter()
        .find(|a| a.status == StatusCode::SERVICE_UNAVAILABLE)
        .unwrap();
    assert!(late.headers.contains_key("retry-after"));
    let waited = late.at - t;
    assert!(
        waited >= Duration::from_millis(550) && waited < Duration::from_millis(950),
        "503 after {waited:?}"
    );
}

async fn futures_join(tasks: Vec<tokio::task::JoinHandle<Answer>>) -> Vec<Answer> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

/// dry_run forwards everything at once and counts what it would have
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_forwards_everything_and_counts_refusals() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"1/s\"\ncapacity = 1\ndry_run = true",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let t = Instant::now();
    let answers = burst(&s, "/d", 5, &[("x-client", "k")]).await;
    assert_eq!(count(&answers, StatusCode::OK), 5);
    assert!(
        t.elapsed() < Duration::from_millis(500),
        "dry run must not delay: {:?}",
        t.elapsed()
    );
    assert_eq!(ds.seen().len(), 5);
    let c = client();
    let text =
        String::from_utf8_lossy(&get(&c, &s.admin_url("/metrics"), &[]).await.body).into_owned();
    // 1 departs, 1 would wait, 3 would be refused.
    assert!(
        text.contains("sluice_dry_run_refusals_total{route=\"default\",protocol=\"http\"} 3"),
        "{text}"
    );
    assert!(
        text.contains(
            "sluice_requests_total{route=\"default\",protocol=\"http\",outcome=\"forwarded\"} 5"
        ),
        "{text}"
    );
}

/// RateLimit-Policy and RateLimit parse as Structured Fields lists with the
/// draft-10 parameters, on forwarded responses and on 429s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ratelimit_headers_parse_per_the_draft() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"5/s\"\ncapacity = 10\nratelimit_headers = true",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let answers = burst(&s, "/r", 13, &[("x-client", "k")]).await;
    let mut saw_429 = false;
    for a in &answers {
        let policy = sfv::Parser::parse_list(a.headers["ratelimit-policy"].as_bytes()).unwrap();
        let sfv::ListEntry::Item(item) = &policy[0] else {
            panic!("not an item")
        };
        assert_eq!(item.bare_item.as_str(), Some("default"));
        assert_eq!(item.params["q"].as_int(), Some(10));
        assert_eq!(item.params["w"].as_int(), Some(2));
        let limit = sfv::Parser::parse_list(a.headers["ratelimit"].as_bytes()).unwrap();
        let sfv::ListEntry::Item(item) = &limit[0] else {
            panic!("not an item")
        };
        assert_eq!(item.bare_item.as_str(), Some("default"));
        let r = item.params["r"].as_int().unwrap();
        let t = item.params["t"].as_int().unwrap();
        assert!((0..=10).contains(&r), "r={r}");
        assert!((0..=3).contains(&t), "t={t}");
        if a.status == StatusCode::TOO_MANY_REQUESTS {
            saw_429 = true;
            assert_eq!(r, 0, "a refused request sees no remaining quota");
        }
    }
    assert!(saw_429);
}

/// The bucket query reports a client's queue and what a request of cost N
/// would get, and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bucket_query_changes_nothing() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"2/s\"\ncapacity = 3",
    );
    let s = Sluice::start(&config(ds.addr, "", &routes));
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..3 {
        let (c, url) = (c.clone(), s.url(&format!("/q/{i}")));
        tasks.push(tokio::spawn(async move {
            get(&c, &url, &[("x-client", "bob")]).await.status
        }));
    }
    // One departed, two wait (until the second departs, 500 ms after the
    // first).
    s.wait_queued(2).await;
    let ask = |cost: u32| {
        let (c, url) = (
            c.clone(),
            s.admin_url(&format!("/buckets/default/bob?cost={cost}")),
        );
        async move {
            serde_json::from_slice::<serde_json::Value>(&get(&c, &url, &[]).await.body).unwrap()
        }
    };
    let one = ask(1).await;
    assert_eq!(one["waiting_cost"], 2, "{one}");
    assert_eq!(one["admitted_now"], true, "{one}");
    let two = ask(2).await;
    assert_eq!(two["admitted_now"], false, "{two}");
    assert_eq!(two["verdict"], "reject");
    // Asking many times changes nothing: still 2 waiting, still room for 1.
    for _ in 0..5 {
        let _ = ask(1).await;
    }
    assert_eq!(ask(1).await["waiting_cost"], 2);
    let fits = get(&c, &s.url("/q/fits"), &[("x-client", "bob")]).await;
    assert_eq!(fits.status, StatusCode::OK);
    for t in tasks {
        assert_eq!(t.await.unwrap(), StatusCode::OK);
    }
    let idle = ask(1).await;
    assert_eq!(idle["waiting_cost"], 0);
    let unknown = get(&c, &s.admin_url("/buckets/nope/bob"), &[]).await;
    assert_eq!(unknown.status, StatusCode::NOT_FOUND);
}

/// Open a raw HTTP/1.1 connection and send a GET for `path` as client
/// `key`; the request stays in flight until the stream is dropped.
fn held_get(addr: SocketAddr, path: &str, key: &str) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: t\r\nX-Client: {key}\r\n\r\n"
    )
    .unwrap();
    s
}

/// `limits.max_queued = 2` (README "What a client sees": `max_clients` or
/// `max_queued` reached gives `503 Service Unavailable`, `Retry-After: 1`):
/// with two requests waiting, a third that would wait gets 503 with
/// `Retry-After: 1` and problem+json, is never forwarded, and counts as
/// outcome `overloaded`, even though its client's own capacity (10) has
/// room; an idle client still passes at once (it needs no queue room);
/// and a waiting request that leaves gives its room back. A bug that
/// ignored the bound would hold the third (no answer within the 60 s
/// interval, so the test's bounded wait fails) or answer 429 from the
/// client's capacity; one that leaked room would refuse the last request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_queued_refuses_with_503_and_counts_overloaded() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"1/m\"\ncapacity = 10",
    );
    let s = Sluice::start(&format!(
        "{}\n[limits]\nmax_queued = 2\n",
        config(ds.addr, "", &routes)
    ));
    let c = client();
    assert_eq!(
        get(&c, &s.url("/first"), &[("x-client", "a")]).await.status,
        StatusCode::OK
    );
    // 1/m: each of the next requests waits a minute; order by /status.
    let one = held_get(s.addr, "/held/1", "a");
    s.wait_queued(1).await;
    let _two = held_get(s.addr, "/held/2", "a");
    s.wait_queued(2).await;

    let over = tokio::time::timeout(
        Duration::from_secs(5),
        get(&c, &s.url("/over"), &[("x-client", "a")]),
    )
    .await
    .expect("the request past max_queued was held, not refused");
    assert_eq!(over.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(over.headers["retry-after"], "1");
    assert_eq!(over.headers["content-type"], "application/problem+json");

    // An idle client departs at once: no queue room needed.
    assert_eq!(
        get(&c, &s.url("/idle"), &[("x-client", "b")]).await.status,
        StatusCode::OK
    );
    // A waiting request that leaves frees its room for the next one.
    drop(one);
    s.wait_queued(1).await;
    let _three = held_get(s.addr, "/held/3", "a");
    s.wait_queued(2).await;

    let paths: Vec<String> = ds.seen().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, vec!["/first", "/idle"]);
    let text =
        String::from_utf8_lossy(&get(&c, &s.admin_url("/metrics"), &[]).await.body).into_owned();
    let line =
        "sluice_requests_total{route=\"default\",protocol=\"http\",outcome=\"overloaded\"} 1";
    assert!(text.contains(line), "missing {line}\n{text}");
    assert!(
        !text.contains("outcome=\"rejected\"} 1"),
        "the 503 was counted as a 429's refusal\n{text}"
    );
    assert_eq!(s.status().await["totals"]["overloaded"], 1);
}

/// `limits.max_clients = 2`: while two clients' states are held (each
/// departed once at 1/m, so its schedule runs a minute ahead), a third
/// client gets 503 with `Retry-After: 1`, never forwarded, counted as
/// `overloaded`; a known client is still answered by its own queue (429
/// at capacity 0, not 503). A bug that ignored the bound forwards the
/// third client (200); one that counted the refusal as a capacity refusal
/// shows `rejected` 2 and `overloaded` 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_clients_refuses_new_clients_with_503_and_counts_overloaded() {
    let ds = Downstream::start().await;
    let routes = route(
        "default",
        "key = \"header:X-Client\"\nrate = \"1/m\"\ncapacity = 0",
    );
    let s = Sluice::start(&format!(
        "{}\n[limits]\nmax_clients = 2\n",
        config(ds.addr, "", &routes)
    ));
    let c = client();
    for key in ["a", "b"] {
        let a = get(&c, &s.url(&format!("/{key}")), &[("x-client", key)]).await;
        assert_eq!(a.status, StatusCode::OK, "client {key}");
    }
    let third = get(&c, &s.url("/c"), &[("x-client", "c")]).await;
    assert_eq!(third.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(third.headers["retry-after"], "1");
    assert_eq!(third.headers["content-type"], "application/problem+json");
    // A known client: its own queue answers (capacity 0: 429).
    let again = get(&c, &s.url("/a-again"), &[("x-client", "a")]).await;
    assert_eq!(again.status, StatusCode::TOO_MANY_REQUESTS);

    let paths: Vec<String> = ds.seen().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, vec!["/a", "/b"]);
    let text =
        String::from_utf8_lossy(&get(&c, &s.admin_url("/metrics"), &[]).await.body).into_owned();
    for (outcome, n) in [("overloaded", 1), ("rejected", 1), ("forwarded", 2)] {
        let line = format!(
            "sluice_requests_total{{route=\"default\",protocol=\"http\",outcome=\"{outcome}\"}} {n}"
        );
        assert!(text.contains(&line), "missing {line}\n{text}");
    }
}
