//! Client keys: which queue a request is filed under.
//!
//! Keys are tagged bytes so kinds never collide and can be shown back:
//! `i` + address octets (`ip`, `forwarded`), `h` + header value, empty for
//! `global`, and `c` + length-prefixed parts for composite keys.

use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;
use http::header::HeaderName;
use ipnet::IpNet;

use super::headers::removed_as_hop_by_hop;
use crate::admission::{Key, compose};
use crate::config::{KeyPart, KeySpec, OnMissingKey};

/// Longest header value accepted as a key; longer ones are refused (400)
/// rather than stored.
pub const MAX_KEY_LEN: usize = 256;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

pub(super) fn is_trusted(ip: IpAddr, trusted: &[IpNet]) -> bool {
    trusted.iter().any(|n| n.contains(&ip))
}

fn parse_hop(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<SocketAddr>().ok().map(|s| s.ip()))
}

/// The client address behind trusted proxies: if the peer is a trusted
/// proxy, walk `X-Forwarded-For` from the right past trusted hops; the
/// first untrusted address is the client. Entries left of it (which the
/// client itself may have written) are never read.
pub fn forwarded_client(headers: &HeaderMap, peer: IpAddr, trusted: &[IpNet]) -> IpAddr {
    if !is_trusted(peer, trusted) {
        return peer;
    }
    let mut client = peer;
    for value in headers.get_all(X_FORWARDED_FOR).iter().rev() {
        // By entry, not by line: bytes that are not text left of the
        // client (which the client may have written) are never read.
        for entry in value.as_bytes().rsplit(|&b| b == b',') {
            let Some(ip) = std::str::from_utf8(entry).ok().and_then(parse_hop) else {
                return client;
            };
            client = ip;
            if !is_trusted(ip, trusted) {
                return ip;
            }
        }
    }
    client
}

/// Whether `spec` keys by the request's host (`header:Host`), which
/// [`extract`] then needs.
pub fn by_host(spec: &KeySpec) -> bool {
    spec.0
        .iter()
        .any(|p| matches!(p, KeyPart::Header(name) if name == http::header::HOST))
}

/// Derive the key for a request, or the reason it has none (answered 400).
pub fn extract(
    spec: &KeySpec,
    on_missing: OnMissingKey,
    headers: &HeaderMap,
    host: Option<&[u8]>,
    peer: IpAddr,
    trusted: &[IpNet],
) -> Result<Key, String> {
    compose(&spec.0, |part, out| {
        match part {
            KeyPart::Ip => out.ip(peer),
            KeyPart::Forwarded => out.ip(forwarded_client(headers, peer, trusted)),
            KeyPart::Global => {}
            // The host the request is for, as routing takes it
            // ([`super::route::request_host`]): HTTP/2's `:authority` or an
            // absolute-form target before `Host` (RFC 9112 3.2.2), without
            // its port or a trailing dot, in lower case. Keyed by the
            // `Host` header beside them, or by the spelling, a client chose
            // a fresh bucket per request (`API.example`, `api.example.`,
            // `api.example:080` are one host).
            KeyPart::Header(name) if name == http::header::HOST => match host {
                Some(h) if !h.is_empty() => out.text(&h.to_ascii_lowercase()),
                _ => match on_missing {
                    OnMissingKey::Ip => out.ip(peer),
                    OnMissingKey::Reject => {
                        return Err(format!("the {name} header is required"));
                    }
                },
            },
            KeyPart::Header(name) => {
                let joined;
                let value = if name != http::header::COOKIE {
                    one_value(headers, name)?
                } else if removed_as_hop_by_hop(headers, name) {
                    None
                } else {
                    joined = super::headers::joined_cookie(headers);
                    joined.as_ref()
                };
                match value {
                    Some(v) if v.len() > MAX_KEY_LEN => {
                        return Err(format!(
                            "the {name} header is longer than {MAX_KEY_LEN} bytes"
                        ));
                    }
                    Some(v) if !v.is_empty() => out.text(v.as_bytes()),
                    _ => match on_missing {
                        OnMissingKey::Ip => out.ip(peer),
                        OnMissingKey::Reject => {
                            return Err(format!("the {name} header is required"));
                        }
                    },
                }
            }
        }
        Ok(())
    })
}

