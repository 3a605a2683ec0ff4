//! The core admission decision (DESIGN section 6: <= 100 ns) measured on
//! the pure engine with a fake clock, one decision per iteration, and the
//! memory one million client keys take.
//!
//! Run: `cargo bench --bench admission -- --warm-up-time 1 --measurement-time 3`
//!
//! Cases:
//! - `admission/depart_idle`: an idle client passes at once. u64 keys
//!   scrambled over a rotating set of 2^20; the fake clock moves 1 µs per
//!   decision at 1000/s, so each state expires 1 ms (1,000 decisions)
//!   after its request; `expire` runs every 256 decisions, its cost
//!   included (the pacer does the same work in production).
//! - `admission/queue`: a client with a queue, the request is queued.
//!   4,096 clients, each primed with one departure untimed; a timed chunk
//!   queues up to 32 per client, then the queues are withdrawn untimed.
//! - `admission/reject_full`: a client whose queue is full (b = 10) is
//!   refused with its Retry-After: the flood path. 4,096 clients.
//! - `admission/reject_full_1m_clients`: the same with 1,000,000 clients
//!   held (the index no longer fits in cache).
//!
//! Before the timed cases it prints resident memory (VmRSS from
//! /proc/self/statm) added by one million client states held at once, and
//! by 100,000 requests queued at once.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, criterion_group};
use sluice::shaper::{Admission, Engine, Limits, Policy, Rate, RouteId};

const MS: u64 = 1_000_000;

fn limits() -> Limits {
    Limits {
        max_clients: 2_000_000,
        max_queued: 2_000_000,
    }
}

fn engine(rate: &str, capacity: u32) -> (Engine<u64, u32>, RouteId) {
    let mut e = Engine::new(limits());
    let up = e.add_upstream(None);
    let policy = Policy::new(rate.parse::<Rate>().expect("rate"), capacity);
    let route = e.add_route(policy, up);
    (e, route)
}

/// A well-spread u64 key for counter `i` (keys are not sequential).
fn key(i: u64) -> u64 {
    i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5851_F42D_4C95_7F2D
}

fn admission(c: &mut Criterion) {
    let mut g = c.benchmark_group("admission");

    g.bench_function("depart_idle", |b| {
        let (mut e, r) = engine("1000/s", 10);
        let mut i = 0u64;
        let mut now = 0u64;
        b.iter(|| {
            i += 1;
            now += 1_000; // 1 µs per decision
            if i.is_multiple_of(256) {
                e.expire(now);
            }
            let a = e.admit(r, key(i & ((1 << 20) - 1)), 1, black_box(now), || 0);
            debug_assert_eq!(a, Admission::Depart);
            black_box(a)
        });
        assert!(e.clients() < 2_000, "states expire: {}", e.clients());
    });

    g.bench_function("queue", |b| {
        const CLIENTS: u64 = 4_096;
        const PER_CLIENT: u64 = 32;
        let (mut e, r) = engine("1000/s", 64);
        let mut now = 0u64;
        let mut sink = Vec::new();
        b.iter_custom(|iters| {
            let mut spent = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                // Untimed: fresh clients, each just departed (D in the
                // future), so every timed admission queues.
                now += 10_000 * MS;
                e.expire(now);
                for k in 0..CLIENTS {
                    let _ = e.admit(r, key(k), 1, now, || 0);
                }
                let n = (iters - done).min(CLIENTS * PER_CLIENT);
                let start = Instant::now();
                for j in 0..n {
                    let a = e.admit(r, key(j % CLIENTS), 1, black_box(now), || 0);
                    debug_assert!(matches!(a, Admission::Queued { .. }));
                    black_box(a);
                }
                spent += start.elapsed();
                done += n;
                e.withdraw_all(now, &mut sink);
                sink.clear();
            }
            spent
        });
    });

    g.bench_function("reject_full", |b| {
        const CLIENTS: u64 = 4_096;
        let (mut e, r) = engine("1/s", 10);
        for k in 0..CLIENTS {
            for _ in 0..11 {
                let _ = e.admit(r, key(k), 1, 0, || 0);
            }
        }
        assert_eq!(e.queued(), 10 * CLIENTS as usize);
        let mut i = 0u64;
        let mut now = 0u64;
        b.iter(|| {
            i += 1;
            now += 1; // stays far below the first departure (1 s)
            let a = e.admit(r, key(i % CLIENTS), 1, black_box(now), || 0);
            debug_assert!(matches!(a, Admission::Rejected(_)));
            black_box(a)
        });
    });

    g.bench_function("reject_full_1m_clients", |b| {
        const CLIENTS: u64 = 1_000_000;
        // b = 0 (policing): one request each holds a state for an hour and
        // every later one is refused, with no queue memory.
        let (mut e, r) = engine("1/h", 0);
        for k in 0..CLIENTS {
            let _ = e.admit(r, key(k), 1, 0, || 0);
        }
        assert_eq!(e.clients(), CLIENTS as usize);
        let mut i = 0u64;
        let mut now = 0u64;
        b.iter(|| {
            i += 1;
            now += 1;
            let a = e.admit(r, key(key(i) % CLIENTS), 1, black_box(now), || 0);
            debug_assert!(matches!(a, Admission::Rejected(_)));
            black_box(a)
        });
    });

    // For comparison with STYLE's iter_batched form: a fresh small engine
    // per batch, one decision per iteration on a client that queues.
    g.bench_function("queue_batched", |b| {
        b.iter_batched_ref(
            || {
                let (mut e, r) = engine("1000/s", 1_000_000);
                let _ = e.admit(r, 1, 1, 0, || 0);
                (e, r)
            },
            |(e, r)| black_box(e.admit(*r, 1, 1, black_box(0), || 0)),
            BatchSize::SmallInput,
        );
    });
    g.finish();
}

/// Resident set size in bytes, from /proc/self/statm (Linux); 0 elsewhere.
fn rss_bytes() -> u64 {
    let pages = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .unwrap_or(0);
    pages * 4_096
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// One million client keys held at once, and 100,000 requests waiting.
fn memory_report() {
    let before = rss_bytes();
    let (mut e, r) = engine("1/h", 10);
    let start = Instant::now();
    for k in 0..1_000_000u64 {
        let a = e.admit(r, key(k), 1, 0, || 0);
        assert_eq!(a, Admission::Depart);
    }
    let took = start.elapsed();
    let held = rss_bytes().saturating_sub(before);
    println!(
        "memory: {} client states held: +{:.1} MiB resident ({} bytes per client); \
         inserted in {:.0} ms ({:.0} ns each)",
        e.clients(),
        mib(held),
        held / 1_000_000,
        took.as_secs_f64() * 1e3,
        took.as_secs_f64() * 1e9 / 1e6,
    );
    // 100,000 requests waiting: 10,000 of those clients with 10 each.
    let before_q = rss_bytes();
    for k in 0..10_000u64 {
        for _ in 0..10 {
            let a = e.admit(r, key(k), 1, 0, || 0);
            assert!(matches!(a, Admission::Queued { .. }));
        }
    }
    let queued = rss_bytes().saturating_sub(before_q);
    println!(
        "memory: {} requests queued on top: +{:.1} MiB resident ({} bytes per request)",
        e.queued(),
        mib(queued),
        queued / e.queued() as u64,
    );
    drop(e);
}

criterion_group!(benches, admission);

fn main() {
    // Only when benchmarking for real (not `--list`, not `cargo test`).
    if std::env::args().any(|a| a == "--bench") {
        memory_report();
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
