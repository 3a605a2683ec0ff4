//! `sluice demo` end to end: the real binary, stdout piped (not a
//! terminal), a short run. Everything it starts binds 127.0.0.1.

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The demo runs 3 s, then its queues drain (at most b/r = 2 s); this is
/// the bound on the whole thing.
const LIMIT: Duration = Duration::from_secs(25);

#[test]
fn short_demo_prints_plain_lines_and_writes_a_valid_svg() {
    let svg =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("demo-{}.svg", std::process::id()));
    let _ = std::fs::remove_file(&svg);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["demo", "--duration", "3s", "--out"])
        .arg(&svg)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start sluice demo");

    // Read stdout on a thread so a full pipe cannot stall the demo.
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for sluice demo") {
            break status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sluice demo did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = reader.join().expect("stdout reader");
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    let text = String::from_utf8_lossy(&out);
    assert!(
        status.success(),
        "exit {status}\nstdout:\n{text}\nstderr:\n{stderr}"
    );

    // Plain output: no escape codes at all, one line per client per tick.
    assert!(
        !out.contains(&0x1b),
        "no ANSI escapes when not a terminal:\n{text}"
    );
    for client in ["steady", "bursty", "flood"] {
        for t in 1..=3 {
            let prefix = format!("t={t}s client={client} in=");
            assert!(
                text.lines().any(|l| l.starts_with(&prefix)),
                "missing a line starting {prefix:?}:\n{text}"
            );
        }
    }
    // The flood client sends at 3·r; what reaches the downstream stays at
    // r (5/s; a one-second window can hold 6 departures 200 ms apart).
    let flood: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("client=flood"))
        .collect();
    for line in &flood {
        let out_rate = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("out="))
            .and_then(|v| v.strip_suffix("/s"))
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or_else(|| panic!("no out= in {line:?}"));
        assert!(out_rate <= 6, "output above r: {line}");
    }
    assert!(
        flood.iter().any(|l| !l.contains(" total_429s=0")),
        "the flood gets 429s:\n{text}"
    );
    // Its queue, read from sluice itself, fills up to b = 10 and no more.
    let queues: Vec<u32> = flood
        .iter()
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|f| f.strip_prefix("queue="))
                .and_then(|v| v.strip_suffix("/10"))
                .and_then(|v| v.parse().ok())
        })
        .collect();
    assert_eq!(queues.len(), flood.len(), "{text}");
    assert!(
        queues.iter().any(|&q| q >= 8),
        "the flood queues: {queues:?}"
    );
    assert!(queues.iter().all(|&q| q <= 10), "never above b: {queues:?}");
    assert!(text.contains("summary:"), "{text}");
    assert!(
        text.contains(&format!("plot written to {}", svg.display())),
        "{text}"
    );

    // The plot: valid XML, an <svg> root, drawn elements, one panel per client.
    let svg_text = std::fs::read_to_string(&svg).expect("the SVG was written");
    let doc = roxmltree::Document::parse(&svg_text).expect("the SVG is valid XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    let count = |tag: &str| doc.descendants().filter(|n| n.has_tag_name(tag)).count();
    assert!(count("path") > 0 && count("line") > 0 && count("rect") > 0);
    let panels = doc
        .descendants()
        .filter(|n| n.attribute("class") == Some("panel"))
        .count();
    assert_eq!(panels, 3);
    let _ = std::fs::remove_file(&svg);
}

/// Ctrl-C (SIGINT) ends a demo early, and its summary and plot still come.
#[test]
fn an_interrupted_demo_still_prints_its_summary_and_writes_its_plot() {
    let svg =
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("demo-int-{}.svg", std::process::id()));
    let _ = std::fs::remove_file(&svg);
    let mut child = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["demo", "--duration", "60s", "--out"])
        .arg(&svg)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start sluice demo");
    let pid = child.id().to_string();
    let mut stdout = child.stdout.take().expect("stdout is piped");
    // The first tick's lines say it is running: then the interrupt.
    let mut seen = Vec::new();
    let mut chunk = [0u8; 4096];
    let started = Instant::now();
    while !String::from_utf8_lossy(&seen).contains("t=1s client=") {
        let n = stdout.read(&mut chunk).expect("read the demo");
        assert!(n > 0, "the demo ended before its first tick");
        seen.extend_from_slice(&chunk[..n]);
        assert!(started.elapsed() < LIMIT, "no first tick");
    }
    let sent = Command::new("kill").args(["-INT", &pid]).status().unwrap();
    assert!(sent.success());
    let interrupted = Instant::now();
    let _ = stdout.read_to_end(&mut seen);
    let status = child.wait().expect("wait for the demo");
    let text = String::from_utf8_lossy(&seen);
    assert!(interrupted.elapsed() < Duration::from_secs(15), "{text}");
    assert!(status.success(), "{status}: {text}");
    assert!(text.contains("summary: rate"), "{text}");
    let plot = std::fs::read_to_string(&svg).unwrap_or_default();
    assert!(
        plot.starts_with("<svg") || plot.starts_with("<?xml"),
        "no plot written"
    );
    let _ = std::fs::remove_file(&svg);
}

/// A plot path that cannot be written is said at once, before any run.
#[test]
fn a_plot_path_that_cannot_be_written_is_refused_at_once() {
    let started = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args([
            "demo",
            "--duration",
            "10s",
            "--out",
            "/nonexistent/dir/x.svg",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("run sluice demo");
    assert!(!out.status.success());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot write the plot"), "{stderr}");
}
