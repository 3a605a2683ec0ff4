//! The `sluice` binary: parse the command line, load the config, run.
//! Everything else lives in the library.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{CommandFactory, Parser};
use sluice::cli::{Cli, Command, LogFormat};
use sluice::config::Config;
use tracing::{error, info};
use tracing_subscriber::EnvFilter;

fn init_logging(level: &str, format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// The exit code for output written to stdout: a reader that closed it
/// early (`| head`) is no failure, and no panic (as `print!` would).
fn written(result: std::io::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sluice: cannot write to standard output: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Completions { shell } => {
            use clap_complete::Generator;
            let mut command = Cli::command();
            command.set_bin_name("sluice");
            command.build();
            // (`clap_complete::generate` panics when stdout is closed.)
            match shell.try_generate(&command, &mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => written(Err(e)),
            }
        }
        Command::Man => {
            match clap_mangen::Man::new(Cli::command()).render(&mut std::io::stdout()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("cannot write the man page: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Command::Check { config } => match Config::load(&config) {
            Ok(c) => {
                let smtp = if c.smtp.is_empty() {
                    String::new()
                } else {
                    format!(
                        ", {} SMTP listeners, {} SMTP upstreams",
                        c.smtp.len(),
                        c.smtp_upstreams.len()
                    )
                };
                // (The exit code says it; a closed stdout is no error.)
                let _ = writeln!(
                    std::io::stdout(),
                    "ok: {}: {} routes, {} upstreams{smtp}",
                    config.display(),
                    c.routes.len(),
                    c.upstreams.len()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::from(2)
            }
        },
        Command::Run { config } => {
            init_logging(&cli.log_level, cli.log_format);
            let cfg = match Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("{e}");
                    return ExitCode::from(2);
                }
            };
            run(config, cfg)
        }
        Command::Migrate {
            config,
            print_sql,
            durable,
        } => migrate(config, print_sql, durable),
        Command::Demo(args) => match sluice::demo::run(&args) {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice demo: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Top(args) => match sluice::top::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice top: {e}");
                ExitCode::FAILURE
            }
        },
        Command::Simulate(args) => match sluice::simulate::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("sluice simulate: {e}");
                ExitCode::from(e.exit_code())
            }
        },
    }
}

/// `sluice migrate`.
fn migrate(path: Option<std::path::PathBuf>, print_sql: bool, durable: bool) -> ExitCode {
    let cfg = match path.as_deref().map(Config::load) {
        None => None,
        Some(Ok(c)) => Some(c),
        Some(Err(e)) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let pg = cfg
        .as_ref()
        .and_then(|c| c.cluster.as_ref())
        .and_then(|c| match &c.store {
            sluice::config::Store::Postgres(pg) => Some((pg, c.timeout, c.key_prefix.as_str())),
            sluice::config::Store::Redis { .. } => None,
        });
    if print_sql {
        let durable = pg.map_or(durable, |(pg, _, _)| pg.durable);
        let sql = sluice::cluster::postgres::schema_sql(durable);
        return written(std::io::stdout().write_all(sql.as_bytes()));
    }
    let Some((pg, timeout, prefix)) = pg else {
        eprintln!("sluice migrate: the config has no [cluster] postgres = \"...\"");
        return ExitCode::from(2);
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice migrate: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        sluice::cluster::postgres::Postgres::new(pg, timeout, prefix)?
            .migrate()
            .await
    });
    match result {
        Ok(true) => {
            let _ = writeln!(
                std::io::stdout(),
                "created the tables and functions in {}",
                pg.target
            );
            ExitCode::SUCCESS
        }
        Ok(false) => {
            let _ = writeln!(std::io::stdout(), "already in place in {}", pg.target);
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("sluice migrate: {}: {e}", pg.target);
            ExitCode::FAILURE
        }
    }
}

fn run(path: std::path::PathBuf, config: Config) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(error = %e, "cannot start the async runtime");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(sluice::daemon::run(path, config));
    // Not a wait for every blocking task left (a reload reading a config
    // on a hung mount, a DNS lookup): dropping the runtime would wait for
    // them for ever, past the stop time systemd was told.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    match result {
        Ok(()) => {
            info!("stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// jemalloc, with its background thread purging freed pages: memory held
/// for a load spike returns to the system once the load falls. Its slab
/// sizes are set at build time in `.cargo/config.toml`.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;
