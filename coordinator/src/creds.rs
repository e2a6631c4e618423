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

/// `$JS.API.<call>`.
fn api(call: &str) -> String {
    format!("$JS.API.{call}")
}

/// The calls that read stream `stream` and its messages, and make it when it is missing: a
/// create of a stream that exists with another configuration fails, so no caller reshapes it.
fn read_or_make(stream: &str) -> [String; 4] {
    [
        api(&format!("STREAM.INFO.{stream}")),
        api(&format!("STREAM.CREATE.{stream}")),
        api(&format!("STREAM.MSG.GET.{stream}")),
        api(&format!("DIRECT.GET.{stream}.>")),
    ]
}

/// The calls that read stream `stream` through short-lived consumers of the reader's own:
/// ephemeral (named by the server) or named once (`follow_<nuid>`), created, pulled from and
/// removed. A reader may so also remove another reader's short-lived consumer on that stream
/// (nats-server cannot tell them apart): that reader's listing ends early, or its ordered
/// consumer is made again; no message is lost. Never granted on the inbox stream, whose
/// consumers are the agents' durable ones.
fn short_lived_consumers(stream: &str) -> [String; 5] {
    [
        api(&format!("CONSUMER.CREATE.{stream}")),
        api(&format!("CONSUMER.CREATE.{stream}.>")),
        api(&format!("CONSUMER.INFO.{stream}.*")),
        api(&format!("CONSUMER.MSG.NEXT.{stream}.*")),
        api(&format!("CONSUMER.DELETE.{stream}.*")),
    ]
}

/// The calls on consumer `name` of stream `stream` that its owner makes: create or update it
/// (with its filter in the subject, as clients since nats-server 2.9 do, or without), read
/// its state, pull, remove it, and acknowledge its deliveries.
fn own_consumer(stream: &str, name: &str) -> [String; 7] {
    [
        api(&format!("CONSUMER.CREATE.{stream}.{name}")),
        api(&format!("CONSUMER.CREATE.{stream}.{name}.>")),
        api(&format!("CONSUMER.DURABLE.CREATE.{stream}.{name}")),
        api(&format!("CONSUMER.INFO.{stream}.{name}")),
        api(&format!("CONSUMER.MSG.NEXT.{stream}.{name}")),
        api(&format!("CONSUMER.DELETE.{stream}.{name}")),
        format!("$JS.ACK.{stream}.{name}.>"),
    ]
}

/// The JetStream API calls `role` may make, each named: an allow list, so anything not in it
/// (deleting, updating or purging a stream, snapshots, restores, leader moves, another
/// agent's inbox consumer, reading the inbox by sequence) is refused by the server.
///
/// - every entry: the account's limits (`$JS.API.INFO`); reads and watches of the registry
///   bucket; the payload bucket's calls that store, find and read an object (no purge, no
///   removal: the coordinator sweeps expired objects).
/// - `--durable`: its own two inbox consumers (`<id>`, `<id>_high`) and their acks; reads of
///   the inbox, dead-letter and advisory streams (made when missing) and of the retry
///   settings; the exactly-once and seen-id buckets, made when missing, read and written
///   under its own id.
/// - `--tasks`: the task stream, read, made when missing, and followed through short-lived
///   consumers.
/// - `--dlq`: the dead-letter queue read, its letters removed, the queue purged; the
///   exactly-once records of any agent (a replayed uncertain message clears its claim); the
///   audit trail read.
///
/// # Errors
/// An invalid-input error when the role's agent id is not a valid token.
pub fn jetstream_calls(subjects: &Subjects, role: &Role) -> Result<Vec<String>> {
    jetstream_calls_of(subjects, role).map_err(Error::wrap(
        ErrorKind::InvalidInput,
        format!("no JetStream rights for agent {:?}", role.agent),
    ))
}

