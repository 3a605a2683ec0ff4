//! `max_concurrency` (an upstream's calls in flight) and an SMTP
//! listener's `max_connections`: capped, and resized in place when a
//! reload changes the cap.
//!
//! A cap is one semaphore for the life of the process (per upstream
//! name), so the calls in flight across a reload count against the cap
//! that follows it, and the requests waiting for a slot keep their turn.
//! Growing adds slots. Shrinking takes the free slots away at once and
//! records the rest as owed: each call that ends while slots are owed
//! pays one instead of freeing it, so no new call starts until fewer
//! than the new cap are in flight. Calls in flight are never cut.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::Semaphore;

/// One upstream's in-flight slots.
#[derive(Debug)]
pub struct InFlight {
    slots: Semaphore,
    /// Slots taken away by a smaller cap while they were in use.
    owed: AtomicUsize,
    /// The cap now.
    limit: AtomicUsize,
    /// Calls holding a slot now.
    busy: AtomicUsize,
    /// Calls waiting for a slot now ([`InFlight::take`] pending).
    waiting: AtomicUsize,
}

/// A count held up while its guard lives.
struct Held<'a>(&'a AtomicUsize);

impl<'a> Held<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Held(count)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One call's slot, given back (or paid towards what is owed) on drop.
#[derive(Debug)]
pub struct CallSlot(Arc<InFlight>);

impl InFlight {
    pub fn new(limit: usize) -> Arc<InFlight> {
        Arc::new(InFlight {
            slots: Semaphore::new(limit.min(Semaphore::MAX_PERMITS)),
            owed: AtomicUsize::new(0),
            limit: AtomicUsize::new(limit),
            busy: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
        })
    }

    /// A free slot, now.
    pub fn try_take(self: &Arc<Self>) -> Option<CallSlot> {
        let permit = self.slots.try_acquire().ok()?;
        permit.forget();
        Some(self.granted())
    }

    /// A slot, first come, first served as calls end (`None` only if the
    /// semaphore were closed, which it never is). Counted as waiting from
    /// its first poll until it has the slot or is dropped.
    pub async fn take(self: &Arc<Self>) -> Option<CallSlot> {
        let _waiting = Held::new(&self.waiting);
        let permit = self.slots.acquire().await.ok()?;
        permit.forget();
        Some(self.granted())
    }

    fn granted(self: &Arc<Self>) -> CallSlot {
        self.busy.fetch_add(1, Ordering::Relaxed);
        CallSlot(self.clone())
    }

    /// Calls holding a slot, and calls waiting for one, now.
    pub fn load(&self) -> (usize, usize) {
        (
            self.busy.load(Ordering::Relaxed),
            self.waiting.load(Ordering::Relaxed),
        )
    }

    /// The cap now.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// The cap goes from `old` to `new`.
    pub fn resize(&self, old: usize, new: usize) {
        self.limit.store(new, Ordering::Relaxed);
        if new >= old {
            let more = new - old;
            // What is owed is forgiven first: those slots are still in use.
            let forgiven = self
                .owed
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    Some(n.saturating_sub(more))
                })
                .map_or(0, |was| was.min(more));
            self.slots.add_permits(more - forgiven);
        } else {
            let less = old - new;
            let free = self.slots.forget_permits(less);
            self.owed.fetch_add(less - free, Ordering::AcqRel);
        }
    }

    fn give_back(&self) {
        let paid = self
            .owed
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        if !paid {
            self.slots.add_permits(1);
        }
    }
}

impl Drop for CallSlot {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
        self.0.give_back();
    }
}

/// Caps by name (`max_concurrency` by upstream, `max_connections` by
/// SMTP listener), with the limit each was last given, kept across
/// reloads so that what is in flight across a reload counts against the
/// same cap. A reload works on a copy; the caps are resized only when it
/// is committed.
#[derive(Default, Clone)]
pub struct Concurrency(HashMap<String, (usize, Arc<InFlight>)>);

