//! Property-based fuzzing (issue 12), bounded so CI runs it every time:
//!
//! - configs: random TOML from a grammar of the schema, with numbers,
//!   durations, rates and sizes at and past their edges: validation never
//!   panics, and every config `check` accepts builds and binds (what `run`
//!   does before serving) without a panic;
//! - request paths and keys: random paths through normalization (never a
//!   panic; the result is normal and normalizing it again changes
//!   nothing), random header bytes through key extraction and the bucket
//!   query's reading of a displayed key.

use proptest::prelude::*;
use sluice::config::Config;
use sluice::http::path::normalize;

// === configs ===

/// Values mostly valid (so configs pass and get started), often at their
/// bounds, sometimes past them or of the wrong type.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop_oneof![
            Just("1".to_owned()),
            Just("1000000".to_owned()),
            (1u64..100_000).prop_map(|n| n.to_string()),
        ],
        1 => number_edges(),
    ]
}

fn number_edges() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("0".to_owned()),
        Just("1".to_owned()),
        Just("-1".to_owned()),
        Just("4294967295".to_owned()),
        Just("4294967296".to_owned()),
        Just("1000000".to_owned()),
        Just("1000001".to_owned()),
        Just("1000000000".to_owned()),
        Just("9223372036854775807".to_owned()),
        Just("1.5".to_owned()),
        Just("\"7\"".to_owned()),
        (0u64..100_000).prop_map(|n| n.to_string()),
    ]
}

fn duration() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop_oneof![
            Just("\"1ns\"".to_owned()),
            Just("\"1day\"".to_owned()),
            (1u64..10_000).prop_map(|n| format!("\"{n}ms\"")),
        ],
        1 => duration_edges(),
    ]
}

fn duration_edges() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\"0s\"".to_owned()),
        Just("\"1ns\"".to_owned()),
        Just("\"250ms\"".to_owned()),
        Just("\"1day\"".to_owned()),
        Just("\"25h\"".to_owned()),
        Just("\"30days\"".to_owned()),
        Just("\"18446744073709551615s\"".to_owned()),
        Just("\"2 s\"".to_owned()),
        Just("\"x\"".to_owned()),
        Just("5".to_owned()),
        (1u64..10_000).prop_map(|n| format!("\"{n}ms\"")),
    ]
}

fn rate() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop_oneof![
            Just("\"1000000000/s\"".to_owned()),
            Just("\"1/d\"".to_owned()),
            (1u32..100_000).prop_map(|n| format!("\"{n}/s\"")),
        ],
        1 => rate_edges(),
    ]
}

fn rate_edges() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\"1000000000/s\"".to_owned()),
        Just("\"2000000000/s\"".to_owned()),
        Just("\"0.01/d\"".to_owned()),
        Just("\"1/d\"".to_owned()),
        Just("\"0/s\"".to_owned()),
        Just("\"NaN/s\"".to_owned()),
        Just("\"inf/s\"".to_owned()),
        Just("\"5/x\"".to_owned()),
        Just("\"1e308/s\"".to_owned()),
        (1u32..100_000).prop_map(|n| format!("\"{n}/s\"")),
    ]
}

fn size() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop_oneof![
            Just("\"1TiB\"".to_owned()),
            Just("1".to_owned()),
            (1u32..10_000_000).prop_map(|n| n.to_string()),
        ],
        1 => size_edges(),
    ]
}

fn size_edges() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("\"1TiB\"".to_owned()),
        Just("\"2TiB\"".to_owned()),
        Just("\"0\"".to_owned()),
        Just("\"18446744073709551615GiB\"".to_owned()),
        Just("1".to_owned()),
        (1u32..10_000_000).prop_map(|n| n.to_string()),
    ]
}

