//! `chorus dlq ls | show | replay | purge`: the dead-letter queue, for operators.

use std::process::ExitCode;

use chorus::service::dlq::{DeadLetterQueue, DlqEntry, describe_envelope};
use clap::Subcommand;

use super::{ConnectionArgs, print_json};

/// The connection name of `chorus dlq`.
const CONNECTION_NAME: &str = "chorus-dlq-cli";

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    action: Action,
    /// `ls` and `show` print JSON: `ls` one array, `show` one object, each entry with its
    /// facts and (`show`) the decoded original envelope.
    #[arg(long, global = true)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// List dead letters, oldest first.
    Ls {
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// Show one dead letter in full.
    Show {
        /// Its id (from `ls`; ids start at 1).
        #[arg(value_parser = clap::value_parser!(u64).range(1..))]
        id: u64,
    },
    /// Publish dead letters to their original subject again and remove them from the queue.
    Replay {
        /// The id to replay (from `ls`; ids start at 1).
        #[arg(required_unless_present = "all", value_parser = clap::value_parser!(u64).range(1..))]
        id: Option<u64>,
        /// Replay every dead letter.
        #[arg(long, conflicts_with = "id")]
        all: bool,
    },
    /// Remove every dead letter.
    Purge,
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let subjects = conn.subjects()?;
    let broker = conn.broker(CONNECTION_NAME).await?;
    let queue = DeadLetterQueue::new(broker.clone(), subjects);
    match args.action {
        Action::Ls { limit } if args.json => {
            let entries = queue.list(limit).await?;
            let rows: Vec<_> = entries.iter().map(|e| entry_json(e, false)).collect();
            print_json(&rows)?;
        }
        Action::Show { id } if args.json => {
            let entry = queue.show(id).await.map_err(not_in_queue(id))?;
            print_json(&entry_json(&entry, true))?;
        }
        Action::Ls { limit } => ls(&queue, limit).await?,
        Action::Show { id } => show(&queue, id).await?,
        Action::Replay { id, all } => replay(&queue, id, all).await?,
        Action::Purge => {
            let n = queue.purge().await?;
            outln!("purged {n} dead letter(s)");
        }
    }
    let _ = broker.drain().await;
    Ok(ExitCode::SUCCESS)
}

/// One entry as `--json` prints it; with `full`, the original envelope decoded too.
fn entry_json(entry: &DlqEntry, full: bool) -> serde_json::Value {
    let l = &entry.letter;
    let mut v = serde_json::json!({
        "id": entry.id,
        "reason": l.reason.as_str(),
        "status": l.status.0,
        "label": l.status.label(),
        "detail": l.detail,
        "agent": l.agent,
        "subject": l.subject,
        "message_id": l.message_id,
        "attempts": l.attempts,
        "stored_ms": l.stored_ms,
        "dead_lettered_ms": l.dead_lettered_ms,
        "source": l.source.as_ref().map(|(s, n)| format!("{s}:{n}")),
        "size": l.omitted.unwrap_or(l.envelope.len() as u64),
        "omitted": l.omitted.is_some(),
    });
    if full {
        v["envelope"] = agent_sdk::codec::decode(&l.envelope)
            .ok()
            .and_then(|(env, _)| serde_json::to_value(env).ok())
            .unwrap_or(serde_json::Value::Null);
    }
    v
}

async fn ls(queue: &DeadLetterQueue, limit: usize) -> anyhow::Result<()> {
    let entries = queue.list(limit).await?;
    outln!(
        "{:>6}  {:<15} {:<22} {:<16} {:>8}  subject",
        "id",
        "reason",
        "status",
        "agent",
        "attempts"
    );
    for e in &entries {
        let l = &e.letter;
        outln!(
            "{:>6}  {:<15} {:<22} {:<16} {:>8}  {}",
            e.id,
            l.reason.as_str(),
            l.status.to_string(),
            l.agent,
            l.attempts,
            l.subject
        );
    }
    eprintln!(
        "{} dead letter(s) shown, {} in the queue",
        entries.len(),
        queue.depth().await?
    );
    Ok(())
}

/// What a missing entry is called, instead of JetStream's own words.
fn not_in_queue(id: u64) -> impl FnOnce(broker_adapter::Error) -> anyhow::Error {
    move |e| {
        if e.kind() == broker_adapter::ErrorKind::NotFound {
            anyhow::anyhow!("no dead letter {id} in the queue (`chorus dlq ls` lists them)")
        } else {
            anyhow::Error::new(e)
        }
    }
}

async fn show(queue: &DeadLetterQueue, id: u64) -> anyhow::Result<()> {
    let e = queue.show(id).await.map_err(not_in_queue(id))?;
    let l = &e.letter;
    outln!("id:              {}", e.id);
    outln!("reason:          {}", l.reason.as_str());
    outln!("status:          {}", l.status);
    outln!("detail:          {}", l.detail);
    outln!("agent:           {}", l.agent);
    outln!("subject:         {}", l.subject);
    outln!("attempts:        {}", l.attempts);
    outln!(
        "message id:      {}",
        l.message_id.map(|u| u.to_string()).unwrap_or_default()
    );
    outln!("stored at (ms):  {}", l.stored_ms);
    outln!("dead at (ms):    {}", l.dead_lettered_ms);
    match l.omitted {
        Some(size) => outln!(
            "message:         not kept ({size} bytes, too large to store beside the dead letter's headers)"
        ),
        None => outln!("message:         {}", describe_envelope(&l.envelope)),
    }
    Ok(())
}

async fn replay(queue: &DeadLetterQueue, id: Option<u64>, all: bool) -> anyhow::Result<()> {
    let ids: Vec<u64> = if all {
        queue
            .list(usize::MAX)
            .await?
            .into_iter()
            .map(|e| e.id)
            .collect()
    } else {
        id.into_iter().collect()
    };
    for id in &ids {
        match queue.replay(*id).await.map_err(not_in_queue(*id))? {
            Some(ack) => outln!("replayed {id} as inbox message {}", ack.sequence),
            None => outln!("replayed {id} (core subject, no delivery guarantee)"),
        }
    }
    eprintln!("{} replayed", ids.len());
    Ok(())
}
