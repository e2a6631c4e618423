//! End-to-end tests. Each test starts its own `nats-server` (see `chorus_tests::server`).

mod a2a_push;
mod broker;
mod cluster;
mod compact;
mod console;
mod coordinator;
mod dashboard;
mod delivery;
mod demo;
mod deploy;
mod docs;
mod examples;
mod gateway;
mod hosting;
mod inbox;
mod leaf;
mod messaging;
mod negotiation;
mod payloads;
mod protocol;
mod reliability;
mod security;
mod shutdown;
mod tasks;
mod vectors;
mod walkthrough;
