//! The tests of the manifest.

use chorus_sdk::subject::validate_token;

use super::*;

/// The example of docs/HOSTING.md: every field.
const FULL: &str = r#"
id = "calculator"
description = "Adds numbers"
capabilities = ["calculation"]
commands = ["add"]
replicas = 1
customer = "acme"

[build]
repository = "https://git.example.com/agents/calculator.git"
branch = "main"
command = "make agent"
timeout = "5m"

[run]
command = "calculator-agent"
args = ["--fast"]
env = { RUST_LOG = "info" }
working_dir = "agents/calc"

[resources]
memory_mb = 256
cpu = 0.5
gpus = 1

[placement]
co_locate_with = "orchestrator"
hosts = ["host-a"]
preferred_region = "eu-west"

[restart]
policy = "on-failure"
max_restarts = 5
window = "10m"
initial_backoff = "500ms"
max_backoff = "30s"

[health]
check = "heartbeat"
interval = "10s"
timeout = "2s"
failures = 3
start_grace = "20s"

[credentials]
nkey_file = "secrets/calculator.nk"
"#;

const MINIMAL: &str = "id = \"calc\"\n[run]\ncommand = \"calc-agent\"\n";

/// The minimal manifest with `extra` appended (a field of `[run]`, or further tables).
fn minimal_with(extra: &str) -> String {
    format!("{MINIMAL}{extra}\n")
}

/// `toml` is refused by validation, naming `field`; returns the error's text.
fn refused(toml: &str, field: &str) -> String {
    let err = Manifest::from_toml(toml).expect_err("refused");
    assert!(
        matches!(err, ManifestError::Invalid { .. }),
        "not an Invalid error: {err}"
    );
    assert_eq!(err.field(), Some(field), "{err}");
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("manifest field {field}: ")),
        "{text}"
    );
    text
}

/// `toml` does not parse; the message mentions `mention`. Returns the error's text.
fn unparsed(toml: &str, mention: &str) -> String {
    let err = Manifest::from_toml(toml).expect_err("refused");
    assert!(
        matches!(err, ManifestError::Parse { .. }),
        "not a Parse error: {err}"
    );
    let text = err.to_string();
    assert!(text.contains(mention), "{mention:?} not in {text}");
    text
}

#[test]
fn the_full_example_parses_and_round_trips_through_json() {
    let manifest = Manifest::from_toml(FULL).expect("the full example parses");
    let expected = Manifest {
        id: "calculator".into(),
        description: Some("Adds numbers".into()),
        capabilities: vec!["calculation".into()],
        commands: vec!["add".into()],
        replicas: 1,
        customer: Some("acme".into()),
        build: Some(Build {
            repository: "https://git.example.com/agents/calculator.git".into(),
            branch: Some("main".into()),
            command: Some("make agent".into()),
            timeout: Duration::from_secs(300),
        }),
        run: Run {
            command: "calculator-agent".into(),
            args: vec!["--fast".into()],
            env: BTreeMap::from([("RUST_LOG".into(), "info".into())]),
            working_dir: Some(PathBuf::from("agents/calc")),
            shared: false,
        },
        resources: Resources {
            memory_mb: Some(256),
            cpu: Some(0.5),
            gpus: Some(1),
        },
        placement: Placement {
            co_locate_with: Some("orchestrator".into()),
            hosts: vec!["host-a".into()],
            preferred_region: Some("eu-west".into()),
        },
        restart: Restart {
            policy: RestartPolicy::OnFailure,
            max_restarts: 5,
            window: Duration::from_secs(600),
            initial_backoff: Duration::from_millis(500),
            max_backoff: Duration::from_secs(30),
        },
        health: Health {
            check: HealthCheck::Heartbeat,
            command: Vec::new(),
            interval: Duration::from_secs(10),
            timeout: Duration::from_secs(2),
            failures: 3,
            start_grace: Duration::from_secs(20),
        },
        credentials: Credentials {
            nkey_file: Some(PathBuf::from("secrets/calculator.nk")),
        },
    };
    assert_eq!(manifest, expected);

    let json = manifest.to_json();
    let value: serde_json::Value = serde_json::from_slice(&json).expect("JSON");
    assert_eq!(
        value["restart"]["window"], "10m",
        "durations travel as text"
    );
    assert_eq!(value["restart"]["initial_backoff"], "500ms");
    assert_eq!(value["restart"]["policy"], "on-failure");
    assert_eq!(Manifest::from_json(&json).expect("reads back"), manifest);
}

