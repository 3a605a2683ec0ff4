//! Header rewriting: hop-by-hop removal (RFC 9110 7.6.1), the forwarding
//! headers (`X-Forwarded-*`, `Via`), and the IETF `RateLimit` headers.

use std::io::Write as _;
use std::net::IpAddr;

use bytes::{BufMut, Bytes, BytesMut};
use http::request::Parts;
use http::uri::InvalidUri;
use http::{Extensions, Method, Request, Uri, Version};
use smallvec::SmallVec;

use super::response::ceil_secs;
use super::route::Route;
use crate::admission::{ClientView, Nanos};
use http::header::{
    CONNECTION, CONTENT_LENGTH, COOKIE, FORWARDED, HeaderMap, HeaderName, HeaderValue, TE,
    TRANSFER_ENCODING, UPGRADE, VIA,
};

const KEEP_ALIVE: HeaderName = HeaderName::from_static("keep-alive");
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
pub(super) const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(super) const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// A waiting request's head, packed into memory of its own size: the
/// target and the header fields in one buffer, the method, version and
/// extensions beside it ([`pack`], [`Packed::unpack`]).
///
/// After the target, `name:value\n` per field in order (`;` for a sensitive
/// value): neither a name nor a value can hold `\n`, nor a name `:` or `;`.
pub struct Packed {
    buf: Bytes,
    /// Where the fields start in `buf` (the target ends).
    fields: usize,
    method: Method,
    version: Version,
    extensions: Extensions,
}

/// Pack the head of a request that waits ([`Packed`]).
///
/// A head as parsed is much larger than its text. hyper's HTTP/1.1 values
/// are slices of the connection's 8 KiB read buffer and HTTP/2's of the
/// frame's, which a held request would keep referenced; a header table is
/// 104 bytes per field with room for six at its first (656 bytes for a
/// request with two fields); and a target (`Uri`) is 88 bytes before its
/// text. A request that departs at once keeps its head as parsed: only
/// requests that wait pay for the copy and the rebuild, and they leave at
/// the configured rate.
pub fn pack(parts: Parts) -> Packed {
    let Parts {
        method,
        uri,
        version,
        headers,
        extensions,
        ..
    } = parts;
    let mut len = uri.path_and_query().map_or(1, |pq| pq.as_str().len());
    if let Some(a) = uri.authority() {
        len += a.as_str().len() + uri.scheme_str().map_or(0, str::len) + 3;
    }
    for (name, value) in &headers {
        len += name.as_str().len() + value.len() + 2;
    }
    let mut buf = BytesMut::with_capacity(len);
    // A target's text parses back to the same target.
    let _ = write!((&mut buf).writer(), "{uri}");
    let fields = buf.len();
    for (name, value) in &headers {
        buf.extend_from_slice(name.as_str().as_bytes());
        buf.extend_from_slice(if value.is_sensitive() { b";" } else { b":" });
        buf.extend_from_slice(value.as_bytes());
        buf.extend_from_slice(b"\n");
    }
    Packed {
        buf: buf.freeze(),
        fields,
        method,
        version,
        extensions,
    }
}

impl Packed {
    /// The head as it was packed (its values and target are slices of
    /// the packed buffer); `Err` only if its target did not parse back,
    /// which a target's own text always does.
    pub fn unpack(self) -> Result<Parts, InvalidUri> {
        let Packed {
            buf,
            fields,
            method,
            version,
            extensions,
        } = self;
        let uri = Uri::from_maybe_shared(buf.slice(..fields))?;
        let text = &buf[fields..];
        let count = text.iter().filter(|&&b| b == b'\n').count();
        let mut headers = HeaderMap::try_with_capacity(count).unwrap_or_default();
        let mut at = 0;
        while let Some(end) = text[at..].iter().position(|&b| b == b'\n').map(|n| at + n) {
            let line = &text[at..end];
            if let Some(colon) = line.iter().position(|&b| b == b':' || b == b';')
                && let Ok(name) = HeaderName::from_bytes(&line[..colon])
                && let Ok(mut value) =
                    HeaderValue::from_maybe_shared(buf.slice(fields + at + colon + 1..fields + end))
            {
                value.set_sensitive(line[colon] == b';');
                headers.append(name, value);
            }
            at = end + 1;
        }
        let (mut parts, ()) = Request::new(()).into_parts();
        parts.method = method;
        parts.uri = uri;
        parts.version = version;
        parts.headers = headers;
        parts.extensions = extensions;
        Ok(parts)
    }
}

