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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allocator_reports_its_numbers() {
        let u = usage().expect("jemalloc statistics are enabled");
        assert!(u.resident > 0, "{u:?}");
    }
}
