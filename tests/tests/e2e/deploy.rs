//! The deployment configs under `deploy/` are checked by the tools that exist for them:
//! `promtool` for the Prometheus config and alert rules (with unit tests), `nats-server -t`
//! for every NATS config, `systemd-analyze verify` for the unit, `kubernetes-validate --strict`
//! (the Kubernetes JSON schemas) for the manifests, two YAML parsers that must agree for every
//! YAML file, structure checks for compose, Kubernetes and the Dockerfile (paths, packages,
//! TLS files); and every metric the dashboard and the alerts use is one a live coordinator and
//! agents really export.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use chorus_sdk::{BroadcastTarget, Context, HandlerError};
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
    nats_t(&deploy("nats-cluster/leaf.conf"), &[]);
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
    let certs =
        chorus_cli::certs::generate(&dir.path().join("tls"), &["chorus-nats".into()], "client")
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
    // The ServiceMonitor (a custom resource, no schema in kubernetes-validate) selects the
    // Service and scrapes a port that Service names.
    let monitor = coord
        .iter()
        .find(|d| d["kind"] == "ServiceMonitor")
        .expect("servicemonitor");
    let service = coord
        .iter()
        .find(|d| d["kind"] == "Service")
        .expect("service");
    assert_eq!(
        monitor["spec"]["selector"]["matchLabels"],
        service["metadata"]["labels"]
    );
    let port = &monitor["spec"]["endpoints"][0]["port"];
    assert!(
        service["spec"]["ports"]
            .as_sequence()
            .expect("ports")
            .iter()
            .any(|p| p["name"] == *port),
        "{port:?}"
    );
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
    let cfg =
        chorus_coordinator::CoordinatorConfig::load(Some(&path)).expect("valid coordinator config");
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

fn kubernetes_validate() -> String {
    std::env::var("KUBERNETES_VALIDATE").unwrap_or_else(|_| "kubernetes-validate".into())
}

/// Every file under `deploy/` whose name ends in one of `exts`, relative to `deploy/`.
fn deploy_files(exts: &[&str]) -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read_dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.push(path);
            }
        }
    }
    let root = deploy("");
    let mut all = Vec::new();
    walk(&root, &mut all);
    let mut out: Vec<String> = all
        .iter()
        .filter(|p| {
            p.extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| exts.contains(&e))
        })
        .map(|p| {
            p.strip_prefix(&root)
                .expect("under deploy/")
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    out.sort();
    out
}

/// Kinds without a schema in kubernetes-validate (custom resources): checked by shape below.
const CUSTOM_KINDS: &[&str] = &["ServiceMonitor"];

#[test]
fn every_kubernetes_manifest_passes_the_schema_validator() {
    let manifests = deploy_files(&["yaml", "yml"])
        .into_iter()
        .filter(|f| f.starts_with("k8s/"))
        .collect::<Vec<_>>();
    assert!(manifests.len() >= 2, "{manifests:?}");
    for file in &manifests {
        let docs = yaml_docs(file);
        // Strict: unknown fields are errors too. Any error fails the command.
        let text = run(Command::new(kubernetes_validate())
            .arg("--strict")
            .arg(deploy(file)));
        let passed = text.matches(" passed for resource ").count();
        let custom = docs
            .iter()
            .filter(|d| CUSTOM_KINDS.iter().any(|k| d["kind"] == *k))
            .count();
        assert_eq!(passed + custom, docs.len(), "{file}: {text}");
        for line in text.lines().filter(|l| !l.starts_with("INFO ")) {
            assert!(
                line.starts_with("WARN ")
                    && line.contains("Couldn't find schema for kind")
                    && CUSTOM_KINDS
                        .iter()
                        .any(|k| line.contains(&format!("kind {k} "))),
                "{file}: {line}"
            );
        }
    }
    // The validator really checks: a wrong type and an unknown field are refused.
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\nspec:\n  replicas: two\n",
    )
    .expect("write");
    let out = Command::new(kubernetes_validate())
        .arg("--strict")
        .arg(&bad)
        .output()
        .expect("run kubernetes-validate");
    assert!(!out.status.success(), "a bad manifest passed");
    std::fs::write(
        &bad,
        "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  portz: []\n",
    )
    .expect("write");
    let out = Command::new(kubernetes_validate())
        .arg("--strict")
        .arg(&bad)
        .output()
        .expect("run kubernetes-validate");
    assert!(!out.status.success(), "an unknown field passed");
}

