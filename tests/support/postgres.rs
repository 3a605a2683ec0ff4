//! A real PostgreSQL server for one test: `initdb` into a temp directory
//! and `postgres` on a free loopback port, as a non-root user (the
//! `postgres` system user when the tests run as root), password auth over
//! TCP, optionally TLS with a test CA. Ended by PID when dropped.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{TempFile, TestCa, closed_port, temp_path};

/// The directory holding `initdb` and `postgres`: on PATH, else Debian's
/// newest `/usr/lib/postgresql/N/bin`.
fn bindir() -> PathBuf {
    if let Ok(out) = Command::new("sh")
        .args(["-c", "command -v initdb"])
        .output()
        && out.status.success()
    {
        let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if let Some(dir) = p
            .canonicalize()
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf))
        {
            return dir;
        }
    }
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is needed (bash .ci/run installs it)")
        .flatten()
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            Some((v, e.path().join("bin")))
        })
        .collect();
    versions.sort();
    versions.pop().expect("no /usr/lib/postgresql/N/bin").1
}

/// The user and group ids to run as: ours, or `postgres`'s when we are
/// root (PostgreSQL refuses to run as root).
fn run_as() -> Option<(u32, u32)> {
    let id = |args: &[&str]| {
        Command::new("id").args(args).output().ok().and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .trim()
                .parse::<u32>()
                .ok()
        })
    };
    if id(&["-u"]) != Some(0) {
        return None;
    }
    let uid = id(&["-u", "postgres"]);
    let gid = id(&["-g", "postgres"]);
    Some((
        uid.expect(
            "running as root needs a 'postgres' user (Debian's postgresql package makes it)",
        ),
        gid.expect("the 'postgres' user's group"),
    ))
}

pub const PASSWORD: &str = "s3cret:pw";

pub struct PostgresServer {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    /// The password, in a file for `password_file`.
    pub password_file: TempFile,
    /// The CA that signed the server's certificate, with TLS.
    pub ca_file: Option<TempFile>,
}

impl PostgresServer {
    pub fn start() -> PostgresServer {
        PostgresServer::start_with(None)
    }

    /// With TLS: a certificate for `localhost` and 127.0.0.1 signed by
    /// `ca`.
    pub fn start_tls(ca: &TestCa) -> PostgresServer {
        PostgresServer::start_with(Some(ca))
    }

    fn start_with(ca: Option<&TestCa>) -> PostgresServer {
        let dir = temp_path("pg");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, format!("{PASSWORD}\n")).unwrap();
        let password_file = TempFile::new("pg.pass", format!("{PASSWORD}\n"));
        let ca_file = ca.map(|ca| {
            let (cert, key) = ca.leaf_files(&["localhost", "127.0.0.1"]);
            std::fs::copy(&cert, dir.join("server.crt")).unwrap();
            std::fs::copy(&key, dir.join("server.key")).unwrap();
            ca.write()
        });
        let owner = run_as();
        if let Some((uid, gid)) = owner {
            for p in ["", "data", "pw", "server.crt", "server.key"] {
                let _ = std::os::unix::fs::chown(dir.join(p), Some(uid), Some(gid));
            }
        }
        let _ = std::fs::set_permissions(
            dir.join("server.key"),
            std::os::unix::fs::PermissionsExt::from_mode(0o600),
        );
        let bin = bindir();
        let mut initdb = Command::new(bin.join("initdb"));
        initdb
            .arg("-D")
            .arg(dir.join("data"))
            .args(["-U", "sluice", "-E", "UTF8", "--no-sync"])
            .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        as_user(&mut initdb, owner);
        let out = initdb.output().expect("initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let mut pg = PostgresServer {
            child: None,
            port: closed_port(),
            dir,
            password_file,
            ca_file,
        };
        // A port another process took between our pick and the bind makes
        // our postgres exit: pick again.
        for _ in 0..5 {
            if pg.try_launch() {
                return pg;
            }
            pg.port = closed_port();
        }
        panic!("postgres could not start on a free port in five tries");
    }

    /// Whether our own postmaster still runs.
    fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Start on `self.port` and wait until it is ready; `false` if our
    /// postmaster exited (readiness counts only while it runs: another
    /// server may answer on a port it took first).
    fn try_launch(&mut self) -> bool {
        let bin = bindir();
        let mut cmd = Command::new(bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "synchronous_commit=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "shared_buffers=32MB",
                "-c",
                "max_connections=100",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if self.ca_file.is_some() {
            cmd.args(["-c", "ssl=on", "-c"])
                .arg(format!(
                    "ssl_cert_file={}",
                    self.dir.join("server.crt").display()
                ))
                .arg("-c")
                .arg(format!(
                    "ssl_key_file={}",
                    self.dir.join("server.key").display()
                ));
        }
        as_user(&mut cmd, run_as());
        self.child = Some(cmd.spawn().expect("postgres"));
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if !self.alive() {
                self.stop();
                return false;
            }
            if self.ready() {
                return self.alive();
            }
            assert!(Instant::now() < deadline, "postgres did not start");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn ready(&self) -> bool {
        Command::new(bindir().join("pg_isready"))
            .args([
                "-q",
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-t",
                "2",
            ])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// `postgres://sluice@127.0.0.1:PORT/postgres` (the password comes
    /// from `password_file`).
    pub fn url(&self) -> String {
        format!("postgres://sluice@127.0.0.1:{}/postgres", self.port)
    }

    /// Run SQL with psql (as the superuser, over the Unix socket).
    pub fn psql(&self, sql: &str) -> String {
        let mut cmd = Command::new(bindir().join("psql"));
        cmd.args([
            "-X",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-U",
            "sluice",
            "-d",
            "postgres",
        ])
        .arg("-h")
        .arg(&self.dir)
        .args(["-p", &self.port.to_string(), "-c", sql]);
        as_user(&mut cmd, run_as());
        let out = cmd.output().expect("psql");
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// The postmaster and its children: the processes this server is.
    fn pids(&self) -> Vec<u32> {
        let Some(c) = &self.child else {
            return Vec::new();
        };
        let root = c.id();
        let mut pids = vec![root];
        if let Ok(entries) = std::fs::read_dir("/proc") {
            for e in entries.flatten() {
                let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                    continue;
                };
                let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                // pid (comm) state ppid ...
                let ppid = stat
                    .rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                    .and_then(|p| p.parse::<u32>().ok());
                if ppid == Some(root) {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// Send a signal by name (STOP, CONT, ...) to every process of this
    /// server.
    pub fn signal(&self, name: &str) {
        for pid in self.pids() {
            let _ = Command::new("kill")
                .args(["-s", name, &pid.to_string()])
                .stderr(Stdio::null())
                .status();
        }
    }

    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            // SIGQUIT: immediate shutdown, children included.
            let _ = Command::new("kill")
                .args(["-s", "QUIT", &c.id().to_string()])
                .status();
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Start again on the same port and data.
    pub fn restart(&mut self) {
        self.stop();
        assert!(
            self.try_launch(),
            "postgres exited on restart: port {} taken by another process?",
            self.port
        );
    }
}

fn as_user(cmd: &mut Command, owner: Option<(u32, u32)>) {
    if let Some((uid, gid)) = owner {
        cmd.uid(uid).gid(gid);
    }
}

impl Drop for PostgresServer {
    fn drop(&mut self) {
        self.signal("CONT");
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
