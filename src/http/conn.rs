//! Client connections of one worker: their count and limit, when they are
//! idle, and which to close (issue 12).
//!
//! A connection is idle while no request of it is being handled. An idle
//! connection is closed `header_read_timeout` after it opened if it never
//! sent a request (a silent socket), and `keepalive_timeout` after its
//! last request otherwise (HTTP/1.1 keep-alive and HTTP/2 alike; nginx's
//! `client_header_timeout`, `keepalive_timeout`, `http2_idle_timeout`);
//! a head begun on an HTTP/1.1 connection must end `header_read_timeout`
//! after its first byte (sluice's own server checks that itself; on
//! hyper's, which would time an idle connection's wait for its next head
//! as a head, [`Conns::head_bytes`] starts the clock here).
//! When the worker is at its share of `max_connections`, a new connection
//! closes the oldest idle one instead of waiting (nginx does the same with
//! its "reusable" connections), so silent sockets cannot lock clients out.
//!
//! A connection is asked to close (shutdown, eviction) through its own
//! [`Close`]: one flag and one waker, which its task checks between
//! requests at the cost of two atomic operations. (A cancellation token
//! per wait costs a mutex per check and the shared one's waiter list two
//! more, on a line both workers write: about 7 % of the user time of a
//! forwarded request, measured.) Shutdown reaches every connection
//! through the worker's registry of open ones.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::task::AtomicWaker;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

/// The state of one connection, shared by its task and its requests.
pub struct ConnState {
    /// Requests being handled now.
    in_flight: AtomicU32,
    /// Whether any request was ever started.
    served: AtomicBool,
    /// When it last became idle (ms since the worker's epoch).
    idle_since: AtomicU64,
    /// Whether it sits in the worker's idle queue.
    queued: AtomicBool,
    /// When the bytes of a next head first came while idle, in ms since
    /// the worker's epoch, plus 1; 0 for none (see [`Conns::head_bytes`]).
    head_from: AtomicU64,
    /// Response bodies (on hyper's path) that handed hyper a frame hyper
    /// has not come back for: waiting for the client to take what was sent
    /// (a full socket, a closed HTTP/2 flow-control window) ...
    owed: AtomicU32,
    /// ... and when one last came back for more (or became owed, from
    /// none), in ms since the worker's epoch: no progress since, for
    /// `send_timeout`, is a client that takes nothing.
    progress_at: AtomicU64,
    /// Set to make the connection close.
    pub close: Close,
    /// Its place in the worker's registry.
    id: u64,
    /// Requests made on hyper's path, and those of them their client
    /// gave up right after (see [`Unanswered`]).
    streams: AtomicU64,
    resets: AtomicU64,
}

/// Why a connection is asked to close.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// The proxy is shutting down.
    Shutdown,
    /// Its place is needed for a new connection (it was idle).
    Evicted,
    /// It stayed idle past its timeout.
    Idle,
    /// Its client reset most of its requests right after making them
    /// (HTTP/2 "rapid reset", CVE-2023-44487): see [`Unanswered`].
    Resets,
}

/// A connection's request to close: set once, seen by its task.
#[derive(Default)]
pub struct Close {
    /// 0 while open, else a [`Reason`] (1 shutdown, 2 evicted, 3 idle).
    reason: AtomicU8,
    waker: AtomicWaker,
}

impl Close {
    /// Ask the connection to close; `false` if it already was.
    pub fn signal(&self, reason: Reason) -> bool {
        let code = match reason {
            Reason::Shutdown => 1,
            Reason::Evicted => 2,
            Reason::Idle => 3,
            Reason::Resets => 4,
        };
        let set = self
            .reason
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire)
            .is_ok();
        if set {
            self.waker.wake();
        }
        set
    }

    /// Why the connection is to close, if it is.
    pub fn reason(&self) -> Option<Reason> {
        match self.reason.load(Ordering::Acquire) {
            0 => None,
            1 => Some(Reason::Shutdown),
            2 => Some(Reason::Evicted),
            3 => Some(Reason::Idle),
            _ => Some(Reason::Resets),
        }
    }

    fn poll(&self, cx: &mut Context<'_>) -> Poll<Reason> {
        if let Some(r) = self.reason() {
            return Poll::Ready(r);
        }
        // Registered before the second look: a signal in between is seen
        // there, one after it wakes this waker.
        self.waker.register(cx.waker());
        match self.reason() {
            Some(r) => Poll::Ready(r),
            None => Poll::Pending,
        }
    }

    /// Resolves when the connection is asked to close. One task waits at
    /// a time (the connection's own).
    pub fn wait(&self) -> impl Future<Output = Reason> + Send + '_ {
        std::future::poll_fn(move |cx| self.poll(cx))
    }
}

