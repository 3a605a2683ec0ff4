//! The config file as written: every field optional so that validation can
//! say what is missing in its own words; unknown fields are refused.
//!
//! Parsing fails on the first syntax or type error (that is serde's model);
//! [`parse`] turns it into one [`Problem`] with its line and key path, named
//! the way validation names things (`route 'api': capacity`). Field types
//! carry their own "expected ..." wording, so a wrong type reads
//! `expected a duration such as "2s" or "250ms"`, not `expected a string`.

use std::fmt;
use std::ops::Range;

use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, de::value::MapAccessDeserializer};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

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
    #[serde(default, rename = "smtp_upstream")]
    pub smtp_upstreams: Vec<RawSmtpUpstream>,
    #[serde(default, rename = "smtp")]
    pub smtp: Vec<RawSmtp>,
}

/// `[[smtp_upstream]]`: where SMTP listeners relay.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSmtpUpstream {
    pub name: Option<String>,
    #[serde(default, deserialize_with = "smtp_url")]
    pub url: Option<String>,
    pub tls: Option<String>,
    pub ca_file: Option<String>,
    pub username: Option<String>,
    pub password_file: Option<String>,
    #[serde(default, deserialize_with = "rate")]
    pub rate: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub max_connections: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub max_messages_per_connection: Option<i64>,
    #[serde(default, deserialize_with = "duration")]
    pub connect_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub relay_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub idle_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub throttle_pause: Option<String>,
    pub helo_name: Option<String>,
}

