//! The pacer: the real-time shell around the pure engine (DESIGN section 2).
//!
//! Admission is synchronous: the caller locks the engine, is answered at
//! once (depart, wait, or refused) and, when it must wait, parks on a
//! oneshot. A dedicated OS thread owns the timing: it sleeps until the next
//! departure minus a short window, spins for the last microseconds, releases
//! everything due under one lock, and fires the oneshots after unlocking.
//! tokio's 1 ms timer never sets a departure time. With nothing due the
//! thread parks without a timeout: an idle pacer uses no CPU.
//!
//! Idle client states are swept at a coarse granularity ([`SWEEP`]) so that
//! many clients leaving at different instants do not wake the thread once
//! each.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::engine::{
    Admission, ClientView, Engine, Limits, Policy, Probe, Rejection, RouteId, Ticket, UpstreamId,
};
use super::rate::{Nanos, Rate};

/// How long before a departure the pacer stops sleeping and spins. Covers
/// the kernel's default 50 µs timer slack plus wake-up latency.
const SPIN: Nanos = 150_000;

/// Granularity of the idle-state sweep.
const SWEEP: Nanos = 100_000_000;

/// Why [`Shaper::acquire`] did not grant a departure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AcquireError {
    /// The engine refused the request.
    #[error("refused: {0:?}")]
    Rejected(Rejection),
    /// The shaper stopped while the request waited.
    #[error("the shaper stopped")]
    Closed,
}

/// Handle to a running shaper; cheap to clone. The pacer thread stops when
/// the last handle is dropped.
pub struct Shaper<K> {
    inner: Arc<Inner<K>>,
    _stop: Arc<StopOnDrop<K>>,
}

impl<K> Clone for Shaper<K> {
    fn clone(&self) -> Self {
        Shaper {
            inner: self.inner.clone(),
            _stop: self._stop.clone(),
        }
    }
}

/// Called by the pacer thread with each wake-up's release lag: the time
/// between the departure it woke for and the moment it released it.
pub type LagObserver = Box<dyn Fn(Duration) + Send + Sync>;

/// A precise wake-up at an absolute instant (cluster mode: a departure
/// scheduled elsewhere, released by this pacer).
struct Timer {
    at: Nanos,
    seq: u64,
    tx: oneshot::Sender<()>,
}

impl PartialEq for Timer {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Timer {}

impl PartialOrd for Timer {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Timer {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

#[derive(Default)]
struct Timers {
    heap: BinaryHeap<Reverse<Timer>>,
    seq: u64,
}

struct Inner<K> {
    engine: Mutex<Engine<K, oneshot::Sender<()>>>,
    /// Locked after `engine` when both are needed, never before.
    timers: Mutex<Timers>,
    lag: OnceLock<LagObserver>,
    origin: Instant,
    /// The instant the pacer will next wake for a release (`u64::MAX`: none).
    target: AtomicU64,
    stop: AtomicBool,
    thread: OnceLock<Thread>,
}

struct StopOnDrop<K>(Arc<Inner<K>>);

impl<K> Drop for StopOnDrop<K> {
    fn drop(&mut self) {
        self.0.stop.store(true, Ordering::Release);
        if let Some(t) = self.0.thread.get() {
            t.unpark();
        }
    }
}

/// The outcome of an admission, before any waiting.
pub enum Admitted {
    /// Go now.
    Now,
    /// Wait for the returned future; dropping it gives the place back.
    Wait(Waiting),
}

/// A request waiting for its departure. Await [`Waiting::departed`];
/// dropping it withdraws the request.
pub struct Waiting {
    rx: oneshot::Receiver<()>,
    cancel: Option<Box<dyn FnOnce() + Send + Sync>>,
    departure: Nanos,
    origin: Instant,
}

impl Waiting {
    /// The departure this client's own schedule gives (a lower bound when
    /// an upstream cap applies).
    pub fn departure(&self) -> Instant {
        self.origin + Duration::from_nanos(self.departure)
    }

    /// Stop waiting without withdrawing: the request keeps its place in
    /// the schedule (dry-run mode decides as if it waited, but forwards at
    /// once).
    pub fn detach(mut self) {
        self.cancel = None;
    }

