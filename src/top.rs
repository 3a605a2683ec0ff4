//! `sluice top`: a live view of a running instance, read from its admin
//! listener (`/status` and `/metrics`) every interval.
//!
//! Per route: requests in, out (forwarded or relayed) and refused per
//! second over the last interval, with a short history; the deepest queues;
//! paused upstreams; the instance's clients, queued requests and the
//! pacer's release lag p99 over the interval. On a terminal the view is
//! redrawn in place; otherwise (a pipe, a file, CI) it prints plain
//! `key=value` lines, as `sluice demo` does, with the same drawing code
//! ([`crate::term`]).

use std::collections::HashMap;
use std::io::{self, Write};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde::Deserialize;

use crate::cli::TopArgs;
use crate::metrics as m;
use crate::shaper::rate::per_unit;
use crate::term::{BOLD, DIM, Frame, GREEN, MAGENTA, RED, Style, YELLOW, bar, fit, pad, spark};

/// How long one admin request may take.
const FETCH_TIMEOUT: Duration = Duration::from_secs(2);
/// Columns of history in the live view (each route's line fits 80
/// columns with two of them).
const HISTORY: usize = 12;
/// The shortest time between updates.
const MIN_INTERVAL: Duration = Duration::from_millis(50);
/// Deepest queues shown.
const QUEUES: usize = 5;

#[derive(Debug, thiserror::Error)]
pub enum TopError {
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] io::Error),
    #[error(
        "cannot read http://{addr}{path}: {why} (is [admin] enabled, and is this its listen address?)"
    )]
    Fetch {
        addr: String,
        path: &'static str,
        why: String,
    },
    #[error("unexpected answer from http://{addr}{path}: {why}")]
    Parse {
        addr: String,
        path: &'static str,
        why: String,
    },
    #[error("cannot write to standard output: {0}")]
    Output(#[from] io::Error),
}

/// Run as `sluice top` does: its own runtime, standard output, a live
/// view when that is a terminal.
pub fn run(args: &TopArgs) -> Result<(), TopError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(TopError::Runtime)?;
    let stdout = io::stdout();
    let style = Style::detect(&stdout);
    let mut out = stdout.lock();
    runtime.block_on(run_with(args, &mut out, style))
}

