//! The pure engine, one rule of DESIGN section 1 per test, driven with
//! explicit instants (u64 nanoseconds) and a perfect pacer: every release
//! happens exactly at the instant `next_release` names, and releases due at
//! an arrival's instant happen before that arrival is decided.

use sluice::shaper::{
    Admission, Engine, Limits, Policy, Rate, Rejection, RouteId, Ticket, UpstreamId,
};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

const ROOMY: Limits = Limits {
    max_clients: 10_000,
    max_queued: 100_000,
};

/// Shards in every engine here: several, so that clients of one capped
/// upstream live in different shards and the cap's arbitration is what
/// keeps them in order.
const SHARDS: usize = 4;

fn rate(s: &str) -> Rate {
    s.parse().expect("valid rate")
}

/// 5/s, so T = 200 ms.
const T5: u64 = 200 * MS;

fn policy(r: &str, capacity: u32) -> Policy {
    Policy::new(rate(r), capacity)
}

/// An engine with a perfect pacer. Payloads are request ids; every
/// departure is recorded as (id, instant), immediate ones included.
struct Sim {
    e: Engine<u32, u32>,
    upstream: UpstreamId,
    route: RouteId,
    next_id: u32,
    departed: Vec<(u32, u64)>,
}

impl Sim {
    /// One uncapped upstream, one route.
    fn new(policy: Policy) -> Sim {
        Sim::with(policy, ROOMY, None)
    }

    fn with(policy: Policy, limits: Limits, cap: Option<Rate>) -> Sim {
        let e = Engine::new(limits, SHARDS);
        let upstream = e.add_upstream(cap);
        let route = e.add_route(policy, upstream);
        Sim {
            e,
            upstream,
            route,
            next_id: 0,
            departed: Vec::new(),
        }
    }

    /// Another route on the same upstream.
    fn add_route(&mut self, policy: Policy) -> RouteId {
        self.e.add_route(policy, self.upstream)
    }

    /// Release everything scheduled at or before `t`, each exactly at its
    /// scheduled instant; then forget idle states as of `t`.
    fn run_to(&mut self, t: u64) {
        while let Some(at) = self.e.next_release() {
            if at > t {
                break;
            }
            let mut out = Vec::new();
            self.e.release_due(at, &mut out);
            assert!(!out.is_empty(), "next_release named {at} but nothing left");
            self.departed.extend(out.into_iter().map(|id| (id, at)));
        }
        self.e.expire(t);
    }

    /// An arrival on the default route.
    fn arrive(&mut self, key: u32, cost: u32, t: u64) -> (u32, Admission) {
        let route = self.route;
        self.arrive_on(route, key, cost, t)
    }

    /// An arrival of `cost` for `key` at `t`: releases due at `t` first.
    fn arrive_on(&mut self, route: RouteId, key: u32, cost: u32, t: u64) -> (u32, Admission) {
        self.run_to(t);
        self.next_id += 1;
        let id = self.next_id;
        let a = self.e.admit(route, key, cost, t, || id);
        if a == Admission::Depart {
            self.departed.push((id, t));
        }
        (id, a)
    }

    fn departure_of(&self, id: u32) -> Option<u64> {
        self.departed.iter().find(|d| d.0 == id).map(|d| d.1)
    }

    fn departure_times(&self) -> Vec<u64> {
        self.departed.iter().map(|d| d.1).collect()
    }
}

fn ticket(a: &Admission) -> Ticket {
    match a {
        Admission::Queued { ticket, .. } => *ticket,
        other => panic!("expected Queued, got {other:?}"),
    }
}

fn queued_at(a: &Admission) -> u64 {
    match a {
        Admission::Queued { departure, .. } => *departure,
        other => panic!("expected Queued, got {other:?}"),
    }
}

fn full_retry_after(a: &Admission) -> u64 {
    match a {
        Admission::Rejected(Rejection::Full { retry_after }) => *retry_after,
        other => panic!("expected Rejected(Full), got {other:?}"),
    }
}

fn gaps(times: &[u64]) -> Vec<u64> {
    times.windows(2).map(|w| w[1] - w[0]).collect()
}

// === Departure schedule ===

#[test]
fn idle_client_departs_at_once_with_no_added_latency() {
    let mut sim = Sim::new(policy("5/s", 10));
    let t = 1_234_567_891;
    let (id, a) = sim.arrive(7, 1, t);
    assert_eq!(a, Admission::Depart);
    assert_eq!(sim.departure_of(id), Some(t), "departs at its arrival");
    assert_eq!(sim.e.queued(), 0);
    assert_eq!(sim.e.next_release(), None, "nothing scheduled for later");
    // Another client, idle too, is not delayed by the first.
    assert_eq!(sim.arrive(8, 1, t).1, Admission::Depart);
    // And the first again once its schedule has passed: D = t + T.
    assert_eq!(sim.arrive(7, 1, t + T5).1, Admission::Depart);
}

#[test]
fn one_clients_requests_depart_in_arrival_order() {
    let mut sim = Sim::new(policy("5/s", 20));
    let mut sent = Vec::new();
    // Ties, spread arrivals and mixed costs: order is arrival order.
    for (i, t) in [0, 0, 0, 3 * MS, 3 * MS, 150 * MS, 401 * MS, 401 * MS]
        .into_iter()
        .enumerate()
    {
        let cost = 1 + (i as u32 % 3);
        let (id, a) = sim.arrive(1, cost, t);
        assert!(!matches!(a, Admission::Rejected(_)), "{a:?}");
        sent.push(id);
    }
    sim.run_to(60 * S);
    let order: Vec<u32> = sim.departed.iter().map(|d| d.0).collect();
    assert_eq!(order, sent);
}

#[test]
fn backlogged_departures_are_exactly_c_times_t_apart() {
    let mut sim = Sim::new(policy("5/s", 100));
    let costs = [1, 1, 3, 1, 2, 5, 1, 1];
    for &c in &costs {
        sim.arrive(1, c, 0);
    }
    sim.run_to(60 * S);
    let times = sim.departure_times();
    assert_eq!(times.len(), costs.len());
    assert_eq!(times[0], 0);
    // Each gap is the cost of the request that left first, times T.
    let want: Vec<u64> = costs[..costs.len() - 1]
        .iter()
        .map(|&c| u64::from(c) * T5)
        .collect();
    assert_eq!(gaps(&times), want);
}

#[test]
fn queued_departure_is_the_schedule_not_the_arrival() {
    // Arrivals spread inside one interval still leave on the grid.
    let mut sim = Sim::new(policy("5/s", 10));
    sim.arrive(1, 1, 0);
    let (_, a) = sim.arrive(1, 1, 17 * MS);
    assert_eq!(queued_at(&a), T5);
    let (_, a) = sim.arrive(1, 1, 190 * MS);
    assert_eq!(queued_at(&a), 2 * T5);
    sim.run_to(10 * S);
    assert_eq!(sim.departure_times(), vec![0, T5, 2 * T5]);
}

