//! Pacer precision and idle cost, measured in real time.
//!
//! For each scenario every client gets a full queue at once, then the time
//! each waiter wakes (in a tokio runtime, as a proxy task would) is
//! recorded; the deviation of each client's consecutive intervals from
//! 1/r is reported as p50/p99/max. Then 100,000 idle clients are created
//! and the process CPU time over an idle stretch is reported.
//!
//! Run: `cargo bench --bench pacer`

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice::pacer::{Admitted, Shaper};
use sluice::shaper::{Limits, Policy, Rate};

fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}

fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks = f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    Duration::from_millis(ticks * 10)
}

/// What one scenario measured.
struct Report {
    /// |interval - 1/r| per client, at the waiting task, nanoseconds.
    waiter: Vec<u64>,
    /// Pacer release lag (actual - scheduled), nanoseconds.
    lag: Vec<u64>,
    wall: Duration,
    cpu: Duration,
}

/// `clients` clients at `aggregate / clients` each, `per_client` requests
/// each, the clients' phases spread evenly over one interval (as
/// independent clients are), admitted from a plain thread; the waiters are
/// tokio tasks, as proxy requests are.
fn precision(
    rt: &tokio::runtime::Runtime,
    aggregate: f64,
    clients: u32,
    per_client: u32,
) -> Report {
    let shaper: Shaper<u32> = Shaper::start(Limits {
        max_clients: 1_000_000,
        max_queued: 1_000_000,
    })
    .expect("pacer");
    let lags = Arc::new(Mutex::new(Vec::new()));
    let sink = lags.clone();
    shaper.observe_lag(Box::new(move |d| {
        if let Ok(mut v) = sink.lock() {
            v.push(d.as_nanos() as u64);
        }
    }));
    let rate = Rate::per_second(aggregate / f64::from(clients)).expect("rate");
    let up = shaper.add_upstream(None);
    let route = shaper.add_route(Policy::new(rate, per_client), up);
    let interval = rate.interval_nanos() as i64;
    let phase = Duration::from_secs_f64(1.0 / aggregate);
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let admitter = shaper.clone();
    let feeder = std::thread::spawn(move || {
        let start = Instant::now();
        for k in 0..clients {
            // Phases only need to be spread, not exact: sleep (never spin,
            // which would steal one of the cores the measurement runs on).
            let at = start + phase * k;
            let now = Instant::now();
            if at > now + Duration::from_micros(500) {
                std::thread::sleep(at - now);
            }
            for _ in 0..per_client {
                match admitter.admit(route, k, 1) {
                    Ok(Admitted::Now) => {
                        let _ = tx.send((k, None, Instant::now()));
                    }
                    Ok(Admitted::Wait(w)) => {
                        let _ = tx.send((k, Some(w), Instant::now()));
                    }
                    Err(_) => {}
                }
            }
        }
    });
    let waiter = rt.block_on(async {
        let mut tasks = Vec::new();
        while let Some((k, waiting, at)) = rx.recv().await {
            tasks.push(tokio::spawn(async move {
                match waiting {
                    None => Some((k, at)),
                    Some(w) => w.departed().await.ok().map(|()| (k, Instant::now())),
                }
            }));
        }
        let mut per: Vec<Vec<Instant>> = vec![Vec::new(); clients as usize];
        for t in tasks {
            if let Ok(Some((k, at))) = t.await {
                per[k as usize].push(at);
            }
        }
        let mut dev = Vec::new();
        for times in &mut per {
            times.sort();
            // Skip the first interval: it includes the set-up of the flood.
            for w in times.windows(2).skip(1) {
                let gap = (w[1] - w[0]).as_nanos() as i64;
                dev.push((gap - interval).unsigned_abs());
            }
        }
        dev.sort_unstable();
        dev
    });
    let _ = feeder.join();
    let mut lag = lags.lock().map(|v| v.clone()).unwrap_or_default();
    lag.sort_unstable();
    Report {
        waiter,
        lag,
        wall: t0.elapsed(),
        cpu: cpu_time() - cpu0,
    }
}

fn us(ns: u64) -> String {
    format!("{:.1} µs", ns as f64 / 1e3)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    println!(
        "| scenario | intervals | waiter p50 / p99 / max |interval - 1/r| | pacer release lag p50 / p99 / max | wall | CPU |"
    );
    println!("|---|---|---|---|---|---|");
    for (label, aggregate, clients, per_client) in [
        ("1 client, r = 100/s", 100.0, 1, 300),
        ("1 client, r = 1,000/s", 1_000.0, 1, 3_000),
        ("1 client, r = 10,000/s", 10_000.0, 1, 30_000),
        ("1,000 clients, 1,000/s aggregate", 1_000.0, 1_000, 4),
        ("1,000 clients, 10,000/s aggregate", 10_000.0, 1_000, 31),
        (
            "1,000 clients x 100 queued (100,000 at once), 10,000/s aggregate",
            10_000.0,
            1_000,
            100,
        ),
    ] {
        let r = precision(&rt, aggregate, clients, per_client);
        println!(
            "| {label} | {} | {} / {} / {} | {} / {} / {} | {:.2} s | {:.2} s |",
            r.waiter.len(),
            us(percentile(&r.waiter, 0.50)),
            us(percentile(&r.waiter, 0.99)),
            us(r.waiter.last().copied().unwrap_or(0)),
            us(percentile(&r.lag, 0.50)),
            us(percentile(&r.lag, 0.99)),
            us(r.lag.last().copied().unwrap_or(0)),
            r.wall.as_secs_f64(),
            r.cpu.as_secs_f64(),
        );
    }

    // 100,000 idle clients: each sent one request at a slow rate, so each
    // holds state (its next slot is an hour away) but nothing is due.
    let shaper: Shaper<u32> = Shaper::start(Limits {
        max_clients: 1_000_000,
        max_queued: 1_000_000,
    })
    .expect("pacer");
    let up = shaper.add_upstream(None);
    let route = shaper.add_route(Policy::new("1/h".parse::<Rate>().expect("rate"), 10), up);
    for k in 0..100_000u32 {
        let _ = shaper.admit(route, k, 1);
    }
    std::thread::sleep(Duration::from_millis(200));
    let cpu0 = cpu_time();
    std::thread::sleep(Duration::from_secs(5));
    let idle_cpu = cpu_time() - cpu0;
    println!();
    println!(
        "pacer CPU with {} idle clients held: {:.3} s over 5 s",
        shaper.stats().0,
        idle_cpu.as_secs_f64()
    );
}
