//! The pure shaping engine: per-client bounded FIFO queues, the departure
//! schedule, and the fair upstream-wide cap (DESIGN section 1).
//!
//! Everything here takes `now` as an argument: no clock, no I/O, no async
//! runtime, no threads of its own. The pacer drives it in real time from
//! any number of threads; tests drive it with explicit instants.
//!
//! # Model
//!
//! Each client (route, key) keeps a schedule value `tat` (the earliest time
//! its next cost unit may go, D in the design, pushed back by `burst`
//! tolerance when configured) and a FIFO of waiting entries. The head of a
//! non-empty queue is *due* at `max(arrival, tat − τ)`; when it departs at
//! `d`, `tat = max(tat, d) + c·T`. Departure times are computed at release,
//! never stored per entry, which is what lets a cancelled request give its
//! slot to the next one in line.
//!
//! # Shards and the cap arbiter
//!
//! Clients live in shards chosen by hash(route, key), each behind its own
//! lock, so admissions from several cores do not serialize on one lock.
//! Heads on an uncapped upstream wait in their shard's heap; heads on a
//! capped upstream (global rate R) wait in that upstream's [`Cap`], shared
//! by every shard, which grants its slots (spaced c/R apart) earliest due
//! first across all shards: that is what shares R fairly. Locks are always
//! taken shard first, then cap.
//!
//! # Late releases
//!
//! A release that comes late keeps the client's absolute grid and is made
//! up by the following ones, never two closer than c·T/2; a release later
//! than the client's whole backlog (b·T) restarts its schedule from the
//! release instead (DESIGN section 1).
//!
//! Each waiting entry keeps the interval it was admitted under: a policy
//! change (reload) applies to new arrivals only.

use std::cmp::Reverse;
use std::hash::{BuildHasher, Hash};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::rate::{Nanos, Rate};
use super::shard::{Cap, Shard, ShardRoute};

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
    pub(super) fn tolerance(&self) -> Nanos {
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
pub struct RouteId(pub(super) u32);

/// Identifies an upstream registered with [`Engine::add_upstream`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct UpstreamId(u32);

/// Names a waiting request, for [`Engine::cancel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Ticket {
    pub(super) shard: u32,
    pub(super) entry: u32,
    pub(super) generation: u32,
}

/// What the releaser must look at: one shard's uncapped heads, or one
/// capped upstream's heads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Shard(u32),
    Cap(u32),
}

/// The releaser must look at `target` at `at`, earlier than it was told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wake {
    pub target: Target,
    pub at: Nanos,
}