#[test]
fn late_releases_keep_departures_on_the_absolute_grid() {
    // A pacer that calls release_due T/3 late every time: the schedule
    // must stay on k·T (lateness is jitter, never drift).
    let t = T5;
    let e: Engine<u32, u32> = Engine::new(ROOMY, SHARDS);
    let up = e.add_upstream(None);
    let r = e.add_route(policy("5/s", 1_000), up);
    for id in 0..200 {
        let _ = e.admit(r, 1, 1, 0, || id);
    }
    // Request 0 departed at once (at 0); the rest are waiting.
    let window = 20 * S;
    let mut released = 1; // the immediate one
    let mut out = Vec::new();
    for k in 1.. {
        let scheduled = e.next_release().expect("still backlogged");
        assert_eq!(scheduled, k * t, "the {k}-th slot drifted");
        let call = scheduled + t / 3;
        if call > window {
            break;
        }
        out.clear();
        e.release_due(call, &mut out);
        assert_eq!(out, vec![k as u32], "one release per late call");
        released += 1;
    }
    // Over 20 s at 5/s: exactly 100 departures (slots 0, T, ..., 99 T).
    assert_eq!(released, 100);
}

/// Releases `e` with a pacer that is on time except once: the release due
/// at `stall_at` happens `late` later. Returns every departure instant.
fn run_with_one_stall(e: &Engine<u32, u32>, stall_at: u64, late: u64, until: u64) -> Vec<u64> {
    let mut times = Vec::new();
    let mut out = Vec::new();
    while let Some(at) = e.next_release() {
        let call = if at == stall_at { at + late } else { at };
        if call > until {
            break;
        }
        out.clear();
        e.release_due(call, &mut out);
        times.extend(out.iter().map(|_| call));
    }
    times
}

#[test]
fn a_late_release_is_made_up_no_faster_than_twice_the_rate() {
    // DESIGN 1, late releases: the client keeps its grid and catches up,
    // never two departures closer than c·T/2, and its long-run rate stays
    // exactly r.
    let t = T5;
    let e: Engine<u32, u32> = Engine::new(ROOMY, SHARDS);
    let up = e.add_upstream(None);
    let r = e.add_route(policy("5/s", 100), up);
    for id in 0..60 {
        let _ = e.admit(r, 1, 1, 0, || id);
    }
    // The pacer comes back 3.5 T late for the slot at T: three slots missed.
    let times = run_with_one_stall(&e, t, 7 * t / 2, 40 * t);
    assert_eq!(times[0], t + 7 * t / 2, "the late one, alone (no burst)");
    let g = gaps(&times);
    assert!(g.iter().all(|&gap| gap >= t / 2), "gaps {g:?}");
    assert_eq!(&g[..6], &[t / 2; 6], "made up at twice the rate");
    // Back on the absolute grid k·T: slot 8 goes at 8 T, and so on.
    assert!(times.contains(&(8 * t)), "{times:?}");
    for w in times.windows(2).skip(7) {
        assert_eq!(w[1] - w[0], t, "on the grid again: {times:?}");
    }
    // Long-run rate: the slots 1..=39 all went by 39 T (slot 0 went at once).
    assert_eq!(times.iter().filter(|&&x| x <= 39 * t).count(), 39);
}

/// An engine with one uncapped route at `r`, capacity `capacity`, with
/// `burst`, and `n` requests of client 1 arrived at 0; how many of them
/// went at once.
fn burst_route(r: &str, capacity: u32, burst: u32, n: u32) -> (Engine<u32, u32>, RouteId, usize) {
    let e: Engine<u32, u32> = Engine::new(ROOMY, SHARDS);
    let up = e.add_upstream(None);
    let mut p = policy(r, capacity);
    p.burst = burst;
    let route = e.add_route(p, up);
    let at_once = (0..n)
        .filter(|&id| e.admit(route, 1, 1, 0, || id) == Admission::Depart)
        .count();
    (e, route, at_once)
}

#[test]
fn with_burst_a_late_release_is_made_up_no_faster_than_twice_the_rate() {
    // burst = 5: five of ten pass at once, the rest are due at 200, 400,
    // 600 ms, ... The pacer comes back at 700 for the one due at 200:
    // the client is not idle, so DESIGN 1's late-release rule holds as
    // without burst (the ones due at 400 and 600 used to leave with it).
    let t = T5;
    let (e, _, at_once) = burst_route("5/s", 10, 5, 10);
    assert_eq!(at_once, 5);
    let times = run_with_one_stall(&e, t, 5 * t / 2, 40 * t);
    assert_eq!(times.len(), 5);
    assert_eq!(times[0], 700 * MS);
    let g = gaps(&times);
    assert!(g.iter().all(|&gap| gap >= t / 2), "gaps {g:?} in {times:?}");
    // Caught up: the last (due at 1000 ms) leaves on its grid time or
    // half an interval after the one before.
    assert!(times[4] <= 1100 * MS, "{times:?}");
}

#[test]
fn with_burst_an_arrival_after_a_late_release_keeps_half_an_interval() {
    // burst = 5: five pass at once, the sixth is due at 200 ms. The pacer
    // sends it at 700 ms and the queue is empty again. The client has
    // burst credit left by then, but DESIGN 1 holds for late releases:
    // a request arriving right after the late one departs no sooner than
    // c·T/2 after it (it used to go at once, 1 ms after it).
    let t = T5;
    let (e, r, at_once) = burst_route("5/s", 10, 5, 6);
    assert_eq!(at_once, 5);
    assert_eq!(e.next_release(), Some(t));
    let mut out = Vec::new();
    e.release_due(700 * MS, &mut out);
    assert_eq!(out, vec![5]);
    let next = e.admit(r, 1, 1, 701 * MS, || 6);
    assert_eq!(
        queued_at(&next),
        700 * MS + t / 2,
        "half an interval after the late release"
    );
    // Past that floor the burst credit is there again: it passes at once.
    out.clear();
    e.release_due(800 * MS, &mut out);
    assert_eq!(out, vec![6]);
    assert_eq!(e.admit(r, 1, 1, 1000 * MS, || 7), Admission::Depart);
}

#[test]
fn a_faster_rate_on_reload_also_shortens_a_late_releases_floor() {
    // 1/s, burst 2: two go at once, the third is due at 1 s and the pacer
    // sends it at 1.6 s, which leaves a floor at 2.1 s. A reload to 100/s
    // then: the next arrival waits for the rescaled schedule (about 14 ms),
    // not for the old floor.
    let (e, r, at_once) = burst_route("1/s", 5, 2, 3);
    assert_eq!(at_once, 2);
    let mut out = Vec::new();
    e.release_due(1600 * MS, &mut out);
    assert_eq!(out, vec![2]);
    let mut faster = policy("100/s", 5);
    faster.burst = 2;
    e.set_policy(r, faster, 1600 * MS);
    let next = e.admit(r, 1, 1, 1601 * MS, || 3);
    let at = match next {
        Admission::Depart => 1601 * MS,
        queued => queued_at(&queued),
    };
    assert!(at <= 1620 * MS, "held until {at} ns");
}

