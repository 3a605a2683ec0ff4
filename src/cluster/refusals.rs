//! Refusals remembered: a client the store has just found full (or
//! whose departure would be past `max_wait`) is refused here again,
//! without a call, until a place may have freed.
//!
//! A client that floods (a retry loop, an attack on one key) would
//! otherwise cost a store round trip per 429: through PostgreSQL a
//! row-locked transaction each, which queue on that one row and take the
//! pool from every other client (their calls time out to `on_failure`);
//! through Redis a script each. The store's refusal says when the
//! client's queue accepts a request of that cost again (its Retry-After):
//! before then, the same request is refused by the store too, unless a
//! place was given back meanwhile. Places given back here (a withdrawal
//! from this instance) forget the client's refusal; one given back by
//! another instance is not seen here, so a refusal is remembered for at
//! most [`REMEMBERED_FOR`].

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::Ask;

/// The longest a refusal is remembered: how long a place another instance
/// gives back may go unseen here.
pub const REMEMBERED_FOR: Duration = Duration::from_secs(1);

const SHARDS: usize = 16;

/// Clients remembered per shard at most: past it a refusal is not
/// remembered (the next request asks the store), so memory stays bounded
/// whatever the keys.
const PER_SHARD: usize = 1_024;

/// How often a shard drops the refusals that have lapsed, at most (a
/// refusal looked up after it lapsed goes at once).
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// Why the store refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    Full,
    MaxWait,
}

/// One remembered refusal: the client's queue takes no request of `cost`
/// or more before `retry_at` (the store's Retry-After), under the policy
/// it was refused under; remembered until `until`. (A larger cost needs
/// as much room or more: see [`Refusals::refused`] for how much longer it
/// waits.)
struct Refused {
    why: Why,
    until: Instant,
    retry_at: Instant,
    cost: u32,
    policy: (u64, u32, u64, u64),
}

#[derive(Default)]
struct Shard {
    refused: HashMap<String, Refused>,
    /// When a place was last given back by a client of this shard: a
    /// refusal asked before then may predate it, and is not remembered.
    forgot: Option<Instant>,
    swept: Option<Instant>,
}

impl Shard {
    /// Drop what has lapsed, once per [`SWEEP_EVERY`] at most.
    fn sweep(&mut self, now: Instant) {
        if self
            .swept
            .is_none_or(|t| now.saturating_duration_since(t) >= SWEEP_EVERY)
        {
            self.refused.retain(|_, r| r.until > now);
            self.swept = Some(now);
        }
    }
}

pub struct Refusals {
    shards: [Mutex<Shard>; SHARDS],
    hasher: RandomState,
}

impl Default for Refusals {
    fn default() -> Refusals {
        Refusals {
            shards: std::array::from_fn(|_| Mutex::default()),
            hasher: RandomState::new(),
        }
    }
}

/// What decides a refusal besides the client's D: a reload that changes
/// the rate, the capacity, the burst or `max_wait` starts over.
fn policy(ask: &Ask) -> (u64, u32, u64, u64) {
    (ask.step_us, ask.capacity, ask.tau_us, ask.max_wait_us)
}

