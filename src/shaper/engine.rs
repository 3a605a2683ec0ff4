//! The pure shaping engine: per-client bounded FIFO queues, the departure
//! schedule, and the fair upstream-wide cap (DESIGN section 1).
//!
//! Everything here takes `now` as an argument: no clock, no I/O, no async
//! runtime. The pacer (`super::pacer`) drives it in real time; tests drive
//! it with explicit instants.
//!
//! # Model
//!
//! Each client (route, key) keeps a schedule value `tat` (the earliest time
//! its next cost unit may go, D in the design, pushed back by `burst`
//! tolerance when configured) and a FIFO of waiting entries. The head of a
//! non-empty queue is *due* at `max(arrival, tat − τ)`; when it departs at
//! `d`, `tat = max(tat, d) + c·T`. Departure times are therefore computed at
//! release, never stored per entry, which is what lets a cancelled request
//! give its slot to the next one in line.
//!
//! Due heads wait in their upstream's heap, ordered by due time (ties by
//! arrival). An uncapped upstream releases every due head; a capped one
//! (global rate R) releases the earliest due head at each of its own slots,
//! spaced c/R apart: earliest-due-first is what shares R fairly.
//!
//! A release that comes late by less than one interval keeps the absolute
//! schedule (lateness is jitter, never drift); a release a whole interval or
//! more late (the pacer stalled) restarts the schedule from the release, so
//! a stalled pacer never produces a catch-up burst. Under an upstream cap a
//! client's next slot counts from its actual departure (D = d + c·T), so
//! its departures never come closer than c·T; a light client is served at
//! the rate it sends, waiting at most one upstream slot per heavier client
//! due before it.
//!
//! Each waiting entry keeps the interval it was admitted under: a policy
//! change (reload) applies to new arrivals only.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::hash::{BuildHasher, Hash};

use hashbrown::HashTable;

use super::rate::{Nanos, Rate};

/// Per-route shaping policy, validated by the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Per-client rate r (T = 1/r per cost unit).
    pub rate: Rate,
    /// Capacity b: the most cost that may wait for one client.
    pub capacity: u32,
    /// Requests that may pass un-paced after idle (nginx `delay=`); 0 = none.
    pub burst: u32,
    /// Refuse at admission a request whose departure would come later than
    /// arrival + `max_wait` (nanoseconds).
    pub max_wait: Option<Nanos>,
}

impl Policy {
    /// A policy with rate and capacity only.
    pub fn new(rate: Rate, capacity: u32) -> Policy {
        Policy {
            rate,
            capacity,
            burst: 0,
            max_wait: None,
        }
    }

    /// The GCRA tolerance τ that `burst` grants, in nanoseconds.
    fn tolerance(&self) -> Nanos {
        Nanos::from(self.burst.saturating_sub(1)).saturating_mul(self.rate.interval_nanos())
    }
}

/// Global bounds on the engine's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most client states held at once.
    pub max_clients: usize,
    /// Most requests waiting at once, over all clients.
    pub max_queued: usize,
}

/// Identifies a route registered with [`Engine::add_route`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RouteId(u32);

/// Identifies an upstream registered with [`Engine::add_upstream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UpstreamId(u32);

/// Names a waiting request, for [`Engine::cancel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    slot: u32,
    generation: u32,
    seq: u64,
}

/// The engine's answer to an arrival.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Depart now: no added latency.
    Depart,
    /// Admitted to wait; the payload comes back from [`Engine::release_due`]
    /// when the request may depart.
    Queued {
        ticket: Ticket,
        /// The departure this client's own schedule gives; the exact one
        /// unless an upstream cap delays it further.
        departure: Nanos,
    },
    /// Refused.
    Rejected(Rejection),
}

/// Why an arrival was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// The client's queue is full (429). `retry_after` is the time from the
    /// arrival until the queue would accept this request.
    Full { retry_after: Nanos },
    /// The departure would come later than arrival + `max_wait` (429).
    MaxWait { retry_after: Nanos },
    /// `max_clients` client states are held (503).
    TooManyClients,
    /// `max_queued` requests are waiting (503).
    TooManyQueued,
}

