//! The HTTP client for what the gateway itself fetches or posts (an identity provider's key
//! set, A2A push webhooks): rustls on ring, as the rest of the gateway, trusting the system's
//! CAs and those of an extra PEM file; no redirects followed; every request bounded in time.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_rustls::rustls::pki_types::pem::PemObject;

/// A client trusting the system's CAs and `ca_file`'s, each request within `timeout`.
///
/// # Errors
/// A message naming the file when `ca_file` does not read as PEM certificates.
pub fn client(ca_file: Option<&Path>, timeout: Duration) -> Result<reqwest::Client, String> {
    let mut roots = tokio_rustls::rustls::RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        // A system certificate rustls cannot use is left out, as browsers do.
        let _ = roots.add(cert);
    }
    if let Some(path) = ca_file {
        let what = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
        for cert in CertificateDer::pem_file_iter(path).map_err(|e| what(&e))? {
            roots
                .add(cert.map_err(|e| what(&e))?)
                .map_err(|e| what(&e))?;
        }
    }
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let tls = tokio_rustls::rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    reqwest::Client::builder()
        .tls_backend_preconfigured(tls)
        .redirect(reqwest::redirect::Policy::none())
        .timeout(timeout)
        .build()
        .map_err(|e| e.to_string())
}
