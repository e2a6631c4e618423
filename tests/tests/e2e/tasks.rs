//! Tasks through a real nats-server: the lifecycle and its table, progress, input, cancel,
//! deadlines on both sides, streamed chunks across a requester restart, and a requester that
//! dies and finds its task again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus_sdk::task::TaskMessage;
use chorus_sdk::{
    Call, HandlerError, SdkError, StatusCode, TaskContext, TaskState, TaskStop, TaskUpdate,
};
use chorus_tests::{CrashableAgent, WAIT, agent, agent_options, server, within};
use futures::StreamExt;
use serde::{Deserialize, Serialize};

#[derive(Debug, Serialize, Deserialize)]
struct Sum {
    a: i64,
    b: i64,
}

/// Reads `updates` until its end (the terminal state), within the test's deadline.
async fn collect(updates: chorus_sdk::TaskUpdates) -> Vec<TaskUpdate> {
    within(WAIT, "a task's updates to end", async move {
        updates
            .map(|u| u.expect("update reads"))
            .collect::<Vec<_>>()
            .await
    })
    .await
}

fn states(updates: &[TaskUpdate]) -> Vec<TaskState> {
    updates.iter().filter_map(TaskUpdate::state).collect()
}

/// Waits until the task's updates show `state`.
async fn until_state(task: &chorus_sdk::TaskHandle, state: TaskState) -> TaskUpdate {
    let mut updates = task.updates_after(0).await.expect("follow");
    within(WAIT, &format!("task to be {state}"), async {
        loop {
            let update = updates
                .next()
                .await
                .expect("the task ended first")
                .expect("update");
            if update.state() == Some(state) {
                return update;
            }
        }
    })
    .await
}

#[tokio::test]
async fn a_task_goes_submitted_accepted_working_completed_with_progress_and_a_report() {
    let server = server();
    let worker = agent(&server, "adder").await;
    worker
        .on_task("sum", |task: TaskContext, args: Sum| async move {
            task.progress(Some(0.5), "half way").await?;
            task.progress_with(None, "partial", &args.a).await?;
            Ok(args.a + args.b)
        })
        .await
        .expect("serve the task");
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::agent("adder", "sum")
                .payload(&Sum { a: 2, b: 40 })
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    let updates = collect(task.updates().await.expect("follow the task")).await;
    assert_eq!(
        states(&updates),
        [
            TaskState::Submitted,
            TaskState::Accepted,
            TaskState::Working,
            TaskState::Completed
        ]
    );
    let progress: Vec<_> = updates
        .iter()
        .filter(|u| u.kind == TaskMessage::Progress)
        .collect();
    assert_eq!(progress.len(), 2);
    assert_eq!(progress[0].fraction(), Some(0.5));
    assert_eq!(progress[0].text(), Some("half way"));
    assert_eq!(progress[1].payload_as::<i64>().expect("payload decodes"), 2);
    // Sequences only grow, and the handle remembers the last one.
    assert!(updates.windows(2).all(|w| w[0].seq < w[1].seq));
    assert_eq!(task.last_seen(), updates.last().expect("an update").seq);

    let report = within(WAIT, "result", task.result()).await.expect("result");
    assert_eq!(report.state, TaskState::Completed);
    assert_eq!(report.status, StatusCode::OK);
    assert_eq!(report.output_as::<i64>().expect("output decodes"), 42);
    assert_eq!(report.requester, "boss");
    assert_eq!(report.target, "adder.sum");
    assert_eq!(report.attempts.len(), 1);
    assert_eq!(report.attempts[0].agent, "adder");
    assert_eq!(report.attempts[0].state, TaskState::Completed);
    assert!(
        report.attempts[0].ended_ms.expect("the attempt ended") >= report.attempts[0].started_ms
    );

    // Finished is final: a cancel now changes nothing, an answer is refused.
    let after = within(WAIT, "cancel of a finished task", task.cancel())
        .await
        .expect("cancel");
    assert_eq!(after.state, TaskState::Completed);
    let err = task.respond(&1).await.expect_err("should fail");
    assert_eq!(err.status(), StatusCode::TASK_STATE, "{err}");
    let listed = boss.tasks(100).await.expect("list tasks");
    assert!(
        listed
            .iter()
            .any(|t| t.id == task.id() && t.state == TaskState::Completed),
        "{listed:?}"
    );
}

