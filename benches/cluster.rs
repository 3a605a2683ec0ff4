//! Cluster mode cost: admissions per second through one local Redis, and
//! the latency one admission adds compared with the local engine.
//!
//! Starts its own `redis-server` on a free loopback port (ended by PID at
//! the end). Run: `cargo bench --bench cluster`

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::cluster::{Ask, Cluster};
use sluice::config::{ClusterConfig, OnFailure};
use sluice::pacer::Shaper;
use sluice::shaper::{Limits, Policy, Rate};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(6399)
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted
        .get(((sorted.len().saturating_sub(1)) as f64 * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

fn ask(cluster: &Cluster, key: u64) -> Ask {
    let (k, global) = cluster.keys("bench", &key.to_be_bytes(), None);
    Ask {
        key: k,
        global,
        step_us: 1_000,
        capacity: 1_000_000,
        cost: 1,
        tau_us: 0,
        global_step_us: 0,
        max_wait_us: 0,
    }
}

fn main() {
    let port = free_port();
    let mut redis = match Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(Stdio::null())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot start redis-server ({e}); install it (apt-get install redis-server)");
            std::process::exit(1);
        }
    };
    std::thread::sleep(Duration::from_millis(300));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let cfg = ClusterConfig {
        redis: format!("redis://127.0.0.1:{port}"),
        key_prefix: "bench:".into(),
        timeout: Duration::from_secs(1),
        on_failure: OnFailure::Reject,
        instances: 1,
    };
    rt.block_on(async {
        let cluster = Arc::new(Cluster::new(&cfg).expect("cluster"));
        // Warm up (loads the script).
        for k in 0..100 {
            let _ = cluster.admit(ask(&cluster, k)).await;
        }
        // Latency: one admission at a time, distinct idle clients.
        let mut lat = Vec::new();
        for k in 0..5_000u64 {
            let t = Instant::now();
            if cluster.admit(ask(&cluster, 1_000_000 + k)).await.is_ok() {
                lat.push(t.elapsed());
            }
        }
        lat.sort();
        // Throughput: 64 concurrent admitters for 3 s.
        let until = Instant::now() + Duration::from_secs(3);
        let mut tasks = Vec::new();
        for w in 0..64u64 {
            let cluster = cluster.clone();
            tasks.push(tokio::spawn(async move {
                let mut n = 0u64;
                let mut k = w << 32;
                while Instant::now() < until {
                    if cluster.admit(ask(&cluster, k)).await.is_ok() {
                        n += 1;
                    }
                    k += 1;
                }
                n
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap_or(0);
        }

        // Local mode: the same admission through the in-process shaper.
        let shaper: Shaper<u64> = Shaper::start(Limits {
            max_clients: 10_000_000,
            max_queued: 1_000_000,
        })
        .expect("pacer");
        let up = shaper.add_upstream(None);
        let route = shaper.add_route(Policy::new(Rate::per_second(1_000.0).expect("rate"), 1_000_000), up);
        let mut local = Vec::new();
        for k in 0..100_000u64 {
            let t = Instant::now();
            let _ = shaper.admit(route, k, 1);
            local.push(t.elapsed());
        }
        local.sort();

        println!("| mode | p50 admission | p99 admission | admissions/s |");
        println!("|---|---|---|---|");
        println!(
            "| cluster (1 Redis on loopback, 1 at a time) | {:.1} µs | {:.1} µs | {:.0} (64 concurrent, 3 s) |",
            pct(&lat, 0.5).as_secs_f64() * 1e6,
            pct(&lat, 0.99).as_secs_f64() * 1e6,
            total as f64 / 3.0
        );
        println!(
            "| local engine | {:.2} µs | {:.2} µs | n/a (in-process) |",
            pct(&local, 0.5).as_secs_f64() * 1e6,
            pct(&local, 0.99).as_secs_f64() * 1e6,
        );
        println!(
            "added latency per request, cluster vs local (p50): {:.1} µs",
            (pct(&lat, 0.5).saturating_sub(pct(&local, 0.5))).as_secs_f64() * 1e6
        );
    });
    let _ = redis.kill();
    let _ = redis.wait();
}
