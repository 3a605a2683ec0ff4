//! The command line itself: help, version, completions and the man page.

use std::process::Command;

fn sluice(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn help_and_version_work_everywhere() {
    for args in [
        &["--help"][..],
        &["run", "--help"],
        &["check", "--help"],
        &["completions", "--help"],
        &["demo", "--help"],
        &["simulate", "--help"],
        &["man", "--help"],
    ] {
        let (ok, out) = sluice(args);
        assert!(ok && out.contains("Usage: sluice"), "{args:?}: {out}");
    }
    let (ok, out) = sluice(&["--version"]);
    assert!(ok && out.starts_with("sluice "), "{out}");
}

#[test]
fn completions_are_generated_for_each_shell() {
    for shell in ["bash", "zsh", "fish"] {
        let (ok, out) = sluice(&["completions", shell]);
        assert!(ok && out.contains("sluice"), "{shell}: {out}");
    }
    let (ok, _) = sluice(&["completions", "tcsh-of-the-future"]);
    assert!(!ok);
}

#[test]
fn man_page_is_roff_for_sluice() {
    let (ok, out) = sluice(&["man"]);
    assert!(ok);
    assert!(out.contains(".TH sluice 1"), "{out}");
    assert!(out.contains("check"), "subcommands are listed");
}

#[test]
fn demo_durations_are_bounded() {
    // The demo keeps every request it draws: a day of it would take
    // hundreds of MB and rescans that grow with it.
    for bad in ["500ms", "11m", "24h"] {
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["demo", "--duration", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("must be from 1s to 10m"), "{bad}: {err}");
    }
}

/// The demo's rate and capacity are bounded too (every request is kept,
/// and each waiting one holds two descriptors), and refused before the
/// plot's file is made; `top --interval` past an hour is refused (a
/// period that large panicked in the timer).
#[test]
fn demo_rates_capacities_and_top_intervals_are_bounded() {
    let dir = std::env::temp_dir().join(format!("sluice-demo-bounds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let svg = dir.join("plot.svg");
    for (args, says) in [
        (&["--rate", "10000/s"][..], "must be at most 1000/s"),
        (&["--capacity", "1001"][..], "1001"),
        (&["--capacity", "2000000000"][..], "2000000000"),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("demo")
            .args(args)
            .arg("--out")
            .arg(&svg)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!svg.exists(), "{args:?} left a plot file");
    }
    let _ = std::fs::remove_dir_all(&dir);
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["top", "--interval", "300000000000y", "--count", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("must be from 50ms to 1h"), "{err}");
}

/// Output cut short by its reader (`| head`) is no failure and no panic.
#[test]
fn a_closed_standard_output_is_no_panic() {
    use std::process::Stdio;
    for args in [&["completions", "zsh"][..], &["migrate", "--print-sql"][..]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Closed before a byte is read.
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {err}", out.status);
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// A `--log-level` tracing cannot read is refused at the command line
/// (it used to run at `info` without a word); a directive list is taken.
#[test]
fn a_log_level_that_is_no_filter_is_refused() {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/config/sluice.toml");
    let (ok, _) = sluice(&[
        "--log-level",
        "info,sluice=loud",
        "check",
        "--config",
        config,
    ]);
    assert!(!ok, "a bad level was taken");
    let (ok, out) = sluice(&[
        "--log-level",
        "sluice=debug,hyper=warn",
        "check",
        "--config",
        config,
    ]);
    assert!(ok, "{out}");
}

/// `top --admin` takes HOST:PORT, or a URL of it, and refuses anything
/// else at the command line.
#[test]
fn top_admin_takes_an_address_or_its_url() {
    let unreachable = "127.0.0.1:1";
    for given in [unreachable, "http://127.0.0.1:1", "http://127.0.0.1:1/"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .args(["top", "--count", "1", "--admin", given])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            stderr.contains(&format!("{unreachable}/status")),
            "{given}: {stderr}"
        );
        assert!(!stderr.contains("http://http://"), "{given}: {stderr}");
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["top", "--count", "1", "--admin", "https://127.0.0.1:1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "clap refuses it");
}
