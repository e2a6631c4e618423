//! The library half of the `chorus` command: what its subcommands share with the end-to-end
//! tests. Development certificates ([`certs`]), durations on the command line ([`duration`]),
//! the local NATS server of `chorus up` ([`local`]), the MCP client of `chorus mcp bridge`
//! ([`mcp_client`]), span export ([`otel`]) and what answers
//! at an address that is not NATS ([`probe`]).

pub mod certs;
pub use chorus_host::duration;
pub mod local;
pub mod mcp_client;
pub mod otel;
pub mod probe;