#[test]
fn a_command_health_check_and_odd_durations_round_trip() {
    let manifest = Manifest::from_toml(&minimal_with(
        "[restart]\npolicy = \"always\"\ninitial_backoff = \"1.5s\"\nmax_backoff = \"90s\"\n\
             [health]\ncheck = \"command\"\ncommand = [\"true\"]\ninterval = \"1h\"\n\
             timeout = \"0.25ms\"",
    ))
    .expect("parses");
    assert_eq!(manifest.restart.policy, RestartPolicy::Always);
    assert_eq!(
        manifest.restart.initial_backoff,
        Duration::from_millis(1500)
    );
    assert_eq!(manifest.health.timeout, Duration::from_micros(250));
    assert_eq!(
        Manifest::from_json(&manifest.to_json()).expect("reads back"),
        manifest
    );
}

#[test]
fn a_minimal_manifest_takes_every_default() {
    let manifest = Manifest::from_toml(MINIMAL).expect("parses");
    assert_eq!(manifest, Manifest::new("calc", "calc-agent"));
    assert_eq!(manifest.replicas, DEFAULT_REPLICAS);
    assert_eq!(manifest.description, None);
    assert!(manifest.capabilities.is_empty() && manifest.commands.is_empty());
    assert_eq!(manifest.customer, None);
    assert!(manifest.run.args.is_empty() && manifest.run.env.is_empty());
    assert_eq!(manifest.run.working_dir, None);
    assert_eq!(manifest.resources, Resources::default());
    assert_eq!(manifest.resources.memory_mb, None);
    assert_eq!(manifest.resources.cpu, None);
    assert_eq!(manifest.placement.co_locate_with, None);
    assert!(manifest.placement.hosts.is_empty());
    let restart = &manifest.restart;
    assert_eq!(restart.policy, RestartPolicy::OnFailure);
    assert_eq!(restart.max_restarts, 5);
    assert_eq!(restart.window, Duration::from_secs(600));
    assert_eq!(restart.initial_backoff, Duration::from_millis(500));
    assert_eq!(restart.max_backoff, Duration::from_secs(30));
    let health = &manifest.health;
    assert_eq!(health.check, HealthCheck::Heartbeat);
    assert!(health.command.is_empty());
    assert_eq!(health.interval, Duration::from_secs(10));
    assert_eq!(health.timeout, Duration::from_secs(2));
    assert_eq!(health.failures, 3);
    assert_eq!(health.start_grace, Duration::from_secs(20));
    assert_eq!(manifest.credentials.nkey_file, None);
    // A table given in part keeps the defaults of the fields it leaves out.
    let partial =
        Manifest::from_toml(&minimal_with("[restart]\nmax_restarts = 2")).expect("parses");
    assert_eq!(partial.restart.max_restarts, 2);
    assert_eq!(partial.restart.window, DEFAULT_RESTART_WINDOW);
    assert_eq!(
        Manifest::from_json(&manifest.to_json()).expect("reads back"),
        manifest
    );
}

#[test]
fn a_missing_run_or_run_command_is_refused_by_name() {
    unparsed("id = \"calc\"\n", "`run`");
    let text = unparsed("id = \"calc\"\n[run]\nargs = [\"-v\"]\n", "`command`");
    assert!(text.contains("line 2"), "{text}");
    refused("id = \"calc\"\n[run]\ncommand = \"\"\n", "run.command");
    unparsed("[run]\ncommand = \"x\"\n", "`id`");
}

