//! One test per validation rule, each checking the message a user sees.

use super::*;

const MINIMAL: &str = r#"
[[upstream]]
name = "api"
url = "http://127.0.0.1:9000"

[[route]]
name = "default"
upstream = "api"
key = "ip"
rate = "5/s"
capacity = 10
"#;

fn problems(text: &str) -> Vec<String> {
    match Config::from_toml(text) {
        Ok(_) => Vec::new(),
        Err(p) => p.iter().map(ToString::to_string).collect(),
    }
}

fn assert_problem(text: &str, expected: &str) {
    let found = problems(text);
    assert!(
        found.iter().any(|p| p.contains(expected)),
        "expected a problem containing {expected:?}, got {found:?}"
    );
}

#[test]
fn defaults_are_applied() {
    let c = Config::from_toml(MINIMAL).unwrap();
    assert_eq!(c.server.listen, vec!["127.0.0.1:8080".parse().unwrap()]);
    assert_eq!(c.server.header_read_timeout, Duration::from_secs(10));
    assert_eq!(c.server.max_header_size, 16 * 1024);
    assert_eq!(c.server.max_connections, 10_000);
    assert_eq!(c.server.drain_timeout, Duration::from_secs(30));
    assert_eq!(c.admin, None);
    assert_eq!(c.limits.max_clients, 1_000_000);
    assert_eq!(c.limits.max_queued, 100_000);
    assert_eq!(c.upstreams[0].connect_timeout, Duration::from_secs(2));
    assert_eq!(c.upstreams[0].request_timeout, Duration::from_secs(30));
    assert_eq!(c.upstreams[0].rate, None);
    assert_eq!(c.routes[0].path_prefix, "/");
    assert_eq!(c.routes[0].on_missing_key, OnMissingKey::Reject);
    assert_eq!(c.routes[0].upstream, 0);
    assert_eq!(c.routes[0].capacity, 10);
}

#[test]
fn bad_rate_unit_is_invalid() {
    assert_problem(
        &MINIMAL.replace("\"5/s\"", "\"5/x\""),
        "route 'default': rate '5/x': unit must be s, m, h or d",
    );
}

#[test]
fn hourly_and_daily_rates_are_valid() {
    assert!(problems(&MINIMAL.replace("\"5/s\"", "\"10/h\"")).is_empty());
    assert!(problems(&MINIMAL.replace("\"5/s\"", "\"100/d\"")).is_empty());
}

#[test]
fn negative_capacity_is_invalid() {
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = -1"),
        "route 'default': capacity: -1 must be a whole number >= 0",
    );
}

#[test]
fn route_naming_missing_upstream_is_invalid() {
    assert_problem(
        &MINIMAL.replace("upstream = \"api\"", "upstream = \"nope\""),
        "route 'default': upstream 'nope' does not exist (known: 'api')",
    );
}

#[test]
fn duplicate_route_names_are_invalid() {
    let text = format!(
        "{MINIMAL}\n[[route]]\nname = \"default\"\nupstream = \"api\"\nkey = \"ip\"\nrate = \"1/s\"\ncapacity = 1\n"
    );
    assert_problem(&text, "route 'default': duplicate route name 'default'");
}

#[test]
fn duplicate_upstream_names_are_invalid() {
    let text =
        format!("{MINIMAL}\n[[upstream]]\nname = \"api\"\nurl = \"http://127.0.0.1:9001\"\n");
    assert_problem(&text, "upstream 'api': duplicate upstream name 'api'");
}

#[test]
fn unparsable_listen_address_is_invalid() {
    let text = format!("[server]\nlisten = [\"localhost\"]\n{MINIMAL}");
    assert_problem(
        &text,
        "server.listen: 'localhost' is not an address with a port",
    );
}

