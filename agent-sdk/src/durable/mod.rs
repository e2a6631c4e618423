//! Durable delivery: commands stored in JetStream until their agent takes them, retried by the
//! retry policy, and dead-lettered when they cannot be handled.
//!
//! - The inbox stream (`CHORUS_INBOX`, subjects `<root>.inbox.<agent>.<lane>.<command>`) keeps each
//!   command until the recipient acks it (work-queue retention), up to its limits.
//! - Each agent with a durable inbox has a durable pull consumer named after it, filtered to its
//!   own subjects, with `MaxDeliver` set to the largest attempt count of the retry policies.
//! - A failed attempt is NAK'd with the policy's delay for that delivery count; the last
//!   attempt, or a failure the policy does not retry, is written to the dead-letter stream
//!   (`CHORUS_DLQ`) with its reason and then terminated. Deliveries that never get an answer
//!   (a crashed handler) reach `MaxDeliver`; the coordinator dead-letters those from the
//!   server's advisories, captured in `CHORUS_ADVISORIES`.
//! - Dead letters are published with the message id `dlq:<stream>:<sequence>`, so however many
//!   times a failure is reported (a retried write, two coordinators), it is stored once.

//!
//! Rooms: `send` (publishing in a delivery class), `inbox` (this agent's consumers, lanes, and
//! each delivery's outcome as an ack, a nak or a dead letter). The dead letter and the note a
//! terminated delivery carries are the crate's `dead_letter` room, re-exported here: a request
//! that fails for good is dead-lettered too, from the outbound side.

pub(crate) mod inbox;
mod queue;
pub(crate) mod send;

use std::time::Duration;

use chorus_broker_adapter::StreamSpec;
use serde::{Deserialize, Serialize};

pub use crate::dead_letter::{
    DEAD_LETTER_HEADROOM, DeadLetter, DeadLetterNote, DeadLetterReason, MAX_DETAIL_BYTES,
    NotADeadLetter, header, is_kept_header, write_dead_letter,
};
pub use crate::inbound::exactly_once::{DEFAULT_IDEMPOTENCY_TTL, IDEMPOTENCY_BUCKET};
pub use inbox::{
    ABANDONED_CONSUMER_AFTER, DEFAULT_INBOX_RECHECK, DEFAULT_INBOX_RELEASE_AFTER, DURABLE_ACK_WAIT,
    InboxConsumers, MIN_DURABLE_ACK_WAIT,
};
pub use queue::{DeadLetterQueue, DlqEntry, DlqFilter, REPLAY_HEADER, describe_envelope};
pub use send::{BATCH_ACKS_IN_FLIGHT, Receipt};

use crate::subject::Subjects;

/// Suffix of the inbox stream's name.
pub const INBOX_STREAM: &str = "INBOX";
/// Suffix of the dead-letter stream's name.
pub const DLQ_STREAM: &str = "DLQ";
/// Timeout of JetStream API calls and publish acks.
pub const JETSTREAM_TIMEOUT: Duration = Duration::from_secs(10);
/// Suffix of the stream that keeps the server's max-deliveries and terminated advisories.
pub const ADVISORY_STREAM: &str = "ADVISORIES";
/// Suffix of the configuration bucket (retry policies live under [`RETRY_KEY`]).
pub const CONFIG_BUCKET: &str = "config";
/// Key of the retry policies in the configuration bucket.
pub const RETRY_KEY: &str = "retry";
/// How long a repeated dead letter (same source message) is recognised and dropped.
pub const DLQ_DEDUPE_WINDOW: Duration = Duration::from_secs(24 * 3600);

