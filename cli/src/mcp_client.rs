//! An MCP client for `chorus mcp bridge`, over either transport: stdio (it starts the server
//! as a child process, one JSON-RPC message per line each way) or Streamable HTTP (it posts
//! each message to the server's endpoint and reads the answer as JSON or server-sent events).
//! It initializes the server, lists its tools and calls them. Calls run concurrently, each
//! with a deadline (a late one is cancelled with `notifications/cancelled`); the server's
//! requests to the client are answered (`ping`) or refused (-32601: no sampling, elicitation
//! or roots here); a message longer than [`MAX_LINE`] or not JSON is skipped. When the server
//! exits (stdio), or stops answering pings (HTTP: three in a row), every pending call fails
//! and [`McpClient::exited`] completes.

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
    link: Link,
    next: AtomicU64,
    /// Cancelled when the server is gone: its output ended, or it stopped answering.
    gone: CancellationToken,
    tracker: TaskTracker,
}

/// How the client reaches the server.
enum Link {
    Stdio {
        stdin: Stdin,
        pending: Pending,
        child: tokio::sync::Mutex<Child>,
    },
    Http(Http),
}

/// A Streamable HTTP server: its endpoint and the session it gave.
struct Http {
    client: reqwest::Client,
    url: String,
    session: Mutex<Option<String>>,
}

