//! The gateway scenario's HTTP client: HTTP/1.1 requests on one kept-alive loopback
//! connection, as a benchmark client (wrk, hey) sends them, with nothing between the timer and
//! the socket but the request's bytes. It reads what the gateway writes (a status line,
//! headers with a `content-length`, the body) and nothing else.

use std::net::SocketAddr;

use anyhow::{Context as _, bail};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// One kept-alive connection.
pub(crate) struct HttpClient {
    addr: SocketAddr,
    stream: BufReader<TcpStream>,
}

/// The longest header block read.
const MAX_HEADER_LINES: usize = 64;

impl HttpClient {
    pub(crate) async fn connect(addr: SocketAddr) -> anyhow::Result<Self> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(HttpClient {
            addr,
            stream: BufReader::new(stream),
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
        s.write_all(head.as_bytes()).await?;
        s.write_all(body).await?;
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
