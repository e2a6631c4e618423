//! `chorus creds`: a NATS identity for one agent (an nkey user) and the `nats.conf`
//! authorization entry that confines it to its own subjects.
//!
//! Chorus uses nkey users in the server's `authorization` block rather than operator/account
//! JWTs: a single bus is one account, the entries are plain text an operator can read and
//! review, and `nats-server -t` checks them. Deployments that need several accounts or
//! central revocation can move to JWTs (`nsc`) with the same permission sets.

use chorus_sdk::Subjects;
use chorus_sdk::durable::{
    ADVISORY_STREAM, CONFIG_BUCKET, DLQ_STREAM, IDEMPOTENCY_BUCKET, INBOX_STREAM,
};
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

/// JetStream API calls no role below the coordinator makes on any stream: they copy out or
/// overwrite a whole stream, or move its leaders and peers. Denied (a deny wins over an allow
/// in nats-server) wherever a role may call the JetStream API.
pub const JETSTREAM_NEVER: [&str; 8] = [
    "$JS.API.STREAM.SNAPSHOT.>",
    "$JS.API.STREAM.RESTORE.>",
    "$JS.API.STREAM.LEADER.>",
    "$JS.API.STREAM.PEER.>",
    "$JS.API.CONSUMER.LEADER.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
    "$JS.API.ACCOUNT.PURGE.>",
];

/// The bus's streams by name (the stream of each key-value bucket among them), as `root`
/// names them: what the deny list of [`publish_denied`] keeps out of reach.
fn bus_streams(subjects: &Subjects) -> Vec<(String, StreamUse)> {
    let kv = |bucket: &str| format!("KV_{}", subjects.bucket_name(bucket));
    vec![
        (subjects.stream_name(INBOX_STREAM), StreamUse::Fixed),
        (subjects.stream_name(DLQ_STREAM), StreamUse::DeadLetters),
        (subjects.stream_name(ADVISORY_STREAM), StreamUse::Fixed),
        (
            subjects.stream_name(chorus_sdk::task::TASK_STREAM),
            StreamUse::Fixed,
        ),
        (
            subjects.stream_name(chorus_sdk::usage::USAGE_STREAM),
            StreamUse::Fixed,
        ),
        (
            subjects.stream_name(chorus_sdk::audit::AUDIT_STREAM),
            StreamUse::Fixed,
        ),
        (kv(REGISTRY_BUCKET), StreamUse::Fixed),
        (kv(CONFIG_BUCKET), StreamUse::Fixed),
        (kv(chorus_sdk::credits::CREDITS_BUCKET), StreamUse::Fixed),
        (
            kv(chorus_host::protocol::DEPLOYMENTS_BUCKET),
            StreamUse::Fixed,
        ),
        (kv(chorus_host::protocol::HOSTS_BUCKET), StreamUse::Fixed),
        // Agents make these two if they are missing (create or update): their settings stay
        // theirs to set, their contents not to purge.
        (kv(IDEMPOTENCY_BUCKET), StreamUse::MadeByAgents),
        (kv(SEEN_BUCKET), StreamUse::MadeByAgents),
    ]
}

/// Who may reshape or empty a stream, besides the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamUse {
    /// Nobody.
    Fixed,
    /// The dead-letter queue: an operator with `--dlq` purges it and removes entries.
    DeadLetters,
    /// A bucket agents create or update when missing (never purge or delete).
    MadeByAgents,
}

/// The JetStream API calls `role` may not make, although its `$JS.API.>` allows the rest: no
/// agent or CLI user purges, deletes or updates the bus's streams or removes their messages
/// (the dead-letter queue's purge and removals are `--dlq`'s), and none calls
/// [`JETSTREAM_NEVER`]. Empty for a role without the JetStream API.
///
/// # Errors
/// As [`permissions`].
pub fn publish_denied(subjects: &Subjects, role: &Role) -> Result<Vec<String>> {
    let (publish, _) = permissions(subjects, role)?;
    if !publish.iter().any(|p| p == JETSTREAM_API) {
        return Ok(Vec::new());
    }
    let mut denied: Vec<String> = JETSTREAM_NEVER.iter().map(|s| (*s).to_owned()).collect();
    for (stream, kind) in bus_streams(subjects) {
        denied.push(format!("$JS.API.STREAM.DELETE.{stream}"));
        if kind != StreamUse::MadeByAgents {
            denied.push(format!("$JS.API.STREAM.UPDATE.{stream}"));
        }
        if !(kind == StreamUse::DeadLetters && role.dlq) {
            denied.push(format!("$JS.API.STREAM.PURGE.{stream}"));
            denied.push(format!("$JS.API.STREAM.MSG.DELETE.{stream}"));
        }
    }
    Ok(denied)
}

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
        // Audit records under its own id only (a gateway identity's callers' writes, the
        // console's people's actions): no one writes in another's name.
        chorus_sdk::audit::audit_of(subjects, id)?,
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
    let denied = publish_denied(subjects, role)?;
    let deny = if denied.is_empty() {
        String::new()
    } else {
        format!(", deny: [{}]", quote(&denied))
    };
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
        "# {what} {}\n{{ nkey: \"{public_key}\", permissions: {{ publish: {{ allow: [{}]{deny} }}, subscribe: {{ allow: [{}] }}{responses} }} }}",
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
    // The coordinator's id is a valid token, so its inbox always builds; and the web console's,
    // the bus's own agent, which the gateway in the coordinator's process runs on this user.
    all.extend(subjects.inbox_all(COORDINATOR_ID).ok());
    all.extend(subjects.inbox_all(chorus_sdk::registry::CONSOLE_ID).ok());
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
