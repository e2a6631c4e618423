//! The coordinator's own endpoints, served through the SDK's inbound pipeline like any
//! agent's: heartbeats and goodbyes (no reply), and discovery and broadcast requests in the
//! coordinators' queue group. The pipeline admits each message (size, version, kind, expiry,
//! hops), checks its signature when the coordinator verifies signatures, and turns the
//! handler's result into the reply; these handlers only do the coordinator's part.
//!
//! Each handler holds the coordinator weakly: the agent's endpoint table owns the handlers, and
//! the coordinator owns the agent.

use std::sync::{Arc, Weak};

use chorus_sdk::registry::{WIRE_NOTIFICATION, WireLevel};
use chorus_sdk::{
    Agent, BoxFuture, Context, EventHandler, Handler, HandlerError, Notify, Output, Report,
    SdkError, StatusCode,
};

use super::{Shared, broadcast};

/// Registers every endpoint on the coordinator's agent.
pub(super) async fn serve(agent: &Agent, shared: &Arc<Shared>) -> Result<(), SdkError> {
    let subjects = &shared.subjects;
    let group = subjects.coordinator_group();
    let weak = Arc::downgrade(shared);
    agent
        .handle_subject_events(&subjects.heartbeats(), Presence::Heartbeat(weak.clone()))
        .await?;
    agent
        .handle_subject_events(&subjects.goodbyes(), Presence::Goodbye(weak.clone()))
        .await?;
    agent
        .handle_subject(&subjects.discover(), Some(&group), Discover(weak.clone()))
        .await?;
    agent
        .handle_subject(&subjects.broadcasts(), Some(&group), Broadcast(weak))
        .await?;
    Ok(())
}

fn upgrade(shared: &Weak<Shared>) -> Result<Arc<Shared>, HandlerError> {
    shared.upgrade().ok_or_else(|| {
        HandlerError::new(StatusCode::UNAVAILABLE, "the coordinator is shutting down")
    })
}

/// Heartbeats and goodbyes.
enum Presence {
    Heartbeat(Weak<Shared>),
    Goodbye(Weak<Shared>),
}

impl EventHandler for Presence {
    fn call(&self, ctx: Context) -> BoxFuture<Result<(), HandlerError>> {
        let (shared, heartbeat) = match self {
            Presence::Heartbeat(s) => (upgrade(s), true),
            Presence::Goodbye(s) => (upgrade(s), false),
        };
        Box::pin(async move {
            let shared = shared?;
            let registry = &shared.registry;
            if !heartbeat {
                registry.on_goodbye(ctx.message(), ctx.subject()).await;
            } else if let Some((agent, level)) =
                registry.on_heartbeat(ctx.message(), ctx.subject()).await
            {
                tell_wire(&shared, agent, level).await;
            }
            Ok(())
        })
    }
}

/// Tells `agent` in a notification what the last announcement on `sys.wire` said (PROTOCOL.md
/// section 3.5): its heartbeats come faster than the floor. Not sent: its next heartbeat asks
/// again only for a new floor, and the next announcement tells it anyway.
async fn tell_wire(shared: &Shared, agent: String, level: WireLevel) {
    let notify = Notify::agent(agent, WIRE_NOTIFICATION).payload(&level);
    let sent = match notify {
        Ok(notify) => shared.agent.notify(notify).await.map(|_| ()),
        Err(err) => Err(err),
    };
    if let Err(err) = sent {
        tracing::debug!(error = %Report(&err), "heartbeat floor not told");
    }
}

/// Discovery queries.
struct Discover(Weak<Shared>);

impl Handler for Discover {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let shared = upgrade(&self.0);
        Box::pin(async move { shared?.registry.on_discover(ctx.message()) })
    }
}

/// Broadcast requests.
struct Broadcast(Weak<Shared>);

impl Handler for Broadcast {
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let shared = upgrade(&self.0);
        Box::pin(async move {
            let shared = shared?;
            broadcast::on_broadcast(&shared, ctx.message(), ctx.subject()).await
        })
    }
}
