//! `[[smtp_upstream]]` and `[[smtp]]`: the mail relay's configuration,
//! validated like the rest (every problem, each with its field path).
//!
//! Secrets never live in the TOML: an upstream's password and the inbound
//! credentials are read from files, which must not be readable by everyone;
//! they are read when the config is loaded, so `sluice check` proves them.

use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use ipnet::IpNet;
use rustls::pki_types::CertificateDer;

use super::raw::{RawKey, RawSize, RawSmtp, RawSmtpUpstream};
use super::{MAX_CONNECTIONS, MAX_TIMEOUT, Validator, element_path};
use crate::shaper::Rate;

const DEFAULT_SMTP_MAX_CONNECTIONS: usize = 4;
const MAX_SMTP_UPSTREAM_CONNECTIONS: usize = 10_000;
const DEFAULT_MAX_MESSAGES_PER_CONNECTION: u32 = 100;
const MAX_MESSAGES_PER_CONNECTION: usize = 1_000_000;
const DEFAULT_SMTP_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_RELAY_TIMEOUT: Duration = Duration::from_secs(120);
const DEFAULT_SMTP_UPSTREAM_IDLE: Duration = Duration::from_secs(60);
const DEFAULT_THROTTLE_PAUSE: Duration = Duration::from_secs(60);
const DEFAULT_SMTP_MAX_WAIT: Duration = Duration::from_secs(300);
/// A client waits at least 10 minutes for the reply to its end of data
/// (RFC 5321 section 4.5.3.2.6); every held message is answered within
/// `max_wait + relay_timeout`, which must leave a minute of that.
pub const MAX_HOLD: Duration = Duration::from_secs(540);
const DEFAULT_MAX_MESSAGE_SIZE: usize = 10_240_000;
const MAX_MESSAGE_SIZE: u64 = 1 << 30;
/// RFC 5321 section 4.5.3.1.8: a server takes at least 100 recipients.
/// Fewer may be set to match an upstream that takes fewer in one
/// transaction (Amazon SES: 50): relayed all or nothing, a message with
/// more would be refused whole on every retry.
const DEFAULT_MAX_RECIPIENTS: usize = 100;
const MAX_RECIPIENTS: usize = 100_000;
const DEFAULT_LISTENER_CONNECTIONS: usize = 1_000;
/// Postfix's `smtpd_client_connection_count_limit` (50).
const DEFAULT_CONNECTIONS_PER_IP: usize = 50;
/// RFC 5321 section 4.5.3.2.7: a server waits at least 5 minutes for the
/// next command.
const DEFAULT_SMTP_IDLE: Duration = Duration::from_secs(300);
/// Who may relay without AUTH by default: this machine.
const LOOPBACK: [IpNet; 2] = [
    IpNet::new_assert(
        std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 0)),
        8,
    ),
    IpNet::new_assert(std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST), 128),
];

/// A secret read from a file; never shown.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The users inbound AUTH accepts (`auth_file`: `user:password` lines).
#[derive(Clone, Default)]
pub struct Credentials(HashMap<String, Secret>);

impl Credentials {
    /// Whether `user` has `password`; the comparison takes the same time
    /// wherever the first difference is.
    pub fn check(&self, user: &str, password: &[u8]) -> bool {
        let Some(known) = self.0.get(user) else {
            return false;
        };
        let known = known.0.as_bytes();
        let mut diff = known.len() ^ password.len();
        for (i, &b) in password.iter().enumerate() {
            diff |= usize::from(b ^ known.get(i).copied().unwrap_or(0));
        }
        diff == 0
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether `user` is one of them.
    pub fn knows(&self, user: &str) -> bool {
        self.0.contains_key(user)
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credentials({} users)", self.0.len())
    }
}

/// How sluice talks TLS to an SMTP upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpTls {
    /// STARTTLS, required: an upstream that does not offer it is an error.
    StartTls,
    /// TLS from the first byte (`smtps://`, port 465).
    Implicit,
    /// Plain text (a relay on the same machine or a private network).
    None,
}