/// The connections open in a worker, for shutdown to reach them all.
#[derive(Default)]
struct Registry {
    stopping: bool,
    next: u64,
    open: HashMap<u64, Weak<ConnState>>,
}

/// The connections of one worker.
pub struct Conns {
    epoch: Instant,
    limit: Arc<Semaphore>,
    /// Connections that became idle, with when they were put here, oldest
    /// first (entries may be stale: busy again, idle since later, closed).
    idle: Mutex<VecDeque<(u64, Weak<ConnState>)>>,
    registry: Mutex<Registry>,
    open: AtomicUsize,
    /// New connections waiting for a place, for which no idle one was
    /// there to close: the next to become idle is (see [`Conns::admit`]).
    /// A count: one waiter done does not end another's wait.
    starved: AtomicUsize,
    became_idle: tokio::sync::Notify,
    pub header_read_timeout: Duration,
    pub keepalive_timeout: Duration,
    /// How long one write to a client may wait for it to read.
    pub send_timeout: Duration,
}

/// Counted connections open in every worker (the `sluice_connections`
/// gauge and `/status`).
pub static OPEN: AtomicUsize = AtomicUsize::new(0);

impl Conns {
    pub fn new(
        limit: usize,
        header_read_timeout: Duration,
        keepalive_timeout: Duration,
        send_timeout: Duration,
    ) -> Conns {
        Conns {
            epoch: Instant::now(),
            limit: Arc::new(Semaphore::new(limit.min(Semaphore::MAX_PERMITS))),
            idle: Mutex::new(VecDeque::new()),
            registry: Mutex::new(Registry::default()),
            open: AtomicUsize::new(0),
            starved: AtomicUsize::new(0),
            became_idle: tokio::sync::Notify::new(),
            header_read_timeout,
            keepalive_timeout,
            send_timeout,
        }
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// A place for a new connection: at once while below the limit;
    /// otherwise the oldest idle connection is asked to close, and the
    /// place it frees is awaited. With none idle (every connection in the
    /// middle of a request), the first to become idle is asked: it used to
    /// be left open, and the new connection waited until one closed by
    /// itself (a keep-alive timeout, 75 s by default).
    pub async fn admit(&self) -> Option<OwnedPermit> {
        match self.limit.clone().try_acquire_owned() {
            Ok(p) => return Some(p),
            Err(TryAcquireError::Closed) => return None,
            Err(TryAcquireError::NoPermits) => {}
        }
        // Set before looking, so that a connection made idle after the
        // look sees it (the idle queue's lock orders the two).
        self.starved.fetch_add(1, Ordering::SeqCst);
        let permit = loop {
            let idle = self.became_idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.evict_one() {
                break self.limit.clone().acquire_owned().await.ok();
            }
            tokio::select! {
                p = self.limit.clone().acquire_owned() => break p.ok(),
                () = idle => {}
            }
        };
        self.starved.fetch_sub(1, Ordering::SeqCst);
        permit
    }

    /// Close the connection idle longest, if there is one (`false`: none).
    fn evict_one(&self) -> bool {
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        while let Some((queued_at, weak)) = idle.pop_front() {
            let Some(state) = weak.upgrade() else {
                continue;
            };
            // Busy and idle again since it was queued: it goes to the back
            // with its new time, once (its time then matches).
            let since = state.idle_since.load(Ordering::Acquire);
            if since > queued_at && state.in_flight.load(Ordering::Acquire) == 0 {
                idle.push_back((since, weak));
                continue;
            }
            state.queued.store(false, Ordering::Relaxed);
            if state.in_flight.load(Ordering::Acquire) == 0 && state.close.signal(Reason::Evicted) {
                return true;
            }
        }
        false
    }

    /// A connection opened (asked to close at once if the worker is
    /// already shutting down).
    pub fn opened(&self) -> Arc<ConnState> {
        self.open.fetch_add(1, Ordering::Relaxed);
        OPEN.fetch_add(1, Ordering::Relaxed);
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        let id = registry.next;
        registry.next += 1;
        let state = Arc::new(ConnState {
            in_flight: AtomicU32::new(0),
            served: AtomicBool::new(false),
            idle_since: AtomicU64::new(self.now_ms()),
            queued: AtomicBool::new(false),
            head_from: AtomicU64::new(0),
            owed: AtomicU32::new(0),
            progress_at: AtomicU64::new(0),
            close: Close::default(),
            id,
            streams: AtomicU64::new(0),
            resets: AtomicU64::new(0),
        });
        if registry.stopping {
            state.close.signal(Reason::Shutdown);
        } else {
            registry.open.insert(id, Arc::downgrade(&state));
        }
        drop(registry);
        self.became_idle(&state);
        state
    }

    /// `state`'s connection closed.
    pub fn closed(&self, state: &ConnState) {
        let open = self.open.fetch_sub(1, Ordering::Relaxed).saturating_sub(1);
        OPEN.fetch_sub(1, Ordering::Relaxed);
        // Closed connections' entries leave the idle queue only when it is
        // walked: it is swept when they outnumber the open ones, so that
        // connections opened and closed below the limit leave nothing.
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            if idle.len() > 2 * open + 64 {
                idle.retain(|(_, w)| w.strong_count() > 0);
            }
        }
        self.registry
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .open
            .remove(&state.id);
    }

