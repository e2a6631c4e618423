//! HTTPS and WSS: the gateway's listener behind rustls. Handshakes run beside the accept loop
//! (a slow client cannot hold the others up), bounded in number and in time; a connection that
//! finishes its handshake is handed to the HTTP server like a plain one.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::GatewayTls;
use crate::error::{Error, ErrorKind, Result};

/// Handshakes in progress at once; past it, new connections wait to be accepted.
const MAX_HANDSHAKES: usize = 256;
/// The longest a client may take over its handshake before it is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The rustls configuration `tls` describes: the certificate chain and key, and with
/// `client_ca_file` a client certificate from that CA required of every caller.
///
/// # Errors
/// A configuration error naming the file that cannot be read or does not hold what it should.
pub(crate) fn server_config(tls: &GatewayTls) -> Result<Arc<ServerConfig>> {
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&tls.cert_file)
        .and_then(Iterator::collect)
        .map_err(|e| config(format!("tls.cert_file {}: {e}", tls.cert_file.display())))?;
    if certs.is_empty() {
        return Err(config(format!(
            "tls.cert_file {}: no certificate in it",
            tls.cert_file.display()
        )));
    }
    let key = PrivateKeyDer::from_pem_file(&tls.key_file)
        .map_err(|e| config(format!("tls.key_file {}: {e}", tls.key_file.display())))?;
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| config(format!("tls: {e}")))?;
    let builder = match &tls.client_ca_file {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(ca)
                .map_err(|e| config(format!("tls.client_ca_file {}: {e}", ca.display())))?
            {
                let cert =
                    cert.map_err(|e| config(format!("tls.client_ca_file {}: {e}", ca.display())))?;
                roots
                    .add(cert)
                    .map_err(|e| config(format!("tls.client_ca_file {}: {e}", ca.display())))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| config(format!("tls.client_ca_file {}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut server = builder.with_single_cert(certs, key).map_err(|e| {
        config(format!(
            "tls: the certificate and key do not go together: {e}"
        ))
    })?;
    // The gateway's HTTP server speaks HTTP/1.1 (WebSockets upgrade from it).
    server.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(server))
}

fn config(what: String) -> Error {
    Error::new(ErrorKind::Config, format!("gateway: {what}"))
}

/// A listener that yields connections whose TLS handshake is done.
pub(crate) struct TlsListener {
    ready: mpsc::Receiver<(tokio_rustls::server::TlsStream<TcpStream>, SocketAddr)>,
}

impl TlsListener {
    /// Accepts on `listener` until `stop`, each handshake a task of `tracker`.
    pub(crate) fn new(
        listener: TcpListener,
        config: Arc<ServerConfig>,
        stop: CancellationToken,
        tracker: &TaskTracker,
    ) -> std::io::Result<TlsListener> {
        let acceptor = TlsAcceptor::from(config);
        let (tx, ready) = mpsc::channel(MAX_HANDSHAKES);
        let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        let spawner = tracker.clone();
        tracker.spawn(async move {
            loop {
                let permit = tokio::select! {
                    permit = Arc::clone(&handshakes).acquire_owned() => permit,
                    _ = stop.cancelled() => break,
                };
                // The semaphore is never closed.
                let Ok(permit) = permit else { break };
                let (stream, peer) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(accepted) => accepted,
                        Err(e) => {
                            // Out of descriptors, a reset before accept: the next one may work.
                            tracing::debug!(error = %e, "gateway: accept failed");
                            tokio::select! {
                                _ = tokio::time::sleep(Duration::from_millis(50)) => continue,
                                _ = stop.cancelled() => break,
                            }
                        }
                    },
                    _ = stop.cancelled() => break,
                };
                if let Err(err) = stream.set_nodelay(true) {
                    tracing::debug!(%peer, error = %err, "gateway: TCP_NODELAY not set");
                }
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                let stop = stop.clone();
                spawner.spawn(async move {
                    let _permit = permit;
                    let shaken = tokio::select! {
                        shaken = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)) => shaken,
                        _ = stop.cancelled() => return,
                    };
                    match shaken {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "gateway: TLS handshake failed");
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "gateway: TLS handshake timed out");
                        }
                    }
                });
            }
        });
        Ok(TlsListener { ready })
    }
}

impl crate::conn::Accept for TlsListener {
    type Io = tokio_rustls::server::TlsStream<TcpStream>;

    async fn next(&mut self) -> Option<(Self::Io, SocketAddr)> {
        // None once the accept loop stopped (shutdown).
        self.ready.recv().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_that_cannot_serve_is_named_with_its_file() {
        let dir = std::env::temp_dir().join(format!("chorus-gateway-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let missing = GatewayTls {
            cert_file: dir.join("missing.pem"),
            key_file: dir.join("missing-key.pem"),
            client_ca_file: None,
        };
        let err = server_config(&missing).expect_err("missing").to_string();
        assert!(
            err.contains("tls.cert_file") && err.contains("missing.pem"),
            "{err}"
        );
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").expect("write");
        let err = server_config(&GatewayTls {
            cert_file: empty,
            ..missing
        })
        .expect_err("empty")
        .to_string();
        assert!(err.contains("no certificate in it"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
