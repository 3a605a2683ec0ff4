//! The allocator's own view of the process's memory, for `/status` and
//! `/metrics` (as Envoy's `server.memory_allocated` and
//! `server.memory_physical_size`): bytes allocated and not yet freed, and
//! bytes in the pages the allocator holds resident. Resident minus
//! allocated is what the allocator keeps for reuse, has not purged yet, or
//! cannot return because live allocations share its pages.
//!
//! Read from jemalloc's statistics; in the `sluice` binary jemalloc is the
//! global allocator. A program that links this library with another
//! allocator reads only what went through jemalloc (next to nothing).
//!
//! Also here: each worker thread returns its allocator cache when it goes
//! quiet after work ([`return_cache_when_idle`]).

use std::time::Duration;

/// Bytes, from the allocator's statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Allocated by the program and not yet freed.
    pub allocated: u64,
    /// In pages the allocator holds resident (data and its own metadata).
    pub resident: u64,
}

/// The allocator's numbers now (it refreshes them first), or `None` if it
/// cannot say.
pub fn usage() -> Option<Usage> {
    use tikv_jemalloc_ctl::{epoch, stats};
    epoch::advance().ok()?;
    Some(Usage {
        allocated: stats::allocated::read().ok()? as u64,
        resident: stats::resident::read().ok()? as u64,
    })
}

/// How often a thread looks whether it has gone quiet.
const IDLE_CHECK: Duration = Duration::from_secs(5);
/// Allocated by a thread within one check: less, and it counts as quiet.
const QUIET_BYTES: u64 = 256 * 1024;
/// Allocated by a thread since its cache was last returned: less, and
/// there is too little in the cache to be worth returning.
const WORKED_BYTES: u64 = 16 * 1024 * 1024;

/// Return the calling thread's allocator cache whenever the thread goes
/// quiet after work; runs until dropped. Spawned on a current-thread
/// runtime (a worker), so that it always runs on that thread.
///
/// Why: jemalloc keeps objects a thread freed in that thread's cache
/// (up to 32 KiB each, a few MiB in all), and trims the cache only as the
/// thread allocates again. A worker that served a burst and then went
/// idle kept its cache, and the pages under it, for good: 7 MiB of the
/// 8 MiB that stayed resident after 100,000 held HTTP/2 streams had gone
/// (BENCHMARKS.md, "Memory per held request"). Turning the cache off
/// always costs an arena lock per allocation; this returns it only when
/// a thread is idle, at most once per quiet spell.
pub async fn return_cache_when_idle() {
    let mut tick = tokio::time::interval(IDLE_CHECK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut quiet = Quiet::default();
    loop {
        tick.tick().await;
        if let Some(allocated) = thread_allocated()
            && quiet.check(allocated)
        {
            return_thread_cache();
            quiet.returned(thread_allocated().unwrap_or(allocated));
        }
    }
}

/// Bytes the calling thread has allocated since it started.
fn thread_allocated() -> Option<u64> {
    tikv_jemalloc_ctl::thread::allocatedp::read()
        .ok()
        .map(|p| p.get())
}

/// Empty the calling thread's cache into the shared arenas (turning it
/// off flushes it; it is made anew when turned back on). `false` if the
/// allocator refused.
fn return_thread_cache() -> bool {
    use tikv_jemalloc_ctl::{Access, AsName};
    let enabled = b"thread.tcache.enabled\0".name();
    enabled.write(false).is_ok() && enabled.write(true).is_ok()
}

/// When a thread's cache is worth returning: the thread allocated
/// [`WORKED_BYTES`] since the last return, and then less than
/// [`QUIET_BYTES`] within one check.
#[derive(Default)]
struct Quiet {
    /// The thread's allocated bytes at the last check.
    last: u64,
    /// ... and when its cache was last returned.
    at_return: u64,
}

impl Quiet {
    fn check(&mut self, allocated: u64) -> bool {
        let since_check = allocated.wrapping_sub(self.last);
        self.last = allocated;
        since_check < QUIET_BYTES && allocated.wrapping_sub(self.at_return) >= WORKED_BYTES
    }

    fn returned(&mut self, allocated: u64) {
        self.at_return = allocated;
        self.last = allocated;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cache_is_returned_once_per_quiet_spell_after_work() {
        const MB: u64 = 1024 * 1024;
        let mut q = Quiet::default();
        // Busy: never while the thread works.
        assert!(!q.check(40 * MB));
        assert!(!q.check(80 * MB));
        // Quiet after work: once.
        assert!(q.check(80 * MB + 1000));
        q.returned(80 * MB + 2000);
        assert!(!q.check(80 * MB + 3000));
        assert!(!q.check(80 * MB + 4000));
        // A trickle of small work never adds up to a return per check...
        assert!(!q.check(81 * MB));
        assert!(!q.check(81 * MB + 100_000));
        // ... and a new burst does, once it is over.
        assert!(!q.check(120 * MB));
        assert!(q.check(120 * MB));
    }

    #[test]
    fn the_allocator_takes_a_cache_return_and_counts_per_thread() {
        assert!(return_thread_cache());
        use tikv_jemalloc_ctl::{Access, AsName};
        let enabled: bool = b"thread.tcache.enabled\0".name().read().unwrap();
        assert!(enabled, "the cache is on again after a return");
        assert!(thread_allocated().is_some());
    }

    #[test]
    fn the_allocator_reports_its_numbers() {
        let u = usage().expect("jemalloc statistics are enabled");
        assert!(u.resident > 0, "{u:?}");
    }
}
