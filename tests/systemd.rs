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
        "DynamicUser=yes",
    ] {
        assert!(
            UNIT.lines().any(|l| l.starts_with(line)),
            "unit lacks {line}"
        );
    }
}
