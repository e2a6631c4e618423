//! `chorus dlq ls | show | replay | purge`: the dead-letter queue, for operators.

use std::process::ExitCode;

use chorus::service::dlq::{DeadLetterQueue, describe_envelope};
use clap::Subcommand;

use super::ConnectionArgs;

/// The connection name of `chorus dlq`.
const CONNECTION_NAME: &str = "chorus-dlq-cli";

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    #[command(subcommand)]
    action: Action,
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
    let url = conn.url();
    let broker = conn
        .broker_options()?
        .name(CONNECTION_NAME)
        .connect()
        .await
        .map_err(|e| anyhow::anyhow!("cannot reach the bus at {url}: {e}"))?;
    let queue = DeadLetterQueue::new(broker.clone(), subjects);
    match args.action {
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
