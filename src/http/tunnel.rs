//! Upgrade tunnels: a request that switches protocols (`Connection:
//! upgrade`, WebSocket or any other) is admitted, queued and released like
//! any request; once the upstream answers `101`, the client's connection
//! and the upstream's are joined both ways, unshaped, until both sides
//! close, or nothing crosses in either direction for the upstream's
//! `read_timeout` (nginx's `proxy_read_timeout` on a WebSocket: a peer
//! that vanished without a FIN no longer holds the tunnel). Open tunnels
//! are counted and bounded (`server.max_tunnels`); a drain closes them
//! when its timeout ends.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use super::in_flight::CallSlot;
use crate::admission::Key;

/// Every worker's tunnels: the count, the bound, the counts of the client
/// keys whose route bounds them (`max_tunnels_per_key`), and the drain's
/// end.
pub struct Tunnels {
    open: Arc<AtomicUsize>,
    max: usize,
    per_key: Arc<PerKey>,
    close: CancellationToken,
}

/// Open tunnels by route and client key, for routes that bound them; a
/// key with none open has no entry (at most `max_tunnels` entries).
type PerKey = Mutex<HashMap<(Arc<str>, Key), usize>>;

/// One open tunnel's place in the count, and in its key's.
pub struct Slot {
    open: Arc<AtomicUsize>,
    key: Option<KeyPlace>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A tunnel's place in its client key's count.
struct KeyPlace {
    per_key: Arc<PerKey>,
    id: (Arc<str>, Key),
}

impl Drop for KeyPlace {
    fn drop(&mut self) {
        let mut per_key = self.per_key.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = per_key.get_mut(&self.id) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                per_key.remove(&self.id);
            }
        }
    }
}

impl Slot {
    /// Also take a place among the tunnels `key` holds open on `route`,
    /// unless it holds `max` already (nginx's `limit_conn`): one client
    /// holding a tunnel open with a byte every `read_timeout` could
    /// otherwise take every place of `max_tunnels`, at its route's rate.
    pub fn for_key(&mut self, tunnels: &Tunnels, route: &str, key: &Key, max: usize) -> bool {
        let id: (Arc<str>, Key) = (Arc::from(route), key.clone());
        let mut per_key = tunnels.per_key.lock().unwrap_or_else(|e| e.into_inner());
        let n = per_key.entry(id.clone()).or_insert(0);
        if *n >= max {
            return false;
        }
        *n += 1;
        drop(per_key);
        self.key = Some(KeyPlace {
            per_key: tunnels.per_key.clone(),
            id,
        });
        true
    }
}

impl Tunnels {
    pub fn new(max: usize) -> Tunnels {
        Tunnels {
            open: Arc::default(),
            max,
            per_key: Arc::default(),
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
                Ok(_) => {
                    return Some(Slot {
                        open: self.open.clone(),
                        key: None,
                    });
                }
                Err(now) => n = now,
            }
        }
    }

    /// The drain's timeout passed: close every tunnel.
    pub fn close(&self) {
        self.close.cancel();
    }

    /// Join both sides once each has switched, on `tracker` (the worker's,
    /// which its shutdown waits for); closed after `idle` with nothing
    /// crossing. The tunnel's slot, and its upstream's `max_concurrency`
    /// slot if it has one, are held until it closes.
    pub fn join(
        &self,
        tracker: &TaskTracker,
        slots: (Slot, Option<CallSlot>),
        (client, upstream): (OnUpgrade, OnUpgrade),
        idle: Duration,
    ) {
        let close = self.close.clone();
        tracker.spawn(async move {
            let _slots = slots;
            let joined = async {
                let (client, upstream) = tokio::try_join!(client, upstream)?;
                let moved = Moved::default();
                let mut c = Watched {
                    io: TokioIo::new(client),
                    moved: moved.clone(),
                };
                let mut u = Watched {
                    io: TokioIo::new(upstream),
                    moved: moved.clone(),
                };
                tokio::select! {
                    r = tokio::io::copy_bidirectional(&mut c, &mut u) => {
                        if let Err(e) = r {
                            debug!(error = %e, "tunnel ended with an error");
                        }
                    }
                    () = moved.idle_for(idle) => debug!("tunnel idle for read_timeout: closed"),
                }
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

/// When bytes last crossed a tunnel, either way (ms since its start).
#[derive(Clone)]
struct Moved {
    start: Instant,
    last: Arc<AtomicU64>,
}

impl Default for Moved {
    fn default() -> Moved {
        Moved {
            start: Instant::now(),
            last: Arc::default(),
        }
    }
}

impl Moved {
    fn now(&self) {
        let ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last.store(ms, Ordering::Relaxed);
    }

    /// Resolves once nothing crossed for `idle`.
    async fn idle_for(&self, idle: Duration) {
        loop {
            let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
            let due = self.start + last + idle;
            if Instant::now() >= due {
                return;
            }
            tokio::time::sleep_until(due.into()).await;
        }
    }
}

/// One side of a tunnel, noting when it reads anything.
struct Watched<T> {
    io: T,
    moved: Moved,
}

impl<T: AsyncRead + Unpin> AsyncRead for Watched<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.moved.now();
        }
        read
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Watched<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
