//! The access log (`server.access_log`): one JSON line per HTTP request
//! that reaches the handler, written once its answer's head is ready (or,
//! status 499, when its client leaves first), by a thread of its own. The
//! request path only formats the line and hands it over: a full channel
//! (a disk slower than the traffic) drops the line and counts it, never
//! holds a request. The file is opened for appending at start and opened
//! again on SIGUSR1 (log rotation) and on SIGHUP.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};
use http::{Method, Uri, Version};
use metrics::Counter;
use serde::Serialize;
use tracing::warn;

use crate::metrics as m;

/// Lines waiting for the writer at most; past it, lines are dropped.
const BACKLOG: usize = 65_536;
/// How long a written line may wait in the buffer before it is flushed.
const FLUSH_EVERY: Duration = Duration::from_secs(1);
/// How long the exit waits for the writer to flush.
const CLOSE_WAIT: Duration = Duration::from_secs(1);
/// The status logged for a request whose client left before its answer
/// (nginx's 499, "client closed request").
const CLIENT_LEFT: u16 = 499;

enum Msg {
    Line(String),
    Close,
}

/// The access log's writer.
pub struct AccessLog {
    tx: Sender<Msg>,
    dropped: Counter,
    /// Set to have the writer open the file again.
    reopen: Arc<AtomicBool>,
    writer: Mutex<Option<JoinHandle<()>>>,
}

/// What is known of a request when it arrives, for its line. The target
/// is copied: a clone of the request's `Uri` would keep the buffer its
/// head was read into (up to `max_header_size`) for as long as the
/// request waits.
pub struct Arrival {
    at: SystemTime,
    started: Instant,
    client: IpAddr,
    method: Method,
    target: Box<str>,
    version: Version,
}

impl Arrival {
    pub fn new(client: IpAddr, method: &Method, target: &Uri, version: Version) -> Arrival {
        let target = target
            .path_and_query()
            .map_or_else(|| target.path(), |pq| pq.as_str());
        Arrival {
            at: SystemTime::now(),
            started: Instant::now(),
            client,
            method: method.clone(),
            target: target.into(),
            version,
        }
    }
}

/// A request's line, written when dropped unless written before: a
/// request whose future is dropped (its client left while it waited or
/// was forwarded) gets status 499.
pub struct Pending {
    log: Arc<AccessLog>,
    arrival: Arrival,
    route: Box<str>,
    written: bool,
}

impl Pending {
    pub fn new(log: Arc<AccessLog>, arrival: Arrival, route: &str) -> Pending {
        Pending {
            log,
            arrival,
            route: route.into(),
            written: false,
        }
    }

    /// Its line, with the answer's status (and gRPC status, if its head
    /// has one).
    pub fn answered<B>(mut self, answer: &http::Response<B>) {
        let grpc = grpc_status(answer.headers());
        let status = answer.status().as_u16();
        self.log
            .write(&self.arrival, Some(&self.route), status, grpc);
        self.written = true;
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        if !self.written {
            self.log
                .write(&self.arrival, Some(&self.route), CLIENT_LEFT, None);
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
    /// A gRPC answer's status, when its head carries one (a refusal, an
    /// error: a trailers-only answer); a call's own status comes later,
    /// in its trailers, and is not logged.
    #[serde(skip_serializing_if = "Option::is_none")]
    grpc_status: Option<u16>,
    /// From arrival to the answer's head, in milliseconds.
    ms: f64,
}

impl AccessLog {
    /// Open `path` for appending (created if missing) and start the
    /// writer.
    pub fn open(path: &Path) -> std::io::Result<AccessLog> {
        let file = append(path)?;
        let (tx, rx) = crossbeam_channel::bounded(BACKLOG);
        let dropped = metrics::counter!(m::ACCESS_LOG_DROPPED_TOTAL);
        let reopen = Arc::new(AtomicBool::new(false));
        let writer = Writer {
            path: path.to_owned(),
            dropped: dropped.clone(),
            reopen: reopen.clone(),
        };
        let file = BufWriter::with_capacity(64 << 10, file);
        let writer = std::thread::Builder::new()
            .name("sluice-access-log".to_owned())
            .spawn(move || writer.run(&rx, file))?;
        Ok(AccessLog {
            tx,
            dropped,
            reopen,
            writer: Mutex::new(Some(writer)),
        })
    }

    /// The line of a request that arrived as `arrival` and was answered
    /// `status` (on `route`, if it had one).
    pub fn write(&self, arrival: &Arrival, route: Option<&str>, status: u16, grpc: Option<u16>) {
        let entry = Entry {
            time: humantime::format_rfc3339_millis(arrival.at).to_string(),
            client: arrival.client,
            method: arrival.method.as_str(),
            target: &arrival.target,
            protocol: protocol(arrival.version),
            route,
            status,
            grpc_status: grpc,
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

    /// Open the file again (after log rotation moved it away), within
    /// the writer's flush period; never waits.
    pub fn reopen(&self) {
        self.reopen.store(true, Ordering::Release);
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

/// The `grpc-status` in an answer's head, if any.
pub fn grpc_status(headers: &http::HeaderMap) -> Option<u16> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
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

/// The file, for appending; made owner- and group-readable only (client
/// addresses, and query strings that may carry tokens).
fn append(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o640)
        .open(path)
}

/// The writer thread's own state.
struct Writer {
    path: std::path::PathBuf,
    /// Lines lost to a failed write count as dropped too.
    dropped: Counter,
    reopen: Arc<AtomicBool>,
}

impl Writer {
    /// Lines as they come, flushed at least every [`FLUSH_EVERY`] while
    /// any wait; the file opened again when asked. A write that fails is
    /// warned about once until writes work again, and its line counted
    /// as dropped.
    fn run(&self, rx: &Receiver<Msg>, mut file: BufWriter<File>) {
        let mut failing = false;
        let mut flushed = Instant::now();
        loop {
            match rx.recv_timeout(FLUSH_EVERY.saturating_sub(flushed.elapsed())) {
                Ok(Msg::Line(line)) => {
                    let written = file.write_all(line.as_bytes());
                    self.report(written, &mut failing);
                }
                Ok(Msg::Close) | Err(RecvTimeoutError::Disconnected) => {
                    let flushed = file.flush();
                    self.report(flushed, &mut failing);
                    return;
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
            if self.reopen.swap(false, Ordering::AcqRel) {
                let done = file.flush();
                self.report(done, &mut failing);
                match append(&self.path) {
                    Ok(f) => file = BufWriter::with_capacity(64 << 10, f),
                    Err(e) => warn!(
                        path = %self.path.display(),
                        error = %e,
                        "cannot open the access log again; writing on to the file open before"
                    ),
                }
            }
            if flushed.elapsed() >= FLUSH_EVERY {
                if !file.buffer().is_empty() {
                    let done = file.flush();
                    self.report(done, &mut failing);
                }
                flushed = Instant::now();
            }
        }
    }

    fn report(&self, result: std::io::Result<()>, failing: &mut bool) {
        match result {
            Ok(()) => *failing = false,
            Err(e) => {
                self.dropped.increment(1);
                if !*failing {
                    warn!(path = %self.path.display(), error = %e, "cannot write the access log");
                }
                *failing = true;
            }
        }
    }
}
