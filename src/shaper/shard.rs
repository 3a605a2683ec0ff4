//! One shard of the engine: the client states whose (route, key) hash to
//! it, their FIFO queues, and the heap of queue heads due on uncapped
//! upstreams. Heads on a capped upstream wait in that upstream's [`Cap`]
//! instead, shared by every shard, so that the cap is granted earliest due
//! first whichever shard a client lives in.
//!
//! Everything takes `now`; nothing here blocks, reads a clock or does I/O.
//! The caller holds this shard's lock and, for a capped route, the cap's
//! lock after it (always in that order).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::hash::Hash;
use std::sync::{Arc, Mutex};

use hashbrown::HashTable;

use super::engine::{
    Admission, Budget, ClientView, Policy, Probe, Rejection, RouteId, Sweeps, Target, Ticket, Wake,
};
use super::rate::Nanos;

/// No entry (end of a queue, empty queue).
const NIL: u32 = u32::MAX;

/// An upstream-wide cap (global rate R): its next free slot and the heads
/// of every client queue waiting for it, from all shards.
#[derive(Debug)]
pub struct Cap {
    /// Interval per cost unit (1/R).
    pub(super) step: Nanos,
    /// The next free slot.
    pub(super) next: Nanos,
    /// Heads waiting for the cap, earliest due first.
    pub(super) heads: BinaryHeap<Reverse<HeadRef>>,
    /// The earliest instant the releaser has promised to look at this cap.
    pub(super) armed: Nanos,
    /// The end of the latest pause the upstream asked for.
    pub(super) paused_until: Nanos,
    /// Entries of `heads` made stale by a cancelled head since the heap
    /// was last pruned ([`Cap::needs_pruning`]).
    pub(super) stale: usize,
}

impl Cap {
    pub(super) fn new(step: Nanos) -> Cap {
        Cap {
            step,
            next: 0,
            heads: BinaryHeap::new(),
            armed: Nanos::MAX,
            paused_until: 0,
            stale: 0,
        }
    }

    /// Whether the stale entries are enough to be worth a pass over the
    /// heap: more than half of it (and a margin), so that each pass is
    /// paid for by as many cancellations and the heap stays within twice
    /// its live heads, whatever a client that cancels in a loop does.
    pub(super) fn needs_pruning(&self) -> bool {
        over_stale(self.stale, self.heads.len())
    }

    /// Whether an arrival may take a slot now: the slot is free and no
    /// queued head is due before it (a stale top only makes this stricter).
    fn free(&self, now: Nanos) -> bool {
        self.next <= now && self.heads.peek().is_none_or(|h| h.0.due > now)
    }

    /// When a waiting head can next be granted a slot (a lower bound: the
    /// top may be stale).
    pub(super) fn next_release(&self) -> Option<Nanos> {
        self.heads.peek().map(|h| h.0.due.max(self.next))
    }

    /// Advance the slot for a departure of `cost` scheduled at `at` and made
    /// at `now`: the cap keeps its grid through release delays under half
    /// a slot; a later release is followed half a slot after it at the
    /// earliest (no faster than twice its rate), and the grid goes on from
    /// there; a delay longer than [`CAP_REANCHOR`] (or one slot, when slots
    /// are longer) restarts it a whole slot after the release.
    fn advance(&mut self, cost: u64, at: Nanos, now: Nanos) {
        let gap = cost.saturating_mul(self.step);
        let late = now.saturating_sub(at);
        self.next = if late > gap.max(CAP_REANCHOR) {
            now.saturating_add(gap)
        } else if late > 0 {
            at.saturating_add(gap).max(now.saturating_add(gap / 2))
        } else {
            at.saturating_add(gap)
        };
    }
}

/// Idle states are forgotten in buckets of 2^26 ns (67 ms) of their
/// schedule: coarse, and never before the schedule has passed.
const EXPIRY_BUCKET_BITS: u32 = 26;

/// The hash this shard's table files a client under, from the low 32 bits
/// of the engine's hash (the engine picks the shard from the high ones):
/// repeated in both halves, so that hashbrown's bucket (its low bits) and
/// tag (its top seven) both come from them.
fn table_hash(h32: u32) -> u64 {
    u64::from(h32) * 0x1_0000_0001
}

/// Whether `stale` of a heap's `len` entries are enough to prune it.
fn over_stale(stale: usize, len: usize) -> bool {
    stale > STALE_SLACK + len / 2
}

/// Stale heap entries tolerated beyond half the heap.
pub(super) const STALE_SLACK: usize = 1_024;

/// How late a capped release may come and still keep the cap's grid.
const CAP_REANCHOR: Nanos = 100_000_000;

/// A queue head waiting in a heap. Stale once its entry left the queue
/// (the entry's generation moved on) or stopped being the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct HeadRef {
    pub(super) due: Nanos,
    /// Arrival, then admission order: ties are served first come.
    arrival: Nanos,
    seq: u64,
    pub(super) shard: u32,
    entry: u32,
    generation: u32,
}

/// A route as a shard sees it.
#[derive(Debug, Clone)]
pub(super) struct ShardRoute {
    pub(super) policy: Policy,
    pub(super) cap: Option<(u32, Arc<Mutex<Cap>>)>,
    /// Requests waiting here that were admitted at another interval than
    /// the policy's (a reload changed the rate): while there are any, a
    /// departure estimate adds up each one's own interval.
    pub(super) odd: usize,
    /// The last sequence number given out when the interval changed: the
    /// requests admitted after it have the policy's interval.
    pub(super) odd_seq: u64,
}

