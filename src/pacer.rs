//! The pacer: the real-time shell around the pure engine (DESIGN section 2).
//!
//! Admission is synchronous and runs on the caller's thread: it locks one
//! engine shard, is answered at once (depart, wait, or refused) and, when it
//! must wait, parks on a oneshot. A dedicated OS thread owns the timing. Its
//! inbox (a crossbeam channel) carries everything that needs it: a wake-up
//! when a new queue head is due earlier than the thread planned to look, a
//! cancellation when a waiter goes away (a message, never a lock taken in
//! `Drop`), and precise timers for requests held for a shared schedule. It
//! sleeps in `recv_deadline` until shortly before the next departure, spins
//! the last microseconds, releases what is due and fires the oneshots after
//! the engine's locks are released. With nothing due and no client state
//! held it blocks on the inbox: an idle pacer uses no CPU.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, ready};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TryRecvError};
use tokio::sync::oneshot;

use crate::shaper::{
    Admission, ClientView, Engine, Limits, Nanos, Policy, Probe, Rate, Rejection, RouteId, Target,
    Ticket, UpstreamId, Wake,
};

/// How long before a departure the pacer stops sleeping and spins. A sleep
/// ends late by the machine's wake-up latency, and that latency depends on
/// the sleep: on this project's 2-vCPU VM a 1 ms sleep ended 44 µs late at
/// the median and 54 µs at p90, a 10 ms one 74 and 91 µs (a vCPU idle for
/// longer wakes more slowly). So the lead is learned, not fixed: [`Lead`]
/// tracks the p90 of the pacer's own oversleeps and adds a margin. Above
/// [`Lead::MIN`] the pacer spins at most half the time between two
/// departures, so at high rates (where short sleeps end early enough) its
/// CPU stays what a fixed 50 µs lead costs.
struct Lead {
    /// Running estimate of the p90 oversleep of a precise sleep.
    p90: Nanos,
}

impl Lead {
    /// Where the estimate starts.
    const START: Nanos = 50_000;
    /// The shortest lead: short sleeps (between departures 100 µs apart)
    /// end within it.
    const MIN: Nanos = 50_000;
    /// Added to the estimate: the spin also covers a wake-up a little
    /// later than the p90.
    const MARGIN: Nanos = 10_000;
    /// The longest lead: beyond it the machine is stalling or saturated,
    /// and a longer spin (at the pacer's raised priority) would take more
    /// of a core from the workers that carry the releases out. It bounds
    /// the spin to 15 % of a core at 1,000 departures a second.
    const MAX: Nanos = 150_000;
    /// One step of the quantile tracker: up 9 steps when a sleep ends later
    /// than the estimate, down 1 when it does not, so the estimate settles
    /// where 10 % of sleeps end later (a single stall moves it by 9 µs).
    const STEP: Nanos = 1_000;

    fn new() -> Lead {
        Lead { p90: Lead::START }
    }

    /// The lead before a departure `gap` after the one released last.
    fn before(&self, gap: Nanos) -> Nanos {
        (self.p90 + Lead::MARGIN)
            .min(Lead::MAX)
            .min(gap / 2)
            .max(Lead::MIN)
    }

    /// A precise sleep meant to end at some instant ended `late` after it.
    fn observe(&mut self, late: Nanos) {
        self.p90 = if late > self.p90 {
            self.p90.saturating_add(9 * Lead::STEP).min(Lead::MAX)
        } else {
            self.p90.saturating_sub(Lead::STEP)
        };
    }
}

/// The pacer thread's timer slack: its sleeps end within this of their
/// deadline (plus the machine's own wake-up latency).
const TIMER_SLACK: u64 = 1_000;

/// The least time between two sweeps of idle client states (a sweep
/// comes when the first held may be forgotten, at most this often).
const SWEEP: Nanos = 100_000_000;

/// Why [`Shaper::acquire`] did not grant a departure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AcquireError {
    /// The engine refused the request.
    #[error("refused: {0:?}")]
    Rejected(Rejection),
    /// The shaper stopped (or withdrew every waiter) while it waited.
    #[error("the shaper stopped")]
    Closed,
}