/// `[[smtp_upstream]]`: a relay sluice hands mail to.
#[derive(Debug, Clone, PartialEq)]
pub struct SmtpUpstream {
    pub name: String,
    pub host: String,
    pub port: u16,
    pub tls: SmtpTls,
    /// Certificates that verify the upstream instead of the system roots.
    pub ca: Option<Vec<CertificateDer<'static>>>,
    /// AUTH user and password.
    pub auth: Option<(String, Secret)>,
    /// A cap over every listener relaying here, shared fairly.
    pub rate: Option<Rate>,
    pub max_connections: usize,
    pub max_messages_per_connection: u32,
    /// TCP connect, greeting, EHLO, STARTTLS and AUTH together.
    pub connect_timeout: Duration,
    /// One message's relay, from its departure to the upstream's reply.
    pub relay_timeout: Duration,
    /// How long an unused session stays open.
    pub idle_timeout: Duration,
    /// How long a throttling reply pauses releases here.
    pub throttle_pause: Duration,
    /// The name sluice gives in EHLO.
    pub helo_name: String,
}

/// One part of an SMTP listener's client key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpKeyPart {
    Global,
    /// The client's IP address.
    Ip,
    /// The MAIL FROM address.
    Sender,
    /// The MAIL FROM address's domain.
    SenderDomain,
    /// The user the client authenticated as.
    Auth,
}

/// What a message costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmtpCost {
    /// 1 per message; decided at MAIL FROM.
    Message,
    /// 1 per accepted recipient (providers' quotas count recipients);
    /// decided at DATA, the first moment the count is known.
    Recipients,
}

/// `[[smtp]]`: one SMTP listener with its shaping policy.
#[derive(Debug, Clone)]
pub struct SmtpListener {
    pub name: String,
    pub listen: Vec<SocketAddr>,
    /// Index into [`super::Config::smtp_upstreams`].
    pub upstream: usize,
    pub key: Vec<SmtpKeyPart>,
    pub rate: Rate,
    pub capacity: u32,
    pub burst: u32,
    pub cost: SmtpCost,
    pub max_wait: Duration,
    pub max_message_size: usize,
    pub max_recipients: usize,
    pub max_connections: usize,
    /// Sessions open at once from one client address outside
    /// `allow_from` (to every SMTP listener together).
    pub max_connections_per_ip: usize,
    /// How long a client may stay silent, or take over one command line;
    /// a message's text must then come at 500 bytes/s on average.
    pub idle_timeout: Duration,
    /// The greeting's and EHLO reply's name.
    pub hostname: String,
    /// STARTTLS inbound, when a certificate and key are configured.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Refuse MAIL before STARTTLS.
    pub require_tls: bool,
    /// Inbound AUTH (then required for every message).
    pub auth: Option<Arc<Credentials>>,
    /// Who may relay without AUTH.
    pub allow_from: Vec<IpNet>,
}

impl SmtpListener {
    /// Whether `ip` may relay without AUTH (`allow_from`).
    pub fn allows(&self, ip: std::net::IpAddr) -> bool {
        self.allow_from.iter().any(|n| n.contains(&ip))
    }
}

/// The machine's name, for greetings and EHLO.
fn system_hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// A name a greeting or EHLO may carry: a domain of letters, digits, '-'
/// and '.', or an address literal (RFC 5321 4.1.3: `[192.0.2.1]`,
/// `[IPv6:2001:db8::1]`).
fn valid_hostname(name: &str) -> bool {
    let literal = |inner: &str| match inner.get(..5) {
        Some(tag) if tag.eq_ignore_ascii_case("IPv6:") => inner
            .get(5..)
            .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok()),
        _ => inner.parse::<std::net::Ipv4Addr>().is_ok(),
    };
    !name.is_empty()
        && name.len() <= 255
        && (name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-.".contains(c))
            || name
                .strip_prefix('[')
                .and_then(|n| n.strip_suffix(']'))
                .is_some_and(literal))
}

