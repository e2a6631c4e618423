//! `chorus certs`: a development certificate authority, a server certificate and a client
//! certificate, for running NATS with TLS (and mutual TLS) on a workstation or in CI. Not for
//! production, where certificates come from the organisation's CA.

use std::path::{Path, PathBuf};

use chorus_coordinator::error::{Error, ErrorKind, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose,
};

/// Where `generate` wrote each file.
#[derive(Debug, Clone)]
pub struct DevCerts {
    /// The CA certificate: give it to clients (`TlsOptions::ca_file`) and to the server for
    /// mutual TLS (`tls { ca_file }`).
    pub ca: PathBuf,
    /// The server's certificate and key (`tls { cert_file, key_file }`).
    pub server_cert: PathBuf,
    /// The server's key.
    pub server_key: PathBuf,
    /// A client certificate and key, for mutual TLS (`TlsOptions::client_cert`).
    pub client_cert: PathBuf,
    /// The client's key.
    pub client_key: PathBuf,
}

/// Mode of the key files: readable by their owner only.
#[cfg(unix)]
const SECRET_MODE: u32 = 0o600;
/// Mode of the certificates: readable by anyone.
#[cfg(unix)]
const PUBLIC_MODE: u32 = 0o644;

fn write(path: &Path, text: &str, secret: bool) -> Result<()> {
    use std::io::Write;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(if secret { SECRET_MODE } else { PUBLIC_MODE });
    }
    let context = || format!("cannot write {}", path.display());
    let mut file = options
        .open(path)
        .map_err(Error::wrap(ErrorKind::Io, context()))?;
    file.write_all(text.as_bytes())
        .map_err(Error::wrap(ErrorKind::Io, context()))
}

/// Generates a CA, a server certificate for `hosts` (names or IP addresses) and a client
/// certificate named `client`, into `dir`.
pub fn generate(dir: &Path, hosts: &[String], client: &str) -> Result<DevCerts> {
    std::fs::create_dir_all(dir).map_err(Error::wrap(
        ErrorKind::Io,
        format!("cannot create {}", dir.display()),
    ))?;
    let cert = |what: &str| Error::wrap(ErrorKind::Certificate, format!("cannot make the {what}"));
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(cert("CA"))?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "Chorus development CA");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_key = KeyPair::generate().map_err(cert("CA key"))?;
    let ca = CertifiedIssuer::self_signed(ca_params, ca_key).map_err(cert("CA"))?;

    let server_key = KeyPair::generate().map_err(cert("server key"))?;
    let mut server = CertificateParams::new(hosts.to_vec()).map_err(cert("server certificate"))?;
    server
        .distinguished_name
        .push(DnType::CommonName, "nats-server");
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_cert = server
        .signed_by(&server_key, &ca)
        .map_err(cert("server certificate"))?;

    let client_key = KeyPair::generate().map_err(cert("client key"))?;
    let mut client_params =
        CertificateParams::new(Vec::<String>::new()).map_err(cert("client certificate"))?;
    client_params
        .distinguished_name
        .push(DnType::CommonName, client);
    client_params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client_params
        .signed_by(&client_key, &ca)
        .map_err(cert("client certificate"))?;

    let files = DevCerts {
        ca: dir.join("ca.pem"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server-key.pem"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client-key.pem"),
    };
    write(&files.ca, &ca.pem(), false)?;
    write(&files.server_cert, &server_cert.pem(), false)?;
    write(&files.server_key, &server_key.serialize_pem(), true)?;
    write(&files.client_cert, &client_cert.pem(), false)?;
    write(&files.client_key, &client_key.serialize_pem(), true)?;
    Ok(files)
}
