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
    assert_eq!(c.server.shutdown_delay, Duration::ZERO);
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
        "route 'default': capacity: -1 must be a whole number from 0 to 1000000000",
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
        "upstream 'api': connect_timeout: '2 parsecs' is not a duration such as 250ms or 2s (unknown unit 'parsecs'; use ms, s, m, h or d)",
    );
}

#[test]
fn duration_without_unit_is_invalid() {
    assert_problem(
        &format!("[server]\nheader_read_timeout = \"10\"\n{MINIMAL}"),
        "server.header_read_timeout: '10' is not a duration such as 250ms or 2s (a unit is required: ms, s, m, h or d)",
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
fn upstream_url_path_becomes_the_forwarded_prefix() {
    let c = Config::from_toml(
        &MINIMAL.replace("http://127.0.0.1:9000", "https://api.mailer.example/v3/"),
    )
    .unwrap();
    assert_eq!(c.upstreams[0].path, "/v3");
    assert_eq!(c.upstreams[0].url.path(), "/");
}

#[test]
fn upstream_host_defaults_to_the_upstream_for_a_name_and_the_client_for_an_ip() {
    let by_name =
        Config::from_toml(&MINIMAL.replace("http://127.0.0.1:9000", "https://api.example.com"))
            .unwrap();
    assert_eq!(by_name.upstreams[0].host, HostMode::Upstream);
    let by_ip = Config::from_toml(MINIMAL).unwrap();
    assert_eq!(by_ip.upstreams[0].host, HostMode::Client);
    let v6 = Config::from_toml(&MINIMAL.replace("127.0.0.1", "[::1]")).unwrap();
    assert_eq!(v6.upstreams[0].host, HostMode::Client);
}

#[test]
fn upstream_host_accepts_upstream_client_or_a_literal() {
    let with = |v: &str| MINIMAL.replace("url = ", &format!("host = \"{v}\"\nurl = "));
    assert_eq!(
        Config::from_toml(&with("client")).unwrap().upstreams[0].host,
        HostMode::Client
    );
    assert_eq!(
        Config::from_toml(&with("api.partner.example:8443"))
            .unwrap()
            .upstreams[0]
            .host,
        HostMode::Fixed(http::HeaderValue::from_static("api.partner.example:8443"))
    );
    assert_problem(&with("a b"), "host 'a b' must be");
}

#[test]
fn unreadable_ca_file_is_invalid() {
    assert_problem(
        &MINIMAL.replace("url = ", "ca_file = \"/nonexistent/ca.pem\"\nurl = "),
        "ca_file '/nonexistent/ca.pem': cannot read",
    );
}

#[test]
fn on_throttle_must_be_pass_or_pause() {
    assert_problem(
        &MINIMAL.replace("url = ", "on_throttle = \"retry\"\nurl = "),
        "on_throttle 'retry' must be \"pass\" or \"pause\"",
    );
}

#[test]
fn strip_prefix_must_begin_the_routes_path_prefix() {
    let route = |strip: &str| {
        MINIMAL.replace(
            "key = \"ip\"",
            &format!(
                "key = \"ip\"\nmatch = {{ path_prefix = \"/stripe/\" }}\nstrip_prefix = \"{strip}\""
            ),
        )
    };
    let c = Config::from_toml(&route("/stripe")).unwrap();
    assert_eq!(c.routes[0].strip_prefix.as_deref(), Some("/stripe"));
    assert_problem(
        &route("/mail"),
        "strip_prefix '/mail' must begin match.path_prefix '/stripe/'",
    );
    assert_problem(
        &route("stripe"),
        "strip_prefix 'stripe' must start with '/'",
    );
    // Stripping must end where a segment does: '/str' would leave 'ipe/'.
    assert_problem(
        &route("/str"),
        "strip_prefix '/str' must begin match.path_prefix '/stripe/' and end where a path segment does",
    );
}

#[test]
fn a_route_match_that_could_never_match_is_refused() {
    let with =
        |m: &str| MINIMAL.replace("key = \"ip\"", &format!("key = \"ip\"\nmatch = {{ {m} }}"));
    let host = |h: &str| {
        Config::from_toml(&with(&format!("host = \"{h}\"")))
            .map(|c| c.routes[0].host.clone())
            .map_err(|p| p.iter().map(ToString::to_string).collect::<Vec<_>>())
    };
    assert_eq!(
        host("API.Example.com."),
        Ok(Some("api.example.com".to_owned()))
    );
    assert_eq!(host("[::1]"), Ok(Some("::1".to_owned())));
    assert_eq!(host("*.example.com"), Ok(Some("*.example.com".to_owned())));
    assert_problem(&with("host = \"api.example.com:8443\""), "has a port");
    assert_problem(
        &with("host = \"api.*.com\""),
        "a wildcard may only start it",
    );
    assert_problem(
        &with("host = \"[::1]:80\""),
        "is not an IPv6 address in brackets",
    );
    assert_problem(
        &with("path_prefix = \"/a//b\""),
        "match.path_prefix '/a//b' would never match: requests are matched by their normalized path ('/a/b')",
    );
    assert_problem(
        &with("path = \"/x/../y\""),
        "match.path '/x/../y' would never match",
    );
    assert!(Config::from_toml(&with("path_prefix = \"/api/\", path = \"/api/v1\"")).is_ok());
    // "/." takes "/.env" and "/.git/config": a prefix, not a path.
    assert!(Config::from_toml(&with("path_prefix = \"/.\"")).is_ok());
    assert_problem(&with("path = \"/.\""), "match.path '/.' would never match");
    // Routes match a path without its ';' parameters.
    assert_problem(
        &with("path_prefix = \"/api;v=2/\""),
        "match.path_prefix '/api;v=2/' would never match: requests are matched by their normalized path ('/api/', without its ';' parameters)",
    );
}

#[test]
fn sizes_take_units_and_are_bounded() {
    assert_eq!(parse_size("1MiB"), Ok(1 << 20));
    assert_eq!(parse_size("512kB"), Ok(512_000));
    assert_eq!(parse_size("25MB"), Ok(25_000_000));
    assert_eq!(parse_size("1048576"), Ok(1 << 20));
    assert!(parse_size("1 parsec").is_err());
    assert_eq!(parse_size("1TiB"), Ok(1 << 40));
    assert_problem(
        &format!("{MINIMAL}\n[limits]\nmax_staged_bytes = \"2TiB\"\n"),
        "limits.max_staged_bytes: 2199023255552 bytes is out of range: 1 byte to 1TiB",
    );
    let c = Config::from_toml(&format!(
        "{MINIMAL}\n[limits]\nmax_staged_body = \"64KiB\"\nmax_staged_bytes = 1000000\n"
    ))
    .unwrap();
    assert_eq!(c.limits.max_staged_body, 64 << 10);
    assert_eq!(c.limits.max_staged_bytes, 1_000_000);
    assert_problem(
        &format!("{MINIMAL}\n[limits]\nmax_staged_body = \"2 parsecs\"\n"),
        "limits.max_staged_body: '2 parsecs': unknown unit 'parsecs'",
    );
    assert_problem(
        &format!("{MINIMAL}\n[limits]\nmax_staged_body = 0\n"),
        "limits.max_staged_body: 0 bytes is out of range",
    );
}

#[test]
fn no_routes_is_invalid() {
    let text = "[[upstream]]\nname = \"api\"\nurl = \"http://127.0.0.1:9000\"\n";
    assert_problem(
        text,
        "at least one [[route]] (HTTP) or [[smtp]] listener is required",
    );
}

#[test]
fn unknown_field_names_its_line_and_route() {
    let text = MINIMAL.replace("capacity = 10", "capacity = 10\nrat = \"5/s\"");
    let p = Config::from_toml(&text).unwrap_err();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].line, Some(12));
    assert!(
        p[0].to_string().starts_with(
            "route 'default': unknown field 'rat', expected one of 'name', 'match', 'upstream'"
        ),
        "{}",
        p[0]
    );
}

