//! One request's life: pick the route, derive the key and cost, ask the
//! admission layer, map its verdict to HTTP (in [`Handler::refusal`], the
//! one place that does), stage the body while waiting for the departure,
//! forward.
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
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::FutureExt;
use futures_util::future::{Either, ready};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Body as _;
use hyper::upgrade::OnUpgrade;
use tokio::sync::OwnedSemaphorePermit;
use tokio_util::task::TaskTracker;

use super::Shared;
use super::forward::{Origin, OutBody, Upstream};
use super::grpc;
use super::h1::RequestBody;
use super::headers::{Packed, add_ratelimit_headers, pack, unpack, upgrade_to};
use super::key;
use super::path;
use super::response::{ProxyBody, full, problem};
use super::route::{App, Route};
use super::stage::{Refused, StageError, Staged, linger, stage};
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
}

impl Body {
    fn out(&self) -> Option<OutBody> {
        match self {
            Body::Stream(_) => None,
            Body::Staged(s) => Some(OutBody::staged(s.data.clone(), s.trailers.clone())),
        }
    }
}

/// A wait that is boxed (not the common one).
type Waits<'a> = Pin<Box<dyn Future<Output = Result<Body, Response<ProxyBody>>> + Send + 'a>>;

/// A request routed and keyed: everything its admission needs, owned, so
/// that the one future that waits for it carries nothing else.
struct Admit {
    app: Arc<App>,
    /// Index into `app.routes`.
    route: usize,
    parts: Parts,
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
    /// The head's fields while it waits ([`pack`]).
    packed: Option<Packed>,
}

