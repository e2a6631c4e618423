//! ocr-agent on a secured bus (docs/SECURITY.md, "Running with security on", which shows this
//! file below its comment): mutual TLS, its own nkey user, signed envelopes it requires of
//! others, replay protection that survives a restart. Its `ocr` command asks the `nlp.analyze`
//! capability and reports the answer.
//!
//! Run it in the directory `chorus certs` and `chorus creds` wrote `.tls/` and `.keys/` into:
//! `cargo run -p chorus-sdk --example secure_ocr_agent` (`CHORUS_NATS_URL` names the server).

use chorus_sdk::security::{Identity, SignaturePolicy};
use chorus_sdk::{AgentOptions, BrokerOptions, Context, Credentials, HandlerError, TlsOptions};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "tls://127.0.0.1:4222".into());
    let read = |file: &str| std::fs::read_to_string(file).map(|text| text.trim().to_owned());
    let agent = AgentOptions::new("ocr-agent")
        .broker(
            BrokerOptions::new([server])
                .credentials(Credentials::NKeySeed(read(".keys/ocr-agent.nk")?))
                .tls(
                    TlsOptions::required()
                        .ca_file(".tls/ca.pem")
                        .client_cert(".tls/client.pem", ".tls/client-key.pem"),
                ),
        )
        // Signs what it sends; its public key travels in its manifest, so the registry
        // tells every other agent.
        .identity(Identity::generate())
        .verify_signatures(SignaturePolicy {
            require_signed: true,
            ..Default::default()
        })
        .persist_seen_ids(true)
        // Who never registers: the coordinator (broadcast copies) and the CLI user ops.
        .trust("coordinator", read(".keys/coordinator.pub")?)
        .trust("ops", read(".keys/ops.pub")?)
        .connect()
        .await?;
    let caller = agent.clone();
    agent
        .on_command("ocr", move |ctx: Context, text: String| {
            let caller = caller.clone();
            async move {
                let words: u32 = caller.request_capability("nlp.analyze", &text).await?;
                Ok::<_, HandlerError>(format!("{words} words for {}", ctx.from()))
            }
        })
        .await?;
    agent
        .on_command("reload", |ctx: Context, (): ()| async move {
            println!("ocr-agent: reload from {}", ctx.from());
            Ok::<_, HandlerError>(())
        })
        .await?;
    println!("ocr-agent: serving (Ctrl-C to stop)");
    tokio::signal::ctrl_c().await?;
    agent.shutdown().await;
    Ok(())
}
