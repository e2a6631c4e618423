//! The demo's calculator as an agent of your own: serves the `calculation` command until
//! Ctrl-C or SIGTERM, then stops gracefully (in-flight work finished, the registry told).
//!
//! ```sh
//! scripts/up                                  # a local bus, in another terminal
//! cargo run -p chorus-sdk --example calculator
//! chorus request --to calculator --command calculation '{"operation":"add","operands":[2,3]}'
//! ```
//!
//! The bus is `CHORUS_NATS_URL` (default `nats://127.0.0.1:4222`).

use chorus_sdk::{AgentOptions, Context, HandlerError};
use serde::{Deserialize, Serialize};

/// The command's argument (test vector 01 is this request).
#[derive(Debug, Serialize, Deserialize)]
struct Calculation {
    operation: String,
    operands: Vec<f64>,
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let calculator = AgentOptions::new("calculator")
        .servers([url.as_str()])
        .capability("math")
        .connect()
        .await?;
    calculator
        .on_command("calculation", |_ctx: Context, c: Calculation| async move {
            let mut operands = c.operands.iter().copied();
            let first = operands.next().unwrap_or(0.0);
            match c.operation.as_str() {
                "add" => Ok(c.operands.iter().sum::<f64>()),
                "multiply" => Ok(c.operands.iter().product::<f64>()),
                "subtract" => Ok(operands.fold(first, |a, b| a - b)),
                "divide" if c.operands.iter().skip(1).any(|d| *d == 0.0) => {
                    Err(HandlerError::invalid_argument("division by zero"))
                }
                "divide" => Ok(operands.fold(first, |a, b| a / b)),
                other => Err(HandlerError::invalid_argument(format!(
                    "no operation {other:?} (add, subtract, multiply, divide)"
                ))),
            }
        })
        .await?;
    println!("calculator: serving `calculation` at {url} (Ctrl-C to stop)");
    shutdown_signal().await;
    calculator.shutdown().await;
    println!("calculator: stopped");
    Ok(())
}

/// Ctrl-C or SIGTERM.
async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
