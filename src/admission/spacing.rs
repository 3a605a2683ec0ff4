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
    /// Which release it was (to give back only a release no later one has
    /// replaced).
    seq: u64,
}

/// Each line's latest release, for the lines released within their last
/// c·T/2.
struct Lines<C> {
    last: HashMap<C, Last>,
    /// Releases given back after a later one replaced them on a line, by
    /// line and sequence number: what each replaced (and when it stops
    /// mattering), so that the later one, given back in its turn, puts
    /// back a release that was made rather than one that was not.
    revoked: HashMap<(C, u64), (Nanos, Option<Last>)>,
    /// The size past which the next prune comes.
    prune_at: usize,
    /// The number of releases taken.
    seq: u64,
}

/// Each client's latest release, for the clients released within their
/// last c·T/2.
pub struct Spacing<C>(Mutex<Lines<C>>);

impl<C> Default for Spacing<C> {
    fn default() -> Self {
        Spacing(Mutex::new(Lines {
            last: HashMap::new(),
            revoked: HashMap::new(),
            prune_at: PRUNE_AT,
            seq: 0,
        }))
    }
}

/// A release taken by [`Spacing::take_all`] for work that may yet not
/// start: what it replaced on each line, to put back with
/// [`Spacing::give_back`].
#[must_use]
pub struct Taken<C> {
    at: Nanos,
    seq: u64,
    before: Vec<(C, Option<Last>)>,
}

impl<C> Taken<C> {
    /// The instant the release was taken for.
    pub fn at(&self) -> Nanos {
        self.at
    }
}

impl<C: Hash + Eq + Clone> Spacing<C> {
    /// The instant, at `now` or later, at which a request of `client`
    /// whose slot was `slot` may be released: `half` (its c·T/2) after the
    /// client's previous release, or as far after it as `slot` is from
    /// that release's slot, if less (overdue releases may be taken in any
    /// order). Taken: the client's next release is spaced from it, unless
    /// it is given back ([`Spacing::give_back`]: the request left before).
    pub fn release(&self, client: &C, now: Nanos, slot: Nanos, half: Nanos) -> Taken<C> {
        let lines = [(client, Some(slot), half)];
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let at = guard.earliest(&lines, now);
        let mut before = Vec::with_capacity(1);
        let seq = guard.take(&lines, at, now, Some(&mut before));
        Taken { at, seq, before }
    }

    /// Whether a release of `client` now could be held back (its latest
    /// release's spacing has not passed).
    pub fn holds_back(&self, client: &C, now: Nanos) -> bool {
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        guard.last.get(client).is_some_and(|l| l.until > now)
    }

    /// [`Spacing::release`] for work that keeps its spacing on several
    /// lines at once (its client's, and its capped upstream's), each
    /// `(line, slot, half)`: the earliest instant from `from` on that
    /// suits every line, taken on all of them, unless it is past
    /// `latest` (then nothing is taken). A line without slots keeps its
    /// whole `half` between any two starts. `now` is the time, for
    /// pruning.
    pub fn take_all(
        &self,
        lines: &[(&C, Option<Nanos>, Nanos)],
        from: Nanos,
        now: Nanos,
        latest: Nanos,
    ) -> Option<Taken<C>> {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let at = guard.earliest(lines, from);
        if at > latest {
            return None;
        }
        let mut before = Vec::with_capacity(lines.len());
        let seq = guard.take(lines, at, now, Some(&mut before));
        Some(Taken { at, seq, before })
    }

    /// Work released by `taken` did not start (its client left, or it was
    /// refused): each line it was taken on gets back its previous
    /// release (the one before that, if that was given back too), unless
    /// a later release was taken there since; then the later one, if
    /// given back, puts back what this one replaced.
    pub fn give_back(&self, taken: Taken<C>) {
        let mut guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let lines = &mut *guard;
        for (line, mut before) in taken.before {
            let current = lines.last.get(&line);
            if current.is_some_and(|l| l.seq == taken.seq) {
                while let Some(prev) = before {
                    match lines.revoked.remove(&(line.clone(), prev.seq)) {
                        Some((_, earlier)) => before = earlier,
                        None => break,
                    }
                }
                match before {
                    Some(prev) => lines.last.insert(line, prev),
                    None => lines.last.remove(&line),
                };
            } else if let Some(later) = current {
                // Kept while the later one's spacing lasts (no shorter
                // than this one's, but for a cost of its own).
                let until = later.until;
                lines.revoked.insert((line, taken.seq), (until, before));
            }
        }
    }
}

