//! `sluice demo`: one command, no config, no other program, that shows
//! shaping at work.
//!
//! In one process it starts a built-in downstream (`downstream`), sluice
//! itself in front of it (a [`Config`] built from an embedded TOML string,
//! then [`Server::bind`], [`Server::start`] and [`crate::http::Running::run`], exactly
//! as the daemon does),
//! and three clients with different send patterns (`clients`). Once a
//! second it shows, per client, the input rate, the output rate (arrivals
//! at the downstream), the queue level and the 429s (`display`). At the
//! end it prints a summary and writes an SVG plot (`crate::plot`).
//!
//! Everything binds 127.0.0.1 on ephemeral ports, and every loop is
//! bounded by `--duration` plus a drain limit: the demo always ends.

mod clients;
mod display;
mod downstream;
mod record;

use std::io::{self, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::cli::DemoArgs;
use crate::config::Config;
use crate::http::{Handle, ServeError, Server};
use crate::plot;
use crate::simulate::human_interval;
pub use crate::term::Style;
pub use record::ClientSummary;

/// Why the demo could not run.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("cannot start the async runtime: {0}")]
    Runtime(io::Error),
    #[error("cannot start the built-in downstream: {0}")]
    Downstream(io::Error),
    #[error("invalid demo settings: {0}")]
    Config(String),
    #[error("cannot start sluice: {0}")]
    Serve(#[from] ServeError),
    #[error("sluice bound no listening address")]
    NoAddress,
    #[error("cannot write the plot to {}: {source}", path.display())]
    Plot { path: PathBuf, source: io::Error },
    #[error("cannot write to standard output: {0}")]
    Output(io::Error),
}

/// What a finished demo measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub clients: Vec<ClientSummary>,
    /// Where the plot was written.
    pub svg: PathBuf,
}

/// The demo's route name.
const ROUTE: &str = "demo";

/// The config the demo runs sluice with: one listener on an ephemeral
/// port, the built-in downstream as the only upstream, one route keyed by
/// `X-Client` with the demo's rate and capacity.
pub fn config_text(downstream: SocketAddr, rate: &str, capacity: u32) -> String {
    format!(
        r#"# sluice demo: built in, not read from a file.
[server]
listen = ["127.0.0.1:0"]
drain_timeout = "1s"

[[upstream]]
name = "demo-downstream"
url = "http://{downstream}"
connect_timeout = "1s"
request_timeout = "5s"

[[route]]
name = "{ROUTE}"
upstream = "demo-downstream"
key = "header:X-Client"
rate = {rate}
capacity = {capacity}
"#,
        rate = toml_string(rate)
    )
}

