//! An MCP client over the stdio transport, for `chorus mcp bridge`: it starts an MCP server as
//! a child process, initializes it, lists its tools and calls them, one JSON-RPC message per
//! line each way. Calls run concurrently, each with a deadline (a late one is cancelled with
//! `notifications/cancelled`); the server's requests to the client are answered (`ping`) or
//! refused (-32601: no sampling, elicitation or roots here); a line longer than
//! [`MAX_LINE`] or not JSON is skipped. When the server exits, every pending call fails and
//! [`McpClient::exited`] completes.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::process::{Child, ChildStdin, Command};
use tokio::sync::oneshot;
use tokio_util::codec::{FramedRead, LinesCodec};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// The longest line read from the server (a tool's result included).
pub const MAX_LINE: usize = 16 * 1024 * 1024;
/// The protocol version asked for.
pub const PROTOCOL_VERSION: &str = "2025-11-25";

/// Why a call did not return a result.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The server answered with a JSON-RPC error.
    #[error("the MCP server refused {method}: {code} {message}")]
    Refused {
        /// The method called.
        method: String,
        /// The JSON-RPC error code.
        code: i64,
        /// Its message.
        message: String,
    },
    /// No answer within the deadline.
    #[error("the MCP server did not answer {0} in time")]
    Timeout(String),
    /// The server is gone (exited, or closed its output).
    #[error("the MCP server has exited")]
    Exited,
    /// The server could not be started or written to.
    #[error("the MCP server: {0}")]
    Io(#[from] std::io::Error),
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, (i64, String)>>>>>;
type Stdin = Arc<tokio::sync::Mutex<ChildStdin>>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A running MCP server and the client speaking to it.
pub struct McpClient {
    stdin: Stdin,
    pending: Pending,
    next: AtomicU64,
    child: tokio::sync::Mutex<Child>,
    /// Cancelled when the server's output ends.
    gone: CancellationToken,
    tracker: TaskTracker,
}

impl std::fmt::Debug for McpClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpClient")
            .field("gone", &self.gone.is_cancelled())
            .finish_non_exhaustive()
    }
}

/// A tool the server offers.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: Option<String>,
    /// Its input schema.
    pub input_schema: Value,
}

impl McpClient {
    /// Starts `program` with `args` and initializes it as client `name`; its standard error
    /// goes to this process's.
    ///
    /// # Errors
    /// [`McpError::Io`] when it cannot be started; [`McpError::Refused`],
    /// [`McpError::Timeout`] or [`McpError::Exited`] when it does not initialize within
    /// `timeout`.
    pub async fn start(
        program: &str,
        args: &[String],
        name: &str,
        timeout: Duration,
    ) -> Result<McpClient, McpError> {
        let mut child = Command::new(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(McpError::Io(std::io::Error::other("no pipes to the child")));
        };
        let client = McpClient {
            stdin: Arc::new(tokio::sync::Mutex::new(stdin)),
            pending: Arc::default(),
            next: AtomicU64::new(1),
            child: tokio::sync::Mutex::new(child),
            gone: CancellationToken::new(),
            tracker: TaskTracker::new(),
        };
        // Owned by the client: it ends when the server's output does.
        client.tracker.spawn(read(
            FramedRead::new(stdout, LinesCodec::new_with_max_length(MAX_LINE)),
            Arc::clone(&client.pending),
            client.gone.clone(),
            Arc::clone(&client.stdin),
        ));
        client
            .request(
                "initialize",
                json!({
                    "protocolVersion": PROTOCOL_VERSION,
                    "capabilities": {},
                    "clientInfo": {"name": name, "version": env!("CARGO_PKG_VERSION")},
                }),
                timeout,
            )
            .await?;
        client
            .notify("notifications/initialized", json!({}))
            .await?;
        Ok(client)
    }

    /// The server's tools (every page).
    ///
    /// # Errors
    /// As [`call`](McpClient::call).
    pub async fn tools(&self, timeout: Duration) -> Result<Vec<Tool>, McpError> {
        let mut tools = Vec::new();
        let mut cursor: Option<String> = None;
        // At most 100 pages: a server whose cursors never end is not followed forever.
        for _ in 0..100 {
            let params = match &cursor {
                Some(c) => json!({"cursor": c}),
                None => json!({}),
            };
            let page = self.request("tools/list", params, timeout).await?;
            for tool in page["tools"].as_array().into_iter().flatten() {
                let Some(name) = tool["name"].as_str() else {
                    continue;
                };
                tools.push(Tool {
                    name: name.to_owned(),
                    description: tool["description"].as_str().map(str::to_owned),
                    input_schema: tool
                        .get("inputSchema")
                        .cloned()
                        .unwrap_or_else(|| json!({"type": "object"})),
                });
            }
            match page["nextCursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => break,
            }
        }
        Ok(tools)
    }

