//! The deployment configs under `deploy/` are checked by the tools that exist for them:
//! `promtool` for the Prometheus config and alert rules (with unit tests), `nats-server -t`
//! for every NATS config, `systemd-analyze verify` for the unit, YAML parsing and structure
//! checks for compose and Kubernetes; and every metric the dashboard and the alerts use is
//! one a live coordinator and agents really export.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use agent_sdk::{BroadcastTarget, Context, HandlerError};
use chorus_tests::{WAIT, agent, coordinator, http_get, server};

fn deploy(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy")
        .join(path)
}

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{cmd:?} failed:\n{text}");
    text
}

fn promtool() -> String {
    std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into())
}

#[test]
fn prometheus_config_and_alert_rules_pass_promtool_including_the_rule_unit_tests() {
    run(Command::new(promtool())
        .args(["check", "config"])
        .arg(deploy("prometheus/prometheus.yml")));
    // The compose config as Prometheus sees it in its container, next to the mounted rules.
    let mounted = tempfile::tempdir().expect("tempdir");
    for (from, to) in [
        ("compose/prometheus.yml", "prometheus.yml"),
        ("prometheus/alerts.yml", "alerts.yml"),
    ] {
        std::fs::copy(deploy(from), mounted.path().join(to)).expect("copy");
    }
    run(Command::new(promtool())
        .args(["check", "config"])
        .arg(mounted.path().join("prometheus.yml")));
    let rules = run(Command::new(promtool())
        .args(["check", "rules"])
        .arg(deploy("prometheus/alerts.yml")));
    assert!(rules.contains("5 rules found"), "{rules}");
    let tests = run(Command::new(promtool())
        .args(["test", "rules", "alerts_test.yml"])
        .current_dir(deploy("prometheus")));
    assert!(tests.contains("SUCCESS"), "{tests}");
    // Every alert has a test.
    let alerts = std::fs::read_to_string(deploy("prometheus/alerts.yml")).expect("alerts");
    let tested = std::fs::read_to_string(deploy("prometheus/alerts_test.yml")).expect("tests");
    for line in alerts
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
    {
        assert!(
            tested.contains(&format!("alertname: {line}")),
            "alert {line} has no test"
        );
    }
}

fn nats_t(conf: &Path, env: &[(&str, &str)]) {
    let binary = chorus_nats_server::find_binary().expect("nats-server installed");
    let mut cmd = Command::new(binary);
    cmd.arg("-t").arg("-c").arg(conf);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let text = run(&mut cmd);
    assert!(text.contains("is valid"), "{text}");
}

fn yaml_docs(path: &str) -> Vec<serde_yaml::Value> {
    let text = std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{path}: {e}")))
        .collect()
}

#[test]
fn every_nats_config_passes_nats_server_t() {
    for n in 1..=3 {
        nats_t(&deploy(&format!("nats-cluster/n{n}.conf")), &[]);
    }
    nats_t(&deploy("compose/nats.conf"), &[]);
    // The Kubernetes config lives in a ConfigMap.
    let docs = yaml_docs("k8s/nats.yaml");
    let conf = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["nats.conf"].as_str())
        .expect("nats.conf in the ConfigMap")
        .to_owned();
    let dir = tempfile::tempdir().expect("tempdir");
    // The TLS files the Secret would mount, made by `chorus certs`.
    let certs = chorus::certs::generate(&dir.path().join("tls"), &["chorus-nats".into()], "client")
        .expect("dev certificates");
    let tls_dir = dir.path().join("tls");
    std::fs::copy(&certs.server_cert, tls_dir.join("tls.crt")).expect("copy");
    std::fs::copy(&certs.server_key, tls_dir.join("tls.key")).expect("copy");
    std::fs::copy(&certs.ca, tls_dir.join("ca.crt")).expect("copy");
    let conf = conf.replace("/etc/nats/tls/", &format!("{}/", tls_dir.display()));
    assert!(conf.contains("verify: true"), "client TLS is mutual");
    let path = dir.path().join("nats.conf");
    std::fs::write(&path, conf).expect("write");
    nats_t(&path, &[("POD_NAME", "chorus-nats-0")]);
}

