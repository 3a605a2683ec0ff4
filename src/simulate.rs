//! `sluice simulate`: run a recorded arrival trace through the pure shaping
//! engine in virtual time, instantly, and say what each request would have
//! been answered.
//!
//! The input is a CSV file with a header naming the columns `time`, `key`
//! and, optionally, `cost` (in any order): `time` in seconds as a decimal
//! (`0.025`), `key` the client key, `cost` a whole number (default 1).
//! Rows may come in any order; equal times keep file order.
//!
//! The pacer is perfect: every release due at or before an arrival happens
//! before that arrival is decided, and each departure happens exactly at its
//! due time. The output has one row per request, in file order:
//! `index,time,key,cost,outcome,departure,retry_after`, where `outcome` is
//! `depart` (forwarded at once), `queued` (waited, then departed at
//! `departure`) or `rejected` (429; `retry_after` is the exact time, in
//! seconds, until this client's queue would have accepted it; the HTTP
//! header rounds it up to whole seconds).
//!
//! This module owns parsing, the virtual-time loop and the output format;
//! the rules themselves are the engine's, and the drawing is `plot`'s.

use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use crate::cli::SimulateArgs;
use crate::plot;
use crate::shaper::{Admission, Engine, Limits, Nanos, Policy, Rate, Rejection};

/// One arrival from the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arrival {
    /// 1-based position in the file (data rows only).
    pub index: usize,
    /// Arrival time, in nanoseconds from the trace's zero.
    pub time: Nanos,
    /// The client key.
    pub key: String,
    /// Cost units (at least 1).
    pub cost: u32,
}

/// What the engine answered one arrival.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Forwarded at once, at its arrival.
    Depart { departure: Nanos },
    /// Admitted to wait; departed at `departure`.
    Queued { departure: Nanos },
    /// Refused (429). `retry_after` is the time from the arrival until the
    /// client's queue would accept it.
    Rejected { retry_after: Nanos },
}

impl Outcome {
    /// The departure time, if it departed.
    pub fn departure(self) -> Option<Nanos> {
        match self {
            Outcome::Depart { departure } | Outcome::Queued { departure } => Some(departure),
            Outcome::Rejected { .. } => None,
        }
    }

    /// The word used in the output CSV.
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Depart { .. } => "depart",
            Outcome::Queued { .. } => "queued",
            Outcome::Rejected { .. } => "rejected",
        }
    }
}

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimulateError {
    #[error("{}: cannot read: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}", render(path, problems))]
    Invalid {
        path: PathBuf,
        problems: Vec<CsvProblem>,
    },
    #[error("{}: cannot write: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
    #[error("cannot write to standard output: {0}")]
    Stdout(io::Error),
    #[error("{}: is the trace being read; write the results elsewhere", path.display())]
    OverInput { path: PathBuf },
    #[error("{}", .0.join("\n"))]
    Shape(Vec<String>),
}

impl SimulateError {
    /// The exit code for the binary: 2 for a bad trace, 1 for I/O.
    pub fn exit_code(&self) -> u8 {
        match self {
            SimulateError::Invalid { .. }
            | SimulateError::OverInput { .. }
            | SimulateError::Shape(_) => 2,
            _ => 1,
        }
    }
}

/// One thing wrong with the trace file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CsvProblem {
    /// 1-based line in the file.
    pub line: usize,
    pub message: String,
}

/// A trace's bytes as text: UTF-8 (ASCII, in practice), or the line where
/// it stops being that (a bad trace: exit 2), naming UTF-16, which
/// spreadsheets export as "Unicode text".
fn text_of(bytes: Vec<u8>) -> Result<String, CsvProblem> {
    String::from_utf8(bytes).map_err(|e| {
        let bytes = e.as_bytes();
        let valid = e.utf8_error().valid_up_to();
        let line = 1 + bytes[..valid].iter().filter(|&&b| b == b'\n').count();
        let message = if bytes.starts_with(&[0xFF, 0xFE]) || bytes.starts_with(&[0xFE, 0xFF]) {
            "the file is UTF-16: save it as CSV in UTF-8 (or plain ASCII)".to_owned()
        } else {
            "not UTF-8 text: save it as CSV in UTF-8 (or plain ASCII)".to_owned()
        };
        CsvProblem { line, message }
    })
}

