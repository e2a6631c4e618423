//! The `chorus` binary against a real server: `up --once`, `request`, `send`, `listen`.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn chorus(server: &str, args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .arg("--server")
        .arg(server)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run chorus");
    // Every wait has a deadline.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().expect("wait").is_some() {
            return child.wait_with_output().expect("output");
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chorus {args:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn up_once_runs_the_demo_against_a_running_server_and_exits_cleanly() {
    let server = chorus_tests::server();
    let out = chorus(server.url(), &["up", "--once"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    assert!(t.contains("using the NATS server at"), "{t}");
    assert!(t.contains("[AIXP] result (5002 ok)"), "{t}");
    assert!(t.contains("refused with 5018 invalid_argument"), "{t}");
    assert!(t.contains("5010 loop_detected"), "{t}");
    assert!(t.contains("chorus up: stopped"), "{t}");
}

#[test]
fn client_commands_report_codes_and_exit_status() {
    let server = chorus_tests::server();
    // Nobody serves: exit code 2 and the no-responders code.
    let out = chorus(
        server.url(),
        &["request", "--to", "nobody", "--command", "x"],
    );
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(text(&out).contains("5012 no_responders"));

    // Bad JSON is refused before anything is sent.
    let out = chorus(server.url(), &["send", "--topic", "t", "{not json"]);
    assert!(!out.status.success());
    assert!(text(&out).contains("payload is not JSON"), "{}", text(&out));

    // Publishing an event works without listeners.
    let out = chorus(server.url(), &["send", "--topic", "task.done", "\"ok\""]);
    assert!(out.status.success(), "{}", text(&out));

    // No server at all: a clear error, not a hang.
    let out = chorus("nats://127.0.0.1:1", &["send", "--topic", "t"]);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("cannot reach the bus"),
        "{}",
        text(&out)
    );
}

/// `OTEL_EXPORTER_OTLP_ENDPOINT` switches the OTLP exporter on: a stand-in collector receives
/// the demo's spans over OTLP/HTTP.
#[cfg(feature = "otlp")]
#[test]
fn up_exports_spans_over_otlp_when_an_endpoint_is_configured() {
    use std::io::{Read, Write};
    use std::sync::{Arc, Mutex};
    let collector = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let endpoint = format!("http://{}", collector.local_addr().expect("addr"));
    let received: Arc<Mutex<Vec<u8>>> = Arc::default();
    {
        let received = Arc::clone(&received);
        std::thread::spawn(move || {
            for stream in collector.incoming() {
                let Ok(mut stream) = stream else { continue };
                let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                let mut buf = vec![0u8; 1 << 20];
                let mut got = Vec::new();
                // Read the request: headers, then as much body as Content-Length says.
                while let Ok(n) = stream.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    got.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
                    if let Some(head_end) = text.find("\r\n\r\n") {
                        let len = text
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if got.len() >= head_end + 4 + len {
                            break;
                        }
                    }
                }
                received.lock().expect("lock").extend_from_slice(&got);
                let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n");
            }
        });
    }
    let server = chorus_tests::server();
    let out = Command::new(env!("CARGO_BIN_EXE_chorus"))
        .args([
            "--server",
            server.url(),
            "up",
            "--once",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
        .output()
        .expect("run chorus up");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = String::from_utf8_lossy(&received.lock().expect("lock")).into_owned();
    assert!(
        got.starts_with("POST /v1/traces"),
        "collector saw: {:.200}",
        got
    );
    assert!(
        got.contains("chorus.handle calculation"),
        "spans of the demo's calculator exported"
    );
}