/// A TOML basic string.
fn toml_string(text: &str) -> String {
    let mut out = String::from("\"");
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Run the demo as `sluice demo` does: its own runtime, standard output,
/// a live chart when that is a terminal.
pub fn run(args: &DemoArgs) -> Result<Report, DemoError> {
    // Every waiting request holds two descriptors here (the client's and
    // sluice's end): a capacity of hundreds passes the usual soft 1,024.
    crate::daemon::raise_open_files();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(DemoError::Runtime)?;
    let stdout = io::stdout();
    let style = Style::detect(&stdout);
    let mut out = stdout.lock();
    let report = runtime.block_on(run_with(args, &mut out, style));
    // Stray connection tasks must not hold the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    report
}

/// Run the demo, printing to `out` in `style`.
pub async fn run_with(
    args: &DemoArgs,
    out: &mut dyn Write,
    style: Style,
) -> Result<Report, DemoError> {
    // The plot's file first: a path that cannot be written is said now,
    // not after the run.
    let plot_error = |source| DemoError::Plot {
        path: args.out.clone(),
        source,
    };
    // Not emptied yet: a run that fails leaves an earlier plot as it was.
    let mut plot_file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(&args.out)
        .map_err(plot_error)?;
    let recorder = Arc::new(record::Recorder::default());
    let downstream = downstream::start(recorder.clone())
        .await
        .map_err(DemoError::Downstream)?;

    let config = Config::from_toml(&config_text(downstream.addr, &args.rate, args.capacity))
        .map_err(|problems| {
            DemoError::Config(
                problems
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; "),
            )
        })?;
    let route = config
        .routes
        .first()
        .ok_or_else(|| DemoError::Config("no route".into()))?;
    let rate = route.rate;
    let capacity = route.capacity;
    let interval = rate.interval();

    let server = Server::bind(&config).await?;
    let proxy = *server.local_addrs().first().ok_or(DemoError::NoAddress)?;
    let handle = server.handle();
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let server_task = tokio::spawn(server.start().await?.run(async {
        let _ = shutdown_rx.await;
    }));

    let patterns = clients::patterns(interval, capacity, args.duration);
    let names: Vec<&'static str> = patterns.iter().map(|p| p.name).collect();
    let rate_text = format!("{} (1/r = {})", args.rate, human_interval(rate));
    let mut screen = display::Screen::new(
        out,
        style,
        names.clone(),
        rate.per_second_f64(),
        rate_text.clone(),
        capacity,
        args.duration,
    );
    let intro = [
        format!(
            "sluice demo: sluice on {proxy} in front of a built-in downstream on {}",
            downstream.addr
        ),
        format!(
            "route key header:X-Client, rate {rate_text}, capacity {capacity}; clients send for {}:",
            humantime::format_duration(args.duration)
        ),
    ];
    for line in &intro {
        screen.line(line).map_err(DemoError::Output)?;
    }
    for p in &patterns {
        screen
            .line(&format!("  {:<7} {}", p.name, p.describe()))
            .map_err(DemoError::Output)?;
    }

    let http = Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(5))
        .build_http();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let start = Instant::now();
    let target = clients::Target {
        http,
        proxy,
        recorder: recorder.clone(),
        stop: stop_rx,
    };
    let senders: Vec<_> = patterns
        .iter()
        .enumerate()
        .map(|(i, p)| {
            tokio::spawn(clients::drive(
                i,
                p.clone(),
                start,
                args.duration,
                target.clone(),
            ))
        })
        .collect();
    drop(target);
    let sampler = tokio::spawn(sample_queues(
        handle,
        names.clone(),
        recorder.clone(),
        stop_tx.subscribe(),
    ));

    // Once a second until the clients have stopped and every request has
    // its answer, or the drain limit passes.
    let drain_limit = (interval.saturating_mul(capacity.saturating_add(2))
        + Duration::from_secs(2))
    .min(Duration::from_secs(30));
    let tick = Duration::from_secs(1);
    let t0 = tokio::time::Instant::from_std(start);
    // Ctrl-C stops the clients early; the summary and the plot still come
    // (and no frame is cut off halfway, leaving the terminal's auto-wrap
    // off).
    let interrupted = tokio::signal::ctrl_c();
    tokio::pin!(interrupted);
    // How long the clients sent: all of it, or up to the interrupt.
    let mut sent_for = args.duration;
    for k in 1u32.. {
        let boundary = start + tick * k;
        tokio::select! {
            biased;
            _ = &mut interrupted => {
                sent_for = start.elapsed().min(args.duration);
                break;
            }
            () = tokio::time::sleep_until(t0 + tick * k) => {}
        }
        let counts = recorder.tick(&names, boundary - tick, boundary);
        screen
            .tick(u64::from(k), &counts)
            .map_err(DemoError::Output)?;
        let elapsed = tick * k;
        let senders_done = senders.iter().all(|s| s.is_finished());
        if elapsed >= args.duration
            && ((senders_done && recorder.all_answered()) || elapsed >= args.duration + drain_limit)
        {
            break;
        }
    }
    drop(screen);

    // Stop: abandon what still waits, then shut sluice down (its queues
    // are empty by now; idle keep-alive connections close).
    let _ = stop_tx.send(true);
    for s in senders {
        s.abort();
    }
    sampler.abort();
    let settle = tokio::time::Instant::now() + Duration::from_secs(1);
    while !recorder.all_answered() && tokio::time::Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = shutdown_tx.send(());
    let abort = server_task.abort_handle();
    if tokio::time::timeout(Duration::from_secs(3), server_task)
        .await
        .is_err()
    {
        abort.abort();
    }
    drop(downstream);

    // Summary and plot.
    let marks = recorder.marks(names.len(), start, interval);
    let queues = recorder.queue_steps(names.len(), start);
    let summaries: Vec<ClientSummary> = names
        .iter()
        .zip(marks.iter().zip(&queues))
        .map(|(n, (m, q))| record::summarize(n, m, q))
        .collect();
    let chart = plot::Chart {
        title: "sluice demo: arrivals, queue level and departures per client".into(),
        subtitle: format!(
            "rate {rate_text}, capacity {capacity}; clients sent for {}; {}",
            humantime::format_duration(Duration::from_secs(sent_for.as_secs())),
            patterns
                .iter()
                .map(|p| format!("{}: {}", p.name, p.describe()))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        capacity,
        end: sent_for.as_secs_f64(),
        panels: names
            .iter()
            .zip(marks.into_iter().zip(queues))
            .map(|(n, (requests, queue))| plot::Panel {
                name: (*n).to_string(),
                requests,
                queue: Some(queue),
            })
            .collect(),
    };
    plot_file
        .set_len(0)
        .and_then(|()| plot_file.write_all(plot::svg(&chart).as_bytes()))
        .map_err(plot_error)?;

    write_summary(out, &summaries, &rate_text, capacity, interval, &args.out)
        .map_err(DemoError::Output)?;
    Ok(Report {
        clients: summaries,
        svg: args.out.clone(),
    })
}

/// How often the queue levels are read from sluice.
const SAMPLE_EVERY: Duration = Duration::from_millis(10);

/// Read each client's queue level from sluice's own shaper (the bucket
/// query behind the admin `/buckets` endpoint) every [`SAMPLE_EVERY`],
/// until the demo stops.
async fn sample_queues(
    handle: Handle,
    names: Vec<&'static str>,
    recorder: Arc<record::Recorder>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let mut every = tokio::time::interval(SAMPLE_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = every.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        let at = Instant::now();
        for (i, name) in names.iter().enumerate() {
            let level = handle
                .bucket(ROUTE, name, 1)
                .and_then(|b| b.view.map(|v| v.waiting_cost))
                .unwrap_or(0);
            recorder.sampled(at, i, level);
        }
    }
}

fn write_summary(
    out: &mut dyn Write,
    summaries: &[ClientSummary],
    rate_text: &str,
    capacity: u32,
    interval: Duration,
    svg: &std::path::Path,
) -> io::Result<()> {
    let ms = |s: f64| format!("{:.1}", s * 1e3);
    writeln!(out)?;
    writeln!(out, "summary: rate {rate_text}, capacity {capacity}")?;
    writeln!(
        out,
        "{:<8} {:>5} {:>9} {:>5} {:>9}   output spacing while queued (ms; 1/r = {})",
        "client",
        "sent",
        "forwarded",
        "429s",
        "max queue",
        ms(interval.as_secs_f64())
    )?;
    for s in summaries {
        let spacing = match s.queued_spacing {
            Some(g) => format!("mean {}  min {}  max {}", ms(g.mean), ms(g.min), ms(g.max)),
            None if s.sent == 0 => "- (sent nothing)".to_string(),
            None if s.refused > 0 => "- (nothing waited: the rest was refused)".to_string(),
            None => "- (never queued: forwarded at once)".to_string(),
        };
        writeln!(
            out,
            "{:<8} {:>5} {:>9} {:>5} {:>9}   {spacing}",
            s.name, s.sent, s.forwarded, s.refused, s.max_queue
        )?;
    }
    let unanswered: u64 = summaries.iter().map(|s| s.other).sum();
    if unanswered > 0 {
        writeln!(
            out,
            "{unanswered} requests were neither forwarded nor refused (failed, or still waiting at the end)"
        )?;
    }
    writeln!(out, "plot written to {}", svg.display())?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_config_is_valid() {
        let addr: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let c = Config::from_toml(&config_text(addr, "5/s", 10)).unwrap();
        assert_eq!(c.routes.len(), 1);
        assert_eq!(c.routes[0].capacity, 10);
        assert_eq!(c.routes[0].rate.interval(), Duration::from_millis(200));
    }

    #[test]
    fn rate_text_is_quoted_for_toml() {
        assert_eq!(toml_string(r#"5/s"#), r#""5/s""#);
        assert_eq!(toml_string("a\"b\\"), r#""a\"b\\""#);
    }
}
