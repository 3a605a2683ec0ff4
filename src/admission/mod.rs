//! The admission layer: one protocol-neutral decision for every front end.
//!
//! A front end (HTTP, SMTP) parses its protocol, derives a [`Key`] and a
//! cost, and asks [`Admission::admit`] with the [`Rule`] its route maps
//! to. The answer is one [`Verdict`]: go now, wait for a [`Hold`], refused
//! with a retry-after, or overloaded. Each front end maps that to its own
//! protocol in one place (HTTP: forward / 429 / 503; SMTP: relay / 451
//! 4.7.0 / 421 4.3.2).
//!
//! Behind it sit the local engine with its pacer and, in cluster mode, the
//! shared schedule (Redis) with its `on_failure` policy. Front ends reach
//! neither directly. The layer also owns what is the same for every
//! protocol: dry-run, `max_wait` while held under an upstream cap, the
//! queue-wait histogram, and the per-rule outcome counters.

mod budget;
mod key;
mod spacing;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use metrics::Counter;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::cluster::{Ask, Cluster, Reservation};
use crate::config::{ClusterConfig, OnFailure};
use crate::metrics::{self as m, Outcome};
use crate::pacer::{AcquireError, Admitted, LagObserver, Shaper, Waiting};
pub use crate::shaper::{ClientView, Limits, Nanos, Policy, Probe, Rate, Rejection};
use crate::shaper::{RouteId, UpstreamId};
pub use budget::{MIN_DATA_RATE, ReadDeadline, Room, StageBudget};
pub use key::{Key, KeyBuf, compose};
use spacing::Spacing;

/// Why the admission layer could not start.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("cannot start the pacer thread: {0}")]
    Pacer(std::io::Error),
    #[error("cluster: {0}")]
    Cluster(#[from] crate::cluster::ClusterError),
}

/// Which front end a rule serves (the `protocol` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Protocol {
    Http,
    Smtp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Http => "http",
            Protocol::Smtp => "smtp",
        }
    }
}

/// What a front end asks for when it builds its routes.
#[derive(Debug, Clone)]
pub struct RuleSpec<'a> {
    pub name: &'a str,
    pub protocol: Protocol,
    /// The upstream's name: routes sharing it share its cap.
    pub upstream: &'a str,
    /// The upstream's global cap, if any.
    pub cap: Option<Rate>,
    /// Whether the upstream may ask to be paused (`on_throttle = "pause"`).
    pub pausable: bool,
    pub policy: Policy,
    pub dry_run: bool,
}

/// A route as the admission layer knows it: engine ids, policy, and the
/// metric handles resolved once (nothing is allocated per request).
pub struct Rule {
    name: String,
    protocol: Protocol,
    local: RouteId,
    /// The local route used while the shared schedule fails with
    /// `on_failure = "local"` (rate r / instances).
    fallback: Option<RouteId>,
    policy: Policy,
    upstream: String,
    upstream_id: UpstreamId,
    cap_step: Option<Nanos>,
    /// Counts the upstream's pauses; registered (at 0) only when the rule
    /// may pause it, so the series exists before the first pause.
    pauses: Option<Counter>,
    dry_run: bool,
    outcomes: [Counter; Outcome::ALL.len()],
    arrivals: Counter,
    dry_run_refusals: Counter,
    queue_wait: Arc<m::Histogram>,
    totals: Arc<Totals>,
    /// Refusals since the last log summary.
    refused: AtomicU64,
}

impl Rule {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn protocol(&self) -> Protocol {
        self.protocol
    }

    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// Whether the upstream has a global cap.
    pub fn capped(&self) -> bool {
        self.cap_step.is_some()
    }

    /// Whether the upstream may be paused.
    pub fn pausable(&self) -> bool {
        self.pauses.is_some()
    }

    /// The upstream's name.
    pub fn upstream(&self) -> &str {
        &self.upstream
    }

    /// Count one request's outcome (metrics and `/status` totals).
    pub fn count(&self, outcome: Outcome) {
        self.outcomes[outcome as usize].increment(1);
        self.totals.add(outcome);
    }

    /// Count a request refused on its route before it reached admission
    /// (a missing key, a bad target): an arrival, and its outcome.
    pub fn count_unadmitted(&self, outcome: Outcome) {
        self.arrivals.increment(1);
        self.count(outcome);
    }

    /// Refusals since the last call (for one log line per interval).
    pub fn take_refused(&self) -> u64 {
        self.refused.swap(0, Ordering::Relaxed)
    }

    fn refuse(&self, outcome: Outcome) {
        self.refused.fetch_add(1, Ordering::Relaxed);
        self.count(outcome);
    }
}

/// Why a request was refused with a retry-after (HTTP 429, SMTP 451).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// The client's queue is full.
    Full,
    /// The departure would come later than arrival + `max_wait`.
    MaxWait,
}

/// Why a request was refused for the instance's own sake (HTTP 503, SMTP
/// 421 4.3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overload {
    /// `max_clients` client states are held.
    Clients,
    /// `max_queued` requests are waiting.
    Queued,
    /// The shared schedule is unreachable and `on_failure = "reject"`.
    Backend,
}

/// The one answer to an arrival.
pub enum Verdict {
    /// Depart now.
    Go,
    /// Wait: await [`Hold::departed`]; dropping the hold withdraws it.
    Wait(Hold),
    /// Refused; retry after the given time (at least 1 s when shown).
    Refused { why: Refusal, retry_after: Duration },
    /// Refused because the instance is at a global bound.
    Overloaded(Overload),
}

