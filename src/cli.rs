//! The command line, defined once with clap's derive API (used by `main`
//! and, later, for completions and the man page).

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// A queue-based traffic shaper: a reverse proxy (and SMTP relay) that
/// releases each client's requests exactly 1/r apart and refuses what would
/// overflow its queue.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, long_about = None)]
pub struct Cli {
    /// Log filter for `run` (trace, debug, info, warn, error, or a tracing
    /// directive); RUST_LOG, when set, wins.
    #[arg(
        long,
        global = true,
        default_value = "info",
        value_parser = log_filter,
        help_heading = "Logging (for run)"
    )]
    pub log_level: String,

    /// Log line format for `run`.
    #[arg(
        long,
        global = true,
        value_enum,
        default_value_t = LogFormat::Text,
        help_heading = "Logging (for run)"
    )]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// How log lines are written.
/// A `--log-level` tracing can use: a typo is an error at the command
/// line, not a silent `info`.
fn log_filter(value: &str) -> Result<String, String> {
    tracing_subscriber::EnvFilter::try_new(value)
        .map(|_| value.to_owned())
        .map_err(|e| format!("not a log filter: {e}"))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy and SMTP relay listeners of a config file.
    Run {
        /// The TOML config file.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Validate a config file and exit: 0 when valid, 2 with one line per
    /// problem when not.
    Check {
        /// The TOML config file.
        #[arg(long, short)]
        config: PathBuf,
    },
    /// Create the PostgreSQL tables and functions of cluster mode now (a
    /// start creates them too when missing), or print their SQL for a DBA
    /// to apply.
    Migrate {
        /// The TOML config file, with `[cluster] postgres = "..."`.
        #[arg(long, short, required_unless_present = "print_sql")]
        config: Option<PathBuf>,
        /// Print the SQL instead of applying it (logged tables with
        /// `--durable`, or as the config's `durable` says).
        #[arg(long)]
        print_sql: bool,
        /// With --print-sql and no config: logged tables.
        #[arg(long, requires = "print_sql")]
        durable: bool,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), e.g. `sluice man > /usr/local/share/man/man1/sluice.1`.
    Man,
    /// Show shaping at work: a built-in downstream, sluice in front of it,
    /// and three clients (steady, bursty, flood); a live chart of input,
    /// output and queue level, then a summary and an SVG plot.
    Demo(DemoArgs),
    /// Run a recorded arrival trace (CSV: time,key,cost) through the
    /// shaping engine in virtual time; write one row per request (and,
    /// with --out-svg, a plot).
    Simulate(SimulateArgs),
    /// A live view of a running instance from its admin listener: per route
    /// requests in, out and refused per second, the deepest queues, paused
    /// upstreams, release lag. Plain lines when stdout is not a terminal.
    Top(TopArgs),
}

/// `sluice top`.
#[derive(Debug, Clone, clap::Args)]
pub struct TopArgs {
    /// The instance's admin listen address ([admin] listen), HOST:PORT
    /// (an `http://` before it is taken off).
    #[arg(long, default_value = "127.0.0.1:9090", value_parser = admin_address)]
    pub admin: String,

    /// Time between updates (50ms to 1h).
    #[arg(long, value_parser = parse_interval, default_value = "1s")]
    pub interval: std::time::Duration,

    /// Stop after this many updates (default: until interrupted).
    #[arg(long)]
    pub count: Option<u64>,
}

/// `--admin` as HOST:PORT: a URL's `http://` and trailing `/` are taken
/// off (the admin listener speaks plain HTTP only).
fn admin_address(value: &str) -> Result<String, String> {
    let bare = value
        .strip_prefix("http://")
        .unwrap_or(value)
        .trim_end_matches('/');
    if bare.contains('/') || !bare.contains(':') || value.starts_with("https://") {
        return Err(format!(
            "'{value}' is not HOST:PORT of the admin listener (such as 127.0.0.1:9090)"
        ));
    }
    Ok(bare.to_owned())
}

/// `sluice demo`.
#[derive(Debug, Clone, clap::Args)]
pub struct DemoArgs {
    /// How long the clients send (then queued requests drain); 1s to 10m.
    #[arg(long, value_parser = parse_duration, default_value = "15s")]
    pub duration: std::time::Duration,

    /// Per-client rate r, as in the config ("5/s", "300/m"); at most
    /// 1000/s.
    #[arg(long, value_parser = parse_demo_rate, default_value = "5/s")]
    pub rate: String,

    /// Per-client capacity b: requests that may wait; 0 to 1000.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub capacity: u32,

    /// Where to write the SVG plot.
    #[arg(long, default_value = "sluice-demo.svg")]
    pub out: PathBuf,
}

/// `sluice simulate`.
#[derive(Debug, Clone, clap::Args)]
pub struct SimulateArgs {
    /// The arrival trace: CSV with a header `time,key,cost` (time in
    /// seconds, e.g. 0.025; cost optional, default 1).
    #[arg(long)]
    pub arrivals: PathBuf,

    /// Per-client rate r ("5/s", "300/m", "0.5/s", "10/h", "100/d").
    #[arg(long)]
    pub rate: crate::shaper::Rate,

    /// Per-client capacity b, in cost units (0 = pure policing).
    #[arg(long)]
    pub capacity: u32,

    /// Requests that may pass un-paced after idle (nginx `delay=`).
    #[arg(long, default_value_t = 0)]
    pub burst: u32,

    /// Write one row per request here (default: standard output).
    #[arg(long)]
    pub out_csv: Option<PathBuf>,

    /// Write the SVG plot here.
    #[arg(long)]
    pub out_svg: Option<PathBuf>,
}

/// `sluice demo --duration`: 1 s to 10 min (the demo keeps every request
/// and sample it draws, and redraws from them each second).
fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < std::time::Duration::from_secs(1) || d > std::time::Duration::from_secs(600) {
        return Err("must be from 1s to 10m".into());
    }
    Ok(d)
}

/// `sluice top --interval`: 50 ms (tokio's interval refuses zero) to 1 h
/// (a period past what an instant can hold panics).
fn parse_interval(text: &str) -> Result<std::time::Duration, String> {
    let d = humantime::parse_duration(text).map_err(|e| e.to_string())?;
    if d < std::time::Duration::from_millis(50) || d > std::time::Duration::from_secs(3600) {
        return Err("must be from 50ms to 1h".into());
    }
    Ok(d)
}

/// `sluice demo --rate`: a rate as the config writes it, checked but kept
/// as text; at most 1000/s (the demo keeps every request it draws: at
/// 10,000/s for 10 minutes, millions of them).
fn parse_demo_rate(text: &str) -> Result<String, String> {
    let rate = text
        .parse::<crate::shaper::Rate>()
        .map_err(|e| e.to_string())?;
    if rate.per_second_f64() > 1000.0 {
        return Err("must be at most 1000/s".into());
    }
    Ok(text.trim().to_string())
}