#[test]
fn unknown_fields_are_refused_by_name_and_line() {
    let text = unparsed(&format!("colour = \"blue\"\n{MINIMAL}"), "colour");
    assert!(text.contains("line 1"), "{text}");
    let text = unparsed(
        &minimal_with("[restart]\nmax_backof = \"1m\""),
        "max_backof",
    );
    assert!(text.contains("line 5"), "{text}");
    unparsed(&minimal_with("cwd = \"x\""), "cwd");
    unparsed(&minimal_with("[health]\ncheck = \"ping\""), "ping");
    unparsed(&minimal_with("[gpu]\ncount = 1"), "gpu");
    // The bus form refuses them too, and says where.
    let mut json: serde_json::Value =
        serde_json::from_slice(&Manifest::new("calc", "x").to_json()).expect("JSON");
    json["restart"]["colour"] = "blue".into();
    let err = Manifest::from_json(&serde_json::to_vec(&json).expect("JSON")).expect_err("refused");
    assert!(err.to_string().contains("colour"), "{err}");
    assert_eq!(err.field(), Some("restart.colour"), "{err}");
}

#[test]
fn a_bad_duration_is_refused_naming_the_field() {
    let text = unparsed(
        &minimal_with("[restart]\nwindow = \"10 minutes\""),
        "not a duration",
    );
    assert!(text.contains("restart.window"), "{text}");
    assert!(text.contains("line 5"), "{text}");
    refused(
        &minimal_with("[restart]\nwindow = \"0s\""),
        "restart.window",
    );
    refused(
        &minimal_with("[health]\nstart_grace = \"25h\""),
        "health.start_grace",
    );
}

#[test]
fn memory_outside_its_range_is_impossible() {
    for memory in ["0", "15", "1000000000"] {
        let text = refused(
            &minimal_with(&format!("[resources]\nmemory_mb = {memory}")),
            "resources.memory_mb",
        );
        assert!(
            text.contains("impossible") && text.contains("16..=1048576"),
            "{text}"
        );
    }
    for memory in ["16", "1048576"] {
        Manifest::from_toml(&minimal_with(&format!("[resources]\nmemory_mb = {memory}")))
            .expect("within range");
    }
}

#[test]
fn cpu_must_be_a_positive_finite_number_of_cores() {
    for cpu in ["0", "0.0", "-1", "nan", "inf", "2000"] {
        refused(
            &minimal_with(&format!("[resources]\ncpu = {cpu}")),
            "resources.cpu",
        );
    }
    let manifest =
        Manifest::from_toml(&minimal_with("[resources]\ncpu = 1024")).expect("at most 1024");
    assert_eq!(manifest.resources.cpu, Some(MAX_CPU));
}

#[test]
fn max_backoff_shorter_than_initial_backoff_names_both() {
    let text = refused(
        &minimal_with("[restart]\ninitial_backoff = \"2s\"\nmax_backoff = \"1s\""),
        "restart.max_backoff",
    );
    assert_eq!(
        text,
        "manifest field restart.max_backoff: 1s is shorter than restart.initial_backoff (2s)"
    );
    refused(
        &minimal_with("[restart]\nmax_restarts = 1001"),
        "restart.max_restarts",
    );
}

#[test]
fn a_health_command_goes_with_check_command_only() {
    let text = refused(
        &minimal_with("[health]\ncheck = \"heartbeat\"\ncommand = [\"true\"]"),
        "health.command",
    );
    assert!(text.contains("\"heartbeat\""), "{text}");
    refused(
        &minimal_with("[health]\ncommand = [\"true\"]"),
        "health.command",
    );
    let text = refused(
        &minimal_with("[health]\ncheck = \"command\""),
        "health.command",
    );
    assert!(text.contains("required"), "{text}");
    refused(
        &minimal_with("[health]\ncheck = \"command\"\ncommand = []"),
        "health.command",
    );
    refused(
        &minimal_with("[health]\ncheck = \"command\"\ncommand = [\"\"]"),
        "health.command[0]",
    );
    let manifest = Manifest::from_toml(&minimal_with(
            "[health]\ncheck = \"command\"\ncommand = [\"curl\", \"-fs\", \"http://127.0.0.1:8000/health\"]",
        ))
        .expect("a command check with its command");
    assert_eq!(manifest.health.check, HealthCheck::Command);
    Manifest::from_toml(&minimal_with("[health]\ncheck = \"none\"")).expect("no check");
}

