//! SMTP test harness: a real SMTP server as the upstream (aiosmtpd, in a
//! child process), a real SMTP client as the application (Python's
//! smtplib, in a child process), and a raw line client for what a
//! well-behaved library will not do (hang up mid-transaction, pipeline,
//! smuggle).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::Value;

use super::{TempFile, clients_dir};

/// A Python 3 that has aiosmtpd (`.ci/run` installs Debian's
/// python3-aiosmtpd).
pub fn python() -> &'static str {
    static FOUND: OnceLock<String> = OnceLock::new();
    FOUND.get_or_init(|| super::python_for("aiosmtpd"))
}

/// Options for the upstream.
#[derive(Default)]
pub struct UpstreamOpts {
    /// Certificate and key: STARTTLS offered and required.
    pub tls: Option<(TempFile, TempFile)>,
    /// `user:password`: AUTH required.
    pub auth: Option<String>,
}

/// A real SMTP server (aiosmtpd) recording every message it takes.
pub struct SmtpUpstream {
    child: Child,
    stdin: Option<ChildStdin>,
    pub port: u16,
    mode_file: TempFile,
    /// The certificate and key files, kept while the server runs.
    _tls: Option<(TempFile, TempFile)>,
    arrivals: Arc<Mutex<Vec<Value>>>,
}

impl SmtpUpstream {
    pub fn start(opts: UpstreamOpts) -> SmtpUpstream {
        let mode_file = TempFile::new("smtp-mode", "ok");
        let mut cmd = Command::new(python());
        cmd.arg(clients_dir().join("smtp_upstream.py"))
            .arg("--mode-file")
            .arg(&mode_file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        if let Some((cert, key)) = &opts.tls {
            cmd.arg("--tls").arg(cert).arg(key);
        }
        if let Some(auth) = &opts.auth {
            cmd.args(["--auth", auth]);
        }
        let mut child = cmd.spawn().expect("start the SMTP upstream");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let arrivals = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let seen = arrivals.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Some(port) = line.strip_prefix("PORT ") {
                    let _ = tx.send(port.trim().parse::<u16>().unwrap());
                } else if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    seen.lock().unwrap().push(v);
                }
            }
        });
        let port = rx
            .recv_timeout(Duration::from_secs(20))
            .expect("the SMTP upstream did not report its port");
        SmtpUpstream {
            child,
            stdin,
            port,
            mode_file,
            _tls: opts.tls,
            arrivals,
        }
    }

    /// See `smtp_upstream.py` for the modes.
    pub fn set_mode(&self, mode: &str) {
        std::fs::write(&self.mode_file, mode).unwrap();
    }

    /// The messages taken so far, in arrival order.
    pub fn arrivals(&self) -> Vec<Value> {
        self.arrivals.lock().unwrap().clone()
    }

    /// Wait (up to `timeout`) for `n` messages.
    pub fn wait_arrivals(&self, n: usize, timeout: Duration) -> Vec<Value> {
        let deadline = Instant::now() + timeout;
        loop {
            let a = self.arrivals();
            if a.len() >= n || Instant::now() > deadline {
                return a;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Assert that the server has taken exactly `n` messages. A message
    /// is recorded when the server's line about it is read, a moment
    /// after the server answered it: up to 10 s are given for the `n`th.
    #[track_caller]
    pub fn assert_taken(&self, n: usize) {
        let a = self.wait_arrivals(n, Duration::from_secs(10));
        assert_eq!(a.len(), n, "{a:?}");
    }

    /// End the server (by its PID), as an upstream that goes away.
    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stdin = None;
    }
}

impl Drop for SmtpUpstream {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Run `smtp_send.py` against `addr` with `args`: one JSON value per
/// message, in message order.
pub fn send(addr: SocketAddr, args: &[&str]) -> Vec<Value> {
    let out = Command::new(python())
        .arg(clients_dir().join("smtp_send.py"))
        .args([
            "--host",
            &addr.ip().to_string(),
            "--port",
            &addr.port().to_string(),
        ])
        .args(args)
        .output()
        .expect("run smtp_send.py");
    assert!(
        out.status.success(),
        "smtp_send.py failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("smtp_send.py prints JSON"))
        .collect()
}

/// The monotonic time of an arrival, in nanoseconds.
pub fn arrival_ns(v: &Value) -> u64 {
    v["t"].as_u64().expect("arrival time")
}

/// A line-level SMTP client on a raw socket.
pub struct Raw {
    stream: TcpStream,
    buf: Vec<u8>,
}

impl Raw {
    pub fn connect(addr: SocketAddr) -> Raw {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_nodelay(true).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut raw = Raw {
            stream,
            buf: Vec::new(),
        };
        let greeting = raw.reply();
        assert!(greeting.starts_with("220 "), "greeting: {greeting}");
        raw
    }

    pub fn send(&mut self, bytes: &str) {
        self.stream.write_all(bytes.as_bytes()).unwrap();
    }

    /// The next reply (all its lines, CRLF-joined).
    pub fn reply(&mut self) -> String {
        let mut lines = Vec::new();
        loop {
            let line = self.line();
            let last = line.len() < 4 || line.as_bytes()[3] != b'-';
            lines.push(line);
            if last {
                return lines.join("\r\n");
            }
        }
    }

    fn line(&mut self) -> String {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                return String::from_utf8_lossy(&line).trim_end().to_owned();
            }
            let mut chunk = [0u8; 4096];
            let n = self.stream.read(&mut chunk).expect("read a reply");
            assert!(n > 0, "connection closed; read so far: {:?}", self.buf);
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Send `command` and return its reply.
    pub fn cmd(&mut self, command: &str) -> String {
        self.send(&format!("{command}\r\n"));
        self.reply()
    }

    /// Whether the server has closed the connection (within `within`).
    pub fn closed(&mut self, within: Duration) -> bool {
        self.stream.set_read_timeout(Some(within)).unwrap();
        let mut b = [0u8; 64];
        match self.stream.read(&mut b) {
            Ok(0) => true,
            Ok(_) => false,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        }
    }

    /// Close the sending side only (a TCP half-close): replies still come.
    pub fn shut_write(&mut self) {
        self.stream.shutdown(std::net::Shutdown::Write).unwrap();
    }

    /// Hang up.
    pub fn hang_up(self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// GET `path` from the admin listener (a blocking HTTP/1.1 request): the
/// body.
pub fn admin_get(admin: SocketAddr, path: &str) -> String {
    let mut s = TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {admin}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    match text.split_once("\r\n\r\n") {
        Some((_, body)) => body.to_owned(),
        None => text,
    }
}

/// The `/status` document.
pub fn status(admin: SocketAddr) -> Value {
    serde_json::from_str(&admin_get(admin, "/status")).expect("/status is JSON")
}

/// Wait (up to 10 s) until `/status` reports `n` requests queued.
pub fn wait_queued(admin: SocketAddr, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let queued = status(admin)["queued"].as_u64().unwrap_or(0);
        if queued == n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "expected {n} queued, /status says {queued}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
