//! The wire protocol (`docs/PROTOCOL.md`): the envelope, its two encodings, status codes, and
//! the messages of the registry. Nothing here touches the network.

pub mod codec;
pub mod envelope;
pub mod implied;
pub mod registry;
pub mod status;
pub mod task;
pub mod usage;
pub(crate) mod wire;