/// Poll the admin listener and print `args.count` updates (or until
/// interrupted). The first poll only sets the baseline for rates; an
/// instance unreachable at the first poll is an error, later failures are
/// shown and polling goes on.
pub async fn run_with(args: &TopArgs, out: &mut dyn Write, style: Style) -> Result<(), TopError> {
    let mut previous = fetch(&args.admin).await?;
    let mut view = View::new(style);
    let start = Instant::now();
    // tokio's interval panics on zero (the command line refuses < 50 ms;
    // this keeps a library caller safe too).
    let mut tick = tokio::time::interval(args.interval.max(MIN_INTERVAL));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut shown = 0u64;
    // A run whose last update failed (the instance went away) ends with
    // that failure, not success: `top --count N` can be scripted.
    let mut failed = None;
    // Ctrl-C ends the run between frames (never in the middle of one,
    // which would leave the terminal's auto-wrap off).
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    while args.count.is_none_or(|n| shown < n) {
        // The signal first: its handler is set up on its first poll,
        // before the first frame is drawn.
        tokio::select! {
            biased;
            _ = &mut interrupted => break,
            _ = tick.tick() => {}
        }
        shown += 1;
        let t = start.elapsed().as_secs_f64();
        match fetch(&args.admin).await {
            Ok(sample) => {
                view.show(out, t, &previous, &sample)?;
                previous = sample;
                failed = None;
            }
            Err(e) => {
                view.problem(out, t, &e.to_string())?;
                failed = Some(e);
            }
        }
    }
    match failed {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// What one poll read.
struct Sample {
    at: Instant,
    status: Status,
    /// `sluice_requests_total` by (route, protocol, outcome), and
    /// `sluice_arrivals_total` by (route, protocol, [`ARRIVED`]).
    requests: HashMap<(String, String, String), f64>,
    /// `sluice_release_lag_seconds` cumulative buckets: (le, count).
    lag: Vec<(f64, f64)>,
}

#[derive(Debug, Deserialize)]
struct Status {
    #[serde(default)]
    draining: bool,
    #[serde(default)]
    routes: Vec<RouteStatus>,
    #[serde(default)]
    upstreams: Vec<UpstreamStatus>,
    #[serde(default)]
    clients: u64,
    #[serde(default)]
    queued: u64,
    #[serde(default)]
    connections: u64,
    #[serde(default)]
    smtp_sessions: u64,
    #[serde(default)]
    deepest_queues: Vec<QueueStatus>,
}

#[derive(Debug, Clone, Deserialize)]
struct RouteStatus {
    name: String,
    protocol: String,
    rate_per_second: f64,
    capacity: u64,
}

#[derive(Debug, Deserialize)]
struct UpstreamStatus {
    name: String,
    protocol: String,
    paused_for_ms: Option<u64>,
}

#[derive(Debug, Deserialize)]
struct QueueStatus {
    route: String,
    key: String,
    waiting: u64,
    drains_in_ms: u64,
}

async fn fetch(addr: &str) -> Result<Sample, TopError> {
    let status = get(addr, "/status").await?;
    let metrics = get(addr, "/metrics").await?;
    let at = Instant::now();
    let status: Status = serde_json::from_slice(&status).map_err(|e| TopError::Parse {
        addr: addr.to_owned(),
        path: "/status",
        why: e.to_string(),
    })?;
    let text = String::from_utf8_lossy(&metrics);
    let mut requests = HashMap::new();
    let mut lag = Vec::new();
    let lag_bucket = format!("{}_bucket", m::RELEASE_LAG_SECONDS);
    for (name, labels, value) in text.lines().filter_map(sample_line) {
        let get = |k: &str| label(&labels, k).unwrap_or_default().to_owned();
        if name == m::REQUESTS_TOTAL {
            requests.insert((get("route"), get("protocol"), get("outcome")), value);
        } else if name == m::ARRIVALS_TOTAL {
            requests.insert((get("route"), get("protocol"), ARRIVED.to_owned()), value);
        } else if name == lag_bucket {
            let le = match label(&labels, "le") {
                Some("+Inf") => f64::INFINITY,
                Some(v) => v.parse().unwrap_or(f64::INFINITY),
                None => continue,
            };
            lag.push((le, value));
        }
    }
    lag.sort_by(|a, b| a.0.total_cmp(&b.0));
    Ok(Sample {
        at,
        status,
        requests,
        lag,
    })
}

/// GET `path` from the admin listener over one HTTP/1.1 connection.
async fn get(addr: &str, path: &'static str) -> Result<Bytes, TopError> {
    let fail = |why: String| TopError::Fetch {
        addr: addr.to_owned(),
        path,
        why,
    };
    let call = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let request = Request::get(path)
            .header(hyper::header::HOST, addr)
            .body(Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        let response = send
            .send_request(request)
            .await
            .map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("status {}", response.status()));
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?;
        Ok(body.to_bytes())
    };
    match tokio::time::timeout(FETCH_TIMEOUT, call).await {
        Ok(result) => result.map_err(fail),
        Err(_) => Err(fail(format!("no answer within {FETCH_TIMEOUT:?}"))),
    }
}

/// A sample's labels: (name, unescaped value).
type Labels<'a> = Vec<(&'a str, String)>;

/// One Prometheus text sample: name, raw label pairs, value. `None` for
/// comments, blank lines and anything unparsable.
fn sample_line(line: &str) -> Option<(&str, Labels<'_>, f64)> {
    if line.starts_with('#') || line.trim().is_empty() {
        return None;
    }
    let (head, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let Some((name, rest)) = head.split_once('{') else {
        return Some((head, Vec::new(), value));
    };
    let rest = rest.strip_suffix('}')?;
    let mut labels = Vec::new();
    let mut chars = rest.char_indices().peekable();
    let mut start = 0;
    while let Some((i, c)) = chars.next() {
        if c != '=' {
            continue;
        }
        let key = rest[start..i].trim_start_matches(',');
        if chars.next().map(|(_, c)| c) != Some('"') {
            return None;
        }
        let mut val = String::new();
        loop {
            match chars.next()? {
                (_, '\\') => match chars.next()?.1 {
                    'n' => val.push('\n'),
                    other => val.push(other),
                },
                (j, '"') => {
                    start = j + 1;
                    break;
                }
                (_, other) => val.push(other),
            }
        }
        labels.push((key, val));
    }
    Some((name, labels, value))
}

fn label<'a>(labels: &'a [(&str, String)], key: &str) -> Option<&'a str> {
    labels
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v.as_str())
}

