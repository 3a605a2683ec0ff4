//! gRPC calls (`content-type: application/grpc`, `application/grpc+proto`
//! ...; not gRPC-Web, which is answered as HTTP): shaped like any request,
//! but what sluice answers itself speaks gRPC. A refusal is HTTP 200 with
//! `grpc-status` in a trailers-only response (one HEADERS frame that ends
//! the stream), a `grpc-message` saying when to retry, and that time in
//! `grpc-retry-pushback-ms` (the gRPC retry design's server pushback).
//! The codes are what each answer means, as a gRPC server would say it:
//! RESOURCE_EXHAUSTED for a rate or size refusal (429, 413, as Envoy's
//! rate limit filter can), UNAVAILABLE for what another try may get past
//! (502, 503, and a 504 of sluice's or the upstream's timeouts),
//! DEADLINE_EXCEEDED only for the call's own deadline, INVALID_ARGUMENT
//! for a 400 and UNIMPLEMENTED for no route (404).

use std::time::{Duration, Instant};

use http::header::{CONTENT_TYPE, HeaderMap, HeaderValue};
use http::{Response, StatusCode};
use percent_encoding::{AsciiSet, CONTROLS, utf8_percent_encode};

use super::headers::{RATELIMIT, RATELIMIT_POLICY};
use super::response::{Local, ProxyBody, full};

/// gRPC status codes sluice answers with.
const INVALID_ARGUMENT: u8 = 3;
const DEADLINE_EXCEEDED: u8 = 4;
const RESOURCE_EXHAUSTED: u8 = 8;
const UNIMPLEMENTED: u8 = 12;
const INTERNAL: u8 = 13;
const UNAVAILABLE: u8 = 14;

/// What `grpc-message` percent-encodes (the gRPC HTTP/2 spec: everything
/// outside printable ASCII, and '%').
const MESSAGE: &AsciiSet = &CONTROLS.add(b'%');

/// Whether a request is a gRPC call: `application/grpc`, alone or with a
/// `+format` or parameters; not `application/grpc-web` (its clients read
/// HTTP answers, and a refusal's content type would have told them gRPC).
pub fn is_grpc(headers: &HeaderMap) -> bool {
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.get(.."application/grpc".len())
                .map(|head| (head, &v[head.len()..]))
        })
        .is_some_and(|(head, rest)| {
            head.eq_ignore_ascii_case("application/grpc")
                && (rest.is_empty() || rest.starts_with(['+', ';']))
        })
}

/// Whether the request is a Connect protocol streaming call
/// (`application/connect+proto`, `+json`): its body streams for as long
/// as the call lasts, so it is not held to an upload's pace.
pub fn is_connect_stream(headers: &HeaderMap) -> bool {
    const STREAM: &str = "application/connect+";
    headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.get(..STREAM.len()))
        .is_some_and(|head| head.eq_ignore_ascii_case(STREAM))
}

/// The call's `grpc-timeout` (an integer of at most 8 digits and a unit:
/// H, M, S, m, u, n).
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let v = headers.get("grpc-timeout")?.to_str().ok()?;
    let unit = v.chars().last()?;
    let digits = &v[..v.len() - unit.len_utf8()];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        'H' => Duration::from_secs(n.saturating_mul(3600)),
        'M' => Duration::from_secs(n.saturating_mul(60)),
        'S' => Duration::from_secs(n),
        'm' => Duration::from_millis(n),
        'u' => Duration::from_micros(n),
        'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A call that waited in the queue tells the upstream what is left of its
/// deadline, not the whole of it (a server plans its work by
/// `grpc-timeout`, and the client gives up at its own deadline): the
/// header is rewritten to the time left, in whole milliseconds rounded
/// up. `Err` when nothing is left.
pub fn spend(headers: &mut HeaderMap, arrival: Instant, timeout: Duration) -> Result<(), ()> {
    let waited = arrival.elapsed();
    // Not worth a rewrite: the upstream's own clock is no finer.
    if waited < Duration::from_millis(1) {
        return Ok(());
    }
    let left = timeout
        .checked_sub(waited)
        .filter(|d| !d.is_zero())
        .ok_or(())?;
    let ms = left.as_nanos().div_ceil(1_000_000);
    // At most 8 digits (the spec's limit): seconds past 99,999,999 ms.
    let value = if ms <= 99_999_999 {
        format!("{ms}m")
    } else {
        format!("{}S", left.as_secs().min(99_999_999))
    };
    if let Ok(v) = HeaderValue::from_str(&value) {
        headers.insert("grpc-timeout", v);
    }
    Ok(())
}

