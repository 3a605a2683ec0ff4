//! The memory held for waiting requests: HTTP bodies staged while their
//! requests wait (DESIGN section 3) and SMTP messages held until their
//! departure. Each is bounded per request by its front end and all of them
//! together by `max_staged_bytes`, shared by every worker and protocol, so
//! a flood of large waiting requests cannot grow memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The slowest a held body (an HTTP request's, an SMTP message) may come
/// in, on average, once its first idle period is spent, in bytes per
/// second (Apache's `mod_reqtimeout` `MinRate=500`, Postfix's
/// `smtpd_min_data_rate`): a sender dripping a byte now and then is cut
/// off, instead of holding its room in the budget for days.
pub const MIN_DATA_RATE: u64 = 500;

/// By when a held body's sender must have sent its next bytes: within
/// `idle` of the start, and each byte read buys 1/[`MIN_DATA_RATE`] s
/// more, never more than `idle` ahead of the last read.
#[derive(Debug, Clone, Copy)]
pub struct ReadDeadline {
    at: Instant,
    idle: Duration,
}

impl ReadDeadline {
    pub fn new(now: Instant, idle: Duration) -> ReadDeadline {
        ReadDeadline {
            at: now + idle,
            idle,
        }
    }

    /// `bytes` more were read, at `now`.
    pub fn read(&mut self, bytes: usize, now: Instant) {
        let bought = Duration::from_micros(
            u64::try_from(bytes)
                .unwrap_or(u64::MAX)
                .saturating_mul(1_000_000 / MIN_DATA_RATE),
        );
        let most = now + self.idle;
        self.at = self.at.checked_add(bought).map_or(most, |d| d.min(most));
    }

    pub fn at(&self) -> Instant {
        self.at
    }
}

/// The staging limits and the bytes held now.
#[derive(Debug)]
pub struct StageBudget {
    used: AtomicUsize,
    max_body: AtomicUsize,
    max_total: AtomicUsize,
}

impl StageBudget {
    pub fn new(max_body: usize, max_total: usize) -> StageBudget {
        StageBudget {
            used: AtomicUsize::new(0),
            max_body: AtomicUsize::new(max_body),
            max_total: AtomicUsize::new(max_total),
        }
    }

    /// New limits (reload); what is held now keeps its room.
    pub fn set(&self, max_body: usize, max_total: usize) {
        self.max_body.store(max_body, Ordering::Relaxed);
        self.max_total.store(max_total, Ordering::Relaxed);
    }

    /// Bytes held now, over all waiting requests.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Whether anything more fits now.
    pub fn has_room(&self) -> bool {
        self.used() < self.max_total.load(Ordering::Relaxed)
    }

    /// Whether `n` more bytes fit now (nothing taken).
    pub fn fits(&self, n: usize) -> bool {
        self.used()
            .checked_add(n)
            .is_some_and(|total| total <= self.max_total.load(Ordering::Relaxed))
    }

    /// The largest HTTP body a waiting request may stage.
    pub fn max_body(&self) -> usize {
        self.max_body.load(Ordering::Relaxed)
    }

    /// Empty room, grown as data arrives.
    pub fn room(self: &Arc<Self>) -> Room {
        Room {
            budget: self.clone(),
            bytes: 0,
        }
    }

    /// Room for `n` more bytes, or `false` (nothing taken, and nothing
    /// seen taken meanwhile: a refused reservation never shows in `used`,
    /// where [`StageBudget::has_room`] would read the budget as full).
    fn take(&self, n: usize) -> bool {
        let max = self.max_total.load(Ordering::Relaxed);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&total| total <= max)
            })
            .is_ok()
    }
}

/// Room taken in the budget, given back when dropped.
#[derive(Debug)]
pub struct Room {
    budget: Arc<StageBudget>,
    bytes: usize,
}

impl Room {
    /// Hold at least `total` bytes; `false` (and nothing more taken) when
    /// the budget has no room.
    pub fn grow_to(&mut self, total: usize) -> bool {
        if total <= self.bytes {
            return true;
        }
        if !self.budget.take(total - self.bytes) {
            return false;
        }
        self.bytes = total;
        true
    }

    /// Hold at least `least` bytes and as many as `most` as the budget
    /// has room for, taken at once: the total now held, or `None` (nothing
    /// more taken) when not even `least` fits.
    pub fn grow_within(&mut self, least: usize, most: usize) -> Option<usize> {
        if least <= self.bytes {
            return Some(self.bytes);
        }
        let max = self.budget.max_total.load(Ordering::Relaxed);
        let (min_more, max_more) = (least - self.bytes, most.max(least) - self.bytes);
        let mut taken = 0;
        self.budget
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let free = max.checked_sub(used)?;
                taken = max_more.min(free);
                (taken >= min_more).then_some(used + taken)
            })
            .ok()?;
        self.bytes += taken;
        Some(self.bytes)
    }

    /// Hold exactly `total` bytes, past the budget's total if need be:
    /// for bytes already read, which are held whatever the budget says
    /// and must be counted as they are. `false` when the budget is over
    /// its total now.
    pub fn set_to(&mut self, total: usize) -> bool {
        if total >= self.bytes {
            self.budget
                .used
                .fetch_add(total - self.bytes, Ordering::AcqRel);
        } else {
            self.budget
                .used
                .fetch_sub(self.bytes - total, Ordering::AcqRel);
        }
        self.bytes = total;
        self.budget.has_room()
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        self.budget.used.fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_refuses_past_its_total_and_gives_back_on_drop() {
        let b = Arc::new(StageBudget::new(100, 150));
        let mut first = b.room();
        assert!(first.grow_to(100));
        let mut second = b.room();
        assert!(!second.grow_to(51));
        assert_eq!(second.bytes(), 0);
        assert!(second.grow_to(50));
        assert_eq!(b.used(), 150);
        drop(first);
        assert_eq!(b.used(), 50);
        assert!(second.grow_to(20), "shrinking is a no-op");
        assert_eq!(b.used(), 50);
    }

    #[test]
    fn bytes_held_are_counted_as_they_are_even_past_the_total() {
        let b = Arc::new(StageBudget::new(100, 150));
        let mut r = b.room();
        assert!(r.set_to(100));
        assert!(!r.set_to(180), "over the total: read no more");
        assert_eq!(b.used(), 180, "but what is held is counted");
        assert!(!b.has_room());
        assert!(r.set_to(40));
        assert_eq!(b.used(), 40);
        drop(r);
        assert_eq!(b.used(), 0);
    }
}
