//! The routing table: which route takes a request, and everything the
//! request path needs from it resolved once per config (admission rule,
//! key spec, cost, pre-rendered refusals, upstream index).

use std::sync::Arc;

use http::{HeaderMap, Method, Request, StatusCode};
use ipnet::IpNet;

use super::ServeError;
use super::forward::Upstream;
use super::in_flight::{Concurrency, InFlight};
use super::response::Problem;
use crate::admission::Policy;
use crate::admission::{Admission, Protocol, Rule, RuleSpec};
use crate::config::{self, Config, Cost, KeySpec, OnMissingKey};

/// A route as the request path sees it.
#[derive(Clone)]
pub struct Route {
    pub name: String,
    host: Option<String>,
    path_prefix: String,
    path: Option<String>,
    methods: Option<Vec<Method>>,
    pub rule: Arc<Rule>,
    /// Index into [`App::upstreams`].
    pub upstream: usize,
    pub key: KeySpec,
    pub on_missing_key: OnMissingKey,
    cost: Cost,
    pub ratelimit_headers: bool,
    /// Removed from the front of the path before forwarding.
    pub strip_prefix: Option<String>,
    /// Tunnels one client key may hold open on this route.
    pub max_tunnels_per_key: Option<usize>,
    /// 429 bodies: queue full, and wait past `max_wait`.
    pub full: Problem,
    pub max_wait: Problem,
    /// 503 body for a request still queued when `max_wait` passed.
    pub expired: Problem,
}

/// The routing table: swapped whole on reload; requests in flight keep
/// the table they started with.
pub struct App {
    pub routes: Vec<Route>,
    pub upstreams: Vec<Upstream>,
    pub trusted_proxies: Vec<IpNet>,
}

impl Route {
    /// Whether this route takes `req`, whose normalized path is `path`:
    /// every criterion it has must match.
    pub fn matches<B>(&self, path: &str, req: &Request<B>) -> bool {
        if !path.starts_with(&self.path_prefix) {
            return false;
        }
        if self.path.as_deref().is_some_and(|p| p != path) {
            return false;
        }
        if self
            .methods
            .as_ref()
            .is_some_and(|m| !m.contains(req.method()))
        {
            return false;
        }
        match &self.host {
            None => true,
            Some(host) => request_host(req).is_some_and(|h| host_matches(host, h)),
        }
    }

    /// The request's cost: fixed, or read from a header (400 when it is not
    /// a whole number from 1 to the configured max, or is given twice: a
    /// client would pay the first while an upstream meters the last).
    pub fn cost(&self, headers: &HeaderMap) -> Result<u32, String> {
        cost_of(&self.cost, headers)
    }

    pub fn path_prefix(&self) -> &str {
        &self.path_prefix
    }
}

/// See [`Route::cost`].
fn cost_of(cost: &Cost, headers: &HeaderMap) -> Result<u32, String> {
    match cost {
        Cost::Fixed(n) => Ok(*n),
        Cost::Header { name, default, max } => match super::key::one_value(headers, name)? {
            None => Ok(*default),
            Some(v) => match v.to_str().ok().and_then(|t| t.trim().parse::<u32>().ok()) {
                Some(n) if (1..=*max).contains(&n) => Ok(n),
                _ => Err(format!(
                    "the {name} header must be a whole number from 1 to {max}"
                )),
            },
        },
    }
}

/// Whether a request for `host` matches a route's `pattern` (lower case;
/// `*.example.com` takes any name under example.com, not example.com
/// itself, as nginx's `server_name`). Compared as bytes: a name with raw
/// UTF-8 in it (which [`sound_host`] lets through, as nginx does) is
/// matched like any other, not left for a route without a host.
fn host_matches(pattern: &str, host: &[u8]) -> bool {
    // An IPv6 address (kept in its canonical form) matches however the
    // request spells it (`[0:0:0:0:0:0:0:1]` is `[::1]`).
    if let Ok(ip) = pattern.parse::<std::net::Ipv6Addr>() {
        return std::str::from_utf8(host)
            .ok()
            .and_then(|h| h.parse::<std::net::Ipv6Addr>().ok())
            == Some(ip);
    }
    let pattern = pattern.as_bytes();
    match pattern.strip_prefix(b"*") {
        Some(suffix) => {
            host.len() > suffix.len()
                && host[host.len() - suffix.len()..].eq_ignore_ascii_case(suffix)
        }
        None => host.eq_ignore_ascii_case(pattern),
    }
}

