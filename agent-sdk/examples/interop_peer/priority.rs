//! The peer's part for the Python SDK's priority tests: with `PEER_PRIORITY_QUEUE` set to `n`,
//! the peer handles one message at a time (`max_in_flight` 1) with `n` waiting at most. The
//! command `prio_hold` takes the only handler slot until an event on `interop.priority.release`
//! lets it go, so the messages behind it wait; `prio_work` records its argument (a label) in the
//! order handled and answers its place in that order (from 0); `prio_order` answers the labels
//! handled so far.

use std::sync::{Arc, Mutex};

use chorus_sdk::{Agent, AgentOptions, Context, HandlerError};
use futures::StreamExt;
use serde_json::Value;
use tokio::sync::Semaphore;

/// Settings of this part: `PEER_PRIORITY_QUEUE` (a number) makes the peer handle one message
/// at a time, with that many waiting at most.
pub fn options(options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    match std::env::var("PEER_PRIORITY_QUEUE") {
        Ok(n) => {
            let n: usize = n
                .parse()
                .map_err(|e| format!("PEER_PRIORITY_QUEUE {n:?}: {e}"))?;
            Ok(options.max_in_flight(1).queue_capacity(n))
        }
        Err(_) => Ok(options),
    }
}

/// The handlers of this part.
pub async fn register(peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    let gate = Arc::new(Semaphore::new(0));
    let mut releases = peer.subscribe("interop.priority.release").await?;
    {
        let gate = Arc::clone(&gate);
        tokio::spawn(async move {
            while releases.next().await.is_some() {
                gate.add_permits(1);
            }
        });
    }
    peer.on_command("prio_hold", move |_ctx: Context, _v: Value| {
        let gate = Arc::clone(&gate);
        async move {
            gate.acquire()
                .await
                .map_err(|_| HandlerError::failed("the gate closed"))?
                .forget();
            Ok::<_, HandlerError>(Value::Null)
        }
    })
    .await?;
    let handled = Arc::new(Mutex::new(Vec::<String>::new()));
    {
        let handled = Arc::clone(&handled);
        peer.on_command("prio_work", move |_ctx: Context, label: String| {
            let mut handled = handled.lock().unwrap_or_else(|e| e.into_inner());
            handled.push(label);
            let place = handled.len() - 1;
            async move { Ok::<_, HandlerError>(place) }
        })
        .await?;
    }
    peer.on_command("prio_order", move |_ctx: Context, _v: Value| {
        let order = handled.lock().unwrap_or_else(|e| e.into_inner()).clone();
        async move { Ok::<_, HandlerError>(order) }
    })
    .await?;
    Ok(())
}