impl fmt::Display for CsvProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// Most problems listed before the rest are only counted.
const MAX_PROBLEMS: usize = 10;

fn render(path: &Path, problems: &[CsvProblem]) -> String {
    let mut lines: Vec<String> = problems
        .iter()
        .take(MAX_PROBLEMS)
        .map(|p| format!("{}:{}: {}", path.display(), p.line, p.message))
        .collect();
    if problems.len() > MAX_PROBLEMS {
        lines.push(format!(
            "{}: and {} more problems",
            path.display(),
            problems.len() - MAX_PROBLEMS
        ));
    }
    lines.join("\n")
}

// === parsing ===

/// Parse a trace, collecting every problem (each with its line).
pub fn parse_arrivals(text: &str) -> Result<Vec<Arrival>, Vec<CsvProblem>> {
    let mut problems = Vec::new();
    // A byte-order mark (spreadsheets write one) is not part of the
    // header's first name.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut lines = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.strip_suffix('\r').unwrap_or(l)))
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((header_line, header)) = lines.next() else {
        return Err(vec![CsvProblem {
            line: 1,
            message: "empty file: expected a header line `time,key,cost`".into(),
        }]);
    };
    let problem = |line: usize, message: String| CsvProblem { line, message };
    let columns = match split_fields(header) {
        Ok(c) => c,
        Err(e) => return Err(vec![problem(header_line, e)]),
    };
    let find = |name: &str| {
        columns
            .iter()
            .position(|c| c.trim().eq_ignore_ascii_case(name))
    };
    let (Some(time_col), Some(key_col)) = (find("time"), find("key")) else {
        return Err(vec![problem(
            header_line,
            format!(
                "the header must name the columns time and key (and optionally cost), \
                 as in `time,key,cost`; found `{header}`"
            ),
        )]);
    };
    let cost_col = find("cost");
    if let Some(unknown) = columns.iter().find(|c| {
        !["time", "key", "cost"]
            .iter()
            .any(|n| c.trim().eq_ignore_ascii_case(n))
    }) {
        return Err(vec![problem(
            header_line,
            format!(
                "unknown column '{}': expected time, key, cost",
                unknown.trim()
            ),
        )]);
    }

    let mut arrivals = Vec::new();
    for (line, text) in lines {
        let fields = match split_fields(text) {
            Ok(f) => f,
            Err(e) => {
                problems.push(problem(line, e));
                continue;
            }
        };
        if fields.len() != columns.len() {
            problems.push(problem(
                line,
                format!(
                    "expected {} fields like the header, found {}",
                    columns.len(),
                    fields.len()
                ),
            ));
            continue;
        }
        let time = parse_seconds(fields[time_col].trim());
        let key = fields[key_col].trim();
        let cost = match cost_col.map(|c| fields[c].trim()) {
            None | Some("") => Ok(1),
            Some(c) => match c.parse::<u32>() {
                Ok(n) if n >= 1 => Ok(n),
                _ => Err(format!("cost '{c}' must be a whole number, at least 1")),
            },
        };
        if key.is_empty() {
            problems.push(problem(line, "key is empty".into()));
        }
        match (&time, &cost) {
            (Err(e), _) | (_, Err(e)) => problems.push(problem(line, e.clone())),
            _ => {}
        }
        if let (Ok(time), Ok(cost), false) = (time, cost, key.is_empty()) {
            arrivals.push(Arrival {
                index: arrivals.len() + 1,
                time,
                key: key.to_string(),
                cost,
            });
        }
    }
    if problems.is_empty() {
        Ok(arrivals)
    } else {
        Err(problems)
    }
}