/// Why a held request did not depart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HoldError {
    /// Shutting down: the drain timeout passed while it waited.
    #[error("shutting down")]
    Closed,
    /// Still waiting when `max_wait` passed (under an upstream cap).
    #[error("still queued after max_wait")]
    Expired,
}

/// A request waiting for its departure. Dropping it (the client went away)
/// withdraws it, gives its slot to the next in line, and counts it as
/// cancelled.
pub struct Hold {
    rule: Arc<Rule>,
    kind: Option<HoldKind>,
    arrival: Instant,
    /// When a request still waiting expires (`max_wait` under a cap).
    expiry: Expiry,
    closing: CancellationToken,
}

/// A held request's `max_wait` deadline. Its timer is made by the first
/// poll that needs one: most holds never expire, and a waiting request
/// carries only this (BENCHMARKS.md, "Memory per held request").
enum Expiry {
    Never,
    At(Instant),
    Armed(Pin<Box<tokio::time::Sleep>>),
}

impl Expiry {
    fn new(at: Option<Instant>) -> Expiry {
        at.map_or(Expiry::Never, Expiry::At)
    }

    /// Ready once the deadline has passed.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self {
            Expiry::Never => Poll::Pending,
            Expiry::At(at) => {
                let mut timer = Box::pin(tokio::time::sleep_until((*at).into()));
                let passed = timer.as_mut().poll(cx);
                *self = Expiry::Armed(timer);
                passed
            }
            Expiry::Armed(timer) => timer.as_mut().poll(cx),
        }
    }
}

enum HoldKind {
    Local(Waiting),
    /// Boxed: cluster holds are the rarer kind, and every held request
    /// carries the enum.
    Shared(Box<SharedHold>),
}

/// A request held by our pacer for the departure the shared schedule gave,
/// past it while the upstream is paused, and c·T/2 after the client's
/// previous release when the pacer ran late.
struct SharedHold {
    at: Nanos,
    /// The departure the shared schedule gave (`at` before any pause or
    /// spacing moved it).
    slot: Nanos,
    /// Set when the upstream may be paused.
    pausable: Option<UpstreamId>,
    /// The client, its c·T/2, and when it was given a later release.
    client: (RouteId, Key),
    half: Nanos,
    spacing: Arc<Spacing<(RouteId, Key)>>,
    /// The later release spacing gave it, kept until it departs (given
    /// back if it leaves before: it spaces nothing after it then).
    spaced: Option<spacing::Taken<(RouteId, Key)>>,
    shaper: Shaper<Key>,
    cluster: Arc<Cluster>,
    reservation: Option<Reservation>,
    /// The pacer's timer for `at`, or the drain's end (false); made by the
    /// first poll.
    woken: Option<Pin<Box<dyn Future<Output = bool> + Send + Sync>>>,
    /// Counts it among its client's requests held here (pausable
    /// upstreams), while it lives.
    _held: Option<Held>,
}

/// Requests held for a shared departure to a pausable upstream, by client
/// (cost units): what an upstream's pause, which the store does not know
/// of, holds here.
#[derive(Default)]
struct HeldCounts(Mutex<HashMap<(RouteId, Key), u64>>);

impl HeldCounts {
    /// Count `cost` more for `client`, unless `full` applies and the
    /// client already has `capacity` held (then `None`).
    fn take(
        self: &Arc<Self>,
        client: (RouteId, Key),
        cost: u32,
        capacity: u32,
        full: bool,
    ) -> Option<Held> {
        let mut counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let held = counts.entry(client.clone()).or_insert(0);
        if full && *held + u64::from(cost) > u64::from(capacity) {
            if *held == 0 {
                counts.remove(&client);
            }
            return None;
        }
        *held += u64::from(cost);
        Some(Held {
            counts: self.clone(),
            client,
            cost: u64::from(cost),
        })
    }
}

/// One request's count in [`HeldCounts`], given back when dropped.
struct Held {
    counts: Arc<HeldCounts>,
    client: (RouteId, Key),
    cost: u64,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut counts = self.counts.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(held) = counts.get_mut(&self.client) {
            *held = held.saturating_sub(self.cost);
            if *held == 0 {
                counts.remove(&self.client);
            }
        }
    }
}

impl SharedHold {
    fn poll_departed(&mut self, closing: &CancellationToken, cx: &mut Context<'_>) -> Poll<bool> {
        loop {
            let (at, shaper) = (self.at, &self.shaper);
            let woken = self.woken.get_or_insert_with(|| {
                let (shaper, closing) = (shaper.clone(), closing.clone());
                Box::pin(async move {
                    tokio::select! {
                        // (false when the pacer thread ended: nothing
                        // departs then, as local waiters do not.)
                        released = shaper.sleep_until(at) => released,
                        () = closing.cancelled() => false,
                    }
                })
            });
            if !ready!(woken.as_mut().poll(cx)) {
                return Poll::Ready(false);
            }
            // The store knows nothing of a pause this instance was asked
            // for: it holds shared departures here, as local ones.
            if let Some(until) = self.pausable.and_then(|u| self.shaper.paused_until(u)) {
                self.at = until;
                self.woken = None;
                continue;
            }
            if self.spaced.as_ref().is_some_and(|t| t.at() == self.at) {
                return Poll::Ready(true);
            }
            // (One taken before a pause moved `at` is taken again.)
            if let Some(old) = self.spaced.take() {
                self.spacing.give_back(old);
            }
            let now = self.shaper.now();
            let release = self
                .spacing
                .release(&self.client, now, self.slot, self.half);
            if release.at() <= now {
                return Poll::Ready(true);
            }
            self.at = release.at();
            self.spaced = Some(release);
            self.woken = None;
        }
    }
}