#[tokio::test]
async fn a_task_taken_once_cannot_be_taken_again_and_a_failure_keeps_its_code() {
    let server = server();
    let serve = |a: chorus_sdk::Agent| async move {
        a.on_task("flaky", |_task: TaskContext, n: u32| async move {
            if n == 0 {
                Err::<u32, _>(HandlerError::invalid_argument("zero is not allowed"))
            } else {
                Ok(n)
            }
        })
        .await
        .expect("serve the task");
        a
    };
    let one = serve(agent(&server, "one").await).await;
    let two = serve(agent(&server, "two").await).await;
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::agent("one", "flaky")
                .payload(&0u32)
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    let report = within(WAIT, "result", task.result()).await.expect("result");
    assert_eq!(report.state, TaskState::Failed);
    assert_eq!(report.status, StatusCode::INVALID_ARGUMENT);
    assert_eq!(report.reason.as_deref(), Some("zero is not allowed"));

    // The recorded submission sent again, to another agent: the task is no longer
    // `submitted`, so taking it is refused with 5024 and nothing runs.
    let submission = task
        .updates_after(0)
        .await
        .expect("follow the task")
        .next()
        .await
        .expect("follow the task")
        .expect("an update")
        .envelope;
    let raw = chorus_tests::raw_broker(&server).await;
    let bytes =
        chorus_sdk::codec::encode(&submission, chorus_sdk::Encoding::MsgPack).expect("encode");
    let reply = raw
        .request("chorus.agent.two.flaky", None, bytes, WAIT)
        .await
        .expect("raw request");
    let (reply, _) = chorus_sdk::codec::decode(reply.payload()).expect("the reply decodes");
    assert_eq!(reply.status, Some(StatusCode::TASK_STATE));
    assert_eq!(task.state().await.expect("state"), TaskState::Failed);
    drop((one, two));
}

#[tokio::test]
async fn a_cancel_reaches_a_working_handler_within_100_ms() {
    let server = server();
    let worker = agent(&server, "slow").await;
    let seen: Arc<Mutex<Option<(Instant, TaskStop)>>> = Arc::default();
    let slot = Arc::clone(&seen);
    worker
        .on_task("wait", move |task: TaskContext, (): ()| {
            let slot = Arc::clone(&slot);
            async move {
                let why = task.cancelled().await;
                *slot.lock().expect("lock") = Some((Instant::now(), why));
                Err::<(), _>(HandlerError::new(StatusCode::CANCELLED, "stopped"))
            }
        })
        .await
        .expect("lock");
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::agent("slow", "wait")
                .payload(&())
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    until_state(&task, TaskState::Working).await;
    let sent = Instant::now();
    let report = within(WAIT, "cancel", task.cancel()).await.expect("cancel");
    let (heard, why) = seen
        .lock()
        .expect("lock")
        .expect("the handler saw the cancel");
    let latency = heard.duration_since(sent);
    assert_eq!(why, TaskStop::Cancelled);
    assert!(
        latency < Duration::from_millis(100),
        "cancel took {latency:?}"
    );
    assert_eq!(report.state, TaskState::Cancelled);
    assert_eq!(report.status, StatusCode::CANCELLED);
    assert_eq!(report.attempts[0].agent, "slow");
}

#[tokio::test]
async fn a_handler_that_ignores_a_cancel_is_stopped_after_the_grace() {
    let server = server();
    let worker = agent(&server, "stubborn").await;
    worker
        .on_task("hang", |_task: TaskContext, (): ()| async move {
            std::future::pending::<()>().await;
            Ok(())
        })
        .await
        .expect("serve the task");
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::agent("stubborn", "hang")
                .payload(&())
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    until_state(&task, TaskState::Working).await;
    let report = within(WAIT, "cancel", task.cancel()).await.expect("cancel");
    assert_eq!(report.state, TaskState::Cancelled);
    // The worker confirmed it (not the requester in its place).
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    let last = updates.last().expect("an update");
    assert_eq!(last.state(), Some(TaskState::Cancelled));
    assert_eq!(last.from(), "stubborn");
}

#[tokio::test]
async fn input_required_is_answered_by_the_requester_and_the_work_goes_on() {
    let server = server();
    let worker = agent(&server, "converter").await;
    worker
        .on_task("convert", |task: TaskContext, celsius: f64| async move {
            let unit: String = task.ask("which unit?", &["F", "K"]).await?;
            Ok(match unit.as_str() {
                "F" => celsius * 9.0 / 5.0 + 32.0,
                _ => celsius + 273.15,
            })
        })
        .await
        .expect("ok");
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::agent("converter", "convert")
                .payload(&100.0)
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    let question = until_state(&task, TaskState::InputRequired).await;
    assert_eq!(question.text(), Some("which unit?"));
    assert_eq!(
        question
            .payload_as::<Vec<String>>()
            .expect("payload decodes"),
        ["F", "K"]
    );
    task.respond(&"F").await.expect("respond");
    let report = within(WAIT, "result", task.result()).await.expect("result");
    assert_eq!(report.output_as::<f64>().expect("output decodes"), 212.0);
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    assert_eq!(
        states(&updates),
        [
            TaskState::Submitted,
            TaskState::Accepted,
            TaskState::Working,
            TaskState::InputRequired,
            TaskState::Working,
            TaskState::Completed
        ]
    );
}

#[tokio::test]
async fn a_deadline_expires_the_task_on_both_sides() {
    let server = server();
    let worker = agent(&server, "late").await;
    let seen: Arc<Mutex<Option<TaskStop>>> = Arc::default();
    let slot = Arc::clone(&seen);
    worker
        .on_task("think", move |task: TaskContext, (): ()| {
            let slot = Arc::clone(&slot);
            async move {
                let why = task.cancelled().await;
                *slot.lock().expect("lock") = Some(why);
                Ok(())
            }
        })
        .await
        .expect("lock");
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::agent("late", "think")
                .payload(&())
                .expect("payload encodes")
                .deadline(Duration::from_millis(300)),
        )
        .await
        .expect("submit");
    let report = within(WAIT, "result", task.result()).await.expect("result");
    assert_eq!(report.state, TaskState::Expired);
    assert_eq!(report.status, StatusCode::EXPIRED);
    // The worker's handler was told, and the worker recorded it.
    assert_eq!(*seen.lock().expect("lock"), Some(TaskStop::Expired));
    assert_eq!(report.attempts[0].state, TaskState::Expired);
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    assert_eq!(updates.last().expect("an update").from(), "late");
}

