//! An upstream's own limit: when a 429 or 503 says when to come back
//! (`Retry-After` in seconds or as an HTTP-date, RFC 9110 10.2.3; or an IETF
//! `RateLimit` header with `r=0;t=N`, draft-ietf-httpapi-ratelimit-headers
//! -10), or a gRPC server pushes back (a trailers-only answer of
//! RESOURCE_EXHAUSTED or UNAVAILABLE with `grpc-retry-pushback-ms`, gRPC's
//! retry design A6), the instant releases to it should resume.

use std::time::{Duration, Instant, SystemTime};

use http::{HeaderMap, StatusCode};

const RATELIMIT: &str = "ratelimit";

/// When an upstream that answered `status` with `headers` wants to be
/// called again, if it said so; never later than `max` from now.
pub fn pause_until(status: StatusCode, headers: &HeaderMap, max: Duration) -> Option<Instant> {
    Some(Instant::now() + asked(status, headers)?.min(max))
}

/// How long an upstream that answered `status` with `headers` asked not to
/// be called, if it said.
pub fn asked(status: StatusCode, headers: &HeaderMap) -> Option<Duration> {
    match status {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
            retry_after(headers).or_else(|| ratelimit_reset(headers))
        }
        StatusCode::OK => grpc_pushback(headers),
        _ => None,
    }
}

/// A gRPC server's pushback: `grpc-status: 8` (RESOURCE_EXHAUSTED) or `14`
/// (UNAVAILABLE) with `grpc-retry-pushback-ms: N` in a trailers-only answer
/// (the status in the headers, no body). A status in trailers after a body
/// comes too late to hold the next release and is not read; a pushback that
/// is not a non-negative integer means "do not retry" in A6 and pauses
/// nothing.
fn grpc_pushback(headers: &HeaderMap) -> Option<Duration> {
    let status = headers.get("grpc-status")?.as_bytes();
    if status != b"8" && status != b"14" {
        return None;
    }
    let ms = headers
        .get("grpc-retry-pushback-ms")?
        .to_str()
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_millis(ms))
}

/// `Retry-After: 120` or `Retry-After: Wed, 21 Oct 2015 07:28:00 GMT`.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let text = headers
        .get(http::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = text.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// `RateLimit: "default";r=0;t=10`: a policy with nothing remaining, and
/// the seconds until it resets (the longest, if several are exhausted).
fn ratelimit_reset(headers: &HeaderMap) -> Option<Duration> {
    let mut longest: Option<u64> = None;
    for value in headers.get_all(RATELIMIT) {
        let Ok(list) = sfv::Parser::parse_list(value.as_bytes()) else {
            continue;
        };
        for member in list {
            let sfv::ListEntry::Item(item) = member else {
                continue;
            };
            let param = |name: &str| item.params.get(name).and_then(sfv::BareItem::as_int);
            if param("r") == Some(0)
                && let Some(t) = param("t").and_then(|t| u64::try_from(t).ok())
            {
                longest = Some(longest.map_or(t, |l| l.max(t)));
            }
        }
    }
    longest.map(Duration::from_secs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    fn wait(status: StatusCode, pairs: &[(&'static str, &'static str)]) -> Option<u64> {
        pause_until(status, &headers(pairs), Duration::from_secs(3_600)).map(|at| {
            at.saturating_duration_since(Instant::now())
                .as_secs_f64()
                .round() as u64
        })
    }

    #[test]
    fn retry_after_seconds_pause_a_429_or_503() {
        assert_eq!(
            wait(StatusCode::TOO_MANY_REQUESTS, &[("retry-after", "2")]),
            Some(2)
        );
        assert_eq!(
            wait(StatusCode::SERVICE_UNAVAILABLE, &[("retry-after", "30")]),
            Some(30)
        );
        assert_eq!(wait(StatusCode::OK, &[("retry-after", "2")]), None);
        assert_eq!(wait(StatusCode::TOO_MANY_REQUESTS, &[]), None);
    }

    #[test]
    fn retry_after_as_an_http_date() {
        let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(90));
        let mut h = HeaderMap::new();
        h.insert("retry-after", HeaderValue::from_str(&at).unwrap());
        let until = pause_until(
            StatusCode::TOO_MANY_REQUESTS,
            &h,
            Duration::from_secs(3_600),
        )
        .unwrap();
        let secs = until.saturating_duration_since(Instant::now()).as_secs();
        assert!((88..=90).contains(&secs), "{secs}");
    }

    #[test]
    fn ratelimit_with_nothing_remaining_pauses_until_the_reset() {
        assert_eq!(
            wait(
                StatusCode::TOO_MANY_REQUESTS,
                &[("ratelimit", "\"default\";r=0;t=7")]
            ),
            Some(7)
        );
        assert_eq!(
            wait(
                StatusCode::TOO_MANY_REQUESTS,
                &[("ratelimit", "\"a\";r=3;t=7, \"b\";r=0;t=12")]
            ),
            Some(12)
        );
        assert_eq!(
            wait(
                StatusCode::TOO_MANY_REQUESTS,
                &[("ratelimit", "\"a\";r=3;t=7")]
            ),
            None
        );
        assert_eq!(
            wait(
                StatusCode::TOO_MANY_REQUESTS,
                &[("ratelimit", "not a list (")]
            ),
            None
        );
    }

    #[test]
    fn a_grpc_pushback_pauses_a_trailers_only_throttle() {
        let ms = |pairs: &[(&'static str, &'static str)]| {
            pause_until(StatusCode::OK, &headers(pairs), Duration::from_secs(3_600))
                .map(|at| at.saturating_duration_since(Instant::now()).as_millis() as u64)
        };
        let busy = ms(&[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")]).unwrap();
        assert!((1_400..=1_500).contains(&busy), "{busy}");
        let down = ms(&[("grpc-status", "14"), ("grpc-retry-pushback-ms", "250")]).unwrap();
        assert!((150..=250).contains(&down), "{down}");
        // No pushback, a negative one (A6: do not retry), another status,
        // or a plain 200: nothing to wait for.
        assert_eq!(ms(&[("grpc-status", "8")]), None);
        assert_eq!(
            ms(&[("grpc-status", "8"), ("grpc-retry-pushback-ms", "-1")]),
            None
        );
        assert_eq!(
            ms(&[("grpc-status", "2"), ("grpc-retry-pushback-ms", "100")]),
            None
        );
        assert_eq!(ms(&[("retry-after", "2")]), None);
        // The same headers on a 429 are HTTP's business, not gRPC's.
        assert_eq!(
            wait(
                StatusCode::TOO_MANY_REQUESTS,
                &[("grpc-status", "8"), ("grpc-retry-pushback-ms", "1500")]
            ),
            None
        );
    }

    #[test]
    fn a_pause_is_never_longer_than_the_bound() {
        let h = headers(&[("retry-after", "31536000")]);
        let until =
            pause_until(StatusCode::TOO_MANY_REQUESTS, &h, Duration::from_secs(60)).unwrap();
        assert!(until.saturating_duration_since(Instant::now()) <= Duration::from_secs(60));
    }
}
