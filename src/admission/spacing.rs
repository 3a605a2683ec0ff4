//! DESIGN section 1's rule for late releases, where the engine's own
//! schedule cannot apply it:
//! - requests held for a shared departure: the store keeps each client's
//!   grid, but the timers that release its held requests are this
//!   instance's, and a pacer that ran late (a stalled machine) would fire
//!   every overdue one at once;
//! - work a front end starts after its departure (an SMTP relay starts
//!   once the message's data is in, which may be after its slot).
//!
//! Each client's releases are kept at least c·T/2 apart, so a catch-up is
//! never faster than twice the client's rate.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

use crate::shaper::Nanos;

/// Past this many clients, entries whose spacing has passed are dropped.
const PRUNE_AT: usize = 1_024;

/// When each client's next shared release may come, for the clients
/// released within their last c·T/2.
pub struct Spacing<C>(Mutex<HashMap<C, Nanos>>);

impl<C> Default for Spacing<C> {
    fn default() -> Self {
        Spacing(Mutex::new(HashMap::new()))
    }
}

impl<C: Hash + Eq + Clone> Spacing<C> {
    /// The instant, at `now` or later, at which a request of `client` due
    /// now may be released, `half` (its c·T/2) after the client's previous
    /// release; taken, so the client's next release comes `half` after it.
    pub fn release(&self, client: &C, now: Nanos, half: Nanos) -> Nanos {
        let mut next = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let at = next
            .get(client)
            .map_or(now, |&not_before| now.max(not_before));
        if next.len() >= PRUNE_AT {
            next.retain(|_, not_before| *not_before > now);
        }
        next.insert(client.clone(), at.saturating_add(half));
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn client(name: &str) -> String {
        name.to_owned()
    }

    #[test]
    fn overdue_releases_of_one_client_are_half_its_interval_apart() {
        let s = Spacing::default();
        let a = client("a");
        // Five requests due 200 ms apart, all fired at once at 1 s.
        let times: Vec<Nanos> = (0..5)
            .map(|_| s.release(&a, 1_000 * MS, 100 * MS))
            .collect();
        assert_eq!(times, [1_000, 1_100, 1_200, 1_300, 1_400].map(|t| t * MS));
        // Another client is not held back by the first.
        assert_eq!(s.release(&client("b"), 1_000 * MS, 100 * MS), 1_000 * MS);
    }

    #[test]
    fn releases_on_their_grid_are_not_delayed() {
        let s = Spacing::default();
        let a = client("a");
        for i in 0..10 {
            let due = i * 200 * MS;
            assert_eq!(s.release(&a, due, 100 * MS), due);
        }
    }

    #[test]
    fn entries_past_their_spacing_are_pruned() {
        let s = Spacing::default();
        for i in 0..(3 * PRUNE_AT) {
            s.release(&client(&i.to_string()), (i as Nanos) * MS, MS);
        }
        let held = s.0.lock().unwrap().len();
        assert!(held <= PRUNE_AT + 1, "{held} entries kept");
    }
}