struct Slot<K> {
    generation: u32,
    client: Option<Client<K>>,
}

struct Client<K> {
    key: K,
    route: RouteId,
    /// The low half of the engine's hash of (route, key): see
    /// [`table_hash`]. Kept so that growing the table or forgetting the
    /// client never hashes the key again (it fits in the padding).
    hash: u32,
    /// The schedule value D: the earliest time its next cost unit may go
    /// (pushed back by the burst tolerance τ when one is configured).
    tat: Nanos,
    /// When the head is due while the queue is not empty; while it is
    /// empty, the earliest instant a new arrival may depart (set after a
    /// late release, so that a burst allowance never sends the next one
    /// closer than c·T/2 to it; 0 otherwise).
    due: Nanos,
    waiting_cost: u64,
    waiting: u32,
    head: u32,
    tail: u32,
    in_expiry: bool,
}

struct Entry<P> {
    generation: u32,
    prev: u32,
    next: u32,
    /// Owning client slot.
    client: u32,
    cost: u32,
    seq: u64,
    arrival: Nanos,
    /// The interval per cost unit when it was admitted: a policy change
    /// (reload) applies to new arrivals, never to requests already waiting.
    step: Nanos,
    /// `None` while the entry is free.
    payload: Option<P>,
}

/// Read-only inputs of one admission decision.
struct Ask<'a> {
    policy: &'a Policy,
    cap: Option<&'a Cap>,
    cost: u32,
    now: Nanos,
    /// Some request of the route admitted up to this sequence number
    /// waits at an interval of its own ([`ShardRoute::odd_seq`]).
    odd: Option<u64>,
}

enum Decision {
    Depart,
    /// Wait: `due` is when the client's own schedule lets it go (the order
    /// among heads); `departure` the estimate told to the caller, bounded
    /// below by the cap's slots.
    Queue {
        due: Nanos,
        departure: Nanos,
    },
    Reject(Rejection),
}

pub(super) struct Shard<K, P> {
    id: u32,
    /// (slot, its client's hash): the hash beside the slot, so that a
    /// probe and a rehash compare hashes in the table itself instead of
    /// loading each candidate's slot (a cache miss per candidate; under
    /// the pass-through bench's churn of new keys, lookup and rehash fell
    /// from 4.2 % to 1.7 % of the proxy's CPU samples). 4 bytes more per
    /// bucket: about 9 bytes per idle client.
    index: HashTable<(u32, u32)>,
    slots: Vec<Slot<K>>,
    free_slots: Vec<u32>,
    /// A client or a queue entry was made since the last sweep: the load
    /// has not passed, so [`Shard::compact`] keeps the memory.
    busy: bool,
    entries: Vec<Entry<P>>,
    free_entries: Vec<u32>,
    /// The generation new entries start at (above every one used before
    /// the arena was last released).
    entry_generations: u32,
    /// Heads of queues on uncapped upstreams.
    heads: BinaryHeap<Reverse<HeadRef>>,
    /// Entries of `heads` made stale by a cancelled head since it was
    /// last pruned.
    stale: usize,
    /// The earliest instant the releaser has promised to look at `heads`.
    armed: Nanos,
    /// Clients with an empty queue whose schedule is still in the future,
    /// as (slot, generation), by the bucket of time in which they may be
    /// forgotten: amortized O(1) per client, however many are held.
    expiry: BTreeMap<u64, Vec<(u32, u32)>>,
    /// Told of every expiry scheduled (the engine's, shared by its shards).
    sweeps: Arc<Sweeps>,
    pub(super) routes: Vec<ShardRoute>,
    seq: u64,
}

/// Whether a release scheduled at `at`, made at `now`, came later than the
/// client's whole backlog (b·T, at least one interval): the pacer stalled
/// for longer than catching up could be worth, and the schedule restarts
/// from the release (DESIGN section 1, late releases).
fn stalled(at: Nanos, now: Nanos, capacity: u32, step: Nanos) -> bool {
    now.saturating_sub(at) > u64::from(capacity.max(1)).saturating_mul(step)
}

/// When an arrival may depart if it finds its client's queue empty: the
/// schedule less the burst tolerance, and not before the floor a late
/// release left (`due`, read only while nothing waits).
fn idle_earliest(tat: Nanos, due: Nanos, tau: Nanos, waiting: u32) -> Nanos {
    let floor = if waiting == 0 { due } else { 0 };
    tat.saturating_sub(tau).max(floor)
}