impl Validator {
    /// A secret file's contents: readable, not by everyone.
    pub(super) fn secret_file(&mut self, path: &str, field: &str, file: &str) -> Option<String> {
        if !self.kept_secret(path, field, file) {
            return None;
        }
        match std::fs::read_to_string(file) {
            Ok(text) => Some(text),
            Err(e) => {
                self.problem(path, format!("{field} '{file}': cannot read: {e}"));
                None
            }
        }
    }

    /// Whether `file`, which holds a secret, is not readable by everyone
    /// (a problem when it is, or when it cannot be read). A file whose
    /// mode lets everyone read it inside a directory that not everyone
    /// may enter is kept (certbot's older `archive/`: keys 0644 in a 0700
    /// directory).
    pub(super) fn kept_secret(&mut self, path: &str, field: &str, file: &str) -> bool {
        use std::os::unix::fs::PermissionsExt;
        let everyone_enters = |file: &str| {
            std::fs::canonicalize(file).is_ok_and(|real| {
                real.ancestors().skip(1).all(|dir| {
                    std::fs::metadata(dir).is_ok_and(|m| m.permissions().mode() & 0o001 != 0)
                })
            })
        };
        match std::fs::metadata(file) {
            Ok(meta) if meta.permissions().mode() & 0o004 != 0 && everyone_enters(file) => {
                self.problem(
                    path,
                    format!("{field} '{file}': is readable by everyone; chmod o-r it"),
                );
                false
            }
            Ok(_) => true,
            Err(e) => {
                self.problem(path, format!("{field} '{file}': cannot read: {e}"));
                false
            }
        }
    }

