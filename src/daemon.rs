//! The daemon around the proxy: the admin listener, systemd notification
//! (READY, RELOADING, STOPPING, WATCHDOG), SIGHUP reload, SIGUSR1 access
//! log reopening and SIGTERM/SIGINT drain.

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

/// Raise the soft limit on open files to the hard one: every client
/// connection and every upstream connection is a descriptor, and a queued
/// request holds its connection (nginx's `worker_rlimit_nofile`).
pub(crate) fn raise_open_files() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => match setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
            Ok(()) => info!(from = soft, to = hard, "open-file limit raised"),
            Err(e) => warn!(error = %e, soft, "cannot raise the open-file limit"),
        },
        Ok(_) => {}
        Err(e) => warn!(error = %e, "cannot read the open-file limit"),
    }
}

/// Grow the process's descriptor table, once, to what the configured
/// connections can use: each client connection, the upstream connection
/// it departs on, and some room. The kernel grows the table by doubling
/// as descriptors open, and in a process with several threads each growth
/// waits for an RCU grace period, while every thread that opens a
/// descriptor (accept, connect) waits behind it: 10 to 40 ms on the bench
/// VM, a few times during a burst of new connections, in which no held
/// request departed (BENCHMARKS.md, "Departures during a burst of
/// connections"). nginx's workers are single-threaded and never wait.
/// The kernel never shrinks a table; it costs about 8 bytes of kernel
/// memory per descriptor (about 256 KiB for the default 10,000
/// connections).
fn reserve_descriptors(config: &Config) {
    use nix::fcntl::{FcntlArg, fcntl};
    use nix::sys::resource::{Resource, getrlimit};
    let clients = config
        .smtp
        .iter()
        .fold(config.server.max_connections, |n, l| {
            n.saturating_add(l.max_connections)
        });
    let upstream: usize = config
        .smtp_upstreams
        .iter()
        .map(|u| u.max_connections)
        .sum();
    // An open tunnel (WebSocket) has left `max_connections` and still
    // holds its two descriptors.
    let want = clients
        .saturating_add(config.server.max_tunnels)
        .saturating_mul(2)
        .saturating_add(upstream)
        .saturating_add(1024);
    let Ok((soft, _)) = getrlimit(Resource::RLIMIT_NOFILE) else {
        return;
    };
    let want = u64::try_from(want).unwrap_or(u64::MAX);
    // As nginx warns when worker_connections exceed the open-file limit:
    // past it, accepts fail (EMFILE) while connections remain to allow.
    if want > soft {
        warn!(
            limit = soft,
            needed = want,
            "the open-file limit is below what the configured connections can use \
             (two descriptors each, plus upstream connections): raise LimitNOFILE \
             or lower max_connections"
        );
    }
    let top = want.min(soft.saturating_sub(1));
    let Ok(top) = i32::try_from(top) else {
        return;
    };
    // Duplicating any descriptor to the lowest free one at or above `top`
    // grows the table to hold it; closing it keeps the table.
    let reserved = std::fs::File::open("/dev/null")
        .map_err(|e| e.to_string())
        .and_then(|null| fcntl(&null, FcntlArg::F_DUPFD_CLOEXEC(top)).map_err(|e| e.to_string()))
        .and_then(|fd| nix::unistd::close(fd).map_err(|e| e.to_string()));
    match reserved {
        Ok(()) => info!(
            descriptors = i64::from(top) + 1,
            "descriptor table reserved"
        ),
        Err(e) => {
            warn!(error = %e, descriptors = i64::from(top) + 1, "cannot reserve the descriptor table")
        }
    }
}

