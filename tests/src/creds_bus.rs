//! Helpers for a bus whose users are `chorus creds` entries: connecting as one of them, and
//! asking the server what a JetStream API call did.

use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::{Broker, BrokerOptions, Credentials};
use chorus_sdk::security::Identity;

use crate::{WAIT, within};

/// How long a call waits for the server's answer: a refused publish gets none.
pub const ANSWER: Duration = Duration::from_secs(2);

/// Connects to `url` as `id`, with `key`'s nkey, its replies on `_INBOX.<id>`.
pub async fn connect(url: &str, id: &str, key: &Identity) -> Broker {
    within(
        WAIT,
        "connect",
        BrokerOptions::new([url])
            .credentials(Credentials::NKeySeed(key.seed().expect("seed")))
            .inbox_prefix(format!("_INBOX.{id}"))
            .connect(),
    )
    .await
    .unwrap_or_else(|e| panic!("{id} connects: {e}"))
}

/// Whether the server answered `subject` (an allowed call gets an answer, even an error one;
/// a refused publish gets none).
pub async fn answered(broker: &Broker, subject: &str, body: &str) -> bool {
    broker
        .request(subject, None, Bytes::from(body.to_owned()), ANSWER)
        .await
        .is_ok()
}

/// The answer of a JetStream API call the caller may make, as JSON.
async fn info(admin: &Broker, subject: &str) -> serde_json::Value {
    let reply = admin
        .request(subject, None, Bytes::new(), WAIT)
        .await
        .unwrap_or_else(|e| panic!("{subject}: {e}"));
    serde_json::from_slice(reply.payload()).expect("JSON")
}

/// The number of messages in `stream`, as `admin` (the coordinator's user) sees it.
pub async fn messages(admin: &Broker, stream: &str) -> u64 {
    let info = info(admin, &format!("$JS.API.STREAM.INFO.{stream}")).await;
    info["state"]["messages"]
        .as_u64()
        .unwrap_or_else(|| panic!("no state in {info}"))
}

/// Whether `stream` has the consumer `consumer`, as `admin` sees it.
pub async fn consumer_exists(admin: &Broker, stream: &str, consumer: &str) -> bool {
    let info = info(admin, &format!("$JS.API.CONSUMER.INFO.{stream}.{consumer}")).await;
    info.get("error").is_none()
}

/// Names `admin` the coordinator's one admin, whose commands count only signed with
/// `public_key` (as SECURITY.md's walk-through configures `ops`).
pub fn signing_admin(
    config: &mut chorus_coordinator::CoordinatorConfig,
    admin: &str,
    public_key: String,
) {
    config.authority = chorus_coordinator::authority::AuthorityConfig {
        admins: vec![admin.to_owned()],
        operators: Vec::new(),
        require_signed: Some(true),
    };
    config.trusted_keys.insert(admin.to_owned(), public_key);
}
