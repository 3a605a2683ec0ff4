//! The engine against every rule of DESIGN section 1, with explicit
//! instants (nanoseconds) and a perfect pacer: no clock, no sleeping.

use sluice::shaper::{Admission, Engine, Limits, Policy, Rate, Rejection, RouteId, Ticket};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
const LIMITS: Limits = Limits {
    max_clients: 1_000,
    max_queued: 1_000,
};

fn rate(s: &str) -> Rate {
    s.parse().unwrap()
}

/// An engine on one uncapped route, with a perfect pacer that releases
/// every request exactly at its scheduled instant.
struct Sim {
    e: Engine<u32, u32>,
    route: RouteId,
    next_id: u32,
    /// (request id, departure instant)
    departed: Vec<(u32, u64)>,
}

impl Sim {
    fn new(policy: Policy) -> Sim {
        let mut e = Engine::new(LIMITS);
        let up = e.add_upstream(None);
        let route = e.add_route(policy, up);
        Sim {
            e,
            route,
            next_id: 0,
            departed: Vec::new(),
        }
    }

    /// Release everything due up to and including `t`, each at its
    /// scheduled instant.
    fn run_to(&mut self, t: u64) {
        while let Some(at) = self.e.next_release() {
            if at > t {
                break;
            }
            let mut out = Vec::new();
            self.e.release_due(at, &mut out);
            self.departed.extend(out.into_iter().map(|id| (id, at)));
        }
        self.e.expire(t);
    }

    /// An arrival of `cost` for `key` at `t` (releases due at `t` first).
    fn arrive(&mut self, key: u32, cost: u32, t: u64) -> (u32, Admission) {
        self.run_to(t);
        self.next_id += 1;
        let id = self.next_id;
        let a = self.e.admit(self.route, key, cost, t, || id);
        if a == Admission::Depart {
            self.departed.push((id, t));
        }
        (id, a)
    }

    fn departure_of(&self, id: u32) -> Option<u64> {
        self.departed.iter().find(|(i, _)| *i == id).map(|d| d.1)
    }
}

fn ticket(a: &Admission) -> Ticket {
    match a {
        Admission::Queued { ticket, .. } => *ticket,
        other => panic!("expected queued, got {other:?}"),
    }
}

#[test]
fn idle_client_departs_at_once() {
    let mut sim = Sim::new(Policy::new(rate("5/s"), 10));
    assert_eq!(sim.arrive(1, 1, 7 * MS).1, Admission::Depart);
    // And again once its schedule has passed.
    assert_eq!(sim.arrive(1, 1, 7 * MS + 200 * MS).1, Admission::Depart);
}

#[test]
fn one_clients_requests_depart_in_arrival_order_exactly_t_apart() {
    let mut sim = Sim::new(Policy::new(rate("5/s"), 10));
    let ids: Vec<u32> = (0..6).map(|i| sim.arrive(1, 1, i * MS).0).collect();
    sim.run_to(10 * S);
    let order: Vec<u32> = sim.departed.iter().map(|d| d.0).collect();
    assert_eq!(order, ids);
    for (k, (_, at)) in sim.departed.iter().enumerate() {
        assert_eq!(*at, k as u64 * 200 * MS, "departure {k}");
    }
}

#[test]
fn late_releases_keep_the_absolute_grid_no_drift() {
    // A pacer that is always T/3 late still releases on the grid: the k-th
    // scheduled slot is exactly k*T, whatever the lateness.
    let t = 10 * MS;
    let mut e: Engine<u32, u32> = Engine::new(LIMITS);
    let up = e.add_upstream(None);
    let route = e.add_route(Policy::new(rate("100/s"), 1_000), up);
    for i in 0..500 {
        let _ = e.admit(route, 1, 1, 0, || i);
    }
    let mut out = Vec::new();
    for k in 1..400u64 {
        let scheduled = e.next_release().unwrap();
        assert_eq!(scheduled, k * t, "slot {k} drifted");
        e.release_due(scheduled + t / 3, &mut out);
    }
    assert_eq!(out.len(), 399, "one release per slot");
}