/// Run until SIGTERM or SIGINT, then drain. `path` is re-read on SIGHUP.
pub async fn run(path: PathBuf, config: Config) -> Result<(), DaemonError> {
    raise_open_files();
    reserve_descriptors(&config);
    let prometheus = m::install()?;
    let mut hangup = signal(SignalKind::hangup()).map_err(DaemonError::Signals)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(DaemonError::Signals)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(DaemonError::Signals)?;
    let mut rotate = signal(SignalKind::user_defined1()).map_err(DaemonError::Signals)?;

    let server = Server::bind(&config).await?;
    let handle = server.handle();
    let admin = match &config.admin {
        Some(a) => Some((
            crate::admin::bind(a.listen)
                .await
                .map_err(|source| DaemonError::Admin {
                    addr: a.listen,
                    source,
                })?,
            a.show_keys,
        )),
        None => None,
    };
    let mut background = Vec::new();
    // Both series exist from the start (at 0), so dashboards and alerts on
    // them never see "no data".
    for result in ["ok", "error"] {
        metrics::counter!(m::CONFIG_RELOADS_TOTAL, "result" => result).increment(0);
    }
    if let Some((listener, show_keys)) = admin {
        let (listener, handle) = (std::sync::Arc::new(listener), handle.clone());
        background.push(supervise("admin", move || {
            crate::admin::serve(
                listener.clone(),
                handle.clone(),
                prometheus.clone(),
                show_keys,
            )
        }));
    }

    let mut watchdog_usec = 0;
    if sd_notify::watchdog_enabled(false, &mut watchdog_usec) && watchdog_usec > 0 {
        // (Not zero, which `interval` refuses: WATCHDOG_USEC=1 comes from
        // the environment.)
        let period = Duration::from_micros(watchdog_usec / 2).max(Duration::from_millis(1));
        let handle = handle.clone();
        background.push(supervise("watchdog", move || {
            let handle = handle.clone();
            async move {
                let mut tick = tokio::time::interval(period);
                loop {
                    tick.tick().await;
                    // The pacer thread moves every queue, and each HTTP
                    // worker serves its connections: systemd hears from
                    // sluice only while they all answer.
                    let (answers, stuck) = tokio::join!(
                        tokio::time::timeout(period / 2, handle.pacer_answers()),
                        handle.workers_stuck(period / 2),
                    );
                    if answers != Ok(true) {
                        error!("the pacer thread does not answer: the watchdog is not told");
                    } else if !stuck.is_empty() {
                        error!(
                            workers = ?stuck,
                            "HTTP workers run nothing: the watchdog is not told"
                        );
                    } else {
                        notify(&[NotifyState::Watchdog]);
                    }
                }
            }
        }));
    }

    let stopping = handle.clone();
    let shutdown = async move {
        let signal = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        // Read now, not at start: a reload may have changed it.
        let delay = stopping.shutdown_delay();
        // Not ready from now on; said in the log after it is so (a probe
        // that read the line before the flag was set got 200).
        stopping.announce_stop();
        if delay.is_zero() {
            info!("{signal} received: draining");
        } else {
            info!(
                "{signal} received: not ready, serving for shutdown_delay ({}), then draining",
                humantime::format_duration(delay)
            );
        }
        // systemd's stop timeout is the unit's; the drain may need more (a
        // raised drain_timeout, request_timeout or relay_timeout, and the
        // shutdown delay before it): ask for it, so that systemd does not
        // kill sluice in the middle.
        // Written out: sd-notify's `ExtendTimeoutUsec` holds 32 bits (71
        // minutes), and systemd reads 64.
        let longest = delay + stopping.longest_stop() + Duration::from_secs(5);
        let extend = format!("EXTEND_TIMEOUT_USEC={}", longest.as_micros());
        notify(&[NotifyState::Stopping, NotifyState::Custom(&extend)]);
        // A second signal ends the drain at once (an operator's second
        // Ctrl-C): what is queued or in flight is cut; the access log is
        // written out first (a second at most).
        let last = stopping.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = terminate.recv() => {}
                _ = interrupt.recv() => {}
            }
            warn!("second signal received: exiting without finishing the drain");
            last.close_access_log();
            std::process::exit(1);
        });
        // Load balancers take the instance out of rotation meanwhile
        // (`/readyz` is 503); what they still send is served.
        tokio::time::sleep(delay).await;
        if !delay.is_zero() {
            info!("shutdown_delay passed: draining");
        }
    };
    let running = server.start().await?;
    let closing = handle.clone();
    // SIGUSR1: open the access log again (log rotation), nothing else.
    let rotating = handle.clone();
    background.push(tokio::spawn(async move {
        while rotate.recv().await.is_some() {
            rotating.reopen_access_log();
        }
    }));
    notify(&[NotifyState::Ready]);
    // SIGHUP is taken only now, once READY=1 is out: a reload before it
    // would tell systemd RELOADING=1 and READY=1 while the start could
    // still fail. One that came meanwhile was kept by its stream.
    background.push(tokio::spawn(async move {
        while hangup.recv().await.is_some() {
            // Once stopping, the config stays: systemd was told how long
            // the drain may take from it (a reload could lengthen the
            // drain past that and be killed in the middle), and RELOADING
            // after STOPPING is out of order.
            if handle.stopping() {
                warn!("SIGHUP during shutdown: ignored, the drain keeps its config");
                continue;
            }
            // Each reload on its own task: a panic in one is logged and
            // counted, and the next SIGHUP still works.
            let (path, handle) = (path.clone(), handle.clone());
            let done = tokio::task::spawn_blocking(move || reload(&path, &handle)).await;
            if let Err(e) = done {
                metrics::counter!(m::CONFIG_RELOADS_TOTAL, "result" => "error").increment(1);
                error!(error = %e, "reload failed unexpectedly; keeping the running config");
                notify(&[NotifyState::Ready]);
            }
        }
    }));

    running.run(shutdown).await;
    for task in background {
        task.abort();
    }
    closing.close_access_log();
    Ok(())
}

/// Run a background task; if it panics, log it and start it again (after
/// a second, so a task that keeps failing cannot spin). Never silently lost.
fn supervise<F, Fut>(name: &'static str, make: F) -> tokio::task::JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        loop {
            match tokio::spawn(make()).await {
                Ok(()) => return,
                Err(e) if e.is_panic() => {
                    error!(task = name, "background task panicked; restarting it");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
                Err(_) => return,
            }
        }
    })
}

/// Re-read and validate the config; swap it in if valid, otherwise keep
/// the running one and count the failure.
fn reload(path: &std::path::Path, handle: &Handle) {
    let mut states = vec![NotifyState::Reloading];
    if let Ok(now) = NotifyState::monotonic_usec_now() {
        states.push(now);
    }
    notify(&states);
    // Whatever becomes of the config: log rotation reloads to have the
    // access log opened again.
    handle.reopen_access_log();
    let result = Config::load(path).map_err(|e| e.to_string()).and_then(|c| {
        // A stop that began while the file was read keeps its config (see
        // the SIGHUP loop).
        if handle.stopping() {
            return Err("the stop began meanwhile".to_owned());
        }
        handle.reload(&c).map_err(|e| e.to_string())
    });
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
    // Not after STOPPING=1.
    if !handle.stopping() {
        notify(&[NotifyState::Ready]);
    }
}
