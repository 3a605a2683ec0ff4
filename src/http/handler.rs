//! One request's life: pick the route, derive the key and cost, ask the
//! admission layer, map its verdict to what the request does next (in
//! [`Handler::settle`], the one place that does: refusals become their
//! HTTP answers in [`Handler::proceed`]), stage the body while waiting for
//! the departure, forward.
//!
//! A client that goes away while its request is held makes its connection
//! ([`super::h1`]'s or hyper's) drop this future (or the staged body's
//! read fails), and with it the [`Hold`], which withdraws the request and
//! gives its slot to the next in line.
//!
//! With `on_throttle = "pause"`, an upstream's 429 or 503 that says when
//! to come back (or a gRPC pushback) pauses releases to it; the refused
//! request goes back through the queue once, when sending it twice is safe
//! (a method RFC 9110 calls idempotent, or an `Idempotency-Key`; never a
//! gRPC call, which is not staged), and within its `max_wait`. Otherwise
//! the upstream's answer reaches the client.

use std::borrow::Cow;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt as _;
use futures_util::StreamExt as _;
use futures_util::future::{Either, ready};
use http::request::Parts;
use http::uri::{InvalidUri, PathAndQuery};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, BodyStream, StreamBody};
use hyper::body::{Body as _, Frame};
use hyper::upgrade::OnUpgrade;
use tokio_util::task::TaskTracker;

use super::Shared;
use super::access::{Arrival, Pending};
use super::forward::{Origin, OutBody, Upstream};
use super::grpc;
use super::h1::RequestBody;
use super::headers::{Packed, add_ratelimit_headers, foreign_transfer_coding, pack, upgrade_to};
use super::in_flight::{CallSlot, InFlight};
use super::key;
use super::path;
use super::response::{ProxyBody, deadline_passed, full, problem};
use super::route::{App, Route, sound_host};
use super::stage::{Begun, Refused, STARVED_RETRY, StageError, Staged, Staging, linger};
use super::tunnel::Slot;
use crate::admission::{Hold, HoldError, Key, Overload, Refusal, Verdict};
use crate::metrics::Outcome;

/// The largest throttled response kept to be answered if its request
/// cannot be sent again.
const MAX_KEPT_THROTTLE_BODY: usize = 64 * 1024;

/// Serves the requests of one worker thread.
#[derive(Clone)]
pub struct Handler {
    pub shared: Arc<Shared>,
    /// The worker this handler runs on (its upstream pools).
    pub worker: usize,
    /// The worker's open tunnels (its shutdown waits for them).
    pub tunnels: TaskTracker,
}

/// A protocol switch in progress: the client's side, and its place among
/// the open tunnels.
type Switch = (OnUpgrade, Slot);

/// A request body as it goes upstream.
enum Body {
    /// Not read: streamed at departure.
    Stream(RequestBody),
    /// Read in full while it waited.
    Staged(Staged),
    /// What it sent while it waited, and the rest: a gRPC call's, an
    /// upload's that waited for a slot, or one still coming at its
    /// departure.
    Begun(Box<Begun>, RequestBody),
}

impl Body {
    /// The body again, for a second send: a staged one, or one known to
    /// be empty (a request without a body is never staged).
    fn out(&self) -> Option<OutBody> {
        match self {
            Body::Stream(b) if b.is_end_stream() => Some(OutBody::staged(Bytes::new(), None)),
            Body::Stream(_) | Body::Begun(..) => None,
            Body::Staged(s) => Some(OutBody::staged(s.data.clone(), s.trailers.clone())),
        }
    }
}

/// Counts its outcome for its rule when dropped armed (a request whose
/// client left while it waited with its hold already settled).
struct CountOnDrop<'a>(Option<&'a crate::admission::Rule>, Outcome);

impl Drop for CountOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(rule) = self.0.take() {
            rule.count(self.1);
        }
    }
}

/// A departed request as forwarding needs it: its key, cost, arrival and
/// (a gRPC call's) `grpc-timeout`.
type Departed<'a> = (&'a Key, u32, Instant, Option<Duration>);

/// A wait that is boxed (not the common one).
type Waits<'a> = Pin<Box<dyn Future<Output = Result<Body, Response<ProxyBody>>> + Send + 'a>>;

/// A request's answer, boxed: refused before its admission, or admitted
/// through the shared store (cluster mode).
type Answering = Pin<Box<dyn Future<Output = Response<ProxyBody>> + Send>>;

/// What an admitted request does next ([`Handler::settle`]): small, as it
/// is part of every request's future until it is polled.
enum Step {
    /// Departs now.
    Go,
    /// Departs once its body is staged (an upstream that may need it
    /// twice).
    Stage,
    /// Waits in the queue, in the hold kept in its head alone (no body
    /// to stage, not a gRPC call): the common wait.
    Hold,
    /// Waits in the queue with something else (a body staged, a gRPC
    /// deadline), in a boxed future.
    Queued,
    /// Refused: the queue is full (429, retry after so many
    /// nanoseconds: a `Duration` would make this enum, and so every
    /// request's future, 8 bytes larger).
    Full(u64),
    /// Refused: the wait would pass `max_wait` (429, retry after so many
    /// nanoseconds).
    MaxWait(u64),
    /// Refused at one of the instance's own bounds (503).
    Overloaded(Overload),
}

/// A request's head: as parsed, or packed while the request waits in the
/// queue, with the hold it waits in when nothing else waits with it. The
/// hold lives here, in the space the parsed head leaves, and not in the
/// future that waits: that future is part of hyper's HTTP/2 stream task,
/// whose size class (multiples of 128 bytes) it decides.
enum Head {
    Parsed(Parts),
    Waiting(Packed, Option<Hold>),
}

impl Head {
    /// Pack the head for a wait in `hold` (if given).
    fn wait(&mut self, hold: Option<Hold>) {
        if let Head::Parsed(parts) = self {
            let (blank, ()) = Request::new(()).into_parts();
            *self = Head::Waiting(pack(std::mem::replace(parts, blank)), hold);
        }
    }