impl<C: Hash + Eq + Clone> Lines<C> {
    /// The earliest instant from `from` on that suits every line.
    fn earliest(&self, lines: &[(&C, Option<Nanos>, Nanos)], from: Nanos) -> Nanos {
        lines.iter().fold(from, |at, &(line, slot, half)| {
            self.last.get(line).map_or(at, |prev| {
                let gap = slot.map_or(half, |s| half.min(s.abs_diff(prev.slot)));
                at.max(prev.at.saturating_add(gap))
            })
        })
    }

    /// Take a release at `at` on every line (what it replaces into
    /// `before`, if given); its sequence number.
    fn take(
        &mut self,
        lines: &[(&C, Option<Nanos>, Nanos)],
        at: Nanos,
        now: Nanos,
        mut before: Option<&mut Vec<(C, Option<Last>)>>,
    ) -> u64 {
        // Pruned when it has doubled since the last prune: amortized O(1)
        // per release even when every entry is still live (slow rates
        // keep theirs for hours).
        if self.last.len() + self.revoked.len() >= self.prune_at {
            self.last.retain(|_, prev| prev.until > now);
            // A release given back whose line's spacing has passed holds
            // nothing back, whatever is put back in its place.
            self.revoked.retain(|_, (until, _)| *until > now);
            let live = self.last.len() + self.revoked.len();
            self.prune_at = live.saturating_mul(2).max(PRUNE_AT);
        }
        self.seq = self.seq.wrapping_add(1);
        let seq = self.seq;
        for &(line, slot, half) in lines {
            let until = at.saturating_add(half);
            let slot = slot.unwrap_or_default();
            let prev = self.last.insert(
                line.clone(),
                Last {
                    at,
                    slot,
                    until,
                    seq,
                },
            );
            if let Some(before) = before.as_deref_mut() {
                before.push((line.clone(), prev));
            }
        }
        seq
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
            .map(|i| s.release(&a, 1_000 * MS, i * 200 * MS, 100 * MS).at())
            .collect();
        assert_eq!(times, [1_000, 1_100, 1_200, 1_300, 1_400].map(|t| t * MS));
        // Another client is not held back by the first.
        assert_eq!(
            s.release(&client("b"), 1_000 * MS, 0, 100 * MS).at(),
            1_000 * MS
        );
    }

    #[test]
    fn releases_on_their_grid_are_not_delayed() {
        let s = Spacing::default();
        let a = client("a");
        for i in 0..10 {
            let due = i * 200 * MS;
            assert_eq!(s.release(&a, due, due, 100 * MS).at(), due);
        }
    }

    #[test]
    fn releases_whose_slots_were_closer_keep_only_that_gap() {
        let s = Spacing::default();
        let a = client("a");
        // A burst: three slots at the same instant, their work started
        // late (at 500 ms): none is held back by the others.
        for _ in 0..3 {
            assert_eq!(s.release(&a, 500 * MS, 0, 100 * MS).at(), 500 * MS);
        }
        // Two slots 30 ms apart, both overdue: 30 ms apart, not 100.
        assert_eq!(s.release(&a, 900 * MS, 800 * MS, 100 * MS).at(), 900 * MS);
        assert_eq!(s.release(&a, 900 * MS, 830 * MS, 100 * MS).at(), 930 * MS);
        // Overdue slots taken out of order are spaced all the same.
        assert_eq!(
            s.release(&a, 2_000 * MS, 1_400 * MS, 100 * MS).at(),
            2_000 * MS
        );
        assert_eq!(
            s.release(&a, 2_000 * MS, 1_200 * MS, 100 * MS).at(),
            2_100 * MS
        );
    }