/// `[[smtp]]`: one SMTP listener and its shaping policy.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSmtp {
    pub name: Option<String>,
    #[serde(default, deserialize_with = "addresses")]
    pub listen: Option<Vec<String>>,
    pub upstream: Option<String>,
    pub key: Option<RawKey>,
    #[serde(default, deserialize_with = "rate")]
    pub rate: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub capacity: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub burst: Option<i64>,
    pub cost: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub max_wait: Option<String>,
    #[serde(default, deserialize_with = "size")]
    pub max_message_size: Option<RawSize>,
    #[serde(default, deserialize_with = "whole")]
    pub max_recipients: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub max_connections: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub max_connections_per_ip: Option<i64>,
    #[serde(default, deserialize_with = "duration")]
    pub idle_timeout: Option<String>,
    pub hostname: Option<String>,
    pub tls_cert: Option<String>,
    pub tls_key: Option<String>,
    pub require_tls: Option<bool>,
    pub auth_file: Option<String>,
    pub allow_from: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCluster {
    pub redis: Option<RawUrls>,
    pub ca_file: Option<String>,
    pub postgres: Option<String>,
    pub password_file: Option<String>,
    pub durable: Option<bool>,
    #[serde(default, deserialize_with = "whole")]
    pub pool_size: Option<i64>,
    pub mode: Option<String>,
    pub key_prefix: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub timeout: Option<String>,
    pub on_failure: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub instances: Option<i64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdmin {
    #[serde(default, deserialize_with = "address")]
    pub listen: Option<String>,
    pub show_keys: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawServer {
    #[serde(default, deserialize_with = "addresses")]
    pub listen: Option<Vec<String>>,
    #[serde(default, deserialize_with = "duration")]
    pub header_read_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub body_read_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub send_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub keepalive_timeout: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub max_header_size: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub max_connections: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub workers: Option<i64>,
    #[serde(default, deserialize_with = "duration")]
    pub drain_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub shutdown_delay: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub max_tunnels: Option<i64>,
    pub trusted_proxies: Option<Vec<String>>,
    pub access_log: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub name: Option<String>,
    #[serde(default, deserialize_with = "url")]
    pub url: Option<String>,
    #[serde(default, deserialize_with = "rate")]
    pub rate: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub connect_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub request_timeout: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub read_timeout: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub max_concurrency: Option<i64>,
    pub host: Option<String>,
    pub ca_file: Option<String>,
    pub on_throttle: Option<String>,
    #[serde(default, deserialize_with = "duration")]
    pub max_pause: Option<String>,
    pub protocol: Option<String>,
    pub forwarded_headers: Option<bool>,
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
    #[serde(default, deserialize_with = "rate")]
    pub rate: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub capacity: Option<i64>,
    pub cost: Option<RawCost>,
    #[serde(default, deserialize_with = "whole")]
    pub burst: Option<i64>,
    #[serde(default, deserialize_with = "duration")]
    pub max_wait: Option<String>,
    pub dry_run: Option<bool>,
    pub ratelimit_headers: Option<bool>,
    pub strip_prefix: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub max_tunnels_per_key: Option<i64>,
}

/// `redis = "redis://..."` or a list of seed nodes.
#[derive(Debug)]
pub struct RawUrls(pub Vec<String>);

impl<'de> Deserialize<'de> for RawUrls {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RawUrls, D::Error> {
        struct UrlsVisitor;

        impl<'de> Visitor<'de> for UrlsVisitor {
            type Value = RawUrls;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a URL such as \"redis://127.0.0.1:6379\", or a list of them")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawUrls, E> {
                Ok(RawUrls(vec![v.to_owned()]))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawUrls, A::Error> {
                let mut out = Vec::new();
                while let Some(UrlText(u)) = seq.next_element()? {
                    out.push(u);
                }
                Ok(RawUrls(out))
            }
        }

        d.deserialize_any(UrlsVisitor)
    }
}

struct UrlText(String);

impl<'de> Deserialize<'de> for UrlText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<UrlText, D::Error> {
        d.deserialize_str(Text("a URL such as \"redis://127.0.0.1:6379\""))
            .map(UrlText)
    }
}

/// `key = "ip"` or `key = ["header:X-Tenant", "ip"]`.
#[derive(Debug)]
pub enum RawKey {
    One(String),
    Composite(Vec<String>),
}

/// `cost = 5` or `cost = { header = "X-Cost", default = 1, max = 100 }`.
#[derive(Debug)]
pub enum RawCost {
    Fixed(i64),
    Header(RawCostHeader),
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCostHeader {
    pub header: Option<String>,
    #[serde(default, deserialize_with = "whole")]
    pub default: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
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
    #[serde(default, deserialize_with = "whole")]
    pub max_clients: Option<i64>,
    #[serde(default, deserialize_with = "whole")]
    pub max_queued: Option<i64>,
    #[serde(default, deserialize_with = "size")]
    pub max_staged_body: Option<RawSize>,
    #[serde(default, deserialize_with = "size")]
    pub max_staged_bytes: Option<RawSize>,
}

/// A size: a whole number of bytes, or text with a unit such as "1MiB".
#[derive(Debug, Clone)]
pub enum RawSize {
    Bytes(i64),
    Text(String),
}

// === parse ===

/// Parse TOML text; a syntax or type error becomes one [`Problem`] with its
/// line and key path.
pub fn parse(text: &str) -> Result<RawConfig, Problem> {
    toml::from_str(text).map_err(|e| {
        // Quote the way validation messages do ('rat', not `rat`); the
        // message is one line, without toml's multi-line source snippet.
        let mut message = e
            .message()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .replace('`', "'");
        match e.span() {
            Some(span) => {
                let at = span.start.min(text.len());
                if message == "duplicate key"
                    && let Some(key) = text.get(span).map(str::trim).filter(|k| !k.is_empty())
                {
                    message = format!("duplicate key '{key}'");
                }
                Problem {
                    line: Some(
                        text.as_bytes()[..at]
                            .iter()
                            .filter(|&&b| b == b'\n')
                            .count()
                            + 1,
                    ),
                    path: locate(text, at),
                    message,
                }
            }
            None => Problem {
                line: None,
                path: String::new(),
                message,
            },
        }
    })
}

/// One step of a key path: a key, or an element of an array (with the
/// element's `name`, when it is a table that has one).
#[derive(Clone)]
enum Step {
    Key(String),
    Index(usize, Option<String>),
}

/// The key path of the value at byte `offset`, found by walking the parsed
/// document (recovering past syntax errors) and its spans.
///
/// An offset on a value names that value; one on a key (an unknown field)
/// names the table the key sits in; one elsewhere names the table whose
/// header comes last before it. A syntax error may sit where the recovered
/// document has nothing, so the line itself fills in: a `[header]` line
/// names that table, a `key = ...` line adds its key.
fn locate(text: &str, offset: usize) -> String {
    let (doc, errors) = DeTable::parse_recoverable(text);
    let mut walk = Walk {
        text,
        offset,
        path: Vec::new(),
        header: None,
    };
    let hit = walk.table(doc.get_ref());
    let mut path = match hit {
        Some(_) => walk.path,
        None => walk.header.map(|(_, p)| p).unwrap_or_default(),
    };
    if errors.is_empty() || hit == Some(Hit::Value) {
        return render(&path);
    }
    // Byte-wise, so that an offset inside a character cannot panic.
    let line_start = text.as_bytes()[..offset]
        .iter()
        .rposition(|&b| b == b'\n')
        .map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next().unwrap_or_default().trim();
    if let Some(header) = line.strip_prefix('[') {
        let name = header.trim_start_matches('[').split(']').next();
        return name.unwrap_or_default().trim().to_owned();
    }
    if let Some((key, _)) = text
        .get(line_start..offset)
        .and_then(|before| before.split_once('='))
    {
        let key = key.trim();
        if !key.is_empty() && !key.starts_with('#') {
            path.push(Step::Key(key.to_owned()));
        }
    }
    render(&path)
}

/// Where the offset was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hit {
    /// On a key: the path names the table it sits in.
    Key,
    /// On a value (or a table's header): the path names it.
    Value,
}

struct Walk<'t> {
    text: &'t str,
    offset: usize,
    path: Vec<Step>,
    /// The last `[table]` / `[[table]]` header starting at or before the
    /// offset, and its path.
    header: Option<(usize, Vec<Step>)>,
}