#[test]
fn wrong_type_names_the_field_and_what_it_should_be() {
    let p = Config::from_toml(&MINIMAL.replace("\"5/s\"", "5")).unwrap_err();
    assert_eq!(
        p[0].to_string(),
        "route 'default': rate: invalid type: integer '5', expected a rate such as \"5/s\" or \"300/m\""
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
    assert_eq!(
        c.admin,
        Some(Admin {
            listen: "127.0.0.1:9090".parse().unwrap(),
            show_keys: false
        })
    );
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
        "cost: 0 must be a whole number from 1 to 1000000",
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

#[test]
fn unknown_table_is_refused() {
    let p = Config::from_toml(&format!("{MINIMAL}\n[limit]\nmax_queued = 5\n")).unwrap_err();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].line, Some(13));
    assert!(
        p[0].to_string()
            .starts_with("unknown field 'limit', expected one of 'server'"),
        "{}",
        p[0]
    );
}

#[test]
fn syntax_error_names_its_line_and_key() {
    let p = Config::from_toml(&MINIMAL.replace("capacity = 10", "capacity = = 10")).unwrap_err();
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].line, Some(11));
    assert_eq!(
        p[0].to_string(),
        "route 'default': capacity: extra '=', expected nothing"
    );
}

#[test]
fn duplicate_key_names_the_key() {
    let text =
        format!("[server]\nlisten = [\"127.0.0.1:1\"]\nlisten = [\"127.0.0.1:2\"]\n{MINIMAL}");
    let p = Config::from_toml(&text).unwrap_err();
    assert_eq!(p[0].line, Some(3));
    assert_eq!(p[0].to_string(), "server: duplicate key 'listen'");
}

#[test]
fn parse_error_in_route_without_name_names_it_by_index() {
    let p = Config::from_toml(
        &MINIMAL
            .replace("name = \"default\"\n", "")
            .replace("capacity = 10", "capacity = \"ten\""),
    )
    .unwrap_err();
    assert!(
        p[0].to_string().starts_with(
            "route[0]: capacity: invalid type: string \"ten\", expected a whole number"
        ),
        "{}",
        p[0]
    );
}

#[test]
fn error_in_multi_line_array_names_the_element() {
    let text = format!("[server]\nlisten = [\n  \"127.0.0.1:1\",\n  8080,\n]\n{MINIMAL}");
    let p = Config::from_toml(&text).unwrap_err();
    assert_eq!(p[0].line, Some(4));
    assert!(
        p[0].to_string().starts_with(
            "server.listen[1]: invalid type: integer '8080', expected an address with a port"
        ),
        "{}",
        p[0]
    );
}

#[test]
fn error_in_inline_table_names_the_inner_key() {
    let text = MINIMAL.replace("key = \"ip\"", "key = \"ip\"\nmatch = { path_prefix = 5 }");
    assert_eq!(
        problems(&text),
        ["route 'default': match.path_prefix: invalid type: integer '5', expected a string"]
    );
}

#[test]
fn key_of_wrong_type_says_what_a_key_is() {
    assert_problem(
        &MINIMAL.replace("key = \"ip\"", "key = 5"),
        "route 'default': key: invalid type: integer '5', expected a key such as \"ip\", \"global\" or \"header:X-Client\", or a list of them",
    );
}