    /// A release given back (its held request left before it) spaces
    /// nothing after it: the next one is spaced from the release before.
    #[test]
    fn a_release_given_back_holds_nothing_back() {
        let s = Spacing::default();
        let a = client("a");
        assert_eq!(s.release(&a, 1_000 * MS, 0, 100 * MS).at(), 1_000 * MS);
        let gone = s.release(&a, 1_000 * MS, 200 * MS, 100 * MS);
        assert_eq!(gone.at(), 1_100 * MS);
        s.give_back(gone);
        assert_eq!(
            s.release(&a, 1_100 * MS, 400 * MS, 100 * MS).at(),
            1_100 * MS
        );
    }

    #[test]
    fn a_release_on_two_lines_keeps_the_spacing_of_both() {
        let s = Spacing::default();
        let (a, b, c, up) = (client("a"), client("b"), client("c"), client("up"));
        // a, b and c share an upstream whose starts keep 50 ms (half its
        // interval) whatever their slots; their own slots are 200 ms
        // apart (100 ms at half). All start late.
        let start = |who: &String, own: Nanos, from: Nanos| {
            let lines = [(who, Some(own * MS), 100 * MS), (&up, None, 50 * MS)];
            s.take_all(&lines, from * MS, from * MS, Nanos::MAX)
                .map(|t| t.at())
        };
        assert_eq!(start(&a, 0, 1_000), Some(1_000 * MS));
        // b's own line is new: held by the upstream's.
        assert_eq!(start(&b, 0, 1_000), Some(1_050 * MS));
        // a's next by its own (100 ms after its last), the upstream's
        // allowing 1,100.
        assert_eq!(start(&a, 200, 1_000), Some(1_100 * MS));
        // c, at 1,120: the upstream's line holds it to 1,150.
        assert_eq!(start(&c, 0, 1_120), Some(1_150 * MS));
    }

    #[test]
    fn pruning_goes_by_the_time_not_a_later_floor() {
        let s = Spacing::default();
        // Live entries (an hour each), then one start floored a day later
        // (a paused upstream): the live ones are kept.
        for i in 0..PRUNE_AT {
            let _ = s.release(&client(&i.to_string()), 0, 0, 3_600_000 * MS);
        }
        let day = 86_400_000 * MS;
        let late = s.take_all(&[(&client("late"), None, MS)], day, 0, Nanos::MAX);
        assert!(late.is_some());
        // Its slot two hours on: held a whole half (an hour) from its last.
        let (hour, two) = (3_600_000 * MS, 7_200_000 * MS);
        assert_eq!(s.release(&client("0"), MS, two, hour).at(), hour);
    }

    #[test]
    fn entries_past_their_spacing_are_pruned() {
        let s = Spacing::default();
        for i in 0..(3 * PRUNE_AT) {
            let now = (i as Nanos) * MS;
            let _ = s.release(&client(&i.to_string()), now, now, MS);
        }
        let held = s.0.lock().unwrap().last.len();
        assert!(held <= PRUNE_AT + 1, "{held} entries kept");
    }

    #[test]
    fn live_entries_are_not_scanned_on_every_release() {
        let s = Spacing::default();
        // Entries that stay live (an hour of spacing each).
        for i in 0..(PRUNE_AT + 10) {
            let _ = s.release(&client(&i.to_string()), 0, 0, 3_600_000 * MS);
        }
        let (held, next) = {
            let g = s.0.lock().unwrap();
            (g.last.len(), g.prune_at)
        };
        assert_eq!(held, PRUNE_AT + 10);
        assert!(
            next >= 2 * PRUNE_AT,
            "the next prune waits for the map to double: {next}"
        );
    }

