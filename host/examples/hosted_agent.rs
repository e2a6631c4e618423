//! An agent written to be run by `chorus host` (docs/HOSTING.md): it takes who it is and where
//! the bus is from the environment the host gives it, serves a capability that its replicas
//! share, and stops cleanly on SIGTERM.
//!
//! - `CHORUS_AGENT_ID`: its id (the host sets it per replica: `echo`, `echo-2`, ...);
//! - `CHORUS_NATS_URL`: the bus (default `nats://127.0.0.1:4222`); `CHORUS_ROOT`: its root;
//! - `HOSTED_CAPABILITY`: the capability it serves (default `echo`): each request is answered
//!   with the payload and who answered (`agent`, `pid`), so a caller sees the replicas share;
//! - its command `exit` ends the process with the code it is given (a crash, for the tests).

use std::time::Duration;

use chorus_sdk::{AgentOptions, Context, HandlerError};
use serde_json::{Value, json};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let id = std::env::var("CHORUS_AGENT_ID").unwrap_or_else(|_| "hosted-agent".into());
    let servers =
        std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let root = std::env::var("CHORUS_ROOT").unwrap_or_else(|_| "chorus".into());
    let capability = std::env::var("HOSTED_CAPABILITY").unwrap_or_else(|_| "echo".into());
    let agent = AgentOptions::new(&id)
        .servers(servers.split(','))
        .root(root)
        .heartbeat_interval(Duration::from_secs(1))
        .connect()
        .await?;
    agent
        .on_capability(&capability, |ctx: Context, payload: Value| async move {
            Ok::<_, HandlerError>(json!({
                "agent": ctx.agent_id(),
                "pid": std::process::id(),
                "payload": payload,
            }))
        })
        .await?;
    agent
        .on_command("exit", |_ctx: Context, code: i32| async move {
            eprintln!("asked to exit with code {code}");
            std::process::exit(code);
            #[allow(unreachable_code)]
            Ok::<(), HandlerError>(())
        })
        .await?;
    println!("{id} serving {capability} (pid {})", std::process::id());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    println!("{id} stopping");
    agent.shutdown().await;
    Ok(())
}