/// Called by the pacer thread with each release's lag: the time between
/// the departure it woke for and the moment it released it.
pub type LagObserver = Box<dyn Fn(Duration) + Send + Sync>;

enum Msg {
    Wake(Wake),
    Cancel(Ticket),
    Timer(Nanos, oneshot::Sender<()>),
    /// Answered at once: the thread is alive and taking messages.
    Ping(oneshot::Sender<()>),
    /// The engine's next sweep moved earlier: plan the sleep again.
    Look,
    Stop,
}

struct Inner<K> {
    engine: Engine<K, oneshot::Sender<()>>,
    inbox: Sender<Msg>,
    origin: Instant,
    lag: OnceLock<LagObserver>,
    /// Set when the pacer thread has ended (stopped, or panicked).
    ended: std::sync::atomic::AtomicBool,
    /// The pacer thread's wake-ups.
    #[cfg(test)]
    wakeups: std::sync::atomic::AtomicUsize,
}

/// Marks the pacer thread's end, however it ends (a panic unwinds through
/// it): nothing would release the requests still waiting, so each is
/// told (its waiter resolves with an error) rather than left for ever.
struct Ended<K: Hash + Eq>(Arc<Inner<K>>);

impl<K: Hash + Eq> Drop for Ended<K> {
    fn drop(&mut self) {
        self.0
            .ended
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let mut withdrawn = Vec::new();
        self.0.engine.withdraw_all(self.0.now(), &mut withdrawn);
    }
}

impl<K> Inner<K> {
    fn now(&self) -> Nanos {
        u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(Nanos::MAX)
    }
}

/// Handle to a running shaper; cheap to clone. The pacer thread stops when
/// the last handle is dropped.
pub struct Shaper<K> {
    inner: Arc<Inner<K>>,
    _stop: Arc<StopOnDrop>,
}

impl<K> Clone for Shaper<K> {
    fn clone(&self) -> Self {
        Shaper {
            inner: self.inner.clone(),
            _stop: self._stop.clone(),
        }
    }
}

struct StopOnDrop(Sender<Msg>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = self.0.send(Msg::Stop);
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
    /// Set while dropping must withdraw the request.
    ticket: Option<Ticket>,
    inbox: Sender<Msg>,
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
        self.ticket = None;
    }

    /// Resolve when the request may depart.
    pub async fn departed(mut self) -> Result<(), AcquireError> {
        std::future::poll_fn(|cx| self.poll_wait(cx)).await
    }

    /// Ready when the request may depart, keeping the waiter: dropping it
    /// before this is ready still withdraws the request.
    pub fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), AcquireError>> {
        let result = ready!(Pin::new(&mut self.rx).poll(cx)).map_err(|_| AcquireError::Closed);
        self.ticket = None;
        Poll::Ready(result)
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(ticket) = self.ticket.take() {
            let _ = self.inbox.send(Msg::Cancel(ticket));
        }
    }
}

/// Engine shards for a machine with `cores` cores: enough that admissions
/// from every core rarely meet on one lock.
pub fn default_shards(cores: usize) -> usize {
    (cores.max(1) * 4).next_power_of_two().clamp(4, 256)
}

