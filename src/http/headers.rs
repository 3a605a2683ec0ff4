//! Header rewriting: hop-by-hop removal (RFC 9110 7.6.1), the forwarding
//! headers (`X-Forwarded-*`, `Via`), and the IETF `RateLimit` headers.

use std::io::Write as _;
use std::net::IpAddr;

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::uri::PathAndQuery;
use http::{Uri, Version};

use super::response::ceil_secs;
use super::route::Route;
use crate::admission::{ClientView, Nanos};
use http::header::{
    CONNECTION, HeaderMap, HeaderName, HeaderValue, TE, TRANSFER_ENCODING, UPGRADE, VIA,
};

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Copy `headers`' values, and `target` before them, into one buffer of
/// their own; returns the target's copy.
///
/// hyper parses an HTTP/1.1 head in place: its values are slices of the
/// connection's 8 KiB read buffer, so that buffer stays referenced for as
/// long as the request lives, and hyper allocates another for the
/// connection's next read (HTTP/2's values are slices of the frame's).
/// Copied out (one allocation of the head's size), the head lets hyper
/// read on into the buffer it has. A value the
/// copy would not accept (none that hyper parsed) stays as it was.
pub fn detach(headers: &mut HeaderMap, target: &[u8]) -> Bytes {
    let len = target.len() + headers.values().map(HeaderValue::len).sum::<usize>();
    let mut buf = BytesMut::with_capacity(len);
    buf.extend_from_slice(target);
    for v in headers.values() {
        buf.extend_from_slice(v.as_bytes());
    }
    let buf = buf.freeze();
    let mut at = target.len();
    for v in headers.values_mut() {
        let n = v.len();
        if let Ok(mut copy) = HeaderValue::from_maybe_shared(buf.slice(at..at + n)) {
            copy.set_sensitive(v.is_sensitive());
            *v = copy;
        }
        at += n;
    }
    buf.slice(..target.len())
}

/// [`detach`] a request head that hyper parsed: its header values and its
/// path and query go into one buffer of their own. (sluice's own HTTP/1.1
/// reads a head into a buffer of the head's size, so its requests need
/// none of this: [`super::h1`].)
pub fn detach_head(parts: &mut Parts) {
    let Some(pq) = parts.uri.path_and_query() else {
        detach(&mut parts.headers, b"");
        return;
    };
    let target = detach(&mut parts.headers, pq.as_str().as_bytes());
    let mut uri = parts.uri.clone().into_parts();
    uri.path_and_query = PathAndQuery::from_maybe_shared(target).ok();
    if let Ok(uri) = Uri::from_parts(uri) {
        parts.uri = uri;
    }
}

/// Remove the hop-by-hop headers: `Connection` and every header it names,
/// `Keep-Alive`, `Proxy-Connection`, `TE`, `Transfer-Encoding`, `Upgrade`
/// (RFC 9110 7.6.1).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(CONNECTION) {
        strip_connection_named(headers);
    }
    for name in [
        CONNECTION,
        KEEP_ALIVE,
        PROXY_CONNECTION,
        TE,
        TRANSFER_ENCODING,
        UPGRADE,
    ] {
        headers.remove(name);
    }
}

/// The protocol a request asks to switch to (`Connection: upgrade` with
/// an `Upgrade` header), before the hop-by-hop headers go.
pub fn upgrade_to(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| headers.get(UPGRADE).cloned()).flatten()
}

/// Whether the client accepts trailers (`TE: trailers`, which gRPC
/// requires end to end).
pub fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
}

/// Remove the headers `Connection` names.
fn strip_connection_named(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
}

/// The protocol token of `Via` for a message of `version` (RFC 9110 7.6.3).
fn via_value(version: Version) -> HeaderValue {
    HeaderValue::from_static(match version {
        Version::HTTP_09 => "0.9 sluice",
        Version::HTTP_10 => "1.0 sluice",
        Version::HTTP_2 => "2 sluice",
        Version::HTTP_3 => "3 sluice",
        _ => "1.1 sluice",
    })
}

/// Add this hop to `Via`.
pub fn append_via(headers: &mut HeaderMap, version: Version) {
    headers.append(VIA, via_value(version));
}