    /// Resolve when the request may depart.
    pub async fn departed(mut self) -> Result<(), AcquireError> {
        let result = (&mut self.rx).await.map_err(|_| AcquireError::Closed);
        self.cancel = None;
        result
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(cancel) = self.cancel.take() {
            cancel();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the engine half-updated
    // in a way later calls would trip over (each call re-validates), so a
    // poisoned lock is still usable.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<K: Hash + Eq + Send + 'static> Shaper<K> {
    /// Start a shaper with its pacer thread.
    pub fn start(limits: Limits) -> std::io::Result<Shaper<K>> {
        let inner = Arc::new(Inner {
            engine: Mutex::new(Engine::new(limits)),
            timers: Mutex::new(Timers::default()),
            lag: OnceLock::new(),
            origin: Instant::now(),
            target: AtomicU64::new(u64::MAX),
            stop: AtomicBool::new(false),
            thread: OnceLock::new(),
        });
        let pacer = inner.clone();
        let handle = thread::Builder::new()
            .name("sluice-pacer".into())
            .spawn(move || run(&pacer))?;
        let _ = inner.thread.set(handle.thread().clone());
        Ok(Shaper {
            _stop: Arc::new(StopOnDrop(inner.clone())),
            inner,
        })
    }

    /// Observe the pacer's release lag (actual minus scheduled release) at
    /// every wake-up that releases something. Set once; later calls are
    /// ignored.
    pub fn observe_lag(&self, observer: LagObserver) {
        let _ = self.inner.lag.set(observer);
    }

    /// Register an upstream, with an optional global cap.
    pub fn add_upstream(&self, cap: Option<Rate>) -> UpstreamId {
        lock(&self.inner.engine).add_upstream(cap)
    }

    /// Register a route on an upstream.
    pub fn add_route(&self, policy: Policy, upstream: UpstreamId) -> RouteId {
        lock(&self.inner.engine).add_route(policy, upstream)
    }

    /// Change a route's policy for new arrivals (waiting requests keep
    /// their place and their schedule).
    pub fn set_policy(&self, route: RouteId, policy: Policy) {
        lock(&self.inner.engine).set_policy(route, policy);
    }

    /// Change the global bounds on clients and queued requests.
    pub fn set_limits(&self, limits: Limits) {
        lock(&self.inner.engine).set_limits(limits);
    }

    /// Change an upstream's global cap.
    pub fn set_upstream_cap(&self, upstream: UpstreamId, cap: Option<Rate>) {
        lock(&self.inner.engine).set_upstream_cap(upstream, cap);
        // Make the pacer recompute its next wake-up.
        self.inner.target.store(0, Ordering::Release);
        if let Some(t) = self.inner.thread.get() {
            t.unpark();
        }
    }

    /// The shaper's clock, on the engine's time axis.
    pub fn now(&self) -> Nanos {
        self.inner.now()
    }

    /// Client states held and requests waiting.
    pub fn stats(&self) -> (usize, usize) {
        let e = lock(&self.inner.engine);
        (e.clients(), e.queued())
    }

    /// What an arrival of `cost` for `key` would be answered now, without
    /// changing any state.
    pub fn probe(&self, route: RouteId, key: &K, cost: u32) -> Probe {
        let e = lock(&self.inner.engine);
        e.probe(route, key, cost, self.inner.now())
    }

    /// Look at one client without changing anything.
    pub fn view(&self, route: RouteId, key: &K) -> Option<ClientView> {
        let e = lock(&self.inner.engine);
        e.view(route, key, self.inner.now())
    }

    /// Refuse every request still waiting: each waiter resolves with
    /// [`AcquireError::Closed`]. Used when a drain runs out of time.
    pub fn close_waiting(&self) -> usize {
        let mut withdrawn = Vec::new();
        {
            let mut e = lock(&self.inner.engine);
            let now = self.inner.now();
            e.withdraw_all(now, &mut withdrawn);
        }
        // Dropping the senders wakes the waiters with an error.
        withdrawn.len()
    }

    /// The `n` deepest queues, deepest first.
    pub fn deepest(&self, n: usize) -> Vec<(RouteId, K, ClientView)>
    where
        K: Clone,
    {
        let e = lock(&self.inner.engine);
        e.deepest(n, self.inner.now())
            .into_iter()
            .map(|(r, k, v)| (r, k.clone(), v))
            .collect()
    }

    /// Resolve at `at` (on the shaper's clock), released by the pacer
    /// thread with the same precision as queued departures.
    pub async fn sleep_until(&self, at: Nanos) {
        let (tx, rx) = oneshot::channel();
        let wake = {
            let mut t = lock(&self.inner.timers);
            t.seq += 1;
            let seq = t.seq;
            t.heap.push(Reverse(Timer { at, seq, tx }));
            at < self.inner.target.load(Ordering::Acquire)
        };
        if wake {
            self.inner.target.store(at, Ordering::Release);
            if let Some(t) = self.inner.thread.get() {
                t.unpark();
            }
        }
        // An error means the shaper stopped: return, the caller decides.
        let _ = rx.await;
    }

    /// Decide an arrival now. A refusal is answered at once; a request that
    /// must wait gets a [`Waiting`] to await.
    pub fn admit(&self, route: RouteId, key: K, cost: u32) -> Result<Admitted, Rejection> {
        let mut rx = None;
        let mut wake = false;
        let admission = {
            let mut e = lock(&self.inner.engine);
            let now = self.inner.now();
            let admission = e.admit(route, key, cost, now, || {
                let (tx, r) = oneshot::channel();
                rx = Some(r);
                tx
            });
            if let Admission::Queued { .. } = admission
                && let Some(next) = e.next_release()
                && next < self.inner.target.load(Ordering::Acquire)
            {
                self.inner.target.store(next, Ordering::Release);
                wake = true;
            }
            admission
        };
        if wake && let Some(t) = self.inner.thread.get() {
            t.unpark();
        }
        match (admission, rx) {
            (Admission::Depart, _) => Ok(Admitted::Now),
            (Admission::Queued { ticket, departure }, Some(rx)) => Ok(Admitted::Wait(Waiting {
                rx,
                cancel: Some(self.canceller(ticket)),
                departure,
                origin: self.inner.origin,
            })),
            (Admission::Queued { .. }, None) => Err(Rejection::TooManyQueued),
            (Admission::Rejected(r), _) => Err(r),
        }
    }

    fn canceller(&self, ticket: Ticket) -> Box<dyn FnOnce() + Send + Sync> {
        let inner = self.inner.clone();
        Box::new(move || {
            let mut e = lock(&inner.engine);
            let now = inner.now();
            e.cancel(ticket, now);
        })
    }

    /// Resolve when a request of `cost` for `key` may depart; refused at
    /// once when the engine refuses it. Dropping the future while it waits
    /// withdraws the request and gives its slot to the next in line.
    pub async fn acquire(&self, route: RouteId, key: K, cost: u32) -> Result<(), AcquireError> {
        match self.admit(route, key, cost) {
            Ok(Admitted::Now) => Ok(()),
            Ok(Admitted::Wait(w)) => w.departed().await,
            Err(r) => Err(AcquireError::Rejected(r)),
        }
    }
}

impl<K> Inner<K> {
    fn now(&self) -> Nanos {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

// === the pacer thread ===

fn run<K: Hash + Eq>(inner: &Inner<K>) {
    let mut out = Vec::new();
    let mut next_sweep: Nanos = 0;
    while !inner.stop.load(Ordering::Acquire) {
        let (release, expiry) = {
            let mut e = lock(&inner.engine);
            let now = inner.now();
            let due = e.next_release();
            e.release_due(now, &mut out);
            if let (Some(at), Some(observe)) = (due, inner.lag.get())
                && at <= now
            {
                observe(Duration::from_nanos(now - at));
            }
            if now >= next_sweep {
                e.expire(now);
                next_sweep = now + SWEEP;
            }
            let mut timers = lock(&inner.timers);
            while timers.heap.peek().is_some_and(|t| t.0.at <= now) {
                if let Some(Reverse(t)) = timers.heap.pop() {
                    out.push(t.tx);
                }
            }
            let release = match (e.next_release(), timers.heap.peek()) {
                (Some(r), Some(t)) => Some(r.min(t.0.at)),
                (r, t) => r.or(t.map(|t| t.0.at)),
            };
            inner
                .target
                .store(release.unwrap_or(u64::MAX), Ordering::Release);
            (release, e.next_expiry().map(|t| t.max(next_sweep)))
        };
        for tx in out.drain(..) {
            // The receiver may be gone (its client left just now): fine.
            let _ = tx.send(());
        }
        wait(inner, release, expiry);
    }
}

/// Sleep until the next release (precisely) or the next sweep (coarsely),
/// returning early when an admission moves the release earlier.
fn wait<K>(inner: &Inner<K>, release: Option<Nanos>, expiry: Option<Nanos>) {
    let wake = match (release, expiry) {
        (Some(r), Some(x)) => r.min(x),
        (Some(r), None) => r,
        (None, Some(x)) => x,
        (None, None) => {
            thread::park();
            return;
        }
    };
    let precise = release == Some(wake);
    loop {
        let now = inner.now();
        if now >= wake
            || inner.stop.load(Ordering::Acquire)
            || inner.target.load(Ordering::Acquire) < wake
        {
            return;
        }
        let left = wake - now;
        if !precise {
            thread::park_timeout(Duration::from_nanos(left));
        } else if left > SPIN {
            thread::park_timeout(Duration::from_nanos(left - SPIN));
        } else {
            std::hint::spin_loop();
        }
    }
}