/// One route's figures over the last interval, per second.
/// The pseudo-outcome arrivals are kept under in [`Sample::requests`].
const ARRIVED: &str = "(arrived)";

#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Rates {
    input: f64,
    output: f64,
    refused: f64,
}

fn rates(route: &RouteStatus, before: &Sample, now: &Sample) -> Rates {
    let dt = now.at.duration_since(before.at).as_secs_f64().max(1e-3);
    let delta = |outcome: &str| {
        let key = (
            route.name.clone(),
            route.protocol.clone(),
            outcome.to_owned(),
        );
        let a = before.requests.get(&key).copied().unwrap_or(0.0);
        let b = now.requests.get(&key).copied().unwrap_or(0.0);
        (b - a).max(0.0)
    };
    // In: arrivals (refusals before admission included); an instance
    // without the arrivals counter: every answer.
    let arrived = (
        route.name.clone(),
        route.protocol.clone(),
        ARRIVED.to_owned(),
    );
    let input = if now.requests.contains_key(&arrived) {
        delta(ARRIVED)
    } else {
        m::Outcome::ALL.iter().map(|o| delta(o.as_str())).sum()
    };
    Rates {
        input: input / dt,
        output: delta(m::Outcome::Forwarded.as_str()) / dt,
        refused: (delta(m::Outcome::Rejected.as_str()) + delta(m::Outcome::Overloaded.as_str()))
            / dt,
    }
}

/// A release lag bound as shown: the bucket's bound, or, in the +Inf
/// bucket, over the largest bound (1 s).
fn lag_bound(le: f64) -> String {
    if le.is_infinite() {
        format!("> {}", seconds(1.0))
    } else {
        format!("<= {}", seconds(le))
    }
}

/// The release lag p99 over the interval (an upper bound: the bucket it
/// falls in), or `None` when nothing was released.
fn lag_p99(before: &Sample, now: &Sample) -> Option<f64> {
    let count = |s: &Sample, le: f64| {
        s.lag
            .iter()
            .find(|(l, _)| *l == le)
            .map_or(0.0, |(_, c)| *c)
    };
    let total = count(now, f64::INFINITY) - count(before, f64::INFINITY);
    if total <= 0.0 {
        return None;
    }
    now.lag
        .iter()
        .find(|(le, c)| c - count(before, *le) >= 0.99 * total)
        .map(|(le, _)| *le)
}

/// `v` right-aligned in `width` columns, with one decimal; in thousands
/// (k), millions (M) or billions (G) when that does not fit.
fn number(v: f64, width: usize) -> String {
    let plain = format!("{v:.1}");
    let text = if plain.len() <= width {
        plain
    } else if v < 999_950.0 {
        format!("{:.1}k", v / 1e3)
    } else if v < 999_950_000.0 {
        format!("{:.1}M", v / 1e6)
    } else {
        format!("{:.1}G", v / 1e9)
    };
    format!("{:>width$}", fit(&text, width).trim_end())
}

/// `n` right-aligned in `width` columns; in thousands (k) or millions (M)
/// when its digits do not fit.
fn count(n: u64, width: usize) -> String {
    let plain = n.to_string();
    if plain.len() <= width {
        return format!("{plain:>width$}");
    }
    number(n as f64, width)
}

/// The printer: keeps each route's history for the live view.
struct View {
    style: Style,
    frame: Frame,
    history: HashMap<(String, String), Vec<Rates>>,
}

impl View {
    fn new(style: Style) -> View {
        View {
            style,
            frame: Frame::default(),
            history: HashMap::new(),
        }
    }

