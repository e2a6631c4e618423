//! The agent `scripts/mcp-conformance` holds to the official MCP conformance suite through the
//! gateway's MCP server: the tools the suite's server scenarios call, as Chorus capabilities.
//! Content the suite expects as MCP content (an image, audio, an embedded resource) is replied
//! as an MCP tool result ([`REPLY_MCP_TOOL_RESULT`]); the tools that log and report progress
//! are Chorus tasks, whose progress the gateway turns into MCP notifications.
//!
//! ```sh
//! scripts/up                                                       # a local bus
//! cargo run -p chorus-sdk --example mcp_conformance_agent          # the agent `conformance`
//! ```
//!
//! The bus is `CHORUS_NATS_URL` (default `nats://127.0.0.1:4222`). It prints
//! `mcp_conformance_agent: ready` once it serves, and stops on Ctrl-C.

use std::time::Duration;

use chorus_sdk::registry::REPLY_MCP_TOOL_RESULT;
use chorus_sdk::{AgentOptions, Context, Description, HandlerError, TaskContext};
use serde_json::{Value, json};

/// A 1x1 red PNG.
const PNG: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg==";
/// A WAV file's header and one silent sample.
const WAV: &str = "UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAEAfAAABAAgAZGF0YQIAAACAgA==";

/// The tools that answer with fixed MCP content.
fn fixed() -> Vec<(&'static str, &'static str, Value)> {
    vec![
        (
            "test_simple_text",
            "Returns a simple text response.",
            json!({"content": [{"type": "text", "text": "This is a simple text response for testing."}]}),
        ),
        (
            "test_image_content",
            "Returns a 1x1 PNG image.",
            json!({"content": [{"type": "image", "data": PNG, "mimeType": "image/png"}]}),
        ),
        (
            "test_audio_content",
            "Returns a short WAV file.",
            json!({"content": [{"type": "audio", "data": WAV, "mimeType": "audio/wav"}]}),
        ),
        (
            "test_embedded_resource",
            "Returns an embedded text resource.",
            json!({"content": [{"type": "resource", "resource": {
                "uri": "test://embedded-resource",
                "mimeType": "text/plain",
                "text": "This is an embedded resource content.",
            }}]}),
        ),
        (
            "test_multiple_content_types",
            "Returns text, an image and a resource.",
            json!({"content": [
                {"type": "text", "text": "Multiple content types test:"},
                {"type": "image", "data": PNG, "mimeType": "image/png"},
                {"type": "resource", "resource": {
                    "uri": "test://mixed-content-resource",
                    "mimeType": "application/json",
                    "text": "{\"test\":\"data\",\"value\":123}",
                }},
            ]}),
        ),
    ]
}

/// No arguments.
fn no_arguments() -> Value {
    json!({"type": "object", "properties": {}})
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("CHORUS_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let agent = AgentOptions::new("conformance")
        .servers([url.as_str()])
        .connect()
        .await?;
    for (name, what, content) in fixed() {
        agent
            .on_capability(name, move |_ctx: Context, _args: Value| {
                let content = content.clone();
                async move { Ok::<_, HandlerError>(content) }
            })
            .await?;
        agent.describe(
            name,
            Description::new(what)
                .input_schema(no_arguments())
                .reply_format(REPLY_MCP_TOOL_RESULT),
        )?;
    }
    agent
        .on_capability(
            "test_error_handling",
            |_ctx: Context, _args: Value| async move {
                Err::<Value, _>(HandlerError::failed(
                    "This tool intentionally returns an error for testing",
                ))
            },
        )
        .await?;
    agent.describe(
        "test_error_handling",
        Description::new("Always fails.").input_schema(no_arguments()),
    )?;
    agent
        .on_task_capability(
            "test_tool_with_logging",
            |task: TaskContext, _args: Value| async move {
                for (i, line) in [
                    "Tool execution started",
                    "Tool processing data",
                    "Tool execution completed",
                ]
                .into_iter()
                .enumerate()
                {
                    if i > 0 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    task.progress(None, line).await?;
                }
                Ok::<_, HandlerError>("Tool with logging executed successfully".to_owned())
            },
        )
        .await?;
    agent.describe(
        "test_tool_with_logging",
        Description::new("Logs three messages as it runs.").input_schema(no_arguments()),
    )?;
    agent
        .on_task_capability(
            "test_tool_with_progress",
            |task: TaskContext, _args: Value| async move {
                for (i, fraction) in [0.0, 0.5, 1.0].into_iter().enumerate() {
                    if i > 0 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    task.progress(Some(fraction), format!("{:.0} of 100", fraction * 100.0))
                        .await?;
                }
                Ok::<_, HandlerError>("Tool with progress executed successfully".to_owned())
            },
        )
        .await?;
    agent.describe(
        "test_tool_with_progress",
        Description::new("Reports progress 0, 50 and 100 of 100.").input_schema(no_arguments()),
    )?;
    agent
        .on_task_capability(
            "test_reconnection",
            |task: TaskContext, _args: Value| async move {
                task.progress(Some(0.5), "halfway").await?;
                tokio::time::sleep(Duration::from_millis(300)).await;
                Ok::<_, HandlerError>("Reconnection test completed successfully".to_owned())
            },
        )
        .await?;
    agent.describe(
        "test_reconnection",
        Description::new(
            "A task whose call stream is resumable: a priming event, then its events with ids.",
        )
        .input_schema(no_arguments()),
    )?;
    agent
        .on_capability(
            "json_schema_2020_12_tool",
            |_ctx: Context, args: Value| async move { Ok::<_, HandlerError>(args) },
        )
        .await?;
    agent.describe(
        "json_schema_2020_12_tool",
        Description::new("Tool with JSON Schema 2020-12 features").input_schema(json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "type": "object",
            "$defs": {"address": {"type": "object", "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
            }}},
            "properties": {
                "name": {"type": "string"},
                "address": {"$ref": "#/$defs/address"},
            },
            "additionalProperties": false,
        })),
    )?;
    println!("mcp_conformance_agent: ready");
    tokio::signal::ctrl_c().await?;
    agent.shutdown().await;
    Ok(())
}
