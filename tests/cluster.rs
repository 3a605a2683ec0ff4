//! Cluster mode end to end: a real redis-server, two or three real sluice
//! instances, one real downstream.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::StatusCode;
use support::{
    Downstream, RedisServer, Sluice, a_flood_is_refused_from_memory, all_answered_together,
    assert_gaps, client, get, light_client_behind_a_backlog, seed_burst_across,
    store_stopped_then_resumed, throttle, throttled_then_another, together,
    unready_while_writes_are_refused,
};

/// `sluice_cluster_fallbacks_total` for Redis under `policy`, and the
/// whole `/metrics` text (for a failure message).
async fn fallbacks(s: &Sluice, policy: &str) -> (Option<f64>, String) {
    let body = get(&client(), &s.admin_url("/metrics"), &[]).await.body;
    let metrics = String::from_utf8_lossy(&body).into_owned();
    let series =
        format!("sluice_cluster_fallbacks_total{{backend=\"redis\",policy=\"{policy}\"}} ");
    let n = metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.parse::<f64>().ok());
    (n, metrics)
}

/// One instance (`on_failure = "reject"`) whose route's rate and
/// capacity lines are `route`.
fn one_instance(ds: SocketAddr, redis: &str, route: &str) -> String {
    config(ds, redis, "reject", 1, "500ms").replace("rate = \"5/s\"\ncapacity = 10", route)
}

fn config(ds: SocketAddr, redis: &str, on_failure: &str, instances: u32, timeout: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[admin]
listen = "127.0.0.1:0"

[cluster]
redis = "{redis}"
timeout = "{timeout}"
on_failure = "{on_failure}"
instances = {instances}

[[upstream]]
name = "api"
url = "http://{ds}"

[[route]]
name = "default"
upstream = "api"
key = "header:X-Client"
rate = "5/s"
capacity = 10
"#
    )
}

/// One client spreading the DESIGN seed burst over three instances gets the
/// single-instance outcome: 13 admitted, departures 200 ms apart fleet-wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_across_three_instances_is_paced_as_one() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = config(ds.addr, &redis.url(), "reject", 3, "500ms");
    let fleet = [
        Sluice::start(&cfg),
        Sluice::start(&cfg),
        Sluice::start(&cfg),
    ];
    seed_burst_across(&fleet, &ds).await;
}

/// Redis restarting mid-run: requests follow on_failure = "local" (shaped
/// locally at r / instances) and cluster shaping resumes once it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_falls_back_locally_then_recovers() {
    let mut redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = config(ds.addr, &redis.url(), "local", 2, "200ms");
    let a = Sluice::start(&cfg);
    let c = client();
    assert_eq!(
        get(&c, &a.url("/before"), &[("x-client", "k")])
            .await
            .status,
        StatusCode::OK
    );
    redis.stop();
    // Local fallback at 5/s / 2 instances: 2.5/s, capacity 10.
    let t = Instant::now();
    assert_eq!(
        get(&c, &a.url("/during/1"), &[("x-client", "z")])
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        get(&c, &a.url("/during/2"), &[("x-client", "z")])
            .await
            .status,
        StatusCode::OK
    );
    let paced = t.elapsed();
    assert!(
        paced >= Duration::from_millis(350) && paced < Duration::from_secs(3),
        "local pace: {paced:?}"
    );
    // Registered at 0 from the start: the fallbacks must have counted.
    let (fallbacks, metrics) = fallbacks(&a, "local").await;
    assert!(fallbacks.is_some_and(|n| n >= 1.0), "{metrics}");

    redis.restart();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let _ = get(&c, &a.url("/after"), &[("x-client", "fresh")]).await;
        let m =
            String::from_utf8_lossy(&get(&c, &a.admin_url("/status"), &[]).await.body).into_owned();
        if m.contains("\"redis\":\"ok\"") {
            break;
        }
        assert!(Instant::now() < deadline, "did not recover: {m}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Back on Redis: the schedule is shared again (a second instance sees
    // the first's client as busy).
    let b = Sluice::start(&cfg);
    assert_eq!(
        get(&c, &a.url("/shared/1"), &[("x-client", "s")])
            .await
            .status,
        StatusCode::OK
    );
    let t = Instant::now();
    assert_eq!(
        get(&c, &b.url("/shared/2"), &[("x-client", "s")])
            .await
            .status,
        StatusCode::OK
    );
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "the second instance must wait for the shared slot"
    );
}

/// A Redis that stops answering (SIGSTOP) makes requests follow on_failure
/// within the timeout instead of hanging, /readyz reflects it, and all is
/// well again after SIGCONT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_redis_follows_on_failure_within_the_timeout() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let s = Sluice::start(&config(ds.addr, &redis.url(), "reject", 1, "150ms"));
    store_stopped_then_resumed(
        &s,
        &ds,
        || redis.signal("STOP"),
        Duration::ZERO,
        || redis.signal("CONT"),
    )
    .await;
}

/// Regression (issue 12): under an upstream cap in cluster mode, client A's
/// backlog (11 requests, r = 5/s, b = 10, R = 100/s) moved the shared cap
/// to A's last departure and client B waited 1.96 s. B now takes the first
/// free cap slot at or after its own due time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlogged_client_does_not_hold_the_cap_for_everyone() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = config(ds.addr, &redis.url(), "reject", 1, "500ms")
        .replace("url = ", "rate = \"100/s\"\nurl = ");
    let s = Sluice::start(&cfg);
    let heavy = light_client_behind_a_backlog(&s, &s).await;
    // A's requests still leave 200 ms apart.
    let mut ok = 0;
    for h in heavy {
        if h.await.unwrap().status == StatusCode::OK {
            ok += 1;
        }
    }
    assert_eq!(ok, 11);
    let a_times = ds.arrivals("/a/");
    // 200 ms apart; DESIGN section 1 guarantees no gap under T/2 (a late
    // release may be followed by an on-time one), and the upper bound
    // allows a store round trip and scheduling delay on a busy machine.
    // Unpaced, a's 11 requests would leave within a few ms of each other.
    assert_gaps(&a_times, 100, 300);
}