impl Handler {
    /// The answer to `req`. Routing, the key and the request's new target
    /// happen here, synchronously; what is returned is the admission's
    /// future alone (a held request's whole state, so kept small: an
    /// `async fn` would also carry the request it was given).
    pub fn handle(
        self: &Arc<Self>,
        req: Request<RequestBody>,
        peer: SocketAddr,
    ) -> impl Future<Output = Response<ProxyBody>> + Send + use<> {
        let grpc = grpc::is_grpc(req.headers()).then(|| grpc::timeout(req.headers()));
        match self.prepare(req, peer, grpc) {
            // Boxed: the request's own state lives in one allocation of
            // its size, so that the future which waits (in hyper's stream
            // task, or our connection's) carries a pointer to it, not the
            // request itself.
            Ok(a) => Either::Left(self.clone().admit(Box::new(a))),
            Err(response) => Either::Right(ready(match grpc {
                Some(_) => grpc::answer(response),
                None => response,
            })),
        }
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
        // A protocol switch (HTTP/1.1 only) holds a tunnel's place from
        // its arrival: past max_tunnels, 503 at once.
        let switch =
            if req.version() <= http::Version::HTTP_11 && upgrade_to(req.headers()).is_some() {
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
        let Some(index) = app.route(&path, &req) else {
            self.shared.count_unrouted();
            return Err(problem(
                StatusCode::NOT_FOUND,
                "no route matches this request",
                None,
            ));
        };
        let route = &app.routes[index];
        let Some(upstream) = app.upstreams.get(route.upstream) else {
            route.rule.count(Outcome::UpstreamError);
            return Err(problem(StatusCode::BAD_GATEWAY, "no such upstream", None));
        };
        let headers = req.headers();
        let key = key::extract(
            &route.key,
            route.on_missing_key,
            headers,
            peer.ip(),
            &app.trusted_proxies,
        );
        let (key, cost) = match (key, route.cost(headers)) {
            (Ok(key), Ok(cost)) => (key, cost),
            (Err(detail), _) | (_, Err(detail)) => {
                route.rule.count(Outcome::Invalid);
                return Err(problem(StatusCode::BAD_REQUEST, &detail, None));
            }
        };
        let (mut parts, body) = req.into_parts();
        if let Some(pq) = normalized {
            let mut uri = parts.uri.into_parts();
            uri.path_and_query = Some(pq);
            parts.uri = match http::Uri::from_parts(uri) {
                Ok(u) => u,
                Err(_) => {
                    route.rule.count(Outcome::Invalid);
                    return Err(problem(
                        StatusCode::BAD_REQUEST,
                        "the request target is invalid",
                        None,
                    ));
                }
            };
        }
        let Some(origin) = upstream.retarget(&mut parts, peer, route.strip_prefix.as_deref())
        else {
            route.rule.count(Outcome::Invalid);
            let detail = "the request target cannot be forwarded";
            return Err(problem(StatusCode::BAD_REQUEST, detail, None));
        };
        Ok(Admit {
            app,
            route: index,
            parts,
            origin,
            body,
            key,
            cost,
            grpc,
            switch,
            arrival: Instant::now(),
            packed: None,
        })
    }

    /// Admit, wait (staging the body), forward; or refuse. A gRPC call
    /// waits without staging (a streaming call's body flows once it
    /// departs) and is refused at once when its deadline ends before its
    /// departure.
    ///
    /// This and the futures a held request waits in are `async` blocks
    /// returned by plain functions, not `async fn`s: an `async fn` keeps a
    /// second copy of each argument it moves from (its parameter, and the
    /// local that binds it), and these futures are what a held request
    /// costs in memory (BENCHMARKS.md, "Memory per held request").
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps a second copy of each argument in a held request's state"
    )]
    fn admit(
        self: Arc<Self>,
        mut a: Box<Admit>,
    ) -> impl Future<Output = Response<ProxyBody>> + Send {
        async move {
            let verdict = {
                let rule = &a.app.routes[a.route].rule;
                self.shared
                    .admission
                    .admit(rule, a.key.clone(), a.cost, a.arrival)
                    .await
            };
            if let Verdict::Wait(_) = verdict {
                // It waits: its head moves into memory of its own size.
                a.packed = Some(pack(&mut a.parts));
            }
            // Fields are used in place: a destructured copy would be a
            // second one in this future. `prepare` found both indices in
            // this same (immutable) table.
            let route = &a.app.routes[a.route];
            let upstream = &a.app.upstreams[route.upstream];
            let mut response = 'answer: {
                // Moved whole into a plain function: a verdict matched here
                // would stay in this future (the hold moved out of it)
                // while the request waits.
                let next = match self.next(route, upstream, verdict, &mut a.body, a.grpc, a.arrival)
                {
                    Ok(next) => next,
                    Err(response) => break 'answer response,
                };
                let body = match next.await {
                    Ok(body) => body,
                    Err(response) => break 'answer response,
                };
                // The head is made in a block of its own: a local would
                // stay in this future through the call.
                let parts = {
                    let mut parts = a.parts;
                    if let Some(packed) = a.packed {
                        unpack(&mut parts, packed);
                    }
                    upstream.rewrite(&mut parts, a.origin);
                    parts
                };
                // Boxed: the forwarding state (upstream connect, TLS, the
                // call) is large and only exists once the request departs,
                // so a waiting request holds none of it.
                let departed = (&a.key, a.cost, a.arrival);
                Box::pin(self.forward(route, upstream, parts, body, departed, a.switch)).await
            };
            if route.ratelimit_headers {
                self.ratelimit(route, &a.key, &mut response);
            }
            match a.grpc {
                Some(_) => grpc::answer(response),
                None => response,
            }
        }
    }

    /// What an admitted request waits in next; or the answer that refuses
    /// it.
    #[expect(
        clippy::result_large_err,
        reason = "the error is the response itself, returned once; boxing it would add an allocation to every refusal"
    )]
    fn next<'a>(
        &'a self,
        route: &'a Route,
        upstream: &Upstream,
        verdict: Verdict,
        body: &'a mut RequestBody,
        grpc: Option<Option<Duration>>,
        arrival: Instant,
    ) -> Result<
        impl Future<Output = Result<Body, Response<ProxyBody>>> + Send + 'a,
        Response<ProxyBody>,
    > {
        let take = |body: &mut RequestBody| std::mem::replace(body, RequestBody::Empty);
        // What a held request without a body waits in is the hold itself
        // (the body stays with the request, taken at its departure); every
        // other wait is boxed (a staged body, a gRPC deadline), so that it
        // does not size the common one.
        Ok(match verdict {
            // A gRPC call is never staged, even for an upstream that may
            // pause: it may stream both ways. So it is never sent twice.
            Verdict::Go if upstream.stages_everything() && grpc.is_none() => {
                Either::Right(Box::pin(self.stage(route, take(body))) as Waits<'a>)
            }
            Verdict::Go => Either::Left(Either::Left(ready(Ok(Body::Stream(take(body)))))),
            Verdict::Wait(hold) if grpc.is_some() => {
                let deadline = grpc.flatten().map(|d| arrival + d);
                let call = self.call(route, hold, take(body), deadline);
                Either::Right(Box::pin(call) as Waits<'a>)
            }
            Verdict::Wait(hold) if body.is_end_stream() => {
                Either::Left(Either::Right(hold.departed().map(move |d| match d {
                    Ok(()) => Ok(Body::Stream(take(body))),
                    Err(e) => Err(self.hold_failed(route, e)),
                })))
            }
            Verdict::Wait(hold) => {
                Either::Right(Box::pin(self.wait(route, hold, take(body))) as Waits<'a>)
            }
            refused => return Err(self.refusal(route, refused)),
        })
    }

    /// Wait for the departure while the body is staged. A body that
    /// cannot be staged ends the wait: a client gone is counted as
    /// cancelled (by the dropped hold), a refused body as what it got.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps a second copy of each argument in a held request's state"
    )]
    fn wait<'a>(
        &'a self,
        route: &'a Route,
        mut hold: Hold,
        body: RequestBody,
    ) -> impl Future<Output = Result<Body, Response<ProxyBody>>> + Send + 'a {
        async move {
            let staging = stage(body, &self.shared.staging);
            tokio::pin!(staging);
            let mut staged = None;
            loop {
                tokio::select! {
                    s = &mut staging, if staged.is_none() => match s {
                        Ok(s) => staged = Some(s),
                        Err(refused @ Refused { error: StageError::Gone, .. }) => {
                            drop(hold);
                            return Err(self.stage_failed(route, refused, false));
                        }
                        Err(refused) => {
                            hold.withdraw();
                            return Err(self.stage_failed(route, refused, true));
                        }
                    },
                    d = hold.wait() => match d {
                        Ok(()) => break,
                        Err(e) => return Err(self.hold_failed(route, e)),
                    },
                }
            }
            // Departed; a body still arriving is forwarded once complete.
            match staged {
                Some(s) => Ok(Body::Staged(s)),
                None => staging
                    .await
                    .map(Body::Staged)
                    .map_err(|e| self.stage_failed(route, e, true)),
            }
        }
    }

    /// Stage the body of a request that departs at once (an upstream that
    /// may need it twice).
    async fn stage(&self, route: &Route, body: RequestBody) -> Result<Body, Response<ProxyBody>> {
        stage(body, &self.shared.staging)
            .await
            .map(Body::Staged)
            .map_err(|e| self.stage_failed(route, e, true))
    }

    /// A gRPC call's wait: refused at once when its deadline ends before
    /// its departure; its body is streamed once it departs.
    #[expect(
        clippy::manual_async_fn,
        reason = "an async fn keeps a second copy of each argument in a held request's state"
    )]
    fn call<'a>(
        &'a self,
        route: &'a Route,
        hold: Hold,
        body: RequestBody,
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
            match hold.departed().await {
                Ok(()) => Ok(Body::Stream(body)),
                Err(e) => Err(self.hold_failed(route, e)),
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
        let outcome = match e {
            StageError::TooLarge(_) | StageError::Malformed(_) => Outcome::Invalid,
            StageError::Full => Outcome::Overloaded,
            StageError::Gone => Outcome::Cancelled,
        };
        if count {
            route.rule.count(outcome);
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

    /// The HTTP answer to a refusal: 429 with `Retry-After` for a full
    /// queue or a wait past `max_wait`, 503 for the instance's own bounds.
    fn refusal(&self, route: &Route, verdict: Verdict) -> Response<ProxyBody> {
        match verdict {
            Verdict::Refused {
                why: Refusal::Full,
                retry_after,
            } => route.full.response(Some(retry_after)),
            Verdict::Refused {
                why: Refusal::MaxWait,
                retry_after,
            } => route.max_wait.response(Some(retry_after)),
            Verdict::Overloaded(why) => self.shared.overloaded(why),
            Verdict::Go | Verdict::Wait(_) => problem(
                StatusCode::INTERNAL_SERVER_ERROR,
                "unexpected admission state",
                None,
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
        (key, cost, arrival): (&Key, u32, Instant),
        switch: Option<Box<Switch>>,
    ) -> Response<ProxyBody> {
        let replay = body.out().map(|b| (parts.clone(), b));
        let out = match body {
            Body::Stream(b) => OutBody::Stream(b),
            Body::Staged(ref s) => OutBody::staged(s.data.clone(), s.trailers.clone()),
        };
        let mut parts = parts;
        let permit = match self.in_flight_slot(upstream, &mut parts).await {
            Ok(p) => p,
            Err(response) => {
                route.rule.count(Outcome::Expired);
                return response;
            }
        };
        let (response, outcome, throttle, switched) = upstream.forward(parts, out, permit).await;
        if let Some((client, slot)) = switch.map(|s| *s) {
            if let Some(theirs) = switched {
                self.shared
                    .tunnels
                    .join(&self.tunnels, slot, client, theirs);
            }
            if let Some(until) = throttle {
                self.shared.admission.pause(&route.rule, until);
            }
            route.rule.count(outcome);
            return response;
        }
        let Some(until) = throttle else {
            route.rule.count(outcome);
            return response;
        };
        self.shared.admission.pause(&route.rule, until);
        // Boxed: a throttled answer is rare, and its second send would
        // otherwise double this future's size.
        let throttled = (response, outcome, until);
        Box::pin(self.again(route, upstream, throttled, replay, (key, cost, arrival))).await
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
        (key, cost, arrival): (&Key, u32, Instant),
    ) -> Response<ProxyBody> {
        let admission = &self.shared.admission;
        let within_max_wait = route
            .rule
            .policy()
            .max_wait
            .is_none_or(|mw| until <= arrival + Duration::from_nanos(mw));
        let Some((mut parts, out)) = replay.filter(|(p, _)| safe_to_repeat(p) && within_max_wait)
        else {
            route.rule.count(outcome);
            return response;
        };
        // Keep the upstream's answer, to give it if the retry cannot go.
        let Some(kept) = keep(response).await else {
            route.rule.count(Outcome::UpstreamError);
            return problem(
                StatusCode::BAD_GATEWAY,
                "the upstream's answer was cut short",
                None,
            );
        };
        let again = match admission
            .admit(&route.rule, key.clone(), cost, Instant::now())
            .await
        {
            Verdict::Go => true,
            Verdict::Wait(hold) => hold.departed().await.is_ok(),
            _ => false,
        };
        if !again {
            route.rule.count(outcome);
            return kept;
        }
        let permit = match self.in_flight_slot(upstream, &mut parts).await {
            Ok(p) => p,
            Err(response) => {
                route.rule.count(Outcome::Expired);
                return response;
            }
        };
        let (response, outcome, _, _) = upstream.forward(parts, out, permit).await;
        route.rule.count(outcome);
        response
    }

    /// Released by the shaper: wait for one of the upstream's
    /// `max_concurrency` slots (first come, first served, as calls end).
    /// The wait counts against `max_queued`, lasts at most the upstream's
    /// `request_timeout` (504), and ends with 503 when the drain gives up.
    /// The request's head is packed while it waits, as in the queue.
    async fn in_flight_slot(
        &self,
        upstream: &Upstream,
        head: &mut Parts,
    ) -> Result<Option<OwnedSemaphorePermit>, Response<ProxyBody>> {
        let Some(sem) = upstream.concurrency() else {
            return Ok(None);
        };
        if let Ok(p) = sem.clone().try_acquire_owned() {
            return Ok(Some(p));
        }
        let admission = &self.shared.admission;
        let Some(_room) = admission.reserve_wait() else {
            return Err(self.shared.overloaded(Overload::Queued));
        };
        let packed = pack(head);
        let slot = tokio::select! {
            p = sem.clone().acquire_owned() => Ok(p.ok()),
            () = tokio::time::sleep(upstream.request_timeout()) => Err(problem(
                StatusCode::GATEWAY_TIMEOUT,
                "no upstream slot (max_concurrency) became free in time",
                None,
            )),
            () = admission.closing().cancelled() => Err(problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "sluice is shutting down; this request was not forwarded",
                Some(Duration::from_secs(1)),
            )),
        };
        unpack(head, packed);
        slot
    }

    fn ratelimit(&self, route: &Route, key: &Key, response: &mut Response<ProxyBody>) {
        let admission = &self.shared.admission;
        let view = admission.view(&route.rule, key);
        add_ratelimit_headers(route, view, admission.now(), response.headers_mut());
    }
}

/// Whether sending a request twice is safe: a method RFC 9110 (9.2.2)
/// calls idempotent, or an `Idempotency-Key` the upstream deduplicates by.
pub(super) fn safe_to_repeat(parts: &Parts) -> bool {
    matches!(
        parts.method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    ) || parts.headers.contains_key("idempotency-key")
}

/// Read a (small) response in full so it can be answered later; `None`
/// when it is too large or cut short.
async fn keep(response: Response<ProxyBody>) -> Option<Response<ProxyBody>> {
    let (parts, body) = response.into_parts();
    let limited = http_body_util::Limited::new(body, MAX_KEPT_THROTTLE_BODY);
    let bytes: Bytes = limited.collect().await.ok()?.to_bytes();
    Some(Response::from_parts(parts, full(bytes)))
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