impl Refusals {
    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, Shard> {
        // (The shard index is below SHARDS.)
        let i = usize::try_from(self.hasher.hash_one(key) % SHARDS as u64).unwrap_or(0);
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why `ask`'s client is remembered as refused, and the Retry-After
    /// the store would give `ask`, counted down to `now`.
    ///
    /// A full queue takes a request of cost c once its client's D is at
    /// most (b + 1 - c)·T ahead (both stores: Retry-After = D - (b - c +
    /// 1)·T - now, and D - now when c > b), so a larger cost than the one
    /// refused waits that much longer. A departure past `max_wait` does
    /// not depend on the cost: the same Retry-After.
    pub fn refused(&self, ask: &Ask, now: Instant) -> Option<(Why, Duration)> {
        let mut shard = self.shard(&ask.key);
        shard.sweep(now);
        let r = shard.refused.get(&ask.key)?;
        if r.until <= now || r.policy != policy(ask) {
            shard.refused.remove(&ask.key);
            return None;
        }
        if ask.cost < r.cost {
            return None;
        }
        let retry_at = match r.why {
            Why::MaxWait => r.retry_at,
            Why::Full => {
                let room = |cost: u32| u64::from(cost.min(ask.capacity.saturating_add(1)));
                let later = room(ask.cost)
                    .saturating_sub(room(r.cost))
                    .saturating_mul(ask.step_us);
                // (A wait past the clock's range: the store answers.)
                r.retry_at.checked_add(Duration::from_micros(later))?
            }
        };
        Some((r.why, retry_at.saturating_duration_since(now)))
    }

    /// The store refused `ask` (`why`), asked at `asked` (before the store
    /// read its clock: the place frees no earlier than `asked` +
    /// `retry_after` here), with `retry_after`.
    pub fn remember(&self, ask: &Ask, why: Why, asked: Instant, retry_after: Duration) {
        // (A store's reply past the clock's range is not remembered.)
        let Some(retry_at) = asked.checked_add(retry_after) else {
            return;
        };
        let mut shard = self.shard(&ask.key);
        if shard.forgot.is_some_and(|t| asked <= t) {
            return;
        }
        if shard.refused.len() >= PER_SHARD && !shard.refused.contains_key(&ask.key) {
            shard.sweep(Instant::now());
            if shard.refused.len() >= PER_SHARD {
                return;
            }
        }
        // The latest answer replaces an earlier one: it has the client's
        // D as it is now.
        shard.refused.insert(
            ask.key.clone(),
            Refused {
                why,
                until: asked + retry_after.min(REMEMBERED_FOR),
                retry_at,
                cost: ask.cost,
                policy: policy(ask),
            },
        );
    }

    /// A place of `key`'s client was given back: ask the store again, and
    /// remember no refusal asked before now (it may have been answered
    /// before the place came back).
    pub fn forget(&self, key: &str) {
        let mut shard = self.shard(key);
        shard.refused.remove(key);
        shard.forgot = Some(Instant::now());
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).refused.len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{PER_SHARD, REMEMBERED_FOR, Refusals, SHARDS, Why};
    use crate::cluster::Ask;

    fn ask(key: &str, cost: u32, capacity: u32) -> Ask {
        Ask {
            key: key.to_owned(),
            slots: None,
            step_us: 200_000,
            capacity,
            cost,
            tau_us: 0,
            slot_us: 0,
            max_wait_us: 0,
        }
    }

    #[test]
    fn a_refusal_is_remembered_until_its_retry_after_for_that_cost_and_more() {
        let (r, t0) = (Refusals::default(), Instant::now());
        let ms = |n: u64| Duration::from_millis(n);
        r.remember(&ask("a", 2, 10), Why::Full, t0, ms(300));
        assert_eq!(
            r.refused(&ask("a", 2, 10), t0 + ms(100)),
            Some((Why::Full, ms(200)))
        );
        // A larger cost waits (5 - 2)·T longer (T = 200 ms), as the store
        // would say; past the capacity, as long as a cost of b + 1.
        assert_eq!(
            r.refused(&ask("a", 5, 10), t0 + ms(299)),
            Some((Why::Full, ms(601)))
        );
        assert_eq!(
            r.refused(&ask("a", 11, 10), t0 + ms(299)),
            Some((Why::Full, ms(1_801)))
        );
        assert_eq!(
            r.refused(&ask("a", 500, 10), t0 + ms(299)),
            Some((Why::Full, ms(1_801)))
        );
        // A cheaper request may fit: the store decides.
        assert_eq!(r.refused(&ask("a", 1, 10), t0 + ms(100)), None);
        assert_eq!(r.refused(&ask("b", 2, 10), t0 + ms(100)), None);
        // Another policy (a reload), or the place freed: asked again.
        assert_eq!(r.refused(&ask("a", 2, 11), t0 + ms(100)), None);
        assert_eq!(r.refused(&ask("a", 2, 10), t0 + ms(100)), None);
        r.remember(&ask("a", 2, 10), Why::Full, t0, ms(300));
        assert_eq!(r.refused(&ask("a", 2, 10), t0 + ms(300)), None);
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn a_long_retry_after_is_remembered_for_a_second_and_forgotten_on_a_give_back() {
        let (r, t0) = (Refusals::default(), Instant::now());
        let hour = Duration::from_secs(3_600);
        r.remember(&ask("a", 1, 1), Why::Full, t0, hour);
        // The store's Retry-After, counted down; for a second.
        let later = t0 + REMEMBERED_FOR - Duration::from_millis(1);
        assert_eq!(
            r.refused(&ask("a", 1, 1), later),
            Some((Why::Full, hour - (later - t0)))
        );
        assert_eq!(r.refused(&ask("a", 1, 1), t0 + REMEMBERED_FOR), None);
        let t1 = t0;
        r.remember(&ask("a", 1, 1), Why::Full, t1, hour);
        r.forget("a");
        assert_eq!(r.refused(&ask("a", 1, 1), t1), None);
        // A refusal asked before the give-back, answered after it, is not
        // remembered: the place may have come back after the store read
        // the client's D.
        r.remember(&ask("a", 1, 1), Why::Full, t1, hour);
        assert_eq!(r.refused(&ask("a", 1, 1), t1), None);
        let t2 = Instant::now() + Duration::from_millis(1);
        r.remember(&ask("a", 1, 1), Why::Full, t2, hour);
        assert_eq!(r.refused(&ask("a", 1, 1), t2), Some((Why::Full, hour)));
    }

    #[test]
    fn the_latest_refusal_of_a_client_stands() {
        let (r, t0) = (Refusals::default(), Instant::now());
        let ms = |n: u64| Duration::from_millis(n);
        r.remember(&ask("a", 3, 10), Why::Full, t0, ms(500));
        r.remember(&ask("a", 1, 10), Why::Full, t0, ms(100));
        assert_eq!(
            r.refused(&ask("a", 1, 10), t0 + ms(50)),
            Some((Why::Full, ms(50)))
        );
        // Cost 3 waits (3 - 1)·T = 400 ms longer than cost 1: what the
        // first answer said.
        assert_eq!(
            r.refused(&ask("a", 3, 10), t0 + ms(50)),
            Some((Why::Full, ms(450)))
        );
        assert_eq!(r.refused(&ask("a", 3, 10), t0 + ms(100)), None);
    }

    #[test]
    fn a_max_wait_refusal_is_remembered_under_the_same_max_wait() {
        let (r, t0) = (Refusals::default(), Instant::now());
        let ms = |n: u64| Duration::from_millis(n);
        let with_max_wait = |max_wait_us| Ask {
            max_wait_us,
            ..ask("a", 1, 1_000)
        };
        r.remember(&with_max_wait(1_000_000), Why::MaxWait, t0, ms(400));
        assert_eq!(
            r.refused(&with_max_wait(1_000_000), t0 + ms(100)),
            Some((Why::MaxWait, ms(300)))
        );
        // A reload that changed max_wait: asked again.
        assert_eq!(r.refused(&with_max_wait(2_000_000), t0 + ms(100)), None);
    }

    #[test]
    fn memory_is_bounded_whatever_the_keys() {
        let (r, t0) = (Refusals::default(), Instant::now());
        for i in 0..SHARDS * PER_SHARD * 2 {
            r.remember(
                &ask(&i.to_string(), 1, 1),
                Why::Full,
                t0,
                Duration::from_secs(1),
            );
        }
        assert!(r.len() <= SHARDS * PER_SHARD, "{}", r.len());
        assert!(r.len() >= SHARDS * PER_SHARD / 2, "{}", r.len());
    }
}
