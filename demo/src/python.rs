//! The demo's Python agent (`python -m chorus_sdk.demo`, from `python/`): started beside the Rust
//! agents when `chorus up` is given a Python with the SDK installed, and asked each round to
//! review a text (it asks the Rust calculator in turn) and to outline a topic as a task.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use chorus_sdk::{Call, SdkError};
use futures::StreamExt;
use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use super::Demo;

/// The Python agent's id.
pub const PYTHON_AGENT: &str = "py-analyst";
/// How long the Python agent may take to start (an interpreter and its imports).
const START_WAIT: Duration = Duration::from_secs(30);
/// How long it may take to stop once told.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// The Python agent's process, stopped by [`PythonAgent::stop`] (killed if dropped).
#[derive(Debug)]
pub struct PythonAgent {
    child: Child,
    /// Reads what it prints after it is ready, so it never blocks on a full pipe.
    output: tokio::task::JoinHandle<()>,
}

impl PythonAgent {
    /// Starts `python -m chorus_sdk.demo` against `server` and waits until it says it is ready.
    pub async fn start(python: &Path, server: &str) -> std::io::Result<PythonAgent> {
        let mut child = Command::new(python)
            .args(["-m", "chorus_sdk.demo", "--server", server])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot run {} -m chorus_sdk.demo: {e}", python.display()),
                )
            })?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?;
        let mut lines = BufReader::new(stdout).lines();
        let ready = tokio::time::timeout(START_WAIT, async {
            while let Some(line) = lines.next_line().await? {
                if line.contains("ready") {
                    return Ok(true);
                }
            }
            Ok::<_, std::io::Error>(false)
        })
        .await;
        match ready {
            Ok(Ok(true)) => {}
            Ok(Ok(false)) => {
                return Err(std::io::Error::other(format!(
                    "{} -m chorus_sdk.demo exited before it was ready (is the Python SDK installed? \
                     scripts/install-python-sdk)",
                    python.display()
                )));
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the Python demo agent was not ready within {START_WAIT:?}"),
                ));
            }
        }
        let output =
            tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok(PythonAgent { child, output })
    }

    /// Asks it to stop (its standard input closes) and waits, killing it past a limit.
    pub async fn stop(mut self) {
        drop(self.child.stdin.take());
        if tokio::time::timeout(STOP_WAIT, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
        self.output.abort();
        let _ = self.output.await;
    }
}

#[derive(Debug, Deserialize)]
struct Review {
    words_per_line: Vec<u64>,
    words: u64,
    longest_word: String,
    computed_by: String,
}

impl Demo {
    /// The Python scenario: the orchestrator (Rust) asks the Python agent, which asks the
    /// calculator (Rust), and follows a task the Python agent streams.
    pub async fn python_round(&self, say: fn(&str)) -> Result<(), SdkError> {
        let o = &self.orchestrator;
        let text = "Agents in Python\nand agents in Rust\nshare one bus";
        say(&format!(
            "[python] orchestrator -> {PYTHON_AGENT} (Python): review {text:?}"
        ));
        let review: Review = o.request(PYTHON_AGENT, "review", text).await?;
        say(&format!(
            "[python]   {PYTHON_AGENT} asked {} (Rust) to add {:?}: {} words, the longest {:?}",
            review.computed_by, review.words_per_line, review.words, review.longest_word
        ));
        say(&format!(
            "[python] orchestrator -> {PYTHON_AGENT}: outline \"buses\" (a task streamed from Python)"
        ));
        let task = o
            .submit(Call::agent(PYTHON_AGENT, "outline").payload("buses")?)
            .await?;
        let mut updates = task.updates().await?;
        while let Some(update) = updates.next().await {
            let update = update?;
            if update.chunk().is_some() {
                let part: String = update.payload_as()?;
                say(&format!("[python]   chunk {:?}", part));
            }
        }
        let report = task.result().await?;
        say(&format!(
            "[python]   {} by {PYTHON_AGENT} ({})",
            report.state, report.status
        ));
        Ok(())
    }
}