impl Hold {
    /// When the request is expected to depart (a lower bound under an
    /// upstream cap).
    pub fn departure(&self) -> Option<Instant> {
        match self.kind.as_ref()? {
            HoldKind::Local(w) => Some(w.departure()),
            HoldKind::Shared(s) => Some(s.shaper.instant(s.at)),
        }
    }

    /// Resolve when the request may depart. Dropping the future before
    /// it resolves withdraws the request (and counts it as cancelled).
    pub fn departed(mut self) -> impl Future<Output = Result<(), HoldError>> + Send {
        std::future::poll_fn(move |cx| self.poll_wait(cx))
    }

    /// Withdraw the request for a reason the front end counts itself (a
    /// body it refused): not counted as cancelled.
    pub fn withdraw(mut self) {
        // Dropping the waiter (or the shared reservation) is the withdrawal.
        let _ = self.kind.take().map(|k| self.release(k));
    }

    fn release(&self, kind: HoldKind) {
        match kind {
            HoldKind::Local(waiting) => drop(waiting),
            HoldKind::Shared(s) => {
                let SharedHold {
                    shaper,
                    cluster,
                    reservation,
                    spacing,
                    spaced,
                    ..
                } = *s;
                // A later release it never made spaces nothing after it.
                if let Some(taken) = spaced {
                    spacing.give_back(taken);
                }
                // (The give-back first: once the place shows as free here,
                // no refusal of the client is remembered.)
                if let Some(r) = reservation {
                    cluster.cancel(r);
                }
                shaper.budget().give_queued();
            }
        }
    }

    /// As [`Hold::departed`], keeping the hold: dropping it before this
    /// resolves still withdraws the request.
    pub fn wait(&mut self) -> impl Future<Output = Result<(), HoldError>> + Send + '_ {
        std::future::poll_fn(move |cx| self.poll_wait(cx))
    }

    /// As [`Hold::wait`] for a hold from [`Admission::admit_again`]: its
    /// wait and its end are not counted.
    pub fn wait_again(&mut self) -> impl Future<Output = Result<(), HoldError>> + Send + '_ {
        std::future::poll_fn(move |cx| self.poll_settled(cx, Count::No))
    }

    /// Ready when the request may depart, or may not (the drain ended, or
    /// `max_wait` passed). Polled in place, with no future of its own: a
    /// held request's whole state is what it carries while it waits.
    pub fn poll_wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), HoldError>> {
        self.poll_settled(cx, Count::Yes)
    }

    fn poll_settled(&mut self, cx: &mut Context<'_>, count: Count) -> Poll<Result<(), HoldError>> {
        let result = match self.kind.as_mut() {
            None => Ok(()),
            Some(HoldKind::Shared(s)) => match s.poll_departed(&self.closing, cx) {
                Poll::Ready(true) => Ok(()),
                Poll::Ready(false) => Err(HoldError::Closed),
                Poll::Pending => {
                    ready!(self.expiry.poll(cx));
                    Err(HoldError::Expired)
                }
            },
            Some(HoldKind::Local(waiting)) => match waiting.poll_wait(cx) {
                Poll::Ready(Ok(())) => Ok(()),
                Poll::Ready(Err(AcquireError::Closed)) => Err(HoldError::Closed),
                Poll::Ready(Err(AcquireError::Rejected(_))) => Err(HoldError::Expired),
                Poll::Pending => {
                    ready!(self.expiry.poll(cx));
                    Err(HoldError::Expired)
                }
            },
        };
        // Settled: dropping the hold now withdraws nothing. One that does
        // not depart is withdrawn here (an expired local waiter still holds
        // its ticket; a shared one its reservation).
        match self.kind.take() {
            Some(kind) if result.is_err() => self.release(kind),
            kind => {
                self.kind = kind;
                self.settle();
            }
        }
        match result {
            _ if count == Count::No => {}
            Ok(()) => self.rule.queue_wait.record(self.arrival.elapsed()),
            Err(_) => self.rule.count(Outcome::Expired),
        }
        Poll::Ready(result)
    }

    /// Stop waiting without withdrawing (dry run): the request keeps its
    /// place in the schedule and is forwarded at once.
    pub fn detach(mut self) {
        match self.kind.take() {
            Some(HoldKind::Local(w)) => w.detach(),
            // The shared schedule keeps the reservation; the room taken in
            // max_queued is given back, since nothing waits here.
            Some(HoldKind::Shared(s)) => s.shaper.budget().give_queued(),
            None => {}
        }
    }

    /// The wait is over: nothing is counted as cancelled on drop. A local
    /// waiter that did not depart (max_wait passed) is withdrawn.
    fn settle(&mut self) {
        match self.kind.take() {
            Some(HoldKind::Shared(s)) => s.shaper.budget().give_queued(),
            Some(HoldKind::Local(waiting)) => drop(waiting),
            None => {}
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(kind) = self.kind.take() {
            self.rule.count(Outcome::Cancelled);
            // Dropping the waiter sends the pacer its cancellation.
            self.release(kind);
        }
    }
}

