//! The shipped systemd unit passes `systemd-analyze verify` with no
//! complaint (its binary path pointed at the binary under test), and keeps
//! the directives operations rely on.

use std::process::Command;

const UNIT: &str = include_str!("../systemd/sluice.service");

#[test]
fn unit_passes_systemd_analyze_verify() {
    let dir = std::env::temp_dir().join(format!("sluice-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let unit = dir.join("sluice.service");
    std::fs::write(
        &unit,
        UNIT.replace("/usr/bin/sluice", env!("CARGO_BIN_EXE_sluice")),
    )
    .unwrap();
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&unit)
        .output()
        .expect("systemd-analyze is needed (bash .ci/run installs it)");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    // verify only warns (exit 0) about some mistakes: any output is a failure.
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
}

#[test]
fn unit_has_the_operational_directives() {
    for line in [
        "Type=notify",
        "ExecReload=/usr/bin/sluice check --config /etc/sluice/sluice.toml",
        "ExecReload=/bin/kill -HUP $MAINPID",
        "WatchdogSec=",
        "NoNewPrivileges=yes",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "CapabilityBoundingSet=CAP_NET_BIND_SERVICE",
        "AmbientCapabilities=CAP_NET_BIND_SERVICE",
        "RestrictAddressFamilies=",
        "SystemCallFilter=@system-service",
        "LimitNOFILE=",
        "LimitNICE=-10",
        "RestartPreventExitStatus=2",
        "StartLimitIntervalSec=0",
        "DynamicUser=yes",
    ] {
        assert!(
            UNIT.lines().any(|l| l.starts_with(line)),
            "unit lacks {line}"
        );
    }
    // RestartPreventExitStatus ignores ExecStartPre's status (systemd
    // #11868): a config check there would restart in a loop.
    assert!(!UNIT.lines().any(|l| l.starts_with("ExecStartPre=")));
}

/// What RestartPreventExitStatus=2 relies on: `sluice run` on a config
/// that does not load exits 2, before it binds anything.
#[test]
fn run_exits_2_on_a_config_that_does_not_load() {
    let dir = std::env::temp_dir().join(format!("sluice-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("sluice.toml");
    std::fs::write(&bad, "[[route]]\nname = 3\n").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["run", "--config"])
        .arg(&bad)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}