/// How long commands wait in an inbox unless the limits say otherwise: 7 days.
pub const DEFAULT_INBOX_MAX_AGE_SECS: u64 = 7 * 24 * 3600;
/// Consumers the inbox stream takes by default: two per durable agent, for 100,000 agents.
pub const DEFAULT_INBOX_MAX_CONSUMERS: i32 = 200_000;
/// Most bytes across all inboxes unless the limits say otherwise: 1 GiB.
pub const DEFAULT_INBOX_MAX_BYTES: i64 = 1 << 30;
/// The inbox's window for a repeated message id unless the limits say otherwise, in seconds.
pub const DEFAULT_INBOX_DUPLICATE_WINDOW_SECS: u64 = 120;
/// How long dead letters are kept: 30 days.
pub const DLQ_MAX_AGE: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long captured advisories are kept: 7 days.
pub const ADVISORY_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// Limits of the inbox stream. Start from the defaults and change what differs: the fields
/// directly, or the replicas with `InboxLimits::default().replicas(3)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct InboxLimits {
    /// Oldest command kept, in seconds (default 7 days).
    pub max_age_secs: u64,
    /// Most bytes kept across all inboxes (default 1 GiB).
    pub max_bytes: i64,
    /// Most commands kept per agent and command name (-1: no limit, the default).
    pub max_msgs_per_subject: i64,
    /// Stream replicas (1 on one server, 3 on a cluster).
    pub replicas: usize,
    /// Window in which a repeated message id is dropped, in seconds (default 120).
    pub duplicate_window_secs: u64,
    /// Most consumers on the inbox stream: two per durable agent (default 200,000, so 100,000
    /// durable agents). Set explicitly because nats-server 2.15 limits a stream that does not
    /// say to 1,000 consumers, which is 500 durable agents.
    pub max_consumers: i32,
}

impl Default for InboxLimits {
    fn default() -> Self {
        InboxLimits {
            max_age_secs: DEFAULT_INBOX_MAX_AGE_SECS,
            max_bytes: DEFAULT_INBOX_MAX_BYTES,
            max_msgs_per_subject: -1,
            replicas: 1,
            duplicate_window_secs: DEFAULT_INBOX_DUPLICATE_WINDOW_SECS,
            max_consumers: DEFAULT_INBOX_MAX_CONSUMERS,
        }
    }
}

impl InboxLimits {
    /// Stream replicas (1 on one server, 3 on a cluster).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }
}

/// The inbox stream for `subjects`' root.
pub fn inbox_stream(subjects: &Subjects, limits: &InboxLimits) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(INBOX_STREAM),
        vec![subjects.durable_all()],
    );
    spec.max_age = Duration::from_secs(limits.max_age_secs);
    spec.max_bytes = limits.max_bytes;
    spec.max_msgs_per_subject = limits.max_msgs_per_subject;
    spec.replicas = limits.replicas;
    spec.duplicate_window = Duration::from_secs(limits.duplicate_window_secs.max(1));
    spec.work_queue = true;
    spec.max_consumers = limits.max_consumers;
    // Each stored command rings its agent's bell (headers only), so an agent whose inbox was
    // empty needs no consumer until something arrives for it.
    spec.republish_headers = Some((subjects.bell_source(), subjects.bell_destination()));
    spec.description = "Chorus durable inboxes: commands waiting for their agent".into();
    spec
}

/// The dead-letter stream.
pub fn dlq_stream(subjects: &Subjects, replicas: usize) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(DLQ_STREAM),
        vec![subjects.dead_letters()],
    );
    spec.max_age = DLQ_MAX_AGE;
    spec.duplicate_window = DLQ_DEDUPE_WINDOW;
    spec.replicas = replicas;
    spec.description = "Chorus dead letters".into();
    spec
}

/// The stream capturing the server's advisories about the inbox stream, so none is lost
/// while no coordinator runs.
pub fn advisory_stream(subjects: &Subjects, replicas: usize) -> StreamSpec {
    let mut spec = StreamSpec::new(
        subjects.stream_name(ADVISORY_STREAM),
        subjects.consumer_advisories(INBOX_STREAM),
    );
    spec.max_age = ADVISORY_MAX_AGE;
    spec.replicas = replicas;
    spec.description =
        "JetStream advisories about Chorus inboxes, for the dead-letter queue".into();
    spec
}