    /// Shutdown: every open connection (and every one opened from now on)
    /// is asked to close; each finishes the request it holds first.
    pub fn shut_down(&self) {
        let open = {
            let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
            registry.stopping = true;
            std::mem::take(&mut registry.open)
        };
        for state in open.into_values().filter_map(|w| w.upgrade()) {
            state.close.signal(Reason::Shutdown);
        }
    }

    fn became_idle(&self, state: &Arc<ConnState>) {
        let now = self.now_ms();
        state.idle_since.store(now, Ordering::Release);
        if !state.queued.swap(true, Ordering::AcqRel) {
            self.idle
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push_back((now, Arc::downgrade(state)));
        }
        if self.starved.load(Ordering::SeqCst) > 0 {
            self.became_idle.notify_one();
        }
    }

    /// Whether a request of `state`'s connection is being handled, or its
    /// answer sent.
    pub fn busy(&self, state: &ConnState) -> bool {
        state.in_flight.load(Ordering::Acquire) > 0
    }

    /// Whether `state`'s connection has answers waiting for the client to
    /// take what it was sent, none of which moved for `send_timeout`. On
    /// HTTP/2 one stream the client holds back by flow control (a paused
    /// server stream) owes a frame while requests beside it wait their
    /// turn in the queue, which would lose their places with the
    /// connection: one such stream is borne while something else is in
    /// hand, for ten times `send_timeout` at most. Two or more are not (a
    /// client holding back many answers holds their upstream connections
    /// and buffers).
    pub fn stalled(&self, state: &ConnState) -> bool {
        let owed = state.owed.load(Ordering::Acquire);
        let quiet = self
            .now_ms()
            .saturating_sub(state.progress_at.load(Ordering::Acquire));
        let limit = u64::try_from(self.send_timeout.as_millis()).unwrap_or(u64::MAX);
        owed > 0
            && quiet > limit
            && (owed > 1
                || owed >= state.in_flight.load(Ordering::Acquire)
                || quiet > limit.saturating_mul(10))
    }