    /// Ready when the hold kept here lets the request go (at once when
    /// there is none).
    fn poll_departed(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), HoldError>> {
        match self {
            Head::Waiting(_, Some(hold)) => hold.poll_wait(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    /// The hold kept here, taken out (for a wait with something else).
    fn take_hold(&mut self) -> Option<Hold> {
        match self {
            Head::Waiting(_, hold) => hold.take(),
            Head::Parsed(_) => None,
        }
    }

    /// The head as parsed (unpacked if it waited).
    fn parts(self) -> Result<Parts, InvalidUri> {
        match self {
            Head::Parsed(parts) => Ok(parts),
            Head::Waiting(packed, _) => packed.unpack(),
        }
    }
}

/// A request routed and keyed: everything its admission needs, owned, so
/// that the one future that waits for it carries nothing else.
struct Admit {
    app: Arc<App>,
    /// Index into `app.routes`.
    route: usize,
    head: Head,
    /// For the head's rewrite at the departure.
    origin: Origin,
    body: RequestBody,
    key: Key,
    cost: u32,
    /// For a gRPC call, its deadline (`grpc-timeout`) if any.
    grpc: Option<Option<Duration>>,
    /// Boxed: rare, and every request carries the field.
    switch: Option<Box<Switch>>,
    arrival: Instant,
    /// Its access log line to come (only with `server.access_log`).
    logged: Option<Box<Pending>>,
}

impl Handler {
    /// The answer to `req`. Routing, the key, the request's new target
    /// and (without a shared store) its admission happen here,
    /// synchronously, in the order requests arrive; what is returned is
    /// the future that waits and forwards, a held request's whole state
    /// apart from its box, so kept small (64 bytes: hyper's HTTP/2 stream
    /// task then takes a 256-byte cell instead of 384).
    pub fn handle(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<ProxyBody>> + Send + use<> {
        let grpc = grpc::is_grpc(req.headers()).then(|| grpc::timeout(req.headers()));
        let logged = self.shared.access_log.as_ref().map(|_| {
            Box::new(Arrival::new(
                peer.ip(),
                req.method(),
                req.uri(),
                req.version(),
            ))
        });
        // Boxed: the request's own state lives in one allocation of its
        // size, so that the future which waits (in hyper's stream task, or
        // our connection's) carries a pointer to it, not the request
        // itself.
        let mut a = match self.prepare(req, peer, grpc) {
            Ok(mut a) => {
                if let (Some(log), Some(arrival)) = (&self.shared.access_log, logged) {
                    let route = &a.app.routes[a.route].name;
                    a.logged = Some(Box::new(Pending::new(log.clone(), *arrival, route)));
                }
                Box::new(a)
            }
            // Boxed: a request refused before its admission (400, 404) is
            // rare, and its answer would size every request's future.
            Err(response) => {
                let response = match grpc {
                    Some(_) => grpc::answer(response),
                    None => response,
                };
                if let (Some(log), Some(arrival)) = (&self.shared.access_log, logged) {
                    let grpc = super::access::grpc_status(response.headers());
                    log.write(&arrival, None, response.status().as_u16(), grpc);
                }
                return Either::Right(Box::pin(ready(response)) as Answering);
            }
        };
        let rule = &a.app.routes[a.route].rule;
        let admission = &self.shared.admission;
        let Some(verdict) = admission.admit_now(rule, a.key.clone(), a.cost, a.arrival) else {
            // Cluster mode: the shared store is asked first, in a future
            // of its own.
            return Either::Right(Box::pin(self.clone().ask(a)) as Answering);
        };
        let step = self.settle(&mut a, verdict);
        Either::Left(self.clone().proceed(a, step))
    }

    /// Route, key and retarget a request (its headers are rewritten at its
    /// departure: [`Upstream::rewrite`]); or the answer that refuses it.
    #[expect(
        clippy::result_large_err,
        reason = "the error is the response itself, returned once; boxing it would add an allocation to every refusal"
    )]
    fn prepare(
        &self,
        mut req: Request<RequestBody>,
        peer: SocketAddr,
        grpc: Option<Option<Duration>>,
    ) -> Result<Admit, Response<ProxyBody>> {
        let mut hosts = req.headers().get_all(http::header::HOST).iter();
        let host = hosts.next();
        // RFC 9112 3.2: an HTTP/1.1 request carries exactly one Host.
        if req.version() == http::Version::HTTP_11 && (host.is_none() || hosts.next().is_some()) {
            self.shared.count_unrouted();
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "an HTTP/1.1 request needs exactly one Host header",
                None,
            ));
        }
        // RFC 9110 4.2.4 (and RFC 9113 8.3.1 for :authority): userinfo in
        // the target or in Host is an error, not a host to route by.
        let userinfo = req
            .uri()
            .authority()
            .is_some_and(|a| a.as_str().contains('@'))
            || host.is_some_and(|h| h.as_bytes().contains(&b'@'));
        if userinfo {
            self.shared.count_unrouted();
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "the request's host has userinfo (user@host), which HTTP does not allow",
                None,
            ));
        }
        // RFC 9112 3.2: a Host (or target authority) that is not a host
        // and port is a 400, not a name routing and the upstream might
        // read two ways.
        let sound = req
            .uri()
            .authority()
            .is_none_or(|a| sound_host(a.as_str().as_bytes()))
            && host.is_none_or(|h| sound_host(h.as_bytes()));
        if !sound {
            self.shared.count_unrouted();
            return Err(problem(
                StatusCode::BAD_REQUEST,
                "the request's host is not a host name or address with an optional port",
                None,
            ));
        }
        // RFC 9112 6.1: a request whose body has a transfer coding besides
        // `chunked` (`gzip, chunked`): hyper undoes the chunking only, and
        // the field goes as hop-by-hop, so the upstream would take the
        // coded bytes for the content. nginx answers 501 too.
        if foreign_transfer_coding(req.headers()) {
            self.shared.count_unrouted();
            return Err(problem(
                StatusCode::NOT_IMPLEMENTED,
                "a transfer coding other than chunked is not supported",
                None,
            ));
        }
        // RFC 9110 7.8: an HTTP/1.0 request's Upgrade is ignored (hyper
        // would not follow a switch on it): not passed on either.
        if req.version() < http::Version::HTTP_11 {
            req.headers_mut().remove(http::header::UPGRADE);
        }
        // A protocol switch (HTTP/1.1 only) holds a tunnel's place from
        // its arrival: past max_tunnels, 503 at once.
        let mut switch =
            if req.version() == http::Version::HTTP_11 && upgrade_to(req.headers()).is_some() {
                match self.shared.tunnels.reserve() {
                    Some(slot) => Some(Box::new((hyper::upgrade::on(&mut req), slot))),
                    None => {
                        return Err(problem(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "too many tunnels are open (server.max_tunnels); retry later",
                            Some(Duration::from_secs(1)),
                        ));
                    }
                }
            } else {
                None
            };
        let app = self.shared.app(self.worker);
        // Routes see (and the upstream gets) the normalized path.
        let (normalized, path) = match path::normalize(req.uri().path()) {
            Ok(Cow::Borrowed(p)) => (None, Cow::Borrowed(p)),
            Ok(Cow::Owned(p)) => {
                let pq = match req.uri().query() {
                    Some(q) => format!("{p}?{q}"),
                    None => p.clone(),
                };
                (PathAndQuery::try_from(pq).ok(), Cow::Owned(p))
            }
            Err(e) => {
                self.shared.count_unrouted();
                return Err(problem(StatusCode::BAD_REQUEST, &e.to_string(), None));
            }
        };
        let Some(index) = app.route(&path::without_parameters(&path), &req) else {
            self.shared.count_unrouted();
            return Err(problem(
                StatusCode::NOT_FOUND,
                "no route matches this request",
                None,
            ));
        };
        let route = &app.routes[index];
        let Some(upstream) = app.upstreams.get(route.upstream) else {
            route.rule.count_unadmitted(Outcome::UpstreamError);
            return Err(problem(StatusCode::BAD_GATEWAY, "no such upstream", None));
        };
        let headers = req.headers();
        let key = key::extract(
            &route.key,
            route.on_missing_key,
            headers,
            // (Found only for a Host key: not on every request's path.)
            key::by_host(&route.key)
                .then(|| super::route::request_host(&req))
                .flatten(),
            peer.ip(),
            &app.trusted_proxies,
        );
        let (key, cost) = match (key, route.cost(headers)) {
            (Ok(key), Ok(cost)) => (key, cost),
            (Err(detail), _) | (_, Err(detail)) => {
                route.rule.count_unadmitted(Outcome::Invalid);
                return Err(problem(StatusCode::BAD_REQUEST, &detail, None));
            }
        };
        // A protocol switch whose key holds its route's share of tunnels
        // open already: 429 at once (nginx's limit_conn).
        if let (Some(switch), Some(max)) = (switch.as_mut(), route.max_tunnels_per_key)
            && !switch
                .1
                .for_key(&self.shared.tunnels, &route.name, &key, max)
        {
            route.rule.count_unadmitted(Outcome::Rejected);
            return Err(problem(
                StatusCode::TOO_MANY_REQUESTS,
                &format!(
                    "route '{}': this client holds max_tunnels_per_key tunnels open already; close one first",
                    route.name
                ),
                Some(Duration::from_secs(1)),
            ));
        }
        let (mut parts, body) = req.into_parts();
        if let Some(pq) = normalized {
            let mut uri = parts.uri.into_parts();
            uri.path_and_query = Some(pq);
            parts.uri = match http::Uri::from_parts(uri) {
                Ok(u) => u,
                Err(_) => {
                    route.rule.count_unadmitted(Outcome::Invalid);
                    return Err(problem(
                        StatusCode::BAD_REQUEST,
                        "the request target is invalid",
                        None,
                    ));
                }
            };
        }
        let trusted = key::is_trusted(peer.ip(), &app.trusted_proxies);
        let strip = route.strip_prefix.as_deref();
        let Some(origin) = upstream.retarget(&mut parts, peer, trusted, strip) else {
            route.rule.count_unadmitted(Outcome::Invalid);
            let detail = "the request target cannot be forwarded";
            return Err(problem(StatusCode::BAD_REQUEST, detail, None));
        };
        Ok(Admit {
            app,
            route: index,
            head: Head::Parsed(parts),
            origin,
            body,
            key,
            cost,
            grpc,
            switch,
            arrival: Instant::now(),
            logged: None,
        })
    }

    /// A request admitted through the shared store (cluster mode): asked,
    /// then as any other.
    async fn ask(self: Arc<Self>, mut a: Box<Admit>) -> Response<ProxyBody> {
        let verdict = {
            let rule = &a.app.routes[a.route].rule;
            let admission = &self.shared.admission;
            admission
                .admit(rule, a.key.clone(), a.cost, a.arrival)
                .await
        };
        let step = self.settle(&mut a, verdict);
        self.proceed(a, step).await
    }

    /// What an admitted request does next, from its verdict; a hold it
    /// waits in is kept in its head, which is packed.
    fn settle(&self, a: &mut Admit, verdict: Verdict) -> Step {
        let upstream = &a.app.upstreams[a.app.routes[a.route].upstream];
        match verdict {
            // A gRPC call is never staged, even for an upstream that may
            // pause: it may stream both ways. So it is never sent twice.
            Verdict::Go if upstream.stages_everything() && a.grpc.is_none() => Step::Stage,
            Verdict::Go => Step::Go,
            Verdict::Wait(hold) => {
                let alone = a.grpc.is_none() && a.body.is_end_stream();
                a.head.wait(Some(hold));
                if alone { Step::Hold } else { Step::Queued }
            }
            Verdict::Refused {
                why: Refusal::Full,
                retry_after,
            } => Step::Full(nanos(retry_after)),
            Verdict::Refused {
                why: Refusal::MaxWait,
                retry_after,
            } => Step::MaxWait(nanos(retry_after)),
            Verdict::Overloaded(why) => Step::Overloaded(why),
        }
    }

    /// Wait as `step` says (staging the body), forward; or refuse. A gRPC
    /// call waits without staging (a streaming call's body flows once it
    /// departs) and is refused at once when its deadline ends before its
    /// departure.
    ///
    /// This and the futures a held request waits in are `async` blocks
    /// returned by plain functions, not `async fn`s: an `async fn` keeps a
    /// second copy of each argument it moves from (its parameter, and the
    /// local that binds it), and these futures are what a held request
    /// costs in memory (BENCHMARKS.md, "Memory per held request"). This
    /// one keeps only two pointers and the wait at hand: the route and
    /// upstream are looked up again after each wait rather than kept.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps a second copy of each argument in a held request's state"
    )]
    fn proceed(
        self: Arc<Self>,
        mut a: Box<Admit>,
        step: Step,
    ) -> impl Future<Output = Response<ProxyBody>> + Send {
        async move {
            let take = |body: &mut RequestBody| std::mem::replace(body, RequestBody::Empty);
            let mut response = 'answer: {
                // Each arm ends the answer itself on a refusal: a result
                // kept in a local would stay in this future through the
                // call.
                let body = match step {
                    Step::Go => Body::Stream(take(&mut a.body)),
                    Step::Stage => {
                        let route = &a.app.routes[a.route];
                        let upstream = &a.app.upstreams[route.upstream];
                        let departed = (&a.key, a.cost, Instant::now());
                        let staging = self.stage(route, upstream, take(&mut a.body), departed);
                        match Box::pin(staging).await {
                            Ok(body) => body,
                            Err(response) => break 'answer response,
                        }
                    }
                    Step::Queued => {
                        let route = &a.app.routes[a.route];
                        let hold = a.head.take_hold();
                        let body = take(&mut a.body);
                        let waiting: Waits<'_> = match (hold, a.grpc) {
                            (Some(hold), Some(timeout)) => {
                                let deadline = timeout.and_then(|d| a.arrival.checked_add(d));
                                Box::pin(self.call(route, hold, body, deadline))
                            }
                            (Some(hold), None) => {
                                let upstream = &a.app.upstreams[route.upstream];
                                let who = (&a.key, a.cost);
                                Box::pin(self.wait(route, upstream, hold, body, who))
                            }
                            // `settle` kept one: never forwarded unpaced.
                            // (The body is dropped in every arm: kept, it
                            // would stay in this future through the wait.)
                            (None, _) => {
                                drop(body);
                                Box::pin(ready(Err(problem(
                                    StatusCode::INTERNAL_SERVER_ERROR,
                                    "unexpected admission state",
                                    None,
                                ))))
                            }
                        };
                        match waiting.await {
                            Ok(body) => body,
                            Err(response) => break 'answer response,
                        }
                    }
                    Step::Hold => match std::future::poll_fn(|cx| a.head.poll_departed(cx)).await {
                        Ok(()) => Body::Stream(take(&mut a.body)),
                        Err(e) => break 'answer self.hold_failed(&a.app.routes[a.route], e),
                    },
                    Step::Full(after) => {
                        let after = Duration::from_nanos(after);
                        break 'answer a.app.routes[a.route].full.response(Some(after));
                    }
                    Step::MaxWait(after) => {
                        let after = Duration::from_nanos(after);
                        break 'answer a.app.routes[a.route].max_wait.response(Some(after));
                    }
                    Step::Overloaded(why) => break 'answer self.shared.overloaded(why),
                };
                let route = &a.app.routes[a.route];
                let upstream = &a.app.upstreams[route.upstream];
                // The head is made in a block of its own: a local would
                // stay in this future through the call.
                let parts = {
                    let Ok(mut parts) = a.head.parts() else {
                        route.rule.count(Outcome::Invalid);
                        let detail = "the request target cannot be forwarded";
                        break 'answer problem(StatusCode::BAD_REQUEST, detail, None);
                    };
                    upstream.rewrite(&mut parts, a.origin);
                    if let Some(Some(timeout)) = a.grpc
                        && grpc::spend(&mut parts.headers, a.arrival, timeout).is_err()
                    {
                        route.rule.count(Outcome::Expired);
                        let detail = "the call's deadline (grpc-timeout) passed while it waited";
                        break 'answer deadline_passed(detail);
                    }
                    parts
                };
                // Boxed: the forwarding state (upstream connect, TLS, the
                // call) is large and only exists once the request departs,
                // so a waiting request holds none of it.
                let departed = (&a.key, a.cost, a.arrival, a.grpc.flatten());
                Box::pin(self.forward(route, upstream, parts, body, departed, a.switch)).await
            };
            let route = &a.app.routes[a.route];
            if route.ratelimit_headers {
                self.ratelimit(route, &a.key, &mut response);
            }
            let response = match a.grpc {
                Some(_) => grpc::answer(response),
                None => response,
            };
            if let Some(logged) = a.logged.take() {
                logged.answered(&response);
            }
            response
        }
    }

    /// Wait for the departure while the body is staged. A body that
    /// cannot be staged ends the wait: a client gone is counted as
    /// cancelled (by the dropped hold), a refused body as what it got. A
    /// body still arriving at the departure goes with it, as far as it
    /// was read, and the rest is streamed after it (as a request that
    /// departs at once streams its body): held until the body ended, the
    /// request would reach the upstream late, out of its client's order
    /// and off the spacing its departure kept. For an upstream that may
    /// pause, whose requests may be sent twice, the body is read to its
    /// end and the start spaced as a late one ([`Handler::late_start`]).
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps a second copy of each argument in a held request's state"
    )]
    fn wait<'a>(
        &'a self,
        route: &'a Route,
        upstream: &'a Upstream,
        mut hold: Hold,
        body: RequestBody,
        (key, cost): (&'a Key, u32),
    ) -> impl Future<Output = Result<Body, Response<ProxyBody>>> + Send + 'a {
        async move {
            let budget = &self.shared.staging;
            let mut staging = match Staging::new(body, budget, self.shared.body_read_timeout) {
                Ok(staging) => staging,
                Err(refused) => {
                    hold.withdraw();
                    return Err(self.stage_failed(route, refused, true));
                }
            };
            let mut read = false;
            loop {
                tokio::select! {
                    r = staging.read(budget), if !read => match r {
                        Ok(()) => read = true,
                        Err(StageError::Gone) => {
                            drop(hold);
                            return Err(self.stage_failed(route, staging.refused(StageError::Gone), false));
                        }
                        Err(e) => {
                            hold.withdraw();
                            return Err(self.stage_failed(route, staging.refused(e), true));
                        }
                    },
                    d = hold.wait() => match d {
                        Ok(()) => break,
                        Err(e) => return Err(self.hold_failed(route, e)),
                    },
                }
            }
            if read {
                return Ok(Body::Staged(staging.finish()));
            }
            if !upstream.stages_everything() {
                let (first, rest) = staging.begun();
                return Ok(Body::Begun(first, rest));
            }
            // Boxed: every queued request with a body holds this future,
            // and the rare late start is larger than its wait.
            let departed = Instant::now();
            Box::pin(async move {
                if let Err(e) = staging.read(budget).await {
                    return Err(self.stage_failed(route, staging.refused(e), true));
                }
                self.late_start(route, upstream, (key, cost), departed)
                    .await?;
                Ok(Body::Staged(staging.finish()))
            })
            .await
        }
    }

    /// Stage the body of a request that departs at once (at `departed`)
    /// to an upstream that may need it twice. A body not all there yet
    /// makes a late start ([`Handler::late_start`]).
    async fn stage(
        &self,
        route: &Route,
        upstream: &Upstream,
        body: RequestBody,
        (key, cost, departed): (&Key, u32, Instant),
    ) -> Result<Body, Response<ProxyBody>> {
        let budget = &self.shared.staging;
        let mut staging = Staging::new(body, budget, self.shared.body_read_timeout)
            .map_err(|e| self.stage_failed(route, e, true))?;
        let at_once = staging.read(budget).now_or_never();
        let late = at_once.is_none();
        if let Err(e) = match at_once {
            Some(r) => r,
            None => staging.read(budget).await,
        } {
            return Err(self.stage_failed(route, staging.refused(e), true));
        }
        if late {
            self.late_start(route, upstream, (key, cost), departed)
                .await?;
        }
        Ok(Body::Staged(staging.finish()))
    }

    /// A request whose body came after its departure (at `departed`),
    /// sent to an upstream that may pause: its start is spaced as DESIGN
    /// 1's late releases say, and made only once the upstream's pause is
    /// over (as a relayed message's,
    /// [`crate::admission::Admission::space_relay`]), within the
    /// upstream's `request_timeout`; else 503, as when the drain gives up.
    async fn late_start(
        &self,
        route: &Route,
        upstream: &Upstream,
        (key, cost): (&Key, u32),
        departed: Instant,
    ) -> Result<(), Response<ProxyBody>> {
        let admission = &self.shared.admission;
        let latest = Instant::now() + upstream.request_timeout();
        // Its hold is settled: a client that leaves meanwhile is counted
        // here.
        let mut left = CountOnDrop(Some(&route.rule), Outcome::Cancelled);
        let why = tokio::select! {
            in_time = admission.space_relay(&route.rule, key, cost, departed, latest) => {
                left.0 = None;
                if in_time {
                    return Ok(());
                }
                "the upstream asked for a pause that outlasted this request's request_timeout"
            }
            () = admission.closing().cancelled() => {
                left.0 = None;
                "sluice is shutting down; this request was not forwarded"
            }
        };
        route.rule.count(Outcome::Expired);
        Err(problem(
            StatusCode::SERVICE_UNAVAILABLE,
            why,
            Some(Duration::from_secs(1)),
        ))
    }

    /// A gRPC call's wait: refused at once when its deadline ends before
    /// its departure. What it sends meanwhile is read (its connection's
    /// flow-control window, which its other calls share, stays open; see
    /// [`Begun`]) and forwarded first once it departs, then the rest of
    /// its stream.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps a second copy of each argument in a held request's state"
    )]
    fn call<'a>(
        &'a self,
        route: &'a Route,
        mut hold: Hold,
        mut body: RequestBody,
        deadline: Option<Instant>,
    ) -> impl Future<Output = Result<Body, Response<ProxyBody>>> + Send + 'a {
        async move {
            if let (Some(deadline), Some(departure)) = (deadline, hold.departure())
                && departure > deadline
            {
                hold.withdraw();
                route.rule.count(Outcome::Rejected);
                return Err(problem(
                    StatusCode::TOO_MANY_REQUESTS,
                    "the call's deadline (grpc-timeout) ends before its turn",
                    Some(departure - deadline),
                ));
            }
            let max = self.shared.staging.max_body();
            let mut first = Box::new(Begun::new(&self.shared.staging));
            loop {
                tokio::select! {
                    d = hold.wait() => match d {
                        Ok(()) => return Ok(Body::Begun(first, body)),
                        Err(e) => return Err(self.hold_failed(route, e)),
                    },
                    read = first.read(&mut body), if first.wants(max, &self.shared.staging) => match read {
                        Ok(()) => {}
                        Err(error @ StageError::Gone) => {
                            drop(hold);
                            let refused = Refused { error, rest: None };
                            return Err(self.stage_failed(route, refused, false));
                        }
                        Err(error) => {
                            hold.withdraw();
                            let refused = Refused { error, rest: None };
                            return Err(self.stage_failed(route, refused, true));
                        }
                    },
                    // Paused for want of budget: tried again. (After the
                    // read's branch, whose condition sets it.)
                    () = tokio::time::sleep(STARVED_RETRY), if first.starved() => {}
                }
            }
        }
    }

    /// The answer to a body that could not be staged; counted when
    /// `count` (a dropped hold counts its own withdrawal). What the client
    /// still sends is read and dropped for a while, so the answer reaches
    /// it before the connection closes.
    fn stage_failed(&self, route: &Route, refused: Refused, count: bool) -> Response<ProxyBody> {
        let Refused { error: e, rest } = refused;
        if let Some(rest) = rest {
            linger(rest);
        }
        if count {
            route.rule.count(stage_outcome(&e));
        }
        match e {
            StageError::TooLarge(max) => problem(
                StatusCode::PAYLOAD_TOO_LARGE,
                &format!("a request that waits may carry at most {max} bytes of body"),
                None,
            ),
            StageError::Full => self.shared.overloaded(Overload::Queued),
            StageError::Malformed(_) => problem(
                StatusCode::BAD_REQUEST,
                "the request body is malformed",
                None,
            ),
            StageError::TimedOut => problem(
                StatusCode::REQUEST_TIMEOUT,
                &StageError::TimedOut.to_string(),
                None,
            ),
            // Nobody reads this answer: the client is gone.
            StageError::Gone => problem(
                StatusCode::BAD_REQUEST,
                "the request body was cut short",
                None,
            ),
        }
    }

    fn hold_failed(&self, route: &Route, e: HoldError) -> Response<ProxyBody> {
        match e {
            HoldError::Expired => route.expired.response(Some(
                route
                    .rule
                    .policy()
                    .max_wait
                    .map_or(Duration::from_secs(1), Duration::from_nanos),
            )),
            HoldError::Closed => problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "sluice is shutting down; this request was not forwarded",
                Some(Duration::from_secs(1)),
            ),
        }
    }

    /// Send upstream; on an upstream's throttle, pause it and send the
    /// request again once, through the queue, when that is safe. A
    /// protocol switch the upstream accepts (`101`) becomes a tunnel; any
    /// other answer to it reaches the client unchanged.
    async fn forward(
        &self,
        route: &Route,
        upstream: &Upstream,
        parts: Parts,
        body: Body,
        departed: Departed<'_>,
        switch: Option<Box<Switch>>,
    ) -> Response<ProxyBody> {
        let (_, _, arrival, grpc_timeout) = departed;
        let call = grpc_timeout.map(|t| (arrival, t));
        let replay = body.out().map(|b| (parts.clone(), b));
        let (mut parts, mut body) = (parts, body);
        let permit = match self
            .in_flight_slot(route, upstream, &mut parts, &mut body, call)
            .await
        {
            Ok(p) => p,
            Err((response, outcome)) => {
                route.rule.count(outcome);
                return response;
            }
        };
        // An upload's body is held to a pace while it streams; a call's
        // (gRPC, Connect streaming) may stream as long as the call lasts.
        let pace = (!grpc::is_grpc(&parts.headers) && !grpc::is_connect_stream(&parts.headers))
            .then_some(self.shared.body_read_timeout);
        let out = match body {
            Body::Stream(b) => OutBody::stream(b, pace),
            Body::Staged(ref s) => OutBody::staged(s.data.clone(), s.trailers.clone()),
            Body::Begun(first, rest) => OutBody::begun(first, rest, pace),
        };
        let deadline = call.and_then(|(arrival, t)| arrival.checked_add(t));
        let (response, outcome, throttle, switched) =
            upstream.forward(parts, out, permit, deadline).await;
        if let Some((client, slot)) = switch.map(|s| *s) {
            if let Some((theirs, call)) = switched {
                self.shared.tunnels.join(
                    &self.tunnels,
                    (slot, call),
                    (client, theirs),
                    upstream.read_timeout(),
                );
            }
            if let Some(until) = throttle {
                self.shared.admission.pause(&route.rule, until);
            }
            route.rule.count(outcome);
            return response;
        }
        if switched.is_some() {
            // A switch nobody asked for: the client could not follow it.
            route.rule.count(Outcome::UpstreamError);
            return problem(
                StatusCode::BAD_GATEWAY,
                "the upstream switched protocols unasked",
                None,
            );
        }
        let Some(until) = throttle else {
            route.rule.count(outcome);
            return response;
        };
        self.shared.admission.pause(&route.rule, until);
        // Boxed: a throttled answer is rare, and its second send would
        // otherwise double this future's size.
        let throttled = (response, outcome, until);
        Box::pin(self.again(route, upstream, throttled, replay, departed)).await
    }

    /// The upstream throttled its `response` until `until`: send the
    /// request once more through the queue when that is safe and within
    /// its `max_wait`, else answer what the upstream said.
    async fn again(
        &self,
        route: &Route,
        upstream: &Upstream,
        (response, outcome, until): (Response<ProxyBody>, Outcome, Instant),
        replay: Option<(Parts, OutBody)>,
        (key, cost, arrival, grpc_timeout): Departed<'_>,
    ) -> Response<ProxyBody> {
        let call = grpc_timeout.map(|t| (arrival, t));
        let admission = &self.shared.admission;
        let max_wait = route.rule.policy().max_wait.map(Duration::from_nanos);
        let deadline = max_wait.map(|mw| arrival + mw);
        let within_max_wait = deadline.is_none_or(|d| until <= d);
        // Asked to wait past max_pause: the pause ends sooner than the
        // upstream said, and a second send then would come too early.
        let honoured = super::throttle::asked(response.status(), response.headers())
            .is_none_or(|asked| asked <= upstream.max_pause());
        let Some((mut parts, out)) =
            replay.filter(|(p, _)| safe_to_repeat(p) && within_max_wait && honoured)
        else {
            route.rule.count(outcome);
            return response;
        };
        // Keep the upstream's answer, to give it if the retry cannot go.
        let kept = match keep(response).await {
            Some(Ok(kept)) => kept,
            // Too large to keep: passed on as it comes, not sent again.
            Some(Err(whole)) => {
                route.rule.count(outcome);
                return whole;
            }
            None => {
                route.rule.count(Outcome::UpstreamError);
                return problem(
                    StatusCode::BAD_GATEWAY,
                    "the upstream's answer was cut short",
                    None,
                );
            }
        };
        // Not a new arrival: the request's one outcome is counted below.
        let again = match admission
            .admit_again(&route.rule, key.clone(), cost, Instant::now())
            .await
        {
            Verdict::Go => true,
            // Its max_wait still runs from its first arrival.
            Verdict::Wait(mut hold) => {
                let departed = match deadline {
                    Some(d) => tokio::time::timeout_at(d.into(), hold.wait_again())
                        .await
                        .is_ok_and(|r| r.is_ok()),
                    None => hold.wait_again().await.is_ok(),
                };
                if !departed {
                    hold.withdraw();
                }
                departed
            }
            _ => false,
        };
        if !again {
            route.rule.count(outcome);
            return kept;
        }
        // (The body to send again is staged: nothing to read.)
        let mut staged = Body::Stream(RequestBody::Empty);
        let slot = self.in_flight_slot(route, upstream, &mut parts, &mut staged, call);
        let permit = match slot.await {
            Ok(p) => p,
            Err((response, outcome)) => {
                route.rule.count(outcome);
                return response;
            }
        };
        let deadline = call.and_then(|(arrival, t)| arrival.checked_add(t));
        let (response, outcome, throttle, _) = upstream.forward(parts, out, permit, deadline).await;
        // Throttled again: the next releases wait too (this one is not
        // sent a third time).
        if let Some(until) = throttle {
            admission.pause(&route.rule, until);
        }
        route.rule.count(outcome);
        response
    }

    /// Released by the shaper: wait for one of the upstream's
    /// `max_concurrency` slots (first come, first served, as calls end).
    /// The wait counts against `max_queued`, lasts at most the upstream's
    /// `request_timeout` (504), and ends with 503 when the drain gives up.
    /// The request's head is packed while it waits, as in the queue. A
    /// gRPC call's deadline counts the wait too: it ends the wait (504,
    /// DEADLINE_EXCEEDED), and what is left of it is what the upstream is
    /// told. Refused, the answer and how it counts.
    async fn in_flight_slot(
        &self,
        route: &Route,
        upstream: &Upstream,
        head: &mut Parts,
        body: &mut Body,
        call: Option<(Instant, Duration)>,
    ) -> Result<Option<CallSlot>, (Response<ProxyBody>, Outcome)> {
        let Some(cap) = upstream.concurrency() else {
            return Ok(None);
        };
        if let Some(slot) = cap.try_take() {
            return Ok(Some(slot));
        }
        let admission = &self.shared.admission;
        let Some(_room) = admission.reserve_wait() else {
            let full = self.shared.overloaded(Overload::Queued);
            return Err((full, Outcome::Overloaded));
        };
        self.wait_for_slot(route, cap, upstream, head, body, call)
            .await
    }

    /// [`Handler::in_flight_slot`]'s wait for a slot of `cap`, with its
    /// room in `max_queued` taken. A body not read yet is read meanwhile
    /// (up to `max_staged_body`, counted in `max_staged_bytes`), as a
    /// waiting gRPC call's is ([`Begun`]), as the departure's queue stages
    /// one: unread, an HTTP/2 body held its connection's flow-control
    /// window (a few such uploads waiting for a slot stalled every other
    /// request on the connection), and a client that left in the middle
    /// of an HTTP/1.1 body, or before sending it (`Expect:
    /// 100-continue`), was not seen (hyper reads nothing more meanwhile),
    /// and its request took the slot when it came.
    async fn wait_for_slot(
        &self,
        route: &Route,
        cap: &Arc<InFlight>,
        upstream: &Upstream,
        head: &mut Parts,
        body: &mut Body,
        call: Option<(Instant, Duration)>,
    ) -> Result<Option<CallSlot>, (Response<ProxyBody>, Outcome)> {
        let expired = |answer| (answer, Outcome::Expired);
        let admission = &self.shared.admission;
        let left = call
            .and_then(|(arrival, t)| arrival.checked_add(t))
            .map(|d| d.saturating_duration_since(Instant::now()));
        const DEADLINE: &str = "the call's deadline (grpc-timeout) passed while it waited for an upstream slot (max_concurrency)";
        let (limit, own_deadline) = match left {
            Some(d) if d < upstream.request_timeout() => (d, true),
            _ => (upstream.request_timeout(), false),
        };
        let (blank, ()) = Request::new(()).into_parts();
        let packed = pack(std::mem::replace(head, blank));
        // The body to read meanwhile: one not read yet, or the rest of a
        // gRPC call's begun while it waited.
        let mut reading = match std::mem::replace(body, Body::Stream(RequestBody::Empty)) {
            Body::Stream(b) if !b.is_end_stream() => {
                Some((Box::new(Begun::new(&self.shared.staging)), b))
            }
            Body::Begun(first, b) => Some((first, b)),
            other => {
                *body = other;
                None
            }
        };
        let staging = &self.shared.staging;
        let max = staging.max_body();
        let timer = tokio::time::sleep(limit);
        tokio::pin!(timer);
        // Made once: the semaphore's queue is first come, first served, and
        // a wait made again for each part of the body read went to its
        // back (and a slot granted meanwhile passed to the next).
        let take = cap.take();
        tokio::pin!(take);
        let slot = loop {
            let wants = reading
                .as_mut()
                .is_some_and(|(first, _)| first.wants(max, staging));
            let starved = reading.as_ref().is_some_and(|(first, _)| first.starved());
            tokio::select! {
                biased;
                slot = &mut take => break Ok(slot),
                () = &mut timer => break Err(expired(if own_deadline {
                    deadline_passed(DEADLINE)
                } else {
                    let why = "no upstream slot (max_concurrency) became free in time";
                    problem(StatusCode::GATEWAY_TIMEOUT, why, None)
                })),
                () = admission.closing().cancelled() => break Err(expired(problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "sluice is shutting down; this request was not forwarded",
                    Some(Duration::from_secs(1)),
                ))),
                read = async {
                    match reading.as_mut() {
                        Some((first, rest)) => first.read(rest).await,
                        None => Ok(()),
                    }
                }, if wants => if let Err(error) = read {
                    let outcome = stage_outcome(&error);
                    let refused = Refused { error, rest: None };
                    break Err((self.stage_failed(route, refused, false), outcome));
                },
                // Paused for want of budget: tried again.
                () = tokio::time::sleep(STARVED_RETRY), if starved => {}
            }
        };
        if let Some((first, rest)) = reading {
            *body = Body::Begun(first, rest);
        }
        *head = packed.unpack().map_err(|_| {
            let detail = "the request target cannot be forwarded";
            (
                problem(StatusCode::BAD_REQUEST, detail, None),
                Outcome::Invalid,
            )
        })?;
        let slot = slot?;
        if let Some((arrival, t)) = call
            && grpc::spend(&mut head.headers, arrival, t).is_err()
        {
            return Err(expired(deadline_passed(DEADLINE)));
        }
        Ok(slot)
    }

    /// The RateLimit fields, from this instance's schedule; none in
    /// cluster mode, where this instance does not hold the schedule (they
    /// told every client its whole budget was left, 429s included).
    fn ratelimit(&self, route: &Route, key: &Key, response: &mut Response<ProxyBody>) {
        let admission = &self.shared.admission;
        if !admission.schedule_is_local() {
            return;
        }
        let view = admission.view(&route.rule, key);
        add_ratelimit_headers(route, view, admission.now(), response.headers_mut());
    }
}