/// The python of kubernetes-validate's virtualenv, which also holds PyYAML and
/// dockerfile-parse (scripts/install-kubernetes-validate).
fn tools_python() -> PathBuf {
    Path::new(&kubernetes_validate())
        .parent()
        .map(|bin| bin.join("python"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| "python3".into())
}

/// Every YAML file under `deploy/` read by two parsers: serde_yaml (YAML 1.2) and PyYAML
/// (YAML 1.1, what Kubernetes, Compose and Prometheus's Go parsers follow), with duplicate keys
/// refused, and both must read the same values (no `yes`/`on`/octal ambiguity).
#[test]
fn every_yaml_file_under_deploy_reads_the_same_in_two_parsers() {
    let files = deploy_files(&["yaml", "yml"]);
    assert!(files.len() >= 9, "{files:?}");
    let python = tools_python();
    const READ: &str = r#"
import json, sys, yaml
class Strict(yaml.SafeLoader):
    pass
def mapping(loader, node):
    keys = [loader.construct_object(k, deep=True) for k, _ in node.value]
    dups = {k for k in keys if keys.count(k) > 1}
    if dups:
        raise yaml.constructor.ConstructorError(None, None, "duplicate keys %s" % sorted(dups), node.start_mark)
    return loader.construct_mapping(node, deep=True)
Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
with open(sys.argv[1]) as f:
    docs = list(yaml.load_all(f, Loader=Strict))
print(json.dumps(docs))
"#;
    for file in &files {
        let text = run(Command::new(&python).args(["-c", READ]).arg(deploy(file)));
        let pyyaml: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{file}: PyYAML's output {text}: {e}"));
        let serde: serde_json::Value = serde_json::to_value(yaml_docs(file))
            .unwrap_or_else(|e| panic!("{file}: as JSON: {e}"));
        assert_eq!(
            pyyaml, serde,
            "{file}: PyYAML and serde_yaml read it differently"
        );
    }
}

/// The coordinator reaches the mutual-TLS NATS of `nats.yaml`: `tls://` to its Service, with a
/// CA, certificate and key that a mounted Secret (same layout as the server's) provides.
#[test]
fn the_kubernetes_coordinator_connects_with_tls_from_a_mounted_secret() {
    let nats = yaml_docs("k8s/nats.yaml");
    let coord = yaml_docs("k8s/coordinator.yaml");
    // The file names the server's Secret provides, from where nats.conf reads them.
    let nats_conf = nats
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["nats.conf"].as_str())
        .expect("nats.conf");
    let secret_keys: BTreeSet<&str> = nats_conf
        .split_whitespace()
        .filter_map(|w| w.strip_prefix("/etc/nats/tls/"))
        .collect();
    assert_eq!(
        secret_keys,
        BTreeSet::from(["ca.crt", "tls.crt", "tls.key"]),
        "{nats_conf}"
    );
    let dep = coord
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("deployment");
    let pod = &dep["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    // Where each Secret is mounted in the container.
    let mut secret_dirs = Vec::new();
    for mount in container["volumeMounts"].as_sequence().expect("mounts") {
        let volume = pod["volumes"]
            .as_sequence()
            .expect("volumes")
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap_or_else(|| panic!("no volume for {mount:?}"));
        if let Some(secret) = volume["secret"]["secretName"].as_str() {
            assert_ne!(
                secret, "chorus-nats-tls",
                "the server's key stays with the server"
            );
            assert_eq!(mount["readOnly"], true);
            secret_dirs.push(mount["mountPath"].as_str().expect("mountPath").to_owned());
        }
    }
    assert_eq!(
        secret_dirs.len(),
        1,
        "one TLS Secret mounted: {secret_dirs:?}"
    );
    // The config `chorus serve --config` reads names the files in that Secret.
    let args: Vec<&str> = container["args"]
        .as_sequence()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    let config_path = args
        .iter()
        .position(|a| *a == "--config")
        .map(|i| args[i + 1])
        .expect("--config");
    let toml = coord
        .iter()
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["chorus.toml"].as_str())
        .expect("chorus.toml");
    let config_dir = container["volumeMounts"]
        .as_sequence()
        .expect("mounts")
        .iter()
        .find(|m| m["name"] == "config")
        .and_then(|m| m["mountPath"].as_str())
        .expect("config mount");
    assert_eq!(config_path, format!("{config_dir}/chorus.toml"));
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("chorus.toml");
    std::fs::write(&path, toml).expect("write");
    let cfg =
        chorus_coordinator::CoordinatorConfig::load(Some(&path)).expect("valid coordinator config");
    assert_eq!(cfg.servers, "tls://chorus-nats:4222");
    assert!(
        nats.iter()
            .any(|d| d["kind"] == "Service" && d["metadata"]["name"] == "chorus-nats"),
        "the Service the coordinator connects to"
    );
    let security = &cfg.security;
    for (what, file, key) in [
        ("tls_ca", &security.tls_ca, "ca.crt"),
        ("tls_cert", &security.tls_cert, "tls.crt"),
        ("tls_key", &security.tls_key, "tls.key"),
    ] {
        let want = PathBuf::from(format!("{}/{key}", secret_dirs[0]));
        assert_eq!(file.as_ref(), Some(&want), "{what}");
    }
    // The pod runs as the image's numeric user, so `runAsNonRoot` can be checked.
    let dockerfile = std::fs::read_to_string(deploy("Dockerfile")).expect("Dockerfile");
    let user = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("USER "))
        .next_back()
        .expect("USER");
    let uid = user.split(':').next().expect("uid");
    assert_eq!(
        pod["securityContext"]["runAsUser"]
            .as_u64()
            .map(|u| u.to_string())
            .as_deref(),
        Some(uid)
    );
    assert_eq!(container["securityContext"]["runAsNonRoot"], true);
}

