//! Responses sluice makes itself: RFC 9457 `application/problem+json`
//! bodies with a short human text, and the shared response body type.
//! Bodies that are answered often (refusals) are rendered once per route.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};

/// Body of every response sluice sends: proxied bodies stream through,
/// local ones are complete buffers.
pub type ProxyBody = BoxBody<Bytes, BodyError>;

/// What a response body's failure is: hyper's, sluice's own client's, or
/// an upstream that stopped sending it.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error(transparent)]
    Hyper(#[from] hyper::Error),
    #[error(transparent)]
    Upstream(#[from] super::client::Error),
    #[error("the upstream sent nothing of its answer for {0:?}")]
    Stalled(Duration),
}

/// A complete body.
pub fn full(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never: Infallible| match never {})
        .boxed()
}

/// Whole seconds for `Retry-After`: rounded up, at least 1 (DESIGN 1).
pub fn retry_after_secs(wait: Duration) -> u64 {
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    secs.max(1)
}

/// Nanoseconds as whole seconds, rounded up (0 stays 0).
pub fn ceil_secs(nanos: u64) -> u64 {
    nanos.div_ceil(1_000_000_000)
}

/// A problem+json document, rendered once.
#[derive(Debug, Clone)]
pub struct Problem {
    status: StatusCode,
    body: Bytes,
    detail: Arc<str>,
}

/// Marks a response sluice made itself (not the upstream's), with what a
/// gRPC client is told instead: the detail and the exact retry time.
#[derive(Debug, Clone)]
pub struct Local {
    pub detail: Arc<str>,
    pub retry_after: Option<Duration>,
    /// A 504 for the client's own deadline (`grpc-timeout`), not one of
    /// sluice's or the upstream's timeouts.
    pub deadline: bool,
}

impl Problem {
    pub fn new(status: StatusCode, detail: &str) -> Problem {
        let body = serde_json::json!({
            "type": "about:blank",
            "title": status.canonical_reason().unwrap_or("Error"),
            "status": status.as_u16(),
            "detail": detail,
        });
        Problem {
            status,
            body: Bytes::from(body.to_string()),
            detail: Arc::from(detail),
        }
    }

    /// The response, with `Retry-After` when given.
    pub fn response(&self, retry_after: Option<Duration>) -> Response<ProxyBody> {
        let mut response = Response::new(full(self.body.clone()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(wait) = retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(retry_after_secs(wait)));
        }
        response.extensions_mut().insert(Local {
            detail: self.detail.clone(),
            retry_after,
            deadline: false,
        });
        response
    }
}

/// A 504 for a call whose own deadline (`grpc-timeout`) passed: gRPC's
/// DEADLINE_EXCEEDED, where sluice's and the upstream's timeouts are
/// UNAVAILABLE (which a client's retry policy may retry).
pub fn deadline_passed(detail: &str) -> Response<ProxyBody> {
    let mut response = problem(StatusCode::GATEWAY_TIMEOUT, detail, None);
    if let Some(local) = response.extensions_mut().get_mut::<Local>() {
        local.deadline = true;
    }
    response
}

/// A problem+json response rendered on the spot (rare answers).
pub fn problem(
    status: StatusCode,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response<ProxyBody> {
    Problem::new(status, detail).response(retry_after)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds_at_least_one() {
        assert_eq!(retry_after_secs(Duration::from_nanos(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(999)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(1)), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(1001)), 2);
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
    }
}
