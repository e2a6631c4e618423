//! Connection options: a by-value builder ending in [`BrokerOptions::connect`].

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// How the connection authenticates. Secrets never appear in `Debug` output.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum Credentials {
    /// No credentials (a development server).
    #[default]
    None,
    /// A bearer token.
    Token(String),
    /// A user name and password.
    UserPassword {
        /// User name.
        user: String,
        /// Password.
        password: String,
    },
    /// An nkey seed (`SU...`): the user proves possession of the key by signing the server nonce.
    NKeySeed(String),
    /// A `.creds` file holding a user JWT and its nkey seed (decentralized auth).
    CredsFile(PathBuf),
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credentials::None => f.write_str("None"),
            Credentials::Token(_) => f.write_str("Token(***)"),
            Credentials::UserPassword { user, .. } => write!(f, "UserPassword({user}, ***)"),
            Credentials::NKeySeed(_) => f.write_str("NKeySeed(***)"),
            Credentials::CredsFile(path) => write!(f, "CredsFile({})", path.display()),
        }
    }
}

/// TLS settings. With none set, the connection uses TLS only if the server requires it.
///
/// ```
/// use chorus_broker_adapter::TlsOptions;
/// let tls = TlsOptions::required().ca_file("ca.pem").client_cert("client.pem", "client-key.pem");
/// assert!(tls.required && tls.client_cert.is_some());
/// ```
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct TlsOptions {
    /// Refuse to connect without TLS.
    pub required: bool,
    /// PEM file with the CA certificates that sign the server's certificate.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate and key for mutual TLS.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// Start TLS before the NATS `INFO` exchange (servers configured with `handshake_first`).
    pub handshake_first: bool,
}

impl TlsOptions {
    /// TLS required: the connection fails rather than go without it.
    pub fn required() -> Self {
        TlsOptions {
            required: true,
            ..TlsOptions::default()
        }
    }

    /// Trusts the CA certificates in the PEM file `path` for the server's certificate.
    pub fn ca_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.ca_file = Some(path.into());
        self
    }

    /// Presents the PEM certificate `cert` with its key `key` (mutual TLS).
    pub fn client_cert(mut self, cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        self.client_cert = Some((cert.into(), key.into()));
        self
    }

    /// Starts TLS before the NATS `INFO` exchange (servers with `handshake_first`).
    pub fn handshake_first(mut self, first: bool) -> Self {
        self.handshake_first = first;
        self
    }
}

/// Default time between client pings. NATS's own default (two minutes) takes minutes to
/// notice a dead server; agents want to know within seconds.
pub const DEFAULT_PING_INTERVAL: Duration = Duration::from_secs(5);
/// First reconnect delay; it doubles per attempt up to the configured cap.
pub const RECONNECT_BASE_DELAY: Duration = Duration::from_millis(50);
/// Default cap on the delay between reconnect attempts. A client retries at most this long
/// after its server is back, and Chorus promises commands handled again within 2 s of a
/// restarted server being ready (docs/RELIABILITY.md): a 2 s cap alone could spend all of it,
/// 1 s leaves half for the pull's renewal and the command. What it costs while the server is
/// down: one connection attempt a second per client (to a server that is gone, a refused TCP
/// connect); the jitter of [`reconnect_delay`] (up to a quarter of each wait) spreads a fleet
/// that lost its server at the same moment, so it does not come back in lockstep.
pub const DEFAULT_RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
/// Default connect timeout per attempt.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default number of messages buffered per subscription before the client drops and reports a
/// slow consumer.
pub const DEFAULT_SUBSCRIPTION_CAPACITY: usize = 64 * 1024;

/// Options for [`Broker::connect`](crate::Broker::connect).
///
/// ```no_run
/// # async fn run() -> Result<(), chorus_broker_adapter::Error> {
/// use std::time::Duration;
/// let broker = chorus_broker_adapter::BrokerOptions::new(["nats://127.0.0.1:4222"])
///     .name("ocr-1")
///     .inbox_prefix("_INBOX.ocr-1")
///     .ping_interval(Duration::from_secs(2))
///     .connect()
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct BrokerOptions {
    pub(crate) servers: Vec<String>,
    pub(crate) name: Option<String>,
    pub(crate) credentials: Credentials,
    pub(crate) tls: TlsOptions,
    pub(crate) ping_interval: Duration,
    pub(crate) reconnect_max_delay: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) inbox_prefix: Option<String>,
    pub(crate) subscription_capacity: usize,
    pub(crate) retry_initial_connect: bool,
    pub(crate) jetstream_domain: Option<String>,
}

impl Default for BrokerOptions {
    fn default() -> Self {
        BrokerOptions {
            servers: vec!["nats://127.0.0.1:4222".to_owned()],
            name: None,
            credentials: Credentials::None,
            tls: TlsOptions::default(),
            ping_interval: DEFAULT_PING_INTERVAL,
            reconnect_max_delay: DEFAULT_RECONNECT_MAX_DELAY,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            inbox_prefix: None,
            subscription_capacity: DEFAULT_SUBSCRIPTION_CAPACITY,
            retry_initial_connect: false,
            jetstream_domain: None,
        }
    }
}