/// Package names and their binaries in the workspace: `name` of `[package]` and of `[[bin]]`.
fn workspace_binaries() -> Vec<(String, Vec<String>)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    // `members = [ ... ]`, on one line or several, comments aside.
    let members = manifest
        .split_once("members = [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(list, _)| list)
        .expect("members");
    members
        .lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .flat_map(|l| l.split(','))
        .map(|m| m.trim().trim_matches('"'))
        .filter(|m| !m.is_empty())
        .map(|member| {
            let text = std::fs::read_to_string(root.join(member).join("Cargo.toml"))
                .expect("member Cargo.toml");
            let mut section = "";
            let mut package = String::new();
            let mut bins = Vec::new();
            for line in text.lines().map(str::trim) {
                if line.starts_with('[') {
                    section = line;
                } else if let Some(name) = line.strip_prefix("name = ") {
                    let name = name.trim_matches('"').to_owned();
                    match section {
                        "[package]" => package = name,
                        "[[bin]]" => bins.push(name),
                        _ => {}
                    }
                }
            }
            (package, bins)
        })
        .collect()
}

#[test]
fn the_dockerfile_and_compose_name_paths_and_packages_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    // The Dockerfile as a Dockerfile parser reads it (dockerfile-parse): every instruction a
    // real one, two stages, and the lines checked below taken from the parsed instructions.
    const PARSE: &str = r#"
