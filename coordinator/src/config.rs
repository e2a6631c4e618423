//! The coordinator's configuration: defaults, then a TOML file, then `CHORUS_SERVE__*`
//! environment variables (nested keys joined by `__`, for example
//! `CHORUS_SERVE__RETRY__DEFAULT__MAX_ATTEMPTS=3`), validated at start with errors that name
//! the offending key.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use chorus_gateway::config::{CircuitBreakerConfig, GatewayConfig};
use chorus_sdk::RetryPolicies;
use chorus_sdk::durable::InboxLimits;
use chorus_sdk::security::ConnectionSecurity;
use serde::{Deserialize, Serialize};

use crate::authority::AuthorityConfig;
use crate::error::{Error, ErrorKind, Result};

/// Where `chorus serve` and `chorus up` find NATS unless told otherwise.
pub const DEFAULT_SERVERS: &str = "nats://127.0.0.1:4222";
/// Where `/metrics`, `/healthz` and `/readyz` listen unless told otherwise.
pub const DEFAULT_METRICS_ADDR: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 9464);
/// Prefix of the environment variables that override the config file.
pub const ENV_PREFIX: &str = "CHORUS_SERVE";

/// Fails with a configuration error saying `what` unless `ok`.
fn ensure(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::new(ErrorKind::Config, what()))
    }
}

/// Default of `host_grace_ms`: a host silent this long has its agents placed elsewhere.
pub const DEFAULT_HOST_GRACE_MS: u64 = 30_000;
/// Default of `reconcile_interval_ms`.
pub const DEFAULT_RECONCILE_INTERVAL_MS: u64 = 2_000;

/// Everything `chorus serve` reads. Every field has a default; see `docs/COORDINATOR.md`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// NATS server URLs, comma-separated.
    pub servers: String,
    /// Subject root of the bus.
    pub root: String,
    /// Where `/metrics`, `/healthz` and `/readyz` listen.
    pub metrics_addr: SocketAddr,
    /// Heartbeats an agent may miss before it is declared gone.
    pub missed_heartbeats: u32,
    /// Heartbeats a second the whole fleet is asked to keep to: the coordinator announces a
    /// heartbeat floor of one second per this many live agents (0: no floor).
    pub max_heartbeats_per_second: u64,
    /// How often the registry looks for silent agents, in milliseconds.
    pub reap_interval_ms: u64,
    /// How long broadcast recipients have to answer when the sender does not say, in ms.
    pub broadcast_timeout_ms: u64,
    /// Recipients contacted at once by one broadcast.
    pub broadcast_concurrency: usize,
    /// Replicas of the coordinator's streams and buckets (1 on one server, 3 on a cluster).
    pub replicas: usize,
    /// How long shutdown waits for in-flight work, in milliseconds.
    pub shutdown_timeout_ms: u64,
    /// Retry policies for durable deliveries, published to agents through the config bucket.
    pub retry: RetryPolicies,
    /// Limits of the durable inbox stream.
    pub inbox: InboxLimits,
    /// How to reach a secured NATS: CA, client certificate and key, nkey seed file.
    pub security: ConnectionSecurity,
    /// File with the nkey seed the coordinator signs broadcast copies with (as `coordinator`;
    /// receivers trust its public key). Default: `security.nkey_seed_file`, if set; with
    /// neither, copies go unsigned.
    pub signing_seed_file: Option<std::path::PathBuf>,
    /// Refuse unsigned broadcast requests (5014). Signed ones are always verified against the
    /// sender's key (from `trusted_keys` or the registry) and refused with 5004 or 5015.
    pub require_signed_broadcasts: bool,
    /// Public keys of broadcast senders that never register (a `chorus --id` CLI user), by
    /// agent id; they take precedence over the registry's.
    pub trusted_keys: std::collections::BTreeMap<String, String>,
    /// The same from files, by agent id: each file holds one public key (`chorus creds`
    /// writes `<id>.pub` beside the seed). Read at start; a key in `trusted_keys` wins.
    pub trusted_key_files: std::collections::BTreeMap<String, std::path::PathBuf>,
    /// The edge gateway: HTTP when `gateway.listen` is set, SAP agents when `gateway.sap` names
    /// any; off otherwise. See `docs/INTEROP.md`.
    pub gateway: GatewayConfig,
    /// Circuit breakers on the requests the gateway's edge identities make for their callers:
    /// unset, none.
    pub circuit_breaker: Option<CircuitBreakerConfig>,
    /// How long a silent host keeps its hosted agents before they are placed on other hosts,
    /// in milliseconds (docs/HOSTING.md).
    pub host_grace_ms: u64,
    /// How often hosted agents' desired state is reconciled with what the hosts run, in
    /// milliseconds (and after every deploy, scale and terminate).
    pub reconcile_interval_ms: u64,
    /// Who holds which role (docs/SECURITY.md, "Roles and authority"): the admins that may
    /// deploy, scale and terminate, the operators that may read what is deployed.
    pub authority: AuthorityConfig,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            servers: DEFAULT_SERVERS.into(),
            root: chorus_sdk::subject::DEFAULT_ROOT.into(),
            metrics_addr: DEFAULT_METRICS_ADDR,
            missed_heartbeats: 3,
            max_heartbeats_per_second: 2_000,
            reap_interval_ms: 1_000,
            broadcast_timeout_ms: 5_000,
            broadcast_concurrency: 256,
            replicas: 1,
            shutdown_timeout_ms: 10_000,
            retry: RetryPolicies::default(),
            inbox: InboxLimits::default(),
            security: ConnectionSecurity::default(),
            signing_seed_file: None,
            require_signed_broadcasts: false,
            trusted_keys: std::collections::BTreeMap::new(),
            trusted_key_files: std::collections::BTreeMap::new(),
            gateway: GatewayConfig::default(),
            circuit_breaker: None,
            host_grace_ms: DEFAULT_HOST_GRACE_MS,
            reconcile_interval_ms: DEFAULT_RECONCILE_INTERVAL_MS,
            authority: AuthorityConfig::default(),
        }
    }
}