#[test]
fn a_health_timeout_must_be_shorter_than_the_interval() {
    for (timeout, interval) in [("10s", "10s"), ("11s", "10s")] {
        let text = refused(
            &minimal_with(&format!(
                "[health]\ntimeout = \"{timeout}\"\ninterval = \"{interval}\""
            )),
            "health.timeout",
        );
        assert!(text.contains("health.interval (10s)"), "{text}");
    }
    for failures in ["0", "101"] {
        refused(
            &minimal_with(&format!("[health]\nfailures = {failures}")),
            "health.failures",
        );
    }
}

#[test]
fn the_environment_is_checked_and_chorus_variables_are_the_hosts() {
    let text = refused(
        &minimal_with("env = { CHORUS_URL = \"nats://elsewhere\" }"),
        "run.env.CHORUS_URL",
    );
    assert!(text.contains("set by the host"), "{text}");
    refused(
        &minimal_with("env = { chorus_x = \"1\" }"),
        "run.env.chorus_x",
    );
    refused(&minimal_with("env = { 1X = \"1\" }"), "run.env.1X");
    refused(&minimal_with("env = { \"A-B\" = \"1\" }"), "run.env.A-B");
    refused(&minimal_with("env = { A = \"x\\u0000y\" }"), "run.env.A");
    refused(
        &minimal_with("args = [\"ok\", \"x\\u0000\"]"),
        "run.args[1]",
    );
    Manifest::from_toml(&minimal_with("env = { _A1 = \"1\", CHORUSX = \"ok\" }"))
        .expect("well-formed names");
    let many: Vec<String> = (0..=MAX_ARGS).map(|i| format!("\"{i}\"")).collect();
    refused(
        &minimal_with(&format!("args = [{}]", many.join(", "))),
        "run.args",
    );
}

#[test]
fn a_build_is_checked_field_by_field() {
    let with = |build: &str| minimal_with(&format!("[build]\n{build}"));
    let m = Manifest::from_toml(&with("repository = \"/srv/agents/calc.git\"")).expect("valid");
    let build = m.build.expect("a build");
    assert_eq!((build.branch, build.command), (None, None));
    assert_eq!(build.timeout, DEFAULT_BUILD_TIMEOUT);
    refused(&with("repository = \"\""), "build.repository");
    refused(
        &with("repository = \"--upload-pack=x\""),
        "build.repository",
    );
    refused(&with("repository = \"r\"\nbranch = \"-x\""), "build.branch");
    refused(
        &with("repository = \"r\"\nbranch = \"a b\""),
        "build.branch",
    );
    refused(
        &with("repository = \"r\"\ncommand = \" \""),
        "build.command",
    );
    refused(
        &with("repository = \"r\"\ntimeout = \"0s\""),
        "build.timeout",
    );
    let unknown = Manifest::from_toml(&with("url = \"r\"")).expect_err("refused");
    assert!(unknown.to_string().contains("build.url"), "{unknown}");
}

#[test]
fn gpus_and_a_region_are_checked() {
    let m = Manifest::from_toml(&minimal_with(
        "[resources]\ngpus = 2\n[placement]\npreferred_region = \"eu-west\"",
    ))
    .expect("valid");
    assert_eq!(m.resources.gpus, Some(2));
    assert_eq!(m.placement.preferred_region.as_deref(), Some("eu-west"));
    refused(&minimal_with("[resources]\ngpus = 0"), "resources.gpus");
    refused(&minimal_with("[resources]\ngpus = 65"), "resources.gpus");
    refused(
        &minimal_with("[placement]\npreferred_region = \"eu west\""),
        "placement.preferred_region",
    );
}