#[test]
fn cost_table_with_unknown_field_names_it() {
    assert_problem(
        &MINIMAL.replace(
            "capacity = 10",
            "capacity = 10\ncost = { header = \"X-Cost\", maximum = 9 }",
        ),
        "route 'default': cost: unknown field 'maximum', expected one of 'header', 'default', 'max'",
    );
}

#[test]
fn fractional_capacity_is_invalid() {
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 10.5"),
        "route 'default': capacity: invalid type: floating point '10.5', expected a whole number",
    );
}

#[test]
fn capacity_beyond_u32_is_invalid() {
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 4_294_967_296"),
        "route 'default': capacity: 4294967296 must be a whole number from 0 to 1000000000",
    );
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 99999999999999999999"),
        "route 'default': capacity: 99999999999999999999 is out of range",
    );
}

#[test]
fn integers_may_use_underscores() {
    let c = Config::from_toml(&format!("{MINIMAL}\n[limits]\nmax_clients = 2_000_000\n")).unwrap();
    assert_eq!(c.limits.max_clients, 2_000_000);
}

#[test]
fn duration_written_as_a_number_is_invalid() {
    assert_problem(
        &format!("[server]\nheader_read_timeout = 10\n{MINIMAL}"),
        "server.header_read_timeout: invalid type: integer '10', expected a duration such as \"2s\" or \"250ms\"",
    );
}

#[test]
fn sub_second_durations_are_valid() {
    let c = Config::from_toml(&format!(
        "[server]\nheader_read_timeout = \"250ms\"\n{MINIMAL}"
    ))
    .unwrap();
    assert_eq!(c.server.header_read_timeout, Duration::from_millis(250));
}

#[test]
fn upstream_url_without_scheme_is_one_problem() {
    for url in ["127.0.0.1:9000", "/api"] {
        assert_eq!(
            problems(&MINIMAL.replace("http://127.0.0.1:9000", url)),
            [format!(
                "upstream 'api': url '{url}': must start with http:// or https://"
            )]
        );
    }
}

#[test]
fn upstream_url_with_query_is_invalid() {
    assert_problem(
        &MINIMAL.replace("http://127.0.0.1:9000", "http://127.0.0.1:9000/?a=1"),
        "upstream 'api': url 'http://127.0.0.1:9000/?a=1': must not have a query",
    );
}

#[test]
fn upstream_url_with_credentials_is_invalid() {
    assert_problem(
        &MINIMAL.replace("http://127.0.0.1:9000", "http://me:secret@127.0.0.1:9000"),
        "must not contain user info (user:password@)",
    );
}

#[test]
fn empty_upstream_url_is_invalid() {
    assert_problem(
        &MINIMAL.replace("http://127.0.0.1:9000", ""),
        "upstream 'api': url must not be empty",
    );
}

#[test]
fn https_upstream_with_trailing_slash_is_valid() {
    let c =
        Config::from_toml(&MINIMAL.replace("http://127.0.0.1:9000", "https://api.example.com/"))
            .unwrap();
    assert_eq!(c.upstreams[0].url.scheme_str(), Some("https"));
}

#[test]
fn upstream_url_violations_are_each_explained() {
    let found =
        problems(&MINIMAL.replace("http://127.0.0.1:9000", "ftp://user@127.0.0.1:9000/x?y"));
    assert_eq!(found.len(), 3, "{found:?}");
}

#[test]
fn duplicate_listen_addresses_are_invalid() {
    assert_problem(
        &format!("[server]\nlisten = [\"127.0.0.1:1\", \"127.0.0.1:1\"]\n{MINIMAL}"),
        "server.listen: '127.0.0.1:1' is listed twice",
    );
}

#[test]
fn empty_listen_is_invalid() {
    assert_problem(
        &format!("[server]\nlisten = []\n{MINIMAL}"),
        "server.listen: at least one address is required",
    );
}

#[test]
fn several_listeners_including_ipv6_are_valid() {
    let c = Config::from_toml(&format!(
        "[server]\nlisten = [\"127.0.0.1:1\", \"[::1]:1\"]\n{MINIMAL}"
    ))
    .unwrap();
    assert_eq!(c.server.listen.len(), 2);
}

#[test]
fn header_size_below_hyper_minimum_is_invalid() {
    assert_problem(
        &format!("[server]\nmax_header_size = 8191\n{MINIMAL}"),
        "server.max_header_size: 8191 is out of range: must be 8192 to 1048576 bytes",
    );
    assert!(problems(&format!("[server]\nmax_header_size = 8192\n{MINIMAL}")).is_empty());
}

#[test]
fn zero_max_connections_is_invalid() {
    assert_problem(
        &format!("[server]\nmax_connections = 0\n{MINIMAL}"),
        "server.max_connections: 0 is out of range: must be a whole number from 1 to 1000000",
    );
}

#[test]
fn zero_max_clients_is_invalid() {
    assert_problem(
        &format!("{MINIMAL}\n[limits]\nmax_clients = 0\n"),
        "limits.max_clients: 0 is out of range: must be a whole number from 1 to 100000000",
    );
}

#[test]
fn no_upstreams_is_invalid() {
    let text = MINIMAL.replace(
        "[[upstream]]\nname = \"api\"\nurl = \"http://127.0.0.1:9000\"\n",
        "",
    );
    assert_problem(&text, "upstream: at least one [[upstream]] is required");
}

#[test]
fn empty_route_name_is_invalid() {
    assert_problem(
        &MINIMAL.replace("name = \"default\"", "name = \"\""),
        "route[0]: name must not be empty",
    );
}

