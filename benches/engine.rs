//! The admission decision (target <= 100 ns on every path) through the
//! real sharded engine (its locks included) with the real client key type
//! and a fake clock; admissions from two threads against a one-lock
//! control; and the memory one million idle-held client states take.
//!
//! Run: `cargo bench --bench engine`

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group};
use sluice::admission::Key;
use sluice::pacer::default_shards;
use sluice::shaper::{Engine, Limits, Policy, Rate, RouteId};

const LIMITS: Limits = Limits {
    max_clients: 2_000_000,
    max_queued: 2_000_000,
};

/// The key an IPv4 client gets (`ip` keys: a tag and four octets).
fn key(n: u64) -> Key {
    let o = (n as u32).to_be_bytes();
    Key::new(&[b'i', o[0], o[1], o[2], o[3]])
}

fn engine(rate: &str, capacity: u32, shards: usize) -> (Engine<Key, u32>, RouteId) {
    let e = Engine::new(LIMITS, shards);
    let up = e.add_upstream(None);
    let r = e.add_route(
        Policy::new(rate.parse::<Rate>().expect("rate"), capacity),
        up,
    );
    (e, r)
}

/// Shards as the daemon sizes them on this machine.
fn shards() -> usize {
    default_shards(std::thread::available_parallelism().map_or(1, |n| n.get()))
}