import json, sys
from dockerfile_parse import DockerfileParser
parsed = DockerfileParser(path=sys.argv[1]).structure
print(json.dumps([[i["instruction"], i["value"]] for i in parsed if i["instruction"] != "COMMENT"]))
"#;
    let parsed = run(Command::new(tools_python())
        .args(["-c", PARSE])
        .arg(deploy("Dockerfile")));
    let instructions: Vec<(String, String)> =
        serde_json::from_str(&parsed).unwrap_or_else(|e| panic!("parsed Dockerfile {parsed}: {e}"));
    const KNOWN: [&str; 18] = [
        "FROM",
        "RUN",
        "CMD",
        "LABEL",
        "EXPOSE",
        "ENV",
        "ADD",
        "COPY",
        "ENTRYPOINT",
        "VOLUME",
        "USER",
        "WORKDIR",
        "ARG",
        "ONBUILD",
        "STOPSIGNAL",
        "HEALTHCHECK",
        "SHELL",
        "MAINTAINER",
    ];
    for (instruction, _) in &instructions {
        assert!(
            KNOWN.contains(&instruction.as_str()),
            "not a Dockerfile instruction: {instruction}"
        );
    }
    assert_eq!(
        instructions.iter().filter(|(i, _)| i == "FROM").count(),
        2,
        "a build stage and a runtime stage"
    );
    let joined: Vec<String> = instructions
        .iter()
        .map(|(i, v)| format!("{i} {v}"))
        .collect();
    let lines: Vec<&str> = joined.iter().map(String::as_str).collect();
    // The build stage builds a workspace package that has the binary the final stage copies.
    let build = lines
        .iter()
        .find_map(|l| l.strip_prefix("RUN cargo build "))
        .expect("cargo build");
    let words: Vec<&str> = build.split_whitespace().collect();
    let package = words[words.iter().position(|w| *w == "-p").expect("-p") + 1];
    assert!(words.contains(&"--locked") && root.join("Cargo.lock").is_file());
    let packages = workspace_binaries();
    let (_, bins) = packages
        .iter()
        .find(|(p, _)| p == package)
        .unwrap_or_else(|| panic!("no workspace package {package}: {packages:?}"));
    let workdir = lines
        .iter()
        .find_map(|l| l.strip_prefix("WORKDIR "))
        .expect("WORKDIR");
    let copied = lines
        .iter()
        .find_map(|l| l.strip_prefix("COPY --from=build "))
        .expect("COPY --from=build");
    let (from, to) = copied.split_once(' ').expect("COPY src dst");
    let bin = from
        .strip_prefix(&format!("{workdir}/target/release/"))
        .expect("copies from the release build");
    assert!(
        bins.iter().any(|b| b == bin),
        "{package} has no binary {bin}"
    );
    assert!(
        lines.contains(&format!("ENTRYPOINT [\"{to}\"]").as_str()),
        "the entrypoint is the copied binary"
    );
    // Every source of the build context's COPY exists, and .dockerignore keeps what the build
    // needs (the manifests, the lock file, every member) in the context.
    for line in &lines {
        if let Some(args) = line.strip_prefix("COPY ").filter(|a| !a.starts_with("--")) {
            let parts: Vec<&str> = args.split_whitespace().collect();
            for src in &parts[..parts.len() - 1] {
                assert!(root.join(src).exists(), "COPY source {src} does not exist");
            }
        }
    }
    let ignored = std::fs::read_to_string(root.join(".dockerignore")).expect(".dockerignore");
    let ignored: Vec<&str> = ignored
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert!(
        ignored.contains(&"target/"),
        "build output stays out of the context"
    );
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let members = manifest
        .lines()
        .find_map(|l| l.trim().strip_prefix("members = "))
        .expect("members");
    for needed in members
        .trim_matches(|c| c == '[' || c == ']')
        .split(',')
        .map(|m| m.trim().trim_matches('"'))
        .chain(["Cargo.toml", "Cargo.lock"])
    {
        assert!(
            !ignored
                .iter()
                .any(|i| i.trim_end_matches('/') == needed || *i == "*"),
            ".dockerignore leaves out {needed}"
        );
    }
    // The image the compose file and the manifest run is the one the build comment tags.
    let dockerfile = std::fs::read_to_string(deploy("Dockerfile")).expect("Dockerfile");
    let tag = dockerfile
        .lines()
        .find_map(|l| l.split(" -t ").nth(1))
        .and_then(|t| t.split_whitespace().next())
        .expect("docker build -t in the comment");
    let compose = &yaml_docs("compose/docker-compose.yml")[0];
    for service in ["coordinator", "demo"] {
        assert_eq!(compose["services"][service]["image"], tag, "{service}");
    }
    let coord = yaml_docs("k8s/coordinator.yaml");
    let dep = coord
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .expect("deployment");
    assert_eq!(
        dep["spec"]["template"]["spec"]["containers"][0]["image"],
        tag
    );
    // Every file the compose file mounts exists, relative to the compose file.
    let mut mounted = 0;
    for (name, service) in compose["services"].as_mapping().expect("services") {
        for volume in service["volumes"].as_sequence().into_iter().flatten() {
            let source = volume
                .as_str()
                .expect("short volume syntax")
                .split(':')
                .next();
            let source = source.expect("source");
            if source.starts_with('.') {
                assert!(
                    deploy("compose").join(source).is_file(),
                    "{name:?} mounts {source}, which does not exist"
                );
                mounted += 1;
            } else {
                assert!(
                    compose["volumes"].get(source).is_some(),
                    "{name:?} uses an undeclared volume {source}"
                );
            }
        }
    }
    assert!(mounted >= 6, "{mounted}");
    // The Grafana provisioning points at the directory the dashboard is mounted into.
    let provisioning = &yaml_docs("grafana/provisioning-dashboards.yml")[0];
    let dashboards = provisioning["providers"][0]["options"]["path"]
        .as_str()
        .expect("path");
    let grafana_volumes = compose["services"]["grafana"]["volumes"]
        .as_sequence()
        .expect("volumes");
    assert!(
        grafana_volumes.iter().any(|v| v
            .as_str()
            .is_some_and(|v| v.contains(&format!(":{dashboards}/")))),
        "the dashboard is mounted under {dashboards}"
    );
}