#[test]
fn empty_upstream_name_is_invalid() {
    assert_problem(
        &MINIMAL.replace("name = \"api\"", "name = \"\""),
        "upstream[0]: name must not be empty",
    );
}

#[test]
fn missing_route_fields_are_each_reported() {
    let text = "[[upstream]]\nname = \"api\"\nurl = \"http://127.0.0.1:9000\"\n[[route]]\n";
    assert_eq!(
        problems(text),
        [
            "route[0]: name is required",
            "route[0]: upstream is required",
            "route[0]: key is required: \"ip\", \"forwarded\", \"global\", \"header:NAME\" or a list of them",
            "route[0]: rate is required, such as \"5/s\"",
            "route[0]: capacity is required (a whole number >= 0)",
        ]
    );
}

#[test]
fn missing_upstream_url_is_invalid() {
    assert_problem(
        &MINIMAL.replace("url = \"http://127.0.0.1:9000\"\n", ""),
        "upstream 'api': url is required, such as http://127.0.0.1:9000",
    );
}

#[test]
fn bad_upstream_rate_is_invalid() {
    assert_problem(
        &MINIMAL.replace(
            "url = \"http://127.0.0.1:9000\"",
            "url = \"http://127.0.0.1:9000\"\nrate = \"fast\"",
        ),
        "upstream 'api': rate 'fast': expected the form N/UNIT, such as 5/s or 300/m",
    );
}

#[test]
fn bad_on_missing_key_is_invalid() {
    assert_problem(
        &MINIMAL.replace(
            "key = \"ip\"",
            "key = \"header:X-Client\"\non_missing_key = \"allow\"",
        ),
        "route 'default': on_missing_key 'allow' must be \"reject\" or \"ip\"",
    );
}

#[test]
fn global_key_and_ip_fallback_are_read() {
    let c = Config::from_toml(
        &MINIMAL.replace("key = \"ip\"", "key = \"global\"\non_missing_key = \"ip\""),
    )
    .unwrap();
    assert_eq!(c.routes[0].key, KeySpec(vec![KeyPart::Global]));
    assert_eq!(c.routes[0].on_missing_key, OnMissingKey::Ip);
}

#[test]
fn zero_capacity_is_valid() {
    let c = Config::from_toml(&MINIMAL.replace("capacity = 10", "capacity = 0")).unwrap();
    assert_eq!(c.routes[0].capacity, 0);
}

#[test]
fn route_upstream_is_resolved_by_name() {
    let text = format!(
        "[[upstream]]\nname = \"other\"\nurl = \"http://127.0.0.1:9001\"\n{}",
        MINIMAL
    );
    assert_eq!(Config::from_toml(&text).unwrap().routes[0].upstream, 1);
}

#[test]
fn invalid_config_error_prints_one_line_per_problem_naming_the_file() {
    let text = MINIMAL
        .replace("\"5/s\"", "\"5/x\"")
        .replace("upstream = \"api\"", "upstream = \"nope\"");
    let e = ConfigError::Invalid {
        path: PathBuf::from("config/bad.toml"),
        problems: Config::from_toml(&text).unwrap_err(),
    };
    assert_eq!(
        e.to_string(),
        "config/bad.toml: route 'default': upstream 'nope' does not exist (known: 'api')\n\
         config/bad.toml: route 'default': rate '5/x': unit must be s, m, h or d"
    );
}

#[test]
fn parse_error_prints_file_and_line() {
    let e = ConfigError::Invalid {
        path: PathBuf::from("config/bad.toml"),
        problems: Config::from_toml(&MINIMAL.replace("capacity = 10", "capacity = 10\nrat = 1"))
            .unwrap_err(),
    };
    let text = e.to_string();
    assert!(
        text.starts_with("config/bad.toml:12: route 'default': unknown field 'rat'"),
        "{text}"
    );
    assert_eq!(text.lines().count(), 1);
}

#[test]
fn unreadable_file_is_reported_with_its_path() {
    let e = Config::load(Path::new("/nonexistent/sluice.toml")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/nonexistent/sluice.toml: cannot read: "),
        "{e}"
    );
}

#[test]
fn shipped_example_is_valid_and_states_the_defaults() {
    let shipped = Config::from_toml(include_str!("../../config/sluice.toml")).unwrap();
    let defaults = Config::from_toml(MINIMAL).unwrap();
    let (s, d) = (&shipped.server, &defaults.server);
    assert_eq!(s.listen, d.listen);
    assert_eq!(s.header_read_timeout, d.header_read_timeout);
    assert_eq!(s.max_header_size, d.max_header_size);
    assert_eq!(s.max_connections, d.max_connections);
    assert_eq!(s.drain_timeout, d.drain_timeout);
    assert_eq!(s.trusted_proxies, d.trusted_proxies);
    let (s, d) = (&shipped.upstreams[0], &defaults.upstreams[0]);
    assert_eq!(s.url, d.url);
    assert_eq!(s.rate, d.rate);
    assert_eq!(s.connect_timeout, d.connect_timeout);
    assert_eq!(s.request_timeout, d.request_timeout);
    assert_eq!(s.max_concurrency, d.max_concurrency);
    let (s, d) = (&shipped.routes[0], &defaults.routes[0]);
    assert_eq!(s.path_prefix, d.path_prefix);
    assert_eq!(
        (s.cost.clone(), s.burst, s.max_wait),
        (d.cost.clone(), d.burst, d.max_wait)
    );
    assert_eq!(
        (s.dry_run, s.ratelimit_headers),
        (d.dry_run, d.ratelimit_headers)
    );
    assert_eq!(
        (shipped.limits.max_clients, shipped.limits.max_queued),
        (defaults.limits.max_clients, defaults.limits.max_queued)
    );
}

