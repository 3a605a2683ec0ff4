//! `sluice check` on the shipped config and on every broken config in
//! config/invalid/: each broken one must exit non-zero with exactly one
//! line on stderr that names the file and says what its first-line
//! `# expect:` comment says.

mod support;

use std::path::Path;
use std::process::Command;

use support::TempFile;

fn check(path: &Path) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["check", "--config"])
        .arg(path)
        .output()
        .expect("run sluice check");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn shipped_config_is_valid() {
    let (code, stdout, stderr) = check(Path::new("config/sluice.toml"));
    assert_eq!(code, 0, "stderr: {stderr}");
    assert!(stdout.starts_with("ok: config/sluice.toml"), "{stdout}");
}

#[test]
fn every_invalid_config_is_refused_with_one_clear_line() {
    let mut checked = 0;
    for entry in std::fs::read_dir("config/invalid").unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let expect = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{}: first line must be '# expect: ...'", path.display()));
        let (code, _, stderr) = check(&path);
        assert_eq!(code, 2, "{}: {stderr}", path.display());
        let lines: Vec<&str> = stderr.lines().collect();
        assert_eq!(
            lines.len(),
            1,
            "{}: expected one line, got {stderr:?}",
            path.display()
        );
        assert!(
            lines[0].starts_with(&path.display().to_string()),
            "{}",
            lines[0]
        );
        assert!(
            lines[0].contains(expect),
            "{}: {:?} lacks {expect:?}",
            path.display(),
            lines[0]
        );
        checked += 1;
    }
    assert!(checked >= 12, "only {checked} invalid configs");
}

#[test]
fn missing_file_is_reported() {
    let (code, _, stderr) = check(Path::new("config/does-not-exist.toml"));
    assert_ne!(code, 0);
    assert!(
        stderr.contains("does-not-exist.toml: cannot read"),
        "{stderr}"
    );
}

/// The shipped config's commented SMTP example, uncommented (with a real
/// password file), is valid too: the documentation cannot rot.
#[test]
fn shipped_smtp_example_is_valid_uncommented() {
    let text = std::fs::read_to_string("config/sluice.toml").unwrap();
    let start = text.find("# [[smtp_upstream]]").expect("the SMTP example");
    let end = text.find("[limits]").unwrap();
    let password = TempFile::new("ses.pass", "secret\n");
    let example: String = text[start..end]
        .lines()
        .map(|l| {
            l.strip_prefix("# ")
                .or_else(|| l.strip_prefix('#'))
                .unwrap_or(l)
        })
        .collect::<Vec<_>>()
        .join("\n")
        .replace(
            "/run/credentials/sluice.service/ses.pass",
            password.to_str().unwrap(),
        );
    let config = format!("{}{example}\n{}", &text[..start], &text[end..]);
    let path = TempFile::new("smtp-example.toml", &config);
    let (code, stdout, stderr) = check(&path);
    assert_eq!(code, 0, "stderr: {stderr}");
    assert!(
        stdout.contains("1 SMTP listeners, 1 SMTP upstreams"),
        "{stdout}"
    );
}