#[test]
fn a_bad_id_is_refused() {
    for id in ["a.b", "", "calc-2", "calc-02", "a b", "calc-0"] {
        refused(&MINIMAL.replace("\"calc\"", &format!("{id:?}")), "id");
    }
    let longest = "a".repeat(MAX_ID_LEN);
    Manifest::from_toml(&MINIMAL.replace("calc\"", &format!("{longest}\"")))
        .expect("the longest id");
    refused(&MINIMAL.replace("calc\"", &format!("{longest}a\"")), "id");
    Manifest::from_toml(&MINIMAL.replace("\"calc\"", "\"calc-v2\"")).expect("no digits-only tail");
    // Other names are tokens (capabilities dotted ones) too.
    refused(
        &format!("capabilities = [\"text.ocr\", \"a b\"]\n{MINIMAL}"),
        "capabilities[1]",
    );
    refused(
        &format!("capabilities = [\"x\", \"x\"]\n{MINIMAL}"),
        "capabilities[1]",
    );
    refused(
        &format!("commands = [\"add.one\"]\n{MINIMAL}"),
        "commands[0]",
    );
    refused(&format!("customer = \"acme corp\"\n{MINIMAL}"), "customer");
    refused(
        &minimal_with("[placement]\nco_locate_with = \"a.b\""),
        "placement.co_locate_with",
    );
    refused(
        &minimal_with("[placement]\nhosts = [\"h1\", \"\"]"),
        "placement.hosts[1]",
    );
    let long = "x".repeat(MAX_DESCRIPTION_CHARS + 1);
    refused(
        &format!("description = \"{long}\"\n{MINIMAL}"),
        "description",
    );
}

#[test]
fn replicas_are_bounded_and_zero_is_allowed() {
    let text = refused(&format!("replicas = 1001\n{MINIMAL}"), "replicas");
    assert!(text.contains("1000"), "{text}");
    let kept = Manifest::from_toml(&format!("replicas = 0\n{MINIMAL}")).expect("0 replicas");
    assert_eq!(kept.replicas, 0);
    Manifest::from_toml(&format!("replicas = {MAX_REPLICAS}\n{MINIMAL}")).expect("the max");
    unparsed(&format!("replicas = -1\n{MINIMAL}"), "replicas");
}

