//! The command line, defined once with clap's derive API (used by `main`
//! and, later, for completions and the man page).

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

/// A queue-based traffic shaper: a reverse proxy that releases each
/// client's requests exactly 1/r apart and refuses what would overflow its
/// queue.
#[derive(Debug, Parser)]
#[command(name = "sluice", version, about, long_about = None)]
pub struct Cli {
    /// Log filter (trace, debug, info, warn, error, or a tracing directive);
    /// RUST_LOG, when set, wins.
    #[arg(long, global = true, default_value = "info")]
    pub log_level: String,

    /// Log line format.
    #[arg(long, global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy with a config file.
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
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the man page (roff), e.g. `sluice man > /usr/local/share/man/man1/sluice.1`.
    Man,
}