/// Whether `raw` is a host as RFC 9110 4.2.3 and RFC 3986 3.2.2 have it
/// (`uri-host [ ":" port ]`): an IP literal in brackets (zone ids and
/// IPvFuture too), or a name of the characters a reg-name may hold (and
/// raw UTF-8, which nginx takes) with no empty label (`..`, as nginx
/// refuses), then a port of at most five digits. Anything else could miss
/// a host route (`api.example:x` is not `api.example` to routing, but is
/// to an upstream that cuts at the colon) or reach the upstream as a
/// Host it trusts (`evil.example/.api.example`). Empty is sound (a target
/// without an authority).
pub fn sound_host(raw: &[u8]) -> bool {
    // RFC 3986's unreserved and sub-delims, and `%` of pct-encoding.
    let plain = |b: u8| {
        b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'-' | b'.'
                    | b'_'
                    | b'~'
                    | b'!'
                    | b'$'
                    | b'&'
                    | b'\''
                    | b'('
                    | b')'
                    | b'*'
                    | b'+'
                    | b','
                    | b';'
                    | b'='
                    | b'%'
            )
    };
    let (host, port) = match raw.strip_prefix(b"[") {
        Some(rest) => {
            let Some(end) = rest.iter().position(|&b| b == b']') else {
                return false;
            };
            let (literal, after) = rest.split_at(end);
            if literal.is_empty() || !literal.iter().all(|&b| plain(b) || b == b':') {
                return false;
            }
            match after.get(1..) {
                Some([]) | None => return true,
                Some([b':', port @ ..]) => (&b""[..], port),
                Some(_) => return false,
            }
        }
        None => match raw.iter().position(|&b| b == b':') {
            Some(i) => (&raw[..i], &raw[i + 1..]),
            None => (raw, &b""[..]),
        },
    };
    let name_ok =
        host.iter().all(|&b| plain(b) || b >= 0x80) && !host.windows(2).any(|w| w == b"..");
    name_ok && port.len() <= 5 && port.iter().all(u8::is_ascii_digit)
}

/// The host a request is for, without port: the target's authority (an
/// absolute-form target, which RFC 9112 3.2.2 puts before `Host`, or
/// HTTP/2's `:authority`), else `Host`.
pub fn request_host<B>(req: &Request<B>) -> Option<&[u8]> {
    let raw = req
        .uri()
        .authority()
        .map(|a| a.as_str().as_bytes())
        .or_else(|| req.headers().get(http::header::HOST).map(|h| h.as_bytes()))?;
    let host = match raw.strip_prefix(b"[") {
        Some(v6) => v6.split(|&b| b == b']').next().unwrap_or(v6),
        None => {
            // [`sound_host`] was checked: at most one colon, then a port.
            let name = raw.split(|&b| b == b':').next().unwrap_or(raw);
            // The root's dot names the same host ("api.example." is
            // "api.example"), as nginx takes it.
            name.strip_suffix(b".").unwrap_or(name)
        }
    };
    Some(host)
}

impl App {
    /// The index of the first route that takes `req` (with `path`, its
    /// normalized path).
    pub fn route<B>(&self, path: &str, req: &Request<B>) -> Option<usize> {
        self.routes.iter().position(|r| r.matches(path, req))
    }

    /// The longest upstream request timeout, for the drain's grace period.
    pub fn longest_request_timeout(&self) -> std::time::Duration {
        self.upstreams
            .iter()
            .map(Upstream::request_timeout)
            .max()
            .unwrap_or_default()
    }

    /// A table with nothing in it.
    pub fn empty() -> App {
        App {
            routes: Vec::new(),
            upstreams: Vec::new(),
            trusted_proxies: Vec::new(),
        }
    }

