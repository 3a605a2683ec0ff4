//! Property test: random arrivals, costs and cancellations through the
//! engine and through a small, independent reference model written from
//! the rules of DESIGN section 1. Both must make identical decisions
//! (including Retry-After) and identical departures; the invariants (never
//! more than b waiting, spacing never below c·T, FIFO) must hold.

use std::collections::HashMap;

use proptest::prelude::*;
use sluice::shaper::{Admission, Engine, Limits, Policy, Rate, Rejection, Ticket};

#[derive(Debug, Clone)]
enum Op {
    Arrive { gap: u64, key: u32, cost: u32 },
    Cancel { pick: usize },
}

fn op(step: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..=3 * step, 0..3u32, 1..=4u32).prop_map(|(gap, key, cost)| Op::Arrive { gap, key, cost }),
        1 => any::<usize>().prop_map(|pick| Op::Cancel { pick }),
    ]
}

/// The reference: per client, D and the list of waiting requests; the
/// departures of each client computed by walking its own queue in time.
#[derive(Default, Clone)]
struct RefClient {
    d: u64,
    queue: Vec<(u32, u64, u32)>, // (id, arrival, cost)
}

struct Model {
    t: u64, // T
    b: u64,
    tau: u64,
    clients: HashMap<u32, RefClient>,
    departed: Vec<(u32, u32, u64, u32)>, // (key, id, at, cost)
}

impl Model {
    /// When the head of `c` departs.
    fn head_due(&self, c: &RefClient) -> Option<u64> {
        c.queue
            .first()
            .map(|&(_, a, _)| a.max(c.d.saturating_sub(self.tau)))
    }

    /// Depart everything due at or before `now`, in time order.
    fn advance(&mut self, now: u64) {
        loop {
            let next = self
                .clients
                .iter()
                .filter_map(|(k, c)| self.head_due(c).map(|due| (due, *k)))
                .filter(|(due, _)| *due <= now)
                .min();
            let Some((due, k)) = next else { return };
            let t = self.t;
            let c = self.clients.get_mut(&k).unwrap();
            let (id, _, cost) = c.queue.remove(0);
            c.d = c.d.max(due) + u64::from(cost) * t;
            self.departed.push((k, id, due, cost));
        }
    }

    /// Time from `now` until client `c`'s queue would take `cost`, found by
    /// playing its future departures forward.
    fn accepts_at(&self, c: &RefClient, cost: u32) -> u64 {
        let mut sim = c.clone();
        loop {
            let waiting: u64 = sim.queue.iter().map(|e| u64::from(e.2)).sum();
            if sim.queue.is_empty() {
                return sim.d.saturating_sub(self.tau);
            }
            let due = self.head_due(&sim).unwrap();
            let (_, _, c0) = sim.queue.remove(0);
            sim.d = sim.d.max(due) + u64::from(c0) * self.t;
            if u64::from(cost) <= self.b && waiting - u64::from(c0) + u64::from(cost) <= self.b {
                return due;
            }
        }
    }

    fn arrive(&mut self, key: u32, cost: u32, id: u32, now: u64) -> Result<bool, u64> {
        self.advance(now);
        let (t, tau, b) = (self.t, self.tau, self.b);
        let c = self.clients.entry(key).or_default();
        if c.queue.is_empty() && c.d.saturating_sub(tau) <= now {
            c.d = c.d.max(now) + u64::from(cost) * t;
            self.departed.push((key, id, now, cost));
            return Ok(true);
        }
        let waiting: u64 = c.queue.iter().map(|e| u64::from(e.2)).sum();
        if waiting + u64::from(cost) > b {
            let c = c.clone();
            return Err(self.accepts_at(&c, cost).saturating_sub(now).max(1));
        }
        c.queue.push((id, now, cost));
        Ok(false)
    }

    fn cancel(&mut self, id: u32) -> bool {
        for c in self.clients.values_mut() {
            if let Some(i) = c.queue.iter().position(|e| e.0 == id) {
                c.queue.remove(i);
                return true;
            }
        }
        false
    }
}

