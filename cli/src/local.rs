//! Finding or starting the local NATS server for `chorus up`.

use std::path::Path;
use std::time::Duration;

use chorus_broker_adapter::BrokerOptions;
use chorus_nats_server::{NatsServer, ServerBuilder, find_binary};

use chorus_coordinator::error::{Error, ErrorKind, Result};

/// How long the probe waits for a server already running at the URL.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// Hosts `chorus up` may start a server for.
const LOOPBACK_HOSTS: [&str; 3] = ["127.0.0.1", "localhost", "[::1]"];

/// A server `chorus up` found running, or one it started and owns (stopped on drop).
#[derive(Debug)]
pub enum LocalNats {
    /// Someone else's server answered at the URL.
    Existing(String),
    /// Started from the config file; killed when this value is dropped.
    Started(Box<NatsServer>),
}

impl LocalNats {
    /// The client URL.
    pub fn url(&self) -> &str {
        match self {
            LocalNats::Existing(url) => url,
            LocalNats::Started(server) => server.url(),
        }
    }
}

/// Uses the server at `url` if one answers; otherwise, for a loopback URL, starts
/// `nats-server -c <config>` in the config file's directory, listening on the URL's host and
/// port (default 4222) and with its monitoring on `monitor_port` when given (else the
/// config's), and waits until it listens. A port something else holds is named with the flag
/// that moves it.
pub async fn ensure_nats(url: &str, config: &Path, monitor_port: Option<u16>) -> Result<LocalNats> {
    let probe = BrokerOptions::new([url])
        .name("chorus-up-probe")
        .connect_timeout(PROBE_TIMEOUT)
        .connect()
        .await;
    if let Ok(broker) = probe {
        let _ = broker.drain().await;
        return Ok(LocalNats::Existing(url.to_owned()));
    }
    let loopback = LOOPBACK_HOSTS.iter().any(|host| url.contains(host));
    if !loopback {
        return Err(Error::new(
            ErrorKind::Connect,
            format!(
                "no NATS server answers at {url}, and it is not a local address to start one on"
            ),
        ));
    }
    if !config.is_file() {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "no NATS server answers at {url}, and there is no config file at {} to start one with",
                config.display()
            ),
        ));
    }
    let binary = find_binary().ok_or_else(|| {
        Error::new(
            ErrorKind::NatsServer,
            "nats-server is not installed: run scripts/install-nats-server first",
        )
    })?;
    let config = config.canonicalize().map_err(Error::wrap(
        ErrorKind::Io,
        format!("cannot find {}", config.display()),
    ))?;
    let dir = config
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ".".into());
    let (host, port) = host_port(url).ok_or_else(|| {
        Error::new(
            ErrorKind::Config,
            format!("--server {url}: not a NATS URL with a host (nats://127.0.0.1:4222)"),
        )
    })?;
    if let Err(e) = std::net::TcpListener::bind((host.as_str(), port)) {
        return Err(Error::new(
            ErrorKind::Config,
            format!(
                "the NATS client port {host}:{port} is taken by a program that does not speak \
                 NATS ({e}): pass --server nats://127.0.0.1:<another port> (or set \
                 CHORUS_NATS_URL) to start the local server there"
            ),
        ));
    }
    let mut builder = ServerBuilder::default()
        .binary(binary)
        .config(config)
        .current_dir(dir)
        // Command-line flags win over the config file's `listen` and `http`.
        .arg("-a")
        .arg(host.clone())
        .arg("-p")
        .arg(port.to_string());
    if let Some(monitor) = monitor_port {
        builder = builder.arg("-m").arg(monitor.to_string());
    }
    const FAILED: &str = "nats-server did not start";
    let started = tokio::task::spawn_blocking(move || builder.start())
        .await
        .map_err(Error::wrap(ErrorKind::NatsServer, FAILED))?;
    match started {
        Ok(server) => Ok(LocalNats::Started(Box::new(server))),
        Err(e) if e.to_string().contains("can't listen to the monitor port") => Err(Error::new(
            ErrorKind::Config,
            format!(
                "the NATS monitoring port{} is taken: pass --monitor-port <another port> (or \
                 set CHORUS_MONITOR_PORT) to `chorus up` or `scripts/up`",
                monitor_port.map(|p| format!(" {p}")).unwrap_or_default()
            ),
        )),
        Err(e) => Err(Error::wrap(ErrorKind::NatsServer, FAILED)(e)),
    }
}

/// The host and port of the first URL of `urls` (`nats://host:port`, `host:port`, `host`; the
/// port defaults to NATS's 4222).
pub fn host_port(urls: &str) -> Option<(String, u16)> {
    let url = urls.split(',').next()?.trim();
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let rest = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    let rest = rest.split('/').next()?;
    let (host, port) = match rest.rsplit_once(':') {
        Some((host, port)) if !host.ends_with(':') && !port.contains(']') => {
            (host, port.parse().ok()?)
        }
        _ => (rest, DEFAULT_PORT),
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    (!host.is_empty()).then(|| (host.to_owned(), port))
}

/// NATS's standard client port.
const DEFAULT_PORT: u16 = 4222;

#[cfg(test)]
mod tests {
    use super::host_port;

    #[test]
    fn a_url_gives_its_host_and_port() {
        assert_eq!(
            host_port("nats://127.0.0.1:4299"),
            Some(("127.0.0.1".into(), 4299))
        );
        assert_eq!(host_port("127.0.0.1"), Some(("127.0.0.1".into(), 4222)));
        assert_eq!(
            host_port("nats://u:p@localhost:5000,nats://x:1"),
            Some(("localhost".into(), 5000))
        );
        assert_eq!(host_port("nats://[::1]:4333"), Some(("::1".into(), 4333)));
        assert_eq!(host_port("nats://:4333"), None);
    }
}