impl Walk<'_> {
    /// Where in this table the offset lies, if it does; `self.path` then
    /// names it.
    fn table(&mut self, table: &DeTable<'_>) -> Option<Hit> {
        for (key, value) in table.iter() {
            if key.span().contains(&self.offset) {
                return Some(Hit::Key);
            }
            self.path.push(Step::Key(key.get_ref().to_string()));
            if let Some(hit) = self.value(value) {
                return Some(hit);
            }
            self.path.pop();
        }
        None
    }

    /// Where in this value the offset lies, if it does; `self.path` then
    /// names it. Children are searched even when the value's own span does
    /// not hold the offset: a header table's span is its header only, not
    /// the keys under it.
    fn value(&mut self, value: &Spanned<DeValue<'_>>) -> Option<Hit> {
        let span = value.span();
        let here = span.contains(&self.offset).then_some(Hit::Value);
        match value.get_ref() {
            DeValue::Table(table) => {
                self.note_header(span);
                self.table(table).or(here)
            }
            DeValue::Array(array) => {
                for (i, element) in array.iter().enumerate() {
                    self.path.push(Step::Index(i, name_of(element)));
                    if let Some(hit) = self.value(element) {
                        return Some(hit);
                    }
                    self.path.pop();
                }
                here
            }
            _ => here,
        }
    }

    fn note_header(&mut self, span: Range<usize>) {
        let is_header = self
            .text
            .get(span.clone())
            .is_some_and(|s| s.starts_with('['));
        let later = self
            .header
            .as_ref()
            .is_none_or(|(start, _)| span.start >= *start);
        if is_header && later && span.start <= self.offset {
            self.header = Some((span.start, self.path.clone()));
        }
    }
}

/// The `name` of an array element that is a table, if it has one.
fn name_of(element: &Spanned<DeValue<'_>>) -> Option<String> {
    let DeValue::Table(table) = element.get_ref() else {
        return None;
    };
    table
        .iter()
        .find(|(k, _)| k.get_ref() == "name")
        .and_then(|(_, v)| match v.get_ref() {
            DeValue::String(s) if !s.trim().is_empty() => Some(s.to_string()),
            _ => None,
        })
}

/// `server.listen[1]`, `route 'api': capacity`, `route[2]: match.path`:
/// the same names validation uses.
fn render(path: &[Step]) -> String {
    let mut out = String::new();
    let mut after_element = false;
    for step in path {
        match step {
            Step::Key(k) => {
                if after_element {
                    out.push_str(": ");
                } else if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
                after_element = false;
            }
            Step::Index(_, Some(name)) => {
                out.push_str(&format!(" '{name}'"));
                after_element = true;
            }
            Step::Index(i, None) => {
                out.push_str(&format!("[{i}]"));
                after_element = true;
            }
        }
    }
    out
}

// === field types ===

/// A string, described by what it should hold when it is something else.
struct Text(&'static str);

impl Visitor<'_> for Text {
    type Value = String;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<String, E> {
        Ok(v.to_owned())
    }
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_str(Text("a duration such as \"2s\" or \"250ms\""))
        .map(Some)
}

fn rate<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_str(Text("a rate such as \"5/s\" or \"300/m\""))
        .map(Some)
}