#[test]
fn a_stalled_pacer_releases_no_catch_up_burst() {
    let t = 10 * MS;
    let mut e: Engine<u32, u32> = Engine::new(LIMITS);
    let up = e.add_upstream(None);
    let route = e.add_route(Policy::new(rate("100/s"), 100), up);
    for i in 0..10 {
        let _ = e.admit(route, 1, 1, 0, || i);
    }
    // The first departed at once; the next is due at T. Release 3.5 T late:
    let late = t + 35 * t / 10;
    let mut out = Vec::new();
    e.release_due(late, &mut out);
    assert_eq!(out, vec![1], "exactly one released, no burst");
    assert_eq!(
        e.next_release(),
        Some(late + t),
        "the schedule restarts from the release"
    );
}

#[test]
fn capacity_is_counted_in_cost_units() {
    let mut sim = Sim::new(Policy::new(rate("10/s"), 5));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    let (five, a) = sim.arrive(1, 5, MS);
    assert!(matches!(a, Admission::Queued { .. }));
    assert!(matches!(
        sim.arrive(1, 1, 2 * MS).1,
        Admission::Rejected(Rejection::Full { .. })
    ));
    // It departs at T, and the next one 5 T after it.
    let (next, _) = sim.arrive(1, 1, 150 * MS);
    sim.run_to(10 * S);
    assert_eq!(sim.departure_of(five), Some(100 * MS));
    assert_eq!(sim.departure_of(next), Some(600 * MS));
}

#[test]
fn zero_capacity_is_pure_policing() {
    let mut sim = Sim::new(Policy::new(rate("1/s"), 0));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    match sim.arrive(1, 1, 100 * MS).1 {
        Admission::Rejected(Rejection::Full { retry_after }) => assert_eq!(retry_after, 900 * MS),
        other => panic!("{other:?}"),
    }
    assert_eq!(sim.e.queued(), 0);
    assert_eq!(sim.arrive(1, 1, S).1, Admission::Depart);
}

#[test]
fn cancellation_frees_the_place_and_gives_the_slot_to_the_next() {
    let mut sim = Sim::new(Policy::new(rate("5/s"), 2));
    sim.arrive(1, 1, 0);
    let (_, second) = sim.arrive(1, 1, MS);
    let (third, _) = sim.arrive(1, 1, 2 * MS);
    // Full now; cancelling the second frees a place...
    assert!(matches!(sim.arrive(1, 1, 3 * MS).1, Admission::Rejected(_)));
    assert_eq!(sim.e.cancel(ticket(&second), 4 * MS), Some(2));
    let (fourth, a) = sim.arrive(1, 1, 5 * MS);
    assert!(matches!(a, Admission::Queued { .. }));
    sim.run_to(10 * S);
    // ...and the third takes the second's slot (200 ms), the fourth 400 ms.
    assert_eq!(
        sim.departure_of(2),
        None,
        "a cancelled request never departs"
    );
    assert_eq!(sim.departure_of(third), Some(200 * MS));
    assert_eq!(sim.departure_of(fourth), Some(400 * MS));
    // Cancelling a released ticket does nothing.
    assert_eq!(sim.e.cancel(ticket(&second), 11 * S), None);
}

#[test]
fn retry_after_is_the_time_until_the_queue_accepts() {
    let mut sim = Sim::new(Policy::new(rate("5/s"), 3));
    for i in 0..4 {
        sim.arrive(1, 1, i * MS);
    }
    let at = 10 * MS;
    let Admission::Rejected(Rejection::Full { retry_after }) = sim.arrive(1, 1, at).1 else {
        panic!("expected a full queue");
    };
    // The first waiting request departs at 200 ms and frees a place.
    assert_eq!(at + retry_after, 200 * MS);
    let mut early = Sim::new(Policy::new(rate("5/s"), 3));
    for i in 0..4 {
        early.arrive(1, 1, i * MS);
    }
    assert!(matches!(
        early.arrive(1, 1, at + retry_after - 1).1,
        Admission::Rejected(_)
    ));
    assert!(matches!(
        sim.arrive(1, 1, at + retry_after).1,
        Admission::Queued { .. }
    ));
}

#[test]
fn idle_state_is_dropped_and_a_returning_client_is_new() {
    let mut sim = Sim::new(Policy::new(rate("5/s"), 10));
    for k in 0..50 {
        sim.arrive(k, 1, 0);
    }
    assert_eq!(sim.e.clients(), 50);
    sim.run_to(200 * MS);
    assert_eq!(sim.e.clients(), 0, "states whose schedule passed are gone");
    assert_eq!(sim.arrive(3, 1, 300 * MS).1, Admission::Depart);
}

