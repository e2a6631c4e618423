//! The gateway's scenarios: requests over HTTP, HTTPS, MCP and A2A beside the same call over
//! NATS (or beside a reference server), alternating call by call on kept-alive connections.

use super::*;

/// The three lists of [`gateway_latency`].
pub(crate) struct GatewayTimings {
    /// The request with the SDK over NATS.
    pub(crate) nats: Vec<Duration>,
    /// The same request through the gateway.
    pub(crate) http: Vec<Duration>,
    /// The same HTTP request to a path the gateway answers 404 at once: its HTTP round trip
    /// alone, without the bus (the yardstick of the gateway's own share).
    pub(crate) floor: Vec<Duration>,
}

/// Sequential JSON requests to an echo agent, alternating request by request: with the SDK
/// over NATS, through the HTTP gateway at `gateway` as the edge identity `api_key` names,
/// the same 128-byte-ish string payload both ways, and the same HTTP request to a path the
/// gateway does not route (its HTTP round trip alone).
pub(crate) async fn gateway_latency(
    bus: &Bus<'_>,
    gateway: std::net::SocketAddr,
    api_key: &str,
    n: usize,
    size: usize,
) -> anyhow::Result<GatewayTimings> {
    let echo = echo_agent(bus, "bench-gw-echo").await?;
    let client = agent(bus, "bench-gw-client").await?;
    let text = "x".repeat(size.saturating_sub(2));
    let body = serde_json::to_vec(
        &serde_json::json!({"to": "bench-gw-echo", "command": "echo", "payload": text}),
    )?;
    let header = format!("x-api-key: {api_key}");
    let mut http = crate::http::HttpClient::connect(gateway).await?;
    let mut timings = GatewayTimings {
        nats: Vec::with_capacity(n),
        http: Vec::with_capacity(n),
        floor: Vec::with_capacity(n),
    };
    let timed = async {
        for i in 0..n + WARM_UP {
            let call = Call::agent("bench-gw-echo", "echo").json_payload(&text)?;
            let t = Instant::now();
            client.call(call).await?;
            let nats = t.elapsed();
            let http_took = timed_request(&mut http, "the gateway", &header, &body).await?;
            let t = Instant::now();
            let (status, answer) = http.post_json("/v1/unrouted", &header, &body).await?;
            let floor = t.elapsed();
            if status != 404 {
                anyhow::bail!(
                    "the gateway answered {status} for an unrouted path: {}",
                    String::from_utf8_lossy(&answer)
                );
            }
            if i >= WARM_UP {
                timings.nats.push(nats);
                timings.http.push(http_took);
                timings.floor.push(floor);
            }
        }
        anyhow::Ok(())
    }
    .await;
    client.shutdown().await;
    echo.shutdown().await;
    timed.map(|()| timings)
}

/// `n` timings each of `first` and `second`, called alternately (each with the call's number),
/// after [`WARM_UP`] untimed pairs.
async fn alternating(
    n: usize,
    mut first: impl AsyncFnMut(usize) -> anyhow::Result<Duration>,
    mut second: impl AsyncFnMut(usize) -> anyhow::Result<Duration>,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let (mut firsts, mut seconds) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for i in 0..n + WARM_UP {
        let one = first(i).await?;
        let other = second(i).await?;
        if i >= WARM_UP {
            firsts.push(one);
            seconds.push(other);
        }
    }
    Ok((firsts, seconds))
}