    pub(super) fn smtp_upstream(
        &mut self,
        index: usize,
        raw: RawSmtpUpstream,
    ) -> Option<SmtpUpstream> {
        let path = element_path("smtp_upstream", index, raw.name.as_deref());
        let name = self.upstream_name(&path, raw.name);
        let target = match raw.url {
            None => {
                self.problem(&path, "url is required, such as smtp://127.0.0.1:2587");
                None
            }
            Some(text) => self.smtp_url(&path, &text),
        };
        let tls = match (raw.tls.as_deref(), target.as_ref()) {
            (None, Some((_, _, true))) | (Some("tls"), _) => Some(SmtpTls::Implicit),
            (Some("starttls"), Some((_, _, true))) => {
                self.problem(
                    &path,
                    "tls = \"starttls\" does not go with smtps:// (TLS from the first byte)",
                );
                None
            }
            (None | Some("starttls"), _) => Some(SmtpTls::StartTls),
            (Some("none"), Some((_, _, true))) => {
                self.problem(&path, "tls = \"none\" does not go with smtps://");
                None
            }
            (Some("none"), _) => Some(SmtpTls::None),
            (Some(other), _) => {
                self.problem(
                    &path,
                    format!("tls '{other}' must be \"starttls\", \"tls\" or \"none\""),
                );
                None
            }
        };
        let ca = match raw.ca_file {
            None => Some(None),
            Some(file) => self.ca_file(&path, "ca_file", &file).map(Some),
        };
        let auth = match (raw.username, raw.password_file) {
            (None, None) => Some(None),
            (Some(user), Some(file)) if !user.is_empty() => self
                .secret_file(&path, "password_file", &file)
                .map(|p| p.trim_end_matches(['\r', '\n']).to_owned())
                .and_then(|p| {
                    if p.is_empty() {
                        self.problem(&path, format!("password_file '{file}': is empty"));
                        None
                    } else {
                        Some(Some((user, Secret(p))))
                    }
                }),
            (Some(_), Some(_)) => {
                self.problem(&path, "username must not be empty");
                None
            }
            (Some(_), None) => {
                self.problem(
                    &path,
                    "username needs password_file (the password is never written in the config)",
                );
                None
            }
            (None, Some(_)) => {
                self.problem(&path, "password_file needs username");
                None
            }
        };
        if tls == Some(SmtpTls::None) && auth.as_ref().is_some_and(Option::is_some) {
            self.problem(
                &path,
                "AUTH over tls = \"none\" would send the password in clear text; use starttls or tls",
            );
        }
        let rate = self.optional_rate(&path, raw.rate);
        let max_connections = raw
            .max_connections
            .map_or(DEFAULT_SMTP_MAX_CONNECTIONS, |n| {
                self.bounded(
                    &format!("{path}: max_connections"),
                    n,
                    1,
                    MAX_SMTP_UPSTREAM_CONNECTIONS,
                )
            });
        let max_messages = raw.max_messages_per_connection.map_or(
            DEFAULT_MAX_MESSAGES_PER_CONNECTION as usize,
            |n| {
                self.bounded(
                    &format!("{path}: max_messages_per_connection"),
                    n,
                    1,
                    MAX_MESSAGES_PER_CONNECTION,
                )
            },
        );
        let connect_timeout = self.duration(
            &format!("{path}: connect_timeout"),
            raw.connect_timeout.as_deref(),
            DEFAULT_SMTP_CONNECT_TIMEOUT,
        );
        let relay_timeout = self.duration_up_to(
            &format!("{path}: relay_timeout"),
            raw.relay_timeout.as_deref(),
            DEFAULT_RELAY_TIMEOUT,
            MAX_HOLD,
        );
        let idle_timeout = self.duration(
            &format!("{path}: idle_timeout"),
            raw.idle_timeout.as_deref(),
            DEFAULT_SMTP_UPSTREAM_IDLE,
        );
        let throttle_pause = self.duration(
            &format!("{path}: throttle_pause"),
            raw.throttle_pause.as_deref(),
            DEFAULT_THROTTLE_PAUSE,
        );
        let helo_name = match raw.helo_name {
            None => Some(system_hostname()),
            Some(h) if valid_hostname(&h) => Some(h),
            Some(h) => {
                self.problem(&path, format!("helo_name '{h}' is not a host name"));
                None
            }
        };
        let (host, port, _) = target?;
        Some(SmtpUpstream {
            name: name?,
            host,
            port,
            tls: tls?,
            ca: ca?,
            auth: auth?,
            rate: rate?,
            max_connections,
            max_messages_per_connection: u32::try_from(max_messages).unwrap_or(u32::MAX),
            connect_timeout: connect_timeout?,
            relay_timeout: relay_timeout?,
            idle_timeout: idle_timeout?,
            throttle_pause: throttle_pause?,
            helo_name: helo_name?,
        })
    }

