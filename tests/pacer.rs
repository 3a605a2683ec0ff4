//! The real pacer in real time: the DESIGN section 1 seed example through
//! `Shaper::acquire`, and the idle pacer's CPU use.

use std::time::{Duration, Instant};

use sluice::pacer::{AcquireError, Shaper};
use sluice::shaper::{Limits, Policy, Rate, Rejection};

const LIMITS: Limits = Limits {
    max_clients: 1_000,
    max_queued: 1_000,
};

/// Seed example: r = 5/s, b = 10, 20 arrivals 25 ms apart. Expected from
/// the rules: 1 departs at once, 2-12 wait, 13-16 are refused, exactly one
/// of 17/18 (17 arrives at the instant 3 departs) is admitted, 19-20 are
/// refused; departures are 200 ms apart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_example_in_real_time() {
    let shaper: Shaper<u32> = Shaper::start(LIMITS).unwrap();
    let up = shaper.add_upstream(None);
    let route = shaper.add_route(Policy::new("5/s".parse::<Rate>().unwrap(), 10), up);

    let start = Instant::now() + Duration::from_millis(20);
    let mut tasks = Vec::new();
    for i in 0..20u32 {
        let shaper = shaper.clone();
        tokio::time::sleep_until((start + Duration::from_millis(25 * u64::from(i))).into()).await;
        tasks.push(tokio::spawn(async move {
            let r = shaper.acquire(route, 7, 1).await;
            (i + 1, r, Instant::now())
        }));
    }
    let mut admitted = Vec::new();
    let mut departures = Vec::new();
    for t in tasks {
        let (n, r, at) = t.await.unwrap();
        match r {
            Ok(()) => {
                admitted.push(n);
                departures.push(at);
            }
            Err(AcquireError::Rejected(Rejection::Full { retry_after })) => {
                assert!(retry_after > 0, "request {n}: retry_after must be positive");
                assert!(
                    retry_after <= 200_000_000,
                    "request {n}: one departure frees a place"
                );
            }
            Err(e) => panic!("request {n}: unexpected {e:?}"),
        }
    }
    let first_twelve: Vec<u32> = (1..=12).collect();
    assert_eq!(&admitted[..12], &first_twelve[..], "admitted: {admitted:?}");
    assert_eq!(admitted.len(), 13, "admitted: {admitted:?}");
    assert!(
        admitted[12] == 17 || admitted[12] == 18,
        "admitted: {admitted:?}"
    );

    departures.sort();
    // 200 ms apart: never closer than the rate allows (minus scheduling
    // jitter of the test's own tasks), never far behind on a loaded machine.
    for w in departures.windows(2) {
        let gap = w[1] - w[0];
        assert!(
            gap >= Duration::from_millis(185) && gap <= Duration::from_millis(260),
            "gap {gap:?}"
        );
    }
    let span = departures[12] - departures[0];
    assert!(
        span >= Duration::from_millis(2_390) && span <= Duration::from_millis(2_480),
        "12 intervals of 200 ms took {span:?}"
    );
}

/// A dropped waiter gives its slot to the next in line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_waiter_gives_its_slot_to_the_next() {
    let shaper: Shaper<u32> = Shaper::start(LIMITS).unwrap();
    let up = shaper.add_upstream(None);
    let route = shaper.add_route(Policy::new("5/s".parse::<Rate>().unwrap(), 10), up);
    let t0 = Instant::now();
    shaper.acquire(route, 1, 1).await.unwrap();
    let second = shaper.clone();
    let cancelled = tokio::spawn(async move { second.acquire(route, 1, 1).await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    let third = shaper.clone();
    let waiting =
        tokio::spawn(async move { third.acquire(route, 1, 1).await.map(|()| Instant::now()) });
    tokio::time::sleep(Duration::from_millis(30)).await;
    cancelled.abort();
    let at = waiting.await.unwrap().unwrap();
    let waited = at - t0;
    assert!(
        waited >= Duration::from_millis(195) && waited <= Duration::from_millis(300),
        "the third request should take the second's slot at 200 ms, went at {waited:?}"
    );
    let (_, queued) = shaper.stats();
    assert_eq!(queued, 0);
}

fn cpu_time() -> Duration {
    // utime + stime of this process, in clock ticks (fields 14 and 15).
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = stat.rsplit_once(')').unwrap().1;
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// An idle pacer parks: no CPU while nothing is due.
#[test]
fn idle_pacer_uses_no_cpu() {
    let shaper: Shaper<u32> = Shaper::start(LIMITS).unwrap();
    let up = shaper.add_upstream(None);
    let _route = shaper.add_route(Policy::new("5/s".parse::<Rate>().unwrap(), 10), up);
    std::thread::sleep(Duration::from_millis(100));
    let before = cpu_time();
    std::thread::sleep(Duration::from_secs(2));
    let used = cpu_time() - before;
    // A spinning pacer would burn ~2 s here; a parked one, nothing. Other
    // tests in this binary run in parallel, so allow them some CPU.
    assert!(
        used < Duration::from_millis(1_000),
        "used {used:?} of CPU in 2 s idle"
    );
    drop(shaper);
}
