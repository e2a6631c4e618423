//! MCP's stdio transport: JSON-RPC messages one per line on standard input, answers and
//! notifications one per line on standard output, for a desktop host that starts the server
//! as a local command. One session; requests are served concurrently (a long task does not
//! hold up a `ping`); a line longer than the gateway's `max_body_bytes` is refused and skipped.
//! At the end of input the calls in flight finish, then it returns.

use std::sync::Arc;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, LinesCodec, LinesCodecError};

use super::server::{Caller, Incoming, Out, RpcError, Sent, Session, classify, code, response};
use crate::GatewayState;
use crate::api::Credential;

/// Lines waiting to be written.
const OUTPUT_QUEUE: usize = 256;

pub(crate) async fn serve<R, W>(
    state: Arc<GatewayState>,
    identity: String,
    input: R,
    mut output: W,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let limit = state.config.max_body_bytes;
    let caller = Caller {
        session: Some(Arc::new(Session::new(&identity))),
        state,
        identity,
        credential: Credential::default(),
    };
    let (tx, mut rx) = mpsc::channel::<Sent>(OUTPUT_QUEUE);
    let read = async move {
        let mut lines = FramedRead::new(input, LinesCodec::new_with_max_length(limit));
        let mut calls = FuturesUnordered::new();
        let mut open = true;
        while open || !calls.is_empty() {
            tokio::select! {
                line = lines.next(), if open => match line {
                    None => open = false,
                    Some(Err(LinesCodecError::Io(e))) => return Err(e),
                    Some(Err(LinesCodecError::MaxLineLengthExceeded)) => {
                        let refused = RpcError::new(
                            code::INVALID_REQUEST,
                            format!("a message longer than {limit} bytes (max_body_bytes)"),
                        );
                        let _ = tx.send(Sent::message(response(&Value::Null, &Err(refused)))).await;
                    }
                    Some(Ok(line)) if line.trim().is_empty() => {}
                    Some(Ok(line)) => {
                        let message = match serde_json::from_str::<Value>(&line) {
                            Ok(m) => m,
                            Err(e) => {
                                let refused = RpcError::new(code::PARSE, format!("not JSON: {e}"));
                                let _ = tx.send(Sent::message(response(&Value::Null, &Err(refused)))).await;
                                continue;
                            }
                        };
                        match classify(message) {
                            Ok(Incoming::Request { id, method, params }) => {
                                let (caller, tx) = (caller.clone(), tx.clone());
                                calls.push(async move {
                                    let out = Out::new(tx.clone());
                                    let answer = caller.request(&id, &method, &params, &out).await;
                                    if !matches!(&answer, Err(e) if e.code == code::CANCELLED) {
                                        let _ = tx.send(Sent::message(response(&id, &answer))).await;
                                    }
                                });
                            }
                            Ok(Incoming::Notification { method, params }) => {
                                caller.notification(&method, &params);
                            }
                            Ok(Incoming::Response) => {}
                            Err((id, refused)) => {
                                let _ = tx.send(Sent::message(response(&id, &Err(refused)))).await;
                            }
                        }
                    }
                },
                Some(()) = calls.next(), if !calls.is_empty() => {}
            }
        }
        Ok(())
    };
    let write = async {
        while let Some(sent) = rx.recv().await {
            // Event ids and priming events are for streams a client resumes: not here.
            let Some(message) = sent.message else {
                continue;
            };
            let mut line = message.to_string();
            line.push('\n');
            output.write_all(line.as_bytes()).await?;
            output.flush().await?;
        }
        Ok::<_, std::io::Error>(())
    };
    // The reader owns the last sender: when it returns, the writer drains and ends.
    let (read, write) = tokio::join!(read, write);
    read.and(write)
}