/// A response sluice made itself, in gRPC form; the upstream's responses
/// pass unchanged.
pub fn answer(mut response: Response<ProxyBody>) -> Response<ProxyBody> {
    let Some(local) = response.extensions().get::<Local>().cloned() else {
        return response;
    };
    let code = match response.status() {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::PAYLOAD_TOO_LARGE => RESOURCE_EXHAUSTED,
        StatusCode::GATEWAY_TIMEOUT if local.deadline => DEADLINE_EXCEEDED,
        StatusCode::GATEWAY_TIMEOUT => UNAVAILABLE,
        StatusCode::BAD_GATEWAY | StatusCode::SERVICE_UNAVAILABLE => UNAVAILABLE,
        StatusCode::BAD_REQUEST => INVALID_ARGUMENT,
        StatusCode::NOT_FOUND => UNIMPLEMENTED,
        _ => INTERNAL,
    };
    let mut answer = refusal(code, &local.detail, local.retry_after);
    // The RateLimit fields (`ratelimit_headers`) go out as metadata: a
    // client told to back off by the status can read its budget too.
    for name in [RATELIMIT_POLICY, RATELIMIT] {
        if let Some(v) = response.headers_mut().remove(&name) {
            answer.headers_mut().insert(name, v);
        }
    }
    answer
}

/// A trailers-only gRPC response.
fn refusal(code: u8, detail: &str, retry_after: Option<Duration>) -> Response<ProxyBody> {
    let message = match retry_after {
        Some(wait) => format!("{detail} (retry in {} ms)", wait.as_millis().max(1)),
        None => detail.to_owned(),
    };
    let mut response = Response::new(full(bytes::Bytes::new()));
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    headers.insert("grpc-status", HeaderValue::from(u16::from(code)));
    if let Ok(v) = HeaderValue::from_str(&utf8_percent_encode(&message, MESSAGE).to_string()) {
        headers.insert("grpc-message", v);
    }
    if let Some(wait) = retry_after {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX).max(1);
        headers.insert("grpc-retry-pushback-ms", HeaderValue::from(ms));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_is_application_grpc_with_a_format_or_parameters_not_grpc_web() {
        let is = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_static(v));
            is_grpc(&h)
        };
        for yes in [
            "application/grpc",
            "application/grpc+proto",
            "application/grpc;charset=utf-8",
            "Application/GRPC",
        ] {
            assert!(is(yes), "{yes}");
        }
        for no in [
            "application/grpc-web",
            "application/grpc-web+proto",
            "application/grpc-web-text",
            "application/grpcx",
            "application/json",
            "application/grp",
        ] {
            assert!(!is(no), "{no}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
    }

    /// A 504 is DEADLINE_EXCEEDED only for the call's own deadline;
    /// sluice's and the upstream's timeouts are UNAVAILABLE.
    #[test]
    fn only_the_calls_own_deadline_is_deadline_exceeded() {
        use super::super::response::{deadline_passed, problem};
        let code = |r: Response<ProxyBody>| answer(r).headers()["grpc-status"].clone();
        assert_eq!(code(deadline_passed("late")), "4");
        assert_eq!(
            code(problem(StatusCode::GATEWAY_TIMEOUT, "slow", None)),
            "14"
        );
        assert_eq!(
            code(problem(StatusCode::TOO_MANY_REQUESTS, "full", None)),
            "8"
        );
    }

    #[test]
    fn a_call_that_waited_tells_the_upstream_what_is_left() {
        let mut h = HeaderMap::new();
        h.insert("grpc-timeout", HeaderValue::from_static("2S"));
        let arrival = Instant::now() - Duration::from_millis(500);
        assert_eq!(spend(&mut h, arrival, Duration::from_secs(2)), Ok(()));
        let left = timeout(&h).unwrap();
        assert!(
            left <= Duration::from_millis(1_500) && left > Duration::from_millis(1_000),
            "{left:?}"
        );
        assert_eq!(spend(&mut h, arrival, Duration::from_millis(400)), Err(()));
        // Past 8 digits of ms: seconds.
        let long = Duration::from_secs(200_000);
        assert_eq!(spend(&mut h, arrival, long), Ok(()));
        assert_eq!(h["grpc-timeout"], "199999S");
    }

    #[test]
    fn grpc_timeouts_parse_as_the_spec_writes_them() {
        let t = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_static(v));
            timeout(&h)
        };
        assert_eq!(t("100m"), Some(Duration::from_millis(100)));
        assert_eq!(t("2S"), Some(Duration::from_secs(2)));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("5u"), Some(Duration::from_micros(5)));
        assert_eq!(t("123456789m"), None);
        assert_eq!(t("m"), None);
        assert_eq!(t("10x"), None);
        assert_eq!(t("-1S"), None);
    }

    #[test]
    fn local_refusals_become_trailers_only_grpc_answers() {
        let local = super::super::response::problem(
            StatusCode::TOO_MANY_REQUESTS,
            "queue full",
            Some(Duration::from_millis(1500)),
        );
        let r = answer(local);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()["grpc-status"], "8");
        assert_eq!(r.headers()["grpc-retry-pushback-ms"], "1500");
        assert_eq!(r.headers()["grpc-message"], "queue full (retry in 1500 ms)");
        use hyper::body::Body as _;
        assert!(r.body().is_end_stream());
        let up = Response::new(full(bytes::Bytes::from_static(b"x")));
        assert!(answer(up).headers().get("grpc-status").is_none());
    }
}