#[test]
fn a_stall_longer_than_the_whole_backlog_restarts_the_schedule() {
    // A release later than b·T: catching up would only burst, so the grid
    // restarts from the release.
    let t = T5;
    let e: Engine<u32, u32> = Engine::new(ROOMY, SHARDS);
    let up = e.add_upstream(None);
    let r = e.add_route(policy("5/s", 10), up);
    for id in 0..11 {
        let _ = e.admit(r, 1, 1, 0, || id);
    }
    let late = 10 * t + t / 4;
    let times = run_with_one_stall(&e, t, late, 100 * t);
    assert_eq!(times.len(), 10);
    assert_eq!(times[0], t + late);
    assert!(gaps(&times).iter().all(|&g| g == t), "{times:?}");
}

#[test]
fn a_faster_rate_on_reload_frees_idle_clients_served_at_the_old_one() {
    // Client 1 was served at 1/d just before a reload to 100/s: its next
    // request waits one new interval, not the rest of the day. Client 2
    // has a request waiting: it keeps the departure it was given, and the
    // interval after it (it was admitted at 1/d); a new one behind it is
    // told so, and departs when it was told.
    const DAY: u64 = 86_400 * S;
    let mut sim = Sim::new(policy("1/d", 10));
    sim.arrive(1, 1, 0);
    sim.arrive(2, 1, 0);
    let (_, waiting) = sim.arrive(2, 1, 0);
    assert_eq!(queued_at(&waiting), DAY);
    sim.e.set_policy(sim.route, policy("100/s", 10), S);
    let (_, next) = sim.arrive(1, 1, S);
    let at = match next {
        Admission::Depart => S,
        queued => queued_at(&queued),
    };
    assert!(at <= S + 10 * MS, "client 1 waits until {at} ns");
    let (id, behind) = sim.arrive(2, 1, S);
    assert_eq!(queued_at(&behind), 2 * DAY, "behind the one waiting");
    // Once the old one has gone, the estimates are the new rate's again.
    sim.run_to(2 * DAY);
    assert_eq!(sim.departure_of(3), Some(DAY));
    assert_eq!(sim.departure_of(id), Some(2 * DAY));
    let (_, next) = sim.arrive(2, 1, 2 * DAY);
    assert_eq!(queued_at(&next), 2 * DAY + 10 * MS);
}

#[test]
fn max_wait_after_a_reload_counts_the_waiting_at_their_own_interval() {
    // At 1/s two wait (due 1 s and 2 s); a reload to 10/s. A request at
    // 200 ms departs after them, at 3 s (each keeps its interval): past
    // its 2 s max_wait, so it is refused, not admitted on an estimate of
    // 1.2 s made at the new interval.
    let mut p = policy("1/s", 10);
    p.max_wait = Some(2 * S);
    let mut sim = Sim::new(p);
    for _ in 0..3 {
        sim.arrive(1, 1, 0);
    }
    let mut faster = policy("10/s", 10);
    faster.max_wait = Some(2 * S);
    sim.e.set_policy(sim.route, faster, 100 * MS);
    let (_, late) = sim.arrive(1, 1, 200 * MS);
    assert!(
        matches!(late, Admission::Rejected(Rejection::MaxWait { .. })),
        "{late:?}"
    );
    // Once they have gone, the next goes at once and the one behind it
    // is told the new interval.
    sim.run_to(3 * S);
    assert_eq!(sim.arrive(1, 1, 3 * S).1, Admission::Depart);
    let (_, next) = sim.arrive(1, 1, 3 * S);
    assert_eq!(queued_at(&next), 3 * S + 100 * MS);
}

#[test]
fn requests_admitted_on_both_sides_of_a_reload_are_told_their_departures() {
    // Two wait at 1/s (due 1 s, 2 s); a reload to 10/s; two more queue
    // behind them. Each is told when it departs: 3 s (after the old
    // ones' whole seconds) and 3.1 s (then the new interval).
    let mut sim = Sim::new(policy("1/s", 10));
    for _ in 0..3 {
        sim.arrive(1, 1, 0);
    }
    sim.e.set_policy(sim.route, policy("10/s", 10), 100 * MS);
    let (a, told_a) = sim.arrive(1, 1, 200 * MS);
    let (b, told_b) = sim.arrive(1, 1, 200 * MS);
    assert_eq!(queued_at(&told_a), 3 * S);
    assert_eq!(queued_at(&told_b), 3 * S + 100 * MS);
    sim.run_to(4 * S);
    assert_eq!(sim.departure_of(a), Some(3 * S));
    assert_eq!(sim.departure_of(b), Some(3 * S + 100 * MS));
}

#[test]
fn a_burst_raised_on_reload_leaves_a_waiting_queue_on_its_grid() {
    // Five waiting at 5/s (200 ms apart); a reload gives the route a
    // burst of 10 at 100 ms: the queue still departs 200 ms apart (new
    // burst credit is for after it), not at twice the rate.
    let mut sim = Sim::new(policy("5/s", 10));
    let ids: Vec<u32> = (0..6).map(|_| sim.arrive(1, 1, 0).0).collect();
    let mut burst = policy("5/s", 10);
    burst.burst = 10;
    sim.e.set_policy(sim.route, burst, 100 * MS);
    sim.run_to(2 * S);
    let times: Vec<u64> = ids[1..]
        .iter()
        .map(|&id| sim.departure_of(id).unwrap_or(0))
        .collect();
    assert_eq!(times, [1, 2, 3, 4, 5].map(|k| k * T5));
}

#[test]
fn an_idle_client_rescaled_by_a_reload_is_forgotten_on_its_new_schedule() {
    // Served at 1/d, then the rate goes to 100/s: the client is idle and
    // owes 10 ms, so it is forgotten within the next sweep, not in a day
    // (DESIGN 1: idle state is free).
    let mut sim = Sim::new(policy("1/d", 10));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    sim.run_to(S / 2);
    assert_eq!(sim.e.clients(), 1, "held while its day runs");
    sim.e.set_policy(sim.route, policy("100/s", 10), S);
    sim.run_to(2 * S);
    assert_eq!(sim.e.clients(), 0, "still held a day for the old rate");
}

// === Capacity ===

#[test]
fn capacity_is_counted_in_cost_units() {
    let mut sim = Sim::new(policy("5/s", 10));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    let (a, x) = sim.arrive(1, 5, 0);
    assert_eq!(queued_at(&x), T5);
    // 5 of b = 10 taken: another cost-5 fits exactly...
    let (b, x) = sim.arrive(1, 5, 0);
    assert_eq!(
        queued_at(&x),
        T5 + 5 * T5,
        "after the cost-5 ahead: 5 T later"
    );
    assert_eq!(sim.e.queued(), 2, "two requests");
    let view = sim.e.view(sim.route, &1, 0).expect("client held");
    assert_eq!(view.waiting_cost, 10);
    // ...and then not even a cost-1.
    assert!(matches!(
        sim.arrive(1, 1, 0).1,
        Admission::Rejected(Rejection::Full { .. })
    ));
    sim.run_to(60 * S);
    assert_eq!(sim.departure_of(a), Some(T5));
    assert_eq!(sim.departure_of(b), Some(6 * T5));
}