    /// A response body handed hyper a frame (`true`), or was polled again
    /// after one, or dropped with one owed (`false`).
    fn owe(&self, state: &ConnState, owed: bool) {
        if owed {
            if state.owed.fetch_add(1, Ordering::AcqRel) == 0 {
                state.progress_at.store(self.now_ms(), Ordering::Release);
            }
        } else {
            state.owed.fetch_sub(1, Ordering::AcqRel);
            state.progress_at.store(self.now_ms(), Ordering::Release);
        }
    }

    /// A request of `state`'s connection starts; the guard ends it.
    pub fn request(self: &Arc<Self>, state: &Arc<ConnState>) -> RequestGuard {
        state.in_flight.fetch_add(1, Ordering::AcqRel);
        state.served.store(true, Ordering::Relaxed);
        state.head_from.store(0, Ordering::Relaxed);
        RequestGuard {
            conns: self.clone(),
            state: state.clone(),
        }
    }

    /// When `state`'s connection is due to close if it stays idle, or
    /// `None` while a request is being handled.
    pub fn idle_deadline(&self, state: &ConnState) -> Option<Instant> {
        if state.in_flight.load(Ordering::Acquire) > 0 {
            return None;
        }
        let timeout = if state.served.load(Ordering::Relaxed) {
            self.keepalive_timeout
        } else {
            self.header_read_timeout
        };
        let since = Duration::from_millis(state.idle_since.load(Ordering::Acquire));
        let idle = self.epoch + since + timeout;
        match state.head_from.load(Ordering::Acquire) {
            0 => Some(idle),
            from => {
                let head = self.epoch + Duration::from_millis(from - 1) + self.header_read_timeout;
                Some(idle.min(head))
            }
        }
    }

    /// Bytes came in on `state`'s HTTP/1.1 connection served by hyper:
    /// while it is idle, they begin a head, which must end within
    /// `header_read_timeout` (hyper's own timer is off: it also ran while
    /// the connection waited for its next request, and closed keep-alive
    /// connections at `header_read_timeout` instead of `keepalive_timeout`).
    pub fn head_bytes(&self, state: &ConnState) {
        if state.in_flight.load(Ordering::Acquire) == 0
            && state.head_from.load(Ordering::Relaxed) == 0
        {
            state
                .head_from
                .store(self.now_ms().saturating_add(1), Ordering::Release);
        }
    }
}

/// A request whose client gives it up within this long of making it
/// (before its answer) counts as a premature reset (Envoy's
/// `premature_reset_min_stream_lifetime_seconds`).
const PREMATURE: Duration = Duration::from_secs(1);

/// Premature resets at which a connection is closed when they are half of
/// its requests or more: Envoy's rule (its `premature_reset_total_stream_count`
/// of 500, half of them resets). A request held in the queue counts too:
/// a reset while held costs its admission and its withdrawal all the same.
const RESETS_CLOSING: u64 = 250;

/// A request on hyper's path until its answer is made. Dropped before
/// (its client reset the HTTP/2 stream, or left) within [`PREMATURE`] of
/// its start, it counts as a premature reset of its connection; at
/// [`RESETS_CLOSING`] of them, when they are half of the connection's
/// requests or more, the connection is asked to close ([`Reason::Resets`]:
/// GOAWAY).
/// h2 bounds only resets of streams not yet accepted; hyper accepts each
/// at once, and each costs routing, an admission and its withdrawal, so
/// a client resetting every stream it opens could run that at line rate
/// on one connection.
pub struct Unanswered {
    state: Arc<ConnState>,
    since: Instant,
    answered: bool,
}

impl Unanswered {
    pub fn new(state: &Arc<ConnState>) -> Unanswered {
        state.streams.fetch_add(1, Ordering::Relaxed);
        Unanswered {
            state: state.clone(),
            since: Instant::now(),
            answered: false,
        }
    }

    /// Its answer is made: not a reset.
    pub fn answered(mut self) {
        self.answered = true;
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.answered || self.since.elapsed() >= PREMATURE {
            return;
        }
        let resets = self.state.resets.fetch_add(1, Ordering::Relaxed) + 1;
        let streams = self.state.streams.load(Ordering::Relaxed);
        if resets >= RESETS_CLOSING && resets.saturating_mul(2) >= streams {
            self.state.close.signal(Reason::Resets);
        }
    }
}

