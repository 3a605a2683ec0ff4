//! Upgrade tunnels: a request that switches protocols (`Connection:
//! upgrade`, WebSocket or any other) is admitted, queued and released like
//! any request; once the upstream answers `101`, the client's connection
//! and the upstream's are joined both ways, unshaped, until either side
//! closes. Open tunnels are counted and bounded (`server.max_tunnels`);
//! a drain closes them when its timeout ends.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

/// Every worker's tunnels: the count, the bound, and the drain's end.
pub struct Tunnels {
    open: Arc<AtomicUsize>,
    max: usize,
    close: CancellationToken,
}

/// One open tunnel's place in the count.
pub struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Tunnels {
    pub fn new(max: usize) -> Tunnels {
        Tunnels {
            open: Arc::default(),
            max,
            close: CancellationToken::new(),
        }
    }

    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A place for one more tunnel, unless `max_tunnels` are open.
    pub fn reserve(&self) -> Option<Slot> {
        let mut n = self.open.load(Ordering::Relaxed);
        loop {
            if n >= self.max {
                return None;
            }
            match self
                .open
                .compare_exchange_weak(n, n + 1, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Some(Slot(self.open.clone())),
                Err(now) => n = now,
            }
        }
    }

    /// The drain's timeout passed: close every tunnel.
    pub fn close(&self) {
        self.close.cancel();
    }

    /// Join both sides once each has switched, on `tracker` (the worker's,
    /// which its shutdown waits for).
    pub fn join(&self, tracker: &TaskTracker, slot: Slot, client: OnUpgrade, upstream: OnUpgrade) {
        let close = self.close.clone();
        tracker.spawn(async move {
            let _slot = slot;
            let joined = async {
                let (client, upstream) = tokio::try_join!(client, upstream)?;
                let (mut c, mut u) = (TokioIo::new(client), TokioIo::new(upstream));
                tokio::io::copy_bidirectional(&mut c, &mut u)
                    .await
                    .map_err(|e| debug!(error = %e, "tunnel ended with an error"))
                    .ok();
                Ok::<_, hyper::Error>(())
            };
            tokio::select! {
                r = joined => if let Err(e) = r {
                    debug!(error = %e, "the protocol switch failed");
                },
                () = close.cancelled() => debug!("tunnel closed by the drain"),
            }
        });
    }
}
