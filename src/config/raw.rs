//! The config file as written: every field optional so that validation can
//! say what is missing in its own words; unknown fields are refused.

use serde::Deserialize;

use super::Problem;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    #[serde(default)]
    pub server: RawServer,
    #[serde(default, rename = "upstream")]
    pub upstreams: Vec<RawUpstream>,
    #[serde(default, rename = "route")]
    pub routes: Vec<RawRoute>,
    #[serde(default)]
    pub limits: RawLimits,
    pub admin: Option<RawAdmin>,
    pub cluster: Option<RawCluster>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    pub redis: Option<String>,
    pub key_prefix: Option<String>,
    pub timeout: Option<String>,
    pub on_failure: Option<String>,
    pub instances: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    pub listen: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    pub listen: Option<Vec<String>>,
    pub header_read_timeout: Option<String>,
    pub max_header_size: Option<i64>,
    pub max_connections: Option<i64>,
    pub drain_timeout: Option<String>,
    pub trusted_proxies: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub name: Option<String>,
    pub url: Option<String>,
    pub rate: Option<String>,
    pub connect_timeout: Option<String>,
    pub request_timeout: Option<String>,
    pub max_concurrency: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Option<String>,
    #[serde(rename = "match")]
    pub matcher: Option<RawMatch>,
    pub upstream: Option<String>,
    pub key: Option<RawKey>,
    pub on_missing_key: Option<String>,
    pub rate: Option<String>,
    pub capacity: Option<i64>,
    pub cost: Option<RawCost>,
    pub burst: Option<i64>,
    pub max_wait: Option<String>,
    pub dry_run: Option<bool>,
    pub ratelimit_headers: Option<bool>,
}

/// `key = "ip"` or `key = ["header:X-Tenant", "ip"]`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawKey {
    One(String),
    Composite(Vec<String>),
}

/// `cost = 5` or `cost = { header = "X-Cost", default = 1, max = 100 }`.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum RawCost {
    Fixed(i64),
    Header(RawCostHeader),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCostHeader {
    pub header: Option<String>,
    pub default: Option<i64>,
    pub max: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub host: Option<String>,
    pub path_prefix: Option<String>,
    pub path: Option<String>,
    pub methods: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimits {
    pub max_clients: Option<i64>,
    pub max_queued: Option<i64>,
}

/// Parse TOML text; a syntax or type error becomes one [`Problem`] with its
/// line and the table it sits in (`route[1].rate`).
pub fn parse(text: &str) -> Result<RawConfig, Problem> {
    toml::from_str(text).map_err(|e| {
        let message = e.message().replace('\n', " ").trim().to_owned();
        match e.span() {
            Some(span) => Problem {
                line: Some(text[..span.start.min(text.len())].matches('\n').count() + 1),
                path: locate(text, span.start),
                message,
            },
            None => Problem {
                line: None,
                path: String::new(),
                message,
            },
        }
    })
}

/// The key path at byte `offset`: the enclosing table (with its index for
/// arrays of tables) and the key on that line, e.g. `route[1].rate`.
fn locate(text: &str, offset: usize) -> String {
    let before = &text[..offset.min(text.len())];
    let mut table = String::new();
    let mut counts: Vec<(String, usize)> = Vec::new();
    for line in before.lines() {
        let line = line.trim();
        if let Some(name) = line.strip_prefix("[[").and_then(|l| l.split("]]").next()) {
            let name = name.trim().to_owned();
            let n = match counts.iter_mut().find(|(k, _)| *k == name) {
                Some((_, n)) => {
                    *n += 1;
                    *n
                }
                None => {
                    counts.push((name.clone(), 0));
                    0
                }
            };
            table = format!("{name}[{n}]");
        } else if let Some(name) = line.strip_prefix('[').and_then(|l| l.split(']').next()) {
            table = name.trim().to_owned();
        }
    }
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line_end = text[line_start..]
        .find('\n')
        .map_or(text.len(), |i| line_start + i);
    let key = text[line_start..line_end]
        .split_once('=')
        .map(|(k, _)| k.trim().to_owned())
        .filter(|k| !k.is_empty() && !k.starts_with('['));
    match (table.is_empty(), key) {
        (true, Some(k)) => k,
        (true, None) => String::new(),
        (false, Some(k)) => format!("{table}.{k}"),
        (false, None) => table,
    }
}
