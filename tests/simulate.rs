//! `sluice simulate`: recorded traces through the engine in virtual time.
//!
//! The seed trace of DESIGN section 1 must come out exactly as the design
//! says, checked both against a small reference model of the rules and
//! against the facts the design states; a bad trace must fail clearly.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use sluice::shaper::{Policy, Rate};
use sluice::simulate::{Arrival, Outcome, parse_arrivals, simulate};

const MS: u64 = 1_000_000;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn tmp(name: &str) -> PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("simulate-{}-{name}", std::process::id()))
}

fn sluice(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .expect("run sluice")
}

/// `sluice simulate --arrivals ARRIVALS --rate RATE --capacity CAPACITY EXTRA...`
fn simulate_cli(arrivals: &str, rate: &str, capacity: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "simulate",
        "--arrivals",
        arrivals,
        "--rate",
        rate,
        "--capacity",
        capacity,
    ];
    args.extend_from_slice(extra);
    sluice(&args)
}

fn seed() -> Vec<Arrival> {
    let text = std::fs::read_to_string(data("seed.csv")).expect("read seed.csv");
    parse_arrivals(&text).expect("seed.csv parses")
}

/// The rules of DESIGN section 1 for one client, cost 1, no burst, written
/// independently of the engine: D is the earliest next departure; a
/// perfect pacer releases the head of the queue at max(its arrival, D)
/// before any later arrival is decided.
fn reference(times: &[u64], interval: u64, capacity: usize) -> Vec<Option<u64>> {
    let mut d = 0u64;
    let mut queue: std::collections::VecDeque<usize> = Default::default();
    let mut out = vec![None; times.len()];
    let release = |until: Option<u64>,
                   d: &mut u64,
                   queue: &mut std::collections::VecDeque<usize>,
                   out: &mut Vec<Option<u64>>| {
        while let Some(&head) = queue.front() {
            let at = times[head].max(*d);
            if until.is_some_and(|u| at > u) {
                break;
            }
            queue.pop_front();
            out[head] = Some(at);
            *d = at + interval;
        }
    };
    for (i, &a) in times.iter().enumerate() {
        release(Some(a), &mut d, &mut queue, &mut out);
        if queue.is_empty() && d <= a {
            out[i] = Some(a);
            d = a + interval;
        } else if queue.len() < capacity {
            queue.push_back(i);
        }
    }
    release(None, &mut d, &mut queue, &mut out);
    out
}

#[test]
fn seed_trace_matches_the_reference_model() {
    let arrivals = seed();
    assert_eq!(arrivals.len(), 20);
    let rate: Rate = "5/s".parse().unwrap();
    let outcomes = simulate(&arrivals, Policy::new(rate, 10));
    let times: Vec<u64> = arrivals.iter().map(|a| a.time).collect();
    let expected = reference(&times, 200 * MS, 10);
    let got: Vec<Option<u64>> = outcomes.iter().map(|o| o.departure()).collect();
    assert_eq!(got, expected);
}

#[test]
fn seed_trace_reproduces_the_design_outcome() {
    let arrivals = seed();
    let rate: Rate = "5/s".parse().unwrap();
    let outcomes = simulate(&arrivals, Policy::new(rate, 10));
    // Request n (1-based) is outcomes[n - 1].
    let admitted = |n: usize| outcomes[n - 1].departure().is_some();

    assert_eq!(
        outcomes[0],
        Outcome::Depart { departure: 0 },
        "1 departs at once"
    );
    for n in 2..=12 {
        assert!(
            matches!(outcomes[n - 1], Outcome::Queued { .. }),
            "{n} waits: {:?}",
            outcomes[n - 1]
        );
    }
    for n in (13..=16).chain(19..=20) {
        assert!(
            matches!(outcomes[n - 1], Outcome::Rejected { .. }),
            "{n} is refused: {:?}",
            outcomes[n - 1]
        );
    }
    assert!(
        admitted(17) ^ admitted(18),
        "exactly one of 17 and 18 is admitted: {:?} {:?}",
        outcomes[16],
        outcomes[17]
    );

    let mut departures: Vec<u64> = outcomes.iter().filter_map(|o| o.departure()).collect();
    assert_eq!(departures.len(), 13, "13 requests reach the downstream");
    departures.sort_unstable();
    for pair in departures.windows(2) {
        assert_eq!(
            pair[1] - pair[0],
            200 * MS,
            "exactly 200 ms apart: {departures:?}"
        );
    }
    assert_eq!(departures.last(), Some(&(2_400 * MS)), "the last at 2.4 s");

    // Retry-After for a refusal is the time until the queue has room.
    for o in &outcomes {
        if let Outcome::Rejected { retry_after } = o {
            assert!(*retry_after > 0 && *retry_after <= 200 * MS, "{o:?}");
        }
    }
}