/// Split one CSV line into fields (RFC 4180 quoting: `"a,b"`, `""`).
fn split_fields(line: &str) -> Result<Vec<String>, String> {
    let mut fields = Vec::new();
    let mut field = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    let mut was_quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (true, c) => field.push(c),
            (false, '"') if field.trim().is_empty() && !was_quoted => {
                field.clear();
                quoted = true;
                was_quoted = true;
            }
            (false, ',') => {
                fields.push(std::mem::take(&mut field));
                was_quoted = false;
            }
            (false, c) => field.push(c),
        }
    }
    if quoted {
        return Err("unterminated quoted field".into());
    }
    fields.push(field);
    Ok(fields)
}

/// Parse decimal seconds (`2`, `0.025`, `.5`) into nanoseconds: exactly,
/// or rounded to the nearest nanosecond past nine decimals (a float
/// printed in full, `0.07500000000000001`).
fn parse_seconds(text: &str) -> Result<Nanos, String> {
    let bad = || format!("time '{text}' is not a number of seconds such as 0.025");
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    if (whole.is_empty() && frac.is_empty())
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let frac = frac.trim_end_matches('0');
    let round_up = frac.as_bytes().get(9).is_some_and(|&d| d >= b'5');
    let frac = frac.get(..9).unwrap_or(frac);
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    let mut nanos_frac: u64 = 0;
    for (i, b) in frac.bytes().enumerate() {
        nanos_frac += u64::from(b - b'0') * 10u64.pow(8 - i as u32);
    }
    // Keep well inside u64 so schedule arithmetic cannot saturate.
    const MAX_SECONDS: u64 = 100 * 365 * 86_400;
    if whole > MAX_SECONDS {
        return Err(format!("time '{text}' is too large (at most 100 years)"));
    }
    Ok(whole * 1_000_000_000 + nanos_frac + u64::from(round_up))
}

/// Nanoseconds as decimal seconds, exact, without trailing zeros.
pub fn format_seconds(nanos: Nanos) -> String {
    let whole = nanos / 1_000_000_000;
    let frac = nanos % 1_000_000_000;
    if frac == 0 {
        return whole.to_string();
    }
    let frac = format!("{frac:09}");
    format!("{whole}.{}", frac.trim_end_matches('0'))
}