    /// Build one table per worker for `config`: admission rules (shared,
    /// reusing engine state for routes that keep their name and upstream),
    /// and for each worker its own routes and upstream pools.
    /// Each worker's table for `config`; on a reload, `old` holds the
    /// tables it replaces, whose upstreams' connections go on where the
    /// reload leaves an upstream the same.
    pub fn build_all(
        admission: &Admission,
        config: &Config,
        tls: &Arc<rustls::ClientConfig>,
        workers: usize,
        concurrency: &mut Concurrency,
        old: &[Arc<App>],
    ) -> Result<Vec<App>, ServeError> {
        let caps: Vec<Option<Arc<InFlight>>> = config
            .upstreams
            .iter()
            .map(|u| u.max_concurrency.map(|n| concurrency.get(&u.name, n)))
            .collect();
        // Everything that can fail is built first: a reload that fails
        // leaves the engine untouched (all or nothing).
        let mut pools = (0..workers.max(1))
            .map(|_| {
                config
                    .upstreams
                    .iter()
                    .zip(&caps)
                    .map(|(u, cap)| Upstream::new(u, tls, cap.clone()))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (upstreams, old) in pools.iter_mut().zip(old) {
            for u in upstreams.iter_mut() {
                if let Some(before) = old.upstreams.iter().find(|o| o.name() == u.name()) {
                    u.keep_connections_of(before);
                }
            }
        }
        let specs: Vec<RuleSpec<'_>> = config.routes.iter().map(|r| rule_spec(config, r)).collect();
        let rules = admission.rules(&specs);
        let routes: Vec<Route> = config
            .routes
            .iter()
            .zip(rules)
            .map(|(r, rule)| Route {
                full: Problem::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    &format!(
                        "route '{}': this client's queue is full; retry later",
                        r.name
                    ),
                ),
                max_wait: Problem::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    &format!(
                        "route '{}': the wait would exceed max_wait; retry later",
                        r.name
                    ),
                ),
                expired: Problem::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("route '{}': still queued after max_wait", r.name),
                ),
                name: r.name.clone(),
                host: r.host.clone(),
                path_prefix: r.path_prefix.clone(),
                path: r.path.clone(),
                methods: r.methods.clone(),
                rule,
                upstream: r.upstream,
                key: r.key.clone(),
                on_missing_key: r.on_missing_key,
                cost: r.cost.clone(),
                ratelimit_headers: r.ratelimit_headers,
                strip_prefix: r.strip_prefix.clone(),
                max_tunnels_per_key: r.max_tunnels_per_key,
            })
            .collect();
        Ok(pools
            .drain(..)
            .map(|upstreams| App {
                routes: routes.clone(),
                upstreams,
                trusted_proxies: config.server.trusted_proxies.clone(),
            })
            .collect())
    }
}

fn rule_spec<'a>(config: &'a Config, r: &'a config::Route) -> RuleSpec<'a> {
    let upstream = &config.upstreams[r.upstream];
    RuleSpec {
        name: &r.name,
        protocol: Protocol::Http,
        upstream: &upstream.name,
        cap: upstream.rate,
        pausable: upstream.on_throttle == config::OnThrottle::Pause,
        policy: Policy {
            rate: r.rate,
            capacity: r.capacity,
            burst: r.burst,
            max_wait: r
                .max_wait
                .map(|d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
        },
        dry_run: r.dry_run,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_is_a_name_or_address_and_a_port() {
        for ok in [
            "",
            "api.example",
            "api.example.",
            "API.example:8080",
            "api.example:",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:443",
            "[2001:db8::1]",
            "xn--bcher-kva.example",
            "bücher.example",
            "a_b.example",
            "[fe80::1%25eth0]:8080",
            "[v1.x]",
        ] {
            assert!(sound_host(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "api.example:x",
            "api.example:80:80",
            "api.example:123456",
            "evil.example/.api.example",
            "evil.example\\.api.example",
            "api..example",
            "api example",
            "api.example\t",
            "[::1",
            "[::1]x",
            "[]",
            "[::1/8]",
            "::1",
            "a\0b",
        ] {
            assert!(!sound_host(bad.as_bytes()), "{bad}");
        }
    }

    #[test]
    fn a_cost_header_given_twice_is_refused() {
        use http::HeaderValue;
        let cost = Cost::Header {
            name: http::HeaderName::from_static("x-units"),
            default: 1,
            max: 100,
        };
        let mut h = HeaderMap::new();
        assert_eq!(cost_of(&cost, &h), Ok(1));
        h.append("x-units", HeaderValue::from_static("1"));
        assert_eq!(cost_of(&cost, &h), Ok(1));
        h.append("x-units", HeaderValue::from_static("100"));
        assert_eq!(
            cost_of(&cost, &h),
            Err("the x-units header must appear once".to_owned())
        );
    }

    #[test]
    fn a_wildcard_host_takes_names_under_it_only() {
        let m = |pattern: &str, host: &str| host_matches(pattern, host.as_bytes());
        assert!(m("*.example.com", "api.example.com"));
        assert!(m("*.example.com", "a.b.EXAMPLE.com"));
        assert!(!m("*.example.com", "example.com"));
        assert!(!m("*.example.com", "badexample.com"));
        assert!(!m("*.example.com", ".example.com"));
        assert!(m("api.example.com", "API.example.com"));
        assert!(!m("api.example.com", "x.api.example.com"));
        // Raw UTF-8 (sound, as nginx takes it) is under the wildcard too.
        assert!(m("*.shop.example", "ü.shop.example"));
    }

    /// An IPv6 host route takes the address however it is spelt (a
    /// longer spelling took a looser route to the same upstream).
    #[test]
    fn an_ipv6_host_matches_every_spelling() {
        let m = |pattern: &str, host: &str| host_matches(pattern, host.as_bytes());
        for spelt in ["::1", "0:0:0:0:0:0:0:1", "::0001", "0::1"] {
            assert!(m("::1", spelt), "{spelt}");
        }
        assert!(!m("::1", "::2"));
        assert!(!m("::1", "localhost"));
    }
}