/// Remove the hop-by-hop headers: `Connection` and every header it names,
/// `Keep-Alive`, `Proxy-Connection`, `TE`, `Transfer-Encoding`, `Upgrade`
/// (RFC 9110 7.6.1).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // RFC 9112 6.3: Transfer-Encoding overrides Content-Length, and a
    // proxy must remove the latter (the body was read chunked; a length
    // kept would cut it short on the way out). Seen before `Connection`
    // may have named Transfer-Encoding away.
    if headers.contains_key(TRANSFER_ENCODING) {
        headers.remove(CONTENT_LENGTH);
    }
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
        HTTP2_SETTINGS,
    ] {
        headers.remove(name);
    }
}

/// `HTTP2-Settings`: part of an `h2c` upgrade (RFC 7540 3.2.1), which is
/// never passed on, so never meaningful beyond this hop.
const HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

/// Whether a response's `Transfer-Encoding` names a coding other than
/// `chunked` (`gzip`, say). Its body could only be passed on decoded or
/// mislabelled (the field is hop-by-hop and goes), so such an answer is
/// a 502.
pub fn foreign_transfer_coding(headers: &HeaderMap) -> bool {
    headers.get_all(TRANSFER_ENCODING).iter().any(|v| {
        v.to_str().map_or(true, |v| {
            v.split(',')
                .any(|c| !c.trim().eq_ignore_ascii_case("chunked"))
        })
    })
}

/// The protocol switch a request asks for (`Connection: upgrade` with one
/// `Upgrade` header), before the hop-by-hop headers go; never to HTTP
/// itself (`h2c`, `h2`, `HTTP/2.0`): a backend that accepts `h2c` would
/// take an unshaped HTTP/2 connection through the tunnel, every request
/// on it past the routes and their rates (h2c smuggling). Such a request
/// goes as a plain one, its `Upgrade` dropped.
pub fn upgrade_to(headers: &HeaderMap) -> Option<HeaderValue> {
    let asks = headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    let not_http = |v: &HeaderValue| {
        v.to_str().is_ok_and(|v| {
            v.split(',').all(|p| {
                let name = p.trim().split('/').next().unwrap_or_default();
                !["h2c", "h2", "http"]
                    .iter()
                    .any(|h| name.eq_ignore_ascii_case(h))
            })
        })
    };
    let mut values = headers.get_all(UPGRADE).iter();
    match (asks, values.next(), values.next()) {
        (true, Some(v), None) if not_http(v) => Some(v.clone()),
        _ => None,
    }
}

/// On a request going to an HTTP/1.1 upstream: a `TE` field named in
/// `Connection` as well, as RFC 9110 7.6.1 and 10.1.4 require of its
/// sender (`TE` is hop-by-hop; an upstream or a proxy before it may drop
/// a `TE` that `Connection` does not name, and gRPC over HTTP/1.1 needs
/// `TE: trailers`). Not for HTTP/2, where `Connection` is not allowed.
pub fn name_te_in_connection(headers: &mut HeaderMap) {
    if !headers.contains_key(TE) {
        return;
    }
    let value = match headers.get(CONNECTION) {
        None => HeaderValue::from_static("te"),
        Some(v) => {
            let named = v
                .to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("te")));
            if named {
                return;
            }
            let mut joined = BytesMut::with_capacity(v.len() + 4);
            joined.put_slice(v.as_bytes());
            joined.put_slice(b", te");
            match HeaderValue::from_maybe_shared(joined.freeze()) {
                Ok(v) => v,
                Err(_) => return,
            }
        }
    };
    headers.insert(CONNECTION, value);
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