impl BrokerOptions {
    /// Options for the given server list (URLs such as `nats://host:4222` or `tls://host:4222`;
    /// a comma-separated string is split).
    pub fn new<I, S>(servers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let servers = servers
            .into_iter()
            .flat_map(|s| {
                s.as_ref()
                    .split(',')
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect();
        BrokerOptions {
            servers,
            ..BrokerOptions::default()
        }
    }

    /// Replaces the server list (same parsing as [`BrokerOptions::new`]).
    pub fn with_servers<I, S>(mut self, servers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        self.servers = BrokerOptions::new(servers).servers;
        self
    }

    /// Sets the connection name unless one is set already.
    pub fn name_if_unset(mut self, name: impl Into<String>) -> Self {
        self.name.get_or_insert_with(|| name.into());
        self
    }

    /// Sets the inbox prefix unless one is set already.
    pub fn inbox_prefix_if_unset(mut self, prefix: impl Into<String>) -> Self {
        self.inbox_prefix.get_or_insert_with(|| prefix.into());
        self
    }

    /// The connection name the server shows in its monitoring.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// How to authenticate.
    pub fn credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = credentials;
        self
    }

    /// TLS settings.
    pub fn tls(mut self, tls: TlsOptions) -> Self {
        self.tls = tls;
        self
    }

    /// Time between pings; two missed pongs mark the connection dead.
    pub fn ping_interval(mut self, interval: Duration) -> Self {
        self.ping_interval = interval;
        self
    }

    /// Cap on the exponential reconnect backoff ([`DEFAULT_RECONNECT_MAX_DELAY`], 1 s, by
    /// default): the longest a client waits to notice its server is back.
    pub fn reconnect_max_delay(mut self, delay: Duration) -> Self {
        self.reconnect_max_delay = delay;
        self
    }

    /// Timeout of each connect attempt.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Prefix of the reply subjects this connection creates. Give each agent its own
    /// (`_INBOX.<agent-id>`) so the server can allow it to read only its own replies.
    pub fn inbox_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.inbox_prefix = Some(prefix.into());
        self
    }

    /// Messages buffered per subscription before new ones are dropped and a slow consumer is
    /// reported.
    pub fn subscription_capacity(mut self, capacity: usize) -> Self {
        self.subscription_capacity = capacity.max(1);
        self
    }

    /// The JetStream domain whose API this connection's JetStream calls use
    /// (`$JS.<domain>.API`): set it on a leaf node that has no JetStream of its own to reach
    /// the hub's (docs/OPERATIONS.md, "Sites and leaf nodes"). Unset: the local `$JS.API`.
    pub fn jetstream_domain(mut self, domain: impl Into<String>) -> Self {
        self.jetstream_domain = Some(domain.into()).filter(|d| !d.is_empty());
        self
    }

    /// Keep trying when the first connect fails instead of returning an error.
    pub fn retry_initial_connect(mut self, retry: bool) -> Self {
        self.retry_initial_connect = retry;
        self
    }

    /// The configured servers.
    pub fn servers(&self) -> &[String] {
        &self.servers
    }

    /// Connects with these options.
    ///
    /// # Errors
    /// Those of [`Broker::connect`](crate::Broker::connect): options that cannot work, a server
    /// that refuses the credentials or is full, TLS that cannot be set up, no server reachable.
    pub async fn connect(self) -> crate::Result<crate::Broker> {
        crate::Broker::connect(self).await
    }
}

/// The reconnect delay for attempt `attempt` (1-based): exponential from
/// `RECONNECT_BASE_DELAY` (50 ms), capped at `max`, with up to 25% jitter subtracted so that many
/// agents cut off together do not reconnect in lockstep.
pub fn reconnect_delay(attempt: usize, max: Duration) -> Duration {
    let exp = attempt.saturating_sub(1).min(16) as u32;
    let delay = RECONNECT_BASE_DELAY.saturating_mul(1u32 << exp).min(max);
    // Cheap jitter without a random-number dependency: the clock's nanoseconds.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let jitter = delay.mul_f64(f64::from(nanos % 1000) / 4000.0);
    delay.saturating_sub(jitter)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_lists_are_split_and_trimmed() {
        let o = BrokerOptions::new(["nats://a:1, nats://b:2", "nats://c:3"]);
        assert_eq!(o.servers(), ["nats://a:1", "nats://b:2", "nats://c:3"]);
    }

    #[test]
    fn reconnect_delay_grows_and_is_bounded() {
        let max = Duration::from_secs(2);
        assert!(reconnect_delay(1, max) <= RECONNECT_BASE_DELAY);
        assert!(reconnect_delay(1, max) >= RECONNECT_BASE_DELAY * 3 / 4);
        for attempt in 1..100 {
            assert!(reconnect_delay(attempt, max) <= max);
        }
        assert!(reconnect_delay(30, max) >= max * 3 / 4);
    }

    #[test]
    fn secrets_are_not_printed() {
        let dbg = format!("{:?}", Credentials::Token("s3cret".into()));
        assert!(!dbg.contains("s3cret"));
    }
}
