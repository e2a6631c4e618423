//! The Chorus agent SDK.
//!
//! An [`Agent`] publishes and subscribes to events, sends commands and requests to other
//! agents or to capabilities, and serves its own with typed handlers. Every message travels in
//! an [`Envelope`] (see `docs/PROTOCOL.md`); every subject comes from [`Subjects`].
//!
//! ```no_run
//! use chorus_sdk::{AgentOptions, Context, HandlerError};
//!
//! # async fn run() -> Result<(), chorus_sdk::SdkError> {
//! let calculator = AgentOptions::new("calculator").connect().await?;
//! calculator
//!     .on_command("add", |_ctx: Context, (a, b): (f64, f64)| async move {
//!         Ok::<_, HandlerError>(a + b)
//!     })
//!     .await?;
//!
//! let orchestrator = AgentOptions::new("orchestrator").connect().await?;
//! let sum: f64 = orchestrator.request("calculator", "add", &(2.0, 3.0)).await?;
//! assert_eq!(sum, 5.0);
//! # Ok(()) }
//! ```

//! # Rooms
//!
//! | module | job |
//! |---|---|
//! | `protocol` | the envelope, its codecs, status codes, the registry's messages |
//! | [`subject`] | every subject, built and validated in one place |
//! | [`security`] | signatures, end-to-end encryption, permissions and rate limits |
//! | `outbound` | what an agent sends: calls, requests, events |
//! | `handler` | handler traits, the [`Context`] they run in, the endpoint table |
//! | `inbound` | the one inbound pipeline: admit, layers, exactly-once, handle, outcome |
//! | [`durable`] | durable sends, the durable inbox, dead letters |
//! | `presence` | heartbeats, service discovery, keys learned from the registry |
//! | [`negotiate`] | contract-net: calls for proposals, policies, awards, settlements |
//! | [`task`] | long work: task handlers, progress, chunks, input, cancel, reports |
//! | `agent` | the [`Agent`] handle and its [`AgentOptions`] |

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

mod agent;
pub mod audit;
pub mod credits;
mod dead_letter;
pub mod durable;
mod error;
mod handler;
mod inbound;
mod link;
pub mod metrics;
pub mod negotiate;
mod outbound;
pub mod payload;
mod presence;
mod protocol;
pub mod retry;
pub mod schema;
pub mod security;
mod sequence;
mod stats;
pub mod subject;
mod sync;
pub mod task;
pub mod trace;
pub mod usage;

pub use protocol::{codec, envelope, registry, status};
pub use security::encryption;
pub use sequence::EventNumbers;

pub use agent::{
    Agent, AgentConfig, AgentOptions, Batcher, Batching, BatchingConfig, BusConfig,
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_QUEUE_CAPACITY,
    DEFAULT_REQUEST_TIMEOUT, DEFAULT_SHUTDOWN_TIMEOUT, JETSTREAM_TIMEOUT, MAX_BATCH_DELAY,
    MAX_BATCH_MESSAGES, MonitoringConfig, Queued, ReliabilityConfig, SecurityConfig,
    ShutdownReport, TaskSummary,
};
pub use chorus_broker_adapter::{BrokerOptions, ConnectionEvent, Credentials, Report, TlsOptions};
pub use codec::{CodecError, Encoding};
pub use durable::Receipt;
pub use envelope::TaskState;
pub use envelope::{ContentType, DeliveryClass, Envelope, Kind, Name, Performative, Priority};
pub use error::{HandlerError, Rejection, SdkError};
pub use handler::endpoint::{
    ANY_NOTIFICATION, Description, MAX_DESCRIPTION_BYTES, MAX_INPUT_SCHEMA_BYTES,
};
pub use handler::{BoxFuture, Context, EventHandler, Handler, Output, Typed};
pub use inbound::{Event, EventStream};
pub use outbound::{
    BreakerPolicy, Call, CircuitState, Collect, DEFAULT_BREAKER_FAILURES, DEFAULT_BREAKER_OPEN_FOR,
    DEFAULT_ROUTING_REFRESH, MAX_HEADER_NAME_BYTES, MAX_HEADERS, MAX_HEADERS_BYTES,
    MAX_MULTICAST_RECIPIENTS, MulticastCounts, MulticastOutcome, MulticastRecipient,
    MulticastReport, Notify, NotifyReport, NotifyTarget, Publish, Reply, Routing, Target,
};
pub use registry::{
    AgentRecord, Availability, BroadcastReport, BroadcastTarget, DiscoverQuery, EndpointInfo,
    EndpointRole, Manifest, Outcome,
};
pub use retry::{RetryPolicies, RetryPolicy};
pub use security::access::RateLimit;
pub use stats::AgentStats;
pub use status::StatusCode;
pub use subject::Subjects;
pub use task::{
    TaskContext, TaskHandle, TaskHandler, TaskReport, TaskStop, TaskUpdate, TaskUpdates, TypedTask,
};