#[test]
fn bad_duration_is_invalid() {
    let text = MINIMAL.replace(
        "url = \"http://127.0.0.1:9000\"",
        "url = \"http://127.0.0.1:9000\"\nconnect_timeout = \"2 parsecs\"",
    );
    assert_problem(
        &text,
        "upstream 'api': connect_timeout: '2 parsecs' is not a duration",
    );
}

#[test]
fn zero_duration_is_invalid() {
    let text = format!("[server]\nheader_read_timeout = \"0s\"\n{MINIMAL}");
    assert_problem(
        &text,
        "server.header_read_timeout: '0s' must be longer than zero",
    );
}

#[test]
fn unknown_key_kind_is_invalid() {
    assert_problem(
        &MINIMAL.replace("key = \"ip\"", "key = \"cookie:x\""),
        "route 'default': key 'cookie:x': must be \"ip\", \"forwarded\", \"global\" or \"header:NAME\"",
    );
}

#[test]
fn bad_header_name_in_key_is_invalid() {
    assert_problem(
        &MINIMAL.replace("key = \"ip\"", "key = \"header:X Client\""),
        "key 'header:X Client': 'X Client' is not a valid header name",
    );
}

#[test]
fn header_key_is_stored_lower_case() {
    let c =
        Config::from_toml(&MINIMAL.replace("key = \"ip\"", "key = \"header:X-Client\"")).unwrap();
    assert_eq!(
        c.routes[0].key,
        KeySpec(vec![KeyPart::Header(HeaderName::from_static("x-client"))])
    );
}

#[test]
fn upstream_url_with_bad_scheme_is_invalid() {
    assert_problem(
        &MINIMAL.replace("http://127.0.0.1:9000", "ftp://127.0.0.1:9000"),
        "upstream 'api': url 'ftp://127.0.0.1:9000': scheme 'ftp' must be http or https",
    );
}

#[test]
fn upstream_url_with_path_is_invalid() {
    assert_problem(
        &MINIMAL.replace("http://127.0.0.1:9000", "http://127.0.0.1:9000/v1"),
        "must not have a path",
    );
}

#[test]
fn no_routes_is_invalid() {
    let text = "[[upstream]]\nname = \"api\"\nurl = \"http://127.0.0.1:9000\"\n";
    assert_problem(text, "at least one [[route]] is required");
}

#[test]
fn unknown_field_names_its_line_and_table() {
    let text = MINIMAL.replace("capacity = 10", "capacity = 10\nrat = \"5/s\"");
    let p = Config::from_toml(&text).unwrap_err();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].line, Some(12));
    assert!(
        p[0].to_string()
            .starts_with("route[0].rat: unknown field `rat`"),
        "{}",
        p[0]
    );
}

#[test]
fn wrong_type_names_the_field() {
    let p = Config::from_toml(&MINIMAL.replace("\"5/s\"", "5")).unwrap_err();
    assert!(
        p[0].to_string().starts_with("route[0].rate: invalid type"),
        "{}",
        p[0]
    );
}

#[test]
fn path_prefix_must_start_with_slash() {
    let text = MINIMAL.replace(
        "upstream = \"api\"\nkey",
        "upstream = \"api\"\nmatch = { path_prefix = \"api\" }\nkey",
    );
    assert_problem(
        &text,
        "route 'default': match.path_prefix 'api' must start with '/'",
    );
}

#[test]
fn every_problem_is_reported_not_just_the_first() {
    let text = MINIMAL
        .replace("\"5/s\"", "\"5/x\"")
        .replace("capacity = 10", "capacity = -3")
        .replace("key = \"ip\"", "key = \"nope\"");
    assert_eq!(problems(&text).len(), 3, "{:?}", problems(&text));
}

#[test]
fn out_of_range_header_size_is_invalid() {
    let text = format!("[server]\nmax_header_size = 100\n{MINIMAL}");
    assert_problem(&text, "server.max_header_size: 100 is out of range");
}