#[test]
fn kubernetes_and_compose_files_have_the_promised_shape() {
    let nats = yaml_docs("k8s/nats.yaml");
    let sts = nats
        .iter()
        .find(|d| d["kind"] == "StatefulSet")
        .expect("statefulset");
    assert_eq!(sts["spec"]["replicas"], 3);
    assert_eq!(
        sts["spec"]["template"]["spec"]["containers"][0]["image"],
        "nats:2.15.1"
    );
    let coord = yaml_docs("k8s/coordinator.yaml");
    let dep = coord
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("deployment");
    assert_eq!(dep["spec"]["replicas"], 2);
    assert_eq!(
        dep["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"],
        "true"
    );
    assert!(coord.iter().any(|d| d["kind"] == "ServiceMonitor"));
    for doc in nats.iter().chain(&coord) {
        assert!(
            doc["apiVersion"].is_string() && doc["metadata"]["name"].is_string(),
            "{doc:?}"
        );
    }
    // The coordinator's config in its ConfigMap is one `chorus serve` accepts.
    let toml = coord
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["chorus.toml"].as_str())
        .expect("chorus.toml")
        .to_owned();
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("chorus.toml");
    std::fs::write(&path, toml).expect("write");
    let cfg = chorus::CoordinatorConfig::load(Some(&path)).expect("valid coordinator config");
    assert_eq!(cfg.replicas, 3);

    let compose = &yaml_docs("compose/docker-compose.yml")[0];
    for service in ["nats", "coordinator", "demo", "prometheus", "grafana"] {
        assert!(
            compose["services"][service]["image"].is_string(),
            "service {service}"
        );
    }
    assert_eq!(compose["services"]["coordinator"]["deploy"]["replicas"], 2);
    let dashboard: serde_json::Value = serde_json::from_slice(
        &std::fs::read(deploy("grafana/chorus-dashboard.json")).expect("dashboard"),
    )
    .expect("dashboard is JSON");
    assert!(dashboard["panels"].as_array().is_some_and(|p| p.len() >= 8));
}

#[test]
fn the_systemd_unit_verifies() {
    let unit = std::fs::read_to_string(deploy("systemd/chorus-coordinator.service")).expect("unit");
    // Verify the unit as written, with the binary it starts stood in by one that exists here.
    let unit = unit.replace("/usr/local/bin/chorus", "/bin/true");
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("chorus-coordinator.service");
    std::fs::write(&path, unit).expect("write");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .expect("systemd-analyze is available");
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "systemd-analyze verify exited with {}: {text}",
        out.status
    );
    // Warnings (an unknown key is only "ignoring") do not change the exit status.
    let problems: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("chorus-coordinator.service"))
        .collect();
    assert!(problems.is_empty(), "systemd-analyze verify: {problems:?}");
}

/// Metric names used in a PromQL expression (`chorus_...`), with histogram suffixes removed.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut i = 0;
    while let Some(pos) = text[i..].find("chorus_") {
        let start = i + pos;
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let name = &text[start..end];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        out.insert(base.to_owned());
        i = end;
    }
    out
}

#[tokio::test]
async fn every_metric_in_the_dashboard_and_the_alerts_is_exported_by_a_live_system() {
    let server = server();
    let coordinator = coordinator(&server, true).await;
    let worker = agent(&server, "deploy-worker").await;
    worker
        .on_command("ping", |_ctx: Context, (): ()| async {
            Ok::<_, HandlerError>(())
        })
        .await
        .expect("register");
    let client = agent(&server, "deploy-client").await;
    let _: () = client
        .request("deploy-worker", "ping", &())
        .await
        .expect("ping");
    client
        .broadcast(
            &BroadcastTarget::All,
            "ping",
            &(),
            std::time::Duration::from_secs(1),
        )
        .await
        .expect("broadcast");
    let addr = coordinator.metrics_addr().expect("metrics");
    // The registry gauges are set by the coordinator's sweep; wait for one.
    let text = chorus_tests::eventually(WAIT, "agent gauges", || async {
        let (_, text) = http_get(addr, "/metrics").await;
        text.contains("chorus_coordinator_agents").then_some(text)
    })
    .await;
    let exported: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect();
    let dashboard =
        std::fs::read_to_string(deploy("grafana/chorus-dashboard.json")).expect("dashboard");
    let alerts = std::fs::read_to_string(deploy("prometheus/alerts.yml")).expect("alerts");
    let used: BTreeSet<String> = names_in(&dashboard)
        .into_iter()
        .chain(names_in(&alerts))
        .collect();
    assert!(used.len() >= 10, "{used:?}");
    let missing: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
    assert!(
        missing.is_empty(),
        "used but not exported: {missing:?}\nexported: {exported:?}"
    );
    coordinator.shutdown().await;
}