/// Quote a CSV field when it needs it.
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) || text.trim() != text {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

// === the virtual-time run ===

/// Run `arrivals` through the engine with `policy`, a perfect pacer and no
/// global bounds. Returns one outcome per arrival, in the same order.
pub fn simulate(arrivals: &[Arrival], policy: Policy) -> Vec<Outcome> {
    let engine: Engine<String, usize> = Engine::new(
        Limits {
            max_clients: usize::MAX,
            max_queued: usize::MAX,
        },
        1,
    );
    let upstream = engine.add_upstream(None);
    let route = engine.add_route(policy, upstream);

    // Equal times keep file order (the sort is stable).
    let mut order: Vec<usize> = (0..arrivals.len()).collect();
    order.sort_by_key(|&i| arrivals[i].time);

    let mut outcomes: Vec<Option<Outcome>> = vec![None; arrivals.len()];
    let mut released = Vec::new();
    let mut release_until = |engine: &Engine<String, usize>,
                             outcomes: &mut Vec<Option<Outcome>>,
                             limit: Option<Nanos>| {
        while let Some(at) = engine.next_release() {
            if limit.is_some_and(|l| at > l) {
                break;
            }
            released.clear();
            engine.release_due(at, &mut released);
            for &i in &released {
                outcomes[i] = Some(Outcome::Queued { departure: at });
            }
        }
    };

    for &i in &order {
        let a = &arrivals[i];
        release_until(&engine, &mut outcomes, Some(a.time));
        let outcome = match engine.admit(route, a.key.clone(), a.cost, a.time, || i) {
            Admission::Depart => Some(Outcome::Depart { departure: a.time }),
            Admission::Queued { .. } => None,
            Admission::Rejected(r) => Some(Outcome::Rejected {
                retry_after: match r {
                    Rejection::Full { retry_after } | Rejection::MaxWait { retry_after } => {
                        retry_after
                    }
                    // No global bounds here; kept total for completeness.
                    Rejection::TooManyClients | Rejection::TooManyQueued => 0,
                },
            }),
        };
        outcomes[i] = outcome;
    }
    release_until(&engine, &mut outcomes, None);

    outcomes
        .into_iter()
        .zip(arrivals)
        // Every queued request departs once the engine is drained; an
        // entry still missing would be an engine bug, shown as a refusal
        // rather than a crash.
        .map(|(o, _)| o.unwrap_or(Outcome::Rejected { retry_after: 0 }))
        .collect()
}

/// Write the result CSV: a header, then one row per request in file order.
pub fn write_csv(
    out: &mut dyn Write,
    arrivals: &[Arrival],
    outcomes: &[Outcome],
) -> io::Result<()> {
    writeln!(out, "index,time,key,cost,outcome,departure,retry_after")?;
    for (a, o) in arrivals.iter().zip(outcomes) {
        let departure = o.departure().map(format_seconds).unwrap_or_default();
        let retry_after = match o {
            Outcome::Rejected { retry_after } => format_seconds(*retry_after),
            _ => String::new(),
        };
        writeln!(
            out,
            "{},{},{},{},{},{},{}",
            a.index,
            format_seconds(a.time),
            csv_field(&a.key),
            a.cost,
            o.name(),
            departure,
            retry_after
        )?;
    }
    Ok(())
}

/// The plot of a simulated run: one panel per key, in order of first
/// arrival.
pub fn chart(arrivals: &[Arrival], outcomes: &[Outcome], policy: Policy) -> plot::Chart {
    let mut panels: Vec<plot::Panel> = Vec::new();
    let mut by_key: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    let secs = |n: Nanos| n as f64 / 1e9;
    for (a, o) in arrivals.iter().zip(outcomes) {
        let p = *by_key.entry(a.key.as_str()).or_insert_with(|| {
            panels.push(plot::Panel {
                name: a.key.clone(),
                requests: Vec::new(),
                queue: None,
            });
            panels.len() - 1
        });
        let fate = match *o {
            Outcome::Depart { departure } => plot::Fate::Immediate {
                departure: secs(departure),
            },
            Outcome::Queued { departure } => plot::Fate::Queued {
                departure: secs(departure),
            },
            Outcome::Rejected { .. } => plot::Fate::Rejected,
        };
        panels[p].requests.push(plot::Mark {
            arrival: secs(a.time),
            cost: a.cost,
            fate,
        });
    }
    let burst = if policy.burst > 0 {
        format!(", burst {}", policy.burst)
    } else {
        String::new()
    };
    plot::Chart {
        title: "sluice simulate: arrivals, queue level and departures".into(),
        subtitle: format!(
            "rate {} (1/r = {}), capacity {}{burst}; virtual time, perfect pacer; {} requests",
            policy.rate,
            human_interval(policy.rate),
            policy.capacity,
            arrivals.len()
        ),
        capacity: policy.capacity,
        end: 0.0,
        panels,
    }
}

/// 1/r for people: `200 ms`, `12 s`, `1.5 µs`.
pub fn human_interval(rate: Rate) -> String {
    let n = rate.interval_nanos() as f64;
    let (v, unit) = if n >= 1e9 {
        (n / 1e9, "s")
    } else if n >= 1e6 {
        (n / 1e6, "ms")
    } else if n >= 1e3 {
        (n / 1e3, "µs")
    } else {
        (n, "ns")
    };
    let text = format!("{v:.3}");
    format!(
        "{} {unit}",
        text.trim_end_matches('0').trim_end_matches('.')
    )
}

/// Totals of a run, for the one-line summary.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub requests: usize,
    pub at_once: usize,
    pub queued: usize,
    pub rejected: usize,
}

/// Count outcomes.
pub fn totals(outcomes: &[Outcome]) -> Totals {
    let mut t = Totals {
        requests: outcomes.len(),
        ..Totals::default()
    };
    for o in outcomes {
        match o {
            Outcome::Depart { .. } => t.at_once += 1,
            Outcome::Queued { .. } => t.queued += 1,
            Outcome::Rejected { .. } => t.rejected += 1,
        }
    }
    t
}

