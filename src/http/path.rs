//! Request paths as the upstream will see them, so that route matching
//! cannot be bypassed with a path the upstream normalizes back (issue 12):
//! `/x/../admin`, `/x/%2e%2e/admin`, `/%61dmin`, `//admin` all match as
//! `/admin`, and that normalized path is what is forwarded.
//!
//! The rule, applied to the path (the query is never touched):
//! 1. a path that cannot be normalized safely is refused (400): an encoded
//!    `/` (`%2F`) or `\` (`%5C`), a `\` or NUL (`%00`), a malformed
//!    percent-escape, a `..` that would climb above the root, or a `.` or
//!    `..` segment with `;` parameters (`/x/..;/admin`: servlet containers
//!    drop the parameters, then resolve the dots);
//! 2. percent-escapes of unreserved characters (RFC 3986 2.3: letters,
//!    digits, `-`, `.`, `_`, `~`) are decoded, other escapes upper-cased
//!    (6.2.2.1, 6.2.2.2);
//! 3. runs of `/` become one;
//! 4. `.` and `..` segments are removed (5.2.4).
//!
//! A path that does not start with `/` (`*` for `OPTIONS *`) is left as it
//! is. Routes then match it without its segments' `;` parameters
//! ([`without_parameters`]), as servlet containers read it.

use std::borrow::Cow;

/// Why a path was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error(
        "the path has an encoded '/' or '\\\\', a '\\\\' or a NUL, which upstreams read differently"
    )]
    Ambiguous,
    #[error("the path has a malformed percent-escape")]
    BadEscape,
    #[error("the path climbs above the root with '..'")]
    AboveRoot,
    #[error(
        "the path has a '.' or '..' segment with ';' parameters, which upstreams resolve differently"
    )]
    DotParameters,
}

/// A `.` or `..` segment with `;` parameters (`..;jsessionid=1`).
fn dot_with_parameters(segment: &str) -> bool {
    segment
        .split_once(';')
        .is_some_and(|(dots, _)| dots == "." || dots == "..")
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

/// Whether `path` (starting with '/') is already in normal form (the
/// common case: nothing to allocate).
fn is_normal(path: &str) -> bool {
    !path.contains(['%', '\\'])
        && !path.contains("//")
        && !path[1..]
            .split('/')
            .any(|s| s == "." || s == ".." || dot_with_parameters(s))
}

/// The normal form of `path`, or why it has none.
pub fn normalize(path: &str) -> Result<Cow<'_, str>, PathError> {
    if !path.starts_with('/') {
        return Ok(Cow::Borrowed(path));
    }
    if is_normal(path) {
        return Ok(Cow::Borrowed(path));
    }
    // Decode escapes of unreserved characters; refuse the ambiguous ones.
    let b = path.as_bytes();
    let mut decoded = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\\' => return Err(PathError::Ambiguous),
            b'%' => {
                let (Some(h), Some(l)) = (
                    b.get(i + 1).copied().and_then(hex),
                    b.get(i + 2).copied().and_then(hex),
                ) else {
                    return Err(PathError::BadEscape);
                };
                let c = h << 4 | l;
                if matches!(c, b'/' | b'\\' | 0) {
                    return Err(PathError::Ambiguous);
                }
                if unreserved(c) {
                    decoded.push(c);
                } else {
                    decoded.push(b'%');
                    decoded.extend_from_slice(format!("{c:02X}").as_bytes());
                }
                i += 3;
            }
            c => {
                decoded.push(c);
                i += 1;
            }
        }
    }
    // Segments, with dot segments applied and empty ones merged away.
    let text = String::from_utf8_lossy(&decoded);
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = text[1..].split('/').collect();
    let last = segments.len() - 1;
    let mut trailing_slash = false;
    for (n, seg) in segments.iter().enumerate() {
        match *seg {
            "" => trailing_slash = n == last,
            "." => trailing_slash = n == last,
            ".." => {
                if out.pop().is_none() {
                    return Err(PathError::AboveRoot);
                }
                trailing_slash = n == last;
            }
            s if dot_with_parameters(s) => return Err(PathError::DotParameters),
            s => {
                out.push(s);
                trailing_slash = false;
            }
        }
    }
    let mut normal = String::with_capacity(path.len());
    for seg in &out {
        normal.push('/');
        normal.push_str(seg);
    }
    if trailing_slash || normal.is_empty() {
        normal.push('/');
    }
    Ok(Cow::Owned(normal))
}