/// The engine's answer to an arrival.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    /// Depart now: no added latency.
    Depart,
    /// Admitted to wait; the payload comes back from [`Engine::release`]
    /// when the request may depart.
    Queued {
        ticket: Ticket,
        /// The departure this client's own schedule gives; the exact one
        /// unless an upstream cap delays it further.
        departure: Nanos,
        /// Set when the releaser must be told to look earlier.
        wake: Option<Wake>,
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

// === impl Budget ===

/// The global bounds, counted across shards with atomics (no lock).
#[derive(Debug)]
pub struct Budget {
    clients: AtomicUsize,
    queued: AtomicUsize,
    max_clients: AtomicUsize,
    max_queued: AtomicUsize,
}

impl Budget {
    fn new(limits: Limits) -> Budget {
        Budget {
            clients: AtomicUsize::new(0),
            queued: AtomicUsize::new(0),
            max_clients: AtomicUsize::new(limits.max_clients),
            max_queued: AtomicUsize::new(limits.max_queued),
        }
    }

    fn take(count: &AtomicUsize, max: &AtomicUsize) -> bool {
        // One atomic add in the common case; a taker that went past the
        // bound gives it back (exact: of takers racing for the last unit,
        // only the one that saw room keeps it).
        if count.fetch_add(1, Ordering::AcqRel) < max.load(Ordering::Relaxed) {
            true
        } else {
            count.fetch_sub(1, Ordering::AcqRel);
            false
        }
    }

    pub(super) fn take_client(&self) -> bool {
        Self::take(&self.clients, &self.max_clients)
    }

    pub(super) fn give_client(&self) {
        self.clients.fetch_sub(1, Ordering::AcqRel);
    }

    pub(super) fn has_client_room(&self) -> bool {
        self.clients.load(Ordering::Acquire) < self.max_clients.load(Ordering::Relaxed)
    }

    /// Reserve room for one more waiting request (the admission layer
    /// also counts requests held for a shared schedule here).
    pub fn take_queued(&self) -> bool {
        Self::take(&self.queued, &self.max_queued)
    }

    /// Give back room taken with [`Budget::take_queued`].
    pub fn give_queued(&self) {
        self.queued.fetch_sub(1, Ordering::AcqRel);
    }

    pub(super) fn has_queue_room(&self) -> bool {
        self.queued.load(Ordering::Acquire) < self.max_queued.load(Ordering::Relaxed)
    }

    /// Requests waiting (or held), over all clients.
    pub fn queued(&self) -> usize {
        self.queued.load(Ordering::Acquire)
    }

    /// Client states held.
    pub fn clients(&self) -> usize {
        self.clients.load(Ordering::Acquire)
    }

    /// The bounds in force.
    pub fn limits(&self) -> Limits {
        Limits {
            max_clients: self.max_clients.load(Ordering::Relaxed),
            max_queued: self.max_queued.load(Ordering::Relaxed),
        }
    }

    fn set(&self, limits: Limits) {
        self.max_clients
            .store(limits.max_clients, Ordering::Relaxed);
        self.max_queued.store(limits.max_queued, Ordering::Relaxed);
    }
}

// === impl Sweeps ===

/// When a sweep ([`Engine::expire`]) may next have work, kept lock-free for
/// the releaser to sleep on: whoever schedules an earlier expiry lowers
/// it and raises a flag, so that a releaser with nothing due sleeps until
/// the first client it can forget (DESIGN 2: an idle pacer uses no CPU),
/// and is still told when arrivals that never wait make one earlier.
#[derive(Debug)]
pub(super) struct Sweeps {
    /// The earliest instant a sweep may have work; `Nanos::MAX`: none.
    at: AtomicU64,
    /// `at` was lowered since the releaser last read it.
    lowered: AtomicBool,
}

impl Sweeps {
    fn new() -> Sweeps {
        Sweeps {
            at: AtomicU64::new(Nanos::MAX),
            lowered: AtomicBool::new(false),
        }
    }

    /// A sweep may have work at `at`.
    pub(super) fn note(&self, at: Nanos) {
        // A load first: in the common case (not earlier) nothing is written.
        if at < self.at.load(Ordering::Relaxed) && self.at.fetch_min(at, Ordering::AcqRel) > at {
            self.lowered.store(true, Ordering::Release);
        }
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every operation re-validates what it reads, so a lock poisoned by a
    // panic elsewhere is still safe to use.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// === impl Engine ===

/// The shaping engine. `K` is the client key; `P` is an opaque payload held
/// for each waiting request and handed back at release (the pacer uses a
/// oneshot sender). Every method takes `&self`: shards and caps are locked
/// inside, briefly, never while calling out.
pub struct Engine<K, P> {
    shards: Box<[Mutex<Shard<K, P>>]>,
    hasher: foldhash::fast::RandomState,
    budget: Budget,
    sweeps: Arc<Sweeps>,
    /// The cap of each upstream (`None`: uncapped), by [`UpstreamId`].
    upstreams: Mutex<Vec<Option<Arc<Mutex<Cap>>>>>,
    /// Every route as registered, by [`RouteId`]; each shard keeps a copy.
    routes: Mutex<Vec<ShardRoute>>,
    /// When an arrival at `max_clients` last swept the other shards
    /// ([`Engine::expire_elsewhere`]): at most once per [`ELSEWHERE_GAP`].
    swept_elsewhere: AtomicU64,
}

/// How often arrivals at `max_clients` sweep the other shards: each sweep
/// takes their locks in turn, and at the bound every arrival (a known
/// client's too) would otherwise pay for it.
const ELSEWHERE_GAP: Nanos = 1_000_000;

impl<K: Hash + Eq, P> Engine<K, P> {
    /// An engine with no routes and `shards` shards (at least one).
    pub fn new(limits: Limits, shards: usize) -> Engine<K, P> {
        let hasher = foldhash::fast::RandomState::default();
        let sweeps = Arc::new(Sweeps::new());
        let shards = (0..shards.clamp(1, 1024) as u32)
            .map(|i| Mutex::new(Shard::new(i, sweeps.clone())))
            .collect();
        Engine {
            shards,
            hasher,
            budget: Budget::new(limits),
            sweeps,
            upstreams: Mutex::new(Vec::new()),
            routes: Mutex::new(Vec::new()),
            swept_elsewhere: AtomicU64::new(0),
        }
    }

    /// How many shards there are.
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// The global counters, shared with the admission layer.
    pub fn budget(&self) -> &Budget {
        &self.budget
    }

    /// Register an upstream, capped at a global rate shared fairly by all
    /// clients of its routes, or uncapped. Whether an upstream is capped
    /// is fixed; its cap's rate can change ([`Engine::set_upstream_rate`]).
    pub fn add_upstream(&self, cap: Option<Rate>) -> UpstreamId {
        self.add_gated_upstream(cap, false)
    }

    /// Register an upstream that may be paused ([`Engine::pause`]) as well
    /// as capped. A pausable upstream's queue heads wait in its cap (with
    /// no spacing when it has no rate), so a pause holds them all and
    /// resumes them earliest due first.
    pub fn add_gated_upstream(&self, cap: Option<Rate>, pausable: bool) -> UpstreamId {
        let step = match (cap, pausable) {
            (Some(r), _) => Some(r.interval_nanos()),
            (None, true) => Some(0),
            (None, false) => None,
        };
        let mut ups = lock(&self.upstreams);
        ups.push(step.map(|s| Arc::new(Mutex::new(Cap::new(s)))));
        UpstreamId((ups.len() - 1) as u32)
    }

    /// Hold every release to `upstream` until `until` (the upstream asked
    /// for it); queued requests keep their order. Returns false for an
    /// upstream that cannot be paused.
    pub fn pause(&self, upstream: UpstreamId, until: Nanos) -> bool {
        match self.cap(upstream.0) {
            Some(cap) => {
                let mut c = lock(&cap);
                c.next = c.next.max(until);
                c.paused_until = c.paused_until.max(until);
                true
            }
            None => false,
        }
    }

    /// Until when releases to `upstream` are paused, if they are at `now`.
    pub fn paused_until(&self, upstream: UpstreamId, now: Nanos) -> Option<Nanos> {
        let cap = self.cap(upstream.0)?;
        let until = lock(&cap).paused_until;
        (until > now).then_some(until)
    }

    /// Change a capped upstream's rate (`None`: no spacing, for a
    /// pausable upstream without a rate); an uncapped one stays uncapped.
    /// What is left of the slot it gave last is scaled to the new rate,
    /// as idle clients' schedules are on a reload: after 1/m to 100/s the
    /// next slot is at most 10 ms away, not the rest of the minute.
    pub fn set_upstream_rate(&self, upstream: UpstreamId, rate: Option<Rate>, now: Nanos) {
        if let Some(cap) = self.cap(upstream.0) {
            let mut cap = lock(&cap);
            let new = rate.map_or(0, Rate::interval_nanos);
            // A pause the upstream asked for keeps its end: only the slot
            // past it (or past now) is the rate's.
            let base = now.max(cap.paused_until);
            if cap.step > 0 && cap.next > base {
                let ahead = u128::from(cap.next - base) * u128::from(new) / u128::from(cap.step);
                cap.next = base.saturating_add(u64::try_from(ahead).unwrap_or(u64::MAX));
            }
            cap.step = new;
        }
    }

    /// Register a route on an upstream.
    pub fn add_route(&self, policy: Policy, upstream: UpstreamId) -> RouteId {
        let cap = lock(&self.upstreams)
            .get(upstream.0 as usize)
            .cloned()
            .flatten()
            .map(|c| (upstream.0, c));
        let route = ShardRoute {
            policy,
            cap,
            odd: 0,
            odd_seq: 0,
        };
        let mut routes = lock(&self.routes);
        routes.push(route.clone());
        for shard in self.shards.iter() {
            lock(shard).routes.push(route.clone());
        }
        RouteId((routes.len() - 1) as u32)
    }

    /// Change a route's policy for future admissions; waiting requests keep
    /// their place and their interval.
    pub fn set_policy(&self, route: RouteId, policy: Policy, now: Nanos) {
        let mut routes = lock(&self.routes);
        let Some(r) = routes.get_mut(route.0 as usize) else {
            return;
        };
        let old = r.policy.rate.interval_nanos();
        let new = policy.rate.interval_nanos();
        let tolerance = (r.policy.tolerance(), policy.tolerance());
        r.policy = policy;
        for shard in self.shards.iter() {
            let mut shard = lock(shard);
            if let Some(r) = shard.routes.get_mut(route.0 as usize) {
                r.policy = policy;
            }
            if tolerance.0 != tolerance.1 {
                shard.retolerate(route, tolerance.0, tolerance.1);
            }
            if old != new {
                shard.rescale(route, old, new, now);
                shard.recount_odd(route, new);
            }
        }
    }

    /// Change the global bounds (state above them is kept and drains).
    pub fn set_limits(&self, limits: Limits) {
        self.budget.set(limits);
    }

    /// Client states held.
    pub fn clients(&self) -> usize {
        self.budget.clients()
    }

    /// Requests waiting, over all clients (and requests the admission
    /// layer holds against the same budget).
    pub fn queued(&self) -> usize {
        self.budget.queued()
    }

    fn hash(&self, route: RouteId, key: &K) -> u64 {
        self.hasher.hash_one((route.0, key))
    }

    fn shard_index(&self, hash: u64) -> usize {
        // The shards' tables hash by the low 32 bits: the shard comes from
        // the high ones, scaled to the shard count by a multiply (a division
        // here was a fifth of this function's time).
        (((hash >> 32) * self.shards.len() as u64) >> 32) as usize
    }

    fn shard_of(&self, hash: u64) -> &Mutex<Shard<K, P>> {
        &self.shards[self.shard_index(hash)]
    }

    /// The shard `key` of `route` lives in (for benchmarks and tests that
    /// place keys on purpose).
    pub fn shard_for(&self, route: RouteId, key: &K) -> usize {
        self.shard_index(self.hash(route, key))
    }

    fn cap(&self, up: u32) -> Option<Arc<Mutex<Cap>>> {
        lock(&self.upstreams).get(up as usize).cloned().flatten()
    }

    /// Decide an arrival of `cost` units for `key` on `route` at `now`.
    /// `payload` is called only when the request is queued.
    pub fn admit(
        &self,
        route: RouteId,
        key: K,
        cost: u32,
        now: Nanos,
        payload: impl FnOnce() -> P,
    ) -> Admission {
        let hash = self.hash(route, &key);
        let index = self.shard_index(hash);
        if !self.budget.has_client_room() && self.claim_sweep_elsewhere(now) {
            self.expire_elsewhere(index, now);
        }
        let mut shard = lock(&self.shards[index]);
        let cap = match shard.routes.get(route.0 as usize) {
            Some(r) => r.cap.as_ref().map(|c| c.1.clone()),
            None => return Admission::Rejected(Rejection::TooManyClients),
        };
        let mut cap = cap.as_ref().map(|c| lock(c));
        shard.admit(
            route,
            key,
            hash,
            cost,
            now,
            cap.as_deref_mut(),
            &self.budget,
            payload,
        )
    }

    /// What [`Engine::admit`] would answer now, without changing anything
    /// (for the bucket query).
    pub fn probe(&self, route: RouteId, key: &K, cost: u32, now: Nanos) -> Probe {
        let hash = self.hash(route, key);
        let shard = lock(self.shard_of(hash));
        let cap = shard
            .routes
            .get(route.0 as usize)
            .and_then(|r| r.cap.as_ref().map(|c| c.1.clone()));
        let cap = cap.as_ref().map(|c| lock(c));
        shard.probe(route, key, hash, cost, now, cap.as_deref(), &self.budget)
    }

    /// Look at one client without changing anything.
    pub fn view(&self, route: RouteId, key: &K, now: Nanos) -> Option<ClientView> {
        let hash = self.hash(route, key);
        lock(self.shard_of(hash)).view(route, key, hash, now)
    }

    /// Withdraw a waiting request: it will never be released, and the next
    /// one in line takes its slot. Returns its payload, or `None` when the
    /// ticket was already released (or cancelled).
    pub fn cancel(&self, ticket: Ticket, now: Nanos) -> Option<P> {
        let mut shard = lock(self.shards.get(ticket.shard as usize)?);
        let route = shard.ticket_route(ticket)?;
        let cap = shard
            .routes
            .get(route.0 as usize)
            .and_then(|r| r.cap.as_ref().map(|c| c.1.clone()));
        let mut guard = cap.as_ref().map(|c| lock(c));
        let payload = shard.cancel(ticket, now, guard.as_deref_mut(), &self.budget);
        let prune = guard.as_ref().is_some_and(|c| c.needs_pruning());
        drop(guard);
        drop(shard);
        if let (true, Some(cap)) = (prune, cap) {
            self.prune_cap(&cap);
        }
        payload
    }

    /// Drop a cap's stale heads, shard by shard (each shard's lock, then
    /// the cap's: the engine's lock order). O(heap) per pass, and a pass
    /// only once the stale entries are more than half the heap.
    fn prune_cap(&self, cap: &Mutex<Cap>) {
        let counted = lock(cap).stale;
        for shard in self.shards.iter() {
            let shard = lock(shard);
            shard.prune_cap_heads(&mut lock(cap));
        }
        // Those counted during the pass may still be there.
        let mut c = lock(cap);
        c.stale = c.stale.saturating_sub(counted);
    }

    /// Release what `target` has due at `now`, appending payloads to `out`
    /// in departure order; returns when the target next has work (and
    /// counts on being told, through [`Wake`], of anything earlier).
    pub fn release(&self, target: Target, now: Nanos, out: &mut Vec<P>) -> Option<Nanos> {
        match target {
            Target::Shard(i) => lock(self.shards.get(i as usize)?).release(now, &self.budget, out),
            Target::Cap(up) => self.release_cap(up, now, out),
        }
    }

    /// Grant a capped upstream's slots due by `now`, earliest due head
    /// first across every shard.
    fn release_cap(&self, up: u32, now: Nanos, out: &mut Vec<P>) -> Option<Nanos> {
        let cap = self.cap(up)?;
        loop {
            // Which shard holds the earliest head (cap lock alone) ...
            let shard = {
                let mut c = lock(&cap);
                match c.next_release() {
                    Some(at) if at <= now => c.heads.peek().map(|h| h.0.shard),
                    next => {
                        c.armed = next.unwrap_or(Nanos::MAX);
                        return next;
                    }
                }
            };
            let Some(index) = shard else {
                continue;
            };
            let Some(shard) = self.shards.get(index as usize) else {
                // Cannot happen: heads name shards of this engine.
                lock(&cap).heads.pop();
                continue;
            };
            // ... then shard and cap, in lock order, and check again.
            let mut shard = lock(shard);
            let mut c = lock(&cap);
            let Some(&Reverse(head)) = c.heads.peek() else {
                continue;
            };
            let at = head.due.max(c.next);
            if head.shard != index || at > now {
                continue;
            }
            if !shard.head_is_live(&head) {
                c.heads.pop();
                continue;
            }
            c.heads.pop();
            shard.depart(head, now, Some(&mut c), &self.budget, out);
        }
    }

    /// Every target, for a releaser that looks at all of them.
    pub fn targets(&self) -> Vec<Target> {
        let shards = (0..self.shards.len() as u32).map(Target::Shard);
        let caps: Vec<Target> = lock(&self.upstreams)
            .iter()
            .enumerate()
            .filter(|(_, c)| c.is_some())
            .map(|(i, _)| Target::Cap(i as u32))
            .collect();
        shards.chain(caps).collect()
    }

    /// When [`Engine::release_due`] next has work, if ever.
    pub fn next_release(&self) -> Option<Nanos> {
        let mut next: Option<Nanos> = None;
        for target in self.targets() {
            let at = match target {
                Target::Shard(i) => lock(&self.shards[i as usize]).next_release(),
                Target::Cap(up) => self.cap_next_release(up),
            };
            if let Some(at) = at {
                next = Some(next.map_or(at, |n| n.min(at)));
            }
        }
        next
    }

    /// A capped upstream's next release, dropping stale heads on top.
    fn cap_next_release(&self, up: u32) -> Option<Nanos> {
        let cap = self.cap(up)?;
        loop {
            let index = lock(&cap).heads.peek().map(|h| h.0.shard)?;
            let shard = lock(self.shards.get(index as usize)?);
            let mut c = lock(&cap);
            let &Reverse(head) = c.heads.peek()?;
            if head.shard != index {
                continue;
            }
            if shard.head_is_live(&head) {
                return c.next_release();
            }
            c.heads.pop();
        }
    }

    /// Release every request due at `now` on every target, appending
    /// payloads to `out` (for single-threaded drivers and tests).
    pub fn release_due(&self, now: Nanos, out: &mut Vec<P>) {
        for target in self.targets() {
            self.release(target, now, out);
        }
    }

    /// Forget idle clients of one shard whose schedule has passed, and
    /// give its memory back if a load has passed; returns when that shard
    /// next has work for a sweep (`now` when memory is left to give back
    /// at the next one).
    pub fn expire_shard(&self, shard: usize, now: Nanos) -> Option<Nanos> {
        let mut s = lock(self.shards.get(shard)?);
        s.expire(now, &self.budget);
        let later = s.compact().then_some(now);
        [s.next_expiry(), later].into_iter().flatten().min()
    }

    /// When [`Engine::expire`] next has work, if ever, shard by shard
    /// (each shard's lock in turn).
    pub fn next_expiry(&self) -> Option<Nanos> {
        self.shards
            .iter()
            .filter_map(|s| lock(s).next_expiry())
            .min()
    }

    /// Whether this arrival sweeps the other shards (none did within
    /// [`ELSEWHERE_GAP`]).
    fn claim_sweep_elsewhere(&self, now: Nanos) -> bool {
        let last = self.swept_elsewhere.load(Ordering::Relaxed);
        now >= last.saturating_add(ELSEWHERE_GAP)
            && self
                .swept_elsewhere
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// At `max_clients`, before an arrival in shard `but` (which forgets
    /// its own expired states itself when it needs room): forget those of
    /// the other shards now, rather than refuse a new client for states
    /// the releaser's sweep (every 100 ms) has not reached yet. A shard
    /// busy with another admission is passed over (`try_lock`: this is on
    /// the admission path, and no lock is held here).
    fn expire_elsewhere(&self, but: usize, now: Nanos) {
        for (i, shard) in self.shards.iter().enumerate() {
            if i == but {
                continue;
            }
            let mut s = match shard.try_lock() {
                Ok(s) => s,
                Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => continue,
            };
            if s.next_expiry().is_some_and(|t| t <= now) {
                s.expire(now, &self.budget);
            }
            if self.budget.has_client_room() {
                return;
            }
        }
    }

    /// Forget idle clients whose schedule has passed, in every shard.
    pub fn expire(&self, now: Nanos) {
        // What each shard has left is taken in again below (the releaser,
        // which sweeps, reads it next: no news for it), and whatever is
        // scheduled meanwhile is noted by whoever schedules it.
        self.sweeps.at.store(Nanos::MAX, Ordering::Release);
        for i in 0..self.shards.len() {
            if let Some(next) = self.expire_shard(i, now) {
                self.sweeps.at.fetch_min(next, Ordering::AcqRel);
            }
        }
    }

    /// When [`Engine::expire`] may next have work, if ever, without a
    /// lock: what the releaser sleeps on. Reading it clears the flag
    /// [`Engine::sweep_moved_earlier`] reads.
    pub fn next_sweep(&self) -> Option<Nanos> {
        self.sweeps.lowered.swap(false, Ordering::AcqRel);
        self.sweep_at()
    }

    /// [`Engine::next_sweep`] without clearing its flag (a second look in
    /// the same round).
    pub fn sweep_at(&self) -> Option<Nanos> {
        let at = self.sweeps.at.load(Ordering::Acquire);
        (at != Nanos::MAX).then_some(at)
    }

    /// Whether [`Engine::next_sweep`] moved earlier since the releaser
    /// last read it (an arrival that departed at once made a client the
    /// releaser did not know of): true once, for the caller to wake it.
    pub fn sweep_moved_earlier(&self) -> bool {
        self.sweeps.lowered.load(Ordering::Relaxed)
            && self.sweeps.lowered.swap(false, Ordering::AcqRel)
    }

    /// Withdraw every waiting request (shutdown past the drain timeout),
    /// appending their payloads to `out`. Client schedules are kept.
    pub fn withdraw_all(&self, now: Nanos, out: &mut Vec<P>) {
        for shard in self.shards.iter() {
            lock(shard).withdraw_all(now, &self.budget, out);
        }
    }

    /// The `n` clients with the most cost waiting, deepest first, as
    /// (route, key, view). Visits shards a bounded number of slots per
    /// lock, so admissions never wait on this walk for long.
    pub fn deepest(&self, n: usize, now: Nanos) -> Vec<(RouteId, K, ClientView)>
    where
        K: Clone,
    {
        const CHUNK: usize = 4096;
        let mut best: Vec<(RouteId, K, ClientView)> = Vec::new();
        for shard in self.shards.iter() {
            let mut from = Some(0);
            while let Some(start) = from {
                from = lock(shard).scan_waiting(start, CHUNK, now, |route, key, view| {
                    if best.len() < n {
                        best.push((route, key.clone(), view));
                    } else if let Some(min) = best
                        .iter_mut()
                        .min_by_key(|e| e.2.waiting_cost)
                        .filter(|m| m.2.waiting_cost < view.waiting_cost)
                    {
                        *min = (route, key.clone(), view);
                    }
                });
            }
        }
        best.sort_by_key(|e| Reverse(e.2.waiting_cost));
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: Nanos = 3_600_000_000_000;

    /// Every heap entry, live or stale: the shards' and the caps'.
    fn heap_entries(e: &Engine<u32, u32>) -> usize {
        let shards: usize = e.shards.iter().map(|s| lock(s).heads_len()).sum();
        let caps: usize = lock(&e.upstreams)
            .iter()
            .flatten()
            .map(|c| lock(c).heads.len())
            .sum();
        shards + caps
    }

    /// A client that queues a request and withdraws it, in a loop, under
    /// a slow rate (1/h): each withdrawn head leaves a heap entry that would
    /// stay until its due time an hour away. Pruning keeps them within
    /// a bound, on an uncapped upstream and a capped one.
    #[test]
    fn withdrawn_heads_do_not_pile_up_in_the_heaps() {
        for cap in [
            None,
            Some(Rate::from_interval_nanos(HOUR).unwrap_or(Rate::SLOWEST)),
        ] {
            let e: Engine<u32, u32> = Engine::new(
                Limits {
                    max_clients: 1_000,
                    max_queued: 1_000,
                },
                4,
            );
            let upstream = e.add_upstream(cap);
            let policy = Policy::new(Rate::from_interval_nanos(HOUR).unwrap_or(Rate::SLOWEST), 2);
            let route = e.add_route(policy, upstream);
            // The client departs once; from then on each request waits
            // at the head of its queue, for an hour.
            assert_eq!(e.admit(route, 7, 1, 0, || 0), Admission::Depart);
            for i in 0..100_000u32 {
                let Admission::Queued { ticket, .. } = e.admit(route, 7, 1, 1, || i) else {
                    panic!("request {i} was not queued");
                };
                assert_eq!(e.cancel(ticket, 2), Some(i));
            }
            let entries = heap_entries(&e);
            assert!(
                entries <= 2 * (super::super::shard::STALE_SLACK + 1),
                "{entries} heap entries left by 100,000 withdrawals (cap {cap:?})"
            );
        }
    }
}