/// Marks a request in flight until dropped.
pub struct RequestGuard {
    conns: Arc<Conns>,
    state: Arc<ConnState>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        if self.state.in_flight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.conns.became_idle(&self.state);
        }
    }
}

/// A response body on hyper's path that keeps its request in flight
/// until it is sent (or dropped), and tells its connection when it waits
/// for the client to take a frame.
pub struct Guarded<B> {
    body: B,
    guard: RequestGuard,
    owed: bool,
}

impl<B> Drop for Guarded<B> {
    fn drop(&mut self) {
        if self.owed {
            self.guard.conns.owe(&self.guard.state, false);
        }
    }
}

impl<B> Guarded<B> {
    pub fn new(body: B, guard: RequestGuard) -> Guarded<B> {
        Guarded {
            body,
            guard,
            owed: false,
        }
    }
}

impl<B: hyper::body::Body + Unpin> hyper::body::Body for Guarded<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        let this = &mut *self;
        if this.owed {
            this.owed = false;
            this.guard.conns.owe(&this.guard.state, false);
        }
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(Some(Ok(_))) = &frame {
            this.owed = true;
            this.guard.conns.owe(&this.guard.state, true);
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

pub type OwnedPermit = OwnedSemaphorePermit;

#[cfg(test)]
mod tests {
    use super::*;

    /// Premature resets close the connection only from RESETS_CLOSING on,
    /// and when half of its requests or more; answered requests are not
    /// resets.
    #[test]
    fn resets_close_a_connection_past_the_bound_and_half_its_requests() {
        let conns = Conns::new(
            10,
            Duration::from_secs(1),
            Duration::from_secs(5),
            Duration::from_secs(5),
        );
        let reset =
            |state: &Arc<ConnState>, n: u64| (0..n).for_each(|_| drop(Unanswered::new(state)));
        let answer = |state: &Arc<ConnState>, n: u64| {
            (0..n).for_each(|_| Unanswered::new(state).answered());
        };
        let a = conns.opened();
        reset(&a, RESETS_CLOSING - 1);
        assert_eq!(a.close.reason(), None, "below the bound");
        reset(&a, 1);
        assert_eq!(a.close.reason(), Some(Reason::Resets));
        // Fewer than half its requests: a client cancelling many calls
        // among more served ones keeps its connection.
        let b = conns.opened();
        answer(&b, 2 * RESETS_CLOSING + 1);
        reset(&b, 2 * RESETS_CLOSING);
        assert_eq!(b.close.reason(), None, "under half of them");
        reset(&b, 2);
        assert_eq!(b.close.reason(), Some(Reason::Resets));
    }

    #[tokio::test]
    async fn at_the_limit_the_oldest_idle_connection_is_evicted() {
        let conns = Arc::new(Conns::new(
            2,
            Duration::from_secs(1),
            Duration::from_secs(5),
            Duration::from_secs(5),
        ));
        let p1 = conns.admit().await.unwrap();
        let a = conns.opened();
        let p2 = conns.admit().await.unwrap();
        let b = conns.opened();
        // b is busy, a is idle: a new connection evicts a, not b.
        let busy = conns.request(&b);
        let waiting = {
            let conns = conns.clone();
            tokio::spawn(async move { conns.admit().await })
        };
        let why = tokio::time::timeout(Duration::from_secs(1), a.close.wait())
            .await
            .unwrap();
        assert_eq!(why, Reason::Evicted);
        assert_eq!(b.close.reason(), None);
        drop(p1); // a closes
        let p3 = waiting.await.unwrap();
        assert!(p3.is_some());
        drop((p2, busy));
    }

    #[tokio::test]
    async fn at_the_limit_with_none_idle_the_first_to_become_idle_is_evicted() {
        let conns = Arc::new(Conns::new(
            2,
            Duration::from_secs(1),
            Duration::from_secs(60),
            Duration::from_secs(60),
        ));
        let p1 = conns.admit().await.unwrap();
        let a = conns.opened();
        let p2 = conns.admit().await.unwrap();
        let b = conns.opened();
        let (busy_a, busy_b) = (conns.request(&a), conns.request(&b));
        let waiting = {
            let conns = conns.clone();
            tokio::spawn(async move { conns.admit().await })
        };
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(a.close.reason(), None);
        assert_eq!(b.close.reason(), None);
        // b's request ends: b is asked to close for the new one.
        drop(busy_b);
        let why = tokio::time::timeout(Duration::from_secs(1), b.close.wait())
            .await
            .unwrap();
        assert_eq!(why, Reason::Evicted);
        assert_eq!(a.close.reason(), None);
        drop(p2); // b closes
        let p3 = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .unwrap()
            .unwrap();
        assert!(p3.is_some());
        drop((p1, busy_a));
    }

    #[tokio::test]
    async fn shutdown_reaches_every_open_connection_and_every_later_one() {
        let conns = Arc::new(Conns::new(
            10,
            Duration::from_secs(1),
            Duration::from_secs(5),
            Duration::from_secs(5),
        ));
        let a = conns.opened();
        let b = conns.opened();
        let gone = conns.opened();
        conns.closed(&gone);
        drop(gone);
        let waiting = {
            let a = a.clone();
            tokio::spawn(async move { a.close.wait().await })
        };
        tokio::task::yield_now().await;
        assert_eq!(a.close.reason(), None);
        conns.shut_down();
        let why = tokio::time::timeout(Duration::from_secs(1), waiting)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(why, Reason::Shutdown);
        assert_eq!(b.close.reason(), Some(Reason::Shutdown));
        // Opened after the shutdown (accepted just before it): closes too.
        let late = conns.opened();
        assert_eq!(late.close.reason(), Some(Reason::Shutdown));
        // An evicted connection keeps its reason.
        assert!(!late.close.signal(Reason::Evicted));
        assert_eq!(late.close.reason(), Some(Reason::Shutdown));
    }

    #[test]
    fn closed_connections_do_not_pile_up_in_the_idle_queue() {
        let conns = Arc::new(Conns::new(
            10,
            Duration::from_secs(1),
            Duration::from_secs(5),
            Duration::from_secs(5),
        ));
        let kept = conns.opened();
        for _ in 0..10_000 {
            let s = conns.opened();
            conns.closed(&s);
        }
        let queued = conns.idle.lock().unwrap().len();
        // Swept past 2 x open + 64 entries.
        assert!(queued <= 67, "{queued} entries for 1 open connection");
        drop(kept);
    }

    #[tokio::test]
    async fn the_connection_idle_longest_is_evicted_not_the_oldest() {
        let conns = Arc::new(Conns::new(
            2,
            Duration::from_secs(1),
            Duration::from_secs(60),
            Duration::from_secs(60),
        ));
        let _p1 = conns.admit().await.unwrap();
        let old = conns.opened();
        std::thread::sleep(Duration::from_millis(20));
        let _p2 = conns.admit().await.unwrap();
        let silent = conns.opened();
        std::thread::sleep(Duration::from_millis(20));
        // The older connection served a request since: idle for less time.
        drop(conns.request(&old));
        let _waiting = {
            let conns = conns.clone();
            tokio::spawn(async move { conns.admit().await })
        };
        let why = tokio::time::timeout(Duration::from_secs(1), silent.close.wait())
            .await
            .unwrap();
        assert_eq!(why, Reason::Evicted);
        assert_eq!(old.close.reason(), None);
    }

    #[test]
    fn an_idle_connection_is_due_after_its_timeout_and_not_while_busy() {
        let conns = Arc::new(Conns::new(
            10,
            Duration::from_secs(2),
            Duration::from_secs(7),
            Duration::from_secs(7),
        ));
        let s = conns.opened();
        let first = conns.idle_deadline(&s).unwrap();
        assert!(first <= Instant::now() + Duration::from_secs(2));
        let guard = conns.request(&s);
        assert_eq!(conns.idle_deadline(&s), None);
        drop(guard);
        let later = conns.idle_deadline(&s).unwrap();
        assert!(later > Instant::now() + Duration::from_secs(6));
    }
}
