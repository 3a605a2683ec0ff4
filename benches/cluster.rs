//! Cluster mode cost, every store side by side in one run: admissions per
//! second and the latency one admission adds, through one standalone Redis,
//! a three-master Redis Cluster and one PostgreSQL, beside the local
//! engine.
//!
//! Starts its own `redis-server` processes and a PostgreSQL server (the
//! test harness's: a temp data directory, a non-root user) on free
//! loopback ports, ended by PID at the end. Run: `cargo bench --bench cluster`

#[path = "../tests/support/mod.rs"]
mod support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice::cluster::{Ask, Cluster};
use sluice::config::{ClusterConfig, OnFailure, PostgresConfig, RedisMode, Store};
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
    let (k, slots) = cluster.keys("bench", &key.to_be_bytes(), None);
    Ask {
        key: k,
        slots,
        step_us: 1_000,
        capacity: 1_000_000,
        cost: 1,
        tau_us: 0,
        slot_us: 0,
        max_wait_us: 0,
    }
}

/// Redis servers started for the run, ended by PID on drop.
struct Servers(Vec<Child>, Option<PathBuf>);

impl Drop for Servers {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(d) = &self.1 {
            let _ = std::fs::remove_dir_all(d);
        }
    }
}

fn redis_server(port: u16, cluster_dir: Option<&PathBuf>) -> Child {
    let mut cmd = Command::new("redis-server");
    cmd.args([
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]);
    if let Some(dir) = cluster_dir {
        cmd.args(["--cluster-enabled", "yes", "--cluster-config-file"])
            .arg(format!("nodes-{port}.conf"))
            .arg("--dir")
            .arg(dir);
    }
    match cmd.stdout(Stdio::null()).spawn() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("cannot start redis-server ({e}); install it (apt-get install redis-server)");
            std::process::exit(1);
        }
    }
}

fn cli_ok(port: u16, args: &[&str], want: &str) -> bool {
    Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(want))
}

fn wait(port: u16, args: &[&str], want: &str) {
    let until = Instant::now() + Duration::from_secs(30);
    while !cli_ok(port, args, want) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn config(store: Store) -> ClusterConfig {
    ClusterConfig {
        store,
        key_prefix: "bench:".into(),
        timeout: Duration::from_secs(1),
        on_failure: OnFailure::Reject,
        instances: 1,
    }
}

/// (p50, p99 of one admission at a time; admissions/s with 64 at once).
async fn measure(cluster: Arc<Cluster>) -> (Duration, Duration, f64) {
    // Warm up (loads the script on each master).
    for k in 0..300 {
        let _ = cluster.admit(ask(&cluster, k)).await;
    }
    let mut lat = Vec::new();
    for k in 0..5_000u64 {
        let t = Instant::now();
        if cluster.admit(ask(&cluster, 1_000_000 + k)).await.is_ok() {
            lat.push(t.elapsed());
        }
    }
    lat.sort();
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
    (pct(&lat, 0.5), pct(&lat, 0.99), total as f64 / 3.0)
}

/// Connections to PostgreSQL (sluice's default pool size).
const PG_POOL: usize = 8;

fn main() {
    let pg = support::postgres::PostgresServer::start();
    let pg_version = format!(
        "one PostgreSQL {}",
        pg.psql("SHOW server_version")
            .split(' ')
            .next()
            .unwrap_or("?")
    );
    let single = free_port();
    let ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
    let dir = std::env::temp_dir().join(format!("sluice-bench-cluster-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let mut children = vec![redis_server(single, None)];
    children.extend(ports.iter().map(|&p| redis_server(p, Some(&dir))));
    let _servers = Servers(children, Some(dir));
    wait(single, &["PING"], "PONG");
    for &p in &ports {
        wait(p, &["PING"], "PONG");
    }
    let nodes: Vec<String> = ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
    let created = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&nodes)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdout(Stdio::null())
        .status();
    if !created.is_ok_and(|s| s.success()) {
        eprintln!("redis-cli --cluster create failed");
        std::process::exit(1);
    }
    for &p in &ports {
        wait(p, &["CLUSTER", "INFO"], "cluster_state:ok");
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let standalone = Arc::new(
            Cluster::new(&config(Store::Redis {
                nodes: vec![format!("redis://127.0.0.1:{single}")],
                mode: RedisMode::Standalone,
                ca: None,
                password_file: None,
            }))
            .expect("standalone"),
        );
        standalone.check().await.expect("standalone redis");
        let cluster = Arc::new(
            Cluster::new(&config(Store::Redis {
                nodes: ports
                    .iter()
                    .map(|p| format!("redis://127.0.0.1:{p}"))
                    .collect(),
                mode: RedisMode::Cluster,
                ca: None,
                password_file: None,
            }))
            .expect("cluster"),
        );
        cluster.check().await.expect("redis cluster");
        let target = sluice::config::postgres::parse(&pg.url()).expect("postgres url");
        let postgres = Arc::new(
            Cluster::new(&config(Store::Postgres(Box::new(PostgresConfig {
                target,
                roots: None,
                password_file: Some(pg.password_file.to_path_buf()),
                durable: false,
                pool_size: PG_POOL,
            }))))
            .expect("postgres"),
        );
        postgres.check().await.expect("postgres");
        let one = measure(standalone).await;
        let three = measure(cluster).await;
        let sql = measure(postgres).await;

        // The same admission through the in-process shaper.
        let shaper: Shaper<u64> = Shaper::start(Limits {
            max_clients: 10_000_000,
            max_queued: 1_000_000,
        })
        .expect("pacer");
        let up = shaper.add_upstream(None);
        let route = shaper.add_route(
            Policy::new(Rate::per_second(1_000.0).expect("rate"), 1_000_000),
            up,
        );
        let mut local = Vec::new();
        for k in 0..100_000u64 {
            let t = Instant::now();
            let _ = shaper.admit(route, k, 1);
            local.push(t.elapsed());
        }
        local.sort();

        let us = |d: Duration| d.as_secs_f64() * 1e6;
        println!("| store | p50 admission | p99 admission | admissions/s (64 at once, 3 s) |");
        println!("|---|---|---|---|");
        for (name, (p50, p99, rate)) in [
            ("one Redis 7.0 (standalone)", one),
            ("Redis Cluster, 3 masters", three),
            (
                &format!("{pg_version}, unlogged table, {PG_POOL} connections"),
                sql,
            ),
        ] {
            println!(
                "| {name} | {:.1} µs | {:.1} µs | {rate:.0} |",
                us(p50),
                us(p99)
            );
        }
        println!(
            "| local engine (in-process) | {:.2} µs | {:.2} µs | n/a |",
            us(pct(&local, 0.5)),
            us(pct(&local, 0.99))
        );
    });
}