    fn show(
        &mut self,
        out: &mut dyn Write,
        t: f64,
        before: &Sample,
        now: &Sample,
    ) -> io::Result<()> {
        let s = &now.status;
        let lag = lag_p99(before, now);
        let routes: Vec<(&RouteStatus, Rates)> = s
            .routes
            .iter()
            .map(|r| (r, rates(r, before, now)))
            .collect();
        for (r, rates) in &routes {
            let h = self
                .history
                .entry((r.name.clone(), r.protocol.clone()))
                .or_default();
            h.push(*rates);
            let excess = h.len().saturating_sub(HISTORY);
            h.drain(..excess);
        }
        if self.style.live {
            self.frame(out, lag, &routes, s)
        } else {
            self.plain(out, t, lag, &routes, s)
        }
    }

    fn plain(
        &self,
        out: &mut dyn Write,
        t: f64,
        lag: Option<f64>,
        routes: &[(&RouteStatus, Rates)],
        s: &Status,
    ) -> io::Result<()> {
        // The +Inf bucket as Prometheus writes it.
        let lag = lag.map_or("-".to_owned(), |l| {
            if l.is_infinite() {
                "+Inf".to_owned()
            } else {
                seconds(l)
            }
        });
        writeln!(
            out,
            "t={t:.1}s clients={} queued={} connections={} smtp_sessions={} release_lag_p99<={lag} draining={}",
            s.clients, s.queued, s.connections, s.smtp_sessions, s.draining
        )?;
        for (r, x) in routes {
            writeln!(
                out,
                "t={t:.1}s route={} protocol={} rate={} in={:.1}/s out={:.1}/s refused={:.1}/s",
                r.name,
                r.protocol,
                per_unit(r.rate_per_second),
                x.input,
                x.output,
                x.refused
            )?;
        }
        for q in s.deepest_queues.iter().take(QUEUES) {
            writeln!(
                out,
                "t={t:.1}s queue route={} key={} waiting={} drains_in={}",
                q.route,
                q.key,
                q.waiting,
                seconds(q.drains_in_ms as f64 / 1e3)
            )?;
        }
        for u in &s.upstreams {
            if let Some(ms) = u.paused_for_ms {
                writeln!(
                    out,
                    "t={t:.1}s upstream={} protocol={} paused_for={}",
                    u.name,
                    u.protocol,
                    seconds(ms as f64 / 1e3)
                )?;
            }
        }
        out.flush()
    }

