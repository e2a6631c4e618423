//! `chorus dlq ls | show | replay | purge`: the dead-letter queue, for operators.

use std::process::ExitCode;
use std::time::Duration;

use chorus_cli::duration::parse_duration;
use chorus_coordinator::service::dlq::{DeadLetterQueue, DlqEntry, DlqFilter, describe_envelope};
use chorus_sdk::Subjects;
use chorus_sdk::durable::DeadLetterReason;
use chorus_sdk::envelope::now_ms;
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

/// Which dead letters: every flag narrows the set.
#[derive(Debug, Clone, clap::Args)]
struct Filter {
    /// Only this agent's.
    #[arg(long)]
    agent: Option<String>,
    /// Only those dead-lettered for this reason (max_attempts, max_deliveries, refused,
    /// expired, undeliverable, uncertain).
    #[arg(long)]
    reason: Option<DeadLetterReason>,
    /// Only those dead-lettered at least this long ago (`90s`, `2h`, `7d`).
    #[arg(long, value_parser = parse_duration)]
    older_than: Option<Duration>,
    /// Only those dead-lettered at most this long ago.
    #[arg(long, value_parser = parse_duration)]
    newer_than: Option<Duration>,
}

impl Filter {
    fn to_query(&self) -> DlqFilter {
        DlqFilter {
            agent: self.agent.clone(),
            reason: self.reason,
            older_than: self.older_than,
            newer_than: self.newer_than,
        }
    }
}

#[derive(Debug, Subcommand)]
enum Action {
    /// List dead letters, oldest first, a page at a time.
    Ls {
        #[command(flatten)]
        filter: Filter,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Only those after this id: the next page (`ls` names it when there is more).
        #[arg(long, default_value_t = 0)]
        after: u64,
    },
    /// Show one dead letter in full.
    Show {
        /// Its id (from `ls`; ids start at 1).
        #[arg(value_parser = clap::value_parser!(u64).range(1..))]
        id: u64,
    },
    /// Publish dead letters to their original subject again and remove them from the queue:
    /// one by id, or with --all every one the filters select.
    Replay {
        /// The id to replay (from `ls`; ids start at 1).
        #[arg(required_unless_present = "all", value_parser = clap::value_parser!(u64).range(1..))]
        id: Option<u64>,
        /// Replay every dead letter the filters select (all of them without filters).
        #[arg(long, conflicts_with = "id")]
        all: bool,
        #[command(flatten)]
        filter: Filter,
    },
    /// Remove the dead letters the filters select (all of them without filters); asks first
    /// unless --yes.
    Purge {
        #[command(flatten)]
        filter: Filter,
        /// Do not ask.
        #[arg(long)]
        yes: bool,
    },
}

pub(crate) async fn run(args: Args, conn: &ConnectionArgs) -> anyhow::Result<ExitCode> {
    let subjects = conn.subjects()?;
    let broker = conn.broker(CONNECTION_NAME).await?;
    let mut queue = DeadLetterQueue::new(broker.clone(), subjects);
    // With a key, replays are signed as this CLI's id: receivers that verify signatures and
    // trust that id handle them (docs/PROTOCOL.md, "Replaying a signed dead letter").
    if let Some(identity) = conn.security.identity()? {
        queue = queue.signed_by(conn.agent_id(), std::sync::Arc::new(identity));
    }
    match args.action {
        Action::Ls {
            filter,
            limit,
            after,
        } => ls(&queue, &filter.to_query(), limit, after, args.json).await?,
        Action::Show { id } if args.json => {
            let entry = queue.show(id).await.map_err(not_in_queue(id))?;
            print_json(&entry_json(&entry, true, queue.subjects()))?;
        }
        Action::Show { id } => show(&queue, id).await?,
        Action::Replay { id, all, filter } => {
            replay(&queue, id, all.then(|| filter.to_query())).await?
        }
        Action::Purge { filter, yes } => purge(&queue, &filter.to_query(), yes).await?,
    }
    let _ = broker.drain().await;
    Ok(ExitCode::SUCCESS)
}

/// One entry as `--json` prints it; with `full`, the original envelope decoded too.
fn entry_json(entry: &DlqEntry, full: bool, subjects: &Subjects) -> serde_json::Value {
    let l = &entry.letter;
    let mut v = entry.to_json();
    if full {
        v["envelope"] = chorus_sdk::codec::decode_on(&l.envelope, &subjects.implied(&l.subject))
            .ok()
            .and_then(|(env, _)| serde_json::to_value(env).ok())
            .unwrap_or(serde_json::Value::Null);
    }
    v
}

