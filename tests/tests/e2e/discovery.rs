//! Capability queries as IACP writes them (PROTOCOL.md section 7.7): several capabilities at
//! once, `max_tokens`, a priority that orders the answer by ETA; the ETA an agent announces
//! from its recent handling times and what waits for its slots; a task's acceptance carrying
//! its ETA; and `offer` as the answer to a `discover`.

use std::sync::Arc;
use std::time::Duration;

use chorus_broker_adapter::BrokerOptions;
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::envelope::CONTENT_TYPE_MSGPACK;
use chorus_sdk::registry::estimate_eta_ms;
use chorus_sdk::{
    AgentRecord, Call, Context, DiscoverQuery, Envelope, HandlerError, Kind, Performative,
    Priority, Subjects, TaskContext, TaskState,
};
use chorus_tests::{WAIT, agent, agent_options, coordinator, eventually, server, within};
use futures::StreamExt;

/// Short, for answers that follow the agents quickly; not so short that a busy machine delays
/// a heartbeat past the three intervals that declare an agent gone.
const HEARTBEAT: Duration = Duration::from_millis(500);

/// An agent whose command `warm` and capabilities each take `ms` to handle.
async fn timed(
    server: &chorus_tests::NatsServer,
    id: &str,
    ms: u64,
    capabilities: &[&str],
    max_tokens: &[(&str, u64)],
) -> chorus_sdk::Agent {
    let mut options = agent_options(server, id).heartbeat_interval(HEARTBEAT);
    for (capability, tokens) in max_tokens {
        options = options.capability_max_tokens(*capability, *tokens);
    }
    let a = within(WAIT, "agent connect", options.connect())
        .await
        .expect("connect");
    let work = move |_ctx: Context, (): ()| async move {
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok::<_, HandlerError>(())
    };
    a.on_command("warm", work).await.expect("serve warm");
    for c in capabilities {
        a.on_capability(c, work).await.expect("serve a capability");
    }
    a
}

async fn discover(client: &chorus_sdk::Agent, query: serde_json::Value) -> Vec<AgentRecord> {
    let query: DiscoverQuery = serde_json::from_value(query).expect("a query");
    client.discover(&query).await.expect("discovery answers")
}

fn ids(records: &[AgentRecord]) -> Vec<&str> {
    records.iter().map(|r| r.manifest.agent.as_str()).collect()
}

/// The ids, sorted: for answers whose order follows load, which a heartbeat sent while a
/// handler ran leaves above zero until the next.
fn sorted(records: &[AgentRecord]) -> Vec<&str> {
    let mut ids = ids(records);
    ids.sort_unstable();
    ids
}

