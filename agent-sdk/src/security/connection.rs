//! How to reach a secured NATS, as a configuration file says it: the CA, a client certificate
//! and key, and the nkey seed a connection authenticates (and signs) with. Read by the
//! coordinator, the gateway's edge identities and the CLI's contexts alike.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::signing::{Identity, KeyError};
use crate::{BrokerOptions, Credentials, TlsOptions};

/// Credentials and TLS for one NATS connection, as files. Every field is optional; with none
/// set, the connection is plain and anonymous (a developer's server).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectionSecurity {
    /// PEM file of the CA that signs the server's certificate; setting it requires TLS.
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate, for mutual TLS.
    pub tls_cert: Option<PathBuf>,
    /// Its key.
    pub tls_key: Option<PathBuf>,
    /// File holding the nkey seed this connection authenticates with (`chorus creds`).
    pub nkey_seed_file: Option<PathBuf>,
}

/// Why [`ConnectionSecurity`] cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectionSecurityError {
    /// The nkey seed file cannot be read.
    #[error("cannot read nkey seed {}", path.display())]
    SeedUnreadable {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file does not hold an nkey user seed.
    #[error("{} does not hold an nkey seed", path.display())]
    NotASeed {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: KeyError,
    },
    /// A client certificate without its key, or a key without its certificate.
    #[error("tls_cert and tls_key go together")]
    CertificateWithoutKey,
}

impl ConnectionSecurity {
    /// Settings that authenticate with the nkey seed in `path` and nothing else.
    pub fn nkey_seed_file(path: impl Into<PathBuf>) -> Self {
        ConnectionSecurity {
            nkey_seed_file: Some(path.into()),
            ..ConnectionSecurity::default()
        }
    }

    /// The signing identity of the nkey seed file, if one is set: the key a connection
    /// authenticates with also signs what it sends, so a receiver that knows its public key
    /// (the one in `nats.conf`) can verify it.
    ///
    /// # Errors
    /// The seed file cannot be read or holds no nkey seed.
    pub fn identity(&self) -> Result<Option<Identity>, ConnectionSecurityError> {
        let Some(path) = &self.nkey_seed_file else {
            return Ok(None);
        };
        let seed = read_seed(path)?;
        Identity::from_seed(&seed)
            .map(Some)
            .map_err(|source| ConnectionSecurityError::NotASeed {
                path: path.clone(),
                source,
            })
    }

    /// Applies these settings to broker options: the seed as credentials, TLS required when a
    /// CA or a client certificate is given.
    ///
    /// # Errors
    /// The seed file cannot be read, or a client certificate comes without its key.
    pub fn apply(
        &self,
        mut options: BrokerOptions,
    ) -> Result<BrokerOptions, ConnectionSecurityError> {
        if let Some(path) = &self.nkey_seed_file {
            options = options.credentials(Credentials::NKeySeed(read_seed(path)?));
        }
        if self.tls_ca.is_some() || self.tls_cert.is_some() {
            let mut tls = TlsOptions::required();
            if let Some(ca) = &self.tls_ca {
                tls = tls.ca_file(ca.clone());
            }
            tls = match (&self.tls_cert, &self.tls_key) {
                (Some(cert), Some(key)) => tls.client_cert(cert.clone(), key.clone()),
                (None, None) => tls,
                _ => return Err(ConnectionSecurityError::CertificateWithoutKey),
            };
            options = options.tls(tls);
        }
        Ok(options)
    }
}

fn read_seed(path: &Path) -> Result<String, ConnectionSecurityError> {
    std::fs::read_to_string(path)
        .map(|seed| seed.trim().to_owned())
        .map_err(|source| ConnectionSecurityError::SeedUnreadable {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_needs_its_key_and_a_missing_seed_is_named() {
        let half = ConnectionSecurity {
            tls_cert: Some("client.pem".into()),
            ..ConnectionSecurity::default()
        };
        let err = half
            .apply(BrokerOptions::new(["nats://127.0.0.1:4222"]))
            .expect_err("no key");
        assert!(matches!(
            err,
            ConnectionSecurityError::CertificateWithoutKey
        ));
        let missing = ConnectionSecurity::nkey_seed_file("no/such/seed.nk");
        let err = missing.identity().expect_err("no file");
        assert!(err.to_string().contains("no/such/seed.nk"), "{err}");
        assert!(
            ConnectionSecurity::default()
                .identity()
                .expect("none")
                .is_none()
        );
    }
}
