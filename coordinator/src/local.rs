//! Finding or starting the local NATS server for `chorus up`.

use std::path::Path;
use std::time::Duration;

use broker_adapter::BrokerOptions;
use broker_adapter::server::{NatsServer, ServerBuilder, find_binary};

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
pub async fn ensure_nats(url: &str, config: &Path) -> anyhow::Result<LocalNats> {
    let probe = BrokerOptions::new([url])
        .name("chorus-up-probe")
        .connect_timeout(Duration::from_secs(1))
        .connect()
        .await;
    if let Ok(broker) = probe {
        let _ = broker.drain().await;
        return Ok(LocalNats::Existing(url.to_owned()));
    }
    let loopback = ["127.0.0.1", "localhost", "[::1]"]
        .iter()
        .any(|host| url.contains(host));
    anyhow::ensure!(
        loopback,
        "no NATS server answers at {url}, and it is not a local address to start one on"
    );
    anyhow::ensure!(
        config.is_file(),
        "no NATS server answers at {url}, and there is no config file at {} to start one with",
        config.display()
    );
    let binary = find_binary().ok_or_else(|| {
        anyhow::anyhow!("nats-server is not installed: run scripts/install-nats-server first")
    })?;
    let config = config.canonicalize()?;
    let dir = config
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ".".into());
    let builder = ServerBuilder::default()
        .binary(binary)
        .config(config)
        .current_dir(dir);
    let server = tokio::task::spawn_blocking(move || builder.start()).await??;
    Ok(LocalNats::Started(Box::new(server)))
}
