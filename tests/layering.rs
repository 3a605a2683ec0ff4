//! The layout's import rules (issue 10): `shaper/` (the pure engine)
//! imports nothing of ours outside itself and nothing that reads a clock or
//! runs tasks; front ends reach the engine, the pacer and the shared
//! schedule only through the admission layer.

use std::path::Path;

fn sources(dir: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join(dir)];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                out.push((p.display().to_string(), text));
            }
        }
    }
    out
}

#[test]
fn the_engine_imports_nothing_outside_itself_and_reads_no_clock() {
    let files = sources("src/shaper");
    assert!(!files.is_empty());
    for (path, text) in files {
        for banned in [
            "crate::",
            "tokio",
            "Instant::now",
            "SystemTime",
            "std::thread",
        ] {
            let hits: Vec<&str> = text
                .lines()
                .filter(|l| l.contains(banned) && !l.contains("crate::shaper"))
                .collect();
            assert!(hits.is_empty(), "{path} uses `{banned}`: {hits:?}");
        }
    }
}

#[test]
fn front_ends_go_through_the_admission_layer() {
    for dir in ["src/http", "src/smtp"] {
        for (path, text) in sources(dir) {
            for banned in ["crate::shaper", "crate::pacer", "crate::cluster"] {
                assert!(!text.contains(banned), "{path} imports {banned}");
            }
        }
    }
}
