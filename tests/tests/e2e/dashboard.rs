//! The Grafana dashboard against live data: `chorus serve` and the demo agents in a process of
//! their own (`chorus up --join`), Prometheus (the real one) started with the shipped
//! `deploy/prometheus/prometheus.yml`, its addresses pointed at this test's processes, finding
//! the agents through the coordinator's service discovery; then every query of every panel
//! is asked of Prometheus's API and must return data.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus_tests::{Processes, chorus_binary, try_http_get};

/// How long Prometheus has to discover, scrape and have data for every panel.
const DATA_WAIT: Duration = Duration::from_secs(120);

fn deploy(path: &str) -> std::path::PathBuf {
    std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy")).join(path)
}

/// Starts `cmd` with its output read on a thread (so it never fills a pipe); the lines come
/// out of the receiver.
fn spawn_reading(cmd: &mut Command, procs: &mut Processes) -> mpsc::Receiver<String> {
    let mut child: Child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let (tx, rx) = mpsc::channel();
    for stream in [
        child
            .stdout
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        child
            .stderr
            .take()
            .map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
    ]
    .into_iter()
    .flatten()
    {
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stream).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    procs.0.push(child);
    rx
}

/// The first line containing `marker`, waiting at most `limit`; every line seen is kept for
/// the failure message.
fn line_with(rx: &mpsc::Receiver<String>, marker: &str, limit: Duration) -> String {
    let deadline = Instant::now() + limit;
    let mut seen = Vec::new();
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        match rx.recv_timeout(left) {
            Ok(line) if line.contains(marker) => return line,
            Ok(line) => seen.push(line),
            Err(_) => break,
        }
    }
    panic!(
        "no line with {marker:?} within {limit:?}:\n{}",
        seen.join("\n")
    );
}

