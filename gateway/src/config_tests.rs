//! The tests of `config.rs`.

use super::*;

fn parse(toml: &str) -> GatewayConfig {
    #[derive(Deserialize)]
    struct File {
        gateway: GatewayConfig,
    }
    let file: File = config::Config::builder()
        .add_source(config::File::from_str(toml, config::FileFormat::Toml))
        .build()
        .and_then(config::Config::try_deserialize)
        .expect("parses");
    file.gateway
}

const SAP_ONLY: &str = r#"
        [gateway]
        [[gateway.identities]]
        id = "sap-user"
        [[gateway.sap]]
        agent = "drafter"
        owner = "chorus"
        identity = "sap-user"
        to = "writer"
        command = "draft"
    "#;

/// Plain HTTP only on loopback, unless asked for in so many words; TLS anywhere.
#[test]
fn off_loopback_the_gateway_speaks_tls_unless_plain_http_is_allowed() {
    let with = |listen: &str, extra: &str| {
        parse(&format!(
            "[gateway]\nlisten = \"{listen}\"\n{extra}\n[[gateway.identities]]\nid = \"edge\"\n[[gateway.api_keys]]\nidentity = \"edge\"\nsha256 = \"{}\"\n",
            "0".repeat(64)
        ))
    };
    with("127.0.0.1:8480", "").validate().expect("loopback");
    with("[::1]:8480", "").validate().expect("loopback");
    let err = with("0.0.0.0:8480", "")
        .validate()
        .expect_err("plain off loopback");
    let text = err.to_string();
    assert!(
        text.contains("0.0.0.0:8480")
            && text.contains("[gateway.tls]")
            && text.contains("allow_plain_http"),
        "{text}"
    );
    with("0.0.0.0:8480", "allow_plain_http = true")
        .validate()
        .expect("allowed");
    let tls = with(
        "0.0.0.0:8480",
        "[gateway.tls]\ncert_file = \"gw.pem\"\nkey_file = \"gw-key.pem\"",
    );
    tls.validate().expect("TLS");
    let tls = tls.tls.expect("tls table");
    assert_eq!(tls.client_ca_file, None);
}

#[test]
fn the_console_listens_on_loopback_without_tls_and_needs_credentials() {
    let base = "[[gateway.identities]]\nid = \"ops\"\n[[gateway.api_keys]]\nidentity = \"ops\"\nsha256 = \"".to_owned()
            + &"ab".repeat(32)
            + "\"\n";
    let with = |console: &str| parse(&format!("[gateway]\n{base}[gateway.console]\n{console}"));
    let alone = with("listen = \"127.0.0.1:8490\"");
    assert!(alone.enabled(), "the console may run without the HTTP API");
    alone.validate().expect("a loopback console");
    assert_eq!(
        alone.console.session_idle_secs,
        DEFAULT_CONSOLE_SESSION_IDLE_SECS
    );
    let text = with("listen = \"0.0.0.0:8490\"")
        .validate()
        .expect_err("plain HTTP off loopback")
        .to_string();
    assert!(text.contains("[gateway.console] listen"), "{text}");
    let text = with("listen = \"127.0.0.1:8490\"\nsession_idle_secs = 0")
        .validate()
        .expect_err("no idle time")
        .to_string();
    assert!(text.contains("session_idle_secs"), "{text}");
    let mut same = with("listen = \"127.0.0.1:8490\"");
    same.listen = same.console.listen;
    let text = same.validate().expect_err("one address").to_string();
    assert!(text.contains("address of its own"), "{text}");
}

#[test]
fn sap_agents_alone_run_a_gateway_without_http_or_keys() {
    let gateway = parse(SAP_ONLY);
    assert!(gateway.enabled() && gateway.listen.is_none());
    gateway
        .validate()
        .expect("valid without listen and api keys");
    let sap = &gateway.sap[0];
    assert_eq!(sap.session, DEFAULT_SAP_SESSION);
    assert_eq!(sap.heartbeat_interval_s, DEFAULT_SAP_HEARTBEAT_SECS);
    assert_eq!(sap.max_prompt_ms, DEFAULT_SAP_MAX_PROMPT_MS);
    assert!(!GatewayConfig::default().enabled());
}