impl Concurrency {
    /// `name`'s cap, planned at `limit` (resized at [`Concurrency::commit`]).
    pub fn get(&mut self, name: &str, limit: usize) -> Arc<InFlight> {
        match self.0.get_mut(name) {
            Some((n, cap)) => {
                *n = limit;
                cap.clone()
            }
            None => {
                let cap = InFlight::new(limit);
                self.0.insert(name.to_owned(), (limit, cap.clone()));
                cap
            }
        }
    }

    /// Make `next` (this copy, changed by a reload that succeeded) the
    /// caps in force: each cap whose limit changed is resized in place.
    pub fn commit(&mut self, next: Concurrency) {
        for (name, (limit, cap)) in &next.0 {
            if let Some(&(was, _)) = self.0.get(name)
                && was != *limit
            {
                cap.resize(was, *limit);
            }
        }
        *self = next;
    }

    /// `name`'s cap now, if it has one.
    pub fn current(&self, name: &str) -> Option<Arc<InFlight>> {
        self.0.get(name).map(|(_, cap)| cap.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take_all(cap: &Arc<InFlight>) -> Vec<CallSlot> {
        std::iter::from_fn(|| cap.try_take()).collect()
    }

    #[test]
    fn a_smaller_cap_takes_free_slots_at_once_and_busy_ones_as_calls_end() {
        let cap = InFlight::new(4);
        let mut busy = take_all(&cap);
        assert_eq!(busy.len(), 4);
        drop(busy.pop());
        cap.resize(4, 2);
        // One slot was free and is gone; one more is owed by the 3 calls.
        assert!(cap.try_take().is_none());
        drop(busy.pop());
        assert!(
            cap.try_take().is_none(),
            "the ended call paid what was owed"
        );
        drop(busy.pop());
        let next = cap.try_take();
        assert!(next.is_some(), "one call in flight under a cap of 2");
        drop(next);
        drop(busy);
        assert_eq!(take_all(&cap).len(), 2);
    }

    #[test]
    fn a_larger_cap_forgives_what_is_owed_before_adding_slots() {
        let cap = InFlight::new(4);
        let busy = take_all(&cap);
        cap.resize(4, 1);
        cap.resize(1, 3);
        assert_eq!(cap.limit(), 3);
        // 4 in flight under a cap of 3: one is still owed.
        assert!(cap.try_take().is_none());
        drop(busy);
        assert_eq!(take_all(&cap).len(), 3);
        cap.resize(3, 5);
        assert_eq!(take_all(&cap).len(), 5);
    }

    #[tokio::test]
    async fn calls_holding_and_waiting_for_slots_are_counted() {
        let cap = InFlight::new(1);
        assert_eq!(cap.load(), (0, 0));
        let busy = cap.try_take();
        assert_eq!(cap.load(), (1, 0));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut waiting = Box::pin(cap.take());
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        assert_eq!(cap.load(), (1, 1));
        drop(busy);
        let slot = waiting.await;
        assert!(slot.is_some());
        assert_eq!(cap.load(), (1, 0));
        let mut given_up = Box::pin(cap.take());
        assert!(given_up.as_mut().poll(&mut cx).is_pending());
        assert_eq!(cap.load(), (1, 1));
        drop(given_up);
        drop(slot);
        assert_eq!(cap.load(), (0, 0));
    }

    #[tokio::test]
    async fn a_waiting_call_keeps_its_turn_across_a_resize() {
        let cap = InFlight::new(1);
        let busy = cap.try_take();
        let waiting = tokio::spawn({
            let cap = cap.clone();
            async move { cap.take().await }
        });
        tokio::task::yield_now().await;
        cap.resize(1, 2);
        let slot = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .ok()
            .and_then(Result::ok)
            .flatten();
        assert!(slot.is_some());
        assert!(cap.try_take().is_none());
        drop(busy);
        assert!(cap.try_take().is_some());
    }
}