#[tokio::test]
async fn a_worker_that_dies_leaves_the_expiry_to_the_requester() {
    let server = server();
    let mut worker = CrashableAgent::start(agent_options(&server, "fragile"), |a| async move {
        a.on_task("think", |_task: TaskContext, (): ()| async move {
            std::future::pending::<()>().await;
            Ok(())
        })
        .await
        .expect("serve the task");
    });
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::agent("fragile", "think")
                .payload(&())
                .expect("payload encodes")
                .deadline(Duration::from_millis(500)),
        )
        .await
        .expect("submit");
    until_state(&task, TaskState::Working).await;
    worker.crash();
    let report = within(WAIT, "result", task.result()).await.expect("result");
    assert_eq!(report.state, TaskState::Expired);
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    assert_eq!(updates.last().expect("an update").from(), "boss");
}

#[tokio::test]
async fn a_stream_of_10000_chunks_survives_a_requester_restart_midway() {
    const CHUNKS: u64 = 10_000;
    let server = server();
    let worker = agent(&server, "model").await;
    worker
        .on_task("tokens", |task: TaskContext, n: u64| async move {
            for i in 1..n {
                task.chunk(&format!("token {i}")).await?;
            }
            task.last_chunk(&format!("token {n}")).await?;
            Ok(n)
        })
        .await
        .expect("serve the task");
    let first = agent(&server, "reader").await;
    let task = first
        .submit(
            Call::agent("model", "tokens")
                .payload(&CHUNKS)
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    let id = task.id();
    let mut chunks = Vec::new();
    let mut updates = task.updates().await.expect("follow the task");
    within(WAIT, "the first 4,000 chunks", async {
        while chunks.len() < 4_000 {
            let update = updates.next().await.expect("an update").expect("an update");
            if let Some(n) = update.chunk() {
                assert_eq!(
                    update.payload_as::<String>().expect("payload decodes"),
                    format!("token {n}")
                );
                chunks.push(n);
            }
        }
    })
    .await;
    let resume_after = task.last_seen();
    drop(updates);
    first.shutdown().await;

    // Another process, knowing only the id and the last sequence it saw.
    let second = agent(&server, "reader").await;
    let task = second.task(id).await.expect("look the task up");
    let rest = within(
        Duration::from_secs(120),
        "the rest of the chunks",
        task.updates_after(resume_after)
            .await
            .expect("follow the task")
            .map(|u| u.expect("follow the task"))
            .collect::<Vec<_>>(),
    )
    .await;
    let mut last = false;
    for update in &rest {
        if let Some(n) = update.chunk() {
            chunks.push(n);
            last = update.is_last_chunk();
        }
    }
    assert!(last, "the final chunk is marked");
    let expected: Vec<u64> = (1..=CHUNKS).collect();
    assert_eq!(chunks.len(), expected.len(), "no gap, no duplicate");
    assert_eq!(chunks, expected);
    let report = task.result().await.expect("result");
    assert_eq!(report.output_as::<u64>().expect("output decodes"), CHUNKS);
}

#[tokio::test]
async fn a_requester_killed_while_its_task_runs_finds_it_and_gets_the_result() {
    let server = server();
    let worker = agent(&server, "worker").await;
    let (release_tx, release_rx) = tokio::sync::watch::channel(false);
    worker
        .on_task("job", move |_task: TaskContext, x: u32| {
            let mut release = release_rx.clone();
            async move {
                release
                    .wait_for(|go| *go)
                    .await
                    .map_err(|_| HandlerError::failed("released nothing"))?;
                Ok(x * 2)
            }
        })
        .await
        .expect("ok");
    let (id_tx, id_rx) = std::sync::mpsc::channel();
    let options = agent_options(&server, "asker");
    // Started off this runtime, which must keep serving the worker meanwhile.
    let id = tokio::task::spawn_blocking(move || {
        let mut requester = CrashableAgent::start(options, move |a| async move {
            let task = a
                .submit(
                    Call::agent("worker", "job")
                        .payload(&21u32)
                        .expect("payload encodes"),
                )
                .await
                .expect("submit");
            id_tx.send(task.id()).expect("send");
        });
        let id = id_rx
            .recv_timeout(WAIT)
            .expect("task id from the requester");
        requester.crash();
        id
    })
    .await
    .expect("task id from the requester");
    release_tx.send(true).expect("send");

    let again = agent(&server, "asker").await;
    let task = again.task(id).await.expect("look the task up");
    let report = within(WAIT, "result", task.result()).await.expect("result");
    assert_eq!(report.output_as::<u32>().expect("output decodes"), 42);
    assert_eq!(report.requester, "asker");
}

#[tokio::test]
async fn a_task_nobody_serves_is_rejected_and_on_record_and_an_unknown_id_is_not_found() {
    let server = server();
    let boss = agent(&server, "boss").await;
    let err = boss
        .submit(
            Call::agent("nobody", "job")
                .payload(&1)
                .expect("payload encodes")
                .timeout(Duration::from_secs(2)),
        )
        .await
        .expect_err("should fail");
    assert!(matches!(err, SdkError::NoResponders(_)), "{err}");
    let listed = boss.tasks(10).await.expect("list tasks");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].state, TaskState::Rejected);
    let missing = uuid::Uuid::now_v7();
    assert!(matches!(
        boss.task(missing).await.expect_err("should fail"),
        SdkError::TaskNotFound(id) if id == missing
    ));
}