#[test]
fn a_slow_clients_state_is_kept_while_its_slot_is_in_the_future() {
    let mut sim = Sim::new(Policy::new(rate("10/h"), 0));
    assert_eq!(sim.arrive(1, 1, 0).1, Admission::Depart);
    sim.run_to(300 * S);
    assert_eq!(sim.e.clients(), 1);
    assert!(
        matches!(sim.arrive(1, 1, 300 * S).1, Admission::Rejected(_)),
        "must not pass again early"
    );
    assert_eq!(sim.arrive(1, 1, 360 * S).1, Admission::Depart);
}

#[test]
fn max_clients_and_max_queued_are_refused_distinctly() {
    let mut e: Engine<u32, u32> = Engine::new(Limits {
        max_clients: 2,
        max_queued: 1,
    });
    let up = e.add_upstream(None);
    let r = e.add_route(Policy::new(rate("1/s"), 10), up);
    assert_eq!(e.admit(r, 1, 1, 0, || 1), Admission::Depart);
    assert_eq!(e.admit(r, 2, 1, 0, || 2), Admission::Depart);
    assert_eq!(
        e.admit(r, 3, 1, 0, || 3),
        Admission::Rejected(Rejection::TooManyClients)
    );
    assert!(matches!(
        e.admit(r, 1, 1, 0, || 4),
        Admission::Queued { .. }
    ));
    assert_eq!(
        e.admit(r, 2, 1, 0, || 5),
        Admission::Rejected(Rejection::TooManyQueued)
    );
}

#[test]
fn burst_lets_n_pass_at_once_after_idle_then_paces() {
    let mut sim = Sim::new(Policy {
        burst: 3,
        ..Policy::new(rate("2/s"), 10)
    });
    let ids: Vec<(u32, Admission)> = (0..5).map(|_| sim.arrive(1, 1, 0)).collect();
    assert!(ids[..3].iter().all(|(_, a)| *a == Admission::Depart));
    assert!(matches!(ids[3].1, Admission::Queued { .. }));
    sim.run_to(10 * S);
    assert_eq!(sim.departure_of(ids[3].0), Some(500 * MS));
    assert_eq!(sim.departure_of(ids[4].0), Some(1_000 * MS));
    // Tokens refill while idle: 1.5 s after the last departure, 3 again.
    let t = 1_000 * MS + 1_500 * MS;
    assert!((0..3).all(|_| sim.arrive(1, 1, t).1 == Admission::Depart));
    assert!(matches!(sim.arrive(1, 1, t).1, Admission::Queued { .. }));
}

#[test]
fn max_wait_refuses_departures_later_than_allowed() {
    let mut sim = Sim::new(Policy {
        max_wait: Some(S),
        ..Policy::new(rate("2/s"), 10)
    });
    let answers: Vec<Admission> = (0..5).map(|_| sim.arrive(1, 1, 0).1).collect();
    assert!(matches!(answers[2], Admission::Queued { departure, .. } if departure == S));
    assert_eq!(
        answers[3],
        Admission::Rejected(Rejection::MaxWait {
            retry_after: 500 * MS
        })
    );
}

/// DESIGN section 1 seed example; expected outcome computed by a tiny
/// reference of the rules, then checked against the stated facts.
#[test]
fn seed_example() {
    let mut sim = Sim::new(Policy::new(rate("5/s"), 10));
    let answers: Vec<(u32, Admission)> = (0..20).map(|i| sim.arrive(1, 1, i * 25 * MS)).collect();
    sim.run_to(10 * S);
    // Reference: D, and the departure times of waiting requests.
    let (mut d, mut waiting, mut expected) = (0u64, Vec::<u64>::new(), Vec::new());
    for i in 0..20u64 {
        let a = i * 25 * MS;
        waiting.retain(|&dep| dep > a);
        if waiting.is_empty() && d <= a {
            d = a + 200 * MS;
            expected.push(Some(a));
        } else if waiting.len() < 10 {
            let dep = d.max(a);
            d = dep + 200 * MS;
            waiting.push(dep);
            expected.push(Some(dep));
        } else {
            expected.push(None);
        }
    }
    let got: Vec<Option<u64>> = answers
        .iter()
        .map(|(id, _)| sim.departure_of(*id))
        .collect();
    assert_eq!(got, expected);
    let admitted: Vec<u64> = got.iter().flatten().copied().collect();
    assert_eq!(admitted.len(), 13);
    assert!(admitted.windows(2).all(|w| w[1] - w[0] == 200 * MS));
    assert_eq!(admitted.last(), Some(&(2_400 * MS)));
    assert!(
        got[16].is_some() != got[17].is_some(),
        "exactly one of 17 and 18"
    );
}

