//! An agent's settings from a TOML file (`docs/AGENT-CONFIG.md`), so an agent is configured as
//! the coordinator is: where the bus is and how to reach it (`[bus]`, `[transport]`), how it
//! delivers (`[reliability]`), signs and checks (`[security]`), and is watched
//! (`[monitoring]`). The Python SDK reads the same file with the same keys
//! (`Agent.from_config`). Every key is optional; an unknown key is refused by name, and file
//! paths are taken relative to the file.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::AgentOptions;
use crate::BrokerOptions;
use crate::error::SdkError;
use crate::protocol::codec::Encoding;
use crate::protocol::envelope::DeliveryClass;
use crate::security::ConnectionSecurity;
use crate::security::signing::SignaturePolicy;

/// The settings of one agent, as its configuration file has them.
///
/// ```
/// let config = chorus_sdk::AgentConfig::parse(r#"
///     id = "ledger"
///     [bus]
///     servers = "nats://127.0.0.1:4222"
///     groups = ["accounts"]
///     [reliability]
///     default_delivery = "exactly_once"
///     request_timeout_ms = 2000
/// "#).unwrap();
/// let options = config.options(None).unwrap();
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// The agent's id (the code may give it instead).
    pub id: Option<String>,
    /// The customer it is dedicated to (unset: every customer).
    pub customer: Option<String>,
    /// Where the bus is.
    pub bus: BusConfig,
    /// How the connection is secured: CA, client certificate and key, nkey seed file (the
    /// keys of `chorus serve`'s own `[security]`).
    pub transport: ConnectionSecurity,
    /// How it sends and how much it takes at once.
    pub reliability: ReliabilityConfig,
    /// Signing and signature checks.
    pub security: SecurityConfig,
    /// Heartbeats, usage reports, service discovery and where its metrics are.
    pub monitoring: MonitoringConfig,
    /// How its default batcher gathers messages (002's `flow_control`).
    pub batching: BatchingConfig,
}

/// `[batching]`: what [`Agent::default_batcher`](crate::Agent::default_batcher) (Python:
/// `agent.batcher()`) batches by.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BatchingConfig {
    /// The most messages a batch holds (002's `batch_size`; default 100).
    pub max_messages: Option<usize>,
    /// The longest a batch waits after its first message, in milliseconds (002's
    /// `batch_timeout`; default 5).
    pub max_delay_ms: Option<u64>,
}

/// `[bus]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BusConfig {
    /// NATS server URLs, comma-separated (default `nats://127.0.0.1:4222`).
    pub servers: Option<String>,
    /// The subject root (default `chorus`).
    pub root: Option<String>,
    /// `json`, `msgpack` or `compact` (default: the form the bus announces).
    pub encoding: Option<String>,
    /// Groups it joins.
    pub groups: Vec<String>,
}

/// `[reliability]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReliabilityConfig {
    /// `at_most_once`, `at_least_once` or `exactly_once`: the class of what it sends when a
    /// call does not say.
    pub default_delivery: Option<String>,
    /// How long a request waits for its reply, in milliseconds.
    pub request_timeout_ms: Option<u64>,
    /// Whether it keeps a durable inbox (default true).
    pub durable_inbox: Option<bool>,
    /// Handlers running at once.
    pub max_in_flight: Option<usize>,
    /// Hops a conversation may take before it is refused as a loop.
    pub hop_limit: Option<u8>,
    /// How long a shutdown waits for running handlers, in milliseconds.
    pub shutdown_timeout_ms: Option<u64>,
}

/// `[security]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SecurityConfig {
    /// Sign what it sends with the `[transport]` nkey seed (default: true when a seed is
    /// given).
    pub sign: Option<bool>,
    /// `off` (the default), `check` (a signed message's signature must hold) or `require`
    /// (unsigned messages are refused, 5014).
    pub verify_signatures: Option<String>,
    /// Take messages from senders whose key it does not know, when it checks signatures.
    pub trust_unverified_senders: Option<bool>,
}

/// `[monitoring]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MonitoringConfig {
    /// How often it says it is alive, in milliseconds (0: never; it is then not in the
    /// registry).
    pub heartbeat_interval_ms: Option<u64>,
    /// How often it reports what it handled, in milliseconds (0: usage is not counted).
    pub usage_interval_ms: Option<u64>,
    /// Whether it answers NATS service discovery (`$SRV`).
    pub service_discovery: Option<bool>,
    /// Where its process serves Prometheus metrics, announced for the coordinator's service
    /// discovery.
    pub metrics_url: Option<String>,
}

fn invalid(key: &str, why: impl std::fmt::Display) -> SdkError {
    SdkError::InvalidCall(format!("agent configuration: {key}: {why}"))
}

fn millis(ms: u64) -> Duration {
    Duration::from_millis(ms)
}