#[test]
fn zero_capacity_is_pure_policing() {
    let mut sim = Sim::new(policy("5/s", 0));
    // Arrivals every 10 ms for 2 s: one passes per T, nothing ever waits.
    let mut passed = Vec::new();
    for i in 0..200u64 {
        let t = i * 10 * MS;
        let (id, a) = sim.arrive(1, 1, t);
        match a {
            Admission::Depart => passed.push(t),
            Admission::Rejected(Rejection::Full { retry_after }) => {
                // Retry-After points at the next instant it would pass.
                let next = passed.last().unwrap() + T5;
                assert_eq!(retry_after, next - t, "request {id}");
            }
            other => panic!("b = 0 never queues: {other:?}"),
        }
        assert_eq!(sim.e.queued(), 0);
    }
    assert_eq!(passed, (0..10).map(|k| k * T5).collect::<Vec<_>>());
}

// === Cancellation ===

#[test]
fn cancellation_frees_the_place_and_the_slot() {
    let mut sim = Sim::new(policy("5/s", 2));
    sim.arrive(1, 1, 0); // departs at once
    let (_, x2) = sim.arrive(1, 1, 10 * MS);
    let (id3, _) = sim.arrive(1, 1, 10 * MS);
    assert_eq!(queued_at(&x2), T5);
    // Full now.
    assert!(matches!(
        sim.arrive(1, 1, 20 * MS).1,
        Admission::Rejected(Rejection::Full { .. })
    ));
    // The head disconnects: its place is free at once...
    assert_eq!(sim.e.cancel(ticket(&x2), 30 * MS), Some(2));
    assert_eq!(sim.e.queued(), 1);
    let (id5, x5) = sim.arrive(1, 1, 40 * MS);
    // ...and its slot goes to the next in line: 3 at T, 5 at 2 T.
    assert_eq!(queued_at(&x5), 2 * T5);
    sim.run_to(10 * S);
    assert_eq!(sim.departed, vec![(1, 0), (id3, T5), (id5, 2 * T5)]);
    assert_eq!(sim.departure_of(2), None, "a cancelled request never goes");
}

#[test]
fn cancelling_the_head_after_a_late_release_keeps_half_an_interval() {
    // DESIGN 1: after a late release no two departures of a client come
    // closer than c·T/2, and a cancelled head's slot goes to the next in
    // line. A1 leaves 500 ms late (at 700), so A2 is due at 800; A2
    // cancels; A3 takes 800, not its grid time 400 (which would send it
    // with the next release, 20 ms after A1).
    let mut sim = Sim::new(policy("5/s", 10));
    sim.arrive(1, 1, 0);
    let (a1, _) = sim.arrive(1, 1, 0);
    let (_, a2) = sim.arrive(1, 1, 0);
    let (a3, _) = sim.arrive(1, 1, 0);
    // Another client, whose release at 720 is the next the pacer makes.
    assert_eq!(
        sim.e.admit(sim.route, 2, 1, 520 * MS, || 100),
        Admission::Depart
    );
    let b1 = sim.e.admit(sim.route, 2, 1, 600 * MS, || 101);
    assert_eq!(queued_at(&b1), 720 * MS);
    let mut out = Vec::new();
    sim.e.release_due(700 * MS, &mut out);
    assert_eq!(out, vec![a1], "A1, late");
    assert!(sim.e.cancel(ticket(&a2), 705 * MS).is_some());
    out.clear();
    sim.e.release_due(720 * MS, &mut out);
    assert_eq!(out, vec![101], "B1 alone; not A3, 20 ms after A1");
    out.clear();
    sim.e.release_due(800 * MS, &mut out);
    assert!(out.contains(&a3), "A3 takes A2's slot at 800: {out:?}");
}

#[test]
fn cancelling_the_last_waiting_request_leaves_its_slot_to_the_next_arrival() {
    let mut sim = Sim::new(policy("5/s", 5));
    sim.arrive(1, 1, 0);
    let (_, x) = sim.arrive(1, 1, 0);
    assert_eq!(queued_at(&x), T5);
    assert!(sim.e.cancel(ticket(&x), 50 * MS).is_some());
    assert_eq!(sim.e.next_release(), None, "no departure is consumed");
    let (id, x) = sim.arrive(1, 1, 60 * MS);
    assert_eq!(queued_at(&x), T5, "the slot the cancelled one had");
    sim.run_to(S);
    assert_eq!(sim.departure_of(id), Some(T5));
}

#[test]
fn cancelling_a_released_or_cancelled_ticket_returns_none() {
    let mut sim = Sim::new(policy("5/s", 5));
    sim.arrive(1, 1, 0);
    let (_, x2) = sim.arrive(1, 1, 0);
    let (_, x3) = sim.arrive(1, 1, 0);
    sim.run_to(T5);
    assert_eq!(sim.departure_of(2), Some(T5));
    assert_eq!(sim.e.cancel(ticket(&x2), T5), None, "already released");
    assert_eq!(sim.e.cancel(ticket(&x3), T5), Some(3));
    assert_eq!(sim.e.cancel(ticket(&x3), T5), None, "already cancelled");
    // After the client's state is gone and its slot reused, old tickets
    // still name nothing.
    sim.run_to(10 * S);
    assert_eq!(sim.e.clients(), 0);
    sim.arrive(2, 1, 10 * S);
    let (_, x) = sim.arrive(2, 1, 10 * S);
    assert_eq!(sim.e.cancel(ticket(&x3), 10 * S), None);
    assert_eq!(sim.e.cancel(ticket(&x2), 10 * S), None);
    assert!(sim.e.cancel(ticket(&x), 10 * S).is_some());
}

// === Retry-After ===

/// From the rules: when a queue holding `waiting` (departure, cost), in
/// departure order, would accept a request of `cost` with capacity `b`.
fn accepts_at(waiting: &[(u64, u32)], b: u32, cost: u32) -> u64 {
    let mut left: u32 = waiting.iter().map(|w| w.1).sum();
    for &(d, c) in waiting {
        left -= c;
        if left + cost <= b {
            return d;
        }
    }
    unreachable!("the queue empties eventually")
}

#[test]
fn full_rejection_retry_after_is_the_time_until_the_queue_accepts() {
    for cost in [1, 2, 3] {
        let b = 3;
        let mut sim = Sim::new(policy("5/s", b));
        sim.arrive(1, 1, 0);
        let mut waiting = Vec::new();
        for _ in 0..3 {
            let (_, x) = sim.arrive(1, 1, 0);
            waiting.push((queued_at(&x), 1));
        }
        let arrival = 50 * MS;
        let retry = full_retry_after(&sim.arrive(1, cost, arrival).1);
        assert_eq!(
            retry,
            accepts_at(&waiting, b, cost) - arrival,
            "cost {cost}"
        );
        // One nanosecond earlier it is still refused...
        let early = sim.arrive(1, cost, arrival + retry - 1).1;
        assert_eq!(full_retry_after(&early), 1, "cost {cost}");
        // ...and at arrival + retry_after it is admitted.
        let (_, x) = sim.arrive(1, cost, arrival + retry);
        assert!(matches!(x, Admission::Queued { .. }), "cost {cost}: {x:?}");
    }
}

