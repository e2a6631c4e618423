//! The Chorus agent SDK.
//!
//! An [`Agent`] publishes and subscribes to events, sends commands and requests to other
//! agents or to capabilities, and serves its own with typed handlers. Every message travels in
//! an [`Envelope`] (see `docs/PROTOCOL.md`); every subject comes from [`Subjects`].
//!
//! ```no_run
//! use agent_sdk::{AgentOptions, Context, HandlerError};
//!
//! # async fn run() -> Result<(), agent_sdk::SdkError> {
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

mod agent;
mod call;
pub mod codec;
mod context;
pub mod durable;
pub mod encryption;
pub mod envelope;
mod error;
mod handler;
pub mod metrics;
mod presence;
pub mod registry;
pub mod retry;
pub mod security;
mod stats;
pub mod status;
pub mod subject;
pub mod trace;
mod wire;

pub use agent::{
    Agent, AgentOptions, DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_MESSAGE_BYTES, DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_SHUTDOWN_TIMEOUT, Event, EventStream, RateLimit, ShutdownReport,
};
pub use broker_adapter::{BrokerOptions, ConnectionEvent, Credentials, TlsOptions};
pub use call::{Call, Reply, Target};
pub use codec::{CodecError, Encoding};
pub use context::Context;
pub use durable::Receipt;
pub use envelope::{DeliveryClass, Envelope, Kind, Performative, Priority};
pub use error::{HandlerError, SdkError};
pub use handler::{BoxFuture, EventHandler, Handler, Output, Typed};
pub use registry::{
    AgentRecord, Availability, BroadcastReport, BroadcastTarget, DiscoverQuery, Manifest, Outcome,
};
pub use retry::{RetryPolicies, RetryPolicy};
pub use stats::AgentStats;
pub use status::StatusCode;
pub use subject::Subjects;
