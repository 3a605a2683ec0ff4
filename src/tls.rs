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
