//! A site on a leaf node attached to a hub cluster of three (docs/OPERATIONS.md, "Sites and
//! leaf nodes"): agents at the site reach agents at the hub and back (events, requests,
//! durable commands); with the leaf cut off, the site's own traffic goes on and durable
//! commands for it wait at the hub; once the leaf is back they are delivered, none lost.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chorus_chaos::Proxy;
use chorus_sdk::{AgentOptions, Call, Context, HandlerError};
use chorus_tests::{WAIT, eventually, within};
use tokio::sync::mpsc;

/// The longest the leaf and the hub take to see each other again (the leaf redials every
/// second; a durable consumer renews a pull that went quiet within its heartbeat).
const REJOIN: Duration = Duration::from_secs(60);

/// Each number once, in the order first seen (at least once may repeat one).
fn firsts(seen: &Mutex<Vec<u32>>) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for n in seen.lock().expect("lock").iter() {
        if !out.contains(n) {
            out.push(*n);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_site_on_a_leaf_node_reaches_the_hub_works_cut_off_and_catches_up() {
    chorus_tests::init_tracing();
    let hub = tokio::task::spawn_blocking(|| {
        chorus_nats_server::Cluster::builder()
            .leafnodes(true)
            .start()
    })
    .await
    .expect("join")
    .expect("the hub cluster starts");
    // The leaf reaches the hub through a proxy the test can cut.
    let proxy = Proxy::bind().await.expect("proxy");
    (proxy.target_setter())(hub.leafnode_address(0).expect("a leaf node listener"));
    let dir = tempfile::tempdir().expect("tempdir");
    let conf = dir.path().join("leaf.conf");
    std::fs::write(
        &conf,
        format!(
            "server_name: leaf\nlisten: \"127.0.0.1:-1\"\nleafnodes {{\n  reconnect: \"1s\"\n  remotes: [ {{ url: \"nats-leaf://{}\" }} ]\n}}\n",
            proxy.addr()
        ),
    )
    .expect("leaf config");
    let leaf = chorus_tests::ServerBuilder::default()
        .config(&conf)
        .start()
        .expect("the leaf starts");

    // At the hub: an agent that answers and sends durable commands (JetStream needs its meta
    // leader before the inbox stream can be made).
    let hub_urls = hub.urls();
    let hq = eventually(REJOIN, "the hub's JetStream", || {
        let servers = hub_urls.clone();
        async move {
            let hq = AgentOptions::new("hq")
                .servers(servers)
                .connect()
                .await
                .ok()?;
            hq.send_durable(Call::agent("nobody", "warm-up").payload(&()).ok()?)
                .await
                .ok()?;
            Some(hq)
        }
    })
    .await;
    hq.on_command("where", |ctx: Context, (): ()| async move {
        Ok::<_, HandlerError>(ctx.agent_id().to_owned())
    })
    .await
    .expect("where");

    // At the site: a durable agent and a neighbour. The durable consumer lives on the hub.
    let leaf_url = leaf.url().to_owned();
    let field = eventually(
        REJOIN,
        "the field agent's durable inbox across the leaf",
        || {
            let url = leaf_url.clone();
            async move {
                AgentOptions::new("field")
                    .servers([url])
                    // The leaf has no JetStream: the hub's is reached in its domain.
                    .jetstream_domain(chorus_nats_server::HUB_DOMAIN)
                    .durable_inbox(true)
                    .durable_ack_wait(Duration::from_secs(2))
                    .connect()
                    .await
                    .ok()
            }
        },
    )
    .await;
    let recorded = Arc::new(Mutex::new(Vec::<u32>::new()));
    {
        let recorded = Arc::clone(&recorded);
        field
            .on_command("record", move |_ctx: Context, n: u32| {
                recorded.lock().expect("lock").push(n);
                async { Ok::<_, HandlerError>(()) }
            })
            .await
            .expect("record");
    }
    field
        .on_command("where", |ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(ctx.agent_id().to_owned())
        })
        .await
        .expect("where");
    let (heard, mut news) = mpsc::unbounded_channel();
    field
        .on_event("site.>", move |ctx: Context, text: String| {
            let heard = heard.clone();
            async move {
                let _ = heard.send((ctx.from().to_owned(), text));
                Ok(())
            }
        })
        .await
        .expect("events");
    let neighbour = AgentOptions::new("neighbour")
        .servers([leaf.url()])
        .connect()
        .await
        .expect("neighbour");

    // Across the leaf, both ways: requests, events, durable commands.
    let answer: String = within(WAIT, "site to hub", field.request("hq", "where", &()))
        .await
        .expect("the hub answers the site");
    assert_eq!(answer, "hq");
    let answer: String = eventually(WAIT, "hub to site", || async {
        hq.request::<_, String>("field", "where", &()).await.ok()
    })
    .await;
    assert_eq!(answer, "field");
    // Events are at most once: published until the site's interest has crossed the leaf.
    within(WAIT, "an event from the hub at the site", async {
        loop {
            hq.publish("site.news", "from the hub")
                .await
                .expect("publish at the hub");
            if let Ok(Some((from, _))) =
                tokio::time::timeout(Duration::from_millis(200), news.recv()).await
                && from == "hq"
            {
                break;
            }
        }
    })
    .await;
    for n in 0..10u32 {
        hq.send_durable(Call::agent("field", "record").payload(&n).expect("payload"))
            .await
            .expect("stored at the hub");
    }
    eventually(WAIT, "the first ten durable commands", || async {
        (firsts(&recorded).len() >= 10).then_some(())
    })
    .await;

    // Cut off: the hub no longer reaches the site...
    proxy.cut();
    eventually(WAIT, "the hub to lose sight of the site", || async {
        hq.request::<_, String>("field", "where", &()).await.err()
    })
    .await;
    // ...the site's own traffic goes on...
    let answer: String = within(
        WAIT,
        "site to site",
        neighbour.request("field", "where", &()),
    )
    .await
    .expect("the site answers itself while cut off");
    assert_eq!(answer, "field");
    while news.try_recv().is_ok() {}
    neighbour
        .publish("site.local", "still here")
        .await
        .expect("publish at the site");
    let (from, text) = within(WAIT, "a site event while cut off", news.recv())
        .await
        .expect("heard");
    assert_eq!((from.as_str(), text.as_str()), ("neighbour", "still here"));
    // ...and durable commands for the site wait at the hub.
    for n in 10..20u32 {
        hq.send_durable(Call::agent("field", "record").payload(&n).expect("payload"))
            .await
            .expect("stored at the hub while the site is cut off");
    }
    assert_eq!(
        firsts(&recorded),
        (0..10).collect::<Vec<_>>(),
        "nothing crossed the cut"
    );
    // The site's own durable sends need the hub's JetStream: refused, not silently dropped.
    let refused = within(
        WAIT,
        "a durable send from the site while cut off",
        field.send_durable(Call::agent("hq", "where").payload(&()).expect("payload")),
    )
    .await;
    assert!(
        refused.is_err(),
        "stored with the hub out of reach: {refused:?}"
    );

    // Back: every command delivered, in order, none lost.
    proxy.heal();
    eventually(REJOIN, "the commands kept for the site", || async {
        (firsts(&recorded).len() >= 20).then_some(())
    })
    .await;
    // None lost. In order before the cut; across it, a command the hub handed to the pull
    // that was waiting when the leaf went is redelivered after the ack wait, so it may come
    // after later ones (docs/OPERATIONS.md).
    let got = firsts(&recorded);
    assert_eq!(got[..10], (0..10).collect::<Vec<_>>());
    let mut all = got.clone();
    all.sort_unstable();
    assert_eq!(all, (0..20).collect::<Vec<_>>(), "as delivered: {got:?}");
    let answer: String = eventually(WAIT, "hub to site again", || async {
        hq.request::<_, String>("field", "where", &()).await.ok()
    })
    .await;
    assert_eq!(answer, "field");

    // The CLI at the site: a durable send needs the hub's JetStream, reached by its domain.
    let cli = |args: &[&str]| {
        let mut cmd = tokio::process::Command::new(chorus_tests::chorus_binary());
        cmd.args(["--server", leaf_url.as_str()])
            .args(args)
            .env(
                "CHORUS_CONFIG_DIR",
                std::env::temp_dir().join("chorus-leaf-cli"),
            )
            .kill_on_drop(true);
        async move {
            within(WAIT, "the chorus CLI", cmd.output())
                .await
                .expect("run chorus")
        }
    };
    let send = [
        "send",
        "--to",
        "field",
        "--command",
        "record",
        "--durable",
        "20",
    ];
    let without = cli(&send).await;
    assert!(
        !without.status.success(),
        "no JetStream at the leaf without its domain: {}",
        String::from_utf8_lossy(&without.stdout)
    );
    let mut with_domain = vec!["--js-domain", chorus_nats_server::HUB_DOMAIN];
    with_domain.extend(send);
    let stored = cli(&with_domain).await;
    assert!(
        stored.status.success(),
        "stored through the hub's domain: {}",
        String::from_utf8_lossy(&stored.stderr)
    );
    eventually(WAIT, "the CLI's durable command at the site", || async {
        firsts(&recorded).contains(&20).then_some(())
    })
    .await;
    let bad = cli(&[
        "--js-domain",
        "not a token",
        "send",
        "--to",
        "field",
        "--command",
        "record",
    ])
    .await;
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("JetStream domain"),
        "a bad domain is named: {}",
        String::from_utf8_lossy(&bad.stderr)
    );

    field.shutdown().await;
    neighbour.shutdown().await;
    hq.shutdown().await;
    proxy.close().await;
}
