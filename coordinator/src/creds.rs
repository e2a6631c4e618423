//! `chorus creds`: a NATS identity for one agent (an nkey user) and the `nats.conf`
//! authorization entry that confines it to its own subjects.
//!
//! Chorus uses nkey users in the server's `authorization` block rather than operator/account
//! JWTs: a single bus is one account, the entries are plain text an operator can read and
//! review, and `nats-server -t` checks them. Deployments that need several accounts or
//! central revocation can move to JWTs (`nsc`) with the same permission sets.

use chorus_sdk::Subjects;
use chorus_sdk::durable::{IDEMPOTENCY_BUCKET, INBOX_STREAM};
use chorus_sdk::security::SEEN_BUCKET;
use chorus_sdk::task::TaskMessage;

use crate::error::{Error, ErrorKind, Result};
use crate::service::{COORDINATOR_ID, REGISTRY_BUCKET};

/// The JetStream API: what an agent with a durable inbox calls to set up its consumer.
pub const JETSTREAM_API: &str = "$JS.API.>";
/// JetStream's advisories and events.
pub const JETSTREAM_EVENTS: &str = "$JS.EVENT.>";
/// Everything JetStream, for the coordinator.
pub const JETSTREAM_ALL: &str = "$JS.>";
/// Every key-value bucket, for the coordinator.
pub const KV_ALL: &str = "$KV.>";
/// Every object store bucket's chunks and metadata (the payload sweep removes objects).
pub const OBJECTS_ALL: &str = "$O.>";
/// Every reply subject of every client (`chorus tap` shows replies).
pub const ALL_REPLIES: &str = "_INBOX.>";
/// The service API (`$SRV.PING`, `$SRV.INFO`, ...) every agent answers.
pub const SERVICE_API: &str = "$SRV.>";

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
    /// Whether it submits, works on or watches tasks (JetStream rights, the task subjects).
    pub tasks: bool,
    /// A `chorus` CLI user rather than an agent: it calls, sends, broadcasts and listens as
    /// `agent` (`chorus --id <agent>`), but never registers, so it has no heartbeat, goodbye,
    /// command subject, capability access points or service-discovery rights.
    pub cli: bool,
    /// It reads and acts on the dead-letter queue (`chorus dlq`): the JetStream API, and the
    /// exactly-once records a replay of an uncertain message clears.
    pub dlq: bool,
    /// It watches all traffic (`chorus tap`): every subject under the root, and every reply
    /// (`_INBOX.>`). For an operator: it reads what every agent sends and receives.
    pub tap: bool,
    /// Synadia Agent Protocol agents it registers (a gateway edge identity with
    /// `[[gateway.sap]]` bindings), each `<agent>.<owner>.<session>`: their `prompt` and
    /// `status` subjects, their heartbeat subject, and answers of many messages per prompt.
    pub sap: Vec<String>,
}

/// Replies one request may get from an agent that streams SAP answers (`allow_responses`).
pub const SAP_MAX_RESPONSES: u64 = 100_000;

/// `<agent>.<owner>.<session>` of an SAP agent, checked: three tokens of lowercase letters,
/// digits, `-` (and `_` in the owner and session).
fn sap_name(name: &str) -> std::result::Result<&str, String> {
    let token = |t: &str, extra: &str| {
        !t.is_empty()
            && t.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || extra.contains(c))
    };
    match name.split('.').collect::<Vec<_>>().as_slice() {
        [agent, owner, session]
            if token(agent, "-") && token(owner, "-_") && token(session, "-_") =>
        {
            Ok(name)
        }
        _ => Err(format!(
            "--sap takes <agent>.<owner>.<session> (lowercase letters, digits, '-', and '_' after the agent), not {name:?}"
        )),
    }
}