/// What an arrival would be answered, from [`Engine::probe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// It would depart at once.
    Depart,
    /// It would wait until `departure` (a lower bound under an upstream cap).
    Queue { departure: Nanos },
    /// It would be refused.
    Reject(Rejection),
}

/// An upstream cap as admission sees it: its next free slot and its
/// interval per cost unit.
#[derive(Clone, Copy)]
struct CapView {
    next: Nanos,
    step: Nanos,
}

/// The rules' verdict for one arrival, before any state changes.
enum Decision {
    Depart,
    /// Wait: `due` is when the client's own schedule lets it go (the
    /// fairness order under a cap); `departure` the estimate told to the
    /// caller, bounded below by the cap's slots.
    Queue {
        due: Nanos,
        departure: Nanos,
    },
    Reject(Rejection),
}

/// Read-only view of one client, for status and bucket queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientView {
    /// Cost units waiting.
    pub waiting_cost: u64,
    /// Requests waiting.
    pub waiting: usize,
    /// When the next request would depart on this client's own schedule.
    pub next_departure: Nanos,
}

// === impl Engine ===

/// The shaping engine. `K` is the client key; `P` is an opaque payload held
/// for each waiting request and handed back at release (the pacer uses a
/// oneshot sender).
pub struct Engine<K, P> {
    limits: Limits,
    routes: Vec<RouteState>,
    upstreams: Vec<UpstreamState>,
    index: HashTable<u32>,
    hasher: foldhash::fast::RandomState,
    slots: Vec<Slot<K, P>>,
    free: Vec<u32>,
    clients: usize,
    queued: usize,
    seq: u64,
    /// Clients with an empty queue whose `tat` is still in the future, by
    /// the time they may be forgotten.
    expiry: BinaryHeap<Reverse<(Nanos, u32, u32)>>,
}

#[derive(Debug)]
struct RouteState {
    policy: Policy,
    upstream: UpstreamId,
}

#[derive(Debug)]
struct UpstreamState {
    /// Interval per cost unit of the global cap; `None` when uncapped.
    cap: Option<Nanos>,
    /// The upstream's next free slot (capped only).
    next: Nanos,
    /// Due heads: (due, seq of the head, slot, generation).
    heads: BinaryHeap<Reverse<HeadRef>>,
}