/// The `sluice simulate` command: read, simulate, write. The result CSV
/// goes to `--out-csv` or standard output; a summary goes to standard
/// output when the CSV went to a file, else to standard error.
pub fn run(args: &SimulateArgs) -> Result<(), SimulateError> {
    // Results written over the trace would lose it.
    let same = |out: &std::path::Path| {
        fs::canonicalize(out)
            .ok()
            .is_some_and(|o| fs::canonicalize(&args.arrivals).is_ok_and(|a| a == o))
    };
    for out in [&args.out_csv, &args.out_svg].into_iter().flatten() {
        if same(out) {
            return Err(SimulateError::OverInput { path: out.clone() });
        }
    }
    let bytes = fs::read(&args.arrivals).map_err(|source| SimulateError::Read {
        path: args.arrivals.clone(),
        source,
    })?;
    let text = text_of(bytes).map_err(|problem| SimulateError::Invalid {
        path: args.arrivals.clone(),
        problems: vec![problem],
    })?;
    let arrivals = parse_arrivals(&text).map_err(|problems| SimulateError::Invalid {
        path: args.arrivals.clone(),
        problems,
    })?;
    // What `check` refuses in a config, refused here too: past it the
    // schedule saturates and the figures mean nothing.
    let most_cost = arrivals.iter().map(|a| a.cost).max().unwrap_or(1);
    let problems = crate::config::shape_problems(args.rate, args.capacity, args.burst, most_cost);
    if !problems.is_empty() {
        return Err(SimulateError::Shape(problems));
    }
    let policy = Policy {
        burst: args.burst,
        ..Policy::new(args.rate, args.capacity)
    };
    let outcomes = simulate(&arrivals, policy);

    let mut notes = Vec::new();
    match &args.out_csv {
        Some(path) => {
            let mut buf = Vec::new();
            let _ = write_csv(&mut buf, &arrivals, &outcomes);
            fs::write(path, buf).map_err(|source| SimulateError::Write {
                path: path.clone(),
                source,
            })?;
            notes.push(format!("wrote {}", path.display()));
        }
        None => {
            let stdout = io::stdout();
            let mut lock = stdout.lock();
            write_csv(&mut lock, &arrivals, &outcomes)
                .and_then(|()| lock.flush())
                .map_err(SimulateError::Stdout)?;
        }
    }
    if let Some(path) = &args.out_svg {
        let svg = plot::svg(&chart(&arrivals, &outcomes, policy));
        fs::write(path, svg).map_err(|source| SimulateError::Write {
            path: path.clone(),
            source,
        })?;
        notes.push(format!("wrote {}", path.display()));
    }

    let t = totals(&outcomes);
    let mut summary = format!(
        "{} requests: {} forwarded ({} at once, {} after waiting), {} rejected (429)",
        t.requests,
        t.at_once + t.queued,
        t.at_once,
        t.queued,
        t.rejected
    );
    for n in notes {
        summary.push_str("; ");
        summary.push_str(&n);
    }
    if args.out_csv.is_some() {
        // (A closed stdout: the files are written, nothing to fail.)
        let _ = writeln!(io::stdout(), "{summary}");
    } else {
        eprintln!("{summary}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_that_is_not_utf8_is_a_bad_trace_at_its_line() {
        let p = text_of(b"time,key\n0,a\n0.5,\xff\n".to_vec()).unwrap_err();
        assert_eq!(p.line, 3);
        assert!(p.message.contains("not UTF-8"), "{}", p.message);
        let p = text_of(vec![0xFF, 0xFE, b't', 0]).unwrap_err();
        assert!(p.message.contains("UTF-16"), "{}", p.message);
        assert_eq!(text_of(b"time,key\n".to_vec()).unwrap(), "time,key\n");
    }

    #[test]
    fn seconds_parse_exactly() {
        assert_eq!(parse_seconds("0.025"), Ok(25_000_000));
        assert_eq!(parse_seconds("2"), Ok(2_000_000_000));
        assert_eq!(parse_seconds(".5"), Ok(500_000_000));
        assert_eq!(parse_seconds("1.000000001"), Ok(1_000_000_001));
        assert_eq!(parse_seconds("0.1000000000"), Ok(100_000_000));
        assert!(parse_seconds("-1").is_err());
        assert!(parse_seconds("1e3").is_err());
        assert!(parse_seconds("").is_err());
        assert!(parse_seconds(".").is_err());
        // Past nine decimals (a float printed in full): the nearest ns.
        assert_eq!(parse_seconds("0.07500000000000001"), Ok(75_000_000));
        assert_eq!(parse_seconds("0.0000000001"), Ok(0));
        assert_eq!(parse_seconds("0.0000000015"), Ok(2));
        assert_eq!(parse_seconds("0.9999999999"), Ok(1_000_000_000));
    }

    #[test]
    fn a_header_after_a_byte_order_mark_is_read() {
        let arrivals = parse_arrivals("\u{feff}time,key\n0,a\n").unwrap_or_default();
        assert_eq!(arrivals.len(), 1);
    }

    #[test]
    fn seconds_format_without_trailing_zeros() {
        assert_eq!(format_seconds(0), "0");
        assert_eq!(format_seconds(2_400_000_000), "2.4");
        assert_eq!(format_seconds(25_000_000), "0.025");
        assert_eq!(format_seconds(1), "0.000000001");
    }

    #[test]
    fn fields_split_with_quotes() {
        assert_eq!(
            split_fields(r#"0.1,"a,b",2"#),
            Ok(vec!["0.1".into(), "a,b".into(), "2".into()])
        );
        assert_eq!(
            split_fields(r#"0,"say ""hi""""#),
            Ok(vec!["0".into(), r#"say "hi""#.into()])
        );
        assert!(split_fields(r#"0,"open"#).is_err());
    }

    #[test]
    fn cost_column_is_optional_and_columns_may_be_reordered() {
        let a = parse_arrivals("key,time\nalice,0.5\n").unwrap();
        assert_eq!(
            a,
            vec![Arrival {
                index: 1,
                time: 500_000_000,
                key: "alice".into(),
                cost: 1
            }]
        );
        let a = parse_arrivals("time,key,cost\n0,a,\n1,a,3\n").unwrap();
        assert_eq!((a[0].cost, a[1].cost), (1, 3));
    }

    #[test]
    fn every_bad_row_is_reported_with_its_line() {
        let problems =
            parse_arrivals("time,key,cost\n0,a,1\nsoon,a,1\n1,,1\n2,a,0\n3,a\n").unwrap_err();
        let lines: Vec<usize> = problems.iter().map(|p| p.line).collect();
        assert_eq!(lines, vec![3, 4, 5, 6], "{problems:?}");
        assert!(problems[0].message.contains("'soon'"));
    }

    #[test]
    fn header_must_name_time_and_key() {
        let p = parse_arrivals("when,who\n0,a\n").unwrap_err();
        assert!(p[0].message.contains("time and key"), "{p:?}");
        assert!(parse_arrivals("").is_err());
    }

    #[test]
    fn idle_client_departs_at_once_and_a_tie_sees_the_release_first() {
        let rate: Rate = "5/s".parse().unwrap();
        let arrivals: Vec<Arrival> = [0, 100, 200, 250]
            .iter()
            .enumerate()
            .map(|(i, ms)| Arrival {
                index: i + 1,
                time: ms * 1_000_000,
                key: "k".into(),
                cost: 1,
            })
            .collect();
        let out = simulate(&arrivals, Policy::new(rate, 1));
        assert_eq!(
            out,
            vec![
                Outcome::Depart { departure: 0 },
                Outcome::Queued {
                    departure: 200_000_000
                },
                // Arrives as #2 departs: the queue is empty again.
                Outcome::Queued {
                    departure: 400_000_000
                },
                Outcome::Rejected {
                    retry_after: 150_000_000
                },
            ]
        );
    }
}