impl AgentConfig {
    /// Reads the configuration file at `path`; the `[transport]` files are taken relative to
    /// its directory.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] naming the file and why: it cannot be read, is not TOML, or
    /// has a key this version does not know (with its line).
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, SdkError> {
        let path = path.as_ref();
        let text =
            std::fs::read_to_string(path).map_err(|e| invalid(&path.display().to_string(), e))?;
        let mut config = Self::parse(&text)
            .map_err(|e| SdkError::InvalidCall(format!("{}: {e}", path.display())))?;
        let dir = path.parent().unwrap_or_else(|| Path::new(""));
        let transport = &mut config.transport;
        for file in [
            &mut transport.tls_ca,
            &mut transport.tls_cert,
            &mut transport.tls_key,
            &mut transport.nkey_seed_file,
        ]
        .into_iter()
        .flatten()
        {
            if file.is_relative() {
                *file = dir.join(&*file);
            }
        }
        Ok(config)
    }

    /// Parses a configuration from TOML text.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when it is not TOML or has a key this version does not know.
    pub fn parse(text: &str) -> Result<Self, SdkError> {
        toml::from_str(text).map_err(|e| {
            SdkError::InvalidCall(format!("agent configuration: {}", e.to_string().trim()))
        })
    }

    /// The agent options these settings make, for agent `id` (or the file's `id` when `None`).
    /// Further settings chain on as usual.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] naming the key: no id anywhere, a value out of its
    /// vocabulary, a seed file that cannot be read, a certificate without its key.
    pub fn options(&self, id: Option<&str>) -> Result<AgentOptions, SdkError> {
        let Some(id) = id.or(self.id.as_deref()) else {
            return Err(invalid(
                "id",
                "no agent id: give one in the file or the code",
            ));
        };
        let servers = match &self.bus.servers {
            Some(servers) => BrokerOptions::new([servers]),
            None => BrokerOptions::default(),
        };
        let broker = self
            .transport
            .apply(servers)
            .map_err(|e| invalid("transport", crate::Report(&e)))?;
        let mut options = AgentOptions::new(id).broker(broker);
        if let Some(root) = &self.bus.root {
            options = options.root(root.clone());
        }
        if let Some(encoding) = &self.bus.encoding {
            options = options.encoding(match encoding.as_str() {
                "json" => Encoding::Json,
                "msgpack" => Encoding::MsgPack,
                "compact" => Encoding::Compact,
                other => {
                    return Err(invalid(
                        "bus.encoding",
                        format!("{other:?} is not json, msgpack or compact"),
                    ));
                }
            });
        }
        for group in &self.bus.groups {
            options = options.group(group.clone());
        }
        if let Some(customer) = &self.customer {
            options = options.customer(customer.clone());
        }
        let mut batching = crate::Batching::new();
        if let Some(n) = self.batching.max_messages {
            batching = batching.max_messages(n);
        }
        if let Some(ms) = self.batching.max_delay_ms {
            batching = batching.max_delay(millis(ms));
        }
        batching.check().map_err(|e| match e {
            // Its message names `batching` and the bound already.
            SdkError::InvalidCall(why) => {
                SdkError::InvalidCall(format!("agent configuration: {why}"))
            }
            other => other,
        })?;
        options = options.batching(batching);
        let r = &self.reliability;
        if let Some(class) = &r.default_delivery {
            options = options.default_delivery(match class.as_str() {
                "at_most_once" => DeliveryClass::AtMostOnce,
                "at_least_once" => DeliveryClass::AtLeastOnce,
                "exactly_once" => DeliveryClass::ExactlyOnce,
                other => {
                    return Err(invalid(
                        "reliability.default_delivery",
                        format!("{other:?} is not at_most_once, at_least_once or exactly_once"),
                    ));
                }
            });
        }
        if let Some(ms) = r.request_timeout_ms {
            options = options.request_timeout(millis(ms));
        }
        if let Some(on) = r.durable_inbox {
            options = options.durable_inbox(on);
        }
        if let Some(n) = r.max_in_flight {
            options = options.max_in_flight(n);
        }
        if let Some(limit) = r.hop_limit {
            options = options.hop_limit(limit);
        }
        if let Some(ms) = r.shutdown_timeout_ms {
            options = options.shutdown_timeout(millis(ms));
        }
        let s = &self.security;
        let seed = self.transport.nkey_seed_file.is_some();
        if s.sign.unwrap_or(seed) {
            let identity = self
                .transport
                .identity()
                .map_err(|e| invalid("transport.nkey_seed_file", crate::Report(&e)))?
                .ok_or_else(|| {
                    invalid("security.sign", "signing needs transport.nkey_seed_file")
                })?;
            options = options.identity(identity);
        }
        if let Some(verify) = &s.verify_signatures {
            let require_signed = match verify.as_str() {
                "off" => None,
                "check" => Some(false),
                "require" => Some(true),
                other => {
                    return Err(invalid(
                        "security.verify_signatures",
                        format!("{other:?} is not off, check or require"),
                    ));
                }
            };
            if let Some(require_signed) = require_signed {
                options = options.verify_signatures(SignaturePolicy {
                    require_signed,
                    ..SignaturePolicy::default()
                });
            }
        }
        if let Some(on) = s.trust_unverified_senders {
            options = options.trust_unverified_senders(on);
        }
        let m = &self.monitoring;
        if let Some(ms) = m.heartbeat_interval_ms {
            options = options.heartbeat_interval(millis(ms));
        }
        if let Some(ms) = m.usage_interval_ms {
            options = options.usage_interval(millis(ms));
        }
        if let Some(on) = m.service_discovery {
            options = options.service_discovery(on);
        }
        if let Some(url) = &m.metrics_url {
            options = options.metrics_url(url.clone());
        }
        Ok(options)
    }
}

