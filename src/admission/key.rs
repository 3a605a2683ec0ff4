//! Client keys: opaque bytes a front end derives from a request (an
//! address, a header value, a sender domain, or several joined). Short keys
//! (most of them: an IPv6 address is 17 bytes) live inline, so filing a
//! request under its key allocates nothing.

use std::fmt;
use std::hash::{Hash, Hasher};

/// Longest key kept inline.
const INLINE: usize = 22;

/// A client key. Equality and hashing are over the bytes.
///
/// The representation is canonical: a key of at most [`INLINE`] bytes is
/// always inline, with the unused bytes zero, so two inline keys are equal
/// exactly when their lengths and whole arrays are (a fixed-size compare,
/// no call into `memcmp`).
#[derive(Clone)]
pub struct Key(Repr);

#[derive(Clone)]
enum Repr {
    Inline { len: u8, bytes: [u8; INLINE] },
    Heap(Box<[u8]>),
}

impl Key {
    /// The key made of `bytes`.
    pub fn new(bytes: &[u8]) -> Key {
        if bytes.len() <= INLINE {
            let mut inline = [0; INLINE];
            inline[..bytes.len()].copy_from_slice(bytes);
            Key(Repr::Inline {
                len: bytes.len() as u8,
                bytes: inline,
            })
        } else {
            Key(Repr::Heap(bytes.into()))
        }
    }

    /// The key's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match &self.0 {
            Repr::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Repr::Heap(b) => b,
        }
    }
}

impl Key {
    /// The key as an operator reads it: an address for `i` parts, the
    /// value (lossily) for other tagged parts, `*` for the empty (global)
    /// key, composite parts joined by `|`.
    pub fn display(&self) -> String {
        display(self.as_bytes(), false)
    }

    /// The key as `/status` shows it unless told to show keys: addresses
    /// as they are, every other part (a header's value: perhaps an API
    /// token; a sender; a user name) as `#` and 12 hex digits of a hash
    /// keyed at random for this process, the same for the same value
    /// while it runs.
    pub fn masked(&self) -> String {
        display(self.as_bytes(), true)
    }
}

/// A part's fingerprint: 48 bits of SipHash under this process's key.
fn fingerprint(value: &[u8]) -> String {
    use std::hash::BuildHasher;
    static SEED: std::sync::OnceLock<std::collections::hash_map::RandomState> =
        std::sync::OnceLock::new();
    let hash = SEED.get_or_init(Default::default).hash_one(value);
    format!("#{:012x}", hash >> 16)
}

fn display(key: &[u8], masked: bool) -> String {
    match key {
        [b'i', octets @ ..] if octets.len() == 4 => {
            std::net::IpAddr::from([octets[0], octets[1], octets[2], octets[3]]).to_string()
        }
        [b'i', octets @ ..] if octets.len() == 16 => {
            let mut o = [0u8; 16];
            o.copy_from_slice(octets);
            std::net::IpAddr::from(o).to_string()
        }
        [b'c', composite @ ..] => {
            let mut rest: &[u8] = composite;
            let mut parts = Vec::new();
            while let [hi, lo, tail @ ..] = rest {
                let n = usize::from(u16::from_be_bytes([*hi, *lo])).min(tail.len());
                parts.push(display(&tail[..n], masked));
                rest = &tail[n..];
            }
            parts.join("|")
        }
        [_, value @ ..] if masked => fingerprint(value),
        [_, value @ ..] => shown(value),
        [] => "*".to_owned(),
    }
}

/// Bytes shown in `/status`: printable text as it is; anything else (and
/// `%` and `|`, which the display gives meaning) percent-encoded, so every
/// key can be read back exactly by the bucket query.
const SHOWN: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%').add(b'|');

fn shown(value: &[u8]) -> String {
    percent_encoding::percent_encode(value, SHOWN).to_string()
}

impl PartialEq for Key {
    fn eq(&self, other: &Key) -> bool {
        match (&self.0, &other.0) {
            (Repr::Inline { len: a, bytes: x }, Repr::Inline { len: b, bytes: y }) => {
                a == b && x == y
            }
            (Repr::Heap(x), Repr::Heap(y)) => x == y,
            _ => false,
        }
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.as_bytes().hash(state);
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({:?})", self.as_bytes())
    }
}

/// Builds a key on the stack; spills to the heap only past 64 bytes.
#[derive(Default)]
pub struct KeyBuf {
    buf: smallvec::SmallVec<[u8; 64]>,
}