#[tokio::test]
async fn a_task_to_a_capability_is_taken_by_one_of_its_holders() {
    let server = server();
    let mut holders = Vec::new();
    for id in ["ocr-1", "ocr-2"] {
        let a = agent(&server, id).await;
        a.on_task_capability("text.ocr", |task: TaskContext, page: String| async move {
            Ok(format!("{} read {page}", task.agent_id()))
        })
        .await
        .expect("serve the capability");
        holders.push(a);
    }
    let boss = agent(&server, "boss").await;
    let task = boss
        .submit(
            Call::capability("text.ocr")
                .payload(&"page 1")
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    let report = within(WAIT, "result", task.result()).await.expect("result");
    let text: String = report.output_as().expect("output decodes");
    assert!(text.ends_with("read page 1"), "{text}");
    assert!(text.starts_with(&report.attempts[0].agent), "{text}");
    assert_eq!(report.target, "text.ocr");
}

/// On a server whose users are the entries `chorus creds --tasks` makes, a task runs end to
/// end: submitted, a question answered, progress, a cancel heard by the worker.
#[tokio::test]
async fn tasks_work_under_per_agent_credentials() {
    use chorus_broker_adapter::{BrokerOptions, Credentials};
    use chorus_coordinator::creds::{Role, authorization_entry};
    use chorus_sdk::security::Identity;
    let subjects = chorus_sdk::Subjects::default();
    let (worker_key, boss_key) = (Identity::generate(), Identity::generate());
    let entry = |agent: &str, calls: Vec<String>, key: &Identity| {
        authorization_entry(
            &subjects,
            &Role {
                agent: agent.into(),
                calls,
                tasks: true,
                ..Role::default()
            },
            &key.public_key(),
        )
        .expect("entry")
    };
    let users = [
        entry("worker", vec!["agent:nobody".into()], &worker_key),
        entry("boss", vec!["agent:worker".into()], &boss_key),
    ]
    .join("\n");
    let dir = tempfile::tempdir().expect("tempdir");
    let server = chorus_tests::server_with_users(dir.path(), &users);
    let connect = |id: &'static str, key: &Identity| {
        agent_options(&server, id)
            .broker(
                BrokerOptions::new([server.url()])
                    .credentials(Credentials::NKeySeed(key.seed().expect("seed"))),
            )
            .connect()
    };
    let worker = connect("worker", &worker_key)
        .await
        .expect("worker connects");
    worker
        .on_task("plan", |task: TaskContext, (): ()| async move {
            let days: u32 = task.ask("how many days?", &()).await?;
            task.progress(Some(0.5), format!("planning {days} days"))
                .await?;
            task.cancelled().await;
            Ok(days)
        })
        .await
        .expect("serve the task");
    let boss = connect("boss", &boss_key).await.expect("boss connects");
    let task = boss
        .submit(
            Call::agent("worker", "plan")
                .payload(&())
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    until_state(&task, TaskState::InputRequired).await;
    task.respond(&3u32).await.expect("respond");
    let mut updates = task.updates_after(0).await.expect("follow the task");
    within(WAIT, "progress", async {
        while let Some(update) = updates.next().await {
            if update.expect("an update").text() == Some("planning 3 days") {
                break;
            }
        }
    })
    .await;
    let report = within(WAIT, "cancel", task.cancel()).await.expect("cancel");
    assert_eq!(report.state, TaskState::Cancelled);
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    assert_eq!(updates.last().expect("an update").from(), "worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_submits_lists_shows_watches_and_cancels_tasks() {
    let server = server();
    let worker = agent(&server, "counter").await;
    worker
        .on_task("count", |task: TaskContext, n: u32| async move {
            for i in 1..=n {
                task.progress(Some(i as f32 / n as f32), format!("step {i}"))
                    .await?;
                task.chunk(&i).await?;
            }
            Ok(n)
        })
        .await
        .expect("serve the task");
    worker
        .on_task("hang", |task: TaskContext, (): ()| async move {
            task.cancelled().await;
            Ok(())
        })
        .await
        .expect("serve the task");

    let (ok, out, err) = chorus_tests::run_chorus(
        &server,
        &[
            "task",
            "submit",
            "--to",
            "counter",
            "--command",
            "count",
            "3",
            "--watch",
        ],
    )
    .await;
    assert!(ok, "{out}{err}");
    let id = out.lines().next().expect("the id first").trim().to_owned();
    uuid::Uuid::parse_str(&id).expect("a task id");
    for expected in [
        "submitted",
        "accepted",
        "working",
        "step 2",
        "#3 3",
        "completed (5002 ok) 3",
    ] {
        assert!(out.contains(expected), "{expected:?} in {out}");
    }

    let (ok, out, err) = chorus_tests::run_chorus(&server, &["task", "ls", "--json"]).await;
    assert!(ok, "{err}");
    let list: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(list[0]["id"], id.as_str());
    assert_eq!(list[0]["state"], "completed");

    let (ok, out, err) = chorus_tests::run_chorus(&server, &["task", "show", &id, "--json"]).await;
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(report["state"], "completed");
    assert_eq!(report["output"], 3);
    assert_eq!(report["attempts"][0]["agent"], "counter");
    assert_eq!(report["target"], "counter.count");

    let (ok, out, err) = chorus_tests::run_chorus(
        &server,
        &["task", "submit", "--to", "counter", "--command", "hang"],
    )
    .await;
    assert!(ok, "{err}");
    let hung = out.trim().to_owned();
    let (ok, out, err) = chorus_tests::run_chorus(&server, &["task", "cancel", &hung]).await;
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("state     cancelled (5020 cancelled)"),
        "{out}"
    );
    let (ok, out, _) = chorus_tests::run_chorus(&server, &["task", "watch", &hung]).await;
    assert!(!ok, "a task that did not complete exits 1");
    assert!(out.contains("cancel requested"), "{out}");
    let (ok, out, _) =
        chorus_tests::run_chorus(&server, &["task", "ls", "--state", "cancelled"]).await;
    assert!(ok && out.contains(&hung) && !out.contains(&id), "{out}");

    let missing = uuid::Uuid::now_v7().to_string();
    let (ok, _, err) = chorus_tests::run_chorus(&server, &["task", "show", &missing]).await;
    assert!(!ok);
    assert!(
        err.contains(&format!("no task {missing} is recorded")),
        "{err}"
    );
    let (ok, _, err) =
        chorus_tests::run_chorus(&server, &["task", "ls", "--state", "sleeping"]).await;
    assert!(!ok && err.contains("not a task state"), "{err}");
}

#[derive(Debug, Serialize, Deserialize)]
struct Summary {
    summary: String,
}

/// The summary every verified-summary test expects: one that passes [`summary_schema`].
const PASSING_SUMMARY: &str = "a summary long enough to pass";

/// Serves `summarize` on `id`, answering with `text`: as a capability when `capability`,
/// else as a task (a command) of its own.
async fn summarizer(
    server: &chorus_tests::NatsServer,
    id: &str,
    text: &'static str,
    capability: bool,
) -> chorus_sdk::Agent {
    let a = agent(server, id).await;
    let answer = move |_task: TaskContext, _doc: String| async move {
        Ok(Summary {
            summary: text.to_owned(),
        })
    };
    if capability {
        a.on_task_capability("summarize", answer).await
    } else {
        a.on_task("summarize", answer).await
    }
    .expect("serve summarize");
    a
}

/// A summary of at least 10 characters.
fn summary_schema() -> serde_json::Value {
    serde_json::json!({
        "type": "object",
        "required": ["summary"],
        "properties": {"summary": {"type": "string", "minLength": 10}}
    })
}

/// Submits a long document to `call` as a task whose result `boss` verifies.
async fn submit_summary(boss: &chorus_sdk::Agent, call: Call) -> chorus_sdk::TaskHandle {
    boss.submit_verified(call.payload(&"a long document").expect("payload encodes"))
        .await
        .expect("submit")
}

/// Verifies `task` by `verification` and checks that it completed with [`PASSING_SUMMARY`].
async fn passing_summary(
    boss: &chorus_sdk::Agent,
    task: &chorus_sdk::TaskHandle,
    verification: &chorus_sdk::task::Verification,
) -> chorus_sdk::TaskReport {
    let report = within(WAIT, "verified result", boss.verify(task, verification))
        .await
        .expect("verify");
    assert_eq!(report.state, TaskState::Completed, "{report:?}");
    assert_eq!(
        report
            .output_as::<Summary>()
            .expect("output decodes")
            .summary,
        PASSING_SUMMARY
    );
    report
}

/// Each attempt's agent and verdict, in order.
fn turns(report: &chorus_sdk::TaskReport) -> Vec<(&str, Option<bool>)> {
    report
        .attempts
        .iter()
        .map(|a| (a.agent.as_str(), a.verified))
        .collect()
}

#[tokio::test]
async fn a_result_that_fails_verification_is_reassigned_to_another_holder_and_the_report_lists_both()
 {
    let server = server();
    let coordinator = chorus_tests::coordinator(&server, false).await;
    let _sloppy = summarizer(&server, "sloppy", "short", true).await;
    let _careful = summarizer(&server, "careful", PASSING_SUMMARY, true).await;
    let boss = agent(&server, "boss").await;
    chorus_tests::eventually(WAIT, "both holders registered", || async {
        let holders = boss.discover_capability("summarize").await.ok()?;
        (holders.len() == 2).then_some(())
    })
    .await;
    let verification =
        chorus_sdk::task::Verification::schema(&summary_schema()).expect("schema compiles");
    // The first attempt goes to the sloppy holder.
    let task = submit_summary(&boss, Call::capability_at("sloppy", "summarize")).await;
    let report = passing_summary(&boss, &task, &verification).await;
    assert_eq!(
        turns(&report),
        [("sloppy", Some(false)), ("careful", Some(true))]
    );
    let verdict = report.attempts[0].note.as_deref().expect("a verdict");
    assert!(verdict.contains("does not meet the schema"), "{verdict}");
    assert!(verdict.contains("reassigned to careful"), "{verdict}");
    // Each step is a message of the task.
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    assert_eq!(
        states(&updates),
        [
            TaskState::Submitted,
            TaskState::Accepted,
            TaskState::Working,
            TaskState::Submitted,
            TaskState::Accepted,
            TaskState::Working,
            TaskState::Completed
        ]
    );
    assert_eq!(
        updates
            .iter()
            .filter(|u| u.kind == TaskMessage::Report)
            .count(),
        2
    );
    coordinator.shutdown().await;
}

#[tokio::test]
async fn with_only_failing_agents_verification_stops_at_the_limit_with_a_failure_report() {
    let server = server();
    let mut agents = Vec::new();
    for id in ["first", "second", "judge-pool"] {
        let a = agent(&server, id).await;
        a.on_task("answer", |task: TaskContext, (): ()| async move {
            Ok(format!("wrong answer from {}", task.agent_id()))
        })
        .await
        .expect("serve the task");
        agents.push(a);
    }
    // A supervisor agent judges: only "42" passes.
    let judge = agent(&server, "judge").await;
    judge
        .on_command(
            "check",
            |_ctx: chorus_sdk::Context, answer: String| async move {
                if answer == "42" {
                    Ok(())
                } else {
                    Err(HandlerError::invalid_argument(format!(
                        "{answer:?} is not 42"
                    )))
                }
            },
        )
        .await
        .expect("serve the check");
    let boss = agent(&server, "boss").await;
    let verification = chorus_sdk::task::Verification::agent("judge", "check")
        .retries(1)
        .candidates(["second"])
        .max_attempts(4);
    let task = boss
        .submit_verified(
            Call::agent("first", "answer")
                .payload(&())
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    let report = within(WAIT, "verification", boss.verify(&task, &verification))
        .await
        .expect("verify");
    assert_eq!(report.state, TaskState::Failed);
    assert_eq!(report.status, StatusCode::UNVERIFIED);
    // One retry on the same agent, then the candidate, then its own retry: four, the limit.
    let turns: Vec<_> = report.attempts.iter().map(|a| a.agent.as_str()).collect();
    assert_eq!(turns, ["first", "first", "second", "second"]);
    let reason = report.reason.as_deref().expect("a reason");
    assert!(reason.contains("in 4 attempts"), "{reason}");
    assert!(
        reason.contains("\"wrong answer from second\" is not 42"),
        "{reason}"
    );
    assert!(
        report
            .attempts
            .iter()
            .all(|a| a.verified == Some(false) || a.agent == "second")
    );

    // Verifying again (a requester that restarted) finds the task over and changes nothing.
    let again = within(WAIT, "verify again", boss.verify(&task, &verification))
        .await
        .expect("verify again");
    assert_eq!(again.state, TaskState::Failed);
    assert_eq!(again.last_seq, report.last_seq);
}

#[tokio::test]
async fn a_result_that_fails_verification_is_escalated_to_the_supervisor_once_the_candidates_failed()
 {
    let server = server();
    let _drafter = summarizer(&server, "drafter", "short", false).await;
    let _second = summarizer(&server, "second-drafter", "brief", false).await;
    let _editor = summarizer(&server, "editor", PASSING_SUMMARY, false).await;
    let boss = agent(&server, "boss").await;
    // The supervisor among the candidates is not asked as one: it comes last, as the supervisor.
    let verification = chorus_sdk::task::Verification::schema(&summary_schema())
        .expect("schema compiles")
        .candidates(["editor", "second-drafter"])
        .escalate_to("editor");
    let task = submit_summary(&boss, Call::agent("drafter", "summarize")).await;
    let report = passing_summary(&boss, &task, &verification).await;
    assert_eq!(
        turns(&report),
        [
            ("drafter", Some(false)),
            ("second-drafter", Some(false)),
            ("editor", Some(true))
        ]
    );
    let verdict = report.attempts[1].note.as_deref().expect("a verdict");
    assert!(verdict.contains("does not meet the schema"), "{verdict}");
    assert!(verdict.ends_with("; reassigned to editor"), "{verdict}");
    // Each attempt is a submission of its own, to that agent alone, by the requester.
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    let submissions: Vec<_> = updates
        .iter()
        .filter(|u| u.state() == Some(TaskState::Submitted))
        .map(|u| (u.from().to_owned(), u.envelope.to.clone()))
        .collect();
    assert_eq!(
        submissions,
        [
            ("boss".to_owned(), vec!["drafter".to_owned()]),
            ("boss".to_owned(), vec!["second-drafter".to_owned()]),
            ("boss".to_owned(), vec!["editor".to_owned()]),
        ]
    );

    // A supervisor whose result fails too is asked once: the task fails with 5025 and the
    // chain of verdicts, within the limit of attempts.
    let strict = chorus_sdk::task::Verification::schema(&serde_json::json!({"const": "never"}))
        .expect("schema compiles")
        .escalate_to("editor")
        .max_attempts(5);
    let task = submit_summary(&boss, Call::agent("drafter", "summarize")).await;
    let report = within(WAIT, "verification", boss.verify(&task, &strict))
        .await
        .expect("verify");
    assert_eq!(report.state, TaskState::Failed);
    assert_eq!(report.status, StatusCode::UNVERIFIED);
    let turns: Vec<_> = report.attempts.iter().map(|a| a.agent.as_str()).collect();
    assert_eq!(turns, ["drafter", "editor"]);
    let reason = report.reason.as_deref().expect("a reason");
    assert!(reason.contains("in 2 attempts"), "{reason}");
    assert!(
        reason.contains("attempt 2 by editor: does not meet the schema"),
        "{reason}"
    );
}

#[tokio::test]
async fn a_handoff_from_a_to_b_while_the_requester_watches_gives_one_handle_and_one_result() {
    let server = server();
    let front = agent(&server, "front-desk").await;
    front
        .on_task("ticket", |task: TaskContext, issue: String| async move {
            task.progress(Some(0.2), "triaged").await?;
            task.handoff(
                Call::agent("specialist", "ticket")
                    .payload(&format!("{issue} (triaged: network)"))?,
            )
            .await?;
            Ok("not recorded".to_owned())
        })
        .await
        .expect("serve the task");
    let specialist = agent(&server, "specialist").await;
    specialist
        .on_task("ticket", |task: TaskContext, context: String| async move {
            task.progress(Some(0.9), "fixing").await?;
            Ok(format!("fixed: {context}"))
        })
        .await
        .expect("serve the task");
    let customer = agent(&server, "customer").await;
    let task = customer
        .submit(
            Call::agent("front-desk", "ticket")
                .payload(&"wifi down")
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    let updates = collect(task.updates().await.expect("follow the task")).await;
    let steps: Vec<_> = updates
        .iter()
        .filter_map(|u| u.state().map(|s| (s, u.from().to_owned())))
        .collect();
    assert_eq!(
        steps,
        [
            (TaskState::Submitted, "customer".to_owned()),
            (TaskState::Accepted, "front-desk".to_owned()),
            (TaskState::Working, "front-desk".to_owned()),
            (TaskState::Working, "specialist".to_owned()),
            (TaskState::Completed, "specialist".to_owned()),
        ]
    );
    let report = within(WAIT, "result", task.result()).await.expect("result");
    assert_eq!(
        report.output_as::<String>().expect("output decodes"),
        "fixed: wifi down (triaged: network)"
    );
    let turns: Vec<_> = report
        .attempts
        .iter()
        .map(|a| (a.agent.as_str(), a.state))
        .collect();
    assert_eq!(
        turns,
        [
            ("front-desk", TaskState::Working),
            ("specialist", TaskState::Completed)
        ]
    );
    assert_eq!(
        report.attempts[0].note.as_deref(),
        Some("handed off by front-desk")
    );

    // Only the agent working on a task may hand it on.
    let intruder = agent(&server, "intruder").await;
    let err = intruder
        .call(
            Call::agent("specialist", "ticket")
                .payload(&"mine now")
                .expect("payload encodes"),
        )
        .await
        .expect_err("a plain call is not a task");
    assert_eq!(err.status(), StatusCode::INVALID_ARGUMENT, "{err}");
}

#[tokio::test]
async fn a_worker_gone_without_a_goodbye_fails_its_task_without_a_deadline() {
    let server = server();
    let coordinator = chorus_tests::coordinator(&server, false).await;
    let mut worker = CrashableAgent::start(
        agent_options(&server, "vanishing").heartbeat_interval(Duration::from_millis(300)),
        |a| async move {
            a.on_task("think", |_task: TaskContext, (): ()| async move {
                std::future::pending::<()>().await;
                Ok(())
            })
            .await
            .expect("serve the task");
        },
    );
    let boss = agent(&server, "boss").await;
    chorus_tests::eventually(WAIT, "the worker registered", || async {
        let live = boss
            .discover(&chorus_sdk::DiscoverQuery::default())
            .await
            .ok()?;
        live.iter()
            .any(|r| r.manifest.agent == "vanishing")
            .then_some(())
    })
    .await;
    // No deadline: only the registry can tell that nobody will finish it.
    let task = boss
        .submit(
            Call::agent("vanishing", "think")
                .payload(&())
                .expect("payload encodes"),
        )
        .await
        .expect("submit");
    until_state(&task, TaskState::Working).await;
    let waiting = tokio::spawn({
        let task = task.clone();
        async move { task.result().await }
    });
    worker.crash();
    let report = within(WAIT, "the task to fail", waiting)
        .await
        .expect("join")
        .expect("result");
    assert_eq!(report.state, TaskState::Failed);
    assert_eq!(report.status, StatusCode::UNEXPECTED_DISCONNECT);
    assert_eq!(
        report.reason.as_deref(),
        Some("vanishing left without finishing the task")
    );
    coordinator.shutdown().await;
}

/// What the agents of an escalation saw: each `summarize` asked of the worker and of the
/// supervisor, with the document and the application headers it came with.
type Asked = Arc<Mutex<Vec<(String, String, std::collections::BTreeMap<String, String>)>>>;

/// Serves `summarize` on `id`, answering `text` and recording each time it is asked in `asked`.
async fn recording_summarizer(
    server: &chorus_tests::NatsServer,
    id: &str,
    text: &'static str,
    asked: &Asked,
) -> chorus_sdk::Agent {
    let a = agent(server, id).await;
    let asked = Arc::clone(asked);
    a.on_task("summarize", move |task: TaskContext, doc: String| {
        asked
            .lock()
            .expect("lock")
            .push((task.agent_id().to_owned(), doc, task.headers().clone()));
        async move {
            Ok(Summary {
                summary: text.to_owned(),
            })
        }
    })
    .await
    .expect("serve summarize");
    a
}

#[tokio::test]
async fn a_worker_that_fails_verification_its_allowed_retries_is_escalated_to_the_supervisor_who_completes_it()
 {
    let server = server();
    let asked: Asked = Arc::default();
    let _drafter = recording_summarizer(&server, "drafter", "short", &asked).await;
    let _chief = recording_summarizer(&server, "chief", PASSING_SUMMARY, &asked).await;
    let boss = agent(&server, "boss").await;
    // The worker gets two more tries after its first failure, then the supervisor: four attempts.
    let verification = chorus_sdk::task::Verification::schema(&summary_schema())
        .expect("schema compiles")
        .retries(2)
        .escalate_to("chief")
        .max_attempts(4);
    let task = submit_summary(
        &boss,
        Call::agent("drafter", "summarize").header("x-ticket", "T-9"),
    )
    .await;
    let report = passing_summary(&boss, &task, &verification).await;
    assert_eq!(
        (report.status, report.requester.as_str()),
        (StatusCode::OK, "boss")
    );
    assert_eq!(
        turns(&report),
        [
            ("drafter", Some(false)),
            ("drafter", Some(false)),
            ("drafter", Some(false)),
            ("chief", Some(true)),
        ]
    );
    assert!(report.attempts.iter().all(|a| a.ended_ms.is_some()));
    // Each failed attempt's note is its verdict and who got the task next.
    let notes: Vec<_> = report
        .attempts
        .iter()
        .map(|a| a.note.as_deref().unwrap_or_default())
        .collect();
    for (note, next) in notes.iter().zip(["drafter", "drafter", "chief"]) {
        assert!(note.starts_with("does not meet the schema"), "{note}");
        assert!(note.ends_with(&format!("; reassigned to {next}")), "{note}");
    }
    // The supervisor was asked once, after the worker's three tries, with the submission as it
    // was: the same document and the requester's headers.
    let header = std::collections::BTreeMap::from([("x-ticket".to_owned(), "T-9".to_owned())]);
    let seen = asked.lock().expect("lock").clone();
    let expected: Vec<_> = ["drafter", "drafter", "drafter", "chief"]
        .into_iter()
        .map(|a| (a.to_owned(), "a long document".to_owned(), header.clone()))
        .collect();
    assert_eq!(seen, expected);
    // Every new attempt is a `submitted` from the requester, to that agent alone, and the
    // requester writes `completed` with the supervisor's output.
    let updates = collect(task.updates_after(0).await.expect("follow the task")).await;
    let submissions: Vec<_> = updates
        .iter()
        .filter(|u| u.state() == Some(TaskState::Submitted))
        .map(|u| {
            (
                u.from().to_owned(),
                u.envelope.to.clone(),
                u.envelope.headers.clone(),
            )
        })
        .collect();
    let to = |a: &str| ("boss".to_owned(), vec![a.to_owned()], header.clone());
    assert_eq!(
        submissions,
        [to("drafter"), to("drafter"), to("drafter"), to("chief")]
    );
    let last = updates.last().expect("updates");
    assert_eq!(
        (last.state(), last.from()),
        (Some(TaskState::Completed), "boss")
    );

    // With one attempt fewer allowed, the worker's tries use them all: the supervisor is never
    // asked and the task fails with 5025 and the chain of verdicts.
    asked.lock().expect("lock").clear();
    let task = submit_summary(&boss, Call::agent("drafter", "summarize")).await;
    let report = within(
        WAIT,
        "verification",
        boss.verify(&task, &verification.max_attempts(3)),
    )
    .await
    .expect("verify");
    assert_eq!(
        (report.state, report.status),
        (TaskState::Failed, StatusCode::UNVERIFIED)
    );
    let turns: Vec<_> = report.attempts.iter().map(|a| a.agent.as_str()).collect();
    assert_eq!(turns, ["drafter", "drafter", "drafter"]);
    let reason = report.reason.as_deref().expect("a reason");
    assert!(
        reason.starts_with("no result passed verification in 3 attempts: attempt 1 by drafter"),
        "{reason}"
    );
    let asked: Vec<_> = asked
        .lock()
        .expect("lock")
        .iter()
        .map(|a| a.0.clone())
        .collect();
    assert_eq!(asked, ["drafter", "drafter", "drafter"]);
}