#[test]
fn command_writes_one_row_per_request_and_a_valid_plot() {
    let csv = tmp("seed-out.csv");
    let svg = tmp("seed-out.svg");
    let seed = data("seed.csv");
    let out = simulate_cli(
        seed.to_str().unwrap(),
        "5/s",
        "10",
        &[
            "--out-csv",
            csv.to_str().unwrap(),
            "--out-svg",
            svg.to_str().unwrap(),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("20 requests: 13 forwarded"), "{stdout}");

    let text = std::fs::read_to_string(&csv).unwrap();
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split(',').collect()).collect();
    assert_eq!(
        rows[0],
        [
            "index",
            "time",
            "key",
            "cost",
            "outcome",
            "departure",
            "retry_after"
        ]
    );
    assert_eq!(rows.len(), 21);
    assert_eq!(rows[1], ["1", "0", "alice", "1", "depart", "0", ""]);
    assert_eq!(rows[2][..6], ["2", "0.025", "alice", "1", "queued", "0.2"]);
    assert_eq!(rows[12][4..6], ["queued", "2.2"]);
    assert_eq!(rows[13][4], "rejected");
    assert!(!rows[13][6].is_empty(), "a refusal says when to retry");
    let last_departure = rows[1..]
        .iter()
        .rev()
        .find(|r| !r[5].is_empty())
        .map(|r| r[5]);
    assert_eq!(last_departure, Some("2.4"));

    let svg_text = std::fs::read_to_string(&svg).unwrap();
    let doc = roxmltree::Document::parse(&svg_text).expect("the SVG is valid XML");
    assert_eq!(doc.root_element().tag_name().name(), "svg");
    assert!(
        doc.descendants().filter(|n| n.has_tag_name("path")).count() >= 3,
        "arrival, queue and departure paths"
    );
    let _ = std::fs::remove_file(csv);
    let _ = std::fs::remove_file(svg);
}

#[test]
fn csv_goes_to_standard_output_without_out_csv() {
    let seed = data("seed.csv");
    let out = simulate_cli(seed.to_str().unwrap(), "5/s", "0", &[]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("index,time,key,cost,outcome,departure,retry_after\n"));
    // Pure policing: only what finds the client idle passes.
    assert_eq!(stdout.lines().filter(|l| l.contains(",queued,")).count(), 0);
    assert_eq!(stdout.lines().filter(|l| l.contains(",depart,")).count(), 3);
}

#[test]
fn bad_csv_is_refused_with_every_problem_and_its_line() {
    let bad = data("bad.csv");
    let out = simulate_cli(bad.to_str().unwrap(), "5/s", "10", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "no partial output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("bad.csv:3: time 'soon' is not a number of seconds"),
        "{stderr}"
    );
    assert!(stderr.contains("bad.csv:4: key is empty"), "{stderr}");
    assert!(stderr.contains("bad.csv:5: cost 'zero'"), "{stderr}");
}

#[test]
fn missing_header_or_file_is_a_clear_error() {
    let headerless = tmp("headerless.csv");
    std::fs::write(&headerless, "0.0,alice,1\n").unwrap();
    let out = simulate_cli(headerless.to_str().unwrap(), "5/s", "10", &[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("header must name the columns time and key"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(headerless);

    let out = simulate_cli("/nonexistent/trace.csv", "5/s", "10", &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read"));

    let out = simulate_cli("x.csv", "5/x", "10", &[]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unit must be s, m, h or d"));
}

/// Results are never written over the trace being read (it would be lost).
#[test]
fn the_trace_is_never_written_over() {
    let trace = tmp("own.csv");
    std::fs::copy(data("seed.csv"), &trace).unwrap();
    let before = std::fs::read(&trace).unwrap();
    for flag in ["--out-csv", "--out-svg"] {
        let out = simulate_cli(
            trace.to_str().unwrap(),
            "5/s",
            "10",
            &[flag, trace.to_str().unwrap()],
        );
        assert_eq!(out.status.code(), Some(2), "{flag}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("is the trace being read"),
            "{flag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert_eq!(std::fs::read(&trace).unwrap(), before);
    let _ = std::fs::remove_file(trace);
}

/// A shape `check` would refuse is refused here too, before anything is
/// written: past it the schedule saturates (a departure 584 years on).
#[test]
fn a_shape_check_would_refuse_is_refused() {
    let costly = tmp("costly.csv");
    std::fs::write(&costly, "time,key,cost\n0,a,1\n0,a,4294967295\n").unwrap();
    let out = simulate_cli(costly.to_str().unwrap(), "1/d", "10", &[]);
    assert_eq!(out.status.code(), Some(2));
    assert!(out.stdout.is_empty(), "no partial output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cost: 4294967295 in the trace is more than 1000000"),
        "{stderr}"
    );
    let _ = std::fs::remove_file(costly);
    let seed = data("seed.csv");
    let out = simulate_cli(seed.to_str().unwrap(), "1/d", "4294967295", &[]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--capacity: 4294967295 is more than"),
        "{stderr}"
    );
    assert!(stderr.contains("the schedule holds at most"), "{stderr}");
}
