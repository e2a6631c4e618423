//! `chorus task submit | ls | show | watch | cancel | respond`: tasks from the command line.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::{parse_duration, parse_timeout};
use chorus_sdk::task::TaskMessage;
use chorus_sdk::{Call, TaskReport, TaskState, TaskUpdate};
use clap::Subcommand;
use futures::StreamExt;
use serde_json::{Value, json};

use super::{ConnectionArgs, check_payload_size, parse_json, print_json};

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    action: Action,
    /// Print JSON: `ls` one array, `show` and `cancel` one report, `watch` one line per update.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Submit a task to an agent (--to, --command) or a capability, print its id, and (with
    /// --watch) follow it to its end.
    #[command(group(clap::ArgGroup::new("target").required(true).args(["to", "capability"])))]
    Submit {
        /// Agent to give it to.
        #[arg(long, requires = "command", conflicts_with = "capability")]
        to: Option<String>,
        /// The task's name (the command the agent serves it under).
        #[arg(long, requires = "to")]
        command: Option<String>,
        /// Capability to give it to (one of its holders takes it).
        #[arg(long)]
        capability: Option<String>,
        /// The input, as JSON (default: null); `-` reads standard input, `@file` a file.
        #[arg(value_name = "PAYLOAD")]
        payload: Option<String>,
        /// The task's deadline from now (`30s`, `10m`); past it the task expires.
        #[arg(long, value_parser = parse_duration)]
        deadline: Option<Duration>,
        /// How long to wait for an agent to take it.
        #[arg(long, default_value = "5s", value_parser = parse_timeout)]
        timeout: Duration,
        /// Follow it to its end, as `watch` does.
        #[arg(long)]
        watch: bool,
    },
    /// List tasks with their latest state, oldest change first.
    Ls {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        max: usize,
        /// Only tasks in this state (submitted, accepted, working, input_required, completed,
        /// failed, cancelled, rejected, expired).
        #[arg(long)]
        state: Option<String>,
    },
    /// Print a task's report: state, code, requester, target, attempts, result.
    Show {
        /// The task's id.
        #[arg(value_parser = task_id)]
        id: uuid::Uuid,
    },
    /// Print a task's updates as they come (states, progress, chunks, questions) until it
    /// ends; exits 0 if it completed, 4 otherwise.
    Watch {
        /// The task's id.
        #[arg(value_parser = task_id)]
        id: uuid::Uuid,
        /// Start after this stream sequence (the `seq` of the last update seen).
        #[arg(long, default_value_t = 0)]
        after: u64,
    },
    /// Cancel a task and print its report once it has stopped.
    Cancel {
        /// The task's id.
        #[arg(value_parser = task_id)]
        id: uuid::Uuid,
    },
    /// Answer the question of a task that is input_required.
    Respond {
        /// The task's id.
        #[arg(value_parser = task_id)]
        id: uuid::Uuid,
        /// The answer, as JSON; `-` reads standard input, `@file` a file.
        #[arg(value_name = "PAYLOAD")]
        payload: Option<String>,
    },
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let agent = conn.agent().await?;
    let json = args.json;
    let code = match args.action {
        Action::Submit {
            to,
            command,
            capability,
            payload,
            deadline,
            timeout,
            watch,
        } => {
            let payload = parse_json(payload.as_deref())?;
            check_payload_size(&payload)?;
            let call = match (to, command, capability) {
                (Some(to), Some(command), _) => Call::agent(to, command),
                (_, _, Some(capability)) => Call::capability(capability),
                _ => anyhow::bail!("give --to with --command, or --capability"),
            };
            let mut call = call.json_payload(&payload)?.timeout(timeout);
            if let Some(deadline) = deadline {
                call = call.deadline(deadline);
            }
            let task = agent.submit(call).await?;
            if json && !watch {
                print_json(&json!({ "id": task.id() }))?;
            } else {
                outln!("{}", task.id());
            }
            if watch {
                follow(&task, 0, json).await?
            } else {
                ExitCode::SUCCESS
            }
        }
        Action::Ls { max, state } => {
            let wanted = state.as_deref().map(str::parse::<TaskState>).transpose()?;
            if wanted == Some(TaskState::Unknown) {
                return Err(super::Usage(format!(
                    "{:?} is not a task state (submitted, accepted, working, input_required, \
                     completed, failed, cancelled, rejected, expired)",
                    state.unwrap_or_default()
                ))
                .into());
            }
            let tasks: Vec<_> = agent
                .tasks(max)
                .await?
                .into_iter()
                .filter(|t| wanted.is_none_or(|s| t.state == s))
                .collect();
            if json {
                let list: Vec<Value> = tasks
                    .iter()
                    .map(|t| {
                        json!({
                            "id": t.id, "state": t.state.as_str(), "by": t.by,
                            "updated_ms": t.updated_ms, "reason": t.reason,
                        })
                    })
                    .collect();
                print_json(&list)?;
            } else if tasks.is_empty() {
                eprintln!("no tasks");
            } else {
                outln!("{:<36}  {:<14}  {:<20}  reason", "id", "state", "by");
                for t in &tasks {
                    outln!(
                        "{:<36}  {:<14}  {:<20}  {}",
                        t.id,
                        t.state.as_str(),
                        t.by,
                        t.reason.as_deref().unwrap_or("")
                    );
                }
            }
            ExitCode::SUCCESS
        }
        Action::Show { id } => {
            let report = agent.task(id).await?.report().await?;
            print_report(&report, json)?;
            ExitCode::SUCCESS
        }
        Action::Watch { id, after } => {
            let task = agent.task(id).await?;
            follow(&task, after, json).await?
        }
        Action::Cancel { id } => {
            let report = agent.task(id).await?.cancel().await?;
            print_report(&report, json)?;
            if report.state == TaskState::Cancelled {
                ExitCode::SUCCESS
            } else {
                eprintln!("the task had already ended: {}", report.state);
                ExitCode::from(super::exit::REFUSED)
            }
        }
        Action::Respond { id, payload } => {
            let answer = parse_json(payload.as_deref())?;
            agent.task(id).await?.respond(&answer).await?;
            eprintln!("answered task {id}");
            ExitCode::SUCCESS
        }
    };
    agent.shutdown().await;
    Ok(code)
}