fn url<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_str(Text("a URL such as \"http://127.0.0.1:9000\""))
        .map(Some)
}

fn smtp_url<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_str(Text("a URL such as \"smtp://127.0.0.1:2587\""))
        .map(Some)
}

fn address<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    d.deserialize_str(Text("an address with a port such as \"127.0.0.1:9090\""))
        .map(Some)
}

/// A list of socket addresses.
struct Addresses;

impl<'de> Visitor<'de> for Addresses {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of addresses such as [\"127.0.0.1:8080\"]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
        let mut out = Vec::new();
        while let Some(Address(a)) = seq.next_element()? {
            out.push(a);
        }
        Ok(out)
    }
}

struct Address(String);

impl<'de> Deserialize<'de> for Address {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Address, D::Error> {
        d.deserialize_str(Text("an address with a port such as \"127.0.0.1:8080\""))
            .map(Address)
    }
}

fn addresses<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<String>>, D::Error> {
    d.deserialize_seq(Addresses).map(Some)
}

/// A TOML integer; its range is checked by validation, which knows the
/// field's bounds. Floats and strings are refused here.
struct Whole;

impl Visitor<'_> for Whole {
    type Value = i64;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a whole number")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<i64, E> {
        Ok(v)
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<i64, E> {
        i64::try_from(v).map_err(|_| E::custom(format!("{v} is too large")))
    }

    fn visit_i128<E: de::Error>(self, v: i128) -> Result<i64, E> {
        i64::try_from(v).map_err(|_| E::custom(format!("{v} is out of range")))
    }

    fn visit_u128<E: de::Error>(self, v: u128) -> Result<i64, E> {
        i64::try_from(v).map_err(|_| E::custom(format!("{v} is too large")))
    }
}

fn whole<'de, D: Deserializer<'de>>(d: D) -> Result<Option<i64>, D::Error> {
    d.deserialize_i64(Whole).map(Some)
}

/// A size in bytes: a whole number, or a string with a unit.
struct Size;

impl Visitor<'_> for Size {
    type Value = RawSize;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a size such as \"1MiB\", \"512kB\" or a whole number of bytes")
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawSize, E> {
        Ok(RawSize::Bytes(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawSize, E> {
        i64::try_from(v)
            .map(RawSize::Bytes)
            .map_err(|_| E::custom(format!("{v} is too large")))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<RawSize, E> {
        Ok(RawSize::Text(v.to_owned()))
    }
}

fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<RawSize>, D::Error> {
    d.deserialize_any(Size).map(Some)
}

impl<'de> Deserialize<'de> for RawKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RawKey, D::Error> {
        struct KeyVisitor;

        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = RawKey;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "a key such as \"ip\", \"global\" or \"header:X-Client\", or a list of them",
                )
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawKey, E> {
                Ok(RawKey::One(v.to_owned()))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RawKey, A::Error> {
                let mut parts = Vec::new();
                while let Some(KeyPartText(p)) = seq.next_element()? {
                    parts.push(p);
                }
                Ok(RawKey::Composite(parts))
            }
        }

        d.deserialize_any(KeyVisitor)
    }
}

struct KeyPartText(String);

impl<'de> Deserialize<'de> for KeyPartText {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<KeyPartText, D::Error> {
        d.deserialize_str(Text("a key such as \"ip\" or \"header:X-Client\""))
            .map(KeyPartText)
    }
}

impl<'de> Deserialize<'de> for RawCost {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<RawCost, D::Error> {
        struct CostVisitor;

        impl<'de> Visitor<'de> for CostVisitor {
            type Value = RawCost;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a whole number, or a table such as { header = \"X-Cost\", max = 100 }")
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<RawCost, E> {
                Ok(RawCost::Fixed(v))
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<RawCost, E> {
                Whole.visit_u64(v).map(RawCost::Fixed)
            }

            fn visit_i128<E: de::Error>(self, v: i128) -> Result<RawCost, E> {
                Whole.visit_i128(v).map(RawCost::Fixed)
            }

            fn visit_u128<E: de::Error>(self, v: u128) -> Result<RawCost, E> {
                Whole.visit_u128(v).map(RawCost::Fixed)
            }

            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<RawCost, A::Error> {
                RawCostHeader::deserialize(MapAccessDeserializer::new(map)).map(RawCost::Header)
            }
        }

        d.deserialize_any(CostVisitor)
    }
}