#[test]
fn table_defined_twice_names_it() {
    let text = format!("[route]\nname = \"x\"\n{MINIMAL}");
    let p = Config::from_toml(&text).unwrap_err();
    assert_eq!(p[0].line, Some(8));
    assert_eq!(p[0].to_string(), "route: duplicate key 'route'");
}

#[test]
fn numbers_above_their_bounds_are_invalid() {
    // Values `run` could not use (tokio's semaphore maximum, timer
    // overflow) are refused by `check`.
    let with = |section: &str| format!("{MINIMAL}\n{section}\n");
    assert_problem(
        &MINIMAL.replace("url = ", "max_concurrency = 9223372036854775807\nurl = "),
        "max_concurrency: 9223372036854775807 is out of range: must be a whole number from 1 to 1000000",
    );
    assert_problem(
        &with("[server]\nmax_connections = 9223372036854775807"),
        "server.max_connections: 9223372036854775807 is out of range",
    );
    for field in ["header_read_timeout", "drain_timeout"] {
        assert_problem(
            &with(&format!("[server]\n{field} = \"18446744073709551615s\"")),
            &format!("server.{field}: '18446744073709551615s'"),
        );
        assert_problem(
            &with(&format!("[server]\n{field} = \"2d\"")),
            &format!("server.{field}: '2d' is too long: at most 1day"),
        );
    }
    assert_problem(
        &MINIMAL.replace("url = ", "request_timeout = \"25h\"\nurl = "),
        "request_timeout: '25h' is too long",
    );
    assert_problem(
        &MINIMAL.replace("rate = \"5/s\"", "rate = \"2000000000/s\""),
        "rate is too high",
    );
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 10\nburst = 1000001"),
        "burst must be a whole number from 0 to 1000000",
    );
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 10\nmax_wait = \"31d\""),
        "max_wait: '31d' is too long: at most 30days",
    );
}

#[test]
fn local_fallback_needs_the_instance_count() {
    let cluster = |extra: &str| {
        format!("{MINIMAL}\n[cluster]\nredis = \"redis://127.0.0.1:6379\"\n{extra}\n")
    };
    assert_problem(
        &cluster(""),
        "cluster.instances: is required with on_failure = \"local\"",
    );
    assert!(Config::from_toml(&cluster("instances = 3")).is_ok());
    assert!(Config::from_toml(&cluster("on_failure = \"reject\"")).is_ok());
    assert_problem(
        &cluster("instances = 10001"),
        "cluster.instances: must be a whole number from 1 to 10000",
    );
}

#[test]
fn the_cluster_store_is_redis_or_postgres() {
    let cluster = |body: &str| format!("{MINIMAL}\n[cluster]\non_failure = \"reject\"\n{body}\n");
    assert_problem(
        &cluster("redis = \"redis://127.0.0.1:6379\"\npostgres = \"postgres://u@h/db\""),
        "cluster: set either redis or postgres, not both",
    );
    assert_problem(&cluster(""), "cluster.redis: is required");
    let pg = Config::from_toml(&cluster(
        "postgres = \"postgres://app@db.example/shape?sslmode=verify-full\"\ndurable = true\npool_size = 4",
    ))
    .expect("valid");
    match pg.cluster.map(|c| c.store) {
        Some(Store::Postgres(p)) => {
            assert!(p.durable);
            assert_eq!(p.pool_size, 4);
            assert_eq!(p.target.sslmode, super::postgres::SslMode::VerifyFull);
        }
        other => panic!("{other:?}"),
    }
    assert_problem(
        &cluster("postgres = \"postgres://u@h/db\"\nmode = \"cluster\""),
        "cluster.mode: applies to redis only",
    );
    // Node URLs are parsed as the client will at start (never shown: they
    // may hold a password); ca_file is for rediss:// nodes.
    assert_problem(
        &cluster("redis = [\"redis://127.0.0.1:6379\", \"redis://:pw@h:notaport\"]"),
        "cluster.redis: node 2:",
    );
    assert!(
        !problems(&cluster("redis = \"redis://:hunter2@h/x\""))
            .iter()
            .any(|p| p.contains("hunter2"))
    );
    assert_problem(
        &cluster("redis = \"redis://127.0.0.1:6379\"\nca_file = \"/etc/ssl/ca.pem\""),
        "cluster.ca_file: applies to rediss:// (TLS) nodes, and every node must be one",
    );
    assert_problem(
        &cluster(
            "redis = [\"rediss://a:6379\", \"redis://b:6379\"]\nca_file = \"/etc/ssl/ca.pem\"",
        ),
        "every node must be one",
    );
    assert_problem(
        &cluster("postgres = \"postgres://u@h/db\"\nca_file = \"/etc/ssl/ca.pem\""),
        "cluster.ca_file: applies to redis only",
    );
    assert_problem(
        &cluster("redis = \"rediss://127.0.0.1:6379\"\nca_file = \"/nonexistent/ca.pem\""),
        "ca_file '/nonexistent/ca.pem': cannot read",
    );
    assert_problem(
        &cluster("redis = \"redis://127.0.0.1:6379\"\ndurable = true"),
        "cluster.durable: applies to postgres only",
    );
    assert_problem(
        &cluster("redis = \"redis://127.0.0.1:6379\"\nkey_prefix = \"{app}:\""),
        "cluster.key_prefix: '{app}:' must not contain '{' or '}' (Redis Cluster hash tags)",
    );
    assert_problem(
        &cluster("postgres = \"postgres://u@h/db\"\npool_size = 0"),
        "cluster.pool_size: must be a whole number from 1 to 256",
    );
    assert_problem(
        &cluster(
            "postgres = \"postgres://u@h/db?sslmode=verify-full&sslrootcert=/nonexistent.pem\"",
        ),
        "cluster.postgres: sslrootcert '/nonexistent.pem': cannot read",
    );
    assert_problem(
        &cluster("postgres = \"postgres://u@h/db\"\npassword_file = \"/nonexistent\""),
        "cluster.password_file: password_file '/nonexistent': cannot read",
    );
    // Readable by everyone: refused, as the SMTP secrets are.
    let open = std::env::temp_dir().join(format!("sluice-pg-pass-{}", std::process::id()));
    std::fs::write(&open, "secret").unwrap();
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    assert_problem(
        &cluster(&format!(
            "postgres = \"postgres://u@h/db\"\npassword_file = \"{}\"",
            open.display()
        )),
        "is readable by everyone; chmod o-r it",
    );
    std::fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let found = problems(&cluster(&format!(
        "postgres = \"postgres://u@h/db\"\npassword_file = \"{}\"",
        open.display()
    )));
    let _ = std::fs::remove_file(&open);
    assert!(
        !found.iter().any(|p| p.contains("password_file")),
        "{found:?}"
    );
}