/// dry_run in cluster mode: a request the shared schedule would hold is
/// forwarded at once and keeps no room in `max_queued` (so it can never
/// crowd out requests that really wait).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_holds_no_queue_room_in_cluster_mode() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[admin]
listen = "127.0.0.1:0"

[limits]
max_queued = 2

[cluster]
redis = "{}"
timeout = "500ms"
on_failure = "reject"

[[upstream]]
name = "api"
url = "http://{}"

[[route]]
name = "dry"
upstream = "api"
key = "header:X-Client"
rate = "1/s"
capacity = 10
dry_run = true
"#,
        redis.url(),
        ds.addr
    );
    let s = Sluice::start(&cfg);
    let c = client();
    let t = Instant::now();
    // The first departs at once; the next four would each wait a second
    // more than the one before.
    for i in 0..5 {
        let a = get(&c, &s.url(&format!("/d/{i}")), &[("x-client", "k")]).await;
        assert_eq!(a.status, StatusCode::OK, "request {i}");
    }
    // Waiting would take 4 s (one per second).
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    let metrics =
        String::from_utf8_lossy(&get(&c, &s.admin_url("/metrics"), &[]).await.body).into_owned();
    let queued = metrics
        .lines()
        .find_map(|l| l.strip_prefix("sluice_queued_requests "))
        .and_then(|v| v.parse::<f64>().ok());
    assert_eq!(queued, Some(0.0), "{metrics}");
}

/// With the store unreachable and `on_failure = "local"`, each instance
/// shapes at r / instances; where that is slower than the slowest rate
/// sluice schedules (one per 30 days), it shapes at that, never at r.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_fallback_never_runs_faster_than_r_over_instances() {
    let ds = Downstream::start().await;
    // Nothing listens on port 1: every call fails at once.
    let mut cfg = config(ds.addr, "redis://127.0.0.1:1", "local", 721, "200ms");
    cfg = cfg.replace(
        "rate = \"5/s\"\ncapacity = 10",
        "rate = \"1/h\"\ncapacity = 0",
    );
    let s = Sluice::start(&cfg);
    let c = client();
    let first = get(&c, &s.url("/1"), &[("x-client", "k")]).await;
    assert_eq!(first.status, StatusCode::OK);
    let second = get(&c, &s.url("/2"), &[("x-client", "k")]).await;
    assert_eq!(second.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = second.retry_after().unwrap_or(0);
    // 721 h / 721 would be 1 h; the fallback's own rate is 30 days.
    assert!(retry > 29 * 86_400, "Retry-After {retry} s");
}

/// With the store unreachable and `on_failure = "local"`, the upstream's
/// rate R is shared as the routes' rates are: each instance sends it at
/// most R / instances, so the fleet never sends more than R.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_fallback_shares_the_upstreams_rate_too() {
    let ds = Downstream::start().await;
    // Nothing listens on port 1: every call fails at once. R = 20/s for
    // 4 instances: 5/s here, 200 ms apart (50 ms at R itself); each
    // client's own share (250/s) never binds.
    let cfg = config(ds.addr, "redis://127.0.0.1:1", "local", 4, "200ms")
        .replace("url = ", "rate = \"20/s\"\nurl = ")
        .replace(
            "rate = \"5/s\"\ncapacity = 10",
            "rate = \"1000/s\"\ncapacity = 10",
        );
    let s = Sluice::start(&cfg);
    let statuses = together(&s, 4, |i| format!("/shared/{i}"), |i| format!("k{i}")).await;
    assert_eq!(statuses, vec![StatusCode::OK; 4]);
    let times = ds.arrivals("/shared/");
    assert_eq!(times.len(), 4);
    // 200 ms apart: no closer than half of it at the departures after a
    // late release (DESIGN section 1; the downstream's own wake-up can
    // take a little off), and the upper bound allows a busy machine's
    // delays. At R itself they would be 50 ms.
    assert_gaps(&times, 80, 400);
}

/// A capped upstream whose calendar is taken for more than the 100,000
/// slots one admission searches: the request is refused as departing too
/// far ahead, not given a slot that may be taken already (two requests in
/// one slot would let the upstream get more than R).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calendar_taken_past_the_search_refuses_instead_of_booking_a_taken_slot() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = config(ds.addr, &redis.url(), "reject", 1, "2s")
        .replace("url = ", "rate = \"1000/s\"\nurl = ");
    let s = Sluice::start(&cfg);
    // 110,000 slots of 1 ms taken in a row from Redis's now: 110 s of the
    // upstream's schedule, so that more than the 100,000 searched are
    // still ahead when the request comes (up to 10 s later on a busy
    // machine; at 100,500 a run under load found their end).
    redis.cli(&[
        "EVAL",
        "local t = redis.call('TIME') \
             local s = math.floor((tonumber(t[1]) * 1000000 + tonumber(t[2])) / 1000) \
             for i = 0, 109999 do redis.call('ZADD', KEYS[1], s + i, s + i) end \
             redis.call('PEXPIRE', KEYS[1], 600000) return s",
        "1",
        "sluice:{u:api}:slots:1000",
    ]);
    let answer = tokio::time::timeout(
        Duration::from_secs(10),
        get(&client(), &s.url("/far"), &[("x-client", "k")]),
    )
    .await
    .expect("refused at once, not held for the end of the calendar");
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    let retry = answer.retry_after().unwrap_or(0);
    // About the 100 s the search went through.
    assert!((90..=110).contains(&retry), "Retry-After {retry} s");
}