#[test]
fn zero_limits_are_invalid() {
    let text = format!("{MINIMAL}\n[limits]\nmax_queued = 0\n");
    assert_problem(&text, "limits.max_queued: 0 is out of range");
}

#[test]
fn admin_table_enables_the_admin_listener_on_its_default_address() {
    let c = Config::from_toml(&format!("[admin]\n{MINIMAL}")).unwrap();
    assert_eq!(c.admin, Some("127.0.0.1:9090".parse().unwrap()));
}

#[test]
fn bad_admin_address_is_invalid() {
    assert_problem(
        &format!("[admin]\nlisten = \"nowhere\"\n{MINIMAL}"),
        "admin.listen: 'nowhere' is not an address",
    );
}

#[test]
fn policy_options_are_read() {
    let text = MINIMAL.replace(
        "capacity = 10",
        "capacity = 10\nburst = 3\nmax_wait = \"2s\"\ndry_run = true\nratelimit_headers = true\ncost = { header = \"X-Cost\", max = 50 }\nmatch = { host = \"API.example\", path = \"/x\", methods = [\"get\", \"POST\"] }",
    );
    let r = &Config::from_toml(&text).unwrap().routes[0];
    assert_eq!(r.burst, 3);
    assert_eq!(r.max_wait, Some(Duration::from_secs(2)));
    assert!(r.dry_run && r.ratelimit_headers);
    assert_eq!(
        r.cost,
        Cost::Header {
            name: HeaderName::from_static("x-cost"),
            default: 1,
            max: 50
        }
    );
    assert_eq!(r.host.as_deref(), Some("api.example"));
    assert_eq!(r.path.as_deref(), Some("/x"));
    assert_eq!(r.methods, Some(vec![http::Method::GET, http::Method::POST]));
}

#[test]
fn composite_key_is_read() {
    let c =
        Config::from_toml(&MINIMAL.replace("key = \"ip\"", "key = [\"header:X-Tenant\", \"ip\"]"))
            .unwrap();
    assert_eq!(
        c.routes[0].key,
        KeySpec(vec![
            KeyPart::Header(HeaderName::from_static("x-tenant")),
            KeyPart::Ip
        ])
    );
}

#[test]
fn cost_header_without_max_is_invalid() {
    assert_problem(
        &MINIMAL.replace(
            "capacity = 10",
            "capacity = 10\ncost = { header = \"X-Cost\" }",
        ),
        "route 'default': cost.max is required with cost.header",
    );
}

#[test]
fn zero_cost_is_invalid() {
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 10\ncost = 0"),
        "cost: 0 must be a whole number >= 1",
    );
}

#[test]
fn malformed_cidr_is_invalid() {
    let text = format!("[server]\ntrusted_proxies = [\"10.0.0.0/33\"]\n{MINIMAL}");
    assert_problem(
        &text,
        "server.trusted_proxies: '10.0.0.0/33' is not an address or CIDR block",
    );
}

#[test]
fn forwarded_key_needs_trusted_proxies() {
    assert_problem(
        &MINIMAL.replace("key = \"ip\"", "key = \"forwarded\""),
        "key 'forwarded' needs server.trusted_proxies",
    );
    let text = format!(
        "[server]\ntrusted_proxies = [\"127.0.0.1\"]\n{}",
        MINIMAL.replace("key = \"ip\"", "key = \"forwarded\"")
    );
    assert!(problems(&text).is_empty(), "{:?}", problems(&text));
}

#[test]
fn route_name_must_be_a_plain_identifier() {
    assert_problem(
        &MINIMAL.replace("name = \"default\"", "name = \"my route\""),
        "route 'my route': name may only use letters, digits",
    );
}

#[test]
fn bad_method_is_invalid() {
    let text = MINIMAL.replace(
        "capacity = 10",
        "capacity = 10\nmatch = { methods = [\"G E T\"] }",
    );
    assert_problem(&text, "match.methods: 'G E T' is not an HTTP method");
}
