//! One request's life: pick the route, derive the key and cost, ask the
//! admission layer, map its verdict to HTTP (in [`Handler::refusal`], the
//! one place that does), wait for the departure if told to, forward.
//!
//! A client that goes away while its request is held makes hyper drop this
//! future, and with it the [`Hold`], which withdraws the request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;

use super::Shared;
use super::headers::add_ratelimit_headers;
use super::key;
use super::response::{ProxyBody, problem};
use super::route::{App, Route};
use crate::admission::{HoldError, Key, Overload, Refusal, Verdict};
use crate::metrics::Outcome;

/// Serves the requests of one worker thread.
#[derive(Clone)]
pub struct Handler {
    pub shared: Arc<Shared>,
    /// The worker this handler runs on (its upstream pools).
    pub worker: usize,
}

impl Handler {
    pub async fn handle(&self, req: Request<Incoming>, peer: SocketAddr) -> Response<ProxyBody> {
        let app = self.shared.app(self.worker);
        let Some(route) = app.route(&req) else {
            self.shared.count_unrouted();
            return problem(StatusCode::NOT_FOUND, "no route matches this request", None);
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
                return problem(StatusCode::BAD_REQUEST, &detail, None);
            }
        };
        let shown = route.ratelimit_headers.then(|| key.clone());
        let verdict = self.shared.admission.admit(&route.rule, key, cost).await;
        let mut response = match verdict {
            Verdict::Go => self.forward(&app, route, req, peer).await,
            Verdict::Wait(hold) => match hold.departed().await {
                Ok(()) => self.forward(&app, route, req, peer).await,
                Err(HoldError::Expired) => route.expired.response(Some(
                    route
                        .rule
                        .policy()
                        .max_wait
                        .map_or(Duration::from_secs(1), Duration::from_nanos),
                )),
                Err(HoldError::Closed) => problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "sluice is shutting down; this request was not forwarded",
                    Some(Duration::from_secs(1)),
                ),
            },
            refused => self.refusal(route, refused),
        };
        if let Some(key) = shown {
            self.ratelimit(route, &key, &mut response);
        }
        response
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

    async fn forward(
        &self,
        app: &App,
        route: &Route,
        req: Request<Incoming>,
        peer: SocketAddr,
    ) -> Response<ProxyBody> {
        let Some(upstream) = app.upstreams.get(route.upstream) else {
            route.rule.count(Outcome::UpstreamError);
            return problem(StatusCode::BAD_GATEWAY, "no such upstream", None);
        };
        let (response, outcome) = upstream.forward(req, peer).await;
        route.rule.count(outcome);
        response
    }

    fn ratelimit(&self, route: &Route, key: &Key, response: &mut Response<ProxyBody>) {
        let admission = &self.shared.admission;
        let view = admission.view(&route.rule, key);
        add_ratelimit_headers(route, view, admission.now(), response.headers_mut());
    }
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