/// How long one `POST /v1/requests` of `body` takes on `http`, which must answer 200.
async fn timed_request(
    http: &mut crate::http::HttpClient,
    what: &str,
    header: &str,
    body: &[u8],
) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let (status, answer) = http.post_json("/v1/requests", header, body).await?;
    let took = t.elapsed();
    if status != 200 {
        anyhow::bail!(
            "{what} answered {status}: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    Ok(took)
}

/// Request-reply through two gateways, alternating call by call on one kept-alive connection
/// each: one serving plain HTTP (the first list), one HTTPS (the second, its certificate
/// signed by `ca_pem`), to the same echo agent.
pub(crate) async fn gateway_https(
    bus: &Bus<'_>,
    plain: (std::net::SocketAddr, &str),
    tls: (std::net::SocketAddr, &str, &[u8]),
    n: usize,
    size: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let echo = echo_agent(bus, "bench-tls-echo").await?;
    let text = "x".repeat(size.saturating_sub(2));
    let body = serde_json::to_vec(
        &serde_json::json!({"to": "bench-tls-echo", "command": "echo", "payload": text}),
    )?;
    let plain_header = format!("x-api-key: {}", plain.1);
    let tls_header = format!("x-api-key: {}", tls.1);
    let mut to_plain = crate::http::HttpClient::connect(plain.0).await?;
    let mut to_tls = crate::http::HttpClient::connect_tls(tls.0, tls.2).await?;
    let timed = alternating(
        n,
        async |_| timed_request(&mut to_plain, "the plain gateway", &plain_header, &body).await,
        async |_| timed_request(&mut to_tls, "the HTTPS gateway", &tls_header, &body).await,
    )
    .await;
    echo.shutdown().await;
    timed
}

/// An MCP `tools/call` through the gateway (JSON answered, on one kept-alive connection) and
/// the same call as a native Chorus request, alternating call by call, to the same echo
/// agent's command (the tool `bench-mcp-echo.echo`) with the same payload.
pub(crate) async fn gateway_mcp(
    bus: &Bus<'_>,
    gateway: std::net::SocketAddr,
    api_key: &str,
    n: usize,
    size: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    // Registered (it heartbeats), so the MCP server lists its command as a tool.
    let echo = bus
        .options("bench-mcp-echo")
        .service_discovery(false)
        .queue_capacity(QUEUE_CAPACITY)
        .connect()
        .await?;
    echo.handle_command("echo", EchoHandler).await?;
    let client = agent(bus, "bench-mcp-client").await?;
    let arguments = serde_json::json!({"text": "x".repeat(size.saturating_sub(11))});
    let body = serde_json::to_vec(&serde_json::json!({
        "jsonrpc": "2.0", "id": 1, "method": "tools/call",
        "params": {"name": "bench-mcp-echo.echo", "arguments": arguments},
    }))?;
    let header = format!("x-api-key: {api_key}\r\naccept: application/json");
    let mut http = crate::http::HttpClient::connect(gateway).await?;
    // The tool is listed once the echo agent's first heartbeat is in the registry.
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, answer) = http.post_json("/mcp", &header, &body).await?;
        let answer: serde_json::Value = serde_json::from_slice(&answer)?;
        if status == 200
            && answer["result"]["isError"] != serde_json::Value::Bool(true)
            && answer.get("result").is_some()
        {
            break;
        }
        if Instant::now() > deadline {
            anyhow::bail!("the gateway's MCP server does not list bench-mcp-echo.echo: {answer}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let timed = alternating(
        n,
        async |_| {
            let call = Call::agent("bench-mcp-echo", "echo").json_payload(&arguments)?;
            let t = Instant::now();
            client.call(call).await?;
            Ok(t.elapsed())
        },
        async |_| {
            let t = Instant::now();
            let (status, answer) = http.post_json("/mcp", &header, &body).await?;
            let took = t.elapsed();
            if status != 200
                || !answer.starts_with(br#"{"id":1,"jsonrpc":"2.0","result":{"content""#)
            {
                anyhow::bail!(
                    "the MCP server answered {status}: {}",
                    String::from_utf8_lossy(&answer)
                );
            }
            Ok(took)
        },
    )
    .await;
    client.shutdown().await;
    echo.shutdown().await;
    timed
}

/// A2A `SendMessage` (blocking) two ways, alternating call by call on one kept-alive
/// connection each: to the official a2a-sdk server at `reference` (the first list) and to the
/// gateway's binding of a Rust agent's echo task (the second). Both answer with the completed
/// task and its artifact.
pub(crate) async fn gateway_a2a(
    bus: &Bus<'_>,
    gateway: std::net::SocketAddr,
    api_key: &str,
    reference: std::net::SocketAddr,
    n: usize,
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let worker = agent(bus, "bench-a2a").await?;
    worker
        .on_task("echo", |_task: chorus_sdk::TaskContext, text: String| async move {
            Ok::<_, HandlerError>(text)
        })
        .await?;
    let mut to_reference = crate::http::HttpClient::connect(reference).await?;
    let mut to_gateway = crate::http::HttpClient::connect(gateway).await?;
    let gateway_header = format!("x-api-key: {api_key}\r\na2a-version: 1.0");
    let text = "x".repeat(100);
    let body = |id: usize| {
        serde_json::to_vec(&serde_json::json!({
            "jsonrpc": "2.0", "id": id, "method": "SendMessage",
            "params": {"message": {"messageId": uuid::Uuid::now_v7().to_string(), "role": "ROLE_USER",
                                   "parts": [{"text": text}]}, "configuration": {}},
        }))
    };
    let timed = alternating(
        n,
        async |i| {
            let t = Instant::now();
            let (status, answer) = to_reference
                .post_json("/", "a2a-version: 1.0", &body(i)?)
                .await?;
            let took = t.elapsed();
            check_completed("the a2a-sdk server", status, &answer)?;
            Ok(took)
        },
        async |i| {
            let t = Instant::now();
            let (status, answer) = to_gateway
                .post_json("/a2a/agents/bench-a2a/echo/", &gateway_header, &body(i)?)
                .await?;
            let took = t.elapsed();
            check_completed("the gateway", status, &answer)?;
            Ok(took)
        },
    )
    .await;
    worker.shutdown().await;
    timed
}

fn check_completed(who: &str, status: u16, answer: &[u8]) -> anyhow::Result<()> {
    let text = String::from_utf8_lossy(answer);
    if status != 200 || !text.contains("TASK_STATE_COMPLETED") {
        anyhow::bail!("{who} answered {status}: {text}");
    }
    Ok(())
}

/// Requests sent before the gateway scenario starts timing (connections and caches warm).
const WARM_UP: usize = 20;
