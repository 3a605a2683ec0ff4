//! Watching a running instance: `sluice top` against a live sluice (its
//! plain, non-terminal output parsed), and the Grafana dashboard and alert
//! rules in contrib/ checked against the metrics a live sluice exports.

mod support;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{Downstream, RedisServer, Sluice, TempFile, client, get};

fn config(downstream: std::net::SocketAddr, extra: &str) -> String {
    format!(
        r#"
[server]
listen = ["127.0.0.1:0"]

[admin]
listen = "127.0.0.1:0"
{extra}
[[upstream]]
name = "api"
url = "http://{downstream}"
on_throttle = "pause"

[[route]]
name = "api"
upstream = "api"
key = "global"
rate = "5/s"
capacity = 5
"#
    )
}

/// One `route=` line of `sluice top`'s plain output, parsed.
#[derive(Debug)]
struct RouteLine {
    input: f64,
    output: f64,
    refused: f64,
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn per_second(line: &str, key: &str) -> f64 {
    field(line, key)
        .and_then(|v| v.strip_suffix("/s"))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}=N/s in {line:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_shows_a_running_instance_as_plain_lines() {
    let ds = Downstream::start().await;
    let sluice = Sluice::start(&config(ds.addr, ""));
    let admin = sluice.admin.expect("admin address").to_string();
    let top = support::KillOnDrop::new(
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args([
                "top",
                "--admin",
                &admin,
                "--count",
                "4",
                "--interval",
                "500ms",
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start sluice top"),
    );
    // Bursts of 10 every 250 ms while top watches (bounded: at most 10 s):
    // each one fills the queue of 5 (refusals) while it drains at 5/s.
    let http = client();
    let url = sluice.url("/x");
    let load = tokio::spawn(async move {
        let end = Instant::now() + Duration::from_secs(10);
        let mut tasks = Vec::new();
        while Instant::now() < end {
            for _ in 0..10 {
                let (http, url) = (http.clone(), url.clone());
                tasks.push(tokio::spawn(
                    async move { get(&http, &url, &[]).await.status },
                ));
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        tasks
    });
    let out = tokio::task::spawn_blocking(move || top.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    load.abort();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "sluice top failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !stdout.contains('\x1b'),
        "escape codes off a terminal: {stdout}"
    );

    let instance: Vec<&str> = stdout.lines().filter(|l| l.contains(" clients=")).collect();
    assert_eq!(instance.len(), 4, "one instance line per update: {stdout}");
    for l in &instance {
        assert!(
            field(l, "queued").is_some_and(|q| q.parse::<u64>().is_ok()),
            "{l}"
        );
        assert!(field(l, "release_lag_p99<").is_some(), "{l}");
    }
    let routes: Vec<RouteLine> = stdout
        .lines()
        .filter(|l| l.contains(" route=api protocol=http rate=5/s "))
        .map(|l| RouteLine {
            input: per_second(l, "in"),
            output: per_second(l, "out"),
            refused: per_second(l, "refused"),
        })
        .collect();
    assert_eq!(routes.len(), 4, "one route line per update: {stdout}");
    // Over 2 s at 5/s with a full queue: forwarded near the rate (never far
    // above it), refusals, and arrivals as input: bursts of 10 every 250 ms
    // (40/s), where answers alone would show about 40/s only once every
    // request of an update's bursts were answered.
    let out_total: f64 = routes.iter().map(|r| r.output).sum();
    let refused_total: f64 = routes.iter().map(|r| r.refused).sum();
    assert!(out_total > 0.0, "{routes:?}");
    assert!(refused_total > 0.0, "{routes:?}");
    for r in &routes {
        assert!(r.output <= 5.0 * 2.0 + 2.0, "out far above r: {r:?}");
        // A refusal comes at its arrival (each figure is printed to 0.1/s,
        // rounded on its own).
        assert!(r.input + 0.15 >= r.refused, "{r:?}");
    }
    // Over the four updates (0.5 s each), answers are arrivals, give or
    // take what waited across the first and last (capacity 5, one in
    // flight): 6 requests, 12/s over one update.
    let input_total: f64 = routes.iter().map(|r| r.input).sum();
    assert!(
        input_total + 12.0 + 0.6 >= out_total + refused_total,
        "{routes:?}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.contains(" queue route=api key=") && field(l, "waiting").is_some()),
        "the deepest queue is listed: {stdout}"
    );
}

/// `top --count N` whose instance goes away after the first poll ends
/// with a failure (exit 1), not success: a script can tell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn top_fails_when_its_last_update_failed() {
    let ds = Downstream::start().await;
    let mut sluice = Sluice::start(&config(ds.addr, ""));
    let admin = sluice.admin.expect("admin address").to_string();
    let top = support::KillOnDrop::new(
        Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["top", "--admin", &admin, "--count", "1", "--interval", "3s"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start sluice top"),
    );
    // The first poll (the baseline) is made at once; the update 3 s later
    // finds nothing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    sluice.signal("KILL");
    let _ = sluice.wait_exit(Duration::from_secs(10));
    let out = tokio::task::spawn_blocking(move || top.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

#[test]
fn top_says_clearly_when_the_admin_listener_is_not_there() {
    let port = support::closed_port();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "top",
            "--admin",
            &format!("127.0.0.1:{port}"),
            "--count",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("sluice top: cannot read http://127.0.0.1:")
            && stderr.contains("is [admin] enabled"),
        "{stderr}"
    );
}

/// Every metric the dashboard's queries and the alert rules use is one a
/// running sluice exports (with a route, a pausable upstream and the shared
/// schedule on Redis), checked by contrib/check_metrics.py against a real
/// scrape; the dashboard is valid JSON whose panels all have queries; and
/// the rules pass `promtool check rules` where promtool is installed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alert_rules_use_only_exported_metrics() {
    let redis = RedisServer::start();
    let ds = Downstream::start().await;
    let cluster = format!(
        "\n[cluster]\nredis = \"{}\"\ntimeout = \"500ms\"\ninstances = 1\n",
        redis.url()
    );
    let sluice = Sluice::start(&config(ds.addr, &cluster));
    let http = client();
    // A forwarded request (queue wait, release lag, upstream duration, a
    // shared-schedule call).
    let a = get(&http, &sluice.url("/x"), &[]).await;
    assert_eq!(a.status, 200);
    let scrape = get(&http, &sluice.admin_url("/metrics"), &[]).await;
    assert_eq!(scrape.status, 200);
    let file = TempFile::new("scrape.txt", &scrape.body);

    let check = Command::new("python3")
        .arg("contrib/check_metrics.py")
        .arg(&file)
        .output()
        .expect("python3 runs contrib/check_metrics.py");
    assert!(
        check.status.success(),
        "metrics the dashboard or rules use but sluice does not export:\n{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    // The checker really reads the assets: it names the families they use.
    let list = Command::new("python3")
        .args(["contrib/check_metrics.py", "--list"])
        .output()
        .unwrap();
    let names = String::from_utf8_lossy(&list.stdout);
    for family in [
        "sluice_requests_total",
        "sluice_release_lag_seconds",
        "sluice_queued_requests_limit",
        "sluice_cluster_healthy",
        "sluice_config_reloads_total",
    ] {
        assert!(
            names.lines().any(|l| l == family),
            "{family} unused? {names}"
        );
    }

    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string("contrib/grafana/sluice-dashboard.json").unwrap(),
    )
    .expect("the dashboard is valid JSON");
    // Collapsed rows carry their panels inside.
    let panels: Vec<&serde_json::Value> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| std::iter::once(p).chain(p["panels"].as_array().into_iter().flatten()))
        .collect();
    let queries = panels
        .iter()
        .filter(|p| p["type"] != "row")
        .map(|p| {
            let targets = p["targets"].as_array().map_or(0, Vec::len);
            assert!(targets > 0, "panel {} has no query", p["title"]);
            targets
        })
        .sum::<usize>();
    assert!(queries >= 20, "{queries} queries");

    if let Ok(out) = Command::new("promtool")
        .args(["check", "rules", "contrib/prometheus/sluice-alerts.yml"])
        .output()
    {
        assert!(
            out.status.success(),
            "promtool check rules: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
