//! The inbound side of an agent: how a message that arrives becomes an [`Outcome`].
//!
//! - `admit`: decode within the size limit; refuse unknown kinds, expired messages and loops.
//! - `layers`: the cross-cutting checks (signature, decryption, authorization and rate).
//! - `exactly_once`: idempotency records, so an exactly-once message's handler runs once.
//! - `pipeline`: the steps in order, ending with the handler.
//! - `outcome`: what became of a message; `reply`: a core request's outcome as its reply.
//! - `reader`: core subscriptions, bounded queues and handler slots; `backlog`: the order in
//!   which waiting messages get a slot (by priority); `stream`: events as a stream.

pub(crate) mod admit;
pub(crate) mod backlog;
pub(crate) mod exactly_once;
pub(crate) mod layers;
pub(crate) mod outcome;
pub(crate) mod pipeline;
pub(crate) mod reader;
pub(crate) mod reply;
pub(crate) mod seen;
pub(crate) mod stream;

pub(crate) use outcome::{Outcome, Retry};
pub(crate) use pipeline::{Pipeline, Target, Via};
pub use stream::{Event, EventStream};