#[tokio::test]
async fn a_query_names_several_capabilities_and_tokens_and_a_priority_orders_it_by_eta() {
    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let client = agent(&server, "asker").await;
    let both = ["code_review", "testing"];
    let slow = timed(&server, "a-slow", 120, &both, &[("code_review", 8192)]).await;
    let fast = timed(&server, "b-fast", 20, &both, &[]).await;
    let _small = timed(
        &server,
        "c-small",
        5,
        &["code_review"],
        &[("code_review", 1024)],
    )
    .await;
    // Handled by `b-fast` alone: its own handling time, apart from the agent's.
    fast.on_capability("translate", |_ctx: Context, (): ()| async {
        tokio::time::sleep(Duration::from_millis(60)).await;
        Ok::<_, HandlerError>(())
    })
    .await
    .expect("serve translate");
    for _ in 0..3 {
        for id in ["a-slow", "b-fast"] {
            client
                .call(Call::agent(id, "warm").payload(&()).expect("payload"))
                .await
                .expect("warm");
        }
        client
            .call(Call::capability("translate").payload(&()).expect("payload"))
            .await
            .expect("translate");
    }

    // IACP's query: both capabilities, 4096 tokens, priority high. `c-small` lacks testing.
    let found = eventually(WAIT, "the timed agents announce their ETAs", || async {
        let found = discover(
            &client,
            serde_json::json!({"capabilities": both, "max_tokens": 4096, "priority": "high"}),
        )
        .await;
        (found.len() == 2 && found.iter().all(|r| r.eta_ms.is_some())).then_some(found)
    })
    .await;
    assert_eq!(ids(&found), ["b-fast", "a-slow"], "soonest first");
    let (fast_eta, slow_eta) = (
        found[0].eta_ms.expect("an eta"),
        found[1].eta_ms.expect("an eta"),
    );
    println!("ETAs: b-fast {fast_eta} ms, a-slow {slow_eta} ms");
    // Idle, so the ETA is the handling time: at least the handler's sleep, and the fast one
    // well under the slow one whatever the machine adds.
    assert!(
        fast_eta >= 20 && fast_eta < slow_eta,
        "b-fast: {fast_eta} ms"
    );
    assert!(slow_eta >= 120, "a-slow: {slow_eta} ms");
    let manifest = &found[0].manifest;
    assert_eq!(
        manifest.eta_ms, manifest.handling_ms,
        "idle: ETA = handling"
    );
    let translate = manifest
        .capabilities
        .iter()
        .find(|c| c.name == "translate")
        .expect("translate listed");
    let translate_ms = translate.handling_ms.expect("translate timed");
    assert!(translate_ms >= 60, "translate: {translate_ms} ms");
    // A query for that capability takes its own time, not the agent's.
    let for_translate = discover(
        &client,
        serde_json::json!({"capabilities": ["translate"], "priority": "normal"}),
    )
    .await;
    assert_eq!(ids(&for_translate), ["b-fast"]);
    assert_eq!(for_translate[0].eta_ms, Some(translate_ms));

    // Tokens: `c-small` takes 1024 at most; `a-slow` states 8192, `b-fast` no limit.
    let review = |tokens: u64| {
        discover(
            &client,
            serde_json::json!({"capability": "code_review", "max_tokens": tokens}),
        )
    };
    assert_eq!(sorted(&review(1000).await), ["a-slow", "b-fast", "c-small"]);
    assert_eq!(sorted(&review(4096).await), ["a-slow", "b-fast"]);
    assert_eq!(ids(&review(10_000).await), ["b-fast"]);
    let stated = review(1).await;
    let small = stated.iter().find(|r| r.manifest.agent == "c-small");
    assert_eq!(
        small.and_then(|r| r.manifest.capabilities[0].max_tokens),
        Some(1024)
    );

    // Without a priority, least loaded first (all idle: by id), the untimed one included;
    // with one, the untimed one goes last.
    eventually(WAIT, "idle agents, by id", || async {
        let by_load = discover(&client, serde_json::json!({"capability": "code_review"})).await;
        let idle = by_load.iter().all(|r| r.manifest.load == 0.0);
        (idle && ids(&by_load) == ["a-slow", "b-fast", "c-small"]).then_some(())
    })
    .await;
    let by_eta = discover(
        &client,
        serde_json::json!({"capability": "code_review", "priority": "low"}),
    )
    .await;
    assert_eq!(ids(&by_eta), ["b-fast", "a-slow", "c-small"]);
    assert_eq!(by_eta[2].eta_ms, None, "never handled: no ETA");

    // The same query from the command line.
    let cli = |args: &[&str]| {
        let mut cli = std::process::Command::new(chorus_tests::chorus_binary());
        cli.args(["--server", server.url(), "agents"])
            .args(args)
            .stdin(std::process::Stdio::null());
        within(
            WAIT,
            "chorus agents",
            tokio::task::spawn_blocking(move || cli.output()),
        )
    };
    // Asked again until both are listed: on a loaded machine a heartbeat can come late
    // enough that an agent is briefly out of the registry (the order is still checked).
    let records = eventually(WAIT, "chorus agents lists both, soonest first", || async {
        let listed = cli(&[
            "--capability",
            "code_review",
            "--capability",
            "testing",
            "--max-tokens",
            "4096",
            "--priority",
            "high",
            "--json",
        ])
        .await
        .expect("the CLI's task")
        .expect("chorus agents runs");
        assert!(listed.status.success(), "{listed:?}");
        let records: Vec<AgentRecord> =
            serde_json::from_slice(&listed.stdout).expect("JSON records");
        (ids(&records) == ["b-fast", "a-slow"]).then_some(records)
    })
    .await;
    assert!(records.iter().all(|r| r.eta_ms.is_some()));
    let text = eventually(WAIT, "chorus agents lists the three", || async {
        let table = cli(&["--capability", "code_review", "--priority", "low"])
            .await
            .expect("the CLI's task")
            .expect("chorus agents runs");
        let text = String::from_utf8_lossy(&table.stdout).into_owned();
        (text.lines().count() == 4).then_some(text)
    })
    .await;
    let rows: Vec<&str> = text.lines().collect();
    assert!(rows[0].contains("eta"), "{text}");
    assert!(
        rows[1].starts_with("b-fast") && rows[1].contains(" ms "),
        "{text}"
    );
    assert!(
        rows[3].starts_with("c-small") && rows[3].contains(" - "),
        "{text}"
    );
    let refused = cli(&["--priority", "urgent"])
        .await
        .expect("the CLI's task")
        .expect("chorus agents runs");
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("critical, high, normal, low"));
    drop(slow);
}

