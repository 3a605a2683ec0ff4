//! Refusals remembered: a client the store has just found full is
//! refused here again, without a call, until a place may have freed.
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
const PER_SHARD: usize = 4_096;

/// One remembered refusal: the client's queue takes no request of `cost`
/// or more before `until`, under the policy it was refused under.
struct Refused {
    until: Instant,
    cost: u32,
    policy: (u64, u32, u64),
}

pub struct Refusals {
    shards: [Mutex<HashMap<String, Refused>>; SHARDS],
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
/// the rate, the capacity or the burst starts over.
fn policy(ask: &Ask) -> (u64, u32, u64) {
    (ask.step_us, ask.capacity, ask.tau_us)
}

impl Refusals {
    fn shard(&self, key: &str) -> std::sync::MutexGuard<'_, HashMap<String, Refused>> {
        // (The shard index is below SHARDS.)
        let i = usize::try_from(self.hasher.hash_one(key) % SHARDS as u64).unwrap_or(0);
        self.shards[i].lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How long `ask`'s client is still refused at `now` (the store's
    /// Retry-After, counted down), if it is remembered as full.
    pub fn refused(&self, ask: &Ask, now: Instant) -> Option<Duration> {
        let mut shard = self.shard(&ask.key);
        let r = shard.get(&ask.key)?;
        if r.until <= now || r.policy != policy(ask) {
            shard.remove(&ask.key);
            return None;
        }
        (ask.cost >= r.cost).then(|| r.until - now)
    }

    /// The store refused `ask`, asked at `asked` (before the store read
    /// its clock: the place frees no earlier than `asked` + `retry_after`
    /// here), with `retry_after`.
    pub fn remember(&self, ask: &Ask, asked: Instant, retry_after: Duration) {
        let until = asked + retry_after.min(REMEMBERED_FOR);
        let mut shard = self.shard(&ask.key);
        if shard.len() >= PER_SHARD && !shard.contains_key(&ask.key) {
            let now = Instant::now();
            shard.retain(|_, r| r.until > now);
            if shard.len() >= PER_SHARD {
                return;
            }
        }
        // The latest answer replaces an earlier one: it has the client's
        // D as it is now.
        shard.insert(
            ask.key.clone(),
            Refused {
                until,
                cost: ask.cost,
                policy: policy(ask),
            },
        );
    }

    /// A place of `key`'s client was given back: ask the store again.
    pub fn forget(&self, key: &str) {
        self.shard(key).remove(key);
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards
            .iter()
            .map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).len())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::{PER_SHARD, REMEMBERED_FOR, Refusals, SHARDS};
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
        r.remember(&ask("a", 2, 10), t0, ms(300));
        assert_eq!(r.refused(&ask("a", 2, 10), t0 + ms(100)), Some(ms(200)));
        assert_eq!(r.refused(&ask("a", 5, 10), t0 + ms(299)), Some(ms(1)));
        // A cheaper request may fit: the store decides.
        assert_eq!(r.refused(&ask("a", 1, 10), t0 + ms(100)), None);
        assert_eq!(r.refused(&ask("b", 2, 10), t0 + ms(100)), None);
        // Another policy (a reload), or the place freed: asked again.
        assert_eq!(r.refused(&ask("a", 2, 11), t0 + ms(100)), None);
        assert_eq!(r.refused(&ask("a", 2, 10), t0 + ms(100)), None);
        r.remember(&ask("a", 2, 10), t0, ms(300));
        assert_eq!(r.refused(&ask("a", 2, 10), t0 + ms(300)), None);
        assert_eq!(r.len(), 0);
    }

    #[test]
    fn a_long_retry_after_is_remembered_for_a_second_and_forgotten_on_a_give_back() {
        let (r, t0) = (Refusals::default(), Instant::now());
        r.remember(&ask("a", 1, 1), t0, Duration::from_secs(3_600));
        let later = t0 + REMEMBERED_FOR - Duration::from_millis(1);
        assert_eq!(
            r.refused(&ask("a", 1, 1), later),
            Some(Duration::from_millis(1))
        );
        assert_eq!(r.refused(&ask("a", 1, 1), t0 + REMEMBERED_FOR), None);
        r.remember(&ask("a", 1, 1), t0, Duration::from_secs(3_600));
        r.forget("a");
        assert_eq!(r.refused(&ask("a", 1, 1), t0), None);
    }

    #[test]
    fn the_latest_refusal_of_a_client_stands() {
        let (r, t0) = (Refusals::default(), Instant::now());
        let ms = |n: u64| Duration::from_millis(n);
        r.remember(&ask("a", 3, 10), t0, ms(500));
        r.remember(&ask("a", 1, 10), t0, ms(100));
        assert_eq!(r.refused(&ask("a", 1, 10), t0 + ms(50)), Some(ms(50)));
        assert_eq!(r.refused(&ask("a", 3, 10), t0 + ms(50)), Some(ms(50)));
        assert_eq!(r.refused(&ask("a", 3, 10), t0 + ms(100)), None);
    }

    #[test]
    fn memory_is_bounded_whatever_the_keys() {
        let (r, t0) = (Refusals::default(), Instant::now());
        for i in 0..SHARDS * PER_SHARD * 2 {
            r.remember(&ask(&i.to_string(), 1, 1), t0, Duration::from_secs(1));
        }
        assert!(r.len() <= SHARDS * PER_SHARD, "{}", r.len());
        assert!(r.len() >= SHARDS * PER_SHARD / 2, "{}", r.len());
    }
}
