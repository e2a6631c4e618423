//! A request-reply pair in one program: an `adder` agent answers `add`, an `asker` agent asks
//! it, and prints the sum and a refusal with its status code. Then both stop.
//!
//! ```sh
//! scripts/up                                  # a local bus, in another terminal
//! cargo run -p chorus-sdk --example request_reply
//! ```
//!
//! The bus is `CHORUS_NATS_URL` (default `nats://127.0.0.1:4222`).

use chorus_sdk::{AgentOptions, Context, HandlerError, SdkError};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let adder = AgentOptions::new("adder")
        .servers([url.as_str()])
        .connect()
        .await?;
    adder
        .on_command("add", |_ctx: Context, (a, b): (i64, i64)| async move {
            a.checked_add(b)
                .ok_or_else(|| HandlerError::invalid_argument("the sum overflows"))
        })
        .await?;

    let asker = AgentOptions::new("asker")
        .servers([url.as_str()])
        .connect()
        .await?;
    let sum: i64 = asker.request("adder", "add", &(2, 3)).await?;
    println!("request_reply: 2 + 3 = {sum}");
    match asker
        .request::<_, i64>("adder", "add", &(i64::MAX, 1))
        .await
    {
        Err(SdkError::Remote { status, reason, .. }) => {
            println!("request_reply: i64::MAX + 1 refused with {status}: {reason}");
        }
        other => return Err(format!("expected a refusal, got {other:?}").into()),
    }
    asker.shutdown().await;
    adder.shutdown().await;
    Ok(())
}