#[tokio::test]
async fn what_waits_for_a_slot_counts_at_its_priority_and_above() {
    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let client = agent(&server, "asker").await;
    let worker = within(
        WAIT,
        "agent connect",
        agent_options(&server, "single")
            .heartbeat_interval(HEARTBEAT)
            .max_in_flight(1)
            .connect(),
    )
    .await
    .expect("connect");
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    {
        let gate = Arc::clone(&gate);
        worker
            .on_command("work", move |_ctx: Context, hold: bool| {
                let gate = Arc::clone(&gate);
                async move {
                    if hold {
                        gate.acquire().await.expect("gate").forget();
                    } else {
                        tokio::time::sleep(Duration::from_millis(30)).await;
                    }
                    Ok::<_, HandlerError>(())
                }
            })
            .await
            .expect("serve work");
    }
    for _ in 0..3 {
        client
            .call(
                Call::agent("single", "work")
                    .payload(&false)
                    .expect("payload"),
            )
            .await
            .expect("warm");
    }
    // One holds the only slot; behind it wait two low, one normal and one high.
    let mut calls = tokio::task::JoinSet::new();
    let send = |calls: &mut tokio::task::JoinSet<_>, hold: bool, priority: Priority| {
        let client = client.clone();
        calls.spawn(async move {
            client
                .call(
                    Call::agent("single", "work")
                        .payload(&hold)
                        .expect("payload")
                        .priority(priority)
                        .timeout(WAIT),
                )
                .await
        });
    };
    send(&mut calls, true, Priority::Normal);
    for p in [
        Priority::Low,
        Priority::Low,
        Priority::Normal,
        Priority::High,
    ] {
        send(&mut calls, false, p);
    }
    let record = |priority: &'static str| {
        let client = client.clone();
        async move {
            let found = discover(
                &client,
                serde_json::json!({"capability": null, "priority": priority}),
            )
            .await;
            found.into_iter().find(|r| r.manifest.agent == "single")
        }
    };
    let held = eventually(WAIT, "the heartbeat shows what waits", || async {
        record("high")
            .await
            .filter(|r| r.manifest.waiting.at_or_above(Priority::Low) == 4)
    })
    .await;
    let waiting = held.manifest.waiting;
    assert_eq!(
        (waiting.critical, waiting.high, waiting.normal, waiting.low),
        (0, 1, 1, 2)
    );
    assert_eq!(held.manifest.load, 1.0);
    let h = held.manifest.handling_ms.expect("timed");
    // At high, only the running one and the high one are ahead; at low, all five.
    assert_eq!(held.eta_ms, Some(estimate_eta_ms(h, 1, 1, 1)));
    let low = record("low").await.expect("found");
    assert_eq!(low.eta_ms, Some(estimate_eta_ms(h, 1, 1, 4)));
    assert!(low.eta_ms > held.eta_ms);
    // The agent's own ETA is at normal: the high and normal ones ahead.
    assert_eq!(held.manifest.eta_ms, Some(estimate_eta_ms(h, 1, 1, 2)));
    gate.add_permits(1);
    within(WAIT, "every call answered", async {
        while let Some(done) = calls.join_next().await {
            done.expect("the call's task").expect("answered");
        }
    })
    .await;
}

#[tokio::test]
async fn the_coordinator_answers_a_discover_with_an_offer() {
    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let _listed = agent(&server, "listed").await;
    let raw = BrokerOptions::new([server.url()])
        .connect()
        .await
        .expect("raw client");
    let mut env = Envelope::new(Kind::Request, Performative::Discover, "raw-asker");
    env.content_type = CONTENT_TYPE_MSGPACK.into();
    env.payload =
        codec::encode_payload(&DiscoverQuery::default(), CONTENT_TYPE_MSGPACK).expect("payload");
    let bytes = codec::encode(&env, Encoding::MsgPack).expect("encode");
    let reply = within(
        WAIT,
        "the coordinator's answer",
        raw.request(&Subjects::default().discover(), None, bytes, WAIT),
    )
    .await
    .expect("answered");
    let (answer, _) = codec::decode(reply.payload()).expect("an envelope");
    assert_eq!(answer.performative, Performative::Offer);
    assert_eq!(answer.in_reply_to, Some(env.id));
    let found: Vec<AgentRecord> =
        codec::decode_payload(&answer.payload, &answer.content_type).expect("records");
    assert!(found.iter().any(|r| r.manifest.agent == "listed"));
    // Any other request is still answered with `inform`.
    let mut ping = Envelope::new(Kind::Request, Performative::Request, "raw-asker");
    ping.name = Some("ping".into());
    let answered = ping.reply("listed", chorus_sdk::StatusCode::OK);
    assert_eq!(answered.performative, Performative::Inform);
}