/// How a body that could not be staged is counted.
fn stage_outcome(e: &StageError) -> Outcome {
    match e {
        StageError::TooLarge(_) | StageError::Malformed(_) | StageError::TimedOut => {
            Outcome::Invalid
        }
        StageError::Full => Outcome::Overloaded,
        StageError::Gone => Outcome::Cancelled,
    }
}

/// A duration in nanoseconds (at most about 584 years).
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// Whether sending a request twice is safe: a method RFC 9110 (9.2.2)
/// calls idempotent, or an `Idempotency-Key` the upstream deduplicates by.
pub(super) fn safe_to_repeat(parts: &Parts) -> bool {
    matches!(
        parts.method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    ) || parts.headers.contains_key("idempotency-key")
}

/// Read a (small) response in full so it can be answered later (`Ok`);
/// one longer than sluice keeps as it comes (`Err`: what was read, then
/// the rest, not read in); `None` when it is cut short.
async fn keep(
    response: Response<ProxyBody>,
) -> Option<Result<Response<ProxyBody>, Response<ProxyBody>>> {
    let (parts, mut body) = response.into_parts();
    let mut kept = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        // Trailers end it (a throttle page has none worth keeping).
        let Ok(data) = frame.ok()?.into_data() else {
            break;
        };
        kept.extend_from_slice(&data);
        if kept.len() > MAX_KEPT_THROTTLE_BODY {
            let head = futures_util::stream::once(ready(Ok(Frame::data(kept.freeze()))));
            let whole = BodyExt::boxed(StreamBody::new(head.chain(BodyStream::new(body))));
            return Some(Err(Response::from_parts(parts, whole)));
        }
    }
    Some(Ok(Response::from_parts(parts, full(kept.freeze()))))
}