/// With `on_failure = "local"` an instance whose store cannot be reached
/// serves (shaping locally), so it stays ready; `/status` says what is
/// wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_store_leaves_a_local_fallback_instance_ready() {
    let ds = Downstream::start().await;
    // Nothing listens on port 1.
    let s = Sluice::start(&config(ds.addr, "redis://127.0.0.1:1", "local", 2, "200ms"));
    let c = client();
    assert_eq!(
        get(&c, &s.url("/a"), &[("x-client", "k")]).await.status,
        StatusCode::OK
    );
    let ready = get(&c, &s.admin_url("/readyz"), &[]).await;
    assert_eq!(
        ready.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&ready.body)
    );
    let status = s.status().await;
    let problem = status["cluster"]["problem"].as_str().unwrap_or_default();
    assert!(problem.contains("cannot reach"), "{status}");
}

/// With `on_failure = "reject"`, an instance made unready by failed calls
/// (for a second, in a row) is ready again once the store answers, with no
/// traffic to tell it (a load balancer sends none to an unready instance).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_comes_back_with_the_store_without_traffic() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let s = Sluice::start(&config(ds.addr, &redis.url(), "reject", 1, "150ms"));
    let c = client();
    redis.signal("STOP");
    let mut first_failed: Option<Instant> = None;
    let mut i = 0;
    while i < 3 || first_failed.is_none_or(|t| t.elapsed() < Duration::from_millis(1_200)) {
        i += 1;
        let a = get(&c, &s.url(&format!("/stopped/{i}")), &[("x-client", "k")]).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        first_failed.get_or_insert_with(Instant::now);
    }
    assert_eq!(
        get(&c, &s.admin_url("/readyz"), &[]).await.status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    redis.signal("CONT");
    // The background check runs every 5 s.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let ready = get(&c, &s.admin_url("/readyz"), &[]).await;
        if ready.status == StatusCode::OK {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "still not ready: {}",
            String::from_utf8_lossy(&ready.body)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(ds.seen().is_empty(), "no request was forwarded meanwhile");
}

fn paused_config(ds: SocketAddr, redis: &str, route: &str) -> String {
    config(ds, redis, "reject", 1, "500ms")
        .replace("url = ", "on_throttle = \"pause\"\nurl = ")
        .replace("rate = \"5/s\"", &format!("rate = \"100/s\"\n{route}"))
}

/// The upstream answers 429 with `Retry-After: 2` in cluster mode: the
/// pause holds every release to it on this instance, shared departures
/// included, as without a store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_pause_holds_shared_departures() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = paused_config(ds.addr, &redis.url(), "");
    let s = Sluice::start(&cfg);
    let (retried, during, paused_at) = throttled_then_another(&s, &ds).await;
    assert_eq!(retried.status, StatusCode::OK);
    assert_eq!(during.status, StatusCode::OK);
    let seen = ds.seen();
    let later: Vec<(String, Duration)> = seen[1..]
        .iter()
        .map(|r| (r.path.clone(), r.at - paused_at))
        .collect();
    assert_eq!(seen.len(), 3, "{later:?}");
    assert!(
        later
            .iter()
            .all(|(_, d)| *d >= Duration::from_millis(1_900)),
        "nothing reaches a paused upstream: {later:?} after the 429"
    );
}