fn quote(list: &[String]) -> String {
    list.iter()
        .map(|s| format!("\"{s}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The permission lists (publish, subscribe) of `role`.
///
/// # Errors
/// An invalid-input error when the role's agent id, a capability, a topic pattern, a `calls` target
/// or an SAP name is malformed, or a CLI user is given SAP agents.
pub fn permissions(subjects: &Subjects, role: &Role) -> Result<(Vec<String>, Vec<String>)> {
    permissions_of(subjects, role).map_err(Error::wrap(
        ErrorKind::InvalidInput,
        format!("no permissions for agent {:?}", role.agent),
    ))
}

type Lists = (Vec<String>, Vec<String>);

fn permissions_of(
    subjects: &Subjects,
    role: &Role,
) -> std::result::Result<Lists, Box<dyn std::error::Error + Send + Sync>> {
    let id = &role.agent;
    let mut publish = Vec::new();
    if !role.cli {
        publish.push(subjects.heartbeat(id)?);
        publish.push(subjects.goodbye(id)?);
        // Its usage reports (the stream's ack comes to its inbox).
        publish.push(subjects.usage(id)?);
    }
    publish.extend([
        subjects.discover(),
        subjects.broadcasts(),
        // Its own inbox: the SDK confirms subscriptions by messaging itself.
        subjects.inbox_all(id)?,
    ]);
    // Payloads carried by reference (the object store bucket), and the registry entries
    // that say which readers take compressed payloads.
    publish.extend(chorus_sdk::payload::payload_permissions(subjects));
    let registry = format!("KV_{}", subjects.bucket_name(REGISTRY_BUCKET));
    publish.push(format!("$JS.API.STREAM.INFO.{registry}"));
    publish.push(format!("$JS.API.DIRECT.GET.{registry}.>"));
    publish.push(format!("$JS.API.STREAM.MSG.GET.{registry}"));
    if role.calls.is_empty() {
        publish.push(subjects.commands_all());
        publish.push(subjects.capabilities_all());
        publish.push(format!("{}.agent.*.cap.>", subjects.root()));
        publish.push(format!("{}.agent.*.bid.>", subjects.root()));
        publish.push(subjects.durable_all());
    } else {
        for target in &role.calls {
            if let Some(agent) = target.strip_prefix("agent:") {
                publish.push(subjects.agent_inbound(agent)?);
                publish.push(subjects.capabilities_at(agent)?);
                publish.push(subjects.durable_agent_all(agent)?);
            } else if let Some(cap) = target.strip_prefix("cap:") {
                publish.push(subjects.capability(cap)?);
                // The same capability at one holder (a task retried or reassigned).
                publish.push(format!("{}.agent.*.cap.{cap}", subjects.root()));
                // Calls for proposals for it (contract-net).
                publish.push(format!("{}.agent.*.bid.{cap}", subjects.root()));
            } else {
                return Err(format!(
                    "--calls takes agent:<id> or cap:<capability>, not {target:?}"
                )
                .into());
            }
        }
    }
    let all_events = subjects.event_pattern(">")?;
    if role.publishes.is_empty() {
        publish.push(all_events.clone());
    } else {
        for topic in &role.publishes {
            publish.push(subjects.event_pattern(topic)?);
        }
    }
    let mut subscribe = vec![subjects.inbox_all(id)?];
    if !role.cli {
        subscribe.push(subjects.agent_inbound(id)?);
        // The coordinator's announcement of the bus's protocol level.
        subscribe.push(subjects.wire());
        subscribe.push(SERVICE_API.to_owned());
        for cap in &role.serves {
            subscribe.push(subjects.capability(cap)?);
            subscribe.push(subjects.capability_at(id, cap)?);
            subscribe.push(subjects.bid(id, cap)?);
        }
    }
    if role.listens.is_empty() {
        subscribe.push(all_events);
    } else {
        for topic in &role.listens {
            subscribe.push(subjects.event_pattern(topic)?);
        }
    }
    if role.durable {
        // The JetStream API for its consumer and the bus's streams, acks of its deliveries,
        // dead letters it writes, exactly-once records and seen message ids.
        publish.push(JETSTREAM_API.to_owned());
        publish.push(subjects.stream_acks(INBOX_STREAM));
        publish.push(subjects.dead_letters());
        publish.push(subjects.bucket_keys(IDEMPOTENCY_BUCKET, id)?);
        // Seen message ids, for replay protection across restarts.
        publish.push(subjects.bucket_keys(SEEN_BUCKET, id)?);
        subscribe.push(JETSTREAM_EVENTS.to_owned());
    }
    if role.dlq {
        if !role.durable && !role.tasks {
            publish.push(JETSTREAM_API.to_owned());
        }
        // A replayed uncertain message's interrupted claim, of any agent.
        publish.push(format!(
            "$KV.{}.>",
            subjects.bucket_name(IDEMPOTENCY_BUCKET)
        ));
    }
    if role.tap {
        subscribe.push(subjects.everything());
        subscribe.push(ALL_REPLIES.to_owned());
    }
    if role.tasks {
        // The task stream's API and every task subject: a submission, a state, progress, a
        // chunk, an answer or a cancel may come from either side of a task, and task ids are
        // not known in advance (signatures tell the writers apart, SECURITY.md).
        if !role.durable && !role.dlq {
            publish.push(JETSTREAM_API.to_owned());
        }
        publish.push(subjects.tasks_all());
        // A worker hears its tasks' cancels and answers.
        subscribe.push(subjects.tasks_of_kind(TaskMessage::Cancel));
        subscribe.push(subjects.tasks_of_kind(TaskMessage::Input));
    }
    for name in &role.sap {
        let name = sap_name(name)?;
        subscribe.push(format!("agents.prompt.{name}"));
        subscribe.push(format!("agents.status.{name}"));
        publish.push(format!("agents.hb.{name}"));
        if role.cli {
            return Err("--sap is for an agent (a gateway identity), not a CLI user".into());
        }
    }
    Ok((publish, subscribe))
}

/// The `nats.conf` user entry for `role` with nkey `public_key`.
///
/// # Errors
/// An invalid-input error when the role's agent id, a capability, a topic pattern, a `calls` target
/// or an SAP name is malformed, or a CLI user is given SAP agents.
pub fn authorization_entry(subjects: &Subjects, role: &Role, public_key: &str) -> Result<String> {
    let (publish, subscribe) = permissions(subjects, role)?;
    let sap_responses = format!(", allow_responses: {{ max: {SAP_MAX_RESPONSES} }}");
    let (what, responses) = if role.cli {
        ("CLI user", "")
    } else if !role.sap.is_empty() {
        // An SAP answer is a stream: an ack, chunks and a terminator to one reply subject.
        ("agent", sap_responses.as_str())
    } else {
        ("agent", ", allow_responses: true")
    };
    Ok(format!(
        "# {what} {}\n{{ nkey: \"{public_key}\", permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }}{responses} }} }}",
        role.agent,
        quote(&publish),
        quote(&subscribe)
    ))
}

/// The coordinator's entry: the whole bus under its root, JetStream, and its own inbox.
pub fn coordinator_entry(subjects: &Subjects, public_key: &str) -> String {
    let mut all = vec![
        subjects.everything(),
        JETSTREAM_ALL.to_owned(),
        KV_ALL.to_owned(),
        OBJECTS_ALL.to_owned(),
    ];
    // The coordinator's id is a valid token, so its inbox always builds.
    all.extend(subjects.inbox_all(COORDINATOR_ID).ok());
    format!(
        "# the coordinator\n{{ nkey: \"{public_key}\", permissions: {{ publish: {{ allow: [{}] }}, subscribe: {{ allow: [{}] }}, allow_responses: true }} }}",
        quote(&all),
        quote(&all)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn role(sap: &[&str]) -> Role {
        Role {
            agent: "web-ui".into(),
            sap: sap.iter().map(|s| (*s).to_owned()).collect(),
            ..Role::default()
        }
    }

    #[test]
    fn an_sap_identity_may_serve_its_prompts_heartbeat_and_stream_answers() {
        let subjects = Subjects::default();
        let (publish, subscribe) =
            permissions(&subjects, &role(&["drafter.chorus.default"])).expect("permissions");
        assert!(publish.contains(&"agents.hb.drafter.chorus.default".to_owned()));
        for s in [
            "agents.prompt.drafter.chorus.default",
            "agents.status.drafter.chorus.default",
        ] {
            assert!(subscribe.contains(&s.to_owned()), "{s}");
        }
        let entry = authorization_entry(&subjects, &role(&["drafter.chorus.default"]), "UKEY")
            .expect("entry");
        assert!(
            entry.contains("allow_responses: { max: 100000 }"),
            "{entry}"
        );
        let plain = authorization_entry(&subjects, &role(&[]), "UKEY").expect("entry");
        assert!(
            plain.contains("allow_responses: true") && !plain.contains("agents."),
            "{plain}"
        );
    }

    #[test]
    fn a_bad_sap_name_is_refused_saying_what_it_takes() {
        for bad in [
            "drafter",
            "drafter.chorus",
            "Drafter.chorus.default",
            "a.b.c.d",
            "a..c",
            "a_b.c.d",
        ] {
            let err = permissions(&Subjects::default(), &role(&[bad])).expect_err(bad);
            assert!(err.to_string().contains("no permissions"), "{err}");
        }
        let cli = Role {
            cli: true,
            ..role(&["drafter.chorus.default"])
        };
        assert!(permissions(&Subjects::default(), &cli).is_err());
    }
}
