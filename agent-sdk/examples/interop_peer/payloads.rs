//! The peer's part for the Python SDK's payloads tests.

use chorus_sdk::{Agent, AgentOptions};

/// Settings of this part, from the environment.
pub fn options(options: AgentOptions) -> Result<AgentOptions, Box<dyn std::error::Error>> {
    Ok(options)
}

/// The handlers of this part.
pub async fn register(_peer: &Agent) -> Result<(), Box<dyn std::error::Error>> {
    Ok(())
}