#[test]
fn retry_after_for_a_cost_above_capacity_is_when_the_client_is_idle() {
    // Cost 5 never fits in b = 4: only an idle client lets it pass.
    let mut sim = Sim::new(policy("5/s", 4));
    sim.arrive(1, 1, 0);
    sim.arrive(1, 2, 0); // departs at T, D = 3 T after it
    let retry = full_retry_after(&sim.arrive(1, 5, 10 * MS).1);
    assert_eq!(retry, 3 * T5 - 10 * MS);
    assert!(matches!(
        sim.arrive(1, 5, 3 * T5 - 1).1,
        Admission::Rejected(Rejection::Full { .. })
    ));
    assert_eq!(sim.arrive(1, 5, 3 * T5).1, Admission::Depart);
}

// === Idle state ===

#[test]
fn idle_state_is_dropped_and_a_returning_client_is_new() {
    let mut sim = Sim::new(policy("5/s", 10));
    sim.arrive(1, 1, 0);
    assert_eq!(sim.e.clients(), 1);
    sim.run_to(T5 - 1);
    assert_eq!(sim.e.clients(), 1, "held while D is in the future");
    sim.run_to(T5);
    assert_eq!(sim.e.clients(), 0, "dropped once D has passed");

    // A backlogged client: dropped once the last departure's D passes.
    for _ in 0..4 {
        sim.arrive(2, 1, S);
    }
    sim.run_to(S + 3 * T5);
    assert_eq!(sim.e.queued(), 0);
    assert_eq!(sim.e.clients(), 1);
    sim.run_to(S + 4 * T5);
    assert_eq!(sim.e.clients(), 0);
    assert_eq!(sim.e.next_expiry(), None, "nothing left to expire");

    // Returning: treated exactly as new (passes, D = a + T).
    let back = 7 * S + 3;
    assert_eq!(sim.arrive(2, 1, back).1, Admission::Depart);
    let (_, x) = sim.arrive(2, 1, back);
    assert_eq!(queued_at(&x), back + T5);
}

#[test]
fn a_slow_client_keeps_its_state_while_its_schedule_is_in_the_future() {
    // 10/h: T = 6 min. Many other clients come and go meanwhile.
    let six_min = 360 * S; // one interval of 10/h
    let mut sim = Sim::new(policy("10/h", 0));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    for i in 0..1_000u32 {
        let t = u64::from(i) * 300 * MS;
        sim.arrive(100 + i, 1, t);
        sim.run_to(t);
    }
    let t = 5 * 60 * S;
    sim.run_to(t);
    assert!(sim.e.clients() >= 1);
    assert!(sim.e.view(sim.route, &1, t).is_some(), "still held");
    // The second request within its interval is not passed at once.
    let retry = full_retry_after(&sim.arrive(1, 1, t).1);
    assert_eq!(retry, six_min - t);
    assert_eq!(sim.arrive(1, 1, six_min).1, Admission::Depart);
}

#[test]
fn a_slow_client_gets_exactly_its_rate_over_the_hour() {
    // 10/h policing (b = 0), one request a minute for an hour while 6,000
    // other clients come and go and states expire: exactly 10 pass, one
    // every 6 minutes, never an early one from a forgotten state.
    let mut sim = Sim::new(policy("10/h", 0));
    let mut passed = Vec::new();
    for minute in 0..60u64 {
        let t = minute * 60 * S;
        for j in 0..100u32 {
            let other = 1_000 + (minute as u32) * 100 + j;
            sim.arrive(other, 1, t + u64::from(j) * MS);
        }
        sim.run_to(t + S);
        if sim.arrive(1, 1, t + S).1 == Admission::Depart {
            passed.push(minute);
        }
    }
    assert_eq!(passed, vec![0, 6, 12, 18, 24, 30, 36, 42, 48, 54]);
}

// === Global bounds ===

#[test]
fn max_clients_refuses_new_clients_with_too_many_clients() {
    let limits = Limits {
        max_clients: 2,
        max_queued: 100,
    };
    let mut sim = Sim::with(policy("5/s", 5), limits, None);
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    assert_eq!(sim.arrive(2, 1, 0).1, Admission::Depart);
    assert_eq!(
        sim.arrive(3, 1, 10 * MS).1,
        Admission::Rejected(Rejection::TooManyClients)
    );
    assert_eq!(sim.e.clients(), 2, "the refused client holds nothing");
    // Known clients are still served.
    assert!(matches!(
        sim.arrive(1, 1, 10 * MS).1,
        Admission::Queued { .. }
    ));
    // Once client 2's state has expired there is room again.
    assert_eq!(sim.arrive(3, 1, T5).1, Admission::Depart);
}

/// At `max_clients`, the states other shards hold past their schedule
/// make room for a new client at once, before any sweep: DESIGN's "a
/// client whose D has passed holds no memory". (Only the arrival's own
/// shard was searched: the rest waited for the releaser's sweep, every
/// 100 ms, and new clients got 503 meanwhile.)
#[test]
fn at_max_clients_expired_states_in_other_shards_make_room() {
    let limits = Limits {
        max_clients: 2,
        max_queued: 100,
    };
    let e: Engine<u32, u32> = Engine::new(limits, 4);
    let route = e.add_route(policy("5/s", 5), e.add_upstream(None));
    // Two keys in shards other than the third's.
    let third = 1_000;
    let home = e.shard_for(route, &third);
    let others: Vec<u32> = (0..1_000)
        .filter(|k| e.shard_for(route, k) != home)
        .take(2)
        .collect();
    for &k in &others {
        assert_eq!(e.admit(route, k, 1, 0, || k), Admission::Depart);
    }
    assert_eq!(
        e.admit(route, third, 1, 10 * MS, || third),
        Admission::Rejected(Rejection::TooManyClients)
    );
    // Both states have passed at T (no sweep ran): room for the third.
    assert_eq!(e.admit(route, third, 1, T5, || third), Admission::Depart);
}

#[test]
fn max_queued_refuses_waiting_requests_with_too_many_queued() {
    let limits = Limits {
        max_clients: 100,
        max_queued: 2,
    };
    let mut sim = Sim::with(policy("5/s", 10), limits, None);
    sim.arrive(1, 1, 0);
    sim.arrive(1, 1, 0);
    sim.arrive(1, 1, 0);
    assert_eq!(sim.e.queued(), 2);
    assert_eq!(
        sim.arrive(1, 1, 0).1,
        Admission::Rejected(Rejection::TooManyQueued),
        "b = 10 has room; the global bound refuses"
    );
    // An idle client needs no queue space: it still passes at once.
    assert_eq!(sim.arrive(2, 1, 0).1, Admission::Depart);
    assert_eq!(
        sim.arrive(2, 1, 0).1,
        Admission::Rejected(Rejection::TooManyQueued)
    );
    // One release frees one place.
    sim.run_to(T5);
    assert_eq!(sim.e.queued(), 1);
    assert!(matches!(sim.arrive(1, 1, T5).1, Admission::Queued { .. }));
}

// === Optional policies ===

