//! TLS client settings shared by the HTTP and SMTP upstream clients: the
//! system's roots, or a private CA's certificates (`ca_file`). ring only.

use std::sync::Arc;

use tracing::{debug, warn};

/// TLS settings for an https upstream with a private CA: its certificates
/// are the only roots.
pub fn private_ca_config(
    certs: &[rustls::pki_types::CertificateDer<'static>],
) -> Result<Arc<rustls::ClientConfig>, rustls::Error> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs {
        roots.add(c.clone())?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth(),
    ))
}

/// TLS settings for https upstreams: the system's roots. A machine without
/// any still serves http upstreams; https ones then fail to verify (502).
pub fn client_config() -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for cert in found.certs {
        let _ = roots.add(cert);
    }
    if roots.is_empty() {
        debug!("no system root certificates found; https and SMTP upstreams will not verify");
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map(|b| {
            b.with_root_certificates(roots.clone())
                .with_no_client_auth()
        });
    match config {
        Ok(c) => Arc::new(c),
        // The ring provider supports the default versions; if it ever does
        // not, https upstreams fail (502), not the daemon.
        Err(e) => {
            warn!(error = %e, "TLS set-up failed; TLS upstreams are unavailable");
            Arc::new(
                rustls::ClientConfig::builder()
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth(),
            )
        }
    }
}

/// How a PostgreSQL connection checks the server's certificate (libpq's
/// `sslmode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Not at all (`prefer`, `require` without `sslrootcert`): TLS
    /// against eavesdroppers only, as libpq does.
    Nothing,
    /// The chain to a root, not the host name (`verify-ca`, `require`
    /// with `sslrootcert`).
    Chain,
    /// The chain and the host name (`verify-full`).
    Full,
}

/// TLS settings for PostgreSQL: `certs` (else the system's) as roots,
/// checked as `check` says.
pub fn postgres_config(
    certs: Option<&[rustls::pki_types::CertificateDer<'static>]>,
    check: Check,
) -> Result<rustls::ClientConfig, rustls::Error> {
    let mut roots = rustls::RootCertStore::empty();
    match certs {
        Some(certs) => {
            for c in certs {
                roots.add(c.clone())?;
            }
        }
        None => {
            for c in rustls_native_certs::load_native_certs().certs {
                let _ = roots.add(c);
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    if check == Check::Full {
        return Ok(builder.with_root_certificates(roots).with_no_client_auth());
    }
    let algorithms = provider.signature_verification_algorithms;
    let chain = match check {
        Check::Nothing => None,
        _ => Some(
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| rustls::Error::General(e.to_string()))?,
        ),
    };
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(Partial { chain, algorithms }))
        .with_no_client_auth())
}

/// libpq's weaker checks: the chain without the name, or nothing; the
/// handshake's signatures are always checked.
#[derive(Debug)]
struct Partial {
    /// The chain's verifier; `None`: nothing is checked.
    chain: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for Partial {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        let Some(chain) = &self.chain else {
            return Ok(rustls::client::danger::ServerCertVerified::assertion());
        };
        // webpki checks the chain before the name: a name error means the
        // chain was good.
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &rustls::pki_types::CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}