/// `key = value` lines for one table, picked from its fields.
fn fields(choices: Vec<(&'static str, BoxedStrategy<String>)>) -> impl Strategy<Value = String> {
    let picks: Vec<BoxedStrategy<Option<String>>> = choices
        .into_iter()
        .map(|(name, value)| {
            proptest::option::weighted(0.3, value.prop_map(move |v| format!("{name} = {v}")))
                .boxed()
        })
        .collect();
    picks.prop_map(|lines| lines.into_iter().flatten().collect::<Vec<_>>().join("\n"))
}

fn config() -> impl Strategy<Value = String> {
    let server = fields(vec![
        ("header_read_timeout", duration().boxed()),
        ("keepalive_timeout", duration().boxed()),
        ("drain_timeout", duration().boxed()),
        ("max_header_size", number().boxed()),
        ("max_connections", number().boxed()),
        (
            "workers",
            prop_oneof![
                Just("1".to_owned()),
                Just("2".to_owned()),
                Just("0".to_owned()),
                Just("1025".to_owned())
            ]
            .boxed(),
        ),
    ]);
    let upstream = fields(vec![
        ("rate", rate().boxed()),
        ("connect_timeout", duration().boxed()),
        ("request_timeout", duration().boxed()),
        ("max_concurrency", number().boxed()),
        ("max_pause", duration().boxed()),
        (
            "forwarded_headers",
            prop_oneof![
                Just("true".to_owned()),
                Just("false".to_owned()),
                Just("\"no\"".to_owned())
            ]
            .boxed(),
        ),
        (
            "on_throttle",
            prop_oneof![
                Just("\"pause\"".to_owned()),
                Just("\"pass\"".to_owned()),
                Just("\"x\"".to_owned())
            ]
            .boxed(),
        ),
        (
            "host",
            prop_oneof![
                Just("\"client\"".to_owned()),
                Just("\"upstream\"".to_owned()),
                Just("\"a.example:99999\"".to_owned()),
                Just("\"\"".to_owned())
            ]
            .boxed(),
        ),
    ]);
    let route = fields(vec![
        ("rate", rate().boxed()),
        ("capacity", number().boxed()),
        ("burst", number().boxed()),
        (
            "cost",
            prop_oneof![
                number(),
                Just("{ header = \"x-cost\", default = 1, max = 1000000 }".to_owned())
            ]
            .boxed(),
        ),
        ("max_wait", duration().boxed()),
        (
            "strip_prefix",
            prop_oneof![
                Just("\"/a\"".to_owned()),
                Just("\"/b\"".to_owned()),
                Just("\"x\"".to_owned())
            ]
            .boxed(),
        ),
        (
            "key",
            prop_oneof![
                Just("\"ip\"".to_owned()),
                Just("\"header:x\"".to_owned()),
                Just("[\"global\", \"ip\"]".to_owned()),
                Just("\"bad\"".to_owned())
            ]
            .boxed(),
        ),
    ]);
    let limits = fields(vec![
        ("max_clients", number().boxed()),
        ("max_queued", number().boxed()),
        ("max_staged_body", size().boxed()),
        ("max_staged_bytes", size().boxed()),
    ]);
    (server, upstream, route, limits, any::<bool>()).prop_map(|(server, upstream, route, limits, cluster)| {
        let cluster = if cluster {
            "[cluster]\nredis = \"redis://127.0.0.1:1\"\non_failure = \"allow\"\ntimeout = \"50ms\"\n"
        } else {
            ""
        };
        format!(
            "[server]\nlisten = [\"127.0.0.1:0\"]\n{server}\n\n{cluster}\n[[upstream]]\nname = \"u\"\nurl = \"http://127.0.0.1:9\"\n{upstream}\n\n\
             [[route]]\nname = \"r\"\nmatch = {{ path_prefix = \"/a/\" }}\nupstream = \"u\"\nkey = \"ip\"\nrate = \"5/s\"\ncapacity = 1\n{route}\n\n[limits]\n{limits}\n"
        )
    })
}

/// What `check` accepts, `run` can build and bind: no panic anywhere. At
/// least 40 of the generated configs must be valid (about 8% of them are:
/// some 80 in 1,024, with a standard deviation near 9), or the test
/// would check only the parser's refusals and nothing that starts.
#[test]
fn any_config_is_validated_without_panic_and_what_is_valid_starts() {
    use proptest::test_runner::TestRunner;
    use std::sync::atomic::{AtomicUsize, Ordering};
    const CASES: u32 = 1_024;
    let (tried, valid) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let mut runner = TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&config(), |text| {
            tried.fetch_add(1, Ordering::Relaxed);
            // Duplicate keys (a field picked twice over the defaults) are a
            // parse error, which is a fine answer too.
            if let Ok(config) = Config::from_toml(&text) {
                valid.fetch_add(1, Ordering::Relaxed);
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                let bound = rt.block_on(sluice::http::Server::bind(&config));
                prop_assert!(bound.is_ok(), "{text}\n{:?}", bound.err());
            }
            Ok(())
        })
        .unwrap();
    let (tried, valid) = (tried.into_inner(), valid.into_inner());
    println!("{valid} of {tried} generated configs valid");
    assert!(tried >= CASES as usize, "{tried} cases run");
    assert!(
        valid >= 40,
        "only {valid} of {tried} generated configs were valid"
    );
}

// === paths and keys ===

fn path() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        Just("/".to_owned()),
        Just("//".to_owned()),
        Just(".".to_owned()),
        Just("..".to_owned()),
        Just("%2e".to_owned()),
        Just("%2E%2e".to_owned()),
        Just("%2f".to_owned()),
        Just("%5C".to_owned()),
        Just("%00".to_owned()),
        Just("%41".to_owned()),
        Just("%7e".to_owned()),
        Just("%e2%82%ac".to_owned()),
        Just("%".to_owned()),
        Just("%4".to_owned()),
        Just("\\".to_owned()),
        "[a-z0-9._~-]{1,4}",
    ];
    prop::collection::vec(piece, 0..12).prop_map(|p| format!("/{}", p.concat()))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 2_000,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn normalized_paths_are_normal(p in path()) {
        if let Ok(n) = normalize(&p) {
            prop_assert!(n.starts_with('/'), "{p} -> {n}");
            prop_assert!(!n.contains("//"), "{p} -> {n}");
            prop_assert!(!n.split('/').any(|s| s == "." || s == ".."), "{p} -> {n}");
            prop_assert!(!n.contains('\\'), "{p} -> {n}");
            let again = normalize(&n);
            prop_assert_eq!(again.as_deref(), Ok(&*n), "normalizing twice changed {}", p);
        }
    }

    #[test]
    fn any_header_bytes_make_a_key_or_a_clear_refusal(value in prop::collection::vec(any::<u8>(), 0..300)) {
        use sluice::config::{KeyPart, KeySpec, OnMissingKey};
        let Ok(v) = http::HeaderValue::from_bytes(&value) else { return Ok(()); };
        let mut headers = http::HeaderMap::new();
        headers.insert("x-client", v);
        let spec = KeySpec(vec![KeyPart::Header(http::HeaderName::from_static("x-client")), KeyPart::Ip]);
        let peer = "127.0.0.1".parse().unwrap();
        match sluice::http::key::extract(&spec, OnMissingKey::Reject, &headers, None, peer, &[]) {
            Ok(key) => {
                // What /status shows reads back as the same key.
                let back = sluice::http::key::from_display(&spec, &key.display());
                prop_assert_eq!(back, Some(key));
            }
            Err(why) => prop_assert!(!why.is_empty()),
        }
    }
}