async fn ls(
    queue: &DeadLetterQueue,
    filter: &DlqFilter,
    limit: usize,
    after: u64,
    json: bool,
) -> anyhow::Result<()> {
    // One more than asked, to tell whether there is a next page.
    let mut entries = queue.find(filter, after, limit.saturating_add(1)).await?;
    let more = entries.len() > limit;
    entries.truncate(limit);
    if json {
        let rows: Vec<_> = entries
            .iter()
            .map(|e| entry_json(e, false, queue.subjects()))
            .collect();
        print_json(&rows)?;
    } else {
        let now = now_ms();
        outln!(
            "{:>6}  {:<20} {:>8}  {:<14} {:<5} {:<16} {:>4}  {:<36}  subject",
            "id",
            "dead at (UTC)",
            "age",
            "reason",
            "code",
            "agent",
            "try",
            "message id"
        );
        for e in &entries {
            let l = &e.letter;
            outln!(
                "{:>6}  {:<20} {:>8}  {:<14} {:<5} {:<16} {:>4}  {:<36}  {}",
                e.id,
                utc(l.dead_lettered_ms),
                age(now, l.dead_lettered_ms),
                l.reason.as_str(),
                l.status.0,
                l.agent,
                l.attempts,
                l.message_id
                    .map(|u| u.to_string())
                    .unwrap_or_else(|| "-".into()),
                l.subject
            );
        }
    }
    let last = entries.last().map(|e| e.id);
    match (more, last) {
        (true, Some(last)) => eprintln!(
            "{} dead letter(s) shown, {} in the queue; next page: --after {last}",
            entries.len(),
            queue.depth().await?
        ),
        _ => eprintln!(
            "{} dead letter(s) shown, {} in the queue",
            entries.len(),
            queue.depth().await?
        ),
    }
    Ok(())
}

/// `ms` since the epoch as a UTC date and time to the second.
pub(crate) fn utc(ms: u64) -> String {
    let format = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second]");
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| t.format(&format).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// How long ago `ms` was, in its largest two units (`3m12s`, `2d4h`).
fn age(now: u64, ms: u64) -> String {
    let s = now.saturating_sub(ms) / 1000;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d{}h", s / 86_400, s % 86_400 / 3600),
    }
}

/// What a missing entry is called, instead of JetStream's own words.
fn not_in_queue(id: u64) -> impl FnOnce(chorus_broker_adapter::Error) -> anyhow::Error {
    move |e| {
        if e.kind() == chorus_broker_adapter::ErrorKind::NotFound {
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
    let now = now_ms();
    outln!(
        "stored at:       {} UTC ({} ago)",
        utc(l.stored_ms),
        age(now, l.stored_ms)
    );
    outln!(
        "dead at:         {} UTC ({} ago)",
        utc(l.dead_lettered_ms),
        age(now, l.dead_lettered_ms)
    );
    match l.omitted {
        Some(size) => outln!(
            "message:         not kept ({size} bytes, too large to store beside the dead letter's headers)"
        ),
        None => outln!(
            "message:         {}",
            describe_envelope(&l.envelope, &queue.subjects().implied(&l.subject))
        ),
    }
    Ok(())
}

async fn replay(
    queue: &DeadLetterQueue,
    id: Option<u64>,
    all: Option<DlqFilter>,
) -> anyhow::Result<()> {
    let ids: Vec<u64> = match all {
        Some(filter) => queue
            .find(&filter, 0, usize::MAX)
            .await?
            .into_iter()
            .map(|e| e.id)
            .collect(),
        None => id.into_iter().collect(),
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

/// Removes what `filter` selects, once confirmed (or with `yes`).
async fn purge(queue: &DeadLetterQueue, filter: &DlqFilter, yes: bool) -> anyhow::Result<()> {
    let ids: Option<Vec<u64>> = if filter.is_empty() {
        None
    } else {
        Some(
            queue
                .find(filter, 0, usize::MAX)
                .await?
                .into_iter()
                .map(|e| e.id)
                .collect(),
        )
    };
    let count = match &ids {
        Some(ids) => ids.len() as u64,
        None => queue.depth().await?,
    };
    if count == 0 {
        outln!("purged 0 dead letter(s)");
        return Ok(());
    }
    if !yes && !confirm(&format!("remove {count} dead letter(s) for good?"))? {
        anyhow::bail!("nothing removed (pass --yes to purge without asking)");
    }
    let removed = match ids {
        None => queue.purge().await?,
        Some(ids) => {
            let mut n = 0;
            for id in ids {
                if queue.remove(id).await? {
                    n += 1;
                }
            }
            n
        }
    };
    outln!("purged {removed} dead letter(s)");
    Ok(())
}

/// Asks `question` on the terminal; refuses when there is no terminal to ask at.
fn confirm(question: &str) -> anyhow::Result<bool> {
    use std::io::{BufRead, IsTerminal, Write};
    if !std::io::stdin().is_terminal() {
        anyhow::bail!("{question} There is no terminal to ask at: pass --yes");
    }
    eprint!("{question} [y/N] ");
    let _ = std::io::stderr().flush();
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(answer.trim(), "y" | "Y" | "yes"))
}
