//! Contract-net through a real nats-server: a call for proposals to every live holder of a
//! capability, refusals and a silent bidder, the award by policy, the losers told, the winner's
//! task run, the settlement recorded.

use std::time::Duration;

use chorus_sdk::credits::{BalanceBy, LedgerEntry, Recorded, balances};
use chorus_sdk::negotiate::{Answer, Negotiation, Policy, Proposal, Settlement};
use chorus_sdk::{Context, HandlerError, StatusCode, TaskContext, TaskState};
use chorus_tests::{WAIT, agent, coordinator, eventually, server, within};
use futures::StreamExt;

/// How a bidder of the test answers.
#[derive(Clone, Copy)]
enum Bidding {
    Price(f64),
    Refuse,
    Silent,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_with_ten_bidders_awards_the_cheapest_tells_the_losers_and_settles() {
    let server = server();
    let coordinator = coordinator(&server, false).await;
    let plan = [
        Bidding::Price(7.0),
        Bidding::Refuse,
        Bidding::Price(3.0),
        Bidding::Price(9.0),
        Bidding::Silent,
        Bidding::Refuse,
        Bidding::Price(4.0),
        Bidding::Price(5.0),
        Bidding::Refuse,
        Bidding::Price(8.0),
    ];
    let mut bidders = Vec::new();
    for (i, bidding) in plan.into_iter().enumerate() {
        let id = format!("translator-{i}");
        let a = agent(&server, &id).await;
        a.on_bid("translate", move |_ctx: Context, text: String| async move {
            match bidding {
                Bidding::Price(price) => Ok(Proposal::at(price)
                    .eta_ms(100 * text.len() as u64)
                    .confidence(0.9)),
                Bidding::Refuse => Err(HandlerError::new(
                    StatusCode::UNAVAILABLE,
                    "busy with other work",
                )),
                Bidding::Silent => {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    Ok(Proposal::at(0.0))
                }
            }
        })
        .await
        .expect("bid");
        a.on_task_capability("translate", |task: TaskContext, text: String| async move {
            Ok::<_, HandlerError>(format!("{} translated {text:?}", task.agent_id()))
        })
        .await
        .expect("serve the work");
        bidders.push((a.round_results(), a));
    }
    let requester = agent(&server, "requester").await;
    let mut settled = requester
        .subscribe("negotiation.settled")
        .await
        .expect("subscribe");
    eventually(WAIT, "the ten bidders registered", || async {
        let holders = requester.discover_capability("translate").await.ok()?;
        (holders.len() == 10).then_some(())
    })
    .await;

    let started = std::time::Instant::now();
    let award = within(
        WAIT,
        "the round",
        requester.negotiate(
            Negotiation::capability("translate")
                .payload(&"bonjour")
                .expect("payload")
                .deadline(Duration::from_millis(800))
                .policy(Policy::Cheapest)
                .customer("acme"),
        ),
    )
    .await
    .expect("awarded");
    // The silent bidder is not waited for past the deadline.
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(award.winner, "translator-2");
    assert_eq!(award.proposal.price, Some(3.0));
    assert_eq!(award.bids.len(), 10);
    let count = |f: fn(&Answer) -> bool| award.bids.iter().filter(|b| f(&b.answer)).count();
    assert_eq!(count(|a| matches!(a, Answer::Proposed(_))), 6);
    assert_eq!(
        count(|a| matches!(
            a,
            Answer::Refused {
                status: StatusCode::UNAVAILABLE,
                ..
            }
        )),
        3
    );
    assert_eq!(count(|a| matches!(a, Answer::Silent)), 1);
    let silent = award
        .bids
        .iter()
        .find(|b| b.answer == Answer::Silent)
        .expect("one silent");
    assert_eq!(silent.agent, "translator-4");

    // The winner's task runs.
    let report = within(WAIT, "the task", award.task.result())
        .await
        .expect("result");
    assert_eq!(report.state, TaskState::Completed);
    assert_eq!(
        report.output_as::<String>().expect("output"),
        "translator-2 translated \"bonjour\""
    );

    // Each proposer hears how it went; refusers and the silent one are not told.
    for (i, (results, _)) in bidders.iter_mut().enumerate() {
        let proposed = matches!(plan[i], Bidding::Price(_));
        if !proposed {
            assert!(results.try_recv().is_err(), "translator-{i} told");
            continue;
        }
        let result = within(WAIT, "the round's outcome", results.recv())
            .await
            .expect("an outcome");
        assert_eq!(result.round, award.round);
        assert_eq!(result.won, i == 2, "translator-{i}");
    }

    // The settlement records what was agreed.
    let event = within(WAIT, "settlement", settled.next())
        .await
        .expect("event");
    let settlement: Settlement = event.payload_as().expect("settlement");
    assert_eq!(settlement.round, award.round);
    assert_eq!(settlement.winner, "translator-2");
    assert_eq!(settlement.task, award.task.id());
    assert_eq!(settlement.proposal.price, Some(3.0));
    assert_eq!(
        (settlement.asked, settlement.proposals, settlement.refusals),
        (10, 6, 3)
    );
    assert_eq!(settlement.customer.as_deref(), Some("acme"));
    assert!(settlement.credited);

    // The price is in the credits ledger under the round, once: recording it again (a
    // higher price, say) leaves the entry as it was.
    let ledger = requester.ledger().await.expect("the ledger");
    let entry = ledger
        .entry(award.round)
        .await
        .expect("read")
        .expect("an entry");
    assert_eq!(
        (entry.payer.as_str(), entry.payee.as_str(), entry.price),
        ("requester", "translator-2", 3.0)
    );
    assert_eq!(
        (entry.customer.as_deref(), entry.task),
        (Some("acme"), award.task.id())
    );
    let again = LedgerEntry {
        price: 99.0,
        ..entry.clone()
    };
    assert_eq!(
        ledger.record(&again).await.expect("record"),
        Recorded::Already(entry.clone())
    );
    let entries = ledger.entries().await.expect("entries");
    assert_eq!(entries, [entry]);
    let by_agent = balances(&entries, BalanceBy::Agent);
    let line = |name: &str| by_agent.iter().find(|b| b.name == name).cloned();
    assert_eq!(
        line("translator-2").map(|b| (b.earned, b.spent)),
        Some((3.0, 0.0))
    );
    assert_eq!(
        line("requester").map(|b| (b.earned, b.spent)),
        Some((0.0, 3.0))
    );
    // A price that is not one is refused.
    let negative = LedgerEntry {
        round: uuid::Uuid::now_v7(),
        price: -1.0,
        ..again
    };
    assert!(matches!(
        ledger.record(&negative).await,
        Err(chorus_sdk::SdkError::InvalidCall(_))
    ));
    coordinator.shutdown().await;
}

#[tokio::test]
async fn a_round_without_proposals_awards_nothing_and_says_why() {
    let server = server();
    let refuser = agent(&server, "refuser").await;
    refuser
        .on_bid("audit", |_ctx: Context, (): ()| async move {
            Err::<Proposal, _>(HandlerError::invalid_argument("not my field"))
        })
        .await
        .expect("bid");
    let requester = agent(&server, "requester").await;
    let err = requester
        .negotiate(
            Negotiation::capability("audit")
                .payload(&())
                .expect("payload")
                .bidders(["refuser", "nobody"])
                .deadline(Duration::from_millis(300)),
        )
        .await
        .expect_err("nothing to award");
    let text = err.to_string();
    assert!(text.contains("refuser refused (5018"), "{text}");
    assert!(text.contains("nobody was silent"), "{text}");
    assert!(requester.tasks(10).await.expect("list").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_runs_a_round_and_waits_for_the_winners_result() {
    let server = server();
    let mut keep = Vec::new();
    for (id, price) in [("cheap", 1.0), ("dear", 9.0)] {
        let a = agent(&server, id).await;
        a.on_bid("quote", move |_ctx: Context, (): ()| async move {
            Ok(Proposal::at(price).eta_ms(50))
        })
        .await
        .expect("bid");
        a.on_task_capability("quote", |task: TaskContext, (): ()| async move {
            Ok::<_, HandlerError>(format!("quoted by {}", task.agent_id()))
        })
        .await
        .expect("serve the work");
        keep.push(a);
    }
    let binary = chorus_tests::chorus_binary();
    let out = within(
        Duration::from_secs(120),
        "chorus negotiate",
        tokio::process::Command::new(binary)
            .args([
                "--server",
                server.url(),
                "negotiate",
                "--capability",
                "quote",
                "--bidders",
                "dear,cheap,ghost",
                "--deadline",
                "500ms",
                "--wait",
                "--json",
            ])
            .env_remove("CHORUS_CONTEXT")
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("run chorus");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let round: serde_json::Value = serde_json::from_str(&stdout).expect("json");
    assert_eq!(round["winner"], "cheap");
    assert_eq!(round["state"], "completed");
    assert_eq!(round["output"], "quoted by cheap");
    let answers: Vec<&str> = round["bids"]
        .as_array()
        .expect("bids")
        .iter()
        .map(|b| b["answer"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(answers, ["proposed", "proposed", "silent"]);
}

/// Routing by load: three holders of a capability whose loads differ; a least-loaded call goes
/// to the least loaded, moves when the loads change, and falls back to the queue group while
/// there is no registry to route by. The details the holders announce reach discovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_loaded_calls_go_to_the_least_loaded_holder_and_fall_back_without_a_registry() {
    use chorus_sdk::registry::Availability;
    use chorus_sdk::{Call, Routing};

    let server = server();
    let mut holders = Vec::new();
    for id in ["ocr-busy", "ocr-idle", "ocr-half"] {
        let holder = within(
            WAIT,
            "holder connect",
            chorus_tests::agent_options(&server, id)
                .heartbeat_interval(Duration::from_millis(200))
                .max_in_flight(8)
                .capability_details("ocr", ["tesseract-5"], Some(12.5))
                .connect(),
        )
        .await
        .expect("holder");
        holder
            .on_capability("ocr", |ctx: Context, _page: String| async move {
                Ok::<_, HandlerError>(ctx.agent_id().to_owned())
            })
            .await
            .expect("serve ocr");
        holders.push(holder);
    }
    let caller = within(
        WAIT,
        "caller connect",
        chorus_tests::agent_options(&server, "reader")
            .capability_routing(Routing::LeastLoaded)
            .routing_refresh(Duration::from_millis(100))
            .connect(),
    )
    .await
    .expect("caller");
    let ask = |call: Call| {
        let caller = caller.clone();
        async move {
            let reply = within(
                WAIT,
                "an ocr call",
                caller.call(call.payload("page").expect("payload")),
            )
            .await?;
            reply.payload_as::<String>()
        }
    };

    // No coordinator, no registry: the queue group answers, routing or not.
    let answered = ask(Call::capability("ocr"))
        .await
        .expect("the queue group answers");
    assert!(answered.starts_with("ocr-"), "{answered}");

    let _coordinator = coordinator(&server, false).await;
    for (holder, load) in holders.iter().zip([0.9, 0.1, 0.5]) {
        holder.set_load(load, Availability::Available);
    }
    let listed = eventually(WAIT, "the registry has the three loads", || async {
        let found = caller.discover_capability("ocr").await.ok()?;
        (found.len() == 3 && (found[0].manifest.load - 0.1).abs() < 1e-6).then_some(found)
    })
    .await;
    let idle = &listed[0].manifest;
    assert_eq!(idle.agent, "ocr-idle");
    assert_eq!(idle.slots, Some(8));
    let ocr = idle
        .capabilities
        .iter()
        .find(|c| c.name == "ocr")
        .expect("ocr");
    assert_eq!(
        (ocr.models.as_slice(), ocr.throughput),
        (&["tesseract-5".to_owned()][..], Some(12.5))
    );

    // Every call goes to the least loaded once the caller's view is refreshed (the empty one
    // it learned without a coordinator is kept for routing_refresh): ten in a row by chance
    // from the queue group would be one in 59,049.
    let streak = |want: &'static str| {
        move || async move {
            for _ in 0..10 {
                if ask(Call::capability("ocr")).await.ok()? != want {
                    return None;
                }
            }
            Some(())
        }
    };
    eventually(WAIT, "calls routed to ocr-idle", streak("ocr-idle")).await;
    for _ in 0..20 {
        assert_eq!(
            ask(Call::capability("ocr")).await.expect("routed"),
            "ocr-idle"
        );
    }
    // The agent's default is the queue group unless it says: then all three answer in time.
    let plain = within(
        WAIT,
        "plain caller",
        chorus_tests::agent(&server, "plain-reader"),
    )
    .await;
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let reply = within(
            WAIT,
            "a plain call",
            plain.call(Call::capability("ocr").payload("page").expect("payload")),
        )
        .await
        .expect("answered");
        seen.insert(reply.payload_as::<String>().expect("id"));
        if seen.len() == 3 {
            break;
        }
    }
    assert_eq!(
        seen.len(),
        3,
        "the queue group spreads plain calls: {seen:?}"
    );
    // A per-call choice: least loaded on an agent whose default is the queue group.
    assert_eq!(
        within(
            WAIT,
            "a routed call",
            plain.call(
                Call::capability("ocr")
                    .least_loaded()
                    .payload("page")
                    .expect("payload")
            )
        )
        .await
        .expect("answered")
        .payload_as::<String>()
        .expect("id"),
        "ocr-idle"
    );

    // Loads change: the calls follow.
    holders[1].set_load(0.95, Availability::Available);
    eventually(WAIT, "calls routed to ocr-half", streak("ocr-half")).await;

    // A capability nobody holds: the registry knows none, the queue group answers no responders.
    let err = ask(Call::capability("nobody.has"))
        .await
        .expect_err("no holder");
    assert_eq!(err.status(), StatusCode::NO_RESPONDERS, "{err}");
}

/// Circuit breaker: calls to an agent that keeps failing open the caller's breaker for it; while
/// open, calls are answered at once without reaching the agent; after the interval one call
/// tries (half-open) and its success closes it. The metric, the manifest and `chorus agents`
/// show the open breaker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_breaker_opens_after_the_failures_answers_at_once_then_half_opens_and_closes() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use chorus_sdk::{BreakerPolicy, Call, CircuitState, SdkError};

    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let healthy = Arc::new(AtomicBool::new(false));
    let reached = Arc::new(AtomicUsize::new(0));
    let flaky = agent(&server, "flaky").await;
    let (h, r) = (Arc::clone(&healthy), Arc::clone(&reached));
    flaky
        .on_command("work", move |_ctx: Context, (): ()| {
            let (healthy, reached) = (Arc::clone(&h), Arc::clone(&r));
            async move {
                reached.fetch_add(1, Ordering::SeqCst);
                if healthy.load(Ordering::SeqCst) {
                    Ok("done".to_owned())
                } else {
                    Err(HandlerError::new(StatusCode::UNAVAILABLE, "overloaded"))
                }
            }
        })
        .await
        .expect("serve work");
    let open_for = Duration::from_millis(500);
    let caller = within(
        WAIT,
        "caller connect",
        chorus_tests::agent_options(&server, "careful")
            .heartbeat_interval(Duration::from_millis(200))
            .circuit_breaker(BreakerPolicy::new(3, open_for))
            .connect(),
    )
    .await
    .expect("caller");
    let work = || {
        let caller = caller.clone();
        async move {
            within(
                WAIT,
                "a call to flaky",
                caller.call(Call::agent("flaky", "work").payload(&()).expect("payload")),
            )
            .await
        }
    };
    let gauge = || {
        chorus_sdk::metrics::render(chorus_sdk::metrics::registry())
            .lines()
            .find(|l| {
                l.starts_with("chorus_agent_circuit_state{")
                    && l.contains("agent=\"careful\"")
                    && l.contains("destination=\"agent:flaky\"")
            })
            .map(|l| l.rsplit(' ').next().unwrap_or_default().to_owned())
    };

    for _ in 0..3 {
        let err = work().await.expect_err("flaky fails");
        assert_eq!(err.status(), StatusCode::UNAVAILABLE, "{err}");
    }
    assert_eq!(caller.circuit("agent:flaky"), CircuitState::Open);
    assert_eq!(gauge().as_deref(), Some("2"));
    // Open: answered at once, and the call never reaches flaky.
    let before = reached.load(Ordering::SeqCst);
    let err = work().await.expect_err("open");
    assert!(
        matches!(err, SdkError::CircuitOpen { ref destination, .. } if destination == "agent:flaky"),
        "{err}"
    );
    assert_eq!(err.status(), StatusCode::UNAVAILABLE);
    assert_eq!(
        reached.load(Ordering::SeqCst),
        before,
        "an open breaker sent the call"
    );
    // Other destinations are not cut off.
    let other = caller
        .call(
            Call::capability("nothing.here")
                .payload(&())
                .expect("payload"),
        )
        .await;
    assert_eq!(
        other.expect_err("nobody holds it").status(),
        StatusCode::NO_RESPONDERS
    );

    // The registry, and `chorus agents`, show it.
    eventually(WAIT, "the manifest lists the open breaker", || async {
        let found = caller
            .discover(&chorus_sdk::DiscoverQuery::default())
            .await
            .ok()?;
        found
            .iter()
            .any(|r| r.manifest.agent == "careful" && r.manifest.open_circuits == ["agent:flaky"])
            .then_some(())
    })
    .await;
    let mut cli = std::process::Command::new(chorus_tests::chorus_binary());
    cli.args(["--server", server.url(), "agents"])
        .stdin(std::process::Stdio::null());
    let listed = within(
        WAIT,
        "chorus agents",
        tokio::task::spawn_blocking(move || cli.output()),
    )
    .await
    .expect("the CLI's task")
    .expect("chorus agents runs");
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(text.contains("circuits open: agent:flaky"), "{text}");

    // Healthy again: after the interval one call tries, succeeds, and closes the breaker.
    healthy.store(true, Ordering::SeqCst);
    eventually(WAIT, "a probe through the half-open breaker", || async {
        match work().await {
            Ok(reply) => Some(reply),
            Err(SdkError::CircuitOpen { .. }) => None,
            Err(e) => panic!("the probe failed: {e}"),
        }
    })
    .await;
    assert_eq!(caller.circuit("agent:flaky"), CircuitState::Closed);
    assert_eq!(gauge().as_deref(), Some("0"));
    eventually(WAIT, "the manifest drops the breaker", || async {
        let found = caller
            .discover(&chorus_sdk::DiscoverQuery::default())
            .await
            .ok()?;
        found
            .iter()
            .any(|r| r.manifest.agent == "careful" && r.manifest.open_circuits.is_empty())
            .then_some(())
    })
    .await;
}

/// Request retries: a request whose reply comes too late is sent again with the same id, and
/// the exactly-once handler it reaches runs once (the copy is answered with the recorded
/// result); a request that keeps failing is retried to its limit and dead-lettered, so the DLQ
/// holds failed requests as well as commands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_request_runs_an_exactly_once_handler_once_and_a_failing_one_is_dead_lettered() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use chorus_coordinator::service::dlq::DeadLetterQueue;
    use chorus_sdk::durable::DeadLetterReason;
    use chorus_sdk::retry::RetryPolicy;
    use chorus_sdk::{Call, DeliveryClass};

    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let ledger = agent(&server, "ledger").await;
    let counted = Arc::clone(&runs);
    ledger
        .on_command("charge", move |_ctx: Context, amount: u32| {
            let runs = Arc::clone(&counted);
            async move {
                // The first run answers after the caller has given up on it.
                if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                    tokio::time::sleep(Duration::from_millis(400)).await;
                }
                Ok::<_, HandlerError>(format!("charged {amount}"))
            }
        })
        .await
        .expect("serve charge");
    ledger
        .on_command("refund", |_ctx: Context, _amount: u32| async move {
            Err::<String, _>(HandlerError::new(
                StatusCode::HANDLER_FAILED,
                "the bank is down",
            ))
        })
        .await
        .expect("serve refund");
    let caller = agent(&server, "shop").await;
    let policy = RetryPolicy {
        max_attempts: 3,
        initial_backoff_ms: 600,
        max_backoff_ms: 600,
        jitter: 0.0,
        ..RetryPolicy::default()
    };