/// The `host:port` in `http://host:port/metrics` of a line.
fn addr_in(line: &str) -> SocketAddr {
    let rest = line.split("http://").nth(1).expect("an http URL");
    rest.split('/')
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

/// Percent-encodes a query parameter.
fn encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Asks Prometheus `expr`; the result's samples as (labels, value).
async fn query(prometheus: SocketAddr, expr: &str) -> Vec<(serde_json::Value, f64)> {
    let Ok((200, body)) =
        try_http_get(prometheus, &format!("/api/v1/query?query={}", encode(expr))).await
    else {
        return Vec::new();
    };
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    json["data"]["result"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|r| {
            let value = r["value"][1].as_str()?.parse::<f64>().ok()?;
            Some((r["metric"].clone(), value))
        })
        .collect()
}

/// The shipped Prometheus config with this test's addresses and 1 s intervals.
fn prometheus_config(coordinator: SocketAddr) -> String {
    let text = std::fs::read_to_string(deploy("prometheus/prometheus.yml")).expect("config");
    let mut config: serde_yaml::Value = serde_yaml::from_str(&text).expect("yaml");
    config["global"]["scrape_interval"] = "1s".into();
    config["global"]["evaluation_interval"] = "1s".into();
    let jobs = config["scrape_configs"]
        .as_sequence_mut()
        .expect("scrape_configs");
    let mut discovered = false;
    for job in jobs {
        if let Some(statics) = job["static_configs"].as_sequence_mut() {
            for s in statics {
                s["targets"] = vec![coordinator.to_string()].into();
            }
        }
        if let Some(sds) = job["http_sd_configs"].as_sequence_mut() {
            for sd in sds {
                let url = sd["url"].as_str().expect("sd url").to_owned();
                // The shipped config asks the coordinator's listener for its agents.
                assert!(url.ends_with("/sd/agents"), "{url}");
                sd["url"] = format!("http://{coordinator}/sd/agents").into();
                sd["refresh_interval"] = "1s".into();
                discovered = true;
            }
        }
    }
    assert!(
        discovered,
        "the shipped config finds agents by the coordinator's service discovery"
    );
    serde_yaml::to_string(&config).expect("yaml")
}

#[tokio::test]
async fn every_dashboard_panel_query_returns_data_from_the_live_demo() {
    let server = chorus_tests::server();
    let chorus = chorus_binary();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut procs = Processes::default();

    let serve = spawn_reading(
        Command::new(&chorus)
            .args(["--server", server.url(), "serve"])
            .env("CHORUS_SERVE__METRICS_ADDR", "127.0.0.1:0"),
        &mut procs,
    );
    let coordinator = addr_in(&line_with(&serve, "metrics on http://", DATA_WAIT));

    let demo = spawn_reading(
        Command::new(&chorus).args([
            "--server",
            server.url(),
            "up",
            "--join",
            "--interval",
            "1s",
            "--metrics-addr",
            "127.0.0.1:0",
        ]),
        &mut procs,
    );
    let demo_metrics = addr_in(&line_with(&demo, "metrics at http://", DATA_WAIT));

    // The coordinator lists the demo's process for Prometheus, found through the registry.
    let sd = chorus_tests::eventually(DATA_WAIT, "the demo in /sd/agents", || async {
        let (status, body) = try_http_get(coordinator, "/sd/agents").await.ok()?;
        // The demo's agents register one by one: wait for the first and the last of them.
        (status == 200
            && body.contains(&demo_metrics.to_string())
            && body.contains("ocr-agent")
            && body.contains("orchestrator"))
        .then_some(body)
    })
    .await;
    let groups: serde_json::Value = serde_json::from_str(&sd).expect("sd json");
    assert_eq!(groups.as_array().map(Vec::len), Some(1), "{sd}");
    assert_eq!(groups[0]["labels"]["__metrics_path__"], "/metrics", "{sd}");
    assert!(
        groups[0]["labels"]["chorus_agents"]
            .as_str()
            .is_some_and(|ids| ids.contains("ocr-agent") && ids.contains("orchestrator")),
        "{sd}"
    );

    std::fs::copy(
        deploy("prometheus/alerts.yml"),
        dir.path().join("alerts.yml"),
    )
    .expect("alerts");
    let config = dir.path().join("prometheus.yml");
    std::fs::write(&config, prometheus_config(coordinator)).expect("write config");
    let prometheus: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
    let binary = std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
    let log = spawn_reading(
        Command::new(&binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={prometheus}")),
        &mut procs,
    );
    let ready = tokio::time::timeout(DATA_WAIT, async {
        loop {
            if let Ok((200, _)) = try_http_get(prometheus, "/-/ready").await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await;
    if ready.is_err() {
        let lines: Vec<String> = log.try_iter().collect();
        panic!("prometheus not ready: {}", lines.join("\n"));
    }

    let dashboard: serde_json::Value = serde_json::from_slice(
        &std::fs::read(deploy("grafana/chorus-dashboard.json")).expect("dashboard"),
    )
    .expect("dashboard json");
    // The data source and the agent are chosen in variables, not written into the panels.
    let variables: Vec<&str> = dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(variables, ["datasource", "agent"]);
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title}");
        for target in panel["targets"].as_array().expect("targets") {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title}");
            let expr = target["expr"].as_str().expect("expr");
            // "All" agents, as the variable's allValue says.
            queries.push((title.clone(), expr.replace("$agent", ".*")));
        }
    }
    assert!(queries.len() >= 12, "{queries:?}");

    // Every query has data: at least one sample that is a number.
    let deadline = Instant::now() + DATA_WAIT;
    let mut empty = queries.clone();
    while !empty.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for (title, expr) in empty {
            let samples = query(prometheus, &expr).await;
            if !samples.iter().any(|(_, v)| v.is_finite()) {
                still.push((title, expr));
            }
        }
        empty = still;
        if !empty.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    assert!(empty.is_empty(), "panel queries without data: {empty:#?}");

    // The agents' series came from the discovered target, and the agent variable has values.
    let up = query(prometheus, r#"up{job="chorus-agents"}"#).await;
    assert!(
        up.iter().any(|(m, v)| *v == 1.0
            && m["instance"] == demo_metrics.to_string().as_str()
            && m["chorus_agents"]
                .as_str()
                .is_some_and(|a| a.contains("ledger"))),
        "{up:?}"
    );
    let agents = query(prometheus, "count by (agent) (chorus_agent_traffic_total)").await;
    assert!(
        agents.iter().any(|(m, _)| m["agent"] == "calculator"),
        "{agents:?}"
    );
    // And the process and build families are there.
    for family in ["process_resident_memory_bytes", "chorus_build_info"] {
        assert!(!query(prometheus, family).await.is_empty(), "no {family}");
    }
}