/// Prints `task`'s updates after `after` until it ends.
async fn follow(task: &chorus_sdk::TaskHandle, after: u64, json: bool) -> anyhow::Result<ExitCode> {
    let mut updates = task.updates_after(after).await?;
    let mut last = None;
    while let Some(update) = updates.next().await {
        let update = update?;
        if json {
            print_json(&update_json(&update))?;
        } else {
            outln!("{}", describe(&update));
        }
        if let Some(state) = update.state() {
            last = Some(state);
        }
    }
    Ok(if last == Some(TaskState::Completed) {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(super::exit::REFUSED)
    })
}

fn payload_json(update: &TaskUpdate) -> Value {
    if update.payload().is_empty() {
        return Value::Null;
    }
    update
        .payload_as::<Value>()
        .unwrap_or_else(|_| json!(format!("<{} bytes>", update.payload().len())))
}

fn update_json(update: &TaskUpdate) -> Value {
    json!({
        "seq": update.seq,
        "kind": update.kind.as_str(),
        "from": update.from(),
        "state": update.state().map(TaskState::as_str),
        "status": update.envelope.status.map(|s| s.0),
        "fraction": update.fraction(),
        "text": update.text(),
        "chunk": update.chunk(),
        "last_chunk": update.is_last_chunk(),
        "payload": payload_json(update),
    })
}