    fn frame(
        &mut self,
        out: &mut dyn Write,
        lag: Option<f64>,
        routes: &[(&RouteStatus, Rates)],
        s: &Status,
    ) -> io::Result<()> {
        let st = self.style;
        // Every line fits 80 columns (auto-wrap is off: what passes them
        // is not shown); DRAINING first, where it is seen.
        let mut lines = vec![
            format!(
                "{}{}   release lag p99 {}",
                st.paint(BOLD, "sluice top"),
                if s.draining {
                    st.paint(RED, "   DRAINING")
                } else {
                    String::new()
                },
                lag.map_or("-".to_owned(), lag_bound),
            ),
            format!(
                "clients {}   queued {}   connections {}   smtp sessions {}",
                s.clients, s.queued, s.connections, s.smtp_sessions,
            ),
        ];
        lines.push(st.paint(
            DIM,
            &format!(
                "{:<16} {:>8}  {:<HISTORY$} {:>7}  {:<HISTORY$} {:>7}  {:>9}",
                "route", "rate", "in", "in/s", "out", "out/s", "refused/s"
            ),
        ));
        for (r, x) in routes {
            let h = self
                .history
                .get(&(r.name.clone(), r.protocol.clone()))
                .map_or(&[][..], Vec::as_slice);
            let full = (r.rate_per_second * 3.0).max(1.0);
            let refused = number(x.refused, 9);
            lines.push(format!(
                "{} {:>8}  {} {}  {} {}  {}",
                st.paint(BOLD, &fit(&format!("{} ({})", r.name, r.protocol), 16)),
                fit(&per_unit(r.rate_per_second), 8),
                st.paint(
                    YELLOW,
                    &pad(&spark(h.iter().map(|x| x.input), full), HISTORY)
                ),
                number(x.input, 7),
                st.paint(
                    GREEN,
                    &pad(&spark(h.iter().map(|x| x.output), full), HISTORY)
                ),
                number(x.output, 7),
                if x.refused > 0.0 {
                    st.paint(RED, &refused)
                } else {
                    refused
                }
            ));
        }
        lines.push(st.paint(DIM, "deepest queues (waiting / route capacity)"));
        let capacity: HashMap<&str, u64> = s
            .routes
            .iter()
            .map(|r| (r.name.as_str(), r.capacity))
            .collect();
        for q in s.deepest_queues.iter().take(QUEUES) {
            let cap = capacity.get(q.route.as_str()).copied().unwrap_or(0).max(1);
            lines.push(format!(
                "  {} {} {}  {}  drains {}",
                fit(&q.route, 14),
                fit(&q.key, 24),
                count(q.waiting, 6),
                st.paint(MAGENTA, &bar(q.waiting as f64, cap as f64, 12)),
                fit(&seconds(q.drains_in_ms as f64 / 1e3), 8)
            ));
        }
        if s.deepest_queues.is_empty() {
            lines.push("  (none)".to_owned());
        }
        for u in &s.upstreams {
            if let Some(ms) = u.paused_for_ms {
                lines.push(st.paint(
                    RED,
                    &format!(
                        "upstream {} ({}) paused for {}",
                        fit(&u.name, 40).trim_end(),
                        u.protocol,
                        seconds(ms as f64 / 1e3)
                    ),
                ));
            }
        }
        self.frame.draw(out, &lines)
    }

    fn problem(&mut self, out: &mut dyn Write, t: f64, why: &str) -> io::Result<()> {
        if self.style.live {
            self.frame.draw(out, &[self.style.paint(RED, why)])
        } else {
            writeln!(out, "t={t:.1}s error={why:?}")?;
            out.flush()
        }
    }
}

