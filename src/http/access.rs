//! The access log (`server.access_log`): one JSON line per HTTP request,
//! written once its answer's head is ready, by a thread of its own. The
//! request path only formats the line and hands it over: a full channel
//! (a disk slower than the traffic) drops the line and counts it, never
//! holds a request. The file is opened for appending at start and opened
//! again on each SIGHUP (`systemctl reload`), as log rotation expects.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::net::IpAddr;
use std::path::Path;
use std::sync::Mutex;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use http::{Method, StatusCode, Uri, Version};
use metrics::Counter;
use serde::Serialize;
use tracing::warn;

use crate::metrics as m;

/// Lines waiting for the writer at most; past it, lines are dropped.
const BACKLOG: usize = 65_536;
/// How long a written line may wait in the buffer before it is flushed.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// How long the exit waits for the writer to flush.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

enum Msg {
    Line(String),
    Reopen,
    Close,
}

/// The access log's writer.
pub struct AccessLog {
    tx: Sender<Msg>,
    dropped: Counter,
    writer: Mutex<Option<JoinHandle<()>>>,
}

/// What is known of a request when it arrives, for its line.
pub struct Arrival {
    at: SystemTime,
    started: Instant,
    client: IpAddr,
    method: Method,
    target: Uri,
    version: Version,
}

impl Arrival {
    pub fn new(client: IpAddr, method: &Method, target: &Uri, version: Version) -> Arrival {
        Arrival {
            at: SystemTime::now(),
            started: Instant::now(),
            client,
            method: method.clone(),
            target: target.clone(),
            version,
        }
    }
}

#[derive(Serialize)]
struct Entry<'a> {
    time: String,
    client: IpAddr,
    method: &'a str,
    target: &'a str,
    protocol: &'static str,
    route: Option<&'a str>,
    status: u16,
    /// From arrival to the answer's head, in milliseconds.
    ms: f64,
}

impl AccessLog {
    /// Open `path` for appending (created if missing) and start the
    /// writer.
    pub fn open(path: &Path) -> std::io::Result<AccessLog> {
        let file = append(path)?;
        let (tx, rx) = crossbeam_channel::bounded(BACKLOG);
        let path = path.to_owned();
        let writer = std::thread::Builder::new()
            .name("sluice-access-log".to_owned())
            .spawn(move || write(&rx, BufWriter::with_capacity(64 << 10, file), &path))?;
        Ok(AccessLog {
            tx,
            dropped: metrics::counter!(m::ACCESS_LOG_DROPPED_TOTAL),
            writer: Mutex::new(Some(writer)),
        })
    }

    /// The line of a request that arrived as `arrival` and was answered
    /// `status` (on `route`, if it had one).
    pub fn write(&self, arrival: &Arrival, route: Option<&str>, status: StatusCode) {
        let entry = Entry {
            time: humantime::format_rfc3339_millis(arrival.at).to_string(),
            client: arrival.client,
            method: arrival.method.as_str(),
            target: arrival
                .target
                .path_and_query()
                .map_or_else(|| arrival.target.path(), |pq| pq.as_str()),
            protocol: protocol(arrival.version),
            route,
            status: status.as_u16(),
            ms: (arrival.started.elapsed().as_micros() as f64) / 1_000.0,
        };
        let Ok(mut line) = serde_json::to_string(&entry) else {
            return;
        };
        line.push('\n');
        match self.tx.try_send(Msg::Line(line)) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => self.dropped.increment(1),
        }
    }

    /// Open the file again (after log rotation moved it away).
    pub fn reopen(&self) {
        let _ = self.tx.send(Msg::Reopen);
    }

    /// Flush what is written and stop the writer (at the exit), waiting
    /// at most [`CLOSE_WAIT`].
    pub fn close(&self) {
        let _ = self.tx.send_timeout(Msg::Close, CLOSE_WAIT);
        let writer = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(writer) = writer {
            let deadline = Instant::now() + CLOSE_WAIT;
            while !writer.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            if writer.is_finished() {
                let _ = writer.join();
            }
        }
    }
}

fn protocol(version: Version) -> &'static str {
    match version {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    }
}

fn append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new().create(true).append(true).open(path)
}

/// The writer thread: lines as they come, flushed at least every
/// [`FLUSH_EVERY`] while any wait; the file opened again on
/// [`Msg::Reopen`]. A write that fails is warned about once until writes
/// work again.
fn write(rx: &Receiver<Msg>, mut file: BufWriter<File>, path: &Path) {
    let mut failing = false;
    let report = |result: std::io::Result<()>, failing: &mut bool| match result {
        Ok(()) => *failing = false,
        Err(e) => {
            if !*failing {
                warn!(path = %path.display(), error = %e, "cannot write the access log");
            }
            *failing = true;
        }
    };
    let mut flushed = Instant::now();
    loop {
        match rx.recv_timeout(FLUSH_EVERY.saturating_sub(flushed.elapsed())) {
            Ok(Msg::Line(line)) => report(file.write_all(line.as_bytes()), &mut failing),
            Ok(Msg::Reopen) => {
                report(file.flush(), &mut failing);
                match append(path) {
                    Ok(f) => file = BufWriter::with_capacity(64 << 10, f),
                    Err(e) => warn!(
                        path = %path.display(),
                        error = %e,
                        "cannot open the access log again; writing on to the file open before"
                    ),
                }
            }
            Ok(Msg::Close) | Err(RecvTimeoutError::Disconnected) => {
                report(file.flush(), &mut failing);
                return;
            }
            Err(RecvTimeoutError::Timeout) => {}
        }
        if flushed.elapsed() >= FLUSH_EVERY {
            if !file.buffer().is_empty() {
                report(file.flush(), &mut failing);
            }
            flushed = Instant::now();
        }
    }
}
