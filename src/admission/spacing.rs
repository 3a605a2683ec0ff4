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
//! never faster than twice the client's rate; releases whose slots are
//! closer than that (a `burst` let them all go at once) are kept only as
//! far apart as their slots were.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

use crate::shaper::Nanos;

/// Past this many clients, entries whose spacing has passed are dropped.
const PRUNE_AT: usize = 1_024;

/// A client's latest release.
#[derive(Debug, Clone, Copy)]
struct Last {
    /// When it was released.
    at: Nanos,
    /// The slot it was released for.
    slot: Nanos,
    /// When it stops holding the next one back (`at` + its c·T/2).
    until: Nanos,
}

/// Each client's latest release, for the clients released within their
/// last c·T/2 (and the size past which the next prune comes).
pub struct Spacing<C>(Mutex<(HashMap<C, Last>, usize)>);

impl<C> Default for Spacing<C> {
    fn default() -> Self {
        Spacing(Mutex::new((HashMap::new(), PRUNE_AT)))
    }
}

impl<C: Hash + Eq + Clone> Spacing<C> {
    /// The instant, at `now` or later, at which a request of `client`
    /// whose slot was `slot` may be released: `half` (its c·T/2) after the
    /// client's previous release, or as far after it as `slot` is from
    /// that release's slot, if less (overdue releases may be taken in any
    /// order). Taken: the client's next release is spaced from it.
    pub fn release(&self, client: &C, now: Nanos, slot: Nanos, half: Nanos) -> Nanos {
        self.release_all(&[(client, Some(slot), half)], now, now)
    }

    /// [`Spacing::release`] for work that keeps its spacing on several
    /// lines at once (its client's, and its capped upstream's), each
    /// `(line, slot, half)`: the earliest instant from `from` on that
    /// suits every line, taken on all of them. A line without slots keeps
    /// its whole `half` between any two starts. `now` is the time, for
    /// pruning.
    pub fn release_all(
        &self,
        lines: &[(&C, Option<Nanos>, Nanos)],
        from: Nanos,
        now: Nanos,
    ) -> Nanos {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let (last, prune_at) = &mut *guard;
        let at = lines.iter().fold(from, |at, &(line, slot, half)| {
            last.get(line).map_or(at, |prev| {
                let gap = slot.map_or(half, |s| half.min(s.abs_diff(prev.slot)));
                at.max(prev.at.saturating_add(gap))
            })
        });
        // Pruned when it has doubled since the last prune: amortized O(1)
        // per release even when every entry is still live (slow rates
        // keep theirs for hours).
        if last.len() >= *prune_at {
            last.retain(|_, prev| prev.until > now);
            *prune_at = last.len().saturating_mul(2).max(PRUNE_AT);
        }
        for &(line, slot, half) in lines {
            let until = at.saturating_add(half);
            let slot = slot.unwrap_or_default();
            last.insert(line.clone(), Last { at, slot, until });
        }
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
            .map(|i| s.release(&a, 1_000 * MS, i * 200 * MS, 100 * MS))
            .collect();
        assert_eq!(times, [1_000, 1_100, 1_200, 1_300, 1_400].map(|t| t * MS));
        // Another client is not held back by the first.
        assert_eq!(s.release(&client("b"), 1_000 * MS, 0, 100 * MS), 1_000 * MS);
    }

    #[test]
    fn releases_on_their_grid_are_not_delayed() {
        let s = Spacing::default();
        let a = client("a");
        for i in 0..10 {
            let due = i * 200 * MS;
            assert_eq!(s.release(&a, due, due, 100 * MS), due);
        }
    }

    #[test]
    fn releases_whose_slots_were_closer_keep_only_that_gap() {
        let s = Spacing::default();
        let a = client("a");
        // A burst: three slots at the same instant, their work started
        // late (at 500 ms): none is held back by the others.
        for _ in 0..3 {
            assert_eq!(s.release(&a, 500 * MS, 0, 100 * MS), 500 * MS);
        }
        // Two slots 30 ms apart, both overdue: 30 ms apart, not 100.
        assert_eq!(s.release(&a, 900 * MS, 800 * MS, 100 * MS), 900 * MS);
        assert_eq!(s.release(&a, 900 * MS, 830 * MS, 100 * MS), 930 * MS);
        // Overdue slots taken out of order are spaced all the same.
        assert_eq!(s.release(&a, 2_000 * MS, 1_400 * MS, 100 * MS), 2_000 * MS);
        assert_eq!(s.release(&a, 2_000 * MS, 1_200 * MS, 100 * MS), 2_100 * MS);
    }

    #[test]
    fn a_release_on_two_lines_keeps_the_spacing_of_both() {
        let s = Spacing::default();
        let (a, b, c, up) = (client("a"), client("b"), client("c"), client("up"));
        // a, b and c share an upstream whose starts keep 50 ms (half its
        // interval) whatever their slots; their own slots are 200 ms
        // apart (100 ms at half). All start late.
        let start = |who: &String, own: Nanos, from: Nanos| {
            s.release_all(
                &[(who, Some(own * MS), 100 * MS), (&up, None, 50 * MS)],
                from * MS,
                from * MS,
            )
        };
        assert_eq!(start(&a, 0, 1_000), 1_000 * MS);
        // b's own line is new: held by the upstream's.
        assert_eq!(start(&b, 0, 1_000), 1_050 * MS);
        // a's next by its own (100 ms after its last), the upstream's
        // allowing 1,100.
        assert_eq!(start(&a, 200, 1_000), 1_100 * MS);
        // c, at 1,120: the upstream's line holds it to 1,150.
        assert_eq!(start(&c, 0, 1_120), 1_150 * MS);
    }

    #[test]
    fn pruning_goes_by_the_time_not_a_later_floor() {
        let s = Spacing::default();
        // Live entries (an hour each), then one start floored a day later
        // (a paused upstream): the live ones are kept.
        for i in 0..PRUNE_AT {
            s.release(&client(&i.to_string()), 0, 0, 3_600_000 * MS);
        }
        let day = 86_400_000 * MS;
        s.release_all(&[(&client("late"), None, MS)], day, 0);
        // Its slot two hours on: held a whole half (an hour) from its last.
        let (hour, two) = (3_600_000 * MS, 7_200_000 * MS);
        assert_eq!(s.release(&client("0"), MS, two, hour), hour);
    }

    #[test]
    fn entries_past_their_spacing_are_pruned() {
        let s = Spacing::default();
        for i in 0..(3 * PRUNE_AT) {
            let now = (i as Nanos) * MS;
            s.release(&client(&i.to_string()), now, now, MS);
        }
        let held = s.0.lock().unwrap().0.len();
        assert!(held <= PRUNE_AT + 1, "{held} entries kept");
    }

    #[test]
    fn live_entries_are_not_scanned_on_every_release() {
        let s = Spacing::default();
        // Entries that stay live (an hour of spacing each).
        for i in 0..(PRUNE_AT + 10) {
            s.release(&client(&i.to_string()), 0, 0, 3_600_000 * MS);
        }
        let (held, next) = {
            let g = s.0.lock().unwrap();
            (g.0.len(), g.1)
        };
        assert_eq!(held, PRUNE_AT + 10);
        assert!(
            next >= 2 * PRUNE_AT,
            "the next prune waits for the map to double: {next}"
        );
    }
}