#[test]
fn a_tenant_has_a_name_and_a_root_and_its_identities_name_it() {
    let with = |extra: &str| parse(&format!("{SAP_ONLY}\n{extra}"));
    let mut gateway = with("[[gateway.tenants]]\nname = \"acme\"\nroot = \"acme\"");
    gateway.identities[0].tenant = Some("acme".into());
    gateway.validate().expect("valid");
    gateway.identities[0].tenant = Some("globex".into());
    let err = gateway
        .validate()
        .expect_err("an unknown tenant")
        .to_string();
    assert!(err.contains("globex"), "{err}");
    for (bad, named) in [
        (
            "[[gateway.tenants]]\nname = \"a b\"\nroot = \"acme\"",
            "a b",
        ),
        (
            "[[gateway.tenants]]\nname = \"acme\"\nroot = \"no root\"",
            "root",
        ),
        (
            "[[gateway.tenants]]\nname = \"acme\"\nroot = \"a\"\n[[gateway.tenants]]\nname = \"acme\"\nroot = \"b\"",
            "twice",
        ),
    ] {
        let err = with(bad).validate().expect_err(bad).to_string();
        assert!(err.contains(named), "{bad}: {err}");
    }
}

#[test]
fn push_notifications_need_an_allow_list_of_webhook_prefixes() {
    let with = |push: &str| parse(&format!("{SAP_ONLY}\n[gateway.push]\n{push}"));
    let gateway = with(
        "allow = [\"https://hooks.example.com/a2a/\"]\nmax_attempts = 3\nfirst_backoff_ms = 100",
    );
    gateway.validate().expect("valid");
    let push = gateway.push.expect("push");
    assert_eq!((push.max_attempts, push.first_backoff_ms), (3, 100));
    assert_eq!(push.max_backoff_ms, PushConfig::default().max_backoff_ms);
    for (bad, named) in [
        ("allow = []", "allow"),
        ("allow = [\"ftp://x/\"]", "allow"),
        (
            "allow = [\"https://h/a\"]\nmax_attempts = 0",
            "max_attempts",
        ),
        (
            "allow = [\"https://h/a\"]\nfirst_backoff_ms = 9\nmax_backoff_ms = 1",
            "first_backoff_ms",
        ),
    ] {
        let err = with(bad).validate().expect_err(bad).to_string();
        assert!(err.contains(named), "{bad}: {err}");
    }
}

#[test]
fn the_default_a2a_agent_is_an_endpoint_under_a2a() {
    assert_eq!(
        a2a_path("agents/tck/chat"),
        Ok(Target::Command {
            agent: "tck".into(),
            command: "chat".into()
        })
    );
    assert_eq!(
        a2a_path("/capabilities/text.summarize/"),
        Ok(Target::Capability("text.summarize".into()))
    );
    for bad in [
        "agents/tck",
        "tck/chat",
        "agents/t*k/chat",
        "capabilities/a b",
        "",
    ] {
        assert!(a2a_path(bad).is_err(), "{bad}");
    }
    let mut gateway = parse(SAP_ONLY);
    gateway.a2a_default = Some("agent/tck".into());
    let err = gateway.validate().expect_err("refused").to_string();
    assert!(err.contains("a2a_default"), "{err}");
}

#[test]
fn a_bad_sap_binding_is_refused_naming_what_is_wrong() {
    for (change, expect) in [
        (
            ("agent = \"drafter\"", "agent = \"Drafter\""),
            "lowercase letters, digits and hyphens",
        ),
        (
            ("owner = \"chorus\"", "owner = \"the team\""),
            "owner and session",
        ),
        (
            (
                "identity = \"sap-user\"\n        to",
                "identity = \"other\"\n        to",
            ),
            "identity other is not in identities",
        ),
        (
            ("command = \"draft\"", "capability = \"drafting\""),
            "give to with command, or capability",
        ),
        (("to = \"writer\"", "to = \"a.b\""), "to"),
        (
            (
                "command = \"draft\"",
                "command = \"draft\"\n        heartbeat_interval_s = 0",
            ),
            "must be positive",
        ),
    ] {
        let toml = SAP_ONLY.replacen(change.0, change.1, 1);
        assert_ne!(toml, SAP_ONLY, "{change:?} changed nothing");
        let err = parse(&toml).validate().expect_err(&toml).to_string();
        assert!(err.contains(expect), "{err} does not say {expect}");
    }
    let twice = format!(
        "{SAP_ONLY}\n[[gateway.sap]]\nagent = \"drafter\"\nowner = \"chorus\"\nidentity = \"sap-user\"\ncapability = \"drafting\"\n"
    );
    let err = parse(&twice).validate().expect_err("twice").to_string();
    assert!(err.contains("drafter.chorus.default twice"), "{err}");
}

#[test]
fn http_still_needs_a_way_to_authenticate() {
    let toml = SAP_ONLY.replacen("[gateway]", "[gateway]\nlisten = \"127.0.0.1:0\"", 1);
    let err = parse(&toml).validate().expect_err("no keys").to_string();
    assert!(err.contains("no way to authenticate"), "{err}");
}