/// Seconds as a short human figure: 0.00005 -> "50µs", 0.0012 -> "1.2ms",
/// 3.5 -> "3.5s".
fn seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{:.0}µs", s * 1e6)
    } else if s < 1.0 {
        format!("{:.1}ms", s * 1e3)
    } else {
        format!("{s:.1}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prometheus_lines_parse_with_escaped_labels() {
        let (name, labels, v) = sample_line(
            r#"sluice_requests_total{route="a\"b",protocol="http",outcome="forwarded"} 12"#,
        )
        .unwrap();
        assert_eq!(name, "sluice_requests_total");
        assert_eq!(label(&labels, "route"), Some("a\"b"));
        assert_eq!(label(&labels, "outcome"), Some("forwarded"));
        assert_eq!(v, 12.0);
        let (name, labels, v) = sample_line("sluice_queued_requests 3").unwrap();
        assert_eq!((name, labels.len(), v), ("sluice_queued_requests", 0, 3.0));
        assert!(sample_line("# TYPE x counter").is_none());
        assert!(sample_line(r#"x{le="0.1} 1"#).is_none());
    }

    fn sample(at: Instant, lag: &[(f64, f64)]) -> Sample {
        Sample {
            at,
            status: Status {
                draining: false,
                routes: Vec::new(),
                upstreams: Vec::new(),
                clients: 0,
                queued: 0,
                connections: 0,
                smtp_sessions: 0,
                deepest_queues: Vec::new(),
            },
            requests: HashMap::new(),
            lag: lag.to_vec(),
        }
    }

    #[test]
    fn in_counts_arrivals_not_answers() {
        let t = Instant::now();
        let route = RouteStatus {
            name: "api".into(),
            protocol: "http".into(),
            rate_per_second: 1.0,
            capacity: 10,
        };
        let mut a = sample(t, &[]);
        let mut b = sample(t + std::time::Duration::from_secs(1), &[]);
        let key = |o: &str| ("api".to_owned(), "http".to_owned(), o.to_owned());
        // A burst of 10 in the second: one forwarded, nine waiting.
        for (s, arrived, forwarded) in [(&mut a, 0.0, 0.0), (&mut b, 10.0, 1.0)] {
            s.requests.insert(key(ARRIVED), arrived);
            s.requests.insert(key("forwarded"), forwarded);
        }
        let r = rates(&route, &a, &b);
        assert!((r.input - 10.0).abs() < 0.01, "{r:?}");
        assert!((r.output - 1.0).abs() < 0.01, "{r:?}");
    }

    /// Auto-wrap is off in the live view: a line past 80 columns loses
    /// its end on a standard terminal. A busy frame: long names and keys,
    /// large numbers, draining.
    #[test]
    fn every_live_line_fits_80_columns() {
        let t = Instant::now();
        let route = RouteStatus {
            name: "a-route-with-a-long-descriptive-name".into(),
            protocol: "http".into(),
            rate_per_second: 10_000.0 / 60.0,
            capacity: 10_000,
        };
        let mut a = sample(t, &[(0.001, 0.0), (f64::INFINITY, 0.0)]);
        let mut b = sample(
            t + std::time::Duration::from_secs(1),
            &[(0.001, 10.0), (f64::INFINITY, 1000.0)],
        );
        b.status = Status {
            draining: true,
            routes: vec![route],
            upstreams: vec![UpstreamStatus {
                name: "a-partner-upstream-with-a-very-long-name-indeed-for-the-line".into(),
                protocol: "http".into(),
                paused_for_ms: Some(59_000),
            }],
            clients: 1_000_000,
            queued: 100_000,
            connections: 65_535,
            smtp_sessions: 1_000,
            deepest_queues: vec![QueueStatus {
                route: "a-route-with-a-long-descriptive-name".into(),
                key: "#0123456789ab|203.0.113.200|a-tenant-with-a-long-name".into(),
                waiting: 1_000_000_000,
                drains_in_ms: 86_400_000_000,
            }],
        };
        let key = |o: &str| {
            (
                "a-route-with-a-long-descriptive-name".to_owned(),
                "http".to_owned(),
                o.to_owned(),
            )
        };
        a.status.routes = b.status.routes.clone();
        b.requests.insert(key(ARRIVED), 12_345_678.0);
        b.requests.insert(key("forwarded"), 1_234_567.0);
        b.requests.insert(key("rejected"), 11_000_000.0);
        let mut view = View::new(Style {
            live: true,
            color: false,
        });
        let mut buf = Vec::new();
        for _ in 0..HISTORY + 2 {
            view.show(&mut buf, 1.0, &a, &b).unwrap();
        }
        let text = String::from_utf8(buf).unwrap();
        // Each line as it shows: without the terminal's control codes.
        let mut shown = String::new();
        let mut chars = text.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                // CSI: '[', then parameters, up to a final letter.
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                shown.push(c);
            }
        }
        let mut lines = 0;
        for line in shown.lines() {
            let width = line.chars().count();
            assert!(width <= 80, "{width} columns: {line:?}");
            lines += 1;
        }
        assert!(lines > 5, "{shown}");
        assert!(shown.contains("DRAINING"), "{shown}");
    }

    #[test]
    fn numbers_fit_their_columns() {
        assert_eq!(number(12.345, 7), "   12.3");
        assert_eq!(number(123_456.7, 7), " 123.5k");
        assert_eq!(number(12_345_678.0, 7), "  12.3M");
        assert_eq!(count(42, 6), "    42");
        assert_eq!(count(1_000_000_000, 6), "  1.0G");
    }

    #[test]
    fn lag_p99_is_the_bucket_of_the_interval() {
        let t = Instant::now();
        let a = sample(t, &[(0.001, 90.0), (0.01, 100.0), (f64::INFINITY, 100.0)]);
        // 100 more releases: 98 under 1 ms, 2 under 10 ms.
        let b = sample(t, &[(0.001, 188.0), (0.01, 200.0), (f64::INFINITY, 200.0)]);
        assert_eq!(lag_p99(&a, &b), Some(0.01));
        assert_eq!(lag_p99(&b, &b), None);
    }
}