    let id = uuid::Uuid::now_v7();
    let reply = within(
        WAIT,
        "the retried charge",
        caller.call(
            Call::agent("ledger", "charge")
                .id(id)
                .delivery(DeliveryClass::ExactlyOnce)
                .timeout(Duration::from_millis(150))
                // A copy that arrives while the first still runs is answered 5019 and retried
                // too: room for a slow machine.
                .retry(RetryPolicy {
                    max_attempts: 5,
                    ..policy.clone()
                })
                .payload(&42u32)
                .expect("payload"),
        ),
    )
    .await
    .expect("the retry is answered");
    assert_eq!(reply.payload_as::<String>().expect("text"), "charged 42");
    assert_eq!(
        reply.envelope.in_reply_to,
        Some(id),
        "the same id went again"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the handler ran once");

    // Failing for good: three attempts, then the dead-letter queue.
    let refund = uuid::Uuid::now_v7();
    let err = within(
        WAIT,
        "the failing refund",
        caller.call(
            Call::agent("ledger", "refund")
                .id(refund)
                .retry(RetryPolicy {
                    initial_backoff_ms: 50,
                    max_backoff_ms: 50,
                    ..policy
                })
                .dead_letter_on_failure()
                .payload(&42u32)
                .expect("payload"),
        ),
    )
    .await
    .expect_err("it keeps failing");
    assert_eq!(err.status(), StatusCode::HANDLER_FAILED, "{err}");
    let dlq = DeadLetterQueue::new(caller.broker().clone(), caller.subjects().clone());
    let entry = eventually(WAIT, "the request's dead letter", || async {
        dlq.list(10)
            .await
            .ok()?
            .into_iter()
            .find(|e| e.letter.message_id == Some(refund))
    })
    .await;
    assert_eq!(entry.letter.reason, DeadLetterReason::MaxAttempts);
    assert_eq!(entry.letter.attempts, 3);
    assert_eq!(entry.letter.agent, "ledger");
    assert_eq!(entry.letter.status, StatusCode::HANDLER_FAILED);
    assert!(
        entry.letter.detail.contains("the bank is down"),
        "{}",
        entry.letter.detail
    );
}

/// Counter-proposals: the requester counters every proposal at 1 below its price; one bidder
/// takes no counters (its proposal stands), one accepts the offer, one meets it part way. The
/// award follows the policy over what stands, the settlement records the counters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn countered_proposals_are_accepted_refused_or_met_part_way_and_the_award_follows() {
    use chorus_sdk::negotiate::CounterOffer;