/// Pings an HTTP server fails in a row before it counts as gone.
const MISSED_PINGS: u32 = 3;

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
        let stdin: Stdin = Arc::new(tokio::sync::Mutex::new(stdin));
        let pending: Pending = Arc::default();
        let client = McpClient {
            link: Link::Stdio {
                stdin: Arc::clone(&stdin),
                pending: Arc::clone(&pending),
                child: tokio::sync::Mutex::new(child),
            },
            next: AtomicU64::new(1),
            gone: CancellationToken::new(),
            tracker: TaskTracker::new(),
        };
        // Owned by the client: it ends when the server's output does.
        client.tracker.spawn(read(
            FramedRead::new(stdout, LinesCodec::new_with_max_length(MAX_LINE)),
            pending,
            client.gone.clone(),
            stdin,
        ));
        client.initialize(name, timeout).await?;
        Ok(client)
    }

    /// Connects to the Streamable HTTP server at `url` (`https` trusting the system's CAs and
    /// `ca_file`'s) and initializes it as client `name`; it counts as gone once it misses
    /// three pings, one every `ping_every`.
    ///
    /// # Errors
    /// [`McpError::Io`] when the URL or the CA file will not do; [`McpError::Refused`],
    /// [`McpError::Timeout`] or [`McpError::Exited`] when it does not initialize within
    /// `timeout`.
    pub async fn connect(
        url: &str,
        ca_file: Option<&std::path::Path>,
        name: &str,
        timeout: Duration,
        ping_every: Duration,
    ) -> Result<Arc<McpClient>, McpError> {
        let parsed = url::Url::parse(url)
            .map_err(|e| McpError::Io(std::io::Error::other(format!("{url}: {e}"))))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(McpError::Io(std::io::Error::other(format!(
                "{url}: an http or https URL"
            ))));
        }
        let client = chorus_gateway::https_client(ca_file, timeout)
            .map_err(|e| McpError::Io(std::io::Error::other(e)))?;
        let client = Arc::new(McpClient {
            link: Link::Http(Http {
                client,
                url: url.to_owned(),
                session: Mutex::new(None),
            }),
            next: AtomicU64::new(1),
            gone: CancellationToken::new(),
            tracker: TaskTracker::new(),
        });
        client.initialize(name, timeout).await?;
        let watched = Arc::downgrade(&client);
        let gone = client.gone.clone();
        // Owned by the client: it ends when the server is gone or the client is dropped.
        client.tracker.spawn(async move {
            let mut missed = 0;
            loop {
                tokio::select! {
                    () = tokio::time::sleep(ping_every) => {}
                    () = gone.cancelled() => return,
                }
                let Some(client) = watched.upgrade() else {
                    return;
                };
                match client
                    .request("ping", json!({}), ping_every.max(Duration::from_secs(1)))
                    .await
                {
                    Ok(_) => missed = 0,
                    Err(_) => missed += 1,
                }
                if missed >= MISSED_PINGS {
                    gone.cancel();
                    return;
                }
            }
        });
        Ok(client)
    }

    async fn initialize(&self, name: &str, timeout: Duration) -> Result<(), McpError> {
        self.request(
            "initialize",
            json!({
                "protocolVersion": PROTOCOL_VERSION,
                "capabilities": {},
                "clientInfo": {"name": name, "version": env!("CARGO_PKG_VERSION")},
            }),
            timeout,
        )
        .await?;
        self.notify("notifications/initialized", json!({})).await
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
        let message = json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
        let answered = match &self.link {
            Link::Stdio { stdin, pending, .. } => {
                let (tx, rx) = oneshot::channel();
                lock(pending).insert(id, tx);
                if let Err(e) = write(stdin, &message).await {
                    lock(pending).remove(&id);
                    return Err(e.into());
                }
                let answer = tokio::time::timeout(timeout, rx).await;
                if answer.is_err() {
                    lock(pending).remove(&id);
                }
                answer.map(|got| got.map_err(|_| McpError::Exited))
            }
            Link::Http(http) => tokio::time::timeout(timeout, http.post(&message, Some(id)))
                .await
                .map(|got| got.and_then(|answer| answer.ok_or(McpError::Exited))),
        };
        match answered {
            Ok(Ok(Ok(result))) => Ok(result),
            Ok(Ok(Err((code, message)))) => Err(McpError::Refused {
                method: method.to_owned(),
                code,
                message,
            }),
            Ok(Err(e)) => Err(e),
            Err(_) => {
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
        let message = json!({"jsonrpc": "2.0", "method": method, "params": params});
        match &self.link {
            Link::Stdio { stdin, .. } => Ok(write(stdin, &message).await?),
            Link::Http(http) => http.post(&message, None).await.map(|_| ()),
        }
    }

    /// Completes when the server's output has ended (it exited, or closed it).
    pub async fn exited(&self) {
        self.gone.cancelled().await;
    }

    /// Stops the server (its input closed, then killed if it lingers) and waits for it.
    pub async fn stop(&self) {
        match &self.link {
            Link::Stdio { stdin, child, .. } => {
                let mut child = child.lock().await;
                let _ = stdin.lock().await.shutdown().await;
                if tokio::time::timeout(Duration::from_secs(2), child.wait())
                    .await
                    .is_err()
                {
                    let _ = child.kill().await;
                }
            }
            Link::Http(http) => http.end().await,
        }
        self.gone.cancel();
        self.tracker.close();
    }
}

impl Http {
    /// Posts `message`; for a request (`id`), its answer, read from JSON or from the event
    /// stream (`None`: the stream ended without it).
    async fn post(
        &self,
        message: &Value,
        id: Option<u64>,
    ) -> Result<Option<Result<Value, (i64, String)>>, McpError> {
        let io = |e: &dyn std::fmt::Display| {
            McpError::Io(std::io::Error::other(format!("{}: {e}", self.url)))
        };
        let mut request = self
            .client
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(
                reqwest::header::ACCEPT,
                "application/json, text/event-stream",
            )
            .header("mcp-protocol-version", PROTOCOL_VERSION)
            .body(message.to_string());
        if let Some(session) = lock(&self.session).clone() {
            request = request.header("mcp-session-id", session);
        }
        let mut response = request.send().await.map_err(|e| io(&e))?;
        if let Some(session) = response
            .headers()
            .get("mcp-session-id")
            .and_then(|s| s.to_str().ok())
        {
            *lock(&self.session) = Some(session.to_owned());
        }
        let status = response.status();
        if status == reqwest::StatusCode::NOT_FOUND && lock(&self.session).is_some() {
            // The session ended at the server (a restart): this client is done.
            return Err(McpError::Exited);
        }
        let Some(id) = id else { return Ok(None) };
        if !status.is_success() {
            return Err(io(&format!("answered {status}")));
        }
        let streamed = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|c| c.to_str().ok())
            .is_some_and(|c| c.starts_with("text/event-stream"));
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| io(&e))? {
            if streamed {
                // Events end their lines with CRLF, LF or CR: LF alone is kept (JSON has no
                // raw CR to lose).
                body.extend(chunk.iter().copied().filter(|b| *b != b'\r'));
            } else {
                body.extend_from_slice(&chunk);
            }
            if body.len() > MAX_LINE {
                return Err(io(&format!("an answer over {MAX_LINE} bytes")));
            }
            if streamed && let Some(answer) = answer_in_events(&mut body, id) {
                return Ok(Some(answer));
            }
        }
        if streamed {
            return Ok(None);
        }
        let message: Value = serde_json::from_slice(&body).map_err(|e| io(&e))?;
        Ok(answer_of(&message, id))
    }

    /// Ends the session (best effort).
    async fn end(&self) {
        let session = lock(&self.session).take();
        if let Some(session) = session {
            let _ = self
                .client
                .delete(&self.url)
                .header("mcp-session-id", session)
                .send()
                .await;
        }
    }
}