/// Global cap helpers: several clients on a capped upstream.
fn capped(cap: &str, per_client: &str, capacity: u32) -> (Engine<u32, (u32, u32)>, RouteId) {
    let mut e = Engine::new(LIMITS);
    let up = e.add_upstream(Some(rate(cap)));
    let r = e.add_route(Policy::new(rate(per_client), capacity), up);
    (e, r)
}

fn drive(e: &mut Engine<u32, (u32, u32)>, until: u64) -> Vec<((u32, u32), u64)> {
    let mut departed = Vec::new();
    while let Some(at) = e.next_release() {
        if at > until {
            break;
        }
        let mut out = Vec::new();
        e.release_due(at, &mut out);
        departed.extend(out.into_iter().map(|p| (p, at)));
    }
    departed
}

#[test]
fn k_backlogged_clients_share_a_global_cap_equally() {
    // R = 40/s over 4 clients that could each do 100/s.
    let (mut e, r) = capped("40/s", "100/s", 200);
    for k in 0..4u32 {
        for i in 0..200u32 {
            let _ = e.admit(r, k, 1, 0, || (k, i));
        }
    }
    let departed = drive(&mut e, 10 * S);
    let mut times: Vec<u64> = departed.iter().map(|d| d.1).collect();
    times.sort();
    assert!(
        times.windows(2).all(|w| w[1] - w[0] >= 25 * MS),
        "spaced 1/R at the upstream"
    );
    let window = |k: u32| {
        departed
            .iter()
            .filter(|((c, _), at)| *c == k && (2 * S..7 * S).contains(at))
            .count()
    };
    for k in 0..4 {
        let n = window(k);
        assert!(
            (49..=51).contains(&n),
            "client {k}: {n} in 5 s (R/K = 10/s)"
        );
    }
}

#[test]
fn a_light_client_keeps_its_rate_beside_a_heavy_one() {
    let (mut e, r) = capped("20/s", "100/s", 1_000);
    for i in 0..1_000u32 {
        let _ = e.admit(r, 0, 1, 0, || (0, i));
    }
    // The light client sends 2/s; each should go within one global slot.
    let mut light = Vec::new();
    let mut departed = Vec::new();
    for i in 0..10u64 {
        let at = 100 * MS + i * 500 * MS;
        departed.extend(drive(&mut e, at));
        let a = e.admit(r, 1, 1, at, || (1, i as u32));
        light.push((at, a));
    }
    departed.extend(drive(&mut e, 10 * S));
    for (i, (sent, a)) in light.iter().enumerate() {
        let left = match a {
            Admission::Depart => *sent,
            Admission::Queued { .. } => departed
                .iter()
                .find(|(p, _)| *p == (1, i as u32))
                .map(|d| d.1)
                .unwrap(),
            other => panic!("{other:?}"),
        };
        assert!(
            left - sent <= 2 * 50 * MS,
            "light request {i} waited {} ms",
            (left - sent) / MS
        );
    }
}

#[test]
fn an_idle_client_departs_at_once_under_a_free_cap() {
    let (mut e, r) = capped("10/s", "10/s", 5);
    assert_eq!(e.admit(r, 1, 1, 0, || (1, 0)), Admission::Depart);
    assert_eq!(e.admit(r, 2, 1, 100 * MS, || (2, 0)), Admission::Depart);
    // The cap's next slot is 200 ms: a third client at 150 ms waits.
    assert!(matches!(
        e.admit(r, 3, 1, 150 * MS, || (3, 0)),
        Admission::Queued { .. }
    ));
}