impl<K: Hash + Eq + Send + 'static> Shaper<K> {
    /// Start a shaper with its pacer thread, sharded for this machine.
    pub fn start(limits: Limits) -> std::io::Result<Shaper<K>> {
        let cores = thread::available_parallelism().map_or(1, |n| n.get());
        Self::with_shards(limits, default_shards(cores))
    }

    /// Start a shaper with `shards` engine shards.
    pub fn with_shards(limits: Limits, shards: usize) -> std::io::Result<Shaper<K>> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let inner = Arc::new(Inner {
            engine: Engine::new(limits, shards),
            inbox: tx.clone(),
            origin: Instant::now(),
            lag: OnceLock::new(),
            ended: std::sync::atomic::AtomicBool::new(false),
            #[cfg(test)]
            wakeups: std::sync::atomic::AtomicUsize::new(0),
        });
        let pacer = inner.clone();
        thread::Builder::new()
            .name("sluice-pacer".into())
            .spawn(move || {
                let _ended = Ended(pacer.clone());
                tune_thread();
                Pacer::new(&pacer, rx).run()
            })?;
        Ok(Shaper {
            inner,
            _stop: Arc::new(StopOnDrop(tx)),
        })
    }

    /// Observe the pacer's release lag (actual minus scheduled release) at
    /// every wake-up that releases something. Set once; later calls are
    /// ignored.
    pub fn observe_lag(&self, observer: LagObserver) {
        let _ = self.inner.lag.set(observer);
    }

    /// Register an upstream, with an optional global cap. Whether it is
    /// capped is fixed; the cap's rate can change.
    pub fn add_upstream(&self, cap: Option<Rate>) -> UpstreamId {
        self.inner.engine.add_upstream(cap)
    }

    /// Register a route on an upstream.
    pub fn add_route(&self, policy: Policy, upstream: UpstreamId) -> RouteId {
        self.inner.engine.add_route(policy, upstream)
    }

    /// Change a route's policy for new arrivals (waiting requests keep
    /// their place and their schedule).
    pub fn set_policy(&self, route: RouteId, policy: Policy) {
        let now = self.now();
        self.inner.engine.set_policy(route, policy, now);
        self.look_if_sweep_moved();
    }

    /// Tell the pacer when what it must next sweep moved earlier than it
    /// planned (a client made, or its schedule shortened, off its thread).
    fn look_if_sweep_moved(&self) {
        if self.inner.engine.sweep_moved_earlier() {
            let _ = self.inner.inbox.send(Msg::Look);
        }
    }

    /// Change the global bounds on clients and queued requests.
    pub fn set_limits(&self, limits: Limits) {
        self.inner.engine.set_limits(limits);
    }

    /// Register an upstream that may also be paused.
    pub fn add_gated_upstream(&self, cap: Option<Rate>, pausable: bool) -> UpstreamId {
        self.inner.engine.add_gated_upstream(cap, pausable)
    }

    /// Hold releases to `upstream` until `until` (engine time).
    pub fn pause(&self, upstream: UpstreamId, until: Nanos) -> bool {
        self.inner.engine.pause(upstream, until)
    }

    /// Until when releases to `upstream` are paused, if they are now.
    pub fn paused_until(&self, upstream: UpstreamId) -> Option<Nanos> {
        self.inner.engine.paused_until(upstream, self.inner.now())
    }

    /// Change a capped upstream's rate; the pacer re-plans at once.
    pub fn set_upstream_rate(&self, upstream: UpstreamId, rate: Option<Rate>) {
        self.inner
            .engine
            .set_upstream_rate(upstream, rate, self.inner.now());
        for target in self.inner.engine.targets() {
            if matches!(target, Target::Cap(_)) {
                let _ = self.inner.inbox.send(Msg::Wake(Wake { target, at: 0 }));
            }
        }
    }

    /// The shaper's clock, on the engine's time axis.
    pub fn now(&self) -> Nanos {
        self.inner.now()
    }

    /// The instant `at` on the engine's time axis stands for.
    pub fn instant(&self, at: Nanos) -> Instant {
        self.inner.origin + Duration::from_nanos(at)
    }

    /// Client states held and requests waiting.
    pub fn stats(&self) -> (usize, usize) {
        (self.inner.engine.clients(), self.inner.engine.queued())
    }

    /// The global bounds, shared with requests held elsewhere (cluster
    /// mode counts its held requests against `max_queued` here too).
    pub fn budget(&self) -> &crate::shaper::Budget {
        self.inner.engine.budget()
    }

    /// What an arrival of `cost` for `key` would be answered now, without
    /// changing any state.
    pub fn probe(&self, route: RouteId, key: &K, cost: u32) -> Probe {
        self.inner.engine.probe(route, key, cost, self.inner.now())
    }

    /// Look at one client without changing anything.
    pub fn view(&self, route: RouteId, key: &K) -> Option<ClientView> {
        self.inner.engine.view(route, key, self.inner.now())
    }

    /// Refuse every request still waiting: each waiter resolves with
    /// [`AcquireError::Closed`]. Used when a drain runs out of time.
    pub fn close_waiting(&self) -> usize {
        let mut withdrawn = Vec::new();
        self.inner
            .engine
            .withdraw_all(self.inner.now(), &mut withdrawn);
        self.look_if_sweep_moved();
        // Dropping the senders wakes the waiters with an error.
        withdrawn.len()
    }

    /// The `n` deepest queues, deepest first.
    pub fn deepest(&self, n: usize) -> Vec<(RouteId, K, ClientView)>
    where
        K: Clone,
    {
        self.inner.engine.deepest(n, self.inner.now())
    }

    /// Whether the pacer thread has ended (stopped or panicked): nothing
    /// is released any more.
    pub fn ended(&self) -> bool {
        self.inner.ended.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Whether the pacer thread is alive and taking messages (what the
    /// systemd watchdog is told): a thread that died or is stuck would
    /// leave every queue standing while the process looks well.
    pub async fn answers(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        self.inner.inbox.send(Msg::Ping(tx)).is_ok() && rx.await.is_ok()
    }

    /// Resolve at `at` (on the shaper's clock), released by the pacer
    /// thread with the same precision as queued departures: `true`, or
    /// `false` at once when the pacer thread has ended (nothing would
    /// release it; the caller must not take that for the time come).
    pub async fn sleep_until(&self, at: Nanos) -> bool {
        let (tx, rx) = oneshot::channel();
        self.inner.inbox.send(Msg::Timer(at, tx)).is_ok() && rx.await.is_ok()
    }

    /// Decide an arrival now. A refusal is answered at once; a request that
    /// must wait gets a [`Waiting`] to await.
    pub fn admit(&self, route: RouteId, key: K, cost: u32) -> Result<Admitted, Rejection> {
        self.admit_at(route, key, cost, Instant::now())
    }

    /// Decide an arrival that happened at `arrival` (a clock read the
    /// caller already made).
    pub fn admit_at(
        &self,
        route: RouteId,
        key: K,
        cost: u32,
        arrival: Instant,
    ) -> Result<Admitted, Rejection> {
        let now = u64::try_from(
            arrival
                .saturating_duration_since(self.inner.origin)
                .as_nanos(),
        )
        .unwrap_or(Nanos::MAX);
        let mut rx = None;
        let admission = self.inner.engine.admit(route, key, cost, now, || {
            let (tx, r) = oneshot::channel();
            rx = Some(r);
            tx
        });
        self.look_if_sweep_moved();
        match (admission, rx) {
            (Admission::Depart, _) => Ok(Admitted::Now),
            (
                Admission::Queued {
                    ticket,
                    departure,
                    wake,
                },
                Some(rx),
            ) => {
                // No pacer left to release it (checked after queueing: one
                // queued before the thread's end was withdrawn by it): it
                // is withdrawn at once, and its waiter told.
                let ticket = if self.ended() {
                    drop(self.inner.engine.cancel(ticket, now));
                    None
                } else {
                    Some(ticket)
                };
                if let Some(wake) = wake {
                    let _ = self.inner.inbox.send(Msg::Wake(wake));
                }
                Ok(Admitted::Wait(Waiting {
                    rx,
                    ticket,
                    inbox: self.inner.inbox.clone(),
                    departure,
                    origin: self.inner.origin,
                }))
            }
            (Admission::Queued { .. }, None) => Err(Rejection::TooManyQueued),
            (Admission::Rejected(r), _) => Err(r),
        }
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

// === the pacer thread ===

/// Niceness the pacer thread asks for (when permitted: root,
/// `CAP_SYS_NICE`, or an `RLIMIT_NICE` that allows it, as the systemd
/// unit's `LimitNICE=-10` does), so that a saturated machine
/// still gives it a core on time. It sleeps most of the time and spins
/// only the last [`Lead`] before a departure.
const PACER_PRIORITY: u8 = 75; // thread-priority's 0..100 scale: nice -10

/// Precise sleeps and a higher priority for the calling (pacer) thread;
/// either may be refused, and the pacer works without them.
fn tune_thread() {
    if let Err(e) = nix::sys::prctl::set_timerslack(TIMER_SLACK) {
        tracing::debug!(error = %e, "pacer: cannot lower the timer slack");
    }
    let raised = thread_priority::ThreadPriorityValue::try_from(PACER_PRIORITY)
        .map_err(|e| e.to_string())
        .and_then(|v| {
            thread_priority::set_current_thread_priority(
                thread_priority::ThreadPriority::Crossplatform(v),
            )
            .map_err(|e| e.to_string())
        });
    match raised {
        Ok(()) => tracing::debug!("pacer: priority raised (nice -10)"),
        Err(e) => tracing::warn!(
            error = %e,
            "pacer: cannot raise its priority to nice -10 (needs root, CAP_SYS_NICE or LimitNICE=-10): departures may come late on a busy machine"
        ),
    }
}

/// A precise wake-up for a request held for a shared schedule.
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

/// Timers below this many are never pruned.
const PRUNE_MIN: usize = 64;

/// Add a timer. A timer whose waiter has gone (a shared hold withdrawn)
/// would stay until its instant: each time the heap has doubled since the
/// last look, those are dropped, so it never holds more than twice the
/// live timers (or 64).
fn push_timer(timers: &mut BinaryHeap<Reverse<Timer>>, prune_at: &mut usize, timer: Timer) {
    if timers.len() >= *prune_at {
        timers.retain(|t| !t.0.tx.is_closed());
        *prune_at = timers.len().saturating_mul(2).max(PRUNE_MIN);
    }
    timers.push(Reverse(timer));
}

struct Pacer<'a, K> {
    inner: &'a Inner<K>,
    inbox: Receiver<Msg>,
    /// Planned looks at each target; an entry is current only while it
    /// matches `planned`.
    plan: BinaryHeap<Reverse<(Nanos, Target)>>,
    planned: HashMap<Target, Nanos>,
    timers: BinaryHeap<Reverse<Timer>>,
    timer_seq: u64,
    /// The heap size at which withdrawn timers are next pruned.
    prune_at: usize,
    next_sweep: Nanos,
    lead: Lead,
    /// The latest departure (or timer) the pacer has released.
    released: Nanos,
    out: Vec<oneshot::Sender<()>>,
}

impl<'a, K: Hash + Eq> Pacer<'a, K> {
    fn new(inner: &'a Inner<K>, inbox: Receiver<Msg>) -> Pacer<'a, K> {
        Pacer {
            inner,
            inbox,
            plan: BinaryHeap::new(),
            planned: HashMap::new(),
            timers: BinaryHeap::new(),
            timer_seq: 0,
            prune_at: PRUNE_MIN,
            next_sweep: 0,
            lead: Lead::new(),
            released: 0,
            out: Vec::new(),
        }
    }

    fn plan(&mut self, target: Target, at: Nanos) {
        if self.planned.get(&target).is_none_or(|&p| at < p) {
            self.planned.insert(target, at);
            self.plan.push(Reverse((at, target)));
        }
    }

    /// The next instant something is due, if anything is.
    fn next_due(&mut self) -> Option<Nanos> {
        while let Some(&Reverse((at, target))) = self.plan.peek() {
            if self.planned.get(&target) == Some(&at) {
                break;
            }
            self.plan.pop();
        }
        let release = self.plan.peek().map(|r| r.0.0);
        let timer = self.timers.peek().map(|t| t.0.at);
        match (release, timer) {
            (Some(r), Some(t)) => Some(r.min(t)),
            (r, t) => r.or(t),
        }
    }

    /// Handle one message; false on stop.
    fn handle(&mut self, msg: Msg) -> bool {
        match msg {
            Msg::Wake(w) => self.plan(w.target, w.at),
            Msg::Cancel(ticket) => {
                // Dropping the payload is all a withdrawn waiter needs.
                let _ = self.inner.engine.cancel(ticket, self.inner.now());
            }
            Msg::Timer(at, tx) => {
                self.timer_seq += 1;
                let timer = Timer {
                    at,
                    seq: self.timer_seq,
                    tx,
                };
                push_timer(&mut self.timers, &mut self.prune_at, timer);
            }
            Msg::Ping(tx) => {
                let _ = tx.send(());
            }
            // The loop plans again after every message.
            Msg::Look => {}
            Msg::Stop => return false,
        }
        true
    }

    fn run(mut self) {
        loop {
            #[cfg(test)]
            self.inner
                .wakeups
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let now = self.inner.now();
            let due = self.next_due();
            // Idle client states are swept while any are held.
            // Idle client states are swept when the first may be forgotten,
            // at most once a period (an arrival that makes an earlier one
            // sends `Look`).
            let sweep = self
                .inner
                .engine
                .next_sweep()
                .map(|at| at.max(self.next_sweep));
            let wake = match (due, sweep) {
                (Some(d), Some(s)) => Some(d.min(s)),
                (d, s) => d.or(s),
            };
            let msg = match wake {
                None => self
                    .inbox
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) if due != Some(at) => {
                    // Sweeps are coarse: no lead, no spin.
                    self.inbox
                        .recv_deadline(self.inner.origin + Duration::from_nanos(at))
                }
                Some(at) => {
                    let lead = self.lead.before(at.saturating_sub(self.released));
                    if at > now.saturating_add(lead) {
                        let until = at - lead;
                        let slept = self
                            .inbox
                            .recv_deadline(self.inner.origin + Duration::from_nanos(until));
                        if let Err(RecvTimeoutError::Timeout) = slept {
                            self.lead.observe(self.inner.now().saturating_sub(until));
                        }
                        slept
                    } else {
                        self.spin_until(at)
                    }
                }
            };
            match msg {
                Ok(m) => {
                    if !self.handle(m) {
                        return;
                    }
                    // Take whatever else arrived in one go.
                    loop {
                        match self.inbox.try_recv() {
                            Ok(m) => {
                                if !self.handle(m) {
                                    return;
                                }
                            }
                            Err(TryRecvError::Empty) => break,
                            Err(TryRecvError::Disconnected) => return,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            self.release_due();
        }
    }

    /// Spin until `at`, still taking messages; a message ends the spin.
    fn spin_until(&self, at: Nanos) -> Result<Msg, RecvTimeoutError> {
        loop {
            match self.inbox.try_recv() {
                Ok(m) => return Ok(m),
                Err(TryRecvError::Disconnected) => return Err(RecvTimeoutError::Disconnected),
                Err(TryRecvError::Empty) => {}
            }
            if self.inner.now() >= at {
                return Err(RecvTimeoutError::Timeout);
            }
            std::hint::spin_loop();
        }
    }

    /// Release every target and timer due now, fire the oneshots (outside
    /// every engine lock), then sweep if it is time: a sweep of many idle
    /// clients does not delay the departures due with it.
    fn release_due(&mut self) {
        let now = self.inner.now();
        while let Some(&Reverse((at, target))) = self.plan.peek() {
            if at > now {
                break;
            }
            self.plan.pop();
            if self.planned.get(&target) != Some(&at) {
                continue;
            }
            self.planned.remove(&target);
            self.released = self.released.max(at);
            let before = self.out.len();
            let next = self.inner.engine.release(target, now, &mut self.out);
            if self.out.len() > before
                && let Some(observe) = self.inner.lag.get()
            {
                observe(Duration::from_nanos(now - at));
            }
            if let Some(next) = next {
                self.plan(target, next);
            }
        }
        while self.timers.peek().is_some_and(|t| t.0.at <= now) {
            if let Some(Reverse(t)) = self.timers.pop() {
                self.released = self.released.max(t.at);
                // A timer releases a request held for a shared departure
                // (cluster mode): its lag counts as a local release's does.
                if !t.tx.is_closed()
                    && let Some(observe) = self.inner.lag.get()
                {
                    observe(Duration::from_nanos(now - t.at));
                }
                self.out.push(t.tx);
            }
        }
        for tx in self.out.drain(..) {
            // The receiver may be gone (its client left just now): fine.
            let _ = tx.send(());
        }
        if self
            .inner
            .engine
            .sweep_at()
            .is_some_and(|at| now >= at.max(self.next_sweep))
        {
            self.inner.engine.expire(now);
            self.next_sweep = now.saturating_add(SWEEP);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        Admitted, BinaryHeap, Lead, Msg, Nanos, PRUNE_MIN, Shaper, Timer, oneshot, push_timer,
    };

    /// What the watchdog asks: the pacer thread answers while it runs, and
    /// not once it has stopped.
    #[tokio::test]
    async fn the_pacer_answers_only_while_it_runs() {
        let limits = crate::shaper::Limits {
            max_clients: 10,
            max_queued: 10,
        };
        let shaper: Shaper<u32> = Shaper::with_shards(limits, 1).unwrap_or_else(|e| panic!("{e}"));
        assert!(shaper.answers().await);
        // A request waiting an hour: the thread's end tells it.
        let up = shaper.add_upstream(None);
        let hourly = "1/h".parse().unwrap_or_else(|e| panic!("{e:?}"));
        let route = shaper.add_route(crate::shaper::Policy::new(hourly, 10), up);
        assert!(matches!(shaper.admit(route, 1, 1), Ok(Admitted::Now)));
        let Ok(Admitted::Wait(waiting)) = shaper.admit(route, 1, 1) else {
            panic!("the second of the hour did not wait");
        };
        // A timer an hour away (a cluster hold, a relay's start).
        let hour = 3_600_000_000_000;
        let timer = tokio::spawn({
            let shaper = shaper.clone();
            async move { shaper.sleep_until(shaper.now() + hour).await }
        });
        tokio::task::yield_now().await;
        let _ = shaper.inner.inbox.send(Msg::Stop);
        let told =
            tokio::time::timeout(std::time::Duration::from_secs(10), waiting.departed()).await;
        assert!(matches!(told, Ok(Err(_))), "the waiter was not told");
        // The timer says it was not released, rather than that its time
        // came (which let a held request depart at once).
        let timer = tokio::time::timeout(std::time::Duration::from_secs(10), timer).await;
        assert!(matches!(timer, Ok(Ok(false))), "{timer:?}");
        // One that queues after the thread's end is told at once too.
        while !shaper.ended() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let Ok(Admitted::Wait(later)) = shaper.admit(route, 1, 1) else {
            panic!("the later one did not wait");
        };
        let told = tokio::time::timeout(std::time::Duration::from_secs(10), later.departed()).await;
        assert!(matches!(told, Ok(Err(_))), "the later waiter was not told");
        let later = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            shaper.sleep_until(shaper.now() + hour),
        )
        .await;
        assert_eq!(later, Ok(false), "a later timer");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while shaper.answers().await {
            assert!(std::time::Instant::now() < deadline, "still answering");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert!(shaper.ended());
    }

    /// Clients that never wait send the pacer nothing; their states are
    /// forgotten once their schedule has passed all the same.
    #[test]
    fn clients_that_never_waited_are_forgotten() {
        let limits = crate::shaper::Limits {
            max_clients: 1000,
            max_queued: 10,
        };
        let shaper: Shaper<u32> = Shaper::with_shards(limits, 2).unwrap_or_else(|e| panic!("{e}"));
        let up = shaper.add_upstream(None);
        let rate = "100/s".parse().unwrap_or_else(|e| panic!("{e:?}"));
        let route = shaper.add_route(crate::shaper::Policy::new(rate, 10), up);
        // The pacer has nothing to do and sleeps.
        std::thread::sleep(std::time::Duration::from_millis(200));
        for key in 0..100 {
            assert!(matches!(shaper.admit(route, key, 1), Ok(Admitted::Now)));
        }
        assert_eq!(shaper.stats().0, 100);
        // Each may be forgotten 10 ms later; the sweep comes within its
        // period.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while shaper.stats().0 > 0 {
            assert!(std::time::Instant::now() < deadline, "never forgotten");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// A client state held for an hour, nothing waiting: the pacer sleeps
    /// until it may be forgotten (it woke every sweep period, 100 ms).
    #[test]
    fn a_pacer_with_nothing_due_sleeps() {
        let limits = crate::shaper::Limits {
            max_clients: 10,
            max_queued: 10,
        };
        let shaper: Shaper<u32> = Shaper::with_shards(limits, 2).unwrap_or_else(|e| panic!("{e}"));
        let up = shaper.add_upstream(None);
        let hourly = "1/h".parse().unwrap_or_else(|e| panic!("{e:?}"));
        let route = shaper.add_route(crate::shaper::Policy::new(hourly, 10), up);
        assert!(matches!(shaper.admit(route, 1, 1), Ok(Admitted::Now)));
        std::thread::sleep(std::time::Duration::from_millis(300));
        let wakeups = || {
            shaper
                .inner
                .wakeups
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        let before = wakeups();
        std::thread::sleep(std::time::Duration::from_secs(1));
        // (One: the wake-up the admission sent, if a loaded machine ran
        // the pacer only now; the period made ten.)
        assert!(wakeups() <= before + 1, "woke {} times", wakeups() - before);
        assert_eq!(shaper.stats().0, 1);
    }

    #[test]
    fn timers_of_waiters_that_left_do_not_pile_up() {
        let (mut timers, mut prune_at) = (BinaryHeap::new(), PRUNE_MIN);
        let mut live = Vec::new();
        for seq in 0..10_000u64 {
            let (tx, rx) = oneshot::channel();
            // One waiter in 100 stays; the others left (their receiver is
            // dropped) before their instant.
            if seq % 100 == 0 {
                live.push(rx);
            }
            let at = 1_000_000_000 + seq;
            push_timer(&mut timers, &mut prune_at, Timer { at, seq, tx });
        }
        assert!(
            timers.len() <= (2 * live.len()).max(PRUNE_MIN) + 1,
            "{} timers for {} live waiters",
            timers.len(),
            live.len()
        );
        let open = timers.iter().filter(|t| !t.0.tx.is_closed()).count();
        assert_eq!(open, live.len(), "every live waiter keeps its timer");
    }

    /// Oversleeps of 1..=100 µs, in a scrambled order that repeats.
    fn oversleeps(n: usize) -> impl Iterator<Item = u64> {
        (0..n).map(|i| ((i * 37) % 100 + 1) as u64 * 1_000)
    }

    #[test]
    fn the_lead_settles_at_the_p90_of_the_sleeps_plus_the_margin() {
        let mut lead = Lead::new();
        for late in oversleeps(10_000) {
            lead.observe(late);
        }
        // The p90 of 1..=100 µs is 90 µs; the tracker moves 1 µs down and 9
        // up, so it stays within a few steps of it.
        assert!(
            (80_000..=100_000).contains(&lead.p90),
            "estimate {} ns",
            lead.p90
        );
        assert_eq!(lead.before(Nanos::MAX), lead.p90 + Lead::MARGIN);
        // Departures 1 ms apart: at most half of it; 100 µs apart: the
        // shortest lead.
        assert_eq!(lead.before(1_000_000), lead.p90 + Lead::MARGIN);
        assert_eq!(lead.before(100_000), Lead::MIN);
    }

    #[test]
    fn one_stall_moves_the_lead_by_one_step_and_the_lead_is_bounded() {
        let mut lead = Lead::new();
        for late in oversleeps(2_000) {
            lead.observe(late);
        }
        let before = lead.before(Nanos::MAX);
        lead.observe(3_000_000);
        assert_eq!(lead.before(Nanos::MAX), before + 9 * Lead::STEP);
        for _ in 0..1_000 {
            lead.observe(3_000_000);
        }
        assert_eq!(lead.before(Nanos::MAX), Lead::MAX);
        assert_eq!(lead.before(200_000), 100_000);
        // And it comes back down once the stalls end.
        for late in oversleeps(10_000) {
            lead.observe(late);
        }
        let after = lead.before(Nanos::MAX);
        assert!(after <= 100_000 + Lead::MARGIN, "lead {after}");
    }
}