impl Shared {
    /// The 503 for an instance-wide bound.
    pub(super) fn overloaded(&self, why: Overload) -> Response<ProxyBody> {
        let detail = match why {
            Overload::Clients => "too many clients are being shaped; retry later",
            Overload::Queued => "too many requests are queued; retry later",
            Overload::Backend => "the shared rate-limit store is unavailable; retry later",
        };
        problem(
            StatusCode::SERVICE_UNAVAILABLE,
            detail,
            Some(Duration::from_secs(1)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The size of what `f` returns, without calling it.
    fn returned<A, B, C, F>(_: impl FnOnce(A, B, C) -> F) -> usize {
        size_of::<F>()
    }

    /// What a held HTTP/2 request costs depends on this future's size:
    /// hyper's stream task wraps it in about 88 bytes of its own, and
    /// tokio's task cells come in multiples of 128 bytes (64 here makes a
    /// 256-byte cell; 72 made it 384). A local that stays alive across a
    /// wait grows it unseen: this says so.
    #[test]
    fn the_future_a_request_waits_in_stays_small() {
        let size = returned(Handler::proceed);
        println!("proceed's future: {size} bytes");
        assert!(size <= 64, "{size} bytes");
    }

    /// A queued request with a body waits in this one (boxed), its body
    /// staged meanwhile; a late start after its departure is boxed apart.
    /// (544 bytes on 2026-11-28; 632 before staging became a struct.)
    #[test]
    fn the_future_a_request_with_a_body_waits_in_stays_small() {
        fn returned6<A, B, C, D, E, G, F>(_: impl FnOnce(A, B, C, D, E, G) -> F) -> usize {
            size_of::<F>()
        }
        let size = returned6(Handler::wait);
        println!("wait's future: {size} bytes");
        assert!(size <= 560, "{size} bytes");
    }
}