#[test]
fn burst_lets_exactly_n_pass_at_once_after_idle_then_paces() {
    let mut p = policy("5/s", 10);
    p.burst = 3;
    let mut sim = Sim::new(p);
    for start in [S, 60 * S] {
        let answers: Vec<Admission> = (0..6).map(|_| sim.arrive(1, 1, start).1).collect();
        assert!(
            answers[..3].iter().all(|a| *a == Admission::Depart),
            "{answers:?}"
        );
        let waits: Vec<u64> = answers[3..].iter().map(queued_at).collect();
        assert_eq!(waits, vec![start + T5, start + 2 * T5, start + 3 * T5]);
        sim.run_to(start + 10 * S);
    }
    let times = sim.departure_times();
    assert_eq!(times.len(), 12);
    assert_eq!(gaps(&times[2..6]), vec![T5; 3], "paced after the burst");
}

#[test]
fn burst_of_one_is_the_same_as_no_burst() {
    for burst in [0, 1] {
        let mut p = policy("5/s", 10);
        p.burst = burst;
        let mut sim = Sim::new(p);
        assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
        assert_eq!(queued_at(&sim.arrive(1, 1, 0).1), T5, "burst {burst}");
    }
}

#[test]
fn max_wait_refuses_a_departure_later_than_arrival_plus_max_wait() {
    let mut p = policy("5/s", 10);
    p.max_wait = Some(500 * MS);
    let mut sim = Sim::new(p);
    sim.arrive(1, 1, 0);
    assert_eq!(queued_at(&sim.arrive(1, 1, 0).1), T5);
    assert_eq!(queued_at(&sim.arrive(1, 1, 0).1), 2 * T5);
    // The next would leave at 600 ms > 0 + 500 ms.
    let a = sim.arrive(1, 1, 0).1;
    assert_eq!(
        a,
        Admission::Rejected(Rejection::MaxWait {
            retry_after: 3 * T5 - 500 * MS
        })
    );
    // Retry-After is exact: 1 ns before, still refused; at it, admitted
    // with a departure exactly max_wait away.
    assert_eq!(
        sim.arrive(1, 1, 100 * MS - 1).1,
        Admission::Rejected(Rejection::MaxWait { retry_after: 1 })
    );
    assert_eq!(queued_at(&sim.arrive(1, 1, 100 * MS).1), 600 * MS);
}

// === The DESIGN seed example ===

/// The rules for one client with no cancellations: each arrival's
/// departure, or `None` when refused. Releases due at an arrival's instant
/// happen before it.
fn reference_one_client(t: u64, b: usize, arrivals: &[u64]) -> Vec<Option<u64>> {
    let mut d = 0u64; // D
    let mut waiting: Vec<u64> = Vec::new(); // departures of the waiting
    arrivals
        .iter()
        .map(|&a| {
            waiting.retain(|&w| w > a);
            if waiting.is_empty() && d <= a {
                d = a + t;
                Some(a)
            } else if waiting.len() < b {
                let dep = d.max(a);
                d = dep + t;
                waiting.push(dep);
                Some(dep)
            } else {
                None
            }
        })
        .collect()
}

#[test]
fn design_seed_example_matches_the_rules() {
    let mut sim = Sim::new(policy("5/s", 10));
    let arrivals: Vec<u64> = (0..20).map(|i| i * 25 * MS).collect();
    let want = reference_one_client(T5, 10, &arrivals);
    let mut ids = Vec::new();
    for &a in &arrivals {
        ids.push(sim.arrive(1, 1, a).0);
    }
    sim.run_to(60 * S);
    let got: Vec<Option<u64>> = ids.iter().map(|&id| sim.departure_of(id)).collect();
    assert_eq!(got, want);

    // The facts the DESIGN page states.
    let admitted: Vec<u32> = sim.departed.iter().map(|d| d.0).collect();
    let mut expected: Vec<u32> = (1..=12).collect();
    expected.push(17); // arrives as 3 departs: released first, then admitted
    assert_eq!(admitted, expected);
    assert_eq!(admitted.len(), 13);
    let times = sim.departure_times();
    assert_eq!(gaps(&times), vec![200 * MS; 12]);
    assert_eq!(*times.last().unwrap(), 2_400 * MS);
}

// === Global cap, fair sharing ===

#[test]
fn backlogged_clients_share_a_global_cap_equally() {
    // R = 100/s over K = 4 clients that could each do 1000/s.
    let cap = 10 * MS;
    let mut sim = Sim::with(policy("1000/s", 1_000), ROOMY, Some(rate("100/s")));
    let mut owner = std::collections::HashMap::new();
    for _ in 0..400 {
        for k in 0..4 {
            let (id, a) = sim.arrive(k, 1, 0);
            assert!(!matches!(a, Admission::Rejected(_)));
            owner.insert(id, k);
        }
    }
    let window = 10 * S;
    sim.run_to(window - 1);
    let times = sim.departure_times();
    assert_eq!(times.len(), 1_000, "R x 10 s");
    assert!(
        gaps(&times).iter().all(|&g| g == cap),
        "upstream departures exactly 1/R apart"
    );
    for k in 0..4 {
        let n = sim.departed.iter().filter(|d| owner[&d.0] == k).count();
        assert!(n.abs_diff(250) <= 1, "client {k} got {n}, R/K x 10 s = 250");
    }
}

#[test]
fn equal_clients_under_a_cap_take_turns() {
    let mut sim = Sim::with(policy("1000/s", 100), ROOMY, Some(rate("100/s")));
    for _ in 0..10 {
        for k in 0..4 {
            sim.arrive(k, 1, 0);
        }
    }
    sim.run_to(S);
    // Ids are 4 i + k + 1: client = (id - 1) % 4. Every 4 departures hold
    // each client once.
    let clients: Vec<u32> = sim.departed.iter().map(|d| (d.0 - 1) % 4).collect();
    for round in clients.chunks(4) {
        let mut r = round.to_vec();
        r.sort();
        assert_eq!(r, vec![0, 1, 2, 3]);
    }
}

/// A heavy client backlogged on one route, a light one on another, both
/// on an upstream capped at 100/s; the light one sends at `every`.
fn light_beside_heavy(light_rate: &str, every: u64) -> (usize, usize, Vec<u64>) {
    let mut sim = Sim::with(policy("1000/s", 10_000), ROOMY, Some(rate("100/s")));
    for _ in 0..2_000 {
        sim.arrive(0, 1, 0);
    }
    let light = sim.add_route(policy(light_rate, 5));
    let mut ids = Vec::new();
    let mut refused = 0;
    let mut t = 0;
    while t < 10 * S {
        let (id, a) = sim.arrive_on(light, 1, 1, t);
        if matches!(a, Admission::Rejected(_)) {
            refused += 1;
        }
        ids.push((id, t));
        t += every;
    }
    sim.run_to(10 * S);
    let waits: Vec<u64> = ids
        .iter()
        .filter_map(|&(id, sent)| sim.departure_of(id).map(|d| d - sent))
        .collect();
    let served = sim
        .departed
        .iter()
        .filter(|d| ids.iter().any(|i| i.0 == d.0))
        .count();
    (served, refused, waits)
}