/// During an upstream's pause (2 s), one client's requests sent at its
/// rate (100/s, b = 10): the store, which knows nothing of the pause, lets
/// each go on time, but this instance holds them all; as without a store,
/// once `capacity` of them are held here the rest are refused (429) until
/// the pause ends, and the held ones reach the upstream after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_holds_no_more_than_capacity_of_a_client() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = paused_config(ds.addr, &redis.url(), "");
    let s = Sluice::start(&cfg);
    let c = client();
    let (throttled, paused_at) = throttle(&s, &ds).await;
    // The downstream has answered 429; the pause begins when sluice has
    // read that answer.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = s.status().await;
        let paused = status["upstreams"]
            .as_array()
            .and_then(|u| u.iter().find(|u| u["name"] == "api"))
            .and_then(|u| u["paused_for_ms"].as_u64());
        if paused.is_some_and(|ms| ms > 0) {
            break;
        }
        assert!(Instant::now() < deadline, "{status}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut sent = Vec::new();
    for i in 0..30 {
        let (c, url) = (c.clone(), s.url(&format!("/b{i}")));
        sent.push(tokio::spawn(async move {
            get(&c, &url, &[("x-client", "b")]).await.status
        }));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sending = paused_at.elapsed();
    let mut refused = 0;
    for status in sent {
        match status.await.unwrap() {
            StatusCode::OK => {}
            StatusCode::TOO_MANY_REQUESTS => refused += 1,
            other => panic!("{other}"),
        }
    }
    assert_eq!(throttled.await.unwrap().status, StatusCode::OK);
    // All thirty came during the pause (within about 0.4 s of its start):
    // at most ten (and one for the rounding of a pause's end) were held.
    if sending < Duration::from_millis(1_500) {
        assert!(refused >= 19, "{refused} refused");
    }
    let held: Vec<Duration> = ds.arrivals("/b").iter().map(|&at| at - paused_at).collect();
    assert_eq!(held.len(), 30 - refused);
    assert!(
        held.iter().all(|d| *d >= Duration::from_millis(1_900)),
        "{held:?}"
    );
}

/// A pause longer than `max_wait` (2 s against 1.2 s): a request held for
/// a shared departure when the pause begins expires at its max_wait (503),
/// one that arrives during it is refused at once (429), and neither
/// reaches the upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_longer_than_max_wait_expires_or_refuses_shared_departures() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = paused_config(ds.addr, &redis.url(), "max_wait = \"1200ms\"")
        .replace("rate = \"100/s\"", "rate = \"1/s\"");
    let s = Sluice::start(&cfg);
    let c = client();
    assert_eq!(
        get(&c, &s.url("/b1"), &[("x-client", "b")]).await.status,
        StatusCode::OK
    );
    // Held for its departure 1 s after the first.
    let held = {
        let (c, url) = (c.clone(), s.url("/b2"));
        tokio::spawn(async move { get(&c, &url, &[("x-client", "b")]).await })
    };
    s.wait_queued(1).await;
    let throttled = get(&c, &s.url("/throttle/get"), &[("x-client", "a")]).await;
    // Not retried: the pause outlasts its max_wait.
    assert_eq!(throttled.status, StatusCode::TOO_MANY_REQUESTS);
    let during = get(&c, &s.url("/during"), &[("x-client", "c")]).await;
    assert_eq!(during.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(held.await.unwrap().status, StatusCode::SERVICE_UNAVAILABLE);
    let seen: Vec<String> = ds.seen().iter().map(|r| r.path.clone()).collect();
    assert_eq!(seen, ["/b1", "/throttle/get"]);
}

/// DESIGN 1's late releases with a shared schedule: sluice stopped
/// (SIGSTOP) for 1.5 s while one client's four requests wait for their
/// shared departures (200 ms apart) catches up at no more than twice the
/// client's rate (100 ms apart), not in one burst; a fifth, sent during
/// the catch-up, which the store lets go at once, keeps that distance too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_instance_catches_up_shared_departures_at_twice_the_rate() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let s = Sluice::start(&config(ds.addr, &redis.url(), "reject", 1, "500ms"));
    let c = client();
    let first = get(&c, &s.url("/0"), &[("x-client", "k")]).await;
    assert_eq!(first.status, StatusCode::OK);
    let held: Vec<_> = (1..=4)
        .map(|i| {
            let (c, url) = (c.clone(), s.url(&format!("/{i}")));
            tokio::spawn(async move { get(&c, &url, &[("x-client", "k")]).await })
        })
        .collect();
    s.wait_queued(4).await;
    s.signal("STOP");
    // Every departure is overdue when it resumes (the last was due 800 ms
    // after the first).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    s.signal("CONT");
    // One more during the catch-up (once its first release is out): the
    // store lets it go at once (its schedule has passed), and it keeps its
    // distance from the others. (Sent before the first release, it may
    // go first: a request that goes at once is not recorded for the
    // spacing, and the first release keeps no distance from it.)
    let deadline = Instant::now() + Duration::from_secs(10);
    while ds.seen().len() < 2 {
        assert!(Instant::now() < deadline, "no release after the stall");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let during = get(&c, &s.url("/5"), &[("x-client", "k")]).await;
    assert_eq!(during.status, StatusCode::OK);
    for h in held {
        assert_eq!(h.await.unwrap().status, StatusCode::OK);
    }
    let seen = ds.seen();
    assert_eq!(seen.len(), 6);
    let times: Vec<Instant> = seen[1..].iter().map(|r| r.at).collect();
    // 100 ms apart less the downstream's own jitter (over 30 ms once,
    // beside a CI run's tests); in one burst they come within a
    // millisecond or two.
    let gaps: Vec<Duration> = times.windows(2).map(|w| w[1] - w[0]).collect();
    assert!(
        gaps.iter().all(|g| *g >= Duration::from_millis(50)),
        "{gaps:?}"
    );
    // Each shared release is in the release-lag histogram, the stall's
    // lateness with it (>= 0.5 s for at least one).
    let metrics =
        String::from_utf8_lossy(&get(&c, &s.admin_url("/metrics"), &[]).await.body).into_owned();
    let sample = |name: &str| {
        metrics
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
    };
    let count = sample("sluice_release_lag_seconds_count");
    assert!(count.is_some_and(|n| n >= 4.0), "{metrics}");
    let sum = sample("sluice_release_lag_seconds_sum");
    assert!(sum.is_some_and(|s| s >= 0.5), "{metrics}");
}

/// The store's connection is driven on the runtime it was made on: a
/// first call made from a worker's runtime that has since ended (a
/// worker's runtime ends with the drain) does not take the connection
/// down for the calls that follow from another.
#[test]
fn the_redis_connection_outlives_the_runtime_of_its_first_call() {
    use sluice::cluster::{Ask, Cluster};
    let redis = RedisServer::start();
    let toml = config(
        "127.0.0.1:9".parse().unwrap(),
        &redis.url(),
        "reject",
        1,
        "2s",
    );
    let cfg = sluice::config::Config::from_toml(&toml)
        .ok()
        .and_then(|c| c.cluster)
        .expect("a cluster config");
    let main = tokio::runtime::Runtime::new().unwrap();
    let cluster = main.block_on(async {
        let c = Cluster::new(&cfg).unwrap();
        c.check().await.unwrap();
        c
    });
    let ask = |n: u32| Ask {
        key: format!("{{t}}:{n}"),
        slots: None,
        step_us: 1_000,
        capacity: 10,
        cost: 1,
        tau_us: 0,
        slot_us: 0,
        max_wait_us: 0,
    };
    let worker = || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    };
    let first = worker();
    let admitted = first.block_on(cluster.admit(ask(1)));
    assert!(admitted.is_ok(), "{admitted:?}");
    drop(first);
    let second = worker();
    for n in 2..5 {
        let admitted = second.block_on(cluster.admit(ask(n)));
        assert!(admitted.is_ok(), "call {n}: {admitted:?}");
    }
}