impl UpstreamState {
    /// The cap as admission sees it, when there is one.
    fn cap_view(&self) -> Option<CapView> {
        self.cap.map(|step| CapView {
            next: self.next,
            step,
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct HeadRef {
    due: Nanos,
    seq: u64,
    slot: u32,
    generation: u32,
}

struct Slot<K, P> {
    generation: u32,
    client: Option<Client<K, P>>,
}

struct Client<K, P> {
    key: K,
    hash: u64,
    route: RouteId,
    /// The schedule value D (theoretical arrival time of the next unit).
    tat: Nanos,
    /// When the head is due (meaningful while the queue has a live head).
    due: Nanos,
    waiting_cost: u64,
    waiting: usize,
    queue: VecDeque<Entry<P>>,
    in_expiry: bool,
}

struct Entry<P> {
    seq: u64,
    arrival: Nanos,
    cost: u32,
    /// The interval per cost unit when it was admitted: a policy change
    /// (reload) applies to new arrivals, never to requests already waiting.
    step: Nanos,
    /// `None` once cancelled (a tombstone skipped at release).
    payload: Option<P>,
}

/// Whether a release scheduled at `at` and performed at `now` came a
/// whole `step` or more late: the pacer stalled, and the schedule restarts
/// from the release rather than making up the missed slots in a burst.
/// Anything less late keeps the absolute grid (jitter, never drift).
fn stalled(at: Nanos, step: Nanos, now: Nanos) -> bool {
    now.saturating_sub(at) >= step
}

impl<K: Hash + Eq, P> Engine<K, P> {
    /// An engine with no routes.
    pub fn new(limits: Limits) -> Engine<K, P> {
        Engine {
            limits,
            routes: Vec::new(),
            upstreams: Vec::new(),
            index: HashTable::new(),
            hasher: foldhash::fast::RandomState::default(),
            slots: Vec::new(),
            free: Vec::new(),
            clients: 0,
            queued: 0,
            seq: 0,
            expiry: BinaryHeap::new(),
        }
    }

    /// Register an upstream, optionally with a global rate cap shared fairly
    /// by all clients of the routes that use it.
    pub fn add_upstream(&mut self, cap: Option<Rate>) -> UpstreamId {
        let id = UpstreamId(self.upstreams.len() as u32);
        self.upstreams.push(UpstreamState {
            cap: cap.map(Rate::interval_nanos),
            next: 0,
            heads: BinaryHeap::new(),
        });
        id
    }

    /// Register a route. Panics never: an unknown upstream id cannot be
    /// constructed outside this engine.
    pub fn add_route(&mut self, policy: Policy, upstream: UpstreamId) -> RouteId {
        let id = RouteId(self.routes.len() as u32);
        self.routes.push(RouteState { policy, upstream });
        id
    }

    /// Change a route's policy for future admissions; waiting requests keep
    /// their place.
    pub fn set_policy(&mut self, route: RouteId, policy: Policy) {
        if let Some(r) = self.routes.get_mut(route.0 as usize) {
            r.policy = policy;
        }
    }

    /// Change the global bounds (existing state above them is kept and
    /// drains naturally).
    pub fn set_limits(&mut self, limits: Limits) {
        self.limits = limits;
    }

    /// Change an upstream's global cap.
    pub fn set_upstream_cap(&mut self, upstream: UpstreamId, cap: Option<Rate>) {
        if let Some(u) = self.upstreams.get_mut(upstream.0 as usize) {
            u.cap = cap.map(Rate::interval_nanos);
        }
    }

    /// Client states held.
    pub fn clients(&self) -> usize {
        self.clients
    }

    /// Requests waiting, over all clients.
    pub fn queued(&self) -> usize {
        self.queued
    }

    fn hash(&self, route: RouteId, key: &K) -> u64 {
        self.hasher.hash_one((route.0, key))
    }

    fn find(&self, route: RouteId, key: &K, hash: u64) -> Option<u32> {
        let slots = &self.slots;
        self.index
            .find(hash, |&s| {
                slots[s as usize]
                    .client
                    .as_ref()
                    .is_some_and(|c| c.route == route && c.key == *key)
            })
            .copied()
    }

    /// Look at one client without changing anything.
    pub fn view(&self, route: RouteId, key: &K, now: Nanos) -> Option<ClientView> {
        let policy = self.routes.get(route.0 as usize)?.policy;
        let slot = self.find(route, key, self.hash(route, key))?;
        let c = self.slots[slot as usize].client.as_ref()?;
        let next_departure = if c.waiting > 0 {
            c.due
                .saturating_add(c.waiting_cost.saturating_mul(policy.rate.interval_nanos()))
        } else {
            c.tat.saturating_sub(policy.tolerance()).max(now)
        };
        Some(ClientView {
            waiting_cost: c.waiting_cost,
            waiting: c.waiting,
            next_departure,
        })
    }

    /// The rules of DESIGN section 1 for one arrival, read-only. `client`
    /// is `None` for a client with no state (idle); `free` says whether the
    /// upstream's cap has a slot now with nobody due ahead.
    #[allow(clippy::too_many_arguments)]
    fn decide(
        client: Option<&Client<K, P>>,
        policy: &Policy,
        free: bool,
        cap: Option<CapView>,
        cost: u32,
        now: Nanos,
        queued: usize,
        max_queued: usize,
    ) -> Decision {
        let step = policy.rate.interval_nanos();
        let (tat, waiting, waiting_cost, due) =
            client.map_or((0, 0, 0, 0), |c| (c.tat, c.waiting, c.waiting_cost, c.due));
        // Idle (nothing waiting, schedule reached): depart at once if the
        // upstream has a free slot.
        let earliest = tat.saturating_sub(policy.tolerance()).max(now);
        if waiting == 0 && earliest == now && free {
            return Decision::Depart;
        }
        // It has to wait: capacity, then max_wait, then the global bound.
        // Under an upstream cap each unit waiting ahead also needs one of
        // the cap's slots: a lower bound on the departure.
        let own = if waiting == 0 {
            earliest
        } else {
            due.saturating_add(waiting_cost.saturating_mul(step))
        };
        let departure = match cap {
            Some(c) => own.max(c.next.saturating_add(waiting_cost.saturating_mul(c.step))),
            None => own,
        }
        .max(now);
        if waiting_cost + u64::from(cost) > u64::from(policy.capacity) {
            let at = client.map_or(now, |c| Self::accepts_at(c, policy, cap, cost));
            return Decision::Reject(Rejection::Full {
                retry_after: at.saturating_sub(now).max(1),
            });
        }
        if let Some(max_wait) = policy.max_wait
            && departure > now.saturating_add(max_wait)
        {
            return Decision::Reject(Rejection::MaxWait {
                retry_after: departure - max_wait - now,
            });
        }
        if queued >= max_queued {
            return Decision::Reject(Rejection::TooManyQueued);
        }
        Decision::Queue {
            due: own.max(now),
            departure,
        }
    }

    /// Decide an arrival of `cost` units for `key` on `route` at `now`.
    /// `payload` is called only when the request is queued.
    pub fn admit(
        &mut self,
        route: RouteId,
        key: K,
        cost: u32,
        now: Nanos,
        payload: impl FnOnce() -> P,
    ) -> Admission {
        let Some(route_state) = self.routes.get(route.0 as usize) else {
            return Admission::Rejected(Rejection::TooManyClients);
        };
        let policy = route_state.policy;
        let upstream = route_state.upstream;
        let hash = self.hash(route, &key);
        let slot = match self.find(route, &key, hash) {
            Some(slot) => slot,
            None => {
                if self.clients >= self.limits.max_clients {
                    self.expire(now);
                    if self.clients >= self.limits.max_clients {
                        return Admission::Rejected(Rejection::TooManyClients);
                    }
                }
                self.insert(route, key, hash)
            }
        };
        let free = self.upstream_free(upstream, now);
        let generation = self.slots[slot as usize].generation;
        let Some(client) = self.slots[slot as usize].client.as_mut() else {
            return Admission::Rejected(Rejection::TooManyClients);
        };
        let cap = self.upstreams[upstream.0 as usize].cap_view();
        let decision = Self::decide(
            Some(client),
            &policy,
            free,
            cap,
            cost,
            now,
            self.queued,
            self.limits.max_queued,
        );
        let step = policy.rate.interval_nanos();
        match decision {
            Decision::Depart => {
                client.tat = client
                    .tat
                    .max(now)
                    .saturating_add(u64::from(cost).saturating_mul(step));
                if let Some(cap) = self.upstreams[upstream.0 as usize].cap {
                    let u = &mut self.upstreams[upstream.0 as usize];
                    u.next = u
                        .next
                        .max(now)
                        .saturating_add(u64::from(cost).saturating_mul(cap));
                }
                self.schedule_expiry(slot);
                Admission::Depart
            }
            Decision::Reject(rejection) => {
                self.forget_if_idle(slot, now);
                Admission::Rejected(rejection)
            }
            Decision::Queue { due, departure } => {
                self.seq += 1;
                let seq = self.seq;
                let becomes_head = client.waiting == 0;
                client.queue.push_back(Entry {
                    seq,
                    arrival: now,
                    cost,
                    step,
                    payload: Some(payload()),
                });
                client.waiting += 1;
                client.waiting_cost += u64::from(cost);
                self.queued += 1;
                if becomes_head {
                    client.due = due;
                    let head = HeadRef {
                        due,
                        seq,
                        slot,
                        generation,
                    };
                    self.upstreams[upstream.0 as usize]
                        .heads
                        .push(Reverse(head));
                }
                Admission::Queued {
                    ticket: Ticket {
                        slot,
                        generation,
                        seq,
                    },
                    departure,
                }
            }
        }
    }

    /// What [`Engine::admit`] would answer now, without changing anything
    /// (for the bucket query). With an upstream cap whose heap holds stale
    /// entries it may say "queue" where admit would depart at once.
    pub fn probe(&self, route: RouteId, key: &K, cost: u32, now: Nanos) -> Probe {
        let Some(route_state) = self.routes.get(route.0 as usize) else {
            return Probe::Reject(Rejection::TooManyClients);
        };
        let client = self
            .find(route, key, self.hash(route, key))
            .and_then(|slot| self.slots[slot as usize].client.as_ref());
        if client.is_none() && self.clients >= self.limits.max_clients {
            return Probe::Reject(Rejection::TooManyClients);
        }
        let upstream = &self.upstreams[route_state.upstream.0 as usize];
        let free = match upstream.cap {
            None => true,
            Some(_) => {
                upstream.next <= now
                    && upstream
                        .heads
                        .peek()
                        .is_none_or(|Reverse(h)| head_is_live(&self.slots, h) && h.due > now)
            }
        };
        let cap = upstream.cap_view();
        let decision = Self::decide(
            client,
            &route_state.policy,
            free,
            cap,
            cost,
            now,
            self.queued,
            self.limits.max_queued,
        );
        match decision {
            Decision::Depart => Probe::Depart,
            Decision::Queue { departure, .. } => Probe::Queue { departure },
            Decision::Reject(r) => Probe::Reject(r),
        }
    }

    /// When a client's queue would accept a request of `cost` (for
    /// Retry-After): the departure that brings the waiting cost down to
    /// `capacity − cost`, or, for a cost the queue can never hold, the time
    /// the client is idle again. Exact without an upstream cap; a lower
    /// bound with one.
    fn accepts_at(
        client: &Client<K, P>,
        policy: &Policy,
        cap: Option<CapView>,
        cost: u32,
    ) -> Nanos {
        let step = policy.rate.interval_nanos();
        let capacity = u64::from(policy.capacity);
        let cost = u64::from(cost);
        if client.waiting == 0 {
            return client.tat.saturating_sub(policy.tolerance());
        }
        // When the waiting units ahead of `done` units have left: on the
        // client's own grid, and (with a cap) on the upstream's.
        let leaves = |done: u64| {
            let own = client.due.saturating_add(done.saturating_mul(step));
            match cap {
                Some(c) => own.max(c.next.saturating_add(done.saturating_mul(c.step))),
                None => own,
            }
        };
        if cost > capacity {
            return leaves(client.waiting_cost);
        }
        // Walk departures from the head until enough cost has gone; at most
        // `cost` units need to go since waiting_cost <= capacity.
        let mut waiting = client.waiting_cost;
        let mut done = 0;
        for entry in client.queue.iter().filter(|e| e.payload.is_some()) {
            let at = leaves(done);
            waiting -= u64::from(entry.cost);
            if waiting + cost <= capacity {
                return at;
            }
            done += u64::from(entry.cost);
        }
        leaves(done)
    }

    /// Whether a capped upstream has a free slot now with nobody due ahead.
    fn upstream_free(&mut self, upstream: UpstreamId, now: Nanos) -> bool {
        self.clean_heads(upstream);
        let u = &self.upstreams[upstream.0 as usize];
        match u.cap {
            None => true,
            Some(_) => u.next <= now && u.heads.peek().is_none_or(|h| h.0.due > now),
        }
    }

    /// Drop stale entries from the top of an upstream's heap.
    fn clean_heads(&mut self, upstream: UpstreamId) {
        let Some(u) = self.upstreams.get_mut(upstream.0 as usize) else {
            return;
        };
        while let Some(Reverse(h)) = u.heads.peek() {
            if head_is_live(&self.slots, h) {
                break;
            }
            u.heads.pop();
        }
    }

    fn insert(&mut self, route: RouteId, key: K, hash: u64) -> u32 {
        let client = Client {
            key,
            hash,
            route,
            tat: 0,
            due: 0,
            waiting_cost: 0,
            waiting: 0,
            queue: VecDeque::new(),
            in_expiry: false,
        };
        let slot = match self.free.pop() {
            Some(s) => {
                self.slots[s as usize].client = Some(client);
                s
            }
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    client: Some(client),
                });
                (self.slots.len() - 1) as u32
            }
        };
        let slots = &self.slots;
        self.index.insert_unique(hash, slot, |&s| {
            slots[s as usize].client.as_ref().map_or(0, |c| c.hash)
        });
        self.clients += 1;
        slot
    }

    fn remove(&mut self, slot: u32) {
        let Some(client) = self.slots[slot as usize].client.take() else {
            return;
        };
        if let Ok(entry) = self.index.find_entry(client.hash, |&s| s == slot) {
            entry.remove();
        }
        let s = &mut self.slots[slot as usize];
        s.generation = s.generation.wrapping_add(1);
        self.free.push(slot);
        self.clients -= 1;
    }

    /// Forget a client that holds nothing (a fresh state made for an
    /// arrival that was then refused), otherwise make sure it will expire.
    fn forget_if_idle(&mut self, slot: u32, now: Nanos) {
        let idle = self.slots[slot as usize]
            .client
            .as_ref()
            .is_some_and(|c| c.waiting == 0 && c.tat <= now);
        if idle {
            self.remove(slot);
        }
    }

    fn schedule_expiry(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if let Some(c) = s.client.as_mut()
            && !c.in_expiry
        {
            c.in_expiry = true;
            self.expiry.push(Reverse((c.tat, slot, s.generation)));
        }
    }

    /// Forget clients whose queue is empty and whose schedule has passed.
    pub fn expire(&mut self, now: Nanos) {
        while let Some(&Reverse((at, slot, generation))) = self.expiry.peek() {
            if at > now {
                break;
            }
            self.expiry.pop();
            let s = &mut self.slots[slot as usize];
            if s.generation != generation {
                continue;
            }
            let Some(c) = s.client.as_mut() else { continue };
            c.in_expiry = false;
            if c.waiting > 0 {
                // It will be re-armed when its queue empties.
                continue;
            }
            if c.tat <= now {
                self.remove(slot);
            } else {
                c.in_expiry = true;
                self.expiry.push(Reverse((c.tat, slot, generation)));
            }
        }
    }

    /// When [`Engine::expire`] next has work, if ever.
    pub fn next_expiry(&self) -> Option<Nanos> {
        self.expiry.peek().map(|r| r.0.0)
    }

    /// When [`Engine::release_due`] next has work, if ever.
    pub fn next_release(&mut self) -> Option<Nanos> {
        let mut next: Option<Nanos> = None;
        for u in 0..self.upstreams.len() {
            let id = UpstreamId(u as u32);
            self.clean_heads(id);
            let u = &self.upstreams[u];
            if let Some(Reverse(h)) = u.heads.peek() {
                let at = if u.cap.is_some() {
                    h.due.max(u.next)
                } else {
                    h.due
                };
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        next
    }

    /// Release every request due at `now`, appending their payloads to
    /// `out` in departure order.
    pub fn release_due(&mut self, now: Nanos, out: &mut Vec<P>) {
        for u in 0..self.upstreams.len() {
            self.release_upstream(UpstreamId(u as u32), now, out);
        }
    }

    fn release_upstream(&mut self, upstream: UpstreamId, now: Nanos, out: &mut Vec<P>) {
        loop {
            self.clean_heads(upstream);
            let u = &mut self.upstreams[upstream.0 as usize];
            let Some(&Reverse(head)) = u.heads.peek() else {
                return;
            };
            let at = match u.cap {
                Some(_) => head.due.max(u.next),
                None => head.due,
            };
            if at > now {
                return;
            }
            u.heads.pop();
            let Some(c) = self.slots[head.slot as usize].client.as_mut() else {
                continue;
            };
            let Some(entry) = c.queue.pop_front() else {
                continue;
            };
            let Some(policy) = self.routes.get(c.route.0 as usize).map(|r| r.policy) else {
                continue;
            };
            let step = entry.step;
            let cost = u64::from(entry.cost);
            c.waiting -= 1;
            c.waiting_cost -= cost;
            self.queued -= 1;
            if let Some(cap) = u.cap {
                let gap = cost.saturating_mul(cap);
                let from = if stalled(at, gap, now) { now } else { at };
                u.next = from.saturating_add(gap);
            }
            // The departing unit moves the client's schedule from its
            // departure (D = d + c·T, DESIGN 1): from the scheduled release,
            // never from `now`, so pacer jitter never drifts the grid; a
            // departure the upstream cap delayed counts from when it went, so
            // one client's departures never come closer than c·T. A release
            // a whole interval or more late (the pacer stalled) restarts from
            // the release: never a catch-up burst.
            let gap = cost.saturating_mul(step);
            let tau = policy.tolerance();
            c.tat = if stalled(at, gap, now) {
                now.saturating_add(tau).saturating_add(gap)
            } else {
                c.tat.max(at).saturating_add(gap)
            };
            if let Some(p) = entry.payload {
                out.push(p);
            }
            self.promote_head(head.slot, now);
        }
    }

    /// After the head left (or was cancelled), drop leading tombstones and
    /// put the new head, if any, in its upstream's heap.
    fn promote_head(&mut self, slot: u32, now: Nanos) {
        let generation = self.slots[slot as usize].generation;
        let Some(c) = self.slots[slot as usize].client.as_mut() else {
            return;
        };
        while c.queue.front().is_some_and(|e| e.payload.is_none()) {
            c.queue.pop_front();
        }
        let Some(route) = self.routes.get(c.route.0 as usize) else {
            return;
        };
        let tau = route.policy.tolerance();
        match c.queue.front() {
            Some(next) => {
                c.due = c.tat.saturating_sub(tau).max(next.arrival);
                let head = HeadRef {
                    due: c.due,
                    seq: next.seq,
                    slot,
                    generation,
                };
                self.upstreams[route.upstream.0 as usize]
                    .heads
                    .push(Reverse(head));
            }
            None => {
                if c.tat <= now {
                    self.remove(slot);
                } else {
                    self.schedule_expiry(slot);
                }
            }
        }
    }

    /// Withdraw every waiting request (shutdown past the drain timeout),
    /// appending their payloads to `out`. Client schedules are kept.
    pub fn withdraw_all(&mut self, now: Nanos, out: &mut Vec<P>) {
        for slot in 0..self.slots.len() {
            let Some(c) = self.slots[slot].client.as_mut() else {
                continue;
            };
            if c.waiting == 0 {
                continue;
            }
            out.extend(c.queue.drain(..).filter_map(|e| e.payload));
            self.queued -= c.waiting;
            c.waiting = 0;
            c.waiting_cost = 0;
            self.promote_head(slot as u32, now);
        }
    }

    /// The `n` clients with the most cost waiting, deepest first, as
    /// (route, key, view). Walks every client: for status pages, not for
    /// the request path.
    pub fn deepest(&self, n: usize, now: Nanos) -> Vec<(RouteId, &K, ClientView)> {
        let mut all: Vec<(RouteId, &K, ClientView)> = self
            .slots
            .iter()
            .filter_map(|s| s.client.as_ref())
            .filter(|c| c.waiting > 0)
            .filter_map(|c| {
                let policy = self.routes.get(c.route.0 as usize)?.policy;
                let next_departure = c
                    .due
                    .saturating_add(c.waiting_cost.saturating_mul(policy.rate.interval_nanos()));
                let view = ClientView {
                    waiting_cost: c.waiting_cost,
                    waiting: c.waiting,
                    next_departure: next_departure.max(now),
                };
                Some((c.route, &c.key, view))
            })
            .collect();
        all.sort_by_key(|e| std::cmp::Reverse(e.2.waiting_cost));
        all.truncate(n);
        all
    }

    /// Withdraw a waiting request: it will never be released, and the next
    /// one in line takes its slot. Returns its payload, or `None` when the
    /// ticket was already released (or cancelled).
    pub fn cancel(&mut self, ticket: Ticket, now: Nanos) -> Option<P> {
        let s = self.slots.get_mut(ticket.slot as usize)?;
        if s.generation != ticket.generation {
            return None;
        }
        let c = s.client.as_mut()?;
        let i = c.queue.binary_search_by_key(&ticket.seq, |e| e.seq).ok()?;
        let entry = c.queue.get_mut(i)?;
        let payload = entry.payload.take()?;
        c.waiting -= 1;
        c.waiting_cost -= u64::from(entry.cost);
        self.queued -= 1;
        if i == 0 {
            // Its heap entry goes stale; the next one takes the same slot.
            c.queue.pop_front();
            self.promote_head(ticket.slot, now);
        }
        Some(payload)
    }
}

fn head_is_live<K, P>(slots: &[Slot<K, P>], h: &HeadRef) -> bool {
    slots.get(h.slot as usize).is_some_and(|s| {
        s.generation == h.generation
            && s.client
                .as_ref()
                .is_some_and(|c| c.due == h.due && c.queue.front().is_some_and(|e| e.seq == h.seq))
    })
}