/// A key header's value: one at most. Two would let a client pick its own
/// bucket with the first while an upstream that reads the last (or the
/// list) sees the real one.
pub(crate) fn one_value<'a>(
    headers: &'a HeaderMap,
    name: &http::HeaderName,
) -> Result<Option<&'a http::HeaderValue>, String> {
    // A header the departure removes (the client named it in
    // `Connection`) is neither key nor cost: the upstream never gets it.
    // (Keyed by it, a client got a fresh bucket per request.)
    if removed_as_hop_by_hop(headers, name) {
        return Ok(None);
    }
    let mut values = headers.get_all(name).iter();
    let first = values.next();
    match values.next() {
        Some(_) => Err(format!("the {name} header must appear once")),
        None => Ok(first),
    }
}

/// The key for the displayed form `text` (as `/status` shows it: header
/// values percent-encoded where they are not printable), for the bucket
/// query; `None` when `text` cannot be a key the proxy would file a
/// request under (an empty or over-long header value).
pub fn from_display(spec: &KeySpec, text: &str) -> Option<Key> {
    let texts: Vec<&str> = match spec.0.len() {
        1 => vec![text],
        n => Some(text.split('|').collect::<Vec<_>>()).filter(|t| t.len() == n)?,
    };
    let mut texts = texts.into_iter();
    compose(&spec.0, |part, out| {
        let text = texts.next().ok_or(())?;
        match part {
            KeyPart::Ip | KeyPart::Forwarded => out.ip(text.parse().map_err(|_| ())?),
            KeyPart::Global => {}
            KeyPart::Header(_) => {
                let value: Vec<u8> = percent_encoding::percent_decode_str(text).collect();
                if value.is_empty() || value.len() > MAX_KEY_LEN {
                    return Err(());
                }
                out.text(&value);
            }
        }
        Ok(())
    })
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn spec(parts: &[KeyPart]) -> KeySpec {
        KeySpec(parts.to_vec())
    }

    fn header(name: &'static str) -> KeyPart {
        KeyPart::Header(HeaderName::from_static(name))
    }

    #[test]
    fn header_key_uses_the_value() {
        let mut h = HeaderMap::new();
        h.insert("x-client", HeaderValue::from_static("alice"));
        let k = extract(
            &spec(&[header("x-client")]),
            OnMissingKey::Reject,
            &h,
            None,
            PEER,
            &[],
        )
        .unwrap();
        assert_eq!(k.display(), "alice");
    }

    /// A Host key is the host the request is for, as routing takes it:
    /// the target's authority (HTTP/2's `:authority`, an absolute-form
    /// target) before a `Host` header beside it, which the client may set
    /// to anything; without its port or a trailing dot, in lower case.
    #[test]
    fn a_host_key_is_the_host_routing_takes() {
        let s = spec(&[header("host")]);
        let key = |uri: &str, host: Option<&str>| {
            let mut req = http::Request::builder().uri(uri);
            if let Some(h) = host {
                req = req.header("host", h);
            }
            let req = req.body(()).unwrap();
            let host = super::super::route::request_host(&req);
            extract(&s, OnMissingKey::Reject, req.headers(), host, PEER, &[]).map(|k| k.display())
        };
        let one = Ok("api.example".to_owned());
        for (uri, host) in [
            ("http://api.example/x", Some("r1")),
            ("http://API.example.:8080/x", Some("r2")),
            ("http://api.example:080/x", None),
            ("/x", Some("Api.Example.")),
            ("/x", Some("api.example:443")),
        ] {
            assert_eq!(key(uri, host), one, "{uri} with Host {host:?}");
        }
        assert!(key("/x", None).is_err(), "no host at all");
        assert_eq!(key("http://[::1]:8080/x", Some("r")), Ok("::1".to_owned()));
    }

    #[test]
    fn missing_header_is_refused_or_falls_back_to_ip() {
        let s = spec(&[header("x-client")]);
        let h = HeaderMap::new();
        assert!(extract(&s, OnMissingKey::Reject, &h, None, PEER, &[]).is_err());
        let k = extract(&s, OnMissingKey::Ip, &h, None, PEER, &[]).unwrap();
        assert_eq!(k.display(), "127.0.0.1");
    }

    #[test]
    fn overlong_header_key_is_refused() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-client",
            HeaderValue::from_str(&"a".repeat(MAX_KEY_LEN + 1)).unwrap(),
        );
        assert!(
            extract(
                &spec(&[header("x-client")]),
                OnMissingKey::Ip,
                &h,
                None,
                PEER,
                &[]
            )
            .is_err()
        );
    }

    #[test]
    fn forwarded_takes_the_rightmost_untrusted_hop() {
        let trusted: Vec<IpNet> = vec![
            "127.0.0.0/8".parse().unwrap(),
            "10.0.0.0/8".parse().unwrap(),
        ];
        let mut h = HeaderMap::new();
        h.insert(
            X_FORWARDED_FOR,
            HeaderValue::from_static("6.6.6.6, 203.0.113.5, 10.1.2.3"),
        );
        assert_eq!(
            forwarded_client(&h, PEER, &trusted).to_string(),
            "203.0.113.5"
        );
        // A spoofed left part never changes the key.
        h.insert(
            X_FORWARDED_FOR,
            HeaderValue::from_static("1.1.1.1, 9.9.9.9, 203.0.113.5, 10.1.2.3"),
        );
        assert_eq!(
            forwarded_client(&h, PEER, &trusted).to_string(),
            "203.0.113.5"
        );
        // Bytes that are not text left of the client do not hide it.
        h.insert(
            X_FORWARDED_FOR,
            HeaderValue::from_bytes(b"\xff\xfe, 203.0.113.5, 10.1.2.3").unwrap(),
        );
        assert_eq!(
            forwarded_client(&h, PEER, &trusted).to_string(),
            "203.0.113.5"
        );
        // An untrusted peer's header is not believed at all.
        let stranger: IpAddr = "198.51.100.1".parse().unwrap();
        assert_eq!(forwarded_client(&h, stranger, &trusted), stranger);
    }

    #[test]
    fn a_key_header_given_twice_is_refused() {
        let s = spec(&[header("x-api-key")]);
        let mut h = HeaderMap::new();
        h.append("x-api-key", HeaderValue::from_static("random-1"));
        h.append("x-api-key", HeaderValue::from_static("real"));
        let e = extract(&s, OnMissingKey::Reject, &h, None, PEER, &[]).unwrap_err();
        assert_eq!(e, "the x-api-key header must appear once");
    }

    #[test]
    fn cookies_split_over_fields_are_one_key() {
        // HTTP/2 clients send Cookie as several fields (RFC 9113 8.2.3).
        let s = spec(&[header("cookie")]);
        let mut h = HeaderMap::new();
        h.append("cookie", HeaderValue::from_static("a=1"));
        h.append("cookie", HeaderValue::from_static("sid=x"));
        let k = extract(&s, OnMissingKey::Reject, &h, None, PEER, &[]).unwrap();
        assert_eq!(k.display(), "a=1; sid=x");
    }

    #[test]
    fn composite_keys_join_their_parts_and_read_back() {
        let s = spec(&[header("x-tenant"), KeyPart::Ip]);
        let mut h = HeaderMap::new();
        h.insert("x-tenant", HeaderValue::from_static("acme"));
        let k = extract(&s, OnMissingKey::Reject, &h, None, PEER, &[]).unwrap();
        assert_eq!(k.display(), "acme|127.0.0.1");
        assert_eq!(from_display(&s, "acme|127.0.0.1"), Some(k.clone()));
        h.insert("x-tenant", HeaderValue::from_static("other"));
        assert_ne!(
            extract(&s, OnMissingKey::Reject, &h, None, PEER, &[]).unwrap(),
            k
        );
    }
}