impl AgentOptions {
    /// The options of the agent configuration file at `path` (`docs/AGENT-CONFIG.md`), whose
    /// `id` names the agent; further settings chain on as usual.
    ///
    /// ```no_run
    /// # async fn run() -> Result<(), chorus_sdk::SdkError> {
    /// let agent = chorus_sdk::AgentOptions::from_file("agent.toml")?.connect().await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// As [`AgentConfig::from_file`] and [`AgentConfig::options`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, SdkError> {
        AgentConfig::from_file(path)?.options(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_key_is_refused_by_name_and_a_bad_value_names_its_key() {
        let err = AgentConfig::parse("[reliability]\nretries = 3\n").expect_err("refused");
        assert!(err.to_string().contains("retries"), "{err}");
        let config =
            AgentConfig::parse("id = \"a\"\n[bus]\nencoding = \"xml\"\n").expect("as expected");
        let err = config.options(None).expect_err("refused");
        assert!(err.to_string().contains("bus.encoding"), "{err}");
        let config = AgentConfig::parse("[reliability]\ndefault_delivery = \"often\"\n")
            .expect("as expected");
        let err = config.options(Some("a")).expect_err("refused");
        assert!(
            err.to_string().contains("reliability.default_delivery"),
            "{err}"
        );
        let err = AgentConfig::default().options(None).expect_err("refused");
        assert!(err.to_string().contains("no agent id"), "{err}");
        let config = AgentConfig::parse("[security]\nsign = true\n").expect("as expected");
        let err = config.options(Some("a")).expect_err("refused");
        assert!(err.to_string().contains("nkey_seed_file"), "{err}");
    }

    #[test]
    fn the_code_s_id_wins_and_every_section_reaches_the_options() {
        let config = AgentConfig::parse(
            "id = \"from-file\"\n\
             [bus]\nroot = \"other\"\nencoding = \"compact\"\ngroups = [\"g1\", \"g2\"]\n\
             [reliability]\ndefault_delivery = \"exactly_once\"\nrequest_timeout_ms = 1500\n\
             durable_inbox = false\nmax_in_flight = 7\nhop_limit = 4\n\
             [security]\nverify_signatures = \"require\"\n\
             [monitoring]\nheartbeat_interval_ms = 250\nservice_discovery = false\n\
             [batching]\nmax_messages = 20\nmax_delay_ms = 40\n",
        )
        .expect("as expected");
        let options = config.options(Some("from-code")).expect("as expected");
        assert_eq!(options.id, "from-code");
        assert_eq!(options.root, "other");
        assert_eq!(options.encoding, Some(Encoding::Compact));
        assert_eq!(options.groups, ["g1", "g2"]);
        assert_eq!(options.default_delivery, DeliveryClass::ExactlyOnce);
        assert_eq!(options.request_timeout, Duration::from_millis(1500));
        assert!(!options.durable_inbox);
        assert_eq!(options.max_in_flight, 7);
        assert_eq!(options.hop_limit, 4);
        assert!(
            options
                .signature_policy
                .as_ref()
                .is_some_and(|p| p.require_signed)
        );
        assert_eq!(options.heartbeat_interval, Duration::from_millis(250));
        assert!(!options.service_discovery);
        assert_eq!(
            options.batching,
            crate::Batching::new()
                .max_messages(20)
                .max_delay(Duration::from_millis(40))
        );
        let dedicated = AgentConfig::parse("customer = \"acme\"\n").expect("as expected");
        let options = dedicated.options(Some("a")).expect("as expected");
        assert_eq!(options.customer.as_deref(), Some("acme"));
        assert_eq!(options.batching, crate::Batching::new(), "the defaults");
    }

    #[test]
    fn batching_out_of_bounds_is_refused_by_its_key() {
        for bad in [
            "max_messages = 0",
            "max_messages = 10001",
            "max_delay_ms = 0",
            "max_delay_ms = 60001",
        ] {
            let config = AgentConfig::parse(&format!("[batching]\n{bad}\n")).expect("TOML");
            let err = config.options(Some("a")).expect_err("refused");
            assert!(err.to_string().contains("batching"), "{bad}: {err}");
        }
        let err = AgentConfig::parse("[batching]\nbatch_size = 3\n").expect_err("refused");
        assert!(err.to_string().contains("batch_size"), "{err}");
    }
}
