//! Upgrade tunnels: a request that switches protocols (`Connection:
//! upgrade`, WebSocket or any other) is admitted, queued and released like
//! any request; once the upstream answers `101`, the client's connection
//! and the upstream's are joined both ways, unshaped, until both sides
//! close, or nothing crosses in either direction for the upstream's
//! `read_timeout` (nginx's `proxy_read_timeout` on a WebSocket: a peer
//! that vanished without a FIN no longer holds the tunnel). Open tunnels
//! are counted and bounded (`server.max_tunnels`); a drain closes them
//! when its timeout ends.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use super::in_flight::CallSlot;

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