/// Add the `X-Forwarded-*` headers for a request from `peer`: the peer is
/// appended to any `X-Forwarded-For` list already present.
pub fn add_forwarded(headers: &mut HeaderMap, peer: IpAddr, host: Option<&HeaderValue>) {
    // Written on the stack: an address is at most 39 bytes.
    let mut buf = [0u8; 48];
    let mut cursor = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(cursor, "{peer}");
    let n = cursor.position() as usize;
    let peer = &buf[..n];
    let value = match headers.get(&X_FORWARDED_FOR).map(HeaderValue::as_bytes) {
        Some(prior) if !prior.trim_ascii().is_empty() => {
            let mut v = Vec::with_capacity(prior.len() + 2 + n);
            v.extend_from_slice(prior);
            v.extend_from_slice(b", ");
            v.extend_from_slice(peer);
            HeaderValue::from_bytes(&v)
        }
        _ => HeaderValue::from_bytes(peer),
    };
    if let Ok(v) = value {
        headers.insert(X_FORWARDED_FOR, v);
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    if let Some(host) = host {
        headers.insert(X_FORWARDED_HOST, host.clone());
    }
}

/// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-
/// headers-10, Structured Fields): the quota is the route's capacity over
/// the time its rate takes to drain it; remaining is the capacity not
/// waiting now; reset is the time until this client's queue has drained.
/// Whole seconds.
pub fn add_ratelimit_headers(
    route: &Route,
    view: Option<ClientView>,
    now: Nanos,
    headers: &mut HeaderMap,
) {
    let policy = route.rule.policy();
    let capacity = u64::from(policy.capacity);
    let window = ceil_secs(policy.rate.interval_nanos().saturating_mul(capacity.max(1)));
    let (waiting, reset) = match view {
        Some(v) => (
            v.waiting_cost,
            ceil_secs(v.next_departure.saturating_sub(now)),
        ),
        None => (0, 0),
    };
    let remaining = capacity.saturating_sub(waiting);
    let name = &route.name;
    if let Ok(v) = HeaderValue::from_str(&format!("\"{name}\";q={capacity};w={window}")) {
        headers.insert(RATELIMIT_POLICY, v);
    }
    if let Ok(v) = HeaderValue::from_str(&format!("\"{name}\";r={remaining};t={reset}")) {
        headers.insert(RATELIMIT, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detach_copies_every_value_out_of_the_read_buffer() {
        let read = Bytes::from_static(b"/a?b=1 example.org k secret");
        let within = |b: &[u8]| {
            let r = read.as_ptr() as usize..read.as_ptr() as usize + read.len();
            r.contains(&(b.as_ptr() as usize))
        };
        let mut h = HeaderMap::new();
        let value =
            |r: std::ops::Range<usize>| HeaderValue::from_maybe_shared(read.slice(r)).unwrap();
        h.insert("host", value(7..18));
        h.append("x-client", value(19..20));
        h.append("x-client", value(7..18));
        let mut secret = value(21..27);
        secret.set_sensitive(true);
        h.insert("authorization", secret);
        assert!(h.values().all(|v| within(v.as_bytes())));

        let target = detach(&mut h, &read[..6]);
        assert_eq!(&target[..], b"/a?b=1");
        assert!(!within(&target));
        assert!(h.values().all(|v| !within(v.as_bytes())));
        assert_eq!(h["host"], "example.org");
        let clients: Vec<_> = h.get_all("x-client").iter().collect();
        assert_eq!(clients, ["k", "example.org"]);
        assert_eq!(h["authorization"], "secret");
        assert!(h["authorization"].is_sensitive());
    }

    #[test]
    fn detach_head_copies_the_path_and_query_too() {
        let read = Bytes::from_static(b"/a?b=1 k");
        let within = |b: &[u8]| {
            let r = read.as_ptr() as usize..read.as_ptr() as usize + read.len();
            r.contains(&(b.as_ptr() as usize))
        };
        let uri = Uri::from_maybe_shared(read.slice(..6)).unwrap();
        let (mut parts, ()) = http::Request::builder()
            .uri(uri)
            .header(
                "x-client",
                HeaderValue::from_maybe_shared(read.slice(7..)).unwrap(),
            )
            .body(())
            .unwrap()
            .into_parts();
        assert!(within(parts.uri.path().as_bytes()));
        detach_head(&mut parts);
        assert_eq!(parts.uri, "/a?b=1");
        assert!(!within(parts.uri.path().as_bytes()));
        assert_eq!(parts.headers["x-client"], "k");
        assert!(!within(parts.headers["x-client"].as_bytes()));
    }

    #[test]
    fn connection_named_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(CONNECTION, HeaderValue::from_static("close, x-secret"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn forwarded_for_appends_the_peer() {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.9"));
        add_forwarded(
            &mut h,
            "127.0.0.1".parse().unwrap(),
            Some(&HeaderValue::from_static("example")),
        );
        assert_eq!(h[&X_FORWARDED_FOR], "203.0.113.9, 127.0.0.1");
        assert_eq!(h[&X_FORWARDED_HOST], "example");
        assert_eq!(h[&X_FORWARDED_PROTO], "http");
    }
}