/// Remove the headers `Connection` names, except those that frame the
/// message or name its host (`Connection: content-length` would unframe
/// it; those are never hop-by-hop), and the `X-Forwarded-*` a proxy in
/// front added (a client naming them would take the chain of addresses
/// that proxy vouched for from the upstream).
fn strip_connection_named(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = connection_named(headers).collect();
    for name in named {
        headers.remove(name);
    }
}

/// The headers `Connection` names that the departure removes (see
/// [`strip_connection_named`] for those it keeps).
fn connection_named(headers: &HeaderMap) -> impl Iterator<Item = HeaderName> + '_ {
    connection_tokens(headers)
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .filter(|name| !kept_when_named(name))
}

/// The tokens of every `Connection` header.
fn connection_tokens(headers: &HeaderMap) -> impl Iterator<Item = &str> {
    headers
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
}

/// Headers a client may name in `Connection` that still reach the
/// upstream.
fn kept_when_named(name: &HeaderName) -> bool {
    [
        CONTENT_LENGTH,
        http::header::HOST,
        X_FORWARDED_FOR,
        X_FORWARDED_PROTO,
        X_FORWARDED_HOST,
    ]
    .contains(name)
}

/// Whether the departure removes `name` as a header `Connection` names:
/// one the upstream never gets. (On the admission path: the tokens are
/// compared as text, no header name is made.)
pub(crate) fn removed_as_hop_by_hop(headers: &HeaderMap, name: &HeaderName) -> bool {
    !kept_when_named(name)
        && connection_tokens(headers).any(|token| token.eq_ignore_ascii_case(name.as_str()))
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

/// The `Cookie` fields (HTTP/2 clients send one per cookie, RFC 9113
/// 8.2.3) joined with "; " into the one value an HTTP/1.1 server reads;
/// `None` when there is none.
pub fn joined_cookie(headers: &HeaderMap) -> Option<HeaderValue> {
    let mut fields = headers.get_all(COOKIE).iter();
    let first = fields.next()?;
    let mut rest = fields.peekable();
    if rest.peek().is_none() {
        return Some(first.clone());
    }
    let mut joined = first.as_bytes().to_vec();
    for v in rest {
        joined.extend_from_slice(b"; ");
        joined.extend_from_slice(v.as_bytes());
    }
    HeaderValue::from_bytes(&joined).ok()
}

/// Several `Cookie` fields made one, in place (for an upstream: many
/// HTTP/1.1 servers read the first `Cookie` line only). A request with one
/// or none is left as it is.
pub fn join_cookies(headers: &mut HeaderMap) {
    if headers.get_all(COOKIE).iter().nth(1).is_some()
        && let Some(one) = joined_cookie(headers)
    {
        headers.insert(COOKIE, one);
    }
}

/// Agreeing repeats of `Content-Length` (`2, 2`, or two lines, which the
/// upstream client accepted as one length) made one field, as RFC 9110
/// 8.6 lets a recipient: a strict client would refuse the list.
pub fn one_length(headers: &mut HeaderMap) {
    let mut values = headers.get_all(CONTENT_LENGTH).iter();
    let repeated = match (values.next(), values.next()) {
        (Some(first), None) => first.as_bytes().contains(&b','),
        (Some(_), Some(_)) => true,
        _ => false,
    };
    if !repeated {
        return;
    }
    let mut lengths = headers
        .get_all(CONTENT_LENGTH)
        .iter()
        .flat_map(|v| v.to_str().unwrap_or("").split(','))
        .map(|n| n.trim().parse::<u64>().ok());
    let first = lengths.next().flatten();
    if let Some(n) = first
        && lengths.all(|m| m == Some(n))
    {
        headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
    }
}

/// Add this hop to `Via`.
pub fn append_via(headers: &mut HeaderMap, version: Version) {
    headers.append(VIA, via_value(version));
}

/// Add the `X-Forwarded-*` headers for a request from `peer`: the peer is
/// appended to any `X-Forwarded-For` list already present. A `trusted`
/// peer (one of `trusted_proxies`: a TLS terminator or load balancer in
/// front) keeps the `X-Forwarded-Proto` and `-Host` it sent, which name
/// the scheme and host its client used, and the rest of what it says of
/// its client (`Forwarded`, `X-Real-IP`, `X-Forwarded-Port`, `-Prefix`
/// and the like); anyone else's are replaced or removed: frameworks build
/// absolute links, redirects and reset URLs from them (Spring prefers
/// `Forwarded`), and a client could name any host there.
pub fn add_forwarded(
    headers: &mut HeaderMap,
    peer: IpAddr,
    trusted: bool,
    host: Option<&HeaderValue>,
) {
    if !trusted {
        remove_forwarded(headers, Some(&X_FORWARDED_FOR));
    }
    let mut buf = [0u8; 48];
    let n = ip_text(peer, &mut buf);
    let peer = &buf[..n];
    // Every prior line, in order, as one list (RFC 9110 5.3: a proxy
    // before us may have added its hop on a line of its own).
    let mut prior = headers
        .get_all(&X_FORWARDED_FOR)
        .iter()
        .map(|v| v.as_bytes().trim_ascii())
        .filter(|v| !v.is_empty())
        .peekable();
    let value = if prior.peek().is_some() {
        let mut v = Vec::with_capacity(64);
        for line in prior {
            v.extend_from_slice(line);
            v.extend_from_slice(b", ");
        }
        v.extend_from_slice(peer);
        HeaderValue::from_bytes(&v)
    } else {
        HeaderValue::from_bytes(peer)
    };
    if let Ok(v) = value {
        headers.insert(X_FORWARDED_FOR, v);
    }
    if !(trusted && headers.contains_key(&X_FORWARDED_PROTO)) {
        headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    }
    if !(trusted && headers.contains_key(&X_FORWARDED_HOST)) {
        // A request with no host at all (HTTP/1.0, an HTTP/2 request
        // without `:authority`): none, rather than the client's own.
        match host {
            Some(host) => headers.insert(X_FORWARDED_HOST, host.clone()),
            None => headers.remove(X_FORWARDED_HOST),
        };
    }
}

/// Remove what names the callers and the way they came (for an upstream
/// with `forwarded_headers = false`, a third party): a caller behind an
/// internal load balancer brings `X-Forwarded-*` (Traefik adds `-Server`,
/// `-Port`, `-Prefix` too), `X-Real-IP` or `Forwarded` fields with
/// internal addresses and host names in them.
pub fn strip_forwarded(headers: &mut HeaderMap) {
    remove_forwarded(headers, None);
}

/// Remove every `X-Forwarded-*` field but `kept`, `X-Real-IP` and
/// `Forwarded`.
fn remove_forwarded(headers: &mut HeaderMap, kept: Option<&HeaderName>) {
    let named: SmallVec<[HeaderName; 4]> = headers
        .keys()
        .filter(|n| {
            (n.as_str().starts_with("x-forwarded-") && Some(*n) != kept)
                || *n == X_REAL_IP
                || *n == FORWARDED
        })
        .cloned()
        .collect();
    for name in named {
        headers.remove(name);
    }
}

/// `ip` as text in `buf` (an address is at most 45 bytes); its length.
/// IPv4 by hand: the formatter's machinery cost more per forwarded
/// request than the rest of [`add_forwarded`].
fn ip_text(ip: IpAddr, buf: &mut [u8; 48]) -> usize {
    match ip {
        IpAddr::V4(v4) => {
            let mut n = 0;
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    buf[n] = b'.';
                    n += 1;
                }
                if octet >= 100 {
                    buf[n] = b'0' + octet / 100;
                    n += 1;
                }
                if octet >= 10 {
                    buf[n] = b'0' + octet / 10 % 10;
                    n += 1;
                }
                buf[n] = b'0' + octet % 10;
                n += 1;
            }
            n
        }
        IpAddr::V6(_) => {
            let mut cursor = std::io::Cursor::new(&mut buf[..]);
            let _ = write!(cursor, "{ip}");
            usize::try_from(cursor.position()).unwrap_or(0)
        }
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

    fn map(fields: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in fields {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn a_switch_to_http_itself_is_never_passed_on() {
        let ask =
            |to: &'static str| upgrade_to(&map(&[("connection", "Upgrade"), ("upgrade", to)]));
        assert_eq!(ask("websocket").unwrap(), "websocket");
        assert_eq!(ask("WebSocket").unwrap(), "WebSocket");
        assert_eq!(ask("echo").unwrap(), "echo");
        // h2c through a tunnel would take every request past the routes.
        assert!(ask("h2c").is_none());
        assert!(ask("H2C").is_none());
        assert!(ask("websocket, h2c").is_none());
        assert!(ask("HTTP/2.0").is_none());
        assert!(upgrade_to(&map(&[("upgrade", "websocket")])).is_none());
        let mut h = map(&[
            ("connection", "Upgrade, HTTP2-Settings"),
            ("upgrade", "h2c"),
            ("http2-settings", "AAMAAABkAARAAAAAAAIAAAAA"),
        ]);
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
    }

    #[test]
    fn te_is_named_in_connection_for_http1() {
        let named = |fields: &[(&'static str, &'static str)]| {
            let mut h = map(fields);
            name_te_in_connection(&mut h);
            h.get_all(CONNECTION)
                .iter()
                .map(|v| v.to_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        };
        assert_eq!(named(&[("te", "trailers")]), ["te"]);
        assert_eq!(
            named(&[("te", "trailers"), ("connection", "upgrade")]),
            ["upgrade, te"]
        );
        assert_eq!(named(&[("te", "trailers"), ("connection", "TE")]), ["TE"]);
        assert!(named(&[]).is_empty());
        assert_eq!(named(&[("connection", "upgrade")]), ["upgrade"]);
    }

    #[test]
    fn connection_cannot_unframe_a_message() {
        // Connection naming Transfer-Encoding: the stale Content-Length
        // still goes (it would cut the chunked body short).
        let mut h = map(&[
            ("connection", "transfer-encoding"),
            ("transfer-encoding", "chunked"),
            ("content-length", "5"),
        ]);
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
        // Connection naming Content-Length, Host or X-Forwarded-For: they
        // stay.
        let mut h = map(&[
            (
                "connection",
                "content-length, host, x-trace, x-forwarded-for",
            ),
            ("content-length", "5"),
            ("host", "a"),
            ("x-trace", "1"),
            ("x-forwarded-for", "203.0.113.9"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h.get("content-length").unwrap(), "5");
        assert_eq!(h.get("host").unwrap(), "a");
        assert_eq!(h.get("x-forwarded-for").unwrap(), "203.0.113.9");
        assert!(h.get("x-trace").is_none());
    }

    #[test]
    fn every_forwarded_for_line_is_kept_in_order_before_the_peer() {
        let peer: IpAddr = "10.0.0.9".parse().unwrap();
        let mut h = HeaderMap::new();
        add_forwarded(&mut h, peer, false, None);
        assert_eq!(h.get(X_FORWARDED_FOR).unwrap(), "10.0.0.9");
        let mut h = HeaderMap::new();
        h.append(X_FORWARDED_FOR, HeaderValue::from_static("6.6.6.6"));
        h.append(X_FORWARDED_FOR, HeaderValue::from_static(" "));
        h.append(
            X_FORWARDED_FOR,
            HeaderValue::from_static("203.0.113.5, 10.0.0.1"),
        );
        add_forwarded(&mut h, peer, false, None);
        let all: Vec<_> = h.get_all(X_FORWARDED_FOR).iter().collect();
        assert_eq!(all, ["6.6.6.6, 203.0.113.5, 10.0.0.1, 10.0.0.9"]);
    }

    #[test]
    fn addresses_are_written_as_their_display_writes_them() {
        let mut buf = [0u8; 48];
        for a in [0u8, 1, 9, 10, 42, 99, 100, 127, 199, 200, 255] {
            for b in [0u8, 7, 10, 100, 255] {
                let ip = IpAddr::from([a, b, a.wrapping_mul(3), b.wrapping_add(a)]);
                let n = ip_text(ip, &mut buf);
                assert_eq!(&buf[..n], ip.to_string().as_bytes());
            }
        }
        for ip in [
            "::1",
            "::ffff:10.0.0.1",
            "2001:db8::8a2e:370:7334",
            "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff",
        ] {
            let ip: IpAddr = ip.parse().unwrap();
            let n = ip_text(ip, &mut buf);
            assert_eq!(&buf[..n], ip.to_string().as_bytes());
        }
    }

    #[test]
    fn a_packed_head_is_out_of_the_read_buffer_and_unpacks_as_it_was() {
        let read = Bytes::from_static(b"/a?b=1 example.org k secret");
        let within = |b: &[u8]| {
            let r = read.as_ptr() as usize..read.as_ptr() as usize + read.len();
            r.contains(&(b.as_ptr() as usize))
        };
        let value =
            |r: std::ops::Range<usize>| HeaderValue::from_maybe_shared(read.slice(r)).unwrap();
        let mut secret = value(21..27);
        secret.set_sensitive(true);
        let (parts, ()) = http::Request::builder()
            .uri(Uri::from_maybe_shared(read.slice(..6)).unwrap())
            .header("host", value(7..18))
            .header("x-client", value(19..20))
            .header("x-client", value(7..18))
            .header("authorization", secret)
            .header("x-empty", HeaderValue::from_static(""))
            .body(())
            .unwrap()
            .into_parts();
        let before = parts.headers.clone();
        assert!(within(parts.uri.path().as_bytes()));

        let parts = pack(parts).unpack().unwrap();
        assert_eq!(parts.uri, "/a?b=1");
        assert!(!within(parts.uri.path().as_bytes()));
        assert_eq!(parts.headers, before);
        assert!(parts.headers.values().all(|v| !within(v.as_bytes())));
        let clients: Vec<_> = parts.headers.get_all("x-client").iter().collect();
        assert_eq!(clients, ["k", "example.org"]);
        assert!(parts.headers["authorization"].is_sensitive());
        assert!(!parts.headers["host"].is_sensitive());
        // The table has room for what it holds, not HTTP/2's first six.
        assert!(parts.headers.capacity() < 12);
    }

    proptest::proptest! {
        /// Any fields (names from every token byte, values from every
        /// byte a value may hold, repeated names, sensitive or not) and
        /// any target come back from a pack exactly as they were.
        #[test]
        fn pack_then_unpack_gives_the_head_back(
            fields in proptest::collection::vec(
                (
                    proptest::collection::vec(
                        proptest::sample::select(b"abcxyz0189!#$%&'*+-.^_`|~".to_vec()),
                        1..6,
                    ),
                    proptest::collection::vec(
                        proptest::prop_oneof![
                            0x20u8..0x7f,
                            proptest::strategy::Just(b'\t'),
                            0x80u8..=0xff,
                        ],
                        0..12,
                    ),
                    proptest::bool::ANY,
                ),
                0..12,
            ),
            path in "/[a-z0-9/%.]{0,12}",
            query in proptest::option::of("[a-z0-9=&%]{0,8}"),
        ) {
            let target = match &query {
                Some(q) => format!("{path}?{q}"),
                None => path.clone(),
            };
            let mut parts = http::Request::builder()
                .method("PATCH")
                .version(Version::HTTP_2)
                .uri(target.as_str())
                .body(())
                .unwrap()
                .into_parts()
                .0;
            parts.extensions.insert(7u8);
            for (name, value, sensitive) in &fields {
                let name = HeaderName::from_bytes(name).unwrap();
                let mut value = HeaderValue::from_bytes(value).unwrap();
                value.set_sensitive(*sensitive);
                parts.headers.append(name, value);
            }
            let before = parts.headers.clone();
            let parts = pack(parts).unpack().unwrap();
            proptest::prop_assert_eq!(&parts.headers, &before);
            proptest::prop_assert_eq!(&parts.method, &Method::PATCH);
            proptest::prop_assert_eq!(parts.version, Version::HTTP_2);
            proptest::prop_assert_eq!(parts.extensions.get::<u8>(), Some(&7));
            for (name, _) in &before {
                let a: Vec<_> = before.get_all(name).iter().map(HeaderValue::is_sensitive).collect();
                let b: Vec<_> = parts.headers.get_all(name).iter().map(HeaderValue::is_sensitive).collect();
                proptest::prop_assert_eq!(a, b);
            }
            proptest::prop_assert_eq!(parts.uri.to_string(), target);
        }
    }

    #[test]
    fn a_head_without_fields_or_path_packs() {
        for target in [
            "http://example.org",
            "https://example.org:8443/a?b",
            "example.org:443",
            "*",
        ] {
            let (parts, ()) = http::Request::builder()
                .uri(target)
                .body(())
                .unwrap()
                .into_parts();
            let uri = parts.uri.clone();
            let parts = pack(parts).unpack().unwrap();
            assert!(parts.headers.is_empty());
            assert_eq!(parts.uri, uri, "{target}");
        }
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
    fn only_chunked_is_a_transfer_coding_sluice_passes_on() {
        let coded = |values: &[&'static str]| {
            let mut h = HeaderMap::new();
            for v in values {
                h.append(TRANSFER_ENCODING, HeaderValue::from_static(v));
            }
            foreign_transfer_coding(&h)
        };
        assert!(!coded(&[]));
        assert!(!coded(&["chunked"]));
        assert!(!coded(&[" Chunked "]));
        assert!(coded(&["gzip"]));
        assert!(coded(&["gzip, chunked"]));
        assert!(coded(&["gzip", "chunked"]));
        assert!(coded(&["chunked, identity"]));
    }

    #[test]
    fn forwarded_for_appends_the_peer() {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, HeaderValue::from_static("203.0.113.9"));
        add_forwarded(
            &mut h,
            "127.0.0.1".parse().unwrap(),
            false,
            Some(&HeaderValue::from_static("example")),
        );
        assert_eq!(h[&X_FORWARDED_FOR], "203.0.113.9, 127.0.0.1");
        assert_eq!(h[&X_FORWARDED_HOST], "example");
        assert_eq!(h[&X_FORWARDED_PROTO], "http");
    }

    #[test]
    fn only_a_trusted_proxy_names_the_scheme_and_host() {
        let sent = || {
            map(&[
                ("x-forwarded-proto", "https"),
                ("x-forwarded-host", "shop.example"),
            ])
        };
        let peer: IpAddr = "10.0.0.2".parse().unwrap();
        let host = HeaderValue::from_static("internal:8080");
        let mut h = sent();
        add_forwarded(&mut h, peer, true, Some(&host));
        assert_eq!(h[&X_FORWARDED_PROTO], "https");
        assert_eq!(h[&X_FORWARDED_HOST], "shop.example");
        let mut h = sent();
        add_forwarded(&mut h, peer, false, Some(&host));
        assert_eq!(h[&X_FORWARDED_PROTO], "http");
        assert_eq!(h[&X_FORWARDED_HOST], "internal:8080");
        // A trusted proxy that sent none: sluice's own.
        let mut h = HeaderMap::new();
        add_forwarded(&mut h, peer, true, Some(&host));
        assert_eq!(h[&X_FORWARDED_PROTO], "http");
        assert_eq!(h[&X_FORWARDED_HOST], "internal:8080");
        // A request with no host (HTTP/1.0): the client's goes all the
        // same, unless a trusted proxy sent it.
        let mut h = sent();
        add_forwarded(&mut h, peer, false, None);
        assert!(h.get(X_FORWARDED_HOST).is_none());
        let mut h = sent();
        add_forwarded(&mut h, peer, true, None);
        assert_eq!(h[&X_FORWARDED_HOST], "shop.example");
    }

    #[test]
    fn a_third_party_learns_nothing_of_the_callers() {
        let mut h = map(&[
            ("x-forwarded-for", "10.1.2.3"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "internal.corp"),
            ("forwarded", "for=10.1.2.3;host=internal.corp"),
            ("x-forwarded-server", "lb-3.internal.corp"),
            ("x-forwarded-port", "8443"),
            ("x-real-ip", "10.1.2.3"),
            ("x-request-id", "7"),
        ]);
        strip_forwarded(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-request-id"], "7");
    }
}