const SMTP: &str = r#"
[[smtp_upstream]]
name = "relay"
url = "smtp://127.0.0.1:2526"

[[smtp]]
name = "mail"
listen = ["127.0.0.1:2525"]
upstream = "relay"
key = "global"
rate = "5/s"
capacity = 10
"#;

/// An SMTP listener's TLS private key readable by everyone is refused,
/// as password files are.
#[test]
fn a_tls_key_readable_by_everyone_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let key = std::env::temp_dir().join(format!("sluice-tls-key-{}", std::process::id()));
    std::fs::write(&key, "not even a key").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let text = format!(
        "{SMTP}tls_cert = \"/nonexistent.pem\"\ntls_key = \"{}\"\n",
        key.display()
    );
    assert_problem(&text, "is readable by everyone; chmod o-r it");
    // Kept to its owner, it is read (and here fails as what it is).
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let found = problems(&text);
    let _ = std::fs::remove_file(&key);
    assert!(
        !found.iter().any(|p| p.contains("readable by everyone")),
        "{found:?}"
    );
    assert!(found.iter().any(|p| p.contains("tls_cert")), "{found:?}");
    // Readable by everyone, in a directory only its owner may enter
    // (certbot's older archive/): kept.
    let dir = std::env::temp_dir().join(format!("sluice-tls-dir-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let inner = dir.join("privkey.pem");
    std::fs::write(&inner, "not even a key").unwrap();
    std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o644)).unwrap();
    let found = problems(&format!(
        "{SMTP}tls_cert = \"/nonexistent.pem\"\ntls_key = \"{}\"\n",
        inner.display()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !found.iter().any(|p| p.contains("readable by everyone")),
        "{found:?}"
    );
}

#[test]
fn listeners_that_overlap_are_invalid() {
    // The SMTP example alone is valid.
    assert_eq!(problems(SMTP), Vec::<String>::new());
    assert_problem(
        &format!("[admin]\nlisten = \"127.0.0.1:2525\"\n{SMTP}"),
        "smtp 'mail': listen: 127.0.0.1:2525 overlaps 127.0.0.1:2525 in admin.listen",
    );
    assert_problem(
        &format!("[server]\nlisten = [\"0.0.0.0:2525\"]\n{MINIMAL}{SMTP}"),
        "smtp 'mail': listen: 127.0.0.1:2525 overlaps 0.0.0.0:2525 in server.listen",
    );
    let second = SMTP
        .split("[[smtp]]")
        .nth(1)
        .unwrap()
        .replace("\"mail\"", "\"mail2\"");
    assert_problem(
        &format!("{SMTP}\n[[smtp]]{second}"),
        "smtp 'mail2': listen: 127.0.0.1:2525 overlaps 127.0.0.1:2525 in smtp 'mail': listen",
    );
    // Other families, other ports and port 0 do not overlap.
    let fine = format!(
        "[server]\nlisten = [\"0.0.0.0:8080\", \"[::]:8080\", \"127.0.0.1:0\"]\n[admin]\nlisten = \"127.0.0.1:0\"\n{MINIMAL}{SMTP}"
    );
    assert_eq!(problems(&fine), Vec::<String>::new());
}

#[test]
fn a_message_size_over_the_staging_budget_is_invalid() {
    assert_problem(
        &format!("[limits]\nmax_staged_bytes = \"4MiB\"\n{SMTP}"),
        "smtp 'mail': max_message_size (10240000 bytes) is more than limits.max_staged_bytes (4194304 bytes)",
    );
    let fits = SMTP.replace(
        "capacity = 10",
        "capacity = 10\nmax_message_size = \"4MiB\"",
    );
    assert_eq!(
        problems(&format!("[limits]\nmax_staged_bytes = \"4MiB\"\n{fits}")),
        Vec::<String>::new()
    );
}

#[test]
fn an_https_host_tls_cannot_name_is_invalid() {
    assert_problem(
        &MINIMAL.replace("http://127.0.0.1:9000", "https://api..example.com"),
        "url 'https://api..example.com': api..example.com: invalid dns name",
    );
    // Names and addresses TLS takes.
    for ok in [
        "https://api.example.com",
        "https://127.0.0.1:9443",
        "https://[::1]:9443",
    ] {
        assert_eq!(
            problems(&MINIMAL.replace("http://127.0.0.1:9000", ok)),
            Vec::<String>::new()
        );
    }
}