impl<K: Hash + Eq, P> Shard<K, P> {
    pub(super) fn new(id: u32, sweeps: Arc<Sweeps>) -> Shard<K, P> {
        Shard {
            id,
            index: HashTable::new(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            busy: false,
            entries: Vec::new(),
            free_entries: Vec::new(),
            entry_generations: 0,
            heads: BinaryHeap::new(),
            stale: 0,
            armed: Nanos::MAX,
            expiry: BTreeMap::new(),
            sweeps,
            routes: Vec::new(),
            seq: 0,
        }
    }

    fn find(&self, route: RouteId, key: &K, hash: u64) -> Option<u32> {
        let slots = &self.slots;
        let h32 = hash as u32;
        self.index
            .find(table_hash(h32), |&(s, h)| {
                h == h32
                    && slots[s as usize]
                        .client
                        .as_ref()
                        .is_some_and(|c| c.route == route && c.key == *key)
            })
            .map(|&(s, _)| s)
    }

    /// The slot of (route, key), made (counted against the budget) when
    /// the client has no state. `None` when no client may be added.
    fn find_or_insert(
        &mut self,
        route: RouteId,
        key: K,
        hash: u64,
        now: Nanos,
        budget: &Budget,
    ) -> Option<u32> {
        if let Some(slot) = self.find(route, &key, hash) {
            return Some(slot);
        }
        if !budget.take_client() {
            // Out of client room: forget what has expired first.
            self.expire(now, budget);
            if !budget.take_client() {
                return None;
            }
        }
        self.busy = true;
        let h32 = hash as u32;
        let client = Client {
            key,
            route,
            hash: h32,
            tat: 0,
            due: 0,
            waiting_cost: 0,
            waiting: 0,
            head: NIL,
            tail: NIL,
            in_expiry: false,
        };
        let slot = match self.free_slots.pop() {
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
        self.index
            .insert_unique(table_hash(h32), (slot, h32), |&(_, h)| table_hash(h));
        Some(slot)
    }

    fn client(&self, slot: u32) -> Option<&Client<K>> {
        self.slots.get(slot as usize)?.client.as_ref()
    }

    /// The rules of DESIGN section 1 for one arrival, read-only. `client`
    /// is `None` for a client with no state (idle).
    fn decide(&self, client: Option<&Client<K>>, ask: &Ask<'_>, budget: &Budget) -> Decision {
        let Ask {
            policy,
            cap,
            cost,
            now,
            odd,
        } = *ask;
        let step = policy.rate.interval_nanos();
        let (tat, waiting, waiting_cost, due) =
            client.map_or((0, 0, 0, 0), |c| (c.tat, c.waiting, c.waiting_cost, c.due));
        // Idle (nothing waiting, schedule reached): depart at once if the
        // upstream's cap, if any, has a free slot.
        let earliest = idle_earliest(tat, due, policy.tolerance(), waiting).max(now);
        if waiting == 0 && earliest == now && cap.is_none_or(|c| c.free(now)) {
            return Decision::Depart;
        }
        // It has to wait: capacity, then max_wait, then the global bound.
        if waiting_cost + u64::from(cost) > u64::from(policy.capacity) {
            // (Nothing waiting, a new client: it could not go only for
            // the cap's slot or pause, whose end is when it may.)
            let at = match client {
                Some(c) => self.accepts_at(c, ask),
                None => cap.map_or(now, |c| c.next),
            };
            return Decision::Reject(Rejection::Full {
                retry_after: at.saturating_sub(now).max(1),
            });
        }
        // Under a cap each unit waiting ahead also needs one of the cap's
        // slots: a lower bound on the departure.
        let own = match client {
            Some(c) if waiting > 0 => due.saturating_add(self.span(c, step, odd)),
            _ => earliest,
        };
        let departure = match cap {
            Some(c) => own.max(c.next.saturating_add(waiting_cost.saturating_mul(c.step))),
            None => own,
        }
        .max(now);
        if let Some(max_wait) = policy.max_wait
            && departure > now.saturating_add(max_wait)
        {
            return Decision::Reject(Rejection::MaxWait {
                retry_after: departure - max_wait - now,
            });
        }
        if !budget.has_queue_room() {
            return Decision::Reject(Rejection::TooManyQueued);
        }
        Decision::Queue {
            due: own.max(now),
            departure,
        }
    }

    /// When a client's queue would accept a request of `ask.cost` (for
    /// Retry-After): the departure that brings the waiting cost down to
    /// `capacity − cost`, or, for a cost the queue can never hold, the time
    /// the client is idle again. Exact without a cap; a lower bound with
    /// one.
    fn accepts_at(&self, client: &Client<K>, ask: &Ask<'_>) -> Nanos {
        let step = ask.policy.rate.interval_nanos();
        let capacity = u64::from(ask.policy.capacity);
        let cost = u64::from(ask.cost);
        if client.waiting == 0 {
            // Nothing waiting: when it may go at once, its own schedule
            // and the cap's next slot (a pause's end) both allowing (b = 0,
            // or a cost the queue can never hold, refused only for the
            // cap: its next slot, not 1 s).
            let idle = idle_earliest(client.tat, client.due, ask.policy.tolerance(), 0);
            return ask.cap.map_or(idle, |c| idle.max(c.next));
        }
        // When the units ahead of `done` units, `span` of the client's own
        // schedule, have left: on its own grid, and (with a cap) on the
        // upstream's.
        let leaves = |done: u64, span: Nanos| {
            let own = client.due.saturating_add(span);
            match ask.cap {
                Some(c) => own.max(c.next.saturating_add(done.saturating_mul(c.step))),
                None => own,
            }
        };
        if cost > capacity {
            return leaves(client.waiting_cost, self.span(client, step, ask.odd));
        }
        // Walk departures from the head until enough cost has gone; at most
        // `cost` units need to go since waiting_cost <= capacity. Each
        // request spaces the next by its own interval.
        let mut waiting = client.waiting_cost;
        let (mut done, mut span) = (0, 0);
        let mut at = client.head;
        while let Some(e) = self.entries.get(at as usize) {
            let leaves_at = leaves(done, span);
            waiting -= u64::from(e.cost);
            if waiting + cost <= capacity {
                return leaves_at;
            }
            done += u64::from(e.cost);
            span = span.saturating_add(u64::from(e.cost).saturating_mul(e.step));
            at = e.next;
        }
        leaves(done, span)
    }

    /// How long a client's waiting requests keep its own schedule busy:
    /// each one's cost times the interval it was admitted at (the route's
    /// `step` for all, unless `odd` names the last request admitted before
    /// a reload changed it: those, at the head, are added one by one).
    fn span(&self, c: &Client<K>, step: Nanos, odd: Option<u64>) -> Nanos {
        let Some(last_old) = odd else {
            return c.waiting_cost.saturating_mul(step);
        };
        let (mut span, mut rest, mut at) = (0u64, c.waiting_cost, c.head);
        while let Some(e) = self
            .entries
            .get(at as usize)
            .filter(|e| at != NIL && e.seq <= last_old)
        {
            span = span.saturating_add(u64::from(e.cost).saturating_mul(e.step));
            rest = rest.saturating_sub(u64::from(e.cost));
            at = e.next;
        }
        span.saturating_add(rest.saturating_mul(step))
    }

    /// After a reload changed `route`'s interval to `step`: count the
    /// requests waiting at another ([`ShardRoute::odd`]).
    pub(super) fn recount_odd(&mut self, route: RouteId, step: Nanos) {
        let mut odd = 0;
        for c in self.slots.iter().filter_map(|s| s.client.as_ref()) {
            if c.route != route || c.waiting == 0 {
                continue;
            }
            let mut at = c.head;
            while let Some(e) = self.entries.get(at as usize).filter(|_| at != NIL) {
                odd += usize::from(e.step != step);
                at = e.next;
            }
        }
        if let Some(r) = self.routes.get_mut(route.0 as usize) {
            r.odd = odd;
            r.odd_seq = self.seq;
        }
    }

    /// Decide an arrival; see [`super::Engine::admit`]. `cap` is the
    /// route's cap, locked by the caller, and must be given exactly when
    /// the route has one.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn admit(
        &mut self,
        route: RouteId,
        key: K,
        hash: u64,
        cost: u32,
        now: Nanos,
        mut cap: Option<&mut Cap>,
        budget: &Budget,
        payload: impl FnOnce() -> P,
    ) -> Admission {
        let Some((policy, odd)) = self
            .routes
            .get(route.0 as usize)
            .map(|r| (r.policy, (r.odd > 0).then_some(r.odd_seq)))
        else {
            return Admission::Rejected(Rejection::TooManyClients);
        };
        let Some(slot) = self.find_or_insert(route, key, hash, now, budget) else {
            return Admission::Rejected(Rejection::TooManyClients);
        };
        let ask = Ask {
            policy: &policy,
            cap: cap.as_deref(),
            cost,
            now,
            odd,
        };
        let decision = self.decide(self.client(slot), &ask, budget);
        let step = policy.rate.interval_nanos();
        match decision {
            Decision::Depart => {
                let Some(c) = self.slots[slot as usize].client.as_mut() else {
                    return Admission::Rejected(Rejection::TooManyClients);
                };
                c.tat = c
                    .tat
                    .max(now)
                    .saturating_add(u64::from(cost).saturating_mul(step));
                if let Some(cap) = cap.as_deref_mut() {
                    cap.next = cap
                        .next
                        .max(now)
                        .saturating_add(u64::from(cost).saturating_mul(cap.step));
                }
                self.schedule_expiry(slot);
                Admission::Depart
            }
            Decision::Reject(rejection) => {
                self.forget_if_idle(slot, now, budget);
                Admission::Rejected(rejection)
            }
            Decision::Queue { due, departure } => {
                if !budget.take_queued() {
                    self.forget_if_idle(slot, now, budget);
                    return Admission::Rejected(Rejection::TooManyQueued);
                }
                self.seq += 1;
                let seq = self.seq;
                let entry = self.new_entry(Entry {
                    generation: 0,
                    prev: NIL,
                    next: NIL,
                    client: slot,
                    cost,
                    seq,
                    arrival: now,
                    step,
                    payload: Some(payload()),
                });
                let generation = self.entries[entry as usize].generation;
                let Some(c) = self.slots[slot as usize].client.as_mut() else {
                    return Admission::Rejected(Rejection::TooManyClients);
                };
                let becomes_head = c.head == NIL;
                if becomes_head {
                    c.head = entry;
                } else {
                    let tail = c.tail;
                    self.entries[tail as usize].next = entry;
                    self.entries[entry as usize].prev = tail;
                }
                c.tail = entry;
                c.waiting += 1;
                c.waiting_cost += u64::from(cost);
                let mut wake = None;
                if becomes_head {
                    c.due = due;
                    let head = HeadRef {
                        due,
                        arrival: now,
                        seq,
                        shard: self.id,
                        entry,
                        generation,
                    };
                    wake = self.push_head(head, route, cap);
                }
                Admission::Queued {
                    ticket: Ticket {
                        shard: self.id,
                        entry,
                        generation,
                    },
                    departure,
                    wake,
                }
            }
        }
    }

    /// Put a new head in its heap (the cap's, or this shard's), and say
    /// whether the releaser must be told to look earlier than it will.
    fn push_head(&mut self, head: HeadRef, route: RouteId, cap: Option<&mut Cap>) -> Option<Wake> {
        match cap {
            Some(cap) => {
                cap.heads.push(Reverse(head));
                let up = self
                    .routes
                    .get(route.0 as usize)
                    .and_then(|r| r.cap.as_ref())
                    .map_or(0, |c| c.0);
                (head.due < cap.armed).then(|| {
                    cap.armed = head.due;
                    Wake {
                        target: Target::Cap(up),
                        at: head.due,
                    }
                })
            }
            None => {
                self.heads.push(Reverse(head));
                (head.due < self.armed).then(|| {
                    self.armed = head.due;
                    Wake {
                        target: Target::Shard(self.id),
                        at: head.due,
                    }
                })
            }
        }
    }

    fn new_entry(&mut self, entry: Entry<P>) -> u32 {
        self.busy = true;
        match self.free_entries.pop() {
            Some(i) => {
                let generation = self.entries[i as usize].generation;
                self.entries[i as usize] = Entry {
                    generation,
                    ..entry
                };
                i
            }
            None => {
                self.entries.push(Entry {
                    generation: self.entry_generations,
                    ..entry
                });
                (self.entries.len() - 1) as u32
            }
        }
    }

    /// Unlink an entry from its client's queue and free it; returns its
    /// cost and payload.
    fn take_entry(&mut self, i: u32, budget: &Budget) -> Option<(u32, Option<P>)> {
        let e = self.entries.get_mut(i as usize)?;
        e.payload.as_ref()?;
        let (prev, next, slot, cost, step) = (e.prev, e.next, e.client, e.cost, e.step);
        let payload = e.payload.take();
        e.generation = e.generation.wrapping_add(1);
        e.prev = NIL;
        e.next = NIL;
        self.free_entries.push(i);
        if prev != NIL {
            self.entries[prev as usize].next = next;
        }
        if next != NIL {
            self.entries[next as usize].prev = prev;
        }
        if let Some(c) = self.slots[slot as usize].client.as_mut() {
            if c.head == i {
                c.head = next;
            }
            if c.tail == i {
                c.tail = prev;
            }
            c.waiting -= 1;
            c.waiting_cost -= u64::from(cost);
            let route = c.route;
            if let Some(r) = self.routes.get_mut(route.0 as usize)
                && r.odd > 0
                && step != r.policy.rate.interval_nanos()
            {
                r.odd -= 1;
            }
        }
        budget.give_queued();
        Some((cost, payload))
    }

    /// Whether a heap entry still names the head of a live queue.
    pub(super) fn head_is_live(&self, h: &HeadRef) -> bool {
        self.entries.get(h.entry as usize).is_some_and(|e| {
            e.generation == h.generation
                && e.payload.is_some()
                && self.client(e.client).is_some_and(|c| c.head == h.entry)
        })
    }

    /// Release every uncapped head due at `now`, appending payloads to
    /// `out` in departure order; returns (and promises) when this shard
    /// next has work.
    pub(super) fn release(
        &mut self,
        now: Nanos,
        budget: &Budget,
        out: &mut Vec<P>,
    ) -> Option<Nanos> {
        while let Some(&Reverse(head)) = self.heads.peek() {
            if !self.head_is_live(&head) {
                self.heads.pop();
                continue;
            }
            if head.due > now {
                break;
            }
            self.heads.pop();
            self.depart(head, now, None, budget, out);
        }
        let next = self.heads.peek().map(|h| h.0.due);
        self.armed = next.unwrap_or(Nanos::MAX);
        next
    }

    /// When this shard's uncapped heads next have work (dropping stale
    /// entries from the top), without arming anything.
    pub(super) fn next_release(&mut self) -> Option<Nanos> {
        while let Some(&Reverse(head)) = self.heads.peek() {
            if self.head_is_live(&head) {
                return Some(head.due);
            }
            self.heads.pop();
        }
        None
    }

    /// The head `head` departs at `now`. `cap` is given when it came
    /// from a cap's heap. Returns the instant it was scheduled for.
    pub(super) fn depart(
        &mut self,
        head: HeadRef,
        now: Nanos,
        mut cap: Option<&mut Cap>,
        budget: &Budget,
        out: &mut Vec<P>,
    ) -> Nanos {
        let slot_free = cap.as_deref().map_or(0, |c| c.next);
        let at = head.due.max(slot_free);
        let Some(entry) = self.entries.get(head.entry as usize) else {
            return at;
        };
        let (slot, step, arrival) = (entry.client, entry.step, entry.arrival);
        let Some(c) = self
            .slots
            .get(slot as usize)
            .and_then(|s| s.client.as_ref())
        else {
            return at;
        };
        let Some(policy) = self.routes.get(c.route.0 as usize).map(|r| r.policy) else {
            return at;
        };
        let Some((cost, payload)) = self.take_entry(head.entry, budget) else {
            return at;
        };
        let Some(c) = self.slots[slot as usize].client.as_mut() else {
            return at;
        };
        let gap = u64::from(cost).saturating_mul(step);
        let tau = policy.tolerance();
        // The departing unit moves the client's schedule from when its own
        // schedule (or the cap's slot) let it go: D = d + c·T (DESIGN 1),
        // never from `now`, so pacer jitter never drifts the grid and a
        // late release is made up by the next ones, no two of which come
        // closer than c·T/2 (the floor below). Late is a release at least
        // c·T/2 after the instant it was due (a stalled pacer; a smaller
        // delay leaves the next grid time c·T/2 away or more), or one
        // whose due time a floor set (a catch-up under way, or a cancelled
        // head's inherited slot): never the release of a request that only
        // a cap or pause held, so its burst credit is never eaten. (The
        // grid is D − τ with `burst`.)
        // A release later than the whole backlog (b·T) restarts the
        // schedule from the release.
        let grid = c.tat.saturating_sub(tau);
        let late = now.saturating_sub(at) >= gap / 2 || head.due > grid.max(arrival);
        let floor = if late { now.saturating_add(gap / 2) } else { 0 };
        let own = c.tat.saturating_sub(tau).max(arrival).max(slot_free);
        c.tat = if stalled(at, now, policy.capacity, step) {
            now.saturating_add(tau).saturating_add(gap)
        } else {
            c.tat.max(own).saturating_add(gap)
        };
        if let Some(cap) = cap.as_deref_mut() {
            cap.advance(u64::from(cost), at, now);
        }
        if let Some(p) = payload {
            out.push(p);
        }
        self.promote(slot, now, floor, cap, budget);
        at
    }

    /// After the head left (departed or cancelled): put the new head, if
    /// any, in its heap, due no earlier than `floor`; otherwise let the
    /// client expire.
    fn promote(
        &mut self,
        slot: u32,
        now: Nanos,
        floor: Nanos,
        cap: Option<&mut Cap>,
        budget: &Budget,
    ) {
        let generation_of = |entries: &[Entry<P>], i: u32| entries[i as usize].generation;
        let Some(c) = self.slots[slot as usize].client.as_mut() else {
            return;
        };
        let route = c.route;
        let Some(tau) = self
            .routes
            .get(route.0 as usize)
            .map(|r| r.policy.tolerance())
        else {
            return;
        };
        if c.head == NIL {
            c.tat = c.tat.max(floor);
            c.due = floor;
            if c.tat <= now {
                self.remove(slot, budget);
            } else {
                self.schedule_expiry(slot);
            }
            return;
        }
        let e = &self.entries[c.head as usize];
        c.due = c.tat.saturating_sub(tau).max(e.arrival).max(floor);
        let head = HeadRef {
            due: c.due,
            arrival: e.arrival,
            seq: e.seq,
            shard: self.id,
            entry: c.head,
            generation: generation_of(&self.entries, c.head),
        };
        let capped = self
            .routes
            .get(route.0 as usize)
            .is_some_and(|r| r.cap.is_some());
        match cap {
            Some(cap) if capped => {
                cap.heads.push(Reverse(head));
            }
            _ => {
                self.heads.push(Reverse(head));
            }
        }
    }

    /// A rate change (reload) for `route`, from `old` to `new` nanoseconds
    /// per unit: an idle client whose schedule is still ahead (served
    /// recently) keeps that debt in intervals, not in time, so a client
    /// served at 1/d just before a reload to 100/s is not held for a day.
    /// Clients with requests waiting keep their schedule: those requests
    /// depart at the pace they were admitted under, new ones follow them.
    /// A burst changed on reload (its tolerance τ, by which a schedule is
    /// pushed back): a client with requests waiting keeps its grid (D − τ),
    /// so its queue still departs c·T apart; a larger τ would otherwise
    /// read every waiting request as late and send them at twice the rate.
    pub(super) fn retolerate(&mut self, route: RouteId, old: Nanos, new: Nanos) {
        for s in &mut self.slots {
            if let Some(c) = s.client.as_mut()
                && c.route == route
                && c.head != NIL
            {
                c.tat = if new >= old {
                    c.tat.saturating_add(new - old)
                } else {
                    c.tat.saturating_sub(old - new)
                };
            }
        }
    }

    pub(super) fn rescale(&mut self, route: RouteId, old: Nanos, new: Nanos, now: Nanos) {
        if old == 0 {
            return;
        }
        let (expiry, sweeps) = (&mut self.expiry, &self.sweeps);
        for (slot, s) in self.slots.iter_mut().enumerate() {
            if let Some(c) = s.client.as_mut()
                && c.route == route
                && c.head == NIL
                && c.tat > now
            {
                let was = c.tat >> EXPIRY_BUCKET_BITS;
                let ahead = u128::from(c.tat - now) * u128::from(new) / u128::from(old);
                c.tat = now.saturating_add(u64::try_from(ahead).unwrap_or(u64::MAX));
                // A late release's floor is never later than the schedule.
                c.due = c.due.min(c.tat);
                // Forgotten when the new schedule passes, not the old one
                // (the entry in the old bucket finds it gone, or is seen
                // again, as any stale entry is).
                let bucket = c.tat >> EXPIRY_BUCKET_BITS;
                if c.in_expiry
                    && bucket < was
                    && let Ok(slot) = u32::try_from(slot)
                {
                    expiry.entry(bucket).or_default().push((slot, s.generation));
                    sweeps.note(bucket << EXPIRY_BUCKET_BITS);
                }
            }
        }
    }

    /// Withdraw a waiting request; see [`super::Engine::cancel`]. `cap` is
    /// the ticket's route's cap, locked by the caller.
    pub(super) fn cancel(
        &mut self,
        ticket: Ticket,
        now: Nanos,
        cap: Option<&mut Cap>,
        budget: &Budget,
    ) -> Option<P> {
        let e = self.entries.get(ticket.entry as usize)?;
        if e.generation != ticket.generation || e.payload.is_none() {
            return None;
        }
        let slot = e.client;
        // The head's due time, which the next one inherits.
        let head_due = self
            .client(slot)
            .and_then(|c| (c.head == ticket.entry).then_some(c.due));
        let (_, payload) = self.take_entry(ticket.entry, budget)?;
        if let Some(floor) = head_due {
            // Its heap entry goes stale (it leaves when it reaches the
            // top, or when enough have piled up); the next one takes the
            // same slot: no earlier, which after a late release keeps the
            // c·T/2 the departure before it put between them.
            // The caller passes the cap exactly when the route is capped.
            match cap {
                Some(cap) => {
                    cap.stale += 1;
                    self.promote(slot, now, floor, Some(cap), budget);
                }
                None => {
                    self.stale += 1;
                    self.promote(slot, now, floor, None, budget);
                    if over_stale(self.stale, self.heads.len()) {
                        self.prune_heads();
                    }
                }
            }
        }
        payload
    }

    /// How many entries this shard's heap holds, stale ones included.
    #[cfg(test)]
    pub(super) fn heads_len(&self) -> usize {
        self.heads.len()
    }

    /// Drop the stale entries of this shard's heap.
    fn prune_heads(&mut self) {
        let mut heads = std::mem::take(&mut self.heads);
        heads.retain(|Reverse(h)| self.head_is_live(h));
        self.heads = heads;
        self.stale = 0;
    }

    /// Drop this shard's stale entries from a cap's heap (the caller
    /// holds this shard's lock, then the cap's).
    pub(super) fn prune_cap_heads(&self, cap: &mut Cap) {
        cap.heads
            .retain(|Reverse(h)| h.shard != self.id || self.head_is_live(h));
    }

    /// The route of the client that owns a ticket's entry, if it waits.
    pub(super) fn ticket_route(&self, ticket: Ticket) -> Option<RouteId> {
        let e = self.entries.get(ticket.entry as usize)?;
        if e.generation != ticket.generation || e.payload.is_none() {
            return None;
        }
        self.client(e.client).map(|c| c.route)
    }

    fn remove(&mut self, slot: u32, budget: &Budget) {
        let Some(h32) = self.client(slot).map(|c| c.hash) else {
            return;
        };
        if let Ok(entry) = self.index.find_entry(table_hash(h32), |&(s, _)| s == slot) {
            entry.remove();
        }
        let s = &mut self.slots[slot as usize];
        s.client = None;
        s.generation = s.generation.wrapping_add(1);
        self.free_slots.push(slot);
        budget.give_client();
        if self.index.is_empty() {
            // The shard's last client: a sweep, as soon as one may come,
            // gives its memory back (nothing else may be due to bring one).
            self.sweeps.note(0);
        }
    }

    /// Forget a client that holds nothing (a fresh state made for an
    /// arrival that was then refused), otherwise make sure it will expire.
    fn forget_if_idle(&mut self, slot: u32, now: Nanos, budget: &Budget) {
        let idle = self
            .client(slot)
            .is_some_and(|c| c.waiting == 0 && c.tat <= now);
        if idle {
            self.remove(slot, budget);
        }
    }

    fn schedule_expiry(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        if let Some(c) = s.client.as_mut()
            && !c.in_expiry
        {
            c.in_expiry = true;
            let bucket = c.tat >> EXPIRY_BUCKET_BITS;
            self.expiry
                .entry(bucket)
                .or_default()
                .push((slot, s.generation));
            self.sweeps.note(bucket << EXPIRY_BUCKET_BITS);
        }
    }

    /// Forget clients whose queue is empty and whose schedule has passed.
    pub(super) fn expire(&mut self, now: Nanos, budget: &Budget) {
        while let Some(first) = self.expiry.first_entry() {
            let bucket = *first.key();
            if bucket << EXPIRY_BUCKET_BITS > now {
                break;
            }
            let due = first.remove();
            let mut later = Vec::new();
            for (slot, generation) in due {
                let s = &mut self.slots[slot as usize];
                if s.generation != generation {
                    continue;
                }
                let Some(c) = s.client.as_mut() else { continue };
                if c.waiting > 0 {
                    // Re-armed when its queue empties.
                    c.in_expiry = false;
                } else if c.tat <= now {
                    self.remove(slot, budget);
                } else if c.tat >> EXPIRY_BUCKET_BITS == bucket {
                    later.push((slot, generation));
                } else {
                    c.in_expiry = false;
                    self.schedule_expiry(slot);
                }
            }
            if !later.is_empty() {
                // `now` is inside this bucket: the next ones start later.
                self.expiry.insert(bucket, later);
                break;
            }
        }
    }

    /// Give memory back once a load has passed: arenas and heaps that
    /// hold nothing live are released (they grow again on demand). Called
    /// at each sweep; the load has passed when no client or entry was made
    /// since the one before. (Not at once when a shard empties: under a
    /// churn of new clients, each released at once, every shard empties
    /// at every sweep, and its table, arena and expiry lists were rebuilt
    /// from nothing, doubling by doubling, after each one.)
    ///
    /// Returns whether memory was left to give back at the next sweep.
    pub(super) fn compact(&mut self) -> bool {
        let entries = !self.entries.is_empty() && self.free_entries.len() == self.entries.len();
        let slots = self.index.is_empty() && !self.slots.is_empty();
        let heads = self.heads.is_empty() && self.heads.capacity() > 0;
        if std::mem::take(&mut self.busy) {
            return entries || slots || heads;
        }
        if entries {
            // New entries start past every generation handed out, so an old
            // ticket or heap reference never matches one of them.
            let last = self.entries.iter().map(|e| e.generation).max().unwrap_or(0);
            self.entry_generations = self.entry_generations.max(last.wrapping_add(1));
            self.entries = Vec::new();
            self.free_entries = Vec::new();
        }
        if slots {
            self.slots = Vec::new();
            self.free_slots = Vec::new();
            self.index = HashTable::new();
            self.expiry = BTreeMap::new();
        }
        if heads {
            self.heads = BinaryHeap::new();
        }
        false
    }

    /// When [`Shard::expire`] may next have work (a lower bound), if ever.
    pub(super) fn next_expiry(&self) -> Option<Nanos> {
        self.expiry
            .first_key_value()
            .map(|(b, _)| b << EXPIRY_BUCKET_BITS)
    }

    /// Withdraw every waiting request, appending their payloads to `out`.
    /// Client schedules are kept.
    pub(super) fn withdraw_all(&mut self, now: Nanos, budget: &Budget, out: &mut Vec<P>) {
        for slot in 0..self.slots.len() as u32 {
            let mut at = match self.client(slot) {
                Some(c) if c.waiting > 0 => c.head,
                _ => continue,
            };
            while at != NIL {
                let next = self.entries[at as usize].next;
                if let Some((_, Some(p))) = self.take_entry(at, budget) {
                    out.push(p);
                }
                at = next;
            }
            self.promote(slot, now, 0, None, budget);
        }
    }

    fn view_of(&self, c: &Client<K>, now: Nanos) -> ClientView {
        let route = self.routes.get(c.route.0 as usize);
        let policy = route.map(|r| r.policy);
        let odd = route.and_then(|r| (r.odd > 0).then_some(r.odd_seq));
        let step = policy.map_or(0, |p| p.rate.interval_nanos());
        let next_departure = if c.waiting > 0 {
            c.due.saturating_add(self.span(c, step, odd))
        } else {
            idle_earliest(c.tat, c.due, policy.map_or(0, |p| p.tolerance()), 0).max(now)
        };
        ClientView {
            waiting_cost: c.waiting_cost,
            waiting: c.waiting as usize,
            next_departure,
        }
    }

    /// Look at one client without changing anything.
    pub(super) fn view(
        &self,
        route: RouteId,
        key: &K,
        hash: u64,
        now: Nanos,
    ) -> Option<ClientView> {
        let slot = self.find(route, key, hash)?;
        let c = self.client(slot)?;
        Some(self.view_of(c, now))
    }

    /// What [`Shard::admit`] would answer now, without changing anything.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn probe(
        &self,
        route: RouteId,
        key: &K,
        hash: u64,
        cost: u32,
        now: Nanos,
        cap: Option<&Cap>,
        budget: &Budget,
    ) -> Probe {
        let Some((policy, odd)) = self
            .routes
            .get(route.0 as usize)
            .map(|r| (r.policy, (r.odd > 0).then_some(r.odd_seq)))
        else {
            return Probe::Reject(Rejection::TooManyClients);
        };
        let client = self.find(route, key, hash).and_then(|s| self.client(s));
        if client.is_none() && !budget.has_client_room() {
            return Probe::Reject(Rejection::TooManyClients);
        }
        let ask = Ask {
            policy: &policy,
            cap,
            cost,
            now,
            odd,
        };
        match self.decide(client, &ask, budget) {
            Decision::Depart => Probe::Depart,
            Decision::Queue { departure, .. } => Probe::Queue { departure },
            Decision::Reject(r) => Probe::Reject(r),
        }
    }

    /// Visit the clients with something waiting among slots
    /// `from..from + count`; returns where to continue, or `None` at the
    /// end. Bounded work per call, so a status page never holds the lock
    /// for long.
    pub(super) fn scan_waiting(
        &self,
        from: usize,
        count: usize,
        now: Nanos,
        mut visit: impl FnMut(RouteId, &K, ClientView),
    ) -> Option<usize> {
        let end = from.saturating_add(count).min(self.slots.len());
        for s in self.slots.get(from..end).into_iter().flatten() {
            if let Some(c) = s.client.as_ref()
                && c.waiting > 0
            {
                visit(c.route, &c.key, self.view_of(c, now));
            }
        }
        (end < self.slots.len()).then_some(end)
    }
}

#[cfg(test)]
mod tests {
    /// The stored hash sits in what was padding: a client's slot with a
    /// 24-byte key (the daemon's key type) is still 80 bytes.
    #[test]
    fn the_stored_hash_costs_no_memory() {
        assert_eq!(std::mem::size_of::<super::Slot<[u64; 3]>>(), 80);
    }
}