/// The answer to request `id` among the complete events at the start of `buffer` (which keeps
/// what follows them), if one is.
fn answer_in_events(buffer: &mut Vec<u8>, id: u64) -> Option<Result<Value, (i64, String)>> {
    loop {
        let text = String::from_utf8_lossy(buffer);
        let end = text.find("\n\n")?;
        let event = text[..end].to_owned();
        buffer.drain(..end + 2);
        let data: Vec<&str> = event
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(str::trim_start)
            .collect();
        if let Ok(message) = serde_json::from_str::<Value>(&data.join("\n"))
            && let Some(answer) = answer_of(&message, id)
        {
            return Some(answer);
        }
    }
}

/// `message`'s answer to request `id`, if it is one.
fn answer_of(message: &Value, id: u64) -> Option<Result<Value, (i64, String)>> {
    if message.get("id").and_then(Value::as_u64) != Some(id) {
        return None;
    }
    Some(match (message.get("result"), message.get("error")) {
        (Some(result), _) => Ok(result.clone()),
        (None, Some(error)) => Err((
            error["code"].as_i64().unwrap_or(-32603),
            error["message"].as_str().unwrap_or_default().to_owned(),
        )),
        (None, None) => Err((-32603, "an answer with no result and no error".into())),
    })
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
                if let Some(outcome) = id.as_u64().and_then(|id| answer_of(&message, id)) {
                    let _ = waiting.send(outcome);
                }
            }
            (None, None) => {}
        }
    }
    gone.cancel();
    // Dropped senders fail their calls with `Exited`.
    lock(&pending).clear();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_found_among_events_and_the_rest_kept() {
        let mut buffer = b"id: 1\ndata: \n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"method\":\"notifications/progress\"}\n\ndata: {\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"ok\":true}}\n\ndata: {\"partial".to_vec();
        assert_eq!(
            answer_in_events(&mut buffer, 7),
            Some(Ok(json!({"ok": true})))
        );
        assert_eq!(buffer, b"data: {\"partial");
        let mut refused = b"data: {\"jsonrpc\":\"2.0\",\"id\":3,\"error\":{\"code\":-32602,\"message\":\"Unknown tool\"}}\n\n".to_vec();
        assert_eq!(
            answer_in_events(&mut refused, 3),
            Some(Err((-32602, "Unknown tool".to_owned())))
        );
        let mut other = b"data: {\"jsonrpc\":\"2.0\",\"id\":4,\"result\":{}}\n\n".to_vec();
        assert_eq!(answer_in_events(&mut other, 5), None);
    }
}