    /// `smtp://host:port` or `smtps://host:port`: host, port, and whether
    /// TLS starts at once. The port defaults to 25 (465 for smtps).
    fn smtp_url(&mut self, path: &str, text: &str) -> Option<(String, u16, bool)> {
        let (implicit, rest) = if let Some(r) = text.strip_prefix("smtps://") {
            (true, r)
        } else if let Some(r) = text.strip_prefix("smtp://") {
            (false, r)
        } else {
            self.problem(
                path,
                format!("url '{text}': must start with smtp:// or smtps://"),
            );
            return None;
        };
        let authority = rest.strip_suffix('/').unwrap_or(rest);
        if authority.contains(['/', '@', '?', '#']) || authority.is_empty() {
            self.problem(
                path,
                format!("url '{text}': must be smtp://host:port, with no user, path or query"),
            );
            return None;
        }
        let default_port = if implicit { 465 } else { 25 };
        // `host`, `host:port`, `[IPv6]` or `[IPv6]:port`.
        let (host, port) = match authority.strip_prefix('[') {
            Some(v6) => match v6.split_once(']') {
                Some((ip, rest))
                    if ip.parse::<std::net::Ipv6Addr>().is_ok()
                        && (rest.is_empty() || rest.starts_with(':')) =>
                {
                    (ip, rest.strip_prefix(':'))
                }
                _ => {
                    let why = "an IPv6 address goes in brackets, then an optional :port";
                    self.problem(path, format!("url '{text}': {why}"));
                    return None;
                }
            },
            None => match authority.split_once(':') {
                Some(_) if authority.matches(':').count() > 1 => {
                    let why = "an IPv6 address goes in brackets ([2001:db8::1]:25)";
                    self.problem(path, format!("url '{text}': {why}"));
                    return None;
                }
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            },
        };
        let port = match port {
            None => default_port,
            Some(p) => match p.parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => {
                    self.problem(
                        path,
                        format!("url '{text}': '{p}' is not a port (1 to 65535)"),
                    );
                    return None;
                }
            },
        };
        if host.is_empty() {
            self.problem(path, format!("url '{text}': a host is required"));
            return None;
        }
        // A name to resolve: letters, digits, '-', '.', and '_' (Docker's
        // service names have it, and resolvers take it).
        let name = |h: &str| {
            h.chars()
                .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
        };
        if host.parse::<std::net::IpAddr>().is_err() && !name(host) {
            self.problem(
                path,
                format!("url '{text}': '{host}' is not a host name or address"),
            );
            return None;
        }
        Some((host.to_owned(), port, implicit))
    }

    pub(super) fn smtp_listener(
        &mut self,
        index: usize,
        raw: RawSmtp,
        upstreams: &[Option<String>],
    ) -> Option<SmtpListener> {
        let path = element_path("smtp", index, raw.name.as_deref());
        let name = self.policy_name(&path, raw.name);
        let listen = match raw.listen {
            None => {
                self.problem(&path, "listen is required, such as [\"127.0.0.1:2525\"]");
                None
            }
            Some(l) if l.is_empty() => {
                self.problem(&path, "listen: at least one address is required");
                None
            }
            Some(l) => self.addresses(&format!("{path}: listen"), &l),
        };
        let upstream = self.upstream_ref(&path, raw.upstream, upstreams);
        let auth = match raw.auth_file {
            None => Some(None),
            Some(file) => self.auth_file(&path, &file).map(|c| Some(Arc::new(c))),
        };
        let key = match raw.key {
            None => {
                self.problem(
                    &path,
                    "key is required: \"global\", \"ip\", \"sender\", \"sender_domain\", \"auth\" or a list of them",
                );
                None
            }
            Some(RawKey::One(text)) => self.smtp_key(&path, &text).map(|p| vec![p]),
            Some(RawKey::Composite(list)) if list.is_empty() => {
                self.problem(&path, "key list must not be empty");
                None
            }
            Some(RawKey::Composite(list)) => list
                .iter()
                .map(|t| self.smtp_key(&path, t))
                .collect::<Vec<_>>()
                .into_iter()
                .collect::<Option<Vec<_>>>(),
        };
        if key.as_ref().is_some_and(|k| k.contains(&SmtpKeyPart::Auth))
            && auth.as_ref().is_some_and(Option::is_none)
        {
            self.problem(
                &path,
                "key 'auth' needs auth_file (clients must authenticate to have a user)",
            );
        }
        let (rate, capacity, burst) = self.shape(&path, raw.rate, raw.capacity, raw.burst);
        let cost = match raw.cost.as_deref() {
            None | Some("message") => Some(SmtpCost::Message),
            Some("recipients") => Some(SmtpCost::Recipients),
            Some(other) => {
                self.problem(
                    &path,
                    format!("cost '{other}' must be \"message\" or \"recipients\""),
                );
                None
            }
        };
        let max_wait = self.duration_up_to(
            &format!("{path}: max_wait"),
            raw.max_wait.as_deref(),
            DEFAULT_SMTP_MAX_WAIT,
            MAX_TIMEOUT,
        );
        let max_message_size = self.message_size(&path, raw.max_message_size);
        let max_recipients = raw.max_recipients.map_or(DEFAULT_MAX_RECIPIENTS, |n| {
            self.bounded(&format!("{path}: max_recipients"), n, 1, MAX_RECIPIENTS)
        });
        if let (Some(r), Some(SmtpCost::Recipients)) = (rate, &cost) {
            let most = u32::try_from(max_recipients).unwrap_or(u32::MAX);
            self.within_span(&path, &format!("cost (max_recipients) {most}"), most, r);
        }
        let max_connections = raw
            .max_connections
            .map_or(DEFAULT_LISTENER_CONNECTIONS, |n| {
                self.bounded(&format!("{path}: max_connections"), n, 1, MAX_CONNECTIONS)
            });
        let max_connections_per_ip =
            raw.max_connections_per_ip
                .map_or(DEFAULT_CONNECTIONS_PER_IP, |n| {
                    self.bounded(
                        &format!("{path}: max_connections_per_ip"),
                        n,
                        1,
                        MAX_CONNECTIONS,
                    )
                });
        let idle_timeout = self.duration(
            &format!("{path}: idle_timeout"),
            raw.idle_timeout.as_deref(),
            DEFAULT_SMTP_IDLE,
        );
        let hostname = match raw.hostname {
            None => Some(system_hostname()),
            Some(h) if valid_hostname(&h) => Some(h),
            Some(h) => {
                self.problem(&path, format!("hostname '{h}' is not a host name"));
                None
            }
        };
        let tls = match (raw.tls_cert, raw.tls_key) {
            (None, None) => Some(None),
            (Some(cert), Some(key)) => self.server_tls(&path, &cert, &key).map(Some),
            _ => {
                self.problem(&path, "tls_cert and tls_key go together");
                None
            }
        };
        let require_tls = raw.require_tls.unwrap_or(false);
        if require_tls && tls.as_ref().is_some_and(Option::is_none) {
            self.problem(&path, "require_tls needs tls_cert and tls_key");
        }
        let allow_from = match raw.allow_from {
            None => Some(LOOPBACK.to_vec()),
            Some(list) => {
                let mut nets = Vec::new();
                let mut ok = true;
                for text in list {
                    match text
                        .parse::<IpNet>()
                        .or_else(|_| text.parse::<std::net::IpAddr>().map(IpNet::from))
                    {
                        Ok(net) => nets.push(net),
                        Err(_) => {
                            self.problem(
                                &path,
                                format!("allow_from: '{text}' is not an address or CIDR block"),
                            );
                            ok = false;
                        }
                    }
                }
                ok.then_some(nets)
            }
        };
        Some(SmtpListener {
            name: name?,
            listen: listen?,
            upstream: upstream?,
            key: key?,
            rate: rate?,
            capacity: capacity?,
            burst: burst?,
            cost: cost?,
            max_wait: max_wait?,
            max_message_size: max_message_size?,
            max_recipients,
            max_connections,
            max_connections_per_ip,
            idle_timeout: idle_timeout?,
            hostname: hostname?,
            tls: tls?,
            require_tls,
            auth: auth?,
            allow_from: allow_from?,
        })
    }

    fn smtp_key(&mut self, path: &str, text: &str) -> Option<SmtpKeyPart> {
        match text {
            "global" => Some(SmtpKeyPart::Global),
            "ip" => Some(SmtpKeyPart::Ip),
            "sender" => Some(SmtpKeyPart::Sender),
            "sender_domain" => Some(SmtpKeyPart::SenderDomain),
            "auth" => Some(SmtpKeyPart::Auth),
            other => {
                self.problem(
                    path,
                    format!(
                        "key '{other}': must be \"global\", \"ip\", \"sender\", \"sender_domain\" or \"auth\""
                    ),
                );
                None
            }
        }
    }

    fn message_size(&mut self, path: &str, raw: Option<RawSize>) -> Option<usize> {
        let parsed = match raw {
            None => return Some(DEFAULT_MAX_MESSAGE_SIZE),
            Some(RawSize::Bytes(n)) => u64::try_from(n).map_err(|_| format!("{n} must be >= 1")),
            Some(RawSize::Text(t)) => super::parse_size(&t),
        };
        match parsed {
            Ok(n) if (1024..=MAX_MESSAGE_SIZE).contains(&n) => usize::try_from(n).ok(),
            Ok(n) => {
                self.problem(
                    path,
                    format!("max_message_size: {n} bytes is out of range: 1KiB to 1GiB"),
                );
                None
            }
            Err(e) => {
                self.problem(path, format!("max_message_size: {e}"));
                None
            }
        }
    }

    /// `user:password` lines; `#` starts a comment.
    fn auth_file(&mut self, path: &str, file: &str) -> Option<Credentials> {
        let text = self.secret_file(path, "auth_file", file)?;
        let mut users = HashMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim_end_matches('\r');
            if line.trim().is_empty() || line.trim_start().starts_with('#') {
                continue;
            }
            match line.split_once(':') {
                Some((user, password)) if !user.is_empty() && !password.is_empty() => {
                    users.insert(user.to_owned(), Secret(password.to_owned()));
                }
                _ => {
                    self.problem(
                        path,
                        format!("auth_file '{file}': line {}: must be user:password", n + 1),
                    );
                    return None;
                }
            }
        }
        if users.is_empty() {
            self.problem(path, format!("auth_file '{file}': has no users"));
            return None;
        }
        Some(Credentials(users))
    }

    /// A TLS server config from a PEM certificate chain and key.
    fn server_tls(
        &mut self,
        path: &str,
        cert: &str,
        key: &str,
    ) -> Option<Arc<rustls::ServerConfig>> {
        use rustls::pki_types::PrivateKeyDer;
        use rustls::pki_types::pem::PemObject;
        // The private key is a secret like a password file.
        if !self.kept_secret(path, "tls_key", key) {
            return None;
        }
        let certs = match CertificateDer::pem_file_iter(cert)
            .and_then(|i| i.collect::<Result<Vec<_>, _>>())
        {
            Ok(c) if !c.is_empty() => c,
            Ok(_) => {
                self.problem(path, format!("tls_cert '{cert}': has no PEM certificate"));
                return None;
            }
            Err(e) => {
                self.problem(path, format!("tls_cert '{cert}': {e}"));
                return None;
            }
        };
        let key_der = match PrivateKeyDer::from_pem_file(key) {
            Ok(k) => k,
            Err(e) => {
                self.problem(path, format!("tls_key '{key}': {e}"));
                return None;
            }
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let built = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key_der));
        match built {
            Ok(c) => Some(Arc::new(c)),
            Err(e) => {
                self.problem(path, format!("tls_cert/tls_key: {e}"));
                None
            }
        }
    }

    /// Every held message is answered within `max_wait + relay_timeout`;
    /// that must stay inside the client's own wait.
    pub(super) fn check_holds(&mut self, listeners: &[SmtpListener], upstreams: &[SmtpUpstream]) {
        for l in listeners {
            let Some(up) = upstreams.get(l.upstream) else {
                continue;
            };
            if l.max_wait + up.relay_timeout > MAX_HOLD {
                self.problem(
                    &format!("smtp '{}'", l.name),
                    format!(
                        "max_wait ({}) + the upstream's relay_timeout ({}) must be at most {}: a client waits 10 minutes for its answer (RFC 5321 4.5.3.2.6), and one that gives up retries a message that may have gone",
                        humantime::format_duration(l.max_wait),
                        humantime::format_duration(up.relay_timeout),
                        humantime::format_duration(MAX_HOLD)
                    ),
                );
            }
        }
    }
}