/// Whether an admission is counted (an arrival's), or not (a request
/// admitted again after its upstream throttled it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Count {
    Yes,
    No,
}

/// Outcome totals, for `/status`.
#[derive(Default)]
pub struct Totals([AtomicU64; Outcome::ALL.len()]);

impl Totals {
    pub fn add(&self, o: Outcome) {
        self.0[o as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, o: Outcome) -> u64 {
        self.0[o as usize].load(Ordering::Relaxed)
    }
}

/// Engine ids by name, kept across reloads so that a route that still
/// exists keeps its queues.
#[derive(Default)]
struct Registry {
    routes: HashMap<(Protocol, String, UpstreamId), RouteId>,
    /// Upstreams by (protocol, name, gated): whether an upstream has a cap
    /// (a rate, or pausing) is fixed for its id, so adding or removing one
    /// makes a new one.
    upstreams: HashMap<(Protocol, String, bool), UpstreamId>,
}

/// A line of starts kept apart by [`Admission::space_relay`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Start {
    Client(RouteId, Key),
    Upstream(UpstreamId),
}

/// A start taken by [`Admission::space_relay`], given back when dropped
/// still holding it.
struct GiveBack<'a>(&'a Spacing<Start>, Option<spacing::Taken<Start>>);

impl Drop for GiveBack<'_> {
    fn drop(&mut self) {
        if let Some(taken) = self.1.take() {
            self.0.give_back(taken);
        }
    }
}

/// The admission layer: local engine and pacer, and the shared schedule in
/// cluster mode.
pub struct Admission {
    shaper: Shaper<Key>,
    cluster: Option<Arc<Cluster>>,
    registry: Mutex<Registry>,
    totals: Arc<Totals>,
    /// Cancelled when the drain gives up: every hold ends with `Closed`.
    closing: CancellationToken,
    /// Shared releases' late-release spacing.
    spacing: Arc<Spacing<(RouteId, Key)>>,
    /// Shared holds to pausable upstreams, by client.
    held: Arc<HeldCounts>,
    /// The same for work a front end starts after its departure (an SMTP
    /// relay, once the message's data is in), by client and by capped
    /// upstream.
    relays: Spacing<Start>,
}

impl Admission {
    /// Start the pacer and, with `cluster`, the shared-schedule client.
    pub fn start(
        limits: Limits,
        cluster: Option<&ClusterConfig>,
    ) -> Result<Admission, AdmissionError> {
        let shaper = Shaper::start(limits).map_err(AdmissionError::Pacer)?;
        let observe: LagObserver = Box::new({
            let lag = m::histogram(m::RELEASE_LAG_SECONDS, &[]);
            move |d| lag.record(d)
        });
        shaper.observe_lag(observe);
        let cluster = match cluster {
            Some(c) => Some(Arc::new(Cluster::new(c)?)),
            None => None,
        };
        Ok(Admission {
            shaper,
            cluster,
            registry: Mutex::default(),
            totals: Arc::default(),
            closing: CancellationToken::new(),
            spacing: Arc::default(),
            held: Arc::default(),
            relays: Spacing::default(),
        })
    }