#[test]
fn a_light_client_is_not_starved_by_a_heavy_one() {
    // The light client sends 20/s (< R/2), far below its per-client rate:
    // every request goes, each within one cap slot of its arrival.
    let (served, refused, waits) = light_beside_heavy("1000/s", 50 * MS);
    assert_eq!(refused, 0);
    assert_eq!(served, 200);
    assert!(waits.iter().all(|&w| w <= 10 * MS), "{waits:?}");
}

#[test]
fn a_light_client_keeps_its_own_rate_beside_a_backlogged_heavy_one() {
    // A light client (sending 20/s, well below R/2 = 50/s and below its
    // per-client rate of 40/s) beside a backlogged heavy one is served at
    // the rate it sends: all 200 in 10 s, nothing refused.
    //
    // Sending at exactly its per-client rate r instead cannot keep r under
    // contention: each departure the cap delays by d moves D to d + c·T
    // (DESIGN: "When it departs, D = d + c·T"; "departures never come closer
    // than c·T"), so it gets 1/(T + d). DESIGN's spacing invariant wins;
    // see under_a_cap_one_clients_departures_never_come_closer_than_c_times_t.
    let (served, refused, _) = light_beside_heavy("40/s", 50 * MS);
    assert_eq!(refused, 0, "refused below its own rate");
    assert_eq!(served, 200);
}

#[test]
fn under_a_cap_one_clients_departures_never_come_closer_than_c_times_t() {
    // R = 100/s (a slot every 10 ms); the client's own T = 25 ms. Client 1
    // takes the cap's slot at 0, so client 2's first request waits for the
    // slot at 10 ms. It departed at d = 10 ms, so D = d + T = 35 ms: its
    // second request may not leave before 35 ms (DESIGN: "When it departs,
    // D = d + c·T"; "Departures never come closer than c·T").
    let mut sim = Sim::with(policy("40/s", 5), ROOMY, Some(rate("100/s")));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    let (a, _) = sim.arrive(2, 1, 0);
    let (b, _) = sim.arrive(2, 1, 0);
    sim.run_to(S);
    assert_eq!(sim.departure_of(a), Some(10 * MS));
    let second = sim.departure_of(b).unwrap();
    assert!(
        second >= 10 * MS + 25 * MS,
        "second departure {} ms after the first, T = 25 ms",
        (second - 10 * MS) as f64 / MS as f64
    );
}

#[test]
fn under_a_cap_a_burst_still_lets_n_pass_without_the_clients_own_pacing() {
    // burst = 3 at 5/s (τ = 2 T = 400 ms) under R = 100/s: after idle,
    // three requests pass at the cap's slots (0, 10, 20 ms); only the
    // fourth waits for the client's own schedule. By the rules: #1 at 0
    // sets D = T; #2 at 10 ms has D − τ <= 10 ms, D = max(D, 10 ms) + T =
    // 2 T; #3 at 20 ms has D − τ = 0, D = 3 T; #4 waits for D − τ = T.
    let mut p = policy("5/s", 10);
    p.burst = 3;
    let mut sim = Sim::with(p, ROOMY, Some(rate("100/s")));
    for _ in 0..4 {
        sim.arrive(1, 1, 0);
    }
    sim.run_to(10 * S);
    assert_eq!(sim.departure_times(), vec![0, 10 * MS, 20 * MS, T5]);
}

#[test]
fn under_a_cap_a_burst_passes_with_a_pacer_a_little_late() {
    // As above, with every release 1 µs after its instant, as a real
    // pacer's are (it reads the clock again after waking): still 0, 10,
    // 20 ms and T; no release counts as late, nor eats the burst.
    let mut p = policy("5/s", 10);
    p.burst = 3;
    let e: Engine<u32, u32> = Engine::new(ROOMY, SHARDS);
    let up = e.add_upstream(Some(rate("100/s")));
    let r = e.add_route(p, up);
    let mut times = Vec::new();
    for id in 0..4 {
        if e.admit(r, 1, 1, 0, || id) == Admission::Depart {
            times.push(0);
        }
    }
    let mut out = Vec::new();
    while let Some(at) = e.next_release() {
        out.clear();
        e.release_due(at + 1_000, &mut out);
        times.extend(out.iter().map(|_| at));
    }
    assert_eq!(times, vec![0, 10 * MS, 20 * MS, T5]);
}

#[test]
fn a_faster_cap_on_reload_scales_what_is_left_of_its_slot() {
    // The cap at 1/m gave its slot at 0 (the next is at 60 s); reloaded to
    // 100/s at 1 s, a new client waits what is left scaled (59 s x
    // 100/s per 1/m: under 10 ms), not the rest of the minute.
    let mut sim = Sim::with(policy("5/s", 5), ROOMY, Some(rate("1/m")));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    sim.e
        .set_upstream_rate(sim.upstream, Some(rate("100/s")), S);
    let (id, a) = sim.arrive(2, 1, S);
    let at = match a {
        Admission::Depart => S,
        _ => {
            sim.run_to(61 * S);
            sim.departure_of(id).unwrap_or(u64::MAX)
        }
    };
    assert!(at <= S + 10 * MS, "departs at {at} ns");
}

#[test]
fn a_cap_changed_on_reload_keeps_the_pause_the_upstream_asked_for() {
    // Paused for 10 minutes at 1/s, then the rate changes: the pause
    // still ends at 10 minutes, neither halved (2/s), stretched (1/m)
    // nor dropped (no rate).
    const MIN: u64 = 60 * S;
    for (new, due) in [
        (Some(rate("2/s")), 10 * MIN),
        (Some(rate("1/m")), 10 * MIN),
        (None, 10 * MIN),
    ] {
        let mut sim = Sim::with(policy("5/s", 5), ROOMY, Some(rate("1/s")));
        assert!(sim.e.pause(sim.upstream, 10 * MIN));
        sim.e.set_upstream_rate(sim.upstream, new, S);
        let (id, a) = sim.arrive(1, 1, 2 * S);
        assert!(matches!(a, Admission::Queued { .. }), "{new:?}: {a:?}");
        sim.run_to(11 * 60 * MIN);
        assert_eq!(sim.departure_of(id), Some(due), "{new:?}");
    }
}

#[test]
fn an_idle_client_under_a_free_cap_departs_at_once() {
    let mut sim = Sim::with(policy("5/s", 5), ROOMY, Some(rate("100/s")));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    // The cap's next slot is 10 ms: another idle client there passes.
    assert_eq!(sim.arrive(2, 1, 10 * MS).1, Admission::Depart);
    // At 15 ms the cap binds (next slot 20 ms): it waits for that slot.
    let (id, a) = sim.arrive(3, 1, 15 * MS);
    assert!(matches!(a, Admission::Queued { .. }), "{a:?}");
    sim.run_to(S);
    assert_eq!(sim.departure_of(id), Some(20 * MS));
    // Free again later: no added latency.
    assert_eq!(sim.arrive(4, 1, 2 * S).1, Admission::Depart);
}