    /// Calls tool `name` with `arguments`; its result (`content`, `isError`, ...) as it came.
    ///
    /// # Errors
    /// [`McpError::Refused`] for a JSON-RPC error (an unknown tool), [`McpError::Timeout`]
    /// past `timeout` (the call is cancelled), [`McpError::Exited`] when the server is gone.
    pub async fn call(
        &self,
        name: &str,
        arguments: Value,
        timeout: Duration,
    ) -> Result<Value, McpError> {
        self.request(
            "tools/call",
            json!({"name": name, "arguments": arguments}),
            timeout,
        )
        .await
    }

    async fn request(
        &self,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, McpError> {
        if self.gone.is_cancelled() {
            return Err(McpError::Exited);
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let sent = self
            .write(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        if let Err(e) = sent {
            lock(&self.pending).remove(&id);
            return Err(e);
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(Ok(result))) => Ok(result),
            Ok(Ok(Err((code, message)))) => Err(McpError::Refused {
                method: method.to_owned(),
                code,
                message,
            }),
            Ok(Err(_)) => Err(McpError::Exited),
            Err(_) => {
                lock(&self.pending).remove(&id);
                let _ = self
                    .notify(
                        "notifications/cancelled",
                        json!({"requestId": id, "reason": "timed out"}),
                    )
                    .await;
                Err(McpError::Timeout(method.to_owned()))
            }
        }
    }

    async fn notify(&self, method: &str, params: Value) -> Result<(), McpError> {
        self.write(&json!({"jsonrpc": "2.0", "method": method, "params": params}))
            .await
    }

    async fn write(&self, message: &Value) -> Result<(), McpError> {
        Ok(write(&self.stdin, message).await?)
    }

    /// Completes when the server's output has ended (it exited, or closed it).
    pub async fn exited(&self) {
        self.gone.cancelled().await;
    }

    /// Stops the server (its input closed, then killed if it lingers) and waits for it.
    pub async fn stop(&self) {
        let mut child = self.child.lock().await;
        let _ = self.stdin.lock().await.shutdown().await;
        if tokio::time::timeout(Duration::from_secs(2), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
        self.tracker.close();
    }
}

/// Writes one message, a line, to the server.
async fn write(stdin: &Stdin, message: &Value) -> std::io::Result<()> {
    let mut line = message.to_string();
    line.push('\n');
    let mut stdin = stdin.lock().await;
    stdin.write_all(line.as_bytes()).await?;
    stdin.flush().await
}

/// Reads the server's messages until its output ends: answers to the pending calls, and its
/// own requests answered (`ping`) or refused; then fails what is still pending.
async fn read<R: tokio::io::AsyncRead + Unpin>(
    mut lines: FramedRead<R, LinesCodec>,
    pending: Pending,
    gone: CancellationToken,
    stdin: Stdin,
) {
    while let Some(line) = lines.next().await {
        let message: Value = match line {
            Ok(line) => match serde_json::from_str(&line) {
                Ok(m) => m,
                Err(e) => {
                    tracing::debug!(error = %e, "an MCP server line that is not JSON, skipped");
                    continue;
                }
            },
            Err(tokio_util::codec::LinesCodecError::MaxLineLengthExceeded) => {
                tracing::warn!(max = MAX_LINE, "an MCP server message too long, skipped");
                continue;
            }
            Err(tokio_util::codec::LinesCodecError::Io(_)) => break,
        };
        let id = message.get("id").cloned();
        match (message.get("method").and_then(Value::as_str), id) {
            // A request of the server's own.
            (Some(method), Some(id)) => {
                let answer = if method == "ping" {
                    json!({"jsonrpc": "2.0", "id": id, "result": {}})
                } else {
                    json!({"jsonrpc": "2.0", "id": id, "error": {
                        "code": -32601,
                        "message": format!("{method}: this client (a Chorus bridge) offers no sampling, elicitation or roots"),
                    }})
                };
                if write(&stdin, &answer).await.is_err() {
                    break;
                }
            }
            // A notification (progress, logs): not forwarded.
            (Some(_), None) => {}
            (None, Some(id)) => {
                let Some(waiting) = id.as_u64().and_then(|id| lock(&pending).remove(&id)) else {
                    continue;
                };
                let outcome = match (message.get("result"), message.get("error")) {
                    (Some(result), _) => Ok(result.clone()),
                    (None, Some(error)) => Err((
                        error["code"].as_i64().unwrap_or(-32603),
                        error["message"].as_str().unwrap_or_default().to_owned(),
                    )),
                    (None, None) => Err((-32603, "an answer with no result and no error".into())),
                };
                let _ = waiting.send(outcome);
            }
            (None, None) => {}
        }
    }
    gone.cancel();
    // Dropped senders fail their calls with `Exited`.
    lock(&pending).clear();
}
