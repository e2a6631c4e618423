//! The raw baseline's yardstick as a program of its own (`chorus bench` runs the same function
//! inside its process): `cargo run --release -p chorus-broker-adapter --features raw --example
//! plain_pubsub -- nats://127.0.0.1:4222 1000000 128` prints the messages received per second.

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args
        .next()
        .unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let count: u64 = args.next().map_or(Ok(1_000_000), |a| a.parse())?;
    let size: usize = args.next().map_or(Ok(128), |a| a.parse())?;
    let (received, elapsed) = chorus_broker_adapter::raw::plain_pubsub(
        &url,
        "plain.pubsub",
        count,
        size,
        std::time::Duration::from_secs(120),
    )
    .await?;
    println!(
        "{received} of {count} messages of {size} B in {elapsed:?}: {:.0} msg/s",
        received as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}