impl CoordinatorConfig {
    /// `trusted_keys` with the keys of `trusted_key_files` read in (those given inline win).
    ///
    /// # Errors
    /// A configuration error naming the file that cannot be read or holds no user public key.
    pub fn read_trusted_keys(&mut self) -> Result<()> {
        for (agent, file) in &self.trusted_key_files {
            let text = std::fs::read_to_string(file).map_err(Error::wrap(
                ErrorKind::Config,
                format!(
                    "trusted_key_files: cannot read {} (for {agent})",
                    file.display()
                ),
            ))?;
            let key = text.trim();
            if !(key.len() == 56 && key.starts_with('U')) {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!(
                        "trusted_key_files: {} (for {agent}) does not hold a user public key \
                         (U..., 56 characters, as `chorus creds` writes to <id>.pub)",
                        file.display()
                    ),
                ));
            }
            self.trusted_keys
                .entry(agent.clone())
                .or_insert_with(|| key.to_owned());
        }
        Ok(())
    }

    /// The key broadcast copies are signed with: `signing_seed_file`, else the nkey seed the
    /// coordinator connects with, else none.
    ///
    /// # Errors
    /// A configuration error when the seed file cannot be read or holds no nkey seed.
    pub fn signing_identity(&self) -> Result<Option<chorus_sdk::security::Identity>> {
        match &self.signing_seed_file {
            Some(path) => ConnectionSecurity::nkey_seed_file(path.clone()).identity(),
            None => self.security.identity(),
        }
        .map_err(Error::wrap(ErrorKind::Config, "signing key"))
    }

    /// Loads defaults, then `file` if given (it must exist), then the environment.
    ///
    /// # Errors
    /// A configuration error when `file` does not exist, a value in it or in the environment does
    /// not parse or is an unknown key, or a value cannot work
    /// ([`validate`](CoordinatorConfig::validate)).
    pub fn load(file: Option<&Path>) -> Result<Self> {
        let invalid = || Error::wrap(ErrorKind::Config, "invalid configuration");
        let defaults = config::Config::try_from(&CoordinatorConfig::default()).map_err(invalid())?;
        let mut builder = config::Config::builder().add_source(defaults);
        if let Some(file) = file {
            ensure(file.is_file(), || {
                format!("config file {} does not exist", file.display())
            })?;
            builder = builder.add_source(config::File::from(file).format(config::FileFormat::Toml));
        }
        builder = builder.add_source(
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true),
        );
        let cfg: CoordinatorConfig = builder
            .build()
            .and_then(config::Config::try_deserialize)
            .map_err(invalid())?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks values that parse but cannot work.
    ///
    /// # Errors
    /// A configuration error naming the first key that cannot work: an invalid root, no servers, an
    /// interval, timeout or count out of range, replicas not 1, 3 or 5, bad retry policies or
    /// circuit breaker, or a gateway section that cannot work.
    pub fn validate(&self) -> Result<()> {
        chorus_sdk::Subjects::new(&self.root).map_err(Error::wrap(ErrorKind::Config, "root"))?;
        ensure(!self.servers.trim().is_empty(), || {
            "servers: no NATS server given".into()
        })?;
        ensure(self.missed_heartbeats >= 1, || {
            "missed_heartbeats must be at least 1".into()
        })?;
        ensure(self.reap_interval_ms >= 10, || {
            "reap_interval_ms must be at least 10".into()
        })?;
        ensure(self.broadcast_timeout_ms >= 1, || {
            "broadcast_timeout_ms must be positive".into()
        })?;
        ensure(self.broadcast_concurrency >= 1, || {
            "broadcast_concurrency must be at least 1".into()
        })?;
        ensure(self.host_grace_ms >= 1_000, || {
            "host_grace_ms must be at least 1000".into()
        })?;
        ensure(self.reconcile_interval_ms >= 100, || {
            "reconcile_interval_ms must be at least 100".into()
        })?;
        ensure(matches!(self.replicas, 1 | 3 | 5), || {
            format!("replicas must be 1, 3 or 5, not {}", self.replicas)
        })?;
        self.retry
            .validate()
            .map_err(|e| Error::new(ErrorKind::Config, format!("retry: {e}")))?;
        ensure(self.inbox.max_age_secs > 0, || {
            "inbox.max_age_secs must be positive".into()
        })?;
        if let Some(breaker) = &self.circuit_breaker {
            ensure(breaker.failures >= 1 && breaker.open_ms >= 1, || {
                "circuit_breaker: failures and open_ms must be positive".into()
            })?;
        }
        self.authority
            .validate()
            .map_err(|e| Error::new(ErrorKind::Config, e))?;
        self.gateway
            .validate()
            .map_err(Error::wrap(ErrorKind::Config, "gateway"))
    }

    /// Whether a role counts only for a signed sender: `authority.require_signed`, or when
    /// unset, whether the coordinator connects with an nkey (a secured bus).
    pub fn roles_require_signatures(&self) -> bool {
        self.authority
            .require_signed
            .unwrap_or(self.security.nkey_seed_file.is_some())
    }

    /// How the gateway reaches the bus: the coordinator's own servers, root and security.
    pub fn gateway_bus(&self) -> chorus_gateway::Bus {
        let mut bus = chorus_gateway::Bus::new(self.servers.clone());
        bus.root.clone_from(&self.root);
        bus.security = self.security.clone();
        bus.circuit_breaker = self.circuit_breaker;
        bus.shutdown_timeout = self.shutdown_timeout();
        // The console's replays are signed with the key the coordinator signs with.
        bus.replay_seed_file = self
            .signing_seed_file
            .clone()
            .or_else(|| self.security.nkey_seed_file.clone());
        bus
    }

    /// The heartbeat floor to announce while `live` agents are live: a second per
    /// `max_heartbeats_per_second` of them, none when that is 0.
    pub fn heartbeat_floor(&self, live: usize) -> Option<u64> {
        let live = u64::try_from(live).unwrap_or(u64::MAX);
        (self.max_heartbeats_per_second > 0)
            .then(|| live.saturating_mul(1_000) / self.max_heartbeats_per_second)
    }

    /// The reaper's period.
    pub fn reap_interval(&self) -> Duration {
        Duration::from_millis(self.reap_interval_ms)
    }

    /// The shutdown deadline.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_a_file_overrides_them() {
        // Environment overrides are checked against a running `chorus serve` in
        // tests/cli.rs (serve_takes_environment_variables_over_the_config_file): setting process
        // environment here would race with the other tests of this binary.
        CoordinatorConfig::default()
            .validate()
            .expect("defaults are valid");
        let dir = tempfile_dir();
        let file = dir.path().join("chorus.toml");
        std::fs::write(
            &file,
            "root = \"acme\"\n[retry.default]\nmax_attempts = 3\ninitial_backoff_ms = 100\n",
        )
        .expect("write");
        let cfg = CoordinatorConfig::load(Some(&file)).expect("loads");
        assert_eq!(cfg.root, "acme");
        assert_eq!(cfg.retry.default.max_attempts, 3);
        assert_eq!(cfg.retry.default.initial_backoff_ms, 100);
        assert_eq!(
            cfg.retry.default.multiplier, 2.0,
            "unset keys keep their defaults"
        );
    }

    #[test]
    fn bad_values_are_refused_with_the_key_named() {
        let dir = tempfile_dir();
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "[retry.default]\nmax_attempts = 0\n").expect("write");
        let err = CoordinatorConfig::load(Some(&file)).expect_err("invalid");
        assert!(err.to_string().contains("max_attempts"), "{err}");
        std::fs::write(&file, "replicas = 2\n").expect("write");
        let err = CoordinatorConfig::load(Some(&file)).expect_err("invalid");
        assert!(err.to_string().contains("replicas"), "{err}");
        std::fs::write(&file, "no_such_key = 1\n").expect("write");
        let err = CoordinatorConfig::load(Some(&file)).expect_err("unknown key");
        assert!(err.to_string().contains("no_such_key"), "{err}");
        let missing = dir.path().join("missing.toml");
        assert!(CoordinatorConfig::load(Some(&missing)).is_err());
    }

    #[test]
    fn the_heartbeat_floor_is_a_second_per_max_heartbeats_per_second_live_agents() {
        let mut config = CoordinatorConfig::default();
        assert_eq!(config.heartbeat_floor(0), Some(0));
        // Up to 10,000 agents the floor stays at or under the default 5 s interval.
        assert_eq!(config.heartbeat_floor(10_000), Some(5_000));
        assert_eq!(config.heartbeat_floor(100_000), Some(50_000));
        assert_eq!(config.heartbeat_floor(usize::MAX), Some(u64::MAX / 2_000));
        config.max_heartbeats_per_second = 0;
        assert_eq!(config.heartbeat_floor(100_000), None);
    }

    #[test]
    fn circuit_breakers_are_off_unless_configured_and_take_defaults() {
        assert_eq!(CoordinatorConfig::default().circuit_breaker, None);
        let dir = tempfile_dir();
        let file = dir.path().join("breaker.toml");
        std::fs::write(&file, "[circuit_breaker]\nfailures = 2\n").expect("write");
        let cfg = CoordinatorConfig::load(Some(&file)).expect("loads");
        let breaker = cfg.circuit_breaker.expect("configured");
        assert_eq!((breaker.failures, breaker.open_ms), (2, 30_000));
        assert_eq!(
            breaker.policy(),
            chorus_sdk::BreakerPolicy::new(2, Duration::from_secs(30))
        );
        std::fs::write(&file, "[circuit_breaker]\nfailures = 0\n").expect("write");
        let err = CoordinatorConfig::load(Some(&file)).expect_err("invalid");
        assert!(err.to_string().contains("circuit_breaker"), "{err}");
    }

    /// A directory of its own, removed when dropped.
    fn tempfile_dir() -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix("chorus-config-test-")
            .tempdir()
            .expect("temp dir")
    }
}