fn jetstream_calls_of(
    subjects: &Subjects,
    role: &Role,
) -> std::result::Result<Vec<String>, Box<dyn std::error::Error + Send + Sync>> {
    let id = &role.agent;
    let kv = |bucket: &str| format!("KV_{}", subjects.bucket_name(bucket));
    let mut calls = vec![api("INFO")];
    // The registry: keys to verify signatures with, which readers take compressed payloads.
    let registry = kv(REGISTRY_BUCKET);
    calls.extend([
        api(&format!("STREAM.INFO.{registry}")),
        api(&format!("STREAM.MSG.GET.{registry}")),
        api(&format!("DIRECT.GET.{registry}.>")),
        api(&format!("CONSUMER.CREATE.{registry}")),
        api(&format!("CONSUMER.CREATE.{registry}.>")),
        api(&format!("CONSUMER.INFO.{registry}.*")),
    ]);
    calls.extend(chorus_sdk::payload::payload_permissions(subjects, id)?);
    if role.durable || role.gateway {
        let inbox = subjects.stream_name(INBOX_STREAM);
        for stream in [
            inbox.clone(),
            subjects.stream_name(DLQ_STREAM),
            subjects.stream_name(ADVISORY_STREAM),
        ] {
            calls.push(api(&format!("STREAM.INFO.{stream}")));
            calls.push(api(&format!("STREAM.CREATE.{stream}")));
        }
        // A token check first: a consumer name is the agent id.
        subjects.durable_agent_all(id)?;
        for name in [id.clone(), format!("{id}_high")] {
            calls.extend(own_consumer(&inbox, &name));
        }
        let config = kv(CONFIG_BUCKET);
        calls.extend([
            api(&format!("STREAM.INFO.{config}")),
            api(&format!("STREAM.MSG.GET.{config}")),
            api(&format!("DIRECT.GET.{config}.>")),
        ]);
        for bucket in [IDEMPOTENCY_BUCKET, SEEN_BUCKET] {
            let stream = kv(bucket);
            calls.extend([
                api(&format!("STREAM.INFO.{stream}")),
                api(&format!("STREAM.CREATE.{stream}")),
                api(&format!("STREAM.MSG.GET.{stream}")),
                api(&format!(
                    "DIRECT.GET.{stream}.{}",
                    subjects.bucket_keys(bucket, id)?
                )),
            ]);
        }
    }
    if role.gateway {
        // The A2A push configs its callers register, kept under its own name only: it may
        // make the bucket, write and remove its own keys, and list them through a consumer
        // whose filter (named in the subject) is its own keys.
        let stream = kv(chorus_gateway::PUSH_BUCKET);
        let own = subjects.bucket_keys(chorus_gateway::PUSH_BUCKET, id)?;
        calls.extend([
            api(&format!("STREAM.INFO.{stream}")),
            api(&format!("STREAM.CREATE.{stream}")),
            api(&format!("CONSUMER.CREATE.{stream}.*.{own}")),
            own,
        ]);
    }
    if role.host {
        let hosts = kv(chorus_hosting::protocol::HOSTS_BUCKET);
        calls.extend([
            api(&format!("STREAM.INFO.{hosts}")),
            api(&format!("STREAM.CREATE.{hosts}")),
        ]);
    }
    if role.tasks {
        let tasks = subjects.stream_name(chorus_sdk::task::TASK_STREAM);
        calls.extend(read_or_make(&tasks));
        calls.extend(short_lived_consumers(&tasks));
    }
    if role.dlq {
        let dlq = subjects.stream_name(DLQ_STREAM);
        calls.extend(read_or_make(&dlq));
        calls.extend(short_lived_consumers(&dlq));
        calls.push(api(&format!("STREAM.MSG.DELETE.{dlq}")));
        calls.push(api(&format!("STREAM.PURGE.{dlq}")));
        let idempotency = kv(IDEMPOTENCY_BUCKET);
        calls.extend([
            api(&format!("STREAM.INFO.{idempotency}")),
            api(&format!("STREAM.MSG.GET.{idempotency}")),
            api(&format!("DIRECT.GET.{idempotency}.>")),
        ]);
        let audit = subjects.stream_name(chorus_sdk::audit::AUDIT_STREAM);
        calls.push(api(&format!("STREAM.INFO.{audit}")));
        calls.extend(short_lived_consumers(&audit));
    }
    let mut seen = std::collections::HashSet::new();
    calls.retain(|c| seen.insert(c.clone()));
    Ok(calls)
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
    /// A gateway identity (`[[gateway.identities]]` with its own `nkey_seed_file`): its
    /// durable inbox, and the A2A push configs of its callers kept under its own name.
    pub gateway: bool,
    /// The machine `chorus host --name <name>` runs, as the agent `host-<name>`: its report
    /// in the hosts bucket under its own name, and the heartbeats of the agents it runs.
    pub host: bool,
}

/// The host name of a `--host` role's agent id, `host-<name>`, or why not.
fn host_name(id: &str) -> std::result::Result<&str, String> {
    id.strip_prefix(chorus_hosting::protocol::HOST_AGENT_PREFIX)
        .filter(|name| !name.is_empty())
        .ok_or_else(|| {
            format!(
                "--host takes the host's agent id, host-<name> (`chorus host --name <name>`), not {id:?}"
            )
        })
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
    // The JetStream API calls it makes, each named (payloads carried by reference, the
    // registry's reads, and those of --durable, --tasks and --dlq): [`jetstream_calls`].
    publish.extend(jetstream_calls_of(subjects, role)?);
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
        // Dead letters it writes, exactly-once records and seen message ids (its consumers'
        // acks are among its JetStream calls).
        publish.push(subjects.dead_letters());
        publish.push(subjects.bucket_keys(IDEMPOTENCY_BUCKET, id)?);
        // Seen message ids, for replay protection across restarts.
        publish.push(subjects.bucket_keys(SEEN_BUCKET, id)?);
        subscribe.push(JETSTREAM_EVENTS.to_owned());
    }
    if role.dlq {
        // A replayed uncertain message's interrupted claim, of any agent.
        publish.push(format!(
            "$KV.{}.>",
            subjects.bucket_name(IDEMPOTENCY_BUCKET)
        ));
    }
    if role.host {
        let name = host_name(id)?;
        // Its report, under its own name only.
        publish.push(format!(
            "$KV.{}.{name}",
            subjects.bucket_name(chorus_hosting::protocol::HOSTS_BUCKET)
        ));
        // The heartbeats of the agents it runs (their health).
        subscribe.push(subjects.heartbeats());
    }
    if role.tap {
        subscribe.push(subjects.everything());
        subscribe.push(ALL_REPLIES.to_owned());
    }
    if role.tasks {
        // Every task subject: a submission, a state, progress, a chunk, an answer or a cancel
        // may come from either side of a task, and task ids are not known in advance
        // (signatures tell the writers apart, SECURITY.md).
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
    // The registry's events (`registry.joined`, `registry.left`) are the coordinator's alone,
    // whatever event topics the role may publish.
    let registry_events = subjects.event_pattern("registry.>").map_err(Error::wrap(
        ErrorKind::InvalidInput,
        "the registry's events",
    ))?;
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
        "# {what} {}\n{{ nkey: \"{public_key}\", permissions: {{ publish: {{ allow: [{}], deny: [\"{registry_events}\"] }}, subscribe: {{ allow: [{}] }}{responses} }} }}",
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