fn admission(c: &mut Criterion) {
    let mut g = c.benchmark_group("admit");

    // A new client passing at once: keys rotate over 100,000, time moves
    // 1 µs per decision, states expire 1 ms after their request.
    g.bench_function("depart_new_client", |b| {
        let (e, r) = engine("1000/s", 10, shards());
        let (mut now, mut n) = (0u64, 0u64);
        b.iter(|| {
            now += 1_000;
            n = (n + 1) % 100_000;
            if n % 1_024 == 0 {
                e.expire(now);
            }
            black_box(e.admit(r, key(n), 1, now, || 0));
        });
    });

    // A known client whose schedule has passed (its state still held):
    // 1,000 clients at 1,000/s each, 1 ms apart per client.
    g.bench_function("depart_known_client", |b| {
        let (e, r) = engine("1000/s", 10, shards());
        let (mut now, mut n) = (0u64, 0u64);
        b.iter(|| {
            n = (n + 1) % 1_000;
            if n == 0 {
                now += 1_000_000;
            }
            black_box(e.admit(r, key(n), 1, now, || 0));
        });
    });

    // Requests that queue (admission only; releases happen untimed).
    g.bench_function("queue", |b| {
        b.iter_custom(|iters| {
            let (e, r) = engine("1000/s", 1_000_000, shards());
            let mut spent = Duration::ZERO;
            let mut done = 0;
            let mut now = 0;
            while done < iters {
                let n = (iters - done).min(100_000);
                let t = Instant::now();
                for i in 0..n {
                    black_box(e.admit(r, key(i % 1_000), 1, now, || 0));
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
        let (e, r) = engine("1/s", 10, shards());
        for _ in 0..11 {
            let _ = e.admit(r, key(7), 1, 0, || 0);
        }
        let mut now = 0u64;
        b.iter(|| {
            now += 1;
            black_box(e.admit(r, key(7), 1, now, || 0));
        });
    });

    // Refusals by max_wait: the departure would be too late.
    g.bench_function("reject_max_wait", |b| {
        let e: Engine<Key, u32> = Engine::new(LIMITS, shards());
        let up = e.add_upstream(None);
        let mut p = Policy::new("1/s".parse().expect("rate"), 10);
        p.max_wait = Some(1_500_000_000);
        let r = e.add_route(p, up);
        for _ in 0..3 {
            let _ = e.admit(r, key(7), 1, 0, || 0);
        }
        let mut now = 0u64;
        b.iter(|| {
            now += 1;
            black_box(e.admit(r, key(7), 1, now, || 0));
        });
    });
    g.finish();
}

/// Admissions per second from `threads` threads at once, each with its
/// own 1,000 keys, on an engine with `shards` shards. With `partitioned`,
/// thread t only gets keys of shards s with s % threads == t (no shard,
/// no cache line, is shared between threads: the ceiling).
fn parallel_rate(threads: usize, shards: usize, per_thread: u64, partitioned: bool) -> f64 {
    let (e, r) = engine("1000000/s", 10, shards);
    let keys: Vec<Vec<Key>> = (0..threads as u64)
        .map(|t| {
            (t * 1_000_000..)
                .map(key)
                .filter(|k| !partitioned || e.shard_for(r, k) % threads == t as usize)
                .take(1_000)
                .collect()
        })
        .collect();
    let barrier = Barrier::new(threads);
    let started = std::sync::Mutex::new(None::<Instant>);
    std::thread::scope(|s| {
        for keys in &keys {
            let (e, barrier, started) = (&e, &barrier, &started);
            s.spawn(move || {
                barrier.wait();
                started
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get_or_insert_with(Instant::now);
                let mut now = 0u64;
                for i in 0..per_thread {
                    now += 10;
                    // Every key passes at once (1 µs apart at 1,000,000/s).
                    let k = keys[(i % 1_000) as usize].clone();
                    black_box(e.admit(r, k, 1, now, || 0));
                }
            });
        }
    });
    let elapsed = started
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .map_or(Duration::ZERO, |t| t.elapsed());
    (threads as u64 * per_thread) as f64 / elapsed.as_secs_f64()
}

/// Two threads admitting at once on the sharded engine, against the same
/// with one shard (one lock: it serializes them) and with keys partitioned
/// so the threads share no shard (the ceiling).
fn two_threads() {
    let n = 2_000_000;
    let best = |threads: usize, shards: usize, partitioned: bool| {
        (0..5)
            .map(|_| parallel_rate(threads, shards, n, partitioned))
            .fold(0.0f64, f64::max)
    };
    let s = shards();
    let one = best(1, s, false);
    let (two, two_apart, one_lock) = (best(2, s, false), best(2, s, true), best(2, 1, false));
    println!(
        "parallel ({s} shards): 1 thread {:.1} M/s; 2 threads {:.1} M/s ({:.2}x), \
         keys partitioned by shard {:.1} M/s ({:.2}x), one shard (one lock) {:.1} M/s ({:.2}x)",
        one / 1e6,
        two / 1e6,
        two / one,
        two_apart / 1e6,
        two_apart / one,
        one_lock / 1e6,
        one_lock / one,
    );
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

/// One million idle client states held at once (each sent one request at
/// a slow rate, so its state lives for an hour): resident memory added.
fn million_clients() {
    let before = rss_kib();
    let (e, r) = engine("1/h", 10, shards());
    for k in 0..1_000_000u64 {
        let _ = e.admit(r, key(k), 1, 0, || 0);
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
    // A filter (`cargo bench --bench engine -- admit/queue`) runs only the
    // criterion cases it names; "scale" and "parallel" name the others.
    // Values of criterion's options (`--measurement-time 3`) are not
    // filters.
    const TAKES_VALUE: &[&str] = &[
        "--warm-up-time",
        "--measurement-time",
        "--sample-size",
        "--nresamples",
        "--noise-threshold",
        "--confidence-level",
        "--significance-level",
        "--save-baseline",
        "--baseline",
        "--baseline-lenient",
        "--load-baseline",
        "--profile-time",
        "--output-format",
        "--color",
        "--plotting-backend",
        "--format",
        "-c",
        "-s",
        "-b",
    ];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let filters: Vec<&String> = args
        .iter()
        .enumerate()
        .filter(|&(i, a)| {
            !a.starts_with('-') && (i == 0 || !TAKES_VALUE.contains(&args[i - 1].as_str()))
        })
        .map(|(_, a)| a)
        .collect();
    let wanted =
        |name: &str| filters.is_empty() || filters.iter().any(|f| name.contains(f.as_str()));
    if wanted("scale") {
        million_clients();
    }
    if wanted("parallel") {
        two_threads();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