    let server = server();
    let _coordinator = coordinator(&server, false).await;
    let mut bidders = Vec::new();
    for (id, price) in [("stubborn", 5.0), ("flexible", 5.5), ("haggler", 9.0)] {
        let a = agent(&server, id).await;
        a.on_bid(
            "translate",
            move |_ctx: Context, _text: String| async move { Ok(Proposal::at(price)) },
        )
        .await
        .expect("bid");
        match id {
            "flexible" => a.on_counter("translate", |_ctx: Context, c: CounterOffer| async move {
                Ok(c.offer)
            }),
            "haggler" => a.on_counter("translate", |_ctx: Context, c: CounterOffer| async move {
                let asked = c.previous.price.unwrap_or_default();
                let offered = c.offer.price.unwrap_or_default();
                Ok(Proposal::at(f64::midpoint(asked, offered)))
            }),
            _ => {}
        }
        a.on_task_capability("translate", |task: TaskContext, text: String| async move {
            Ok::<_, HandlerError>(format!("{} translated {text:?}", task.agent_id()))
        })
        .await
        .expect("serve the work");
        bidders.push(a);
    }
    let requester = agent(&server, "requester").await;
    let mut settled = requester
        .subscribe("negotiation.settled")
        .await
        .expect("subscribe");
    let award = within(
        WAIT,
        "the round",
        requester.negotiate(
            Negotiation::capability("translate")
                .payload(&"hello")
                .expect("payload")
                .bidders(["stubborn", "flexible", "haggler"])
                .counter(1, |bid| {
                    bid.proposal()
                        .and_then(|p| p.price)
                        .map(|price| Proposal::at(price - 1.0))
                }),
        ),
    )
    .await
    .expect("an award");
    let prices: Vec<(String, Option<f64>)> = award
        .bids
        .iter()
        .map(|b| (b.agent.clone(), b.proposal().and_then(|p| p.price)))
        .collect();
    assert_eq!(
        prices,
        [
            ("stubborn".to_owned(), Some(5.0)),
            ("flexible".to_owned(), Some(4.5)),
            ("haggler".to_owned(), Some(8.5)),
        ]
    );
    assert_eq!(award.winner, "flexible");
    assert_eq!(award.proposal.price, Some(4.5));
    let report = within(WAIT, "the winner's task", award.task.result())
        .await
        .expect("result");
    assert_eq!(report.state, TaskState::Completed);
    let event = within(WAIT, "the settlement", settled.next())
        .await
        .expect("an event");
    let settlement: Settlement = event.payload_as().expect("a settlement");
    assert_eq!(
        (settlement.winner.as_str(), settlement.proposal.price),
        ("flexible", Some(4.5))
    );
    assert_eq!(settlement.countered, 3);
}
