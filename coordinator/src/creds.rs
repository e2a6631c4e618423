//! `chorus creds`: a NATS identity for one agent (an nkey user) and the `nats.conf`
//! authorization entry that confines it to its own subjects.
//!
//! Chorus uses nkey users in the server's `authorization` block rather than operator/account
//! JWTs: a single bus is one account, the entries are plain text an operator can read and
//! review, and `nats-server -t` checks them. Deployments that need several accounts or
//! central revocation can move to JWTs (`nsc`) with the same permission sets.

use agent_sdk::Subjects;

/// What one agent may do.
#[derive(Debug, Clone, Default)]
pub struct Role {
    /// The agent's id.
    pub agent: String,
    /// Capabilities it serves (it may subscribe to their access points).
    pub serves: Vec<String>,
    /// Agents and capabilities it may call (`agent:<id>` or `cap:<name>`); empty: any.
    pub calls: Vec<String>,
    /// Event topic patterns it may publish; empty: any.
    pub publishes: Vec<String>,
    /// Event topic patterns it may subscribe to; empty: any.
    pub listens: Vec<String>,
    /// Whether it has a durable inbox (JetStream rights).
    pub durable: bool,
}

fn quote(list: &[String]) -> String {
    list.iter()
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The permission lists (publish, subscribe) of `role`.
pub fn permissions(subjects: &Subjects, role: &Role) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    agent_sdk::subject::validate_token("agent id", &role.agent)?;
    let root = subjects.root();
    let id = &role.agent;
    let mut publish = vec![
        subjects.heartbeat(id)?,
        subjects.goodbye(id)?,
        subjects.discover(),
        format!("{root}.bcast.>"),
        // Its own inbox: the SDK confirms subscriptions by messaging itself.
        format!("_INBOX.{id}.>"),
    ];
    if role.calls.is_empty() {
        publish.push(format!("{root}.agent.*.*"));
        publish.push(format!("{root}.cap.>"));
        publish.push(format!("{root}.inbox.>"));
    } else {
        for target in &role.calls {
            if let Some(agent) = target.strip_prefix("agent:") {
                publish.push(format!("{root}.agent.{agent}.*"));
                publish.push(format!("{root}.inbox.{agent}.>"));
            } else if let Some(cap) = target.strip_prefix("cap:") {
                publish.push(subjects.capability(cap)?);
            } else {
                anyhow::bail!("--calls takes agent:<id> or cap:<capability>, not {target:?}");
            }
        }
    }
    if role.publishes.is_empty() {
        publish.push(format!("{root}.evt.>"));
    } else {
        for topic in &role.publishes {
            publish.push(subjects.event_pattern(topic)?);
        }
    }
    let mut subscribe = vec![
        subjects.agent_inbound(id)?,
        format!("_INBOX.{id}.>"),
        "$SRV.>".to_owned(),
    ];
    for cap in &role.serves {
        subscribe.push(subjects.capability(cap)?);
    }
    if role.listens.is_empty() {
        subscribe.push(format!("{root}.evt.>"));
    } else {
        for topic in &role.listens {
            subscribe.push(subjects.event_pattern(topic)?);
        }
    }
    if role.durable {
        // The JetStream API for its consumer and the bus's streams, acks of its deliveries,
        // dead letters it writes, and exactly-once records.
        publish.push("$JS.API.>".to_owned());
        publish.push(format!("$JS.ACK.{}.>", subjects.stream_name("INBOX")));
        publish.push(format!("{root}.dlq.>"));
        publish.push(format!(
            "$KV.{}.{id}.>",
            subjects.bucket_name("idempotency")
        ));
        subscribe.push("$JS.EVENT.>".to_owned());
    }
    Ok((publish, subscribe))
}

/// The `nats.conf` user entry for `role` with nkey `public_key`.
pub fn authorization_entry(
    subjects: &Subjects,
    role: &Role,
    public_key: &str,
) -> anyhow::Result<String> {
    let (publish, subscribe) = permissions(subjects, role)?;
    Ok(format!(
        "# agent {}\n{{ nkey: \"{public_key}\", permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }}, allow_responses: true }} }}",
        role.agent,
        quote(&publish),
        quote(&subscribe)
    ))
}

/// The coordinator's entry: the whole bus under its root, JetStream, and its own inbox.
pub fn coordinator_entry(subjects: &Subjects, public_key: &str) -> String {
    let root = subjects.root();
    let all = vec![
        format!("{root}.>"),
        "$JS.>".to_owned(),
        "$KV.>".to_owned(),
        "_INBOX.coordinator.>".to_owned(),
    ];
    format!(
        "# the coordinator\n{{ nkey: \"{public_key}\", permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }}, allow_responses: true }} }}",
        quote(&all),
        quote(&all)
    )
}
