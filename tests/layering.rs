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

/// The top-level modules the crate declares (`pub mod NAME;` in lib.rs).
fn top_modules() -> Vec<String> {
    let lib =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/lib.rs")).unwrap();
    let mods: Vec<String> = lib
        .lines()
        .filter_map(|l| {
            let l = l.trim().strip_prefix("pub ").unwrap_or(l.trim());
            l.strip_prefix("mod ")?
                .strip_suffix(';')
                .map(|m| m.trim().to_owned())
        })
        .collect();
    for m in ["shaper", "pacer", "cluster", "admission", "http", "smtp"] {
        assert!(mods.iter().any(|x| x == m), "lib.rs declares no `{m}`");
    }
    mods
}

/// The module path of a source file under `src/` (`src/http/serve.rs` is
/// `http::serve`, `src/http/mod.rs` is `http`).
fn module_of(path: &str) -> Vec<String> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let rel = Path::new(path).strip_prefix(&src).unwrap();
    let mut parts: Vec<String> = rel
        .with_extension("")
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts
}

fn ident_len(s: &str) -> usize {
    s.find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(s.len())
}

/// The top-level items of a `{...}` group starting at `s` (which begins
/// with `{`): the first identifier of each, split at commas of depth 1.
fn group_heads(s: &str) -> Vec<String> {
    let (mut depth, mut heads, mut item) = (0usize, Vec::new(), String::new());
    for c in s.chars() {
        match c {
            '{' => {
                depth += 1;
                if depth == 1 {
                    continue;
                }
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    heads.push(std::mem::take(&mut item));
                    break;
                }
            }
            ',' if depth == 1 => {
                heads.push(std::mem::take(&mut item));
                continue;
            }
            _ => {}
        }
        item.push(c);
    }
    heads
        .iter()
        .map(|i| {
            let i = i.trim();
            i[..ident_len(i)].to_owned()
        })
        .filter(|i| !i.is_empty())
        .collect()
}

/// The crate's top-level modules that `text` (the file at `path`) names
/// through `crate::` or `super::` paths, grouped imports included
/// (`use crate::{shaper::Policy, pacer}` names shaper and pacer).
fn crate_modules_named(path: &str, text: &str) -> Vec<String> {
    let here = module_of(path);
    let mut named = Vec::new();
    for prefix in ["crate::", "super::"] {
        for (i, _) in text.match_indices(prefix) {
            // Only where a path starts: not after `::` (the second `super`
            // of `super::super::`) nor inside an identifier.
            let before = &text[..i];
            if before.ends_with("::")
                || before
                    .chars()
                    .next_back()
                    .is_some_and(|c| c.is_alphanumeric() || c == '_')
            {
                continue;
            }
            let (mut base, mut rest) = (Vec::new(), &text[i + prefix.len()..]);
            if prefix == "super::" {
                // Each `super` goes one module up from this file's.
                base = here.clone();
                base.pop();
                while let Some(r) = rest.strip_prefix("super::") {
                    base.pop();
                    rest = r;
                }
            }
            let heads = if rest.starts_with('{') {
                group_heads(rest)
            } else {
                vec![rest[..ident_len(rest)].to_owned()]
            };
            for h in heads {
                let mut full = base.clone();
                if h != "self" && !h.is_empty() {
                    full.push(h);
                }
                if let Some(top) = full.first() {
                    named.push(top.clone());
                }
            }
        }
    }
    named.sort();
    named.dedup();
    named
}

#[test]
fn the_engine_imports_nothing_outside_itself_and_reads_no_clock() {
    let files = sources("src/shaper");
    assert!(!files.is_empty());
    let tops = top_modules();
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
        // `super::` paths that climb out of the engine (an inline
        // `mod tests` is one level deeper than its file, so only the
        // crate's own top-level modules count).
        let outside: Vec<String> = crate_modules_named(&path, &text)
            .into_iter()
            .filter(|m| m != "shaper" && tops.contains(m))
            .collect();
        assert!(outside.is_empty(), "{path} imports {outside:?}");
    }
}

#[test]
fn front_ends_go_through_the_admission_layer() {
    let tops = top_modules();
    for dir in ["src/http", "src/smtp"] {
        let files = sources(dir);
        assert!(!files.is_empty(), "no sources under {dir}");
        for (path, text) in files {
            let named = crate_modules_named(&path, &text);
            for banned in ["shaper", "pacer", "cluster"] {
                assert!(tops.iter().any(|t| t == banned));
                assert!(
                    !named.iter().any(|m| m == banned),
                    "{path} imports crate::{banned}"
                );
            }
        }
    }
}

/// The scanner itself: the forms an import of the engine can take from a
/// front end are all seen.
#[test]
fn the_import_scanner_sees_grouped_and_relative_paths() {
    let src = |f: &str| format!("{}/src/{f}", env!("CARGO_MANIFEST_DIR"));
    let serve = src("http/serve.rs");
    let named = |text: &str| crate_modules_named(&serve, text);
    assert_eq!(named("use crate::shaper::Policy;"), ["shaper"]);
    assert_eq!(
        named("use crate::{admission::Admission, shaper::Policy};"),
        ["admission", "shaper"]
    );
    assert_eq!(
        named("use crate::{\n    pacer::{Shaper, Ticket},\n    http::Server,\n};"),
        ["http", "pacer"]
    );
    assert_eq!(named("use super::super::cluster::Cluster;"), ["cluster"]);
    assert_eq!(named("use super::{conn, route};"), ["http"]);
    assert_eq!(named("let x = crate::pacer::default_shards(2);"), ["pacer"]);
    assert!(named("use my_crate::shaper;").is_empty());
    // In mod.rs, one `super` is the crate.
    assert_eq!(
        crate_modules_named(&src("http/mod.rs"), "use super::shaper::Rate;"),
        ["shaper"]
    );
}