/// `cluster.redis` pointed at a replica, where every script would fail
/// with READONLY: a misconfiguration, named in /status, and /readyz
/// answers 503 whatever on_failure says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_is_named_as_a_misconfiguration() {
    use std::io::{Read, Write};
    let master = RedisServer::start();
    let replica = RedisServer::start();
    let mut sock = std::net::TcpStream::connect(("127.0.0.1", replica.port)).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(sock, "REPLICAOF 127.0.0.1 {}\r\n", master.port).unwrap();
    let mut buf = [0u8; 64];
    let n = sock.read(&mut buf).unwrap();
    assert!(buf[..n].starts_with(b"+OK"), "{:?}", &buf[..n]);
    let ds = Downstream::start().await;
    let s = Sluice::start(&config(ds.addr, &replica.url(), "local", 1, "500ms"));
    let c = client();
    let ready = get(&c, &s.admin_url("/readyz"), &[]).await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    let status = s.status().await;
    let problem = status["cluster"]["problem"].as_str().unwrap_or_default();
    assert!(problem.contains("replica"), "{status}");
}

/// A Redis password can come from `password_file` (a systemd credential),
/// out of the config, which the service's dynamic user reads only if
/// everyone may: the store answers with it; without it, sluice refuses to
/// start under reject.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_password_can_come_from_a_file() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    redis.cli(&["CONFIG", "SET", "requirepass", "fromfile"]);
    let file = support::TempFile::new("redis-pass", "fromfile\n");
    let cfg = config(ds.addr, &redis.url(), "reject", 1, "500ms");
    let with = cfg.replace(
        "timeout = \"500ms\"",
        &format!(
            "timeout = \"500ms\"\npassword_file = \"{}\"",
            file.display()
        ),
    );
    let c = client();
    let s = Sluice::start(&with);
    assert_eq!(
        get(&c, &s.url("/a"), &[("x-client", "k")]).await.status,
        StatusCode::OK
    );
    assert_eq!(
        get(&c, &s.admin_url("/readyz"), &[]).await.status,
        StatusCode::OK
    );
    // Without it, sluice refuses to start under reject (every call fails).
    let path = support::write_config(&cfg);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("NOAUTH"),
        "{out:?}"
    );
}

/// A store that answers the background check and fails every admission
/// (a Redis ACL user without EVAL and EVALSHA): under `reject`, `/readyz`
/// stays 503 while requests keep failing, across the 5 s checks. A good
/// check that began before the last failure does not count (it made the
/// instance ready for about a second after each check).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_answers_checks_but_fails_admissions_stays_unready() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    redis.cli(&[
        "ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-eval", "-evalsha",
    ]);
    let url = redis.url().replace("redis://", "redis://limited:pw@");
    let s = Sluice::start(&config(ds.addr, &url, "reject", 1, "150ms"));
    let c = client();
    let started = Instant::now();
    let mut samples = 0;
    // Past two background checks (every 5 s).
    while started.elapsed() < Duration::from_secs(11) {
        let a = get(&c, &s.url("/a"), &[("x-client", "k")]).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        if started.elapsed() > Duration::from_millis(1_500) {
            let ready = get(&c, &s.admin_url("/readyz"), &[]).await;
            assert_eq!(
                ready.status,
                StatusCode::SERVICE_UNAVAILABLE,
                "ready {:?} after the start while every admission fails",
                started.elapsed()
            );
            samples += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(samples > 50, "{samples} samples");
    assert!(ds.seen().is_empty());
}

/// A Redis password given in the URL (the one place it can be) is never
/// shown: not in the log, not in /status, whatever the store's trouble.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_password_is_never_logged_or_shown() {
    let ds = Downstream::start().await;
    let s = Sluice::start(&config(
        ds.addr,
        "redis://:TOPSECRET@127.0.0.1:1",
        "local",
        2,
        "200ms",
    ));
    let c = client();
    get(&c, &s.url("/a"), &[("x-client", "k")]).await;
    let status = s.status().await.to_string();
    assert!(
        status.contains("cannot reach redis://:***@127.0.0.1:1"),
        "{status}"
    );
    assert!(!status.contains("TOPSECRET"), "{status}");
    let log = s.log().join("\n");
    assert!(log.contains("cannot reach"), "{log}");
    assert!(!log.contains("TOPSECRET"), "{log}");
}

/// A redis-server that speaks only TLS (its plain port off), with a
/// certificate for 127.0.0.1 from `ca`. Ended by PID when dropped.
struct TlsRedis {
    child: std::process::Child,
    port: u16,
    _files: (support::TempFile, support::TempFile),
}