    #[test]
    fn a_start_past_latest_is_not_taken() {
        let s = Spacing::default();
        let (a, up) = (client("a"), client("up"));
        let lines = |who| [(who, Some(0), 100 * MS), (&up, None, 500 * MS)];
        let first = s.take_all(&lines(&a), 0, 0, Nanos::MAX);
        assert_eq!(first.map(|t| t.at()), Some(0));
        // The upstream's line puts a's next at 500 ms: past 400, refused,
        // and nothing is taken: 450 ms later another goes at 500 all the
        // same, not 1,000.
        assert!(s.take_all(&lines(&a), 0, 0, 400 * MS).is_none());
        let b = client("b");
        let next = s.take_all(&lines(&b), 450 * MS, 450 * MS, Nanos::MAX);
        assert_eq!(next.map(|t| t.at()), Some(500 * MS));
    }

    #[test]
    fn a_release_given_back_spaces_nothing_unless_a_later_one_followed() {
        let s = Spacing::default();
        let (a, b, up) = (client("a"), client("b"), client("up"));
        let lines = |who| [(who, Some(0), 100 * MS), (&up, None, 500 * MS)];
        let take = |who, from| s.take_all(&lines(who), from, from, Nanos::MAX);
        let Some(first) = take(&a, 0) else { panic!() };
        assert_eq!(first.at(), 0);
        // b is held to 500 ms by a's start on the upstream's line; b's
        // client leaves before then: its start is given back, and a's
        // next (at 200 ms) goes at 500, not 1,000.
        let Some(held) = take(&b, 100 * MS) else {
            panic!()
        };
        assert_eq!(held.at(), 500 * MS);
        s.give_back(held);
        let Some(next) = take(&a, 200 * MS) else {
            panic!()
        };
        assert_eq!(next.at(), 500 * MS);
        // A release given back after a later one was taken on its line
        // leaves the later one: the upstream's line still holds c to
        // 1,000.
        let Some(late) = take(&b, 300 * MS) else {
            panic!()
        };
        assert_eq!(late.at(), 1_000 * MS);
        s.give_back(next);
        let Some(c) = take(&client("c"), 400 * MS) else {
            panic!()
        };
        assert_eq!(c.at(), 1_500 * MS);
        drop(late);
        // On a line of its own: a's second start given back, a's line
        // holds its first again (a slot 50 ms after the first starts at
        // 50 ms, not 200 ms after the second); d's only start given back,
        // d's line is empty.
        let own = |who, slot, from| {
            s.take_all(&[(who, Some(slot * MS), 100 * MS)], from, from, Nanos::MAX)
        };
        let (a, d) = (client("a2"), client("d"));
        assert_eq!(own(&a, 0, 0).map(|t| t.at()), Some(0));
        let Some(second) = own(&a, 300, 0) else {
            panic!()
        };
        assert_eq!(second.at(), 100 * MS);
        s.give_back(second);
        assert_eq!(own(&a, 50, 0).map(|t| t.at()), Some(50 * MS));
        let Some(only) = own(&d, 0, 0) else { panic!() };
        s.give_back(only);
        assert_eq!(own(&d, 300, 0).map(|t| t.at()), Some(0));
    }

    #[test]
    fn a_release_given_back_never_comes_back() {
        let s = Spacing::default();
        let up = client("up");
        // Three starts on an upstream's line (whole `half` of 100 ms
        // between any two): a at 0, b held to 100, c to 200.
        let take = |who: &str, from| {
            let who = client(who);
            s.take_all(&[(&up, None, 100 * MS)], from, from, Nanos::MAX)
                .map(|t| (who, t))
        };
        let Some((_, _a)) = take("a", 0) else {
            panic!()
        };
        let Some((_, b)) = take("b", 0) else { panic!() };
        let Some((_, c)) = take("c", 0) else { panic!() };
        assert_eq!((b.at(), c.at()), (100 * MS, 200 * MS));
        // b's client leaves (c follows it on the line), then c's: the
        // line holds a's start again, not b's that was never made.
        s.give_back(b);
        s.give_back(c);
        let Some((_, d)) = take("d", 0) else { panic!() };
        assert_eq!(d.at(), 100 * MS);
    }
}