#[tokio::test]
async fn a_task_s_acceptance_carries_the_eta_of_its_recent_runs() {
    let server = server();
    let worker = agent(&server, "summarizer").await;
    worker
        .on_task("summarize", |_task: TaskContext, (): ()| async move {
            tokio::time::sleep(Duration::from_millis(80)).await;
            Ok::<_, HandlerError>("short")
        })
        .await
        .expect("serve the task");
    let boss = agent(&server, "boss").await;
    let mut etas = Vec::new();
    for _ in 0..2 {
        let task = boss
            .submit(
                Call::agent("summarizer", "summarize")
                    .payload(&())
                    .expect("payload"),
            )
            .await
            .expect("submit");
        let mut updates = task.updates().await.expect("follow");
        let eta = within(WAIT, "the task to complete", async {
            let mut eta = None;
            while let Some(update) = updates.next().await {
                let update = update.expect("update");
                if update.state() == Some(TaskState::Accepted) {
                    eta = Some(update.eta());
                }
                if update.state() == Some(TaskState::Completed) {
                    break;
                }
            }
            eta.expect("an acceptance")
        })
        .await;
        etas.push(eta);
    }
    assert_eq!(etas[0], None, "never run before: no ETA");
    let eta = etas[1].expect("the second acceptance carries an ETA");
    println!("acceptance ETA after one run: {eta:?}");
    assert!(
        eta >= Duration::from_millis(80) && eta < WAIT,
        "the first run's time: {eta:?}"
    );
}

/// Agentify's `discover` with a `customer_id`: the agents dedicated to that customer and those
/// dedicated to none, not another customer's. A hosted agent learns its customer from the
/// host (`CHORUS_CUSTOMER`, its manifest's `customer`).
#[tokio::test]
async fn a_discovery_for_a_customer_finds_its_own_agents_and_the_shared_ones() {
    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let client = agent(&server, "asker").await;
    let serve = |id: &'static str, customer: Option<&'static str>| {
        let server = &server;
        async move {
            let mut options = agent_options(server, id).heartbeat_interval(HEARTBEAT);
            if let Some(c) = customer {
                options = options.customer(c);
            }
            let a = within(WAIT, "agent connect", options.connect())
                .await
                .expect("connect");
            a.on_capability("calculation", |_ctx: Context, (): ()| async {
                Ok::<_, HandlerError>(())
            })
            .await
            .expect("serve");
            a
        }
    };
    let _acme = serve("calc-acme", Some("acme")).await;
    let _globex = serve("calc-globex", Some("globex")).await;
    let _shared = serve("calc-shared", None).await;
    // As a host starts a replica of a manifest with `customer = "acme"`.
    let binary = tokio::task::spawn_blocking(chorus_tests::chorus_binary)
        .await
        .expect("the chorus binary");
    let mut hosted = std::process::Command::new(binary);
    hosted
        .args([
            "--server",
            server.url(),
            "agent",
            "--capability",
            "calculation",
        ])
        .env(chorus_host::process::ENV_AGENT_ID, "calc-hosted")
        .env(chorus_host::process::ENV_CUSTOMER, "acme")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    let _hosted = chorus_tests::Processes(vec![hosted.spawn().expect("chorus agent starts")]);
    let for_acme = eventually(WAIT, "the hosted agent registered", || async {
        let found = discover(
            &client,
            serde_json::json!({"capability": "calculation", "customer": "acme"}),
        )
        .await;
        (found.len() == 3).then_some(found)
    })
    .await;
    assert_eq!(
        sorted(&for_acme),
        ["calc-acme", "calc-hosted", "calc-shared"]
    );
    let hosted_record = for_acme
        .iter()
        .find(|r| r.manifest.agent == "calc-hosted")
        .expect("listed");
    assert_eq!(hosted_record.manifest.customer.as_deref(), Some("acme"));
    let for_globex = discover(&client, serde_json::json!({"customer": "globex"})).await;
    assert!(!ids(&for_globex).contains(&"calc-acme"));
    assert!(ids(&for_globex).contains(&"calc-globex"));
    let everyone = discover(&client, serde_json::json!({"capability": "calculation"})).await;
    assert_eq!(everyone.len(), 4, "no customer named: all of them");
}