/// One line per update: `seq  kind  from  what`.
fn describe(update: &TaskUpdate) -> String {
    let what = match update.kind {
        TaskMessage::Status => {
            let state = update.state().unwrap_or(TaskState::Unknown);
            let mut text = state.as_str().to_owned();
            if let Some(status) = update.envelope.status {
                text.push_str(&format!(" ({status})"));
            }
            if let Some(reason) = update.text() {
                text.push_str(&format!(": {reason}"));
            }
            if matches!(
                state,
                TaskState::Completed | TaskState::InputRequired | TaskState::Submitted
            ) && !update.payload().is_empty()
            {
                text.push_str(&format!(" {}", payload_json(update)));
            }
            text
        }
        TaskMessage::Progress => {
            let mut text = update
                .fraction()
                .map(|f| format!("{:.0}%", f * 100.0))
                .unwrap_or_default();
            if let Some(message) = update.text() {
                text = format!("{text} {message}").trim().to_owned();
            }
            if !update.payload().is_empty() {
                text.push_str(&format!(" {}", payload_json(update)));
            }
            text
        }
        TaskMessage::Chunk => format!(
            "#{}{} {}",
            update.chunk().unwrap_or_default(),
            if update.is_last_chunk() {
                " (last)"
            } else {
                ""
            },
            payload_json(update)
        ),
        TaskMessage::Input => format!("answer {}", payload_json(update)),
        TaskMessage::Cancel => "cancel requested".to_owned(),
        TaskMessage::Report => {
            let mut text = format!(
                "result {}",
                update
                    .envelope
                    .status
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            );
            if let Some(reason) = update.text() {
                text.push_str(&format!(": {reason}"));
            }
            if !update.payload().is_empty() {
                text.push_str(&format!(" {}", payload_json(update)));
            }
            text
        }
    };
    format!(
        "{:>6}  {:<8}  {:<16}  {what}",
        update.seq,
        update.kind.as_str(),
        update.from()
    )
}

fn print_report(report: &TaskReport, json: bool) -> anyhow::Result<()> {
    let output = if report.output.is_empty() {
        Value::Null
    } else {
        chorus_sdk::codec::decode_payload::<Value>(&report.output, &report.content_type)
            .unwrap_or_else(|_| json!(format!("<{} bytes>", report.output.len())))
    };
    let attempts: Vec<Value> = report
        .attempts
        .iter()
        .map(|a| {
            json!({
                "agent": a.agent, "started_ms": a.started_ms, "ended_ms": a.ended_ms,
                "state": a.state.as_str(),
            })
        })
        .collect();
    if json {
        return print_json(&json!({
            "id": report.id,
            "state": report.state.as_str(),
            "status": report.status.0,
            "label": report.status.label(),
            "reason": report.reason,
            "requester": report.requester,
            "target": report.target,
            "submitted_ms": report.submitted_ms,
            "finished_ms": report.finished_ms,
            "deadline_ms": report.deadline_ms,
            "attempts": attempts,
            "output": output,
        }));
    }
    outln!("task      {}", report.id);
    outln!("state     {} ({})", report.state, report.status);
    if let Some(reason) = &report.reason {
        outln!("reason    {reason}");
    }
    outln!("requester {}", report.requester);
    outln!("target    {}", report.target);
    for (i, a) in report.attempts.iter().enumerate() {
        let took = a
            .ended_ms
            .map(|end| format!("{} ms", end.saturating_sub(a.started_ms)))
            .unwrap_or_else(|| "running".to_owned());
        outln!("attempt {} {} {} ({took})", i + 1, a.agent, a.state);
    }
    if !output.is_null() {
        outln!("output    {output}");
    }
    Ok(())
}

/// A task id from the command line: a malformed one is no task's id, said as such.
fn task_id(text: &str) -> Result<uuid::Uuid, String> {
    uuid::Uuid::parse_str(text).map_err(|_| {
        format!("no task with id {text:?}: task ids are UUIDs, as `chorus task ls` lists them")
    })
}
