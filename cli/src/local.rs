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
/// `nats-server -c <config>` in the config file's directory and waits until it listens.
pub async fn ensure_nats(url: &str, config: &Path) -> Result<LocalNats> {
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
    let builder = ServerBuilder::default()
        .binary(binary)
        .config(config)
        .current_dir(dir);
    const FAILED: &str = "nats-server did not start";
    let server = tokio::task::spawn_blocking(move || builder.start())
        .await
        .map_err(Error::wrap(ErrorKind::NatsServer, FAILED))?
        .map_err(Error::wrap(ErrorKind::NatsServer, FAILED))?;
    Ok(LocalNats::Started(Box::new(server)))
}