#[test]
fn greeting_names_are_host_names_or_address_literals() {
    let with = |line: &str| SMTP.replace("key = \"global\"", &format!("key = \"global\"\n{line}"));
    for ok in ["mx.example.com", "[192.0.2.1]", "[IPv6:2001:db8::1]"] {
        assert_eq!(
            problems(&with(&format!("hostname = \"{ok}\""))),
            Vec::<String>::new()
        );
    }
    // A CR LF inside brackets would put a line of its own in the greeting.
    assert_problem(
        &with("hostname = \"[x\\r\\n250 forged]\""),
        "hostname '[x\r\n250 forged]' is not a host name",
    );
    assert_problem(&with("hostname = \"[example.com]\""), "is not a host name");
    assert_problem(&with("hostname = \"[2001:db8::1]\""), "is not a host name");
}

#[test]
fn a_body_limit_past_the_staging_total_is_invalid() {
    assert_problem(
        &format!("{MINIMAL}\n[limits]\nmax_staged_body = \"2MiB\"\nmax_staged_bytes = \"1MiB\"\n"),
        "max_staged_body (2097152 bytes) is more than max_staged_bytes (1048576 bytes)",
    );
}

#[test]
fn a_burst_queue_or_cost_too_long_for_the_schedule_is_invalid() {
    // 299,999 days of burst credit: the engine's tolerance saturated, and
    // every request passed at once.
    assert_problem(
        &MINIMAL
            .replace("\"5/s\"", "\"1/d\"")
            .replace("capacity = 10", "capacity = 10\nburst = 300000"),
        "route 'default': burst 300000: 299999 intervals of 1day (the rate's) span 299999 days, and the schedule holds at most 73000 days",
    );
    assert_problem(
        &MINIMAL
            .replace("\"5/s\"", "\"1/d\"")
            .replace("capacity = 10", "capacity = 80000"),
        "capacity 80000: 80000 intervals of 1day",
    );
    assert_problem(
        &MINIMAL.replace("\"5/s\"", "\"1/d\"").replace(
            "capacity = 10",
            "capacity = 10\ncost = { header = \"X-Cost\", max = 1000000 }",
        ),
        "cost 1000000: 1000000 intervals of 1day",
    );
    assert_problem(
        &SMTP.replace("\"5/s\"", "\"1/d\"").replace(
            "capacity = 10",
            "capacity = 10\ncost = \"recipients\"\nmax_recipients = 100000",
        ),
        "cost (max_recipients) 100000: 100000 intervals of 1day",
    );
    let fine = MINIMAL.replace("capacity = 10", "capacity = 1000000\nburst = 1000000");
    assert_eq!(problems(&fine), Vec::<String>::new());
    // The other rates a route is shaped by: its upstream's cap, and its
    // share of the rate while the cluster's store is down.
    let costly = MINIMAL.replace(
        "capacity = 10",
        "capacity = 10\ncost = { header = \"X-Cost\", max = 100000 }",
    );
    assert_problem(
        &costly.replace("url = ", "rate = \"1/d\"\nurl = "),
        "route 'default': cost 100000 at the upstream's rate: 100000 intervals of 1day",
    );
    let local = "\n[cluster]\nredis = \"redis://127.0.0.1:6379\"\non_failure = \"local\"\ninstances = 1000\n";
    assert_problem(
        &format!("{}{local}", costly.replace("\"5/s\"", "\"1/h\"")),
        "cost 100000 at rate / cluster.instances (on_failure = \"local\")",
    );
    assert_eq!(problems(&format!("{costly}{local}")), Vec::<String>::new());
    // Under an upstream's rate in cluster mode, each unit of cost is a slot
    // the store writes in one call: 10,000 at most.
    let capped = costly.replace("url = ", "rate = \"100/s\"\nurl = ");
    assert_problem(
        &format!("{capped}{local}"),
        "route 'default': cost 100000 under its upstream's rate in cluster mode: at most 10000",
    );
    assert_eq!(problems(&capped), Vec::<String>::new());
    let under = capped.replace("max = 100000", "max = 10000");
    assert_eq!(problems(&format!("{under}{local}")), Vec::<String>::new());
    // And the upstream's rate is shared too while the store is down: 1/d
    // over 1,000 instances is the slowest rate (30 days), and 10,000 of
    // those are past the span, where 10,000 days are not.
    let slow_cap = under.replace("\"100/s\"", "\"1/d\"");
    assert_eq!(problems(&slow_cap), Vec::<String>::new());
    assert_problem(
        &format!("{slow_cap}{local}"),
        "route 'default': cost 10000 at the upstream's rate / cluster.instances (on_failure = \"local\")",
    );
}

#[test]
fn a_fixed_cost_above_a_capacity_is_invalid() {
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 5\ncost = 10"),
        "route 'default': cost 10 is more than capacity 5: no request could ever wait",
    );
    for ok in ["capacity = 0\ncost = 10", "capacity = 10\ncost = 10"] {
        assert_eq!(
            problems(&MINIMAL.replace("capacity = 10", ok)),
            Vec::<String>::new()
        );
    }
}

#[test]
fn the_shutdown_delay_may_be_zero_and_is_bounded() {
    let with = |value: &str| format!("{MINIMAL}\n[server]\nshutdown_delay = \"{value}\"\n");
    for (text, want) in [("0s", 0), ("15s", 15), ("10m", 600)] {
        let c = Config::from_toml(&with(text)).unwrap();
        assert_eq!(c.server.shutdown_delay, Duration::from_secs(want), "{text}");
    }
    assert_problem(
        &with("11m"),
        "server.shutdown_delay: '11m' is too long: at most 10m",
    );
    assert_problem(&with("soon"), "server.shutdown_delay: 'soon'");
}

