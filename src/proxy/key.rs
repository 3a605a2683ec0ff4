//! Client keys: which queue a request is filed under.

use std::net::IpAddr;

use http::HeaderMap;

use crate::config::{KeySpec, OnMissingKey};

/// The key the shaper files a request under, as bytes: a header value, the
/// peer's address, or empty for `global`.
pub type ClientKey = Box<[u8]>;

/// Longest header value accepted as a key; longer ones are refused (400)
/// rather than stored.
const MAX_KEY_LEN: usize = 256;

/// Keys are tagged so that kinds never collide and can be shown:
/// `i` + address octets, `h` + header value, empty for `global`.
fn ip_key(ip: IpAddr) -> ClientKey {
    let mut k = vec![b'i'];
    match ip {
        IpAddr::V4(v4) => k.extend_from_slice(&v4.octets()),
        IpAddr::V6(v6) => k.extend_from_slice(&v6.octets()),
    }
    k.into_boxed_slice()
}

fn header_key(value: &[u8]) -> ClientKey {
    let mut k = Vec::with_capacity(value.len() + 1);
    k.push(b'h');
    k.extend_from_slice(value);
    k.into_boxed_slice()
}

/// A key as an operator reads it: the address for `ip` keys, the header
/// value (lossily) otherwise, `*` for `global`.
pub fn display(key: &[u8]) -> String {
    match key {
        [b'i', octets @ ..] if octets.len() == 4 => {
            let o: [u8; 4] = [octets[0], octets[1], octets[2], octets[3]];
            IpAddr::from(o).to_string()
        }
        [b'i', octets @ ..] if octets.len() == 16 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(octets);
            IpAddr::from(o).to_string()
        }
        [b'h', value @ ..] => String::from_utf8_lossy(value).into_owned(),
        _ => "*".to_owned(),
    }
}

/// Derive the key for a request, or the reason it has none (answered 400).
pub fn extract(
    spec: &KeySpec,
    on_missing: OnMissingKey,
    headers: &HeaderMap,
    peer: IpAddr,
) -> Result<ClientKey, String> {
    match spec {
        KeySpec::Ip => Ok(ip_key(peer)),
        KeySpec::Global => Ok(Box::new([])),
        KeySpec::Header(name) => match headers.get(name) {
            Some(v) if v.len() > MAX_KEY_LEN => Err(format!(
                "the {name} header is longer than {MAX_KEY_LEN} bytes"
            )),
            Some(v) if !v.is_empty() => Ok(header_key(v.as_bytes())),
            _ => match on_missing {
                OnMissingKey::Ip => Ok(ip_key(peer)),
                OnMissingKey::Reject => Err(format!("the {name} header is required")),
            },
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderName, HeaderValue};

    const PEER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[test]
    fn header_key_uses_the_value() {
        let mut h = HeaderMap::new();
        h.insert("x-client", HeaderValue::from_static("alice"));
        let spec = KeySpec::Header(HeaderName::from_static("x-client"));
        assert_eq!(
            extract(&spec, OnMissingKey::Reject, &h, PEER)
                .unwrap()
                .as_ref(),
            b"alice"
        );
    }

    #[test]
    fn missing_header_is_refused_or_falls_back_to_ip() {
        let spec = KeySpec::Header(HeaderName::from_static("x-client"));
        let h = HeaderMap::new();
        assert!(extract(&spec, OnMissingKey::Reject, &h, PEER).is_err());
        assert_eq!(
            extract(&spec, OnMissingKey::Ip, &h, PEER).unwrap().as_ref(),
            &[127, 0, 0, 1]
        );
    }

    #[test]
    fn overlong_header_key_is_refused() {
        let mut h = HeaderMap::new();
        h.insert(
            "x-client",
            HeaderValue::from_str(&"a".repeat(MAX_KEY_LEN + 1)).unwrap(),
        );
        let spec = KeySpec::Header(HeaderName::from_static("x-client"));
        assert!(extract(&spec, OnMissingKey::Ip, &h, PEER).is_err());
    }
}