impl TlsRedis {
    fn start(ca: &support::TestCa) -> TlsRedis {
        let (cert, key) = ca.leaf_files(&["127.0.0.1"]);
        let port = support::closed_port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", "0", "--tls-port", &port.to_string()])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .arg("--tls-cert-file")
            .arg(&*cert)
            .arg("--tls-key-file")
            .arg(&*key)
            .args(["--tls-auth-clients", "no"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server is needed (bash .ci/run installs it)");
        let r = TlsRedis {
            child,
            port,
            _files: (cert, key),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < deadline,
                "redis-server (TLS) did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        r
    }
}

impl Drop for TlsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Redis over TLS (`rediss://`, a private CA in `cluster.ca_file`): two
/// instances share one schedule through it, the seed example as over
/// plain TCP. With `on_failure = "reject"`, a store sluice could not
/// reach would answer 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_share_a_schedule_through_redis_over_tls() {
    let ca = support::TestCa::new();
    let redis = TlsRedis::start(&ca);
    let ca_file = ca.write();
    let ds = Downstream::start().await;
    let toml = config(
        ds.addr,
        &format!("rediss://127.0.0.1:{}", redis.port),
        "reject",
        2,
        "1s",
    )
    .replace(
        "[cluster]\n",
        &format!("[cluster]\nca_file = \"{}\"\n", ca_file.display()),
    );
    let fleet = [Sluice::start(&toml), Sluice::start(&toml)];
    seed_burst_across(&fleet, &ds).await;
    for s in &fleet {
        let ready = get(&client(), &s.admin_url("/readyz"), &[]).await;
        assert_eq!(ready.status, StatusCode::OK);
        // The schedule is the store's: one instance cannot answer for it.
        let bucket = get(&client(), &s.admin_url("/buckets/default/one"), &[]).await;
        assert_eq!(bucket.status, StatusCode::NOT_IMPLEMENTED);
    }
}

/// `on_failure = "allow"` (README: "or "allow" (forward unshaped)"; "While
/// the store fails, /readyz answers 503 only with on_failure = "reject""):
/// with the Redis store stopped (SIGSTOP), a burst of 15 from one client
/// (r = 5/s, b = 10) is forwarded whole, unpaced, each within the store
/// timeout plus slack, and /readyz stays 200; the fallback is counted
/// under policy "allow"; after SIGCONT a fresh client is shaped through
/// the store again. What a bug gives: shaped (as "local" would) 4 of the 15
/// get 429 and the 11 others reach the downstream over 2 s (the bound is
/// 1.2 s); "reject" would answer 503 and make /readyz 503; a fallback
/// stuck on after recovery would forward the fresh client's second
/// request at once (the bound is 150 ms of a 200 ms interval).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_forwards_unshaped_while_the_store_is_stopped() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let s = Sluice::start(&config(ds.addr, &redis.url(), "allow", 1, "150ms"));
    let c = client();
    assert_eq!(
        get(&c, &s.url("/before"), &[("x-client", "k")])
            .await
            .status,
        StatusCode::OK
    );
    redis.signal("STOP");
    let sent = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..15 {
        let (c, url) = (c.clone(), s.url(&format!("/stopped/{i}")));
        tasks.push(tokio::spawn(async move {
            get(&c, &url, &[("x-client", "k")]).await
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let a = t.await.unwrap();
        assert_eq!(a.status, StatusCode::OK, "request {i}");
    }
    let took = sent.elapsed();
    let arrivals = ds.arrivals("/stopped/");
    assert_eq!(arrivals.len(), 15);
    let spread = *arrivals.iter().max().unwrap() - *arrivals.iter().min().unwrap();
    assert!(
        spread < Duration::from_millis(1_200),
        "the burst reached the downstream over {spread:?} (paced: 2 s); answered in {took:?}"
    );
    let ready = get(&c, &s.admin_url("/readyz"), &[]).await;
    assert_eq!(
        ready.status,
        StatusCode::OK,
        "{}",
        String::from_utf8_lossy(&ready.body)
    );
    let (fallbacks, metrics) = fallbacks(&s, "allow").await;
    assert!(fallbacks.is_some_and(|n| n >= 15.0), "{metrics}");

    redis.signal("CONT");
    let deadline = Instant::now() + Duration::from_secs(15);
    while s.status().await["cluster"]["state"] != "ok" {
        assert!(Instant::now() < deadline, "the store did not come back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Shaped again: a fresh client's second request waits its 200 ms.
    let first = get(&c, &s.url("/after/1"), &[("x-client", "fresh")]).await;
    assert_eq!(first.status, StatusCode::OK);
    let second = get(&c, &s.url("/after/2"), &[("x-client", "fresh")]).await;
    assert_eq!(second.status, StatusCode::OK);
    let seen = ds.seen();
    let at = |p: &str| seen.iter().find(|r| r.path == p).unwrap().at;
    let apart = at("/after/2") - at("/after/1");
    assert!(
        apart >= Duration::from_millis(150),
        "after recovery the second request went {apart:?} after the first"
    );
}

/// Hold every Redis client's commands for `ms` (`CLIENT PAUSE`): calls
/// sent meanwhile run when it ends.
fn pause_redis(redis: &RedisServer, ms: u32) {
    let ms = ms.to_string();
    let port = redis.port.to_string();
    let paused = std::process::Command::new("redis-cli")
        .args(["-p", &port, "CLIENT", "PAUSE", &ms, "ALL"])
        .output()
        .unwrap();
    assert!(paused.status.success(), "{paused:?}");
}

/// Redis paused for `pause_ms` while three requests of one client (1/m)
/// are asked about: they go on under `on_failure = "allow"`; once the
/// pause is over (and `settle_ms` more), the same client's next request is
/// decided by Redis and goes at once, not held for the reservations nobody
/// takes (each but the last was behind a later one when it was given
/// back: only the last went back until holes were kept).
async fn a_late_call_leaves_no_reservation(pause_ms: u32, settle_ms: u64) {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let cfg =
        config(ds.addr, &url, "allow", 1, "300ms").replace("rate = \"5/s\"", "rate = \"1/m\"");
    let s = Sluice::start(&cfg);
    let c = client();
    // The scripts are loaded (a first call), and Redis's clock seen.
    let warm = get(&c, &s.url("/warm"), &[("x-client", "warm")]).await;
    assert_eq!(warm.status, StatusCode::OK);
    pause_redis(&redis, pause_ms);
    all_answered_together(&s, "k", 3).await;
    let (allowed, m) = fallbacks(&s, "allow").await;
    assert_eq!(
        allowed,
        Some(3.0),
        "the three went on under on_failure: {m}"
    );
    assert!(
        m.contains("sluice_cluster_calls_total{backend=\"redis\",result=\"ok\"} 1\n"),
        "the warm-up was decided by Redis: {m}"
    );
    tokio::time::sleep(Duration::from_millis(u64::from(pause_ms) + settle_ms)).await;
    let t = Instant::now();
    let next = tokio::time::timeout(
        Duration::from_secs(10),
        get(&c, &s.url("/next"), &[("x-client", "k")]),
    )
    .await
    .expect("the next was held for the reservations nobody took");
    assert_eq!(next.status, StatusCode::OK);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    let (allowed, m) = fallbacks(&s, "allow").await;
    assert_eq!(allowed, Some(3.0), "the next was decided by Redis: {m}");
}

/// A reservation the store makes after sluice gave up on the call (Redis
/// paused 1 s, past the 300 ms timeout, well within the 2 s the call
/// itself may run on) is given back once its answer comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_made_after_the_timeout_is_given_back() {
    a_late_call_leaves_no_reservation(1_000, 2_000).await;
}

/// With `on_failure = "local"`, requests that fell back after a slow store
/// (Redis held past the 300 ms timeout) are admitted as they fall back,
/// not at their arrival: two of one client sent 100 ms apart reach the
/// upstream a whole interval (500 ms at 2/s) apart, not 200 ms.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_fall_back_are_paced_from_when_they_do() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let cfg =
        config(ds.addr, &url, "local", 1, "300ms").replace("rate = \"5/s\"", "rate = \"2/s\"");
    let s = Sluice::start(&cfg);
    let c = client();
    let warm = get(&c, &s.url("/warm"), &[("x-client", "warm")]).await;
    assert_eq!(warm.status, StatusCode::OK);
    pause_redis(&redis, 3_000);
    let mut calls = Vec::new();
    for path in ["/a", "/b"] {
        let (c, url) = (c.clone(), s.url(path));
        calls.push(tokio::spawn(async move {
            get(&c, &url, &[("x-client", "k")]).await
        }));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for call in calls {
        assert_eq!(call.await.unwrap().status, StatusCode::OK);
    }
    let (fell_back, m) = fallbacks(&s, "local").await;
    assert_eq!(fell_back, Some(2.0), "both fell back: {m}");
    let seen = ds.seen();
    let at: Vec<Instant> = seen
        .iter()
        .filter(|x| x.path == "/a" || x.path == "/b")
        .map(|x| x.at)
        .collect();
    assert_eq!(at.len(), 2);
    let gap = at[1].max(at[0]) - at[1].min(at[0]);
    // 500 ms expected; 200 ms when admitted at their arrivals.
    assert!(gap >= Duration::from_millis(400), "{gap:?} apart");
}

/// Two instances with different caps for one upstream (a rolling reload
/// from 10/s to 5/s): each keeps its own calendar. They shared one, whose
/// slot numbers each read at its own scale, and the 10/s instance trimmed
/// every slot of the 5/s one as past, so the 5/s instance's next clients
/// went together with those already held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_with_different_caps_keep_their_own_calendars() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let capped = |cap: &str| {
        config(ds.addr, &redis.url(), "reject", 2, "500ms")
            .replace("url = ", &format!("rate = \"{cap}\"\nurl = "))
            .replace(
                "rate = \"5/s\"\ncapacity = 10",
                "rate = \"100/s\"\ncapacity = 10",
            )
    };
    let (a, b) = (
        Sluice::start(&capped("10/s")),
        Sluice::start(&capped("5/s")),
    );
    let send_b = |range: std::ops::Range<u32>| {
        range
            .map(|i| {
                let url = b.url(&format!("/b/{i}"));
                tokio::spawn(async move {
                    let who = format!("b{i}");
                    get(&client(), &url, &[("x-client", who.as_str())]).await
                })
            })
            .collect::<Vec<_>>()
    };
    let mut held = send_b(0..4);
    // Held for their slots. The calendar's slots lie on a fixed grid: the
    // first to go may leave the next slot's start a few milliseconds
    // away, and one admitted after that start goes at once (so three are
    // not always seen queued); two are, for a slot's length at least.
    b.wait_queued_at_least(2).await;
    // A's call, on its own scale, trims what it takes for past slots.
    assert_eq!(
        get(&client(), &a.url("/a"), &[("x-client", "a")])
            .await
            .status,
        StatusCode::OK
    );
    held.extend(send_b(4..8));
    for h in held {
        assert_eq!(h.await.unwrap().status, StatusCode::OK);
    }
    let mut at = ds.arrivals("/b/");
    at.sort_unstable();
    assert_eq!(at.len(), 8);
    // 200 ms apart (5/s): 1.4 s from the first to the last (a release
    // may be late, none early). The second four went beside the first
    // four: about 0.6 s.
    let span = at[7] - at[0];
    assert!(span >= Duration::from_millis(1_100), "{span:?}");
}

/// A call Redis runs only after sluice stopped waiting for its answer
/// too (Redis paused 4 s, past the 2 s a call may run on) reserves
/// nothing: its deadline has passed on Redis's clock. The reservation it
/// made could never be given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_redis_runs_after_sluice_gave_up_reserves_nothing() {
    a_late_call_leaves_no_reservation(4_000, 1_000).await;
}

/// One stall is not an outage: Redis held past the timeout fails the
/// eight calls in flight together; under `on_failure = "reject"` each
/// request gets its 503, and `/readyz` stays 200. Calls failing in a row
/// for a second make it 503, as the store is down. One slow call made the
/// instance unready until the next succeeded, and counting calls alone
/// made one stall under traffic do the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_stall_does_not_make_the_instance_unready() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let s = Sluice::start(&config(ds.addr, &url, "reject", 1, "150ms"));
    let c = client();
    let warm = get(&c, &s.url("/warm"), &[("x-client", "warm")]).await;
    assert_eq!(warm.status, StatusCode::OK);
    pause_redis(&redis, 5_000);
    let ready = |c: &support::HttpClient| {
        let (c, url) = (c.clone(), s.admin_url("/readyz"));
        async move { get(&c, &url, &[]).await.status }
    };
    let statuses = together(&s, 8, |i| format!("/{i}"), |i| format!("k{i}")).await;
    assert_eq!(statuses, vec![StatusCode::SERVICE_UNAVAILABLE; 8]);
    // Every failure was counted before its answer.
    let failed = Instant::now();
    assert_eq!(
        ready(&c).await,
        StatusCode::OK,
        "after eight calls failed together"
    );
    // The store stays silent: a second of calls failing in a row is down.
    let mut n = 0;
    while failed.elapsed() < Duration::from_millis(1_200) {
        let a = get(&c, &s.url(&format!("/more/{n}")), &[("x-client", "k")]).await;
        assert_eq!(a.status, StatusCode::SERVICE_UNAVAILABLE);
        n += 1;
    }
    assert_eq!(
        ready(&c).await,
        StatusCode::SERVICE_UNAVAILABLE,
        "after {n} more failed calls"
    );
}

/// A Redis out of memory (`maxmemory` under `noeviction`) refuses every
/// script and still answers INFO: the background check writes, so the
/// instance is unready (under "reject") with no traffic to notice it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_refuses_writes_makes_the_instance_unready() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let s = Sluice::start(&config(ds.addr, &redis.url(), "reject", 1, "500ms"));
    unready_while_writes_are_refused(
        &s,
        || assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "1"]), "OK"),
        || assert_eq!(redis.cli(&["CONFIG", "SET", "maxmemory", "0"]), "OK"),
    )
    .await;
    let status = s.status().await;
    assert_eq!(status["cluster"]["state"], "ok", "{status}");
}