    /// Build rules for a config, reusing engine ids for routes and
    /// upstreams that keep their name (and, for routes, their upstream).
    pub fn rules(&self, specs: &[RuleSpec<'_>]) -> Vec<Arc<Rule>> {
        let mut registry = self.registry.lock().unwrap_or_else(|e| e.into_inner());
        specs
            .iter()
            .map(|spec| Arc::new(self.rule(&mut registry, spec)))
            .collect()
    }

    fn rule(&self, registry: &mut Registry, spec: &RuleSpec<'_>) -> Rule {
        let gated = spec.cap.is_some() || spec.pausable;
        let up_key = (spec.protocol, spec.upstream.to_owned(), gated);
        // In cluster mode the store keeps the cap R for the fleet, and the
        // engine's gate serves only the routes that fall back (`on_failure
        // = "local"`): it holds this instance's share, R / instances, as
        // their rate is r / instances.
        let cap = match &self.cluster {
            Some(c) => spec.cap.map(|r| r.share(c.instances)),
            None => spec.cap,
        };
        let upstream = match registry.upstreams.get(&up_key) {
            Some(&id) => {
                if gated {
                    self.shaper.set_upstream_rate(id, cap);
                }
                id
            }
            None => {
                let id = self.shaper.add_gated_upstream(cap, spec.pausable);
                registry.upstreams.insert(up_key, id);
                id
            }
        };
        let mut route = |name: String, policy: Policy| {
            let key = (spec.protocol, name, upstream);
            match registry.routes.get(&key) {
                Some(&id) => {
                    self.shaper.set_policy(id, policy);
                    id
                }
                None => {
                    let id = self.shaper.add_route(policy, upstream);
                    registry.routes.insert(key, id);
                    id
                }
            }
        };
        let local = route(spec.name.to_owned(), spec.policy);
        let fallback = self.cluster.as_ref().map(|c| {
            let policy = Policy {
                rate: spec.policy.rate.share(c.instances),
                ..spec.policy
            };
            route(format!("{}\0local", spec.name), policy)
        });
        let (name, protocol) = (spec.name.to_owned(), spec.protocol.as_str());
        let outcomes = Outcome::ALL.map(|o| {
            metrics::counter!(m::REQUESTS_TOTAL, "route" => name.clone(), "protocol" => protocol, "outcome" => o.as_str())
        });
        Rule {
            name: spec.name.to_owned(),
            protocol: spec.protocol,
            local,
            fallback,
            policy: spec.policy,
            upstream: spec.upstream.to_owned(),
            upstream_id: upstream,
            cap_step: spec.cap.map(Rate::interval_nanos),
            pauses: spec.pausable.then(|| {
                metrics::counter!(m::UPSTREAM_PAUSES_TOTAL, "upstream" => spec.upstream.to_owned(), "protocol" => protocol)
            }),
            dry_run: spec.dry_run,
            outcomes,
            arrivals: metrics::counter!(m::ARRIVALS_TOTAL, "route" => name.clone(), "protocol" => protocol),
            dry_run_refusals: metrics::counter!(m::DRY_RUN_REFUSALS_TOTAL, "route" => name.clone(), "protocol" => protocol),
            queue_wait: m::histogram(
                m::QUEUE_WAIT_SECONDS,
                &[("route", spec.name), ("protocol", protocol)],
            ),
            totals: self.totals.clone(),
            refused: AtomicU64::new(0),
        }
    }

    /// Decide an arrival of `cost` for `key` under `rule`, which came at
    /// `arrival` (a clock read the front end made anyway).
    pub async fn admit(&self, rule: &Arc<Rule>, key: Key, cost: u32, arrival: Instant) -> Verdict {
        rule.arrivals.increment(1);
        self.decide(rule, key, cost, arrival, Count::Yes).await
    }

    /// Admit once more a request already admitted and sent (its upstream
    /// throttled it), at `now`: not a second arrival, and its refusal or
    /// its wait's end is not counted (its one outcome is the front end's
    /// to count). Wait with [`Hold::wait_again`].
    pub async fn admit_again(
        &self,
        rule: &Arc<Rule>,
        key: Key,
        cost: u32,
        now: Instant,
    ) -> Verdict {
        self.decide(rule, key, cost, now, Count::No).await
    }

    async fn decide(
        &self,
        rule: &Arc<Rule>,
        key: Key,
        cost: u32,
        arrival: Instant,
        count: Count,
    ) -> Verdict {
        let (mut local, mut at) = (rule.local, arrival);
        if let Some(cluster) = &self.cluster {
            // Boxed: the shared store's round trip is a large future that
            // a local admission need not carry.
            match Box::pin(self.admit_shared(cluster, rule, &key, cost, arrival, count)).await {
                Shared::Decided(v) => return v,
                // Decided here, now: the arrival is as old as the failed
                // call (up to `timeout`), and two requests admitted at
                // their arrivals after it could depart together.
                Shared::Local => {
                    (local, at) = (rule.fallback.unwrap_or(rule.local), Instant::now());
                }
            }
        }
        self.admit_local(rule, local, key, cost, (arrival, at), count)
    }

    /// [`Admission::admit`] with no future at all when no shared store is
    /// asked: the verdict, or `None` in cluster mode (then use `admit`).
    /// For a front end whose waiting state is what a held request costs.
    pub fn admit_now(
        &self,
        rule: &Arc<Rule>,
        key: Key,
        cost: u32,
        arrival: Instant,
    ) -> Option<Verdict> {
        self.cluster.is_none().then(|| {
            rule.arrivals.increment(1);
            self.admit_local(rule, rule.local, key, cost, (arrival, arrival), Count::Yes)
        })
    }

    /// The local engine's verdict, under the engine route `local`, for a
    /// request that arrived at `arrival` (its wait and `max_wait` count
    /// from then) and is decided as of `at` (later after a failed call to
    /// the shared store).
    fn admit_local(
        &self,
        rule: &Arc<Rule>,
        local: RouteId,
        key: Key,
        cost: u32,
        (arrival, at): (Instant, Instant),
        count: Count,
    ) -> Verdict {
        let verdict = match self.shaper.admit_at(local, key, cost, at) {
            Ok(Admitted::Now) => Verdict::Go,
            Ok(Admitted::Wait(waiting)) => Verdict::Wait(Hold {
                rule: rule.clone(),
                kind: Some(HoldKind::Local(waiting)),
                arrival,
                // Under an upstream cap or pause the departure is only a
                // lower bound at admission: max_wait is also enforced while
                // waiting.
                expiry: Expiry::new(
                    rule.policy
                        .max_wait
                        .filter(|_| rule.capped() || rule.pausable())
                        .map(|w| arrival + Duration::from_nanos(w)),
                ),
                closing: self.closing.clone(),
            }),
            Err(Rejection::Full { retry_after }) => Verdict::Refused {
                why: Refusal::Full,
                retry_after: Duration::from_nanos(retry_after),
            },
            Err(Rejection::MaxWait { retry_after }) => Verdict::Refused {
                why: Refusal::MaxWait,
                retry_after: Duration::from_nanos(retry_after),
            },
            Err(Rejection::TooManyClients) => Verdict::Overloaded(Overload::Clients),
            Err(Rejection::TooManyQueued) => Verdict::Overloaded(Overload::Queued),
        };
        self.settle(rule, verdict, Duration::ZERO, count)
    }

    /// Count a verdict (unless told not to), and apply dry-run: decide and
    /// count, go anyway.
    fn settle(&self, rule: &Arc<Rule>, verdict: Verdict, wait: Duration, count: Count) -> Verdict {
        let count = count == Count::Yes;
        match verdict {
            Verdict::Go => {
                // Departed on arrival (or after a shared-schedule round
                // trip, which is what it waited).
                if count {
                    rule.queue_wait.record(wait);
                }
                Verdict::Go
            }
            Verdict::Wait(hold) if rule.dry_run => {
                hold.detach();
                Verdict::Go
            }
            Verdict::Refused { .. } | Verdict::Overloaded(_) if rule.dry_run => {
                if count {
                    rule.refused.fetch_add(1, Ordering::Relaxed);
                    rule.dry_run_refusals.increment(1);
                    debug!(route = %rule.name, "dry run: would have refused");
                }
                Verdict::Go
            }
            Verdict::Refused { why, retry_after } => {
                if count {
                    rule.refuse(Outcome::Rejected);
                }
                Verdict::Refused { why, retry_after }
            }
            Verdict::Overloaded(o) => {
                if count {
                    rule.refuse(Outcome::Overloaded);
                }
                Verdict::Overloaded(o)
            }
            wait @ Verdict::Wait(_) => wait,
        }
    }

    /// Cluster mode: one round trip to the shared schedule decides; a
    /// request that must wait is held by our own pacer until its
    /// departure. When the backend fails, `on_failure` decides.
    async fn admit_shared(
        &self,
        cluster: &Arc<Cluster>,
        rule: &Arc<Rule>,
        key: &Key,
        cost: u32,
        arrival: Instant,
        count: Count,
    ) -> Shared {
        let us = |ns: u64| ns / 1_000;
        let step = rule.policy.rate.interval_nanos();
        let (k, slots) = cluster.keys(
            &rule.name,
            key.as_bytes(),
            rule.cap_step
                .map(|step| (rule.upstream.as_str(), spacing_us(step))),
        );
        let ask = Ask {
            key: k,
            slots,
            step_us: spacing_us(step),
            capacity: rule.policy.capacity,
            cost,
            tau_us: us(u64::from(rule.policy.burst.saturating_sub(1)).saturating_mul(step)),
            slot_us: rule.cap_step.map_or(0, spacing_us),
            max_wait_us: rule.policy.max_wait.map_or(0, us),
        };
        let verdict = match cluster.admit(ask).await {
            Ok(crate::cluster::Verdict::Go { delay, reservation }) => {
                let pausable = rule.pausable().then_some(rule.upstream_id);
                let paused = pausable.and_then(|u| self.shaper.paused_until(u));
                let max_wait = rule.policy.max_wait.map(Duration::from_nanos);
                let resumes = paused.map(|until| self.shaper.instant(until));
                if let (Some(resumes), Some(max_wait)) = (resumes, max_wait)
                    && resumes > arrival + max_wait
                {
                    // As a local admission: refused when the pause alone
                    // outlasts max_wait.
                    cluster.cancel(reservation);
                    Verdict::Refused {
                        why: Refusal::MaxWait,
                        retry_after: resumes.saturating_duration_since(Instant::now()),
                    }
                } else if delay.is_zero()
                    && paused.is_none()
                    && !self
                        .spacing
                        .holds_back(&(rule.local, key.clone()), self.shaper.now())
                {
                    // (A client whose held requests are catching up after
                    // a stall keeps its c·T/2 from them: a request the
                    // store lets go at once waits its turn as they do.)
                    Verdict::Go
                } else {
                    'hold: {
                        // The store counts the client's requests as departing
                        // on time while this instance's pause holds them: as
                        // a local admission, one that finds `capacity` held
                        // here is refused until the pause ends.
                        let held = match pausable.map(|_| {
                            let client = (rule.local, key.clone());
                            let capacity = rule.policy.capacity;
                            self.held.take(client, cost, capacity, paused.is_some())
                        }) {
                            Some(None) => {
                                cluster.cancel(reservation);
                                let now = Instant::now();
                                break 'hold Verdict::Refused {
                                    why: Refusal::Full,
                                    retry_after: resumes.map_or(Duration::ZERO, |r| {
                                        r.saturating_duration_since(now)
                                    }),
                                };
                            }
                            held => held.flatten(),
                        };
                        if !self.shaper.budget().take_queued() {
                            cluster.cancel(reservation);
                            break 'hold Verdict::Overloaded(Overload::Queued);
                        }
                        let at = self
                            .shaper
                            .now()
                            .saturating_add(u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX));
                        Verdict::Wait(Hold {
                            rule: rule.clone(),
                            kind: Some(HoldKind::Shared(Box::new(SharedHold {
                                at,
                                slot: at,
                                pausable,
                                client: (rule.local, key.clone()),
                                half: step.saturating_mul(u64::from(cost)) / 2,
                                spacing: self.spacing.clone(),
                                spaced: None,
                                shaper: self.shaper.clone(),
                                cluster: cluster.clone(),
                                reservation: Some(reservation),
                                woken: None,
                                _held: held,
                            }))),
                            arrival,
                            // A pause may hold it past its departure.
                            expiry: Expiry::new(pausable.and(max_wait).map(|w| arrival + w)),
                            closing: self.closing.clone(),
                        })
                    }
                }
            }
            Ok(crate::cluster::Verdict::Full { retry_after }) => Verdict::Refused {
                why: Refusal::Full,
                retry_after,
            },
            Ok(crate::cluster::Verdict::MaxWait { retry_after }) => Verdict::Refused {
                why: Refusal::MaxWait,
                retry_after,
            },
            Err(e) => {
                let policy = cluster.on_failure;
                debug!(error = %e, ?policy, "shared schedule failed; applying on_failure");
                metrics::counter!(m::CLUSTER_FALLBACKS_TOTAL, "backend" => cluster.backend(), "policy" => policy.as_str())
                    .increment(1);
                match policy {
                    OnFailure::Local => return Shared::Local,
                    OnFailure::Allow => Verdict::Go,
                    OnFailure::Reject => Verdict::Overloaded(Overload::Backend),
                }
            }
        };
        Shared::Decided(self.settle(rule, verdict, arrival.elapsed(), count))
    }

    /// Resolves when work of `cost` for `key` that departed under `rule`
    /// at `slot` may start: at once, unless
    /// - the client's previous start is less than c·T/2 behind (a start
    ///   made late, after its slot, would otherwise be followed at once by
    ///   the next one on time), or less than their slots were apart when
    ///   those were closer (a `burst`);
    /// - under an upstream cap R, the upstream's previous start is less
    ///   than c/(2R) behind: starts made late, each after its own slot,
    ///   would otherwise reach the upstream together;
    /// - the upstream is paused (it asked for it after this work's
    ///   departure, or while it waited): the start waits for the end.
    ///
    /// `false` (at once, or when a pause is made longer) when the start
    /// would come after `latest`: the work must not start. A start that
    /// does not come (`false`, or the future dropped before it resolves)
    /// holds no later one back.
    pub async fn space_relay(
        &self,
        rule: &Rule,
        key: &Key,
        cost: u32,
        slot: Instant,
        latest: Instant,
    ) -> bool {
        let half = |step: Nanos| step.saturating_mul(u64::from(cost)) / 2;
        let now = self.shaper.now();
        let client = Start::Client(rule.local, key.clone());
        let own = (
            &client,
            Some(self.on_axis(slot, now)),
            half(rule.policy.rate.interval_nanos()),
        );
        let from = self.shaper.paused_until(rule.upstream_id).unwrap_or(now);
        // The cap released held work 1/R apart, whenever its own start
        // came: on the upstream's line every start keeps c/(2R).
        let upstream = Start::Upstream(rule.upstream_id);
        let latest = self.on_axis(latest, now);
        let taken = match rule.cap_step {
            Some(step) => {
                let line = (&upstream, None, half(step));
                self.relays.take_all(&[own, line], from, now, latest)
            }
            None => self.relays.take_all(&[own], from, now, latest),
        };
        let Some(taken) = taken else {
            return false;
        };
        // Given back unless the work starts: a start that never came
        // (the client left while it waited, or a pause outlasted
        // `latest`) spaces nothing after it.
        let start = taken.at();
        let mut taken = GiveBack(&self.relays, Some(taken));
        // (A pacer thread that ended releases nothing: no start.)
        if start > now && !self.shaper.sleep_until(start).await {
            return false;
        }
        while let Some(until) = self.shaper.paused_until(rule.upstream_id) {
            if until > latest || !self.shaper.sleep_until(until).await {
                return false;
            }
        }
        taken.1 = None;
        true
    }

    /// `t` on the engine's time axis, whose present is `now`.
    fn on_axis(&self, t: Instant, now: Nanos) -> Nanos {
        let here = Instant::now();
        let nanos = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        match t.checked_duration_since(here) {
            Some(ahead) => now.saturating_add(nanos(ahead)),
            None => now.saturating_sub(nanos(here.duration_since(t))),
        }
    }

    /// The upstream asked for a pause (a 429 or 503 with a retry time):
    /// hold every release to the rule's upstream until `until`. Counted;
    /// false when the upstream is not pausable.
    pub fn pause(&self, rule: &Rule, until: Instant) -> bool {
        let at = self.shaper.now().saturating_add(
            u64::try_from(until.saturating_duration_since(Instant::now()).as_nanos())
                .unwrap_or(u64::MAX),
        );
        let Some(pauses) = &rule.pauses else {
            return false;
        };
        let paused = self.shaper.pause(rule.upstream_id, at);
        if paused {
            pauses.increment(1);
        }
        paused
    }

    /// How long releases to the rule's upstream stay paused, if they are.
    pub fn paused_for(&self, rule: &Rule) -> Option<Duration> {
        let until = self.shaper.paused_until(rule.upstream_id)?;
        Some(Duration::from_nanos(
            until.saturating_sub(self.shaper.now()),
        ))
    }

    /// Look at one client of a rule without changing anything.
    pub fn view(&self, rule: &Rule, key: &Key) -> Option<ClientView> {
        self.shaper.view(rule.local, key)
    }

    /// What an arrival would be answered now, without changing anything.
    pub fn probe(&self, rule: &Rule, key: &Key, cost: u32) -> Probe {
        self.shaper.probe(rule.local, key, cost)
    }

    /// The `n` deepest local queues, deepest first, with their rule's
    /// engine route (see [`Admission::rule_of`]).
    pub fn deepest(&self, n: usize) -> Vec<(RouteId, Key, ClientView)> {
        self.shaper.deepest(n)
    }

    /// Whether `id` (from [`Admission::deepest`]) is `rule`'s route.
    pub fn is_rule_route(&self, rule: &Rule, id: RouteId) -> bool {
        rule.local == id || rule.fallback == Some(id)
    }

    /// The engine's clock, in nanoseconds.
    pub fn now(&self) -> Nanos {
        self.shaper.now()
    }

    /// Client states held and requests waiting (held ones included).
    pub fn stats(&self) -> (usize, usize) {
        self.shaper.stats()
    }

    /// Outcome totals since start.
    pub fn totals(&self) -> &Totals {
        &self.totals
    }

    /// The global bounds on clients and queued requests.
    pub fn limits(&self) -> Limits {
        self.shaper.budget().limits()
    }

    /// Change the global bounds on clients and queued requests.
    pub fn set_limits(&self, limits: Limits) {
        self.shaper.set_limits(limits);
    }

    /// Room for one more waiting request outside the engine (a request
    /// released and waiting for an upstream's in-flight slot), counted
    /// against `max_queued`; `None` when there is none.
    pub fn reserve_wait(&self) -> Option<WaitSlot> {
        self.shaper.budget().take_queued().then(|| WaitSlot {
            shaper: self.shaper.clone(),
        })
    }

    /// Whether the pacer thread is alive and taking messages.
    pub async fn pacer_answers(&self) -> bool {
        self.shaper.answers().await
    }

    /// Cancelled when the drain gives up: whatever still waits ends.
    pub fn closing(&self) -> &CancellationToken {
        &self.closing
    }

    /// Answer every waiting request "shutting down" (the drain timed out).
    pub fn close_waiting(&self) -> usize {
        self.closing.cancel();
        self.shaper.close_waiting()
    }

    /// The shared schedule's state: `None` outside cluster mode.
    pub fn backend_healthy(&self) -> Option<bool> {
        self.cluster.as_ref().map(|c| c.is_healthy())
    }

    /// The shared schedule's store ("redis", "postgres"): `None` outside
    /// cluster mode.
    pub fn backend(&self) -> Option<&'static str> {
        self.cluster.as_ref().map(|c| c.backend())
    }

    /// Why the instance should not get traffic because of the shared
    /// schedule: it is not usable as configured (a standalone client
    /// pointed at a cluster node), or it is down (or part of it is) while
    /// `on_failure = "reject"`. With `local` or `allow` an instance whose
    /// store is down still serves, as configured.
    pub fn backend_not_ready(&self) -> Option<String> {
        if self.shaper.ended() {
            return Some("the pacer thread has stopped: nothing is released".to_owned());
        }
        let cluster = self.cluster.as_ref()?;
        if let Some(why) = cluster.misconfigured() {
            return Some(why);
        }
        // Part of it down: the calls of its clients fail in a row when
        // they alone come, and every instance unready would fail everyone.
        if cluster.on_failure != OnFailure::Reject || cluster.partly_down() {
            return None;
        }
        cluster.unavailable().or_else(|| {
            (!cluster.is_healthy()).then(|| "the shared schedule is unavailable".to_owned())
        })
    }

    /// Whatever the shared schedule's background check last found wrong.
    pub fn backend_problem(&self) -> Option<String> {
        self.cluster.as_ref()?.problem()
    }

    /// Check the shared schedule's store now (at start), and keep checking
    /// it in the background.
    pub async fn check_backend(&self) -> Result<(), String> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        let result = cluster.check().await;
        cluster.watch();
        result
    }

    /// Whether the schedule is this instance's own (no `[cluster]`): only
    /// then does [`Admission::view`] tell what a client has left. In
    /// cluster mode the store keeps the schedule, and the local view shows
    /// every client its whole budget.
    pub fn schedule_is_local(&self) -> bool {
        self.cluster.is_none()
    }

    /// Whether a failed start-up check must stop sluice (with
    /// `on_failure = "reject"` nothing could be served anyway).
    pub fn backend_required(&self) -> bool {
        self.cluster
            .as_ref()
            .is_some_and(|c| c.on_failure == OnFailure::Reject)
    }
}

