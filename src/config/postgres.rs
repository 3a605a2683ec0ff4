//! `[cluster] postgres = "postgres://user@host:port/db?sslmode=..."`: the
//! URL as libpq users write it. tokio-postgres parses the connection
//! parameters; the ones it does not know (`sslmode=verify-ca`,
//! `verify-full`, `sslrootcert`, `passfile`) are taken out here first and
//! applied by sluice with the meaning libpq gives them.

use std::fmt;
use std::path::PathBuf;

use percent_encoding::percent_decode_str;

/// libpq's `sslmode`, all six (`allow` is treated as `prefer`: sluice
/// never falls back from TLS to plain text after a failed handshake).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// TLS when the server offers it, certificate not checked (libpq's
    /// default).
    Prefer,
    /// TLS always; the certificate is checked against `sslrootcert`
    /// when one is given (as libpq does), else not checked.
    Require,
    /// TLS, the chain checked, not the host name.
    VerifyCa,
    /// TLS, the chain and the host name checked.
    VerifyFull,
}

/// A parsed `postgres://` URL.
#[derive(Clone)]
pub struct Target {
    pub pg: tokio_postgres::Config,
    pub sslmode: SslMode,
    /// CA certificates (PEM) for the verify modes; the system's roots
    /// when absent.
    pub root_cert: Option<PathBuf>,
    /// The URL's `passfile`.
    pub passfile: Option<PathBuf>,
}

/// Every parameter (what a reload compares), the password left out
/// (tokio-postgres redacts it): [`Target::password_digest`] tells a
/// changed one.
impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("pg", &self.pg)
            .field("sslmode", &self.sslmode)
            .field("root_cert", &self.root_cert)
            .field("passfile", &self.passfile)
            .finish()
    }
}

impl Target {
    /// A digest of the URL's password, to tell a changed one without
    /// keeping or showing it.
    pub fn password_digest(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.pg.get_password().hash(&mut h);
        h.finish()
    }
}

/// `user@host:port/db`, never the password.
impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let user = self.pg.get_user().unwrap_or("");
        let host = match self.pg.get_hosts().first() {
            Some(tokio_postgres::config::Host::Tcp(h)) => h.clone(),
            Some(tokio_postgres::config::Host::Unix(p)) => p.display().to_string(),
            None => "localhost".to_owned(),
        };
        let port = self.pg.get_ports().first().copied().unwrap_or(5432);
        let db = self.pg.get_dbname().unwrap_or(user);
        write!(f, "postgres://{user}@{host}:{port}/{db}")
    }
}

/// Parse a `postgres://` or `postgresql://` URL.
pub fn parse(url: &str) -> Result<Target, String> {
    if !url.starts_with("postgres://") && !url.starts_with("postgresql://") {
        return Err(format!(
            "must be a URL starting with postgres:// or postgresql:// (got '{}')",
            url.split('@').next_back().unwrap_or("")
        ));
    }
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut kept = Vec::new();
    let (mut sslmode, mut root_cert, mut passfile) = (SslMode::Prefer, None, None);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode_str(v).decode_utf8_lossy().into_owned();
        match k {
            "sslmode" => {
                sslmode = match value.as_str() {
                    "disable" => SslMode::Disable,
                    "allow" | "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    other => {
                        return Err(format!(
                            "sslmode '{other}' must be disable, allow, prefer, require, verify-ca or verify-full"
                        ));
                    }
                }
            }
            "sslrootcert" => root_cert = Some(PathBuf::from(value)),
            "passfile" => passfile = Some(PathBuf::from(value)),
            _ => kept.push(pair),
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    let mut pg: tokio_postgres::Config = rest.parse().map_err(|e| {
        format!("is not a PostgreSQL URL that sluice understands ({e}); for example postgres://sluice@127.0.0.1:5432/sluice?sslmode=verify-full")
    })?;
    pg.ssl_mode(match sslmode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    if pg.get_hosts().is_empty() {
        pg.host("localhost");
    }
    if pg.get_user().is_none() {
        return Err("names no user: write it as postgres://USER@host/db".to_owned());
    }
    if pg.get_application_name().is_none() {
        pg.application_name("sluice");
    }
    Ok(Target {
        pg,
        sslmode,
        root_cert,
        passfile,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a reload compares tells every parameter apart (a changed
    /// sslmode used to be taken as no change), and never shows the
    /// password.
    #[test]
    fn a_reload_sees_every_changed_parameter_and_no_password() {
        let t = |url: &str| parse(url).expect("parses");
        let base = t("postgres://app:secret@db:5432/shape?sslmode=prefer");
        for changed in [
            "postgres://app:secret@db:5432/shape?sslmode=verify-full",
            "postgres://app:secret@db:5432/shape?sslmode=prefer&connect_timeout=3",
            "postgres://app:secret@db,db2:5432/shape?sslmode=prefer",
            "postgres://app:secret@db:5432/shape?sslmode=prefer&passfile=%2Fp",
        ] {
            assert_ne!(
                format!("{base:?}"),
                format!("{:?}", t(changed)),
                "{changed}"
            );
        }
        let other = t("postgres://app:hunter2@db:5432/shape?sslmode=prefer");
        assert_eq!(format!("{base:?}"), format!("{other:?}"));
        assert_ne!(base.password_digest(), other.password_digest());
        assert!(!format!("{base:?}").contains("secret"));
    }

    #[test]
    fn libpq_parameters_are_taken_out_and_the_rest_parsed() {
        let t = parse(
            "postgres://app:secret@db.example:6543/shape?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&connect_timeout=3",
        )
        .expect("parses");
        assert_eq!(t.sslmode, SslMode::VerifyFull);
        assert_eq!(t.root_cert, Some(PathBuf::from("/etc/ca.pem")));
        assert_eq!(t.pg.get_user(), Some("app"));
        assert_eq!(t.pg.get_password(), Some(&b"secret"[..]));
        assert_eq!(t.pg.get_ports(), &[6543]);
        assert_eq!(
            t.pg.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(3))
        );
        assert_eq!(t.to_string(), "postgres://app@db.example:6543/shape");
        assert!(!format!("{t:?}").contains("secret"));
    }

    #[test]
    fn wrong_urls_are_refused_with_the_reason() {
        assert!(parse("redis://x").unwrap_err().contains("postgres://"));
        assert!(
            parse("postgres://u@h/db?sslmode=sometimes")
                .unwrap_err()
                .contains("sslmode")
        );
        assert!(parse("postgres://h/db").unwrap_err().contains("no user"));
        assert!(
            parse("postgres://u@h/db?bogus=1")
                .unwrap_err()
                .contains("not a PostgreSQL URL")
        );
        assert_eq!(
            parse("postgresql://u@h/db").map(|t| t.sslmode),
            Ok(SslMode::Prefer)
        );
    }
}
