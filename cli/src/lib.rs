//! The library half of the `chorus` command: what its subcommands share with the end-to-end
//! tests. Development certificates ([`certs`]), durations on the command line ([`duration`]),
//! the local NATS server of `chorus up` ([`local`]) and span export ([`otel`]).

pub mod certs;
pub mod duration;
pub mod local;
pub mod otel;