fn run(per_second: u32, capacity: u32, burst: u32, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let rate = Rate::per_second(f64::from(per_second)).unwrap();
    let t = rate.interval_nanos();
    let mut engine: Engine<u32, u32> = Engine::new(Limits {
        max_clients: 100,
        max_queued: 1_000,
    });
    let up = engine.add_upstream(None);
    let route = engine.add_route(
        Policy {
            burst,
            ..Policy::new(rate, capacity)
        },
        up,
    );
    let mut model = Model {
        t,
        b: u64::from(capacity),
        tau: u64::from(burst.saturating_sub(1)) * t,
        clients: HashMap::new(),
        departed: Vec::new(),
    };
    let mut now = 0u64;
    let mut issued: Vec<(u32, Option<Ticket>)> = Vec::new();
    let mut engine_departed: Vec<(u32, u64)> = Vec::new();
    let release_until = |engine: &mut Engine<u32, u32>, until: u64, log: &mut Vec<(u32, u64)>| {
        while let Some(at) = engine.next_release() {
            if at > until {
                break;
            }
            let mut out = Vec::new();
            engine.release_due(at, &mut out);
            log.extend(out.into_iter().map(|id| (id, at)));
        }
    };
    for (n, op) in ops.into_iter().enumerate() {
        let id = n as u32;
        match op {
            Op::Arrive { gap, key, cost } => {
                now += gap;
                release_until(&mut engine, now, &mut engine_departed);
                let got = engine.admit(route, key, cost, now, || id);
                let want = model.arrive(key, cost, id, now);
                match (&got, want) {
                    (Admission::Depart, Ok(true)) => engine_departed.push((id, now)),
                    (Admission::Queued { ticket, .. }, Ok(false)) => {
                        issued.push((id, Some(*ticket)))
                    }
                    (Admission::Rejected(Rejection::Full { retry_after }), Err(r)) => {
                        prop_assert_eq!(*retry_after, r, "retry_after for request {}", id);
                    }
                    (g, w) => prop_assert!(false, "request {id}: engine {g:?}, model {w:?}"),
                }
                for (k, c) in &model.clients {
                    let waiting: u64 = c.queue.iter().map(|e| u64::from(e.2)).sum();
                    prop_assert!(
                        waiting <= u64::from(capacity),
                        "client {k} holds {waiting} > b"
                    );
                }
            }
            Op::Cancel { pick } => {
                if issued.is_empty() {
                    continue;
                }
                let (victim, ticket) = issued[pick % issued.len()];
                let Some(ticket) = ticket else { continue };
                release_until(&mut engine, now, &mut engine_departed);
                model.advance(now);
                let in_model = model.cancel(victim);
                let in_engine = engine.cancel(ticket, now).is_some();
                prop_assert_eq!(in_engine, in_model, "cancel of {}", victim);
            }
        }
    }
    release_until(&mut engine, u64::MAX, &mut engine_departed);
    model.advance(u64::MAX);

    let mut want: Vec<(u32, u64)> = model.departed.iter().map(|d| (d.1, d.2)).collect();
    let mut got = engine_departed.clone();
    want.sort();
    got.sort();
    prop_assert_eq!(&got, &want);

    // Spacing and FIFO per client, from the model's record (equal to the
    // engine's, checked above).
    let mut by_client: HashMap<u32, Vec<(u64, u32, u32)>> = HashMap::new();
    for (k, id, at, cost) in &model.departed {
        by_client.entry(*k).or_default().push((*at, *id, *cost));
    }
    for (k, mut deps) in by_client {
        deps.sort();
        for w in deps.windows(2) {
            let (a0, id0, c0) = w[0];
            let (a1, id1, _) = w[1];
            if burst <= 1 {
                prop_assert!(
                    a1 - a0 >= u64::from(c0) * t,
                    "client {k}: {id0}->{id1} closer than c*T"
                );
            }
            if a1 > a0 {
                prop_assert!(id1 > id0, "client {k}: FIFO broken ({id0} then {id1})");
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn engine_matches_the_reference_model(
        per_second in 1u32..1_000,
        capacity in 0u32..8,
        burst in 0u32..4,
        ops in proptest::collection::vec(op(1_000_000_000), 1..60),
    ) {
        // Gaps are drawn in 0..=3 s and scaled to 0..=3 T for this rate.
        let t = 1_000_000_000 / u64::from(per_second);
        let ops = ops
            .into_iter()
            .map(|o| match o {
                Op::Arrive { gap, key, cost } => Op::Arrive { gap: gap * t / 1_000_000_000, key, cost },
                other => other,
            })
            .collect();
        run(per_second, capacity, burst, ops)?;
    }
}