#[test]
fn under_a_cap_a_queued_request_is_never_told_a_departure_before_its_arrival() {
    // DESIGN: a request arriving at a may depart at d = max(a, D). R =
    // 100/s, the client's own T = 1 ms. #1 takes the cap's slot at 0; #2
    // and #3 wait for the cap (slots 10 and 20 ms); #4 at 5 ms leaves at
    // 30 ms and is never told a departure before it arrived. Regression:
    // the engine told it 1 ms + 2 x 1 ms = 3 ms, from the client's own
    // schedule alone.
    let mut sim = Sim::with(policy("1000/s", 10), ROOMY, Some(rate("100/s")));
    sim.arrive(1, 1, 0);
    sim.arrive(1, 1, 0);
    sim.arrive(1, 1, 0);
    let (id, a) = sim.arrive(1, 1, 5 * MS);
    sim.run_to(S);
    assert_eq!(sim.departure_of(id), Some(30 * MS));
    assert!(queued_at(&a) >= 5 * MS, "told {a:?} at 5 ms");
}

#[test]
fn under_a_cap_max_wait_refuses_a_request_the_cap_holds_past_max_wait() {
    // R = 10/s: after client 1 departs at 0 no request reaches the upstream
    // before 100 ms. Client 2 (idle, max_wait 50 ms) arrives at 0: its
    // departure is at least 100 ms > 0 + 50 ms, so DESIGN refuses it at
    // admission. Regression: the engine admitted it (told departure 0,
    // its own schedule's) and it waited 100 ms.
    let mut p = policy("1000/s", 10);
    p.max_wait = Some(50 * MS);
    let mut sim = Sim::with(p, ROOMY, Some(rate("10/s")));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    let (id, a) = sim.arrive(2, 1, 0);
    sim.run_to(S);
    assert!(
        matches!(a, Admission::Rejected(Rejection::MaxWait { .. })),
        "admitted ({a:?}), departed at {:?}",
        sim.departure_of(id)
    );
}

#[test]
fn under_a_cap_retry_after_is_the_time_until_the_queue_accepts() {
    // R = 10/s (a slot every 100 ms), the client's own T = 1 ms, b = 2. #1
    // takes the slot at 0; #2 and #3 wait for the slots at 100 and 200
    // ms. #4 at 5 ms is refused; the queue accepts again when #2 leaves at
    // 100 ms, so retry_after = 95 ms, and a retry then is queued.
    // Regression: the engine said 1 ns (its walk started from #2's own due
    // time, 1 ms, already past), and a retry then was refused again.
    let mut sim = Sim::with(policy("1000/s", 2), ROOMY, Some(rate("10/s")));
    sim.arrive(1, 1, 0);
    sim.arrive(1, 1, 0);
    sim.arrive(1, 1, 0);
    let retry = full_retry_after(&sim.arrive(1, 1, 5 * MS).1);
    let again = sim.arrive(1, 1, 5 * MS + retry).1;
    assert!(
        matches!(again, Admission::Queued { .. }),
        "retry_after {retry} ns, then {again:?}"
    );
    assert_eq!(retry, 95 * MS);
}

#[test]
fn with_nothing_waiting_a_busy_cap_gives_its_next_slot_as_retry_after() {
    // b = 0 under R = 10/s: client 1 takes the cap's slot at 0; client 2,
    // new, and client 1 again at 10 ms (its own T = 1 ms has passed) are
    // refused only for the cap. The queue (none) accepts them at the
    // cap's next slot, 100 ms: retry_after 90 ms, and a retry then
    // passes. (It said 1 ns, Retry-After 1, and a client retrying every
    // second of a long pause was refused each time.)
    let mut sim = Sim::with(policy("1000/s", 0), ROOMY, Some(rate("10/s")));
    assert!(matches!(sim.arrive(1, 1, 0).1, Admission::Depart));
    assert_eq!(full_retry_after(&sim.arrive(2, 1, 10 * MS).1), 90 * MS);
    assert_eq!(full_retry_after(&sim.arrive(1, 1, 10 * MS).1), 90 * MS);
    assert!(matches!(sim.arrive(2, 1, 100 * MS).1, Admission::Depart));
}

#[test]
fn a_ticket_from_before_memory_was_released_never_matches_a_new_request() {
    // Regression: releasing an emptied shard's arenas restarted entry
    // generations, so an old ticket cancelled a new request in its place.
    let mut sim = Sim::with(policy("5/s", 10), ROOMY, None);
    sim.arrive(1, 1, 0);
    let (_, queued) = sim.arrive(1, 1, 0);
    let old = ticket(&queued);
    sim.run_to(10 * S); // departs; the shard empties
    assert_eq!(sim.e.clients(), 0);
    sim.run_to(11 * S); // a sweep with nothing new since: compacted
    sim.arrive(1, 1, 20 * S);
    let (_, again) = sim.arrive(1, 1, 20 * S);
    assert!(matches!(again, Admission::Queued { .. }));
    assert_eq!(sim.e.cancel(old, 20 * S), None, "the old ticket is stale");
    assert_eq!(sim.e.queued(), 1);
}

#[test]
fn the_next_sweep_is_when_the_first_held_client_may_be_forgotten() {
    // What the releaser sleeps on: an hourly client is held for an hour,
    // and nothing needs a sweep before then; an arrival that departs at
    // once on a 100/s route makes one due 10 ms later, and says so once.
    let mut sim = Sim::new(policy("1/h", 1));
    assert_eq!(sim.e.next_sweep(), None, "nothing held");
    sim.arrive(1, 1, 0);
    let hour = 3600 * S;
    // Expiries are kept in buckets of 2^26 ns (67 ms), by their start.
    let bucket = 1 << 26;
    let hourly = sim.e.next_sweep().expect("the hourly client is held");
    assert!(hourly <= hour && hour - hourly < bucket, "{hourly}");
    assert!(!sim.e.sweep_moved_earlier(), "the releaser has read it");

    let fast = sim.add_route(policy("100/s", 1));
    sim.arrive_on(fast, 2, 1, S);
    assert!(sim.e.sweep_moved_earlier(), "an earlier sweep is news");
    assert!(!sim.e.sweep_moved_earlier(), "told once");
    let soon = sim.e.next_sweep().expect("planned");
    assert!(soon <= S + 10 * MS && S + 10 * MS - soon < bucket, "{soon}");
    // A later one changes nothing.
    sim.arrive_on(fast, 3, 1, S + 5 * MS);
    assert!(!sim.e.sweep_moved_earlier());
    assert_eq!(sim.e.next_sweep(), Some(soon));

    // Swept: the fast clients are forgotten. A shard they leave empty
    // gives its memory back at the next sweep with nothing new, so one
    // may be planned at once (at 0, "as soon as one may come", for a shard
    // that lost its last client); after that, the hourly client's again.
    sim.run_to(3 * S);
    assert_eq!(sim.e.clients(), 1);
    let next = sim.e.next_sweep();
    assert!(next.is_some_and(|n| n <= 3 * S || n == hourly), "{next:?}");
    sim.run_to(4 * S);
    assert_eq!(sim.e.next_sweep(), Some(hourly));
    // Past the hour, everything is forgotten: one more sweep gives the
    // last shard's memory back, then none is planned.
    sim.run_to(hour + S);
    assert_eq!(sim.e.clients(), 0);
    assert_eq!(sim.e.next_sweep(), Some(0));
    sim.run_to(hour + 2 * S);
    assert_eq!(sim.e.next_sweep(), None);
}