/// A port that is not one (a typo, past 65535, 0) is refused: http::Uri
/// takes any text after the host's colon, and the connection then went to
/// the scheme's own port, perhaps another service.
#[test]
fn an_upstream_port_that_is_no_port_is_refused() {
    for bad in ["8o80", "99999", "0", ""] {
        let text = MINIMAL.replace("127.0.0.1:9000", &format!("backend:{bad}"));
        assert_problem(&text, &format!("'{bad}' is not a port (1 to 65535)"));
    }
    // A host whose name is also in its port (found by its text).
    let a = MINIMAL.replace("127.0.0.1:9000", "a:8a");
    assert_problem(&a, "'8a' is not a port");
    let v6 = MINIMAL.replace("127.0.0.1:9000", "[::1]:70000");
    assert_problem(&v6, "'70000' is not a port");
    for good in ["backend:8080", "[::1]:9000", "backend", "[::1]"] {
        let text = MINIMAL.replace("127.0.0.1:9000", good);
        assert_eq!(problems(&text), Vec::<String>::new(), "{good}");
    }
    let host = MINIMAL.replace("url = ", "host = \"api.example:99999\"\nurl = ");
    assert_problem(&host, "host 'api.example:99999' must be");
}

/// An SMTP upstream's URL: a port from 1 to 65535, an IPv6 address in
/// brackets, a host that is a name or an address.
#[test]
fn an_smtp_upstream_url_names_a_host_and_a_port() {
    let with = |url: &str| SMTP.replace("smtp://127.0.0.1:2526", url);
    for (bad, says) in [
        ("smtp://127.0.0.1:0", "'0' is not a port"),
        ("smtp://relay:0", "'0' is not a port"),
        ("smtp://relay:2525x", "'2525x' is not a port"),
        ("smtp://[2001:db8::1]:2525x", "'2525x' is not a port"),
        ("smtp://[2001:db8::1", "an IPv6 address goes in brackets"),
        ("smtp://[relay]:25", "an IPv6 address goes in brackets"),
        ("smtp://2001:db8::1", "an IPv6 address goes in brackets"),
        ("smtp://relay example.com", "is not a host name or address"),
        ("smtp://:25", "a host is required"),
    ] {
        assert_problem(&with(bad), says);
    }
    for (good, host, port) in [
        ("smtp://relay.example:2525", "relay.example", 2525),
        ("smtps://relay.example", "relay.example", 465),
        ("smtp://[2001:db8::1]:587", "2001:db8::1", 587),
        ("smtp://[2001:db8::1]", "2001:db8::1", 25),
        ("smtp://192.0.2.1", "192.0.2.1", 25),
        ("smtp://mail_relay:2525", "mail_relay", 2525),
    ] {
        let c = Config::from_toml(&with(good)).unwrap_or_else(|p| panic!("{good}: {p:?}"));
        let u = &c.smtp_upstreams[0];
        assert_eq!((u.host.as_str(), u.port), (host, port), "{good}");
    }
}

/// An IPv4-mapped IPv6 listen address cannot be bound (IPv6 listeners are
/// IPv6 only): refused, naming the IPv4 form.
#[test]
fn an_ipv4_mapped_listen_address_is_refused() {
    let text = format!("[server]\nlisten = [\"[::ffff:127.0.0.1]:8080\"]\n{MINIMAL}");
    assert_problem(&text, "write 127.0.0.1:8080");
    let admin = format!("[admin]\nlisten = \"[::ffff:127.0.0.1]:9090\"\n{MINIMAL}");
    assert_problem(&admin, "write 127.0.0.1:9090");
}

#[test]
fn max_tunnels_per_key_is_a_positive_count() {
    let c = Config::from_toml(
        &MINIMAL.replace("capacity = 10", "capacity = 10\nmax_tunnels_per_key = 20"),
    )
    .unwrap();
    assert_eq!(c.routes[0].max_tunnels_per_key, Some(20));
    assert_eq!(
        Config::from_toml(MINIMAL).unwrap().routes[0].max_tunnels_per_key,
        None
    );
    assert_problem(
        &MINIMAL.replace("capacity = 10", "capacity = 10\nmax_tunnels_per_key = 0"),
        "route 'default'.max_tunnels_per_key",
    );
}

#[test]
fn a_mistyped_redis_url_is_refused_without_its_password() {
    let text =
        format!("{MINIMAL}\n[cluster]\nredis = \"reds://:s3cret@127.0.0.1:6379\"\ninstances = 2\n");
    let found = problems(&text);
    assert!(
        found
            .iter()
            .any(|p| p.contains("node 1: must start with redis://")),
        "{found:?}"
    );
    assert!(found.iter().all(|p| !p.contains("s3cret")), "{found:?}");
}

#[test]
fn a_redis_password_is_given_once() {
    let file = std::env::temp_dir().join(format!("sluice-redis-pass-{}", std::process::id()));
    std::fs::write(&file, "pw\n").unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    let cluster = |url: &str| {
        format!(
            "{MINIMAL}\n[cluster]\nredis = \"{url}\"\ninstances = 2\npassword_file = \"{}\"\n",
            file.display()
        )
    };
    assert!(problems(&cluster("redis://127.0.0.1:6379")).is_empty());
    assert_problem(
        &cluster("redis://:pw@127.0.0.1:6379"),
        "cluster.password_file: a node's URL has a password too",
    );
    let _ = std::fs::remove_file(&file);
}
