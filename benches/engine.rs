//! The admission decision (target <= 100 ns) with a fake clock, and the
//! memory one million client states take.
//!
//! Run: `cargo bench --bench engine`

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use sluice::shaper::{Engine, Limits, Policy, Rate};

const LIMITS: Limits = Limits {
    max_clients: 2_000_000,
    max_queued: 2_000_000,
};

fn engine(rate: &str, capacity: u32) -> (Engine<u64, u32>, sluice::shaper::RouteId) {
    let mut e = Engine::new(LIMITS);
    let up = e.add_upstream(None);
    let r = e.add_route(
        Policy::new(rate.parse::<Rate>().expect("rate"), capacity),
        up,
    );
    (e, r)
}

fn admission(c: &mut Criterion) {
    let mut g = c.benchmark_group("admit");

    // Idle clients passing at once: keys rotate over 100,000, time moves
    // 1 µs per decision, states expire 1 ms after their request.
    g.bench_function("depart_at_once", |b| {
        let (mut e, r) = engine("1000/s", 10);
        let (mut now, mut key) = (0u64, 0u64);
        b.iter(|| {
            now += 1_000;
            key = (key + 1) % 100_000;
            if key % 1_024 == 0 {
                e.expire(now);
            }
            black_box(e.admit(r, key, 1, now, || 0));
        });
    });

    // Requests that queue (admission only; releases happen untimed).
    g.bench_function("queue", |b| {
        b.iter_custom(|iters| {
            let (mut e, r) = engine("1000/s", 1_000_000);
            let mut spent = Duration::ZERO;
            let mut done = 0;
            let mut now = 0;
            while done < iters {
                let n = (iters - done).min(100_000);
                let t = Instant::now();
                for i in 0..n {
                    black_box(e.admit(r, i % 1_000, 1, now, || 0));
                }
                spent += t.elapsed();
                done += n;
                now += 1_000_000_000_000;
                let mut out = Vec::new();
                while let Some(at) = e.next_release() {
                    e.release_due(at.max(now), &mut out);
                    out.clear();
                }
            }
            spent
        });
    });

    // Refusals: one client with a full queue (the flood case).
    g.bench_function("reject_full_queue", |b| {
        let (mut e, r) = engine("1/s", 10);
        for _ in 0..11 {
            let _ = e.admit(r, 7, 1, 0, || 0);
        }
        let mut now = 0u64;
        b.iter(|| {
            now += 1;
            black_box(e.admit(r, 7, 1, now, || 0));
        });
    });
    g.finish();
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// One million client states held at once (each sent one request at a
/// slow rate, so its state lives for an hour): resident memory added.
fn million_clients() {
    let before = rss_kib();
    let (mut e, r) = engine("1/h", 10);
    for k in 0..1_000_000u64 {
        let _ = e.admit(r, k, 1, 0, || 0);
    }
    let after = rss_kib();
    println!(
        "scale: {} client states held; resident memory +{:.1} MiB ({} bytes per client)",
        e.clients(),
        (after - before) as f64 / 1024.0,
        (after - before) * 1024 / 1_000_000
    );
    drop(e);
}

criterion_group!(benches, admission);

fn main() {
    million_clients();
    benches();
    Criterion::default().configure_from_args().final_summary();
}
