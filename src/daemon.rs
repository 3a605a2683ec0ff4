//! The daemon around the proxy: the admin listener, systemd notification
//! (READY, RELOADING, STOPPING, WATCHDOG), SIGHUP reload and SIGTERM/SIGINT
//! drain.

use std::path::PathBuf;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio::signal::unix::{SignalKind, signal};
use tracing::{error, info, warn};

use crate::config::Config;
use crate::http::{Handle, ServeError, Server};
use crate::metrics as m;

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(transparent)]
    Serve(#[from] ServeError),
    #[error("cannot listen on the admin address {addr}: {source}")]
    Admin {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot install the metrics recorder: {0}")]
    Metrics(#[from] metrics_exporter_prometheus::BuildError),
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

/// Tell systemd (when `NOTIFY_SOCKET` is set; otherwise nothing happens).
fn notify(states: &[NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, states) {
        warn!(error = %e, "cannot notify systemd");
    }
}

/// Run until SIGTERM or SIGINT, then drain. `path` is re-read on SIGHUP.
pub async fn run(path: PathBuf, config: Config) -> Result<(), DaemonError> {
    let prometheus = m::install()?;
    let mut hangup = signal(SignalKind::hangup()).map_err(DaemonError::Signals)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;

    let server = Server::bind(&config).await?;
    let handle = server.handle();
    let admin = match config.admin {
        Some(addr) => Some(
            crate::admin::bind(addr)
                .await
                .map_err(|source| DaemonError::Admin { addr, source })?,
        ),
        None => None,
    };
    if let Some(listener) = admin {
        tokio::spawn(crate::admin::serve(listener, handle.clone(), prometheus));
    }

    let mut watchdog_usec = 0;
    if sd_notify::watchdog_enabled(false, &mut watchdog_usec) && watchdog_usec > 0 {
        let period = Duration::from_micros(watchdog_usec / 2);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                notify(&[NotifyState::Watchdog]);
            }
        });
    }

    let reloader = tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            reload(&path, &handle);
        }
    });

    let shutdown = async move {
        tokio::select! {
            _ = terminate.recv() => info!("SIGTERM received: draining"),
            _ = interrupt.recv() => info!("SIGINT received: draining"),
        }
        notify(&[NotifyState::Stopping]);
    };
    let serving = server.run(shutdown);
    notify(&[NotifyState::Ready]);
    serving.await;
    reloader.abort();
    Ok(())
}

/// Re-read and validate the config; swap it in if valid, otherwise keep
/// the running one and count the failure.
fn reload(path: &std::path::Path, handle: &Handle) {
    let mut states = vec![NotifyState::Reloading];
    if let Ok(now) = NotifyState::monotonic_usec_now() {
        states.push(now);
    }
    notify(&states);
    let result = Config::load(path)
        .map_err(|e| e.to_string())
        .and_then(|c| handle.reload(&c).map_err(|e| e.to_string()));
    match result {
        Ok(()) => {
            metrics::counter!(m::CONFIG_RELOADS_TOTAL, "result" => "ok").increment(1);
            info!(path = %path.display(), "config reloaded");
        }
        Err(e) => {
            metrics::counter!(m::CONFIG_RELOADS_TOTAL, "result" => "error").increment(1);
            for line in e.lines() {
                error!("reload refused, keeping the running config: {line}");
            }
        }
    }
    notify(&[NotifyState::Ready]);
}