#[test]
fn oversize_input_is_refused_naming_the_limit() {
    let padding = format!("# {}\n", "x".repeat(MAX_MANIFEST_BYTES));
    let toml = format!("{MINIMAL}{padding}");
    let err = Manifest::from_toml(&toml).expect_err("too large");
    assert!(
        matches!(
            err,
            ManifestError::TooLarge {
                limit: MAX_MANIFEST_BYTES,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("65536"), "{err}");
    let json = vec![b' '; MAX_MANIFEST_BYTES + 1];
    let err = Manifest::from_json(&json).expect_err("too large");
    assert!(matches!(err, ManifestError::TooLarge { bytes, .. } if bytes == json.len() as u64));
}

#[test]
fn json_is_validated_like_toml() {
    let mut manifest = Manifest::new("calc", "calc-agent");
    manifest.restart.initial_backoff = Duration::from_secs(2);
    manifest.restart.max_backoff = Duration::from_secs(1);
    let err = Manifest::from_json(&manifest.to_json()).expect_err("refused");
    assert_eq!(err.field(), Some("restart.max_backoff"));
    let err = Manifest::from_json(b"{\"id\": \"calc\"}").expect_err("no run");
    assert!(err.to_string().contains("`run`"), "{err}");
    let mut json = Manifest::new("calc", "x").to_json();
    json.extend_from_slice(b" {}");
    assert!(matches!(
        Manifest::from_json(&json),
        Err(ManifestError::Parse { .. })
    ));
}

#[test]
fn replica_ids_and_their_deployment() {
    let manifest = Manifest::new("calc", "calc-agent");
    assert_eq!(manifest.replica_id(1), "calc");
    assert_eq!(manifest.replica_id(0), "calc");
    assert_eq!(manifest.replica_id(2), "calc-2");
    assert_eq!(manifest.replica_id(1000), "calc-1000");
    assert_eq!(deployment_of("calc-3"), ("calc", 3));
    assert_eq!(deployment_of("calc"), ("calc", 1));
    for n in [1, 2, 9, 10, 999, MAX_REPLICAS] {
        assert_eq!(deployment_of(&manifest.replica_id(n)), ("calc", n));
    }
    // Ids no replica of a valid deployment has are their own first replica.
    for id in [
        "calc-1",
        "calc-0",
        "calc-07",
        "-3",
        "calc-",
        "my-agent",
        "calc-99999999999",
    ] {
        assert_eq!(deployment_of(id), (id, 1), "{id}");
    }
    let longest = Manifest::new("a".repeat(MAX_ID_LEN), "x");
    validate_token("agent id", &longest.replica_id(MAX_REPLICAS))
        .expect("the last replica of the longest id is an agent id");
}

#[test]
fn load_resolves_relative_paths_against_the_manifests_folder() {
    let dir = tempfile::tempdir().expect("temp dir");
    let folder = dir.path().join("deploy");
    std::fs::create_dir(&folder).expect("folder");
    let path = folder.join("calc.toml");
    // Without its build: a built agent's folder is inside its clone (tested apart).
    let start = FULL.find("[build]").expect("a build");
    let end = FULL.find("[run]").expect("a run");
    let unbuilt = format!("{}{}", &FULL[..start], &FULL[end..]);
    std::fs::write(&path, unbuilt).expect("write");
    let manifest = Manifest::load(&path).expect("loads");
    let folder = std::path::absolute(&folder).expect("absolute");
    assert_eq!(manifest.run.working_dir, Some(folder.join("agents/calc")));
    assert_eq!(
        manifest.credentials.nkey_file,
        Some(folder.join("secrets/calculator.nk"))
    );
    assert!(
        manifest
            .run
            .working_dir
            .as_deref()
            .is_some_and(Path::is_absolute)
    );

    // Absolute paths are kept.
    let absolute = dir.path().join("elsewhere");
    let text = FULL.replace(
        "\"agents/calc\"",
        &format!("{:?}", absolute.to_str().expect("UTF-8 temp dir")),
    );
    std::fs::write(&path, text).expect("write");
    let manifest = Manifest::load(&path).expect("loads");
    assert_eq!(manifest.run.working_dir, Some(absolute));

    // from_json leaves paths as they are.
    let json = Manifest::from_toml(FULL).expect("parses").to_json();
    let manifest = Manifest::from_json(&json).expect("reads");
    assert_eq!(manifest.run.working_dir, Some(PathBuf::from("agents/calc")));
}

#[test]
fn load_names_a_missing_file_and_refuses_a_large_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("nowhere.toml");
    let err = Manifest::load(&path).expect_err("missing");
    assert!(matches!(err, ManifestError::Read { .. }), "{err}");
    assert!(err.to_string().contains("nowhere.toml"), "{err}");

    let big = dir.path().join("big.toml");
    std::fs::write(&big, vec![b'#'; MAX_MANIFEST_BYTES * 2]).expect("write");
    let err = Manifest::load(&big).expect_err("too large");
    assert!(
        matches!(err, ManifestError::TooLarge { bytes, .. } if bytes == (MAX_MANIFEST_BYTES * 2) as u64),
        "{err}"
    );

    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, b"id = \"\xff\"").expect("write");
    assert!(matches!(
        Manifest::load(&bad),
        Err(ManifestError::Parse { .. })
    ));
}