/// A client flooding one instance is refused from the store's last
/// refusal until a place may have freed, not with a Redis call per 429.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_client_costs_no_redis_call_per_refusal() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = one_instance(ds.addr, &redis.url(), "rate = \"1/s\"\ncapacity = 1");
    let s = Sluice::start(&cfg);
    a_flood_is_refused_from_memory(&s).await;
}

/// The same under `max_wait` (a queue long enough never to fill): a
/// departure past it is refused from memory too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_flooding_past_max_wait_costs_no_redis_call_per_refusal() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = one_instance(
        ds.addr,
        &redis.url(),
        "rate = \"1/s\"\ncapacity = 1000\nmax_wait = \"1s\"",
    );
    let s = Sluice::start(&cfg);
    a_flood_is_refused_from_memory(&s).await;
}

/// A refusal remembered for a client is forgotten when one of its held
/// requests leaves (its place is given back): the client's next request
/// asks the store again instead of being refused from memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_place_given_back_forgets_the_remembered_refusal() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = one_instance(ds.addr, &redis.url(), "rate = \"1/m\"\ncapacity = 1");
    let s = Sluice::start(&cfg);
    let c = client();
    let a = |p: &str| {
        let (c, url) = (c.clone(), s.url(p));
        async move { get(&c, &url, &[("x-client", "a")]).await }
    };
    assert_eq!(a("/first").await.status, StatusCode::OK);
    let held = tokio::spawn(a("/held"));
    s.wait_queued(1).await;
    let remembered = "sluice_cluster_remembered_refusals_total";
    // Refused by the store (remembered for a second from before this).
    let refused_at = Instant::now();
    let refused = a("/refused").await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    let first = s.metric(remembered).await;
    let again = a("/again").await;
    assert_eq!(again.status, StatusCode::TOO_MANY_REQUESTS);
    // The store's Retry-After (about a minute), from memory too.
    let retry = |a: &support::Answer| a.headers["retry-after"].to_str().unwrap().to_owned();
    let (first_retry, retry_again) = (retry(&refused), retry(&again));
    let (first_retry, retry_again): (u64, u64) =
        (first_retry.parse().unwrap(), retry_again.parse().unwrap());
    assert!(
        (58..=60).contains(&first_retry) && (10..=first_retry).contains(&retry_again),
        "{refused:?} {again:?}"
    );
    let before = s.metric(remembered).await;
    // Answered within the second the refusal is remembered for: from it.
    if again.at < refused_at + Duration::from_secs(1) {
        assert_eq!(before, first + 1.0, "refused without a call");
    }
    held.abort();
    s.wait_queued(0).await;
    let sent = Instant::now();
    // Held for its departure in a minute (or refused, if the store has
    // not yet taken the give-back): either way, asked of the store.
    let next = tokio::time::timeout(Duration::from_millis(300), a("/next")).await;
    if let Ok(answer) = &next {
        assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    }
    // Past the second, the refusal would have lapsed anyway: the check
    // shows nothing then (a slow machine), but cannot fail for it.
    if sent < refused_at + Duration::from_millis(900) {
        assert_eq!(s.metric(remembered).await, before);
    }
}

/// RateLimit headers are not sent in cluster mode (README): the schedule is
/// the store's, and this instance's own view told every client its whole
/// budget was left, on the 429s too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_ratelimit_headers_in_cluster_mode() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cfg = one_instance(
        ds.addr,
        &redis.url(),
        "rate = \"1/h\"\ncapacity = 0\nratelimit_headers = true",
    );
    let s = Sluice::start(&cfg);
    let c = client();
    let mut statuses = Vec::new();
    for _ in 0..2 {
        let a = get(&c, &s.url("/r"), &[("x-client", "k")]).await;
        statuses.push(a.status);
        for name in ["ratelimit", "ratelimit-policy"] {
            assert!(
                a.headers.get(name).is_none(),
                "{name} on a {}: {:?}",
                a.status,
                a.headers
            );
        }
    }
    assert_eq!(
        statuses,
        [StatusCode::OK, StatusCode::TOO_MANY_REQUESTS],
        "the route must answer both ways"
    );
}