/// A unit of `max_queued` held by a request waiting outside the engine;
/// given back when dropped.
pub struct WaitSlot {
    shaper: Shaper<Key>,
}

impl Drop for WaitSlot {
    fn drop(&mut self) {
        self.shaper.budget().give_queued();
    }
}

enum Shared {
    Decided(Verdict),
    /// The backend failed and `on_failure = "local"`.
    Local,
}

/// A spacing in nanoseconds as the cluster store keeps it, in whole
/// microseconds rounded up: the shared schedule never departs faster than
/// r or the upstream's cap (30,000/s is 34 µs apart, 29,412/s), and a
/// spacing under 1 µs is never 0.
fn spacing_us(ns: u64) -> u64 {
    ns.div_ceil(1_000).max(1)
}

#[cfg(test)]
mod tests {
    use super::spacing_us;
    use crate::shaper::Rate;

    #[test]
    fn the_store_never_paces_faster_than_the_rate() {
        for per_second in [
            1.0,
            3.0,
            7.0,
            100.0,
            30_000.0,
            33_333.0,
            999_999.0,
            5_000_000.0,
        ] {
            let interval = Rate::per_second(per_second).unwrap().interval_nanos();
            let step = spacing_us(interval);
            // Never closer than the rate's own interval, and less than
            // 1 µs further.
            assert!(
                step * 1_000 >= interval,
                "{per_second}/s paced {step} µs apart"
            );
            assert!(
                step * 1_000 < interval.max(1) + 1_000,
                "{per_second}/s paced {step} µs apart"
            );
        }
        assert_eq!(spacing_us(33_333), 34);
        assert_eq!(spacing_us(1_000_000), 1_000);
        assert_eq!(spacing_us(0), 1);
    }
}
