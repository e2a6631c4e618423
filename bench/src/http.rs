//! The gateway scenario's HTTP client: HTTP/1.1 requests on one kept-alive loopback
//! connection, plain or over TLS (rustls on ring, trusting the gateway's CA), as a benchmark
//! client (wrk, hey) sends them, with nothing between the timer and the socket but the
//! request's bytes. It reads what the gateway writes (a status line, headers with a
//! `content-length`, the body) and nothing else.

use std::net::SocketAddr;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// A connection's bytes: a TCP stream, or TLS over one.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// One kept-alive connection.
pub(crate) struct HttpClient {
    addr: SocketAddr,
    stream: BufReader<Box<dyn Io>>,
}

/// The longest header block read.
const MAX_HEADER_LINES: usize = 64;

impl HttpClient {
    pub(crate) async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(HttpClient {
            addr,
            stream: BufReader::new(Box::new(stream)),
        })
    }

    /// A connection over TLS to a server whose certificate `ca_pem`'s CA signed for
    /// `127.0.0.1`; the handshake is done before it returns.
    pub(crate) async fn connect_tls(addr: SocketAddr, ca_pem: &[u8]) -> anyhow::Result<Self> {
        use tokio_rustls::rustls;
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem) {
            roots.add(cert?)?;
        }
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
        let tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(name, stream)
            .await
            .context("the TLS handshake with the gateway")?;
        Ok(HttpClient {
            addr,
            stream: BufReader::new(Box::new(tls)),
        })
    }

    /// POSTs `body` (JSON) to `path` with `header` (`name: value`); the status and body.
    pub(crate) async fn post_json(
        &mut self,
        path: &str,
        header: &str,
        body: &[u8],
    ) -> anyhow::Result<(u16, Vec<u8>)> {
        let head = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\n{header}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        let s = self.stream.get_mut();
        // One write: over TLS, two would be two records.
        let mut request = head.into_bytes();
        request.extend_from_slice(body);
        s.write_all(&request).await?;
        s.flush().await?;
        let mut line = String::new();
        self.stream.read_line(&mut line).await?;
        let status: u16 = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("no HTTP status in {line:?}"))?;
        let mut length = None;
        for _ in 0..MAX_HEADER_LINES {
            line.clear();
            self.stream.read_line(&mut line).await?;
            let l = line.trim_end();
            if l.is_empty() {
                let Some(n) = length else {
                    bail!("the answer has no content-length");
                };
                let mut body = vec![0u8; n];
                self.stream.read_exact(&mut body).await?;
                return Ok((status, body));
            }
            if let Some((name, value)) = l.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = Some(value.trim().parse::<usize>()?);
            }
        }
        bail!("more than {MAX_HEADER_LINES} header lines")
    }
}