impl KeyBuf {
    pub fn push(&mut self, byte: u8) {
        self.buf.push(byte);
    }

    pub fn extend(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn clear(&mut self) {
        self.buf.clear();
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.buf
    }

    pub fn key(&self) -> Key {
        Key::new(&self.buf)
    }

    /// An address part (`i` and its octets; shown as the address).
    pub fn ip(&mut self, ip: std::net::IpAddr) {
        self.push(b'i');
        match ip {
            std::net::IpAddr::V4(v4) => self.extend(&v4.octets()),
            std::net::IpAddr::V6(v6) => self.extend(&v6.octets()),
        }
    }

    /// A text part (`h` and the value; shown as the value).
    pub fn text(&mut self, value: &[u8]) {
        self.push(b'h');
        self.extend(value);
    }
}

/// The key of `parts`, each written by `one`: the part itself when there
/// is one, `c` and the length-prefixed parts when there are several. A
/// part longer than 65535 bytes is cut there (front ends bound parts far
/// below that).
pub fn compose<P, E>(
    parts: &[P],
    mut one: impl FnMut(&P, &mut KeyBuf) -> Result<(), E>,
) -> Result<Key, E> {
    let mut key = KeyBuf::default();
    match parts {
        [single] => one(single, &mut key)?,
        parts => {
            key.push(b'c');
            let mut part = KeyBuf::default();
            for p in parts {
                part.clear();
                one(p, &mut part)?;
                let n = part.len().min(usize::from(u16::MAX));
                key.extend(&(n as u16).to_be_bytes());
                key.extend(&part.as_bytes()[..n]);
            }
        }
    }
    Ok(key.key())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_and_long_keys_compare_by_bytes() {
        let short = Key::new(b"abc");
        assert_eq!(short.as_bytes(), b"abc");
        let long = vec![7u8; 100];
        assert_eq!(Key::new(&long).as_bytes(), &long[..]);
        assert_eq!(Key::new(&[0; INLINE]), Key::new(&[0; INLINE]));
        assert_ne!(Key::new(b""), Key::new(&[0]));
    }

    #[test]
    fn keys_that_are_not_text_are_shown_percent_encoded() {
        assert_eq!(Key::new(b"hacme").display(), "acme");
        assert_eq!(Key::new(b"h\xff\xfe|%").display(), "%FF%FE%7C%25");
    }

    #[test]
    fn masked_keys_show_addresses_and_fingerprints() {
        let token = Key::new(b"hBearer sk_live_0123456789");
        let masked = token.masked();
        assert!(!masked.contains("sk_live"), "{masked}");
        assert_eq!(masked.len(), 13, "{masked}");
        assert!(masked.starts_with('#'));
        assert_eq!(masked, Key::new(b"hBearer sk_live_0123456789").masked());
        assert_ne!(masked, Key::new(b"hBearer sk_live_0123456788").masked());
        let composite = compose(&[0, 1], |&i, k| {
            match i {
                0 => k.text(b"acme"),
                _ => k.ip("192.0.2.1".parse().unwrap()),
            }
            Ok::<(), ()>(())
        })
        .unwrap();
        let shown = composite.masked();
        assert!(shown.ends_with("|192.0.2.1"), "{shown}");
        assert!(!shown.contains("acme"), "{shown}");
        assert_eq!(Key::new(b"").masked(), "*");
    }

    proptest::proptest! {
        /// Equality (a fixed-size compare on inline keys) is byte equality,
        /// and equal keys hash alike, on both sides of the inline limit.
        #[test]
        fn equality_and_hashing_follow_the_bytes(
            a in proptest::collection::vec(0u8..3, 0..=INLINE + 3),
            b in proptest::collection::vec(0u8..3, 0..=INLINE + 3),
        ) {
            use std::hash::BuildHasher;
            let (x, y) = (Key::new(&a), Key::new(&b));
            proptest::prop_assert_eq!(x.as_bytes(), &a[..]);
            proptest::prop_assert_eq!(x == y, a == b);
            let s = foldhash::fast::FixedState::with_seed(7);
            if a == b {
                proptest::prop_assert_eq!(s.hash_one(&x), s.hash_one(&y));
            }
        }
    }

    #[test]
    fn a_key_is_three_words() {
        assert_eq!(std::mem::size_of::<Key>(), 24);
    }
}