/// The path routes match: the normalized `path` with each segment's `;`
/// parameters removed, as servlet containers (Tomcat, Jetty) read it
/// before they route: `/admin;x/secret` is their `/admin/secret`, and must
/// take the route of `/admin/`, not a looser one. A segment that was all
/// parameters goes (`/;x/admin` is `/admin`). The upstream still gets the
/// path as it came. Borrowed when there is no `;` (the common case).
pub fn without_parameters(path: &str) -> Cow<'_, str> {
    if !path.starts_with('/') || !path.contains(';') {
        return Cow::Borrowed(path);
    }
    let mut out = String::with_capacity(path.len());
    let segments: Vec<&str> = path[1..].split('/').collect();
    let last = segments.len() - 1;
    for (n, segment) in segments.iter().enumerate() {
        let bare = segment.split_once(';').map_or(*segment, |(bare, _)| bare);
        if bare.is_empty() && n != last {
            continue;
        }
        out.push('/');
        out.push_str(bare);
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(p: &str) -> Result<String, PathError> {
        normalize(p).map(Cow::into_owned)
    }

    #[test]
    fn bypass_attempts_become_the_path_the_upstream_sees() {
        // Regression (issue 12): each of these took the default route
        // while the upstream served /admin/y.
        for p in [
            "/x/../admin/y",
            "/x/%2e%2e/admin/y",
            "/%61dmin/y",
            "//admin/y",
            "/admin/./y",
            "/admin//y",
        ] {
            assert_eq!(n(p).as_deref(), Ok("/admin/y"), "{p}");
        }
    }

    #[test]
    fn dot_segments_with_parameters_are_refused() {
        for p in ["/x/..;/admin", "/x/%2e%2e;v=1/admin", "/x/.;/a", "/..;"] {
            assert_eq!(n(p), Err(PathError::DotParameters), "{p}");
        }
        // Parameters on an ordinary segment, or dots that are not a whole
        // segment, are just text.
        for p in ["/a;b/c", "/a/..b;c", "/a/b..;"] {
            assert_eq!(n(p).as_deref(), Ok(p), "{p}");
        }
    }

    #[test]
    fn routes_match_paths_without_their_parameters() {
        for (p, bare) in [
            ("/admin;x/secret", "/admin/secret"),
            ("/admin;x=1;y/", "/admin/"),
            ("/;x/admin", "/admin"),
            ("/shop/cart;jsessionid=AB", "/shop/cart"),
            ("/a/;x", "/a/"),
        ] {
            assert_eq!(without_parameters(p), bare, "{p}");
        }
        for p in ["/admin/secret", "*", "/"] {
            assert!(matches!(without_parameters(p), Cow::Borrowed(x) if x == p));
        }
    }

    #[test]
    fn normal_paths_are_kept_without_copying() {
        for p in ["/", "/a", "/a/b/", "/a.b/c_d-e~f", "*"] {
            assert!(
                matches!(normalize(p), Ok(Cow::Borrowed(x)) if x == p),
                "{p}"
            );
        }
    }

    #[test]
    fn ambiguous_or_escaping_paths_are_refused() {
        assert_eq!(n("/a%2Fb"), Err(PathError::Ambiguous));
        assert_eq!(n("/a%2fb"), Err(PathError::Ambiguous));
        assert_eq!(n("/a%5Cb"), Err(PathError::Ambiguous));
        assert_eq!(n("/a\\b"), Err(PathError::Ambiguous));
        assert_eq!(n("/a%00"), Err(PathError::Ambiguous));
        assert_eq!(n("/a%zz"), Err(PathError::BadEscape));
        assert_eq!(n("/a%4"), Err(PathError::BadEscape));
        assert_eq!(n("/../etc"), Err(PathError::AboveRoot));
        assert_eq!(n("/a/../../etc"), Err(PathError::AboveRoot));
    }

    #[test]
    fn reserved_escapes_stay_escaped_in_upper_case() {
        assert_eq!(n("/a%3fb").as_deref(), Ok("/a%3Fb"));
        assert_eq!(n("/%e2%82%ac").as_deref(), Ok("/%E2%82%AC"));
    }

    #[test]
    fn trailing_slashes_and_dots_keep_their_meaning() {
        assert_eq!(n("/a/b/.").as_deref(), Ok("/a/b/"));
        assert_eq!(n("/a/b/..").as_deref(), Ok("/a/"));
        assert_eq!(n("/a/..").as_deref(), Ok("/"));
        assert_eq!(n("//").as_deref(), Ok("/"));
    }
}
