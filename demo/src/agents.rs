//! The demo's agents: who they are and what each does with a message. Each runs in this process
//! ([`Demo::start`]) or on its own under a host (`chorus demo-agent NAME`, from the manifests in
//! `deploy/demo/`), the same code either way.

use chorus_sdk::{
    Agent, AgentOptions, Context, Description, HandlerError, RetryPolicies, RetryPolicy, SdkError,
};
use tokio::sync::{Mutex, mpsc};

use super::model::{Calculation, OcrReport, Posting, ScannedDocument, Seen};
use super::skills::{analyse, calculate, draft, summarize};
use super::{Demo, LEDGER_ATTEMPTS, ORCHESTRATOR, RELAY_HOP_LIMIT, SEEN_TOPIC};
use chorus_sdk::TaskContext;
use chorus_sdk::negotiate::Proposal;

/// Steps of the researcher's long task.
const RESEARCH_STEPS: u32 = 50;
/// How long each step takes.
const RESEARCH_STEP: std::time::Duration = std::time::Duration::from_millis(200);

/// The ledger's first retry comes this soon, in milliseconds, so the demo sees its dead
/// letter within seconds.
const LEDGER_INITIAL_BACKOFF_MS: u64 = 200;
/// Its retries wait at most this long, in milliseconds.
const LEDGER_MAX_BACKOFF_MS: u64 = 1_000;

/// The demo's agents other than the orchestrator, by the id each has in the demo (and the name
/// `chorus demo-agent` takes; its manifest is `deploy/demo/<name>.toml`).
pub const AGENTS: [&str; 13] = [
    "ocr-agent",
    "nlp-agent",
    "calculator",
    "relay-a",
    "relay-b",
    "ledger",
    "audit",
    "dashboard",
    "notifier",
    "writer",
    "researcher",
    "summarizer-fast",
    "summarizer-careful",
];

/// One of the demo's agents: what it does, whatever id it runs under (a host names replicas
/// `calculator-2` and so on).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// AIXP: reads a scanned document and hands its text to `nlp.analyze`.
    Ocr,
    /// AIXP: counts the words of a text, its most common word and its sentiment.
    Nlp,
    /// Agentify: the `calculation` command, a division by zero refused with a code.
    Calculator,
    /// Relays each message to its peer: two of them loop until the hop limit cuts them.
    Relay {
        /// The agent it relays to.
        peer: &'static str,
    },
    /// Takes postings through its durable inbox; a negative amount fails until dead-lettered.
    Ledger,
    /// In group `watchers`: answers `status`, tells the orchestrator of each `task.>` event.
    Watcher,
    /// Streams a draft word by word as a task.
    Writer,
    /// A long task that reports progress until done or cancelled.
    Researcher,
    /// Bids for and writes summaries; the fast one is sloppy.
    Summarizer {
        /// Whether it is the careful one.
        careful: bool,
    },
}

impl Role {
    /// The role of the demo agent `name` (one of [`AGENTS`]).
    pub fn named(name: &str) -> Option<Role> {
        Some(match name {
            "ocr-agent" => Role::Ocr,
            "nlp-agent" => Role::Nlp,
            "calculator" => Role::Calculator,
            "relay-a" => Role::Relay { peer: "relay-b" },
            "relay-b" => Role::Relay { peer: "relay-a" },
            "ledger" => Role::Ledger,
            "audit" | "dashboard" | "notifier" => Role::Watcher,
            "writer" => Role::Writer,
            "researcher" => Role::Researcher,
            "summarizer-fast" => Role::Summarizer { careful: false },
            "summarizer-careful" => Role::Summarizer { careful: true },
            _ => return None,
        })
    }

    /// Connects an agent with `options` (its id, its bus) and gives it this role's handlers;
    /// what its handlers narrate goes to `say`.
    pub async fn start(self, options: AgentOptions, say: fn(&str)) -> Result<Agent, SdkError> {
        match self {
            Role::Ocr => ocr(options, say).await,
            Role::Nlp => nlp(options, say).await,
            Role::Calculator => calculator(options).await,
            Role::Relay { peer } => relay(options, peer).await,
            Role::Ledger => ledger(options, say).await,
            Role::Watcher => watcher(options).await,
            Role::Writer => writer(options).await,
            Role::Researcher => researcher(options, say).await,
            Role::Summarizer { careful } => summarizer(options, careful).await,
        }
    }
}

async fn ocr(options: AgentOptions, say: fn(&str)) -> Result<Agent, SdkError> {
    let ocr = options.connect().await?;
    ocr.on_capability(
        "ocr",
        move |ctx: Context, doc: ScannedDocument| async move {
            let text = doc.lines.join(" ");
            say(&format!(
                "[AIXP]   {} read {:?}: {} lines -> handing the text to capability nlp.analyze",
                ctx.agent_id(),
                doc.name,
                doc.lines.len()
            ));
            let reply = ctx
                .call(chorus_sdk::Call::capability("nlp.analyze").payload(&text)?)
                .await?;
            Ok::<_, HandlerError>(OcrReport {
                document: doc.name,
                text,
                analysis: reply.payload_as()?,
                analysed_by: reply.envelope.from.into(),
            })
        },
    )
    .await?;
    Ok(ocr)
}

async fn nlp(options: AgentOptions, say: fn(&str)) -> Result<Agent, SdkError> {
    let nlp = options.connect().await?;
    nlp.on_capability(
        "nlp.analyze",
        move |ctx: Context, text: String| async move {
            let analysis = analyse(&text);
            say(&format!(
                "[AIXP]   {} analysed text from {} (hop {}): {} words",
                ctx.agent_id(),
                ctx.from(),
                ctx.message().hops,
                analysis.word_count
            ));
            Ok::<_, HandlerError>(analysis)
        },
    )
    .await?;
    Ok(nlp)
}

async fn calculator(options: AgentOptions) -> Result<Agent, SdkError> {
    let calculator = options.connect().await?;
    calculator
        .on_command("calculation", |_ctx: Context, c: Calculation| async move {
            calculate(&c)
        })
        .await?;
    calculator.describe(
        "calculation",
        Description::new("Applies an operation to the operands, left to right.").input_schema(
            serde_json::json!({
                "type": "object",
                "properties": {
                    "operation": {"enum": ["add", "subtract", "multiply", "divide"]},
                    "operands": {"type": "array", "items": {"type": "number"}, "minItems": 1},
                },
                "required": ["operation", "operands"],
            }),
        ),
    )?;
    Ok(calculator)
}

/// One of two agents that relay to each other: a loop the hop limit cuts.
async fn relay(options: AgentOptions, peer: &'static str) -> Result<Agent, SdkError> {
    let relay = options.hop_limit(RELAY_HOP_LIMIT).connect().await?;
    relay
        .on_command("relay", move |ctx: Context, n: u32| async move {
            Ok::<u32, HandlerError>(ctx.request(peer, "relay", &(n + 1)).await?)
        })
        .await?;
    Ok(relay)
}

/// The ledger takes postings through its durable inbox; a negative amount always fails.
async fn ledger(options: AgentOptions, say: fn(&str)) -> Result<Agent, SdkError> {
    let ledger = options
        .durable_inbox(true)
        .retry_policies(RetryPolicies {
            default: RetryPolicy {
                max_attempts: LEDGER_ATTEMPTS,
                initial_backoff_ms: LEDGER_INITIAL_BACKOFF_MS,
                max_backoff_ms: LEDGER_MAX_BACKOFF_MS,
                ..RetryPolicy::default()
            },
            rules: Vec::new(),
        })
        .connect()
        .await?;
    ledger
        .on_command("post", move |ctx: Context, p: Posting| async move {
            if p.amount < 0 {
                say(&format!(
                    "[dlq]   ledger refuses posting {} of {} (attempt from {})",
                    p.account,
                    p.amount,
                    ctx.from()
                ));
                return Err(HandlerError::failed("negative amount"));
            }
            Ok(())
        })
        .await?;
    Ok(ledger)
}

/// A watcher answers `status` and tells the orchestrator, on [`SEEN_TOPIC`], of each `task.>`
/// event it gets from it (so the orchestrator sees every copy arrive, wherever the watcher runs).
async fn watcher(options: AgentOptions) -> Result<Agent, SdkError> {
    let watcher = options.group("watchers").connect().await?;
    watcher
        .on_command("status", |ctx: Context, (): ()| async move {
            Ok::<_, HandlerError>(format!("{} ok", ctx.agent_id()))
        })
        .await?;
    watcher
        .on_event("task.>", |ctx: Context, task: String| async move {
            if ctx.from() == ORCHESTRATOR {
                let topic = ctx.message().topic.clone().unwrap_or_default();
                let seen = Seen {
                    watcher: ctx.agent_id().to_owned(),
                    event: format!("{topic}: {task}"),
                };
                ctx.publish(SEEN_TOPIC, &seen).await?;
            }
            Ok(())
        })
        .await?;
    Ok(watcher)
}

/// A writer that streams its draft word by word.
async fn writer(options: AgentOptions) -> Result<Agent, SdkError> {
    let writer = options.connect().await?;
    writer
        .on_task("draft", |task: TaskContext, topic: String| async move {
            let words = draft(&topic);
            let n = words.len();
            for (i, word) in words.into_iter().enumerate() {
                #[allow(clippy::cast_precision_loss)]
                let fraction = (i + 1) as f32 / n as f32;
                task.progress(Some(fraction), "writing").await?;
                if i + 1 == n {
                    task.last_chunk(&word).await?;
                } else {
                    task.chunk(&word).await?;
                }
            }
            Ok::<_, HandlerError>(n)
        })
        .await?;
    writer.describe(
        "draft",
        Description::new("Drafts a haiku on a topic, streamed word by word; answers its length.")
            .input_schema(serde_json::json!({"type": "string", "minLength": 1})),
    )?;
    Ok(writer)
}

/// A researcher whose work is long: it reports progress until done or cancelled.
async fn researcher(options: AgentOptions, say: fn(&str)) -> Result<Agent, SdkError> {
    let researcher = options.connect().await?;
    researcher
        .on_task("research", move |task: TaskContext, question: String| async move {
            for step in 1..=RESEARCH_STEPS {
                task.progress(
                    Some(step as f32 / RESEARCH_STEPS as f32),
                    format!("reading source {step} on {question:?}"),
                )
                .await?;
                tokio::select! {
                    why = task.cancelled() => {
                        say(&format!("[tasks]   researcher stops: {why:?}"));
                        return Err(HandlerError::new(chorus_sdk::StatusCode::CANCELLED, "stopped"));
                    }
                    () = tokio::time::sleep(RESEARCH_STEP) => {}
                }
            }
            Ok(format!("{RESEARCH_STEPS} sources on {question:?}"))
        })
        .await?;
    researcher.describe(
        "research",
        Description::new("Researches a question, one source at a time, until done or cancelled.")
            .input_schema(serde_json::json!({"type": "string", "minLength": 1})),
    )?;
    Ok(researcher)
}

/// A summarizer: the fast one cheap and sloppy, the careful one sure of itself (contract-net).
async fn summarizer(options: AgentOptions, careful: bool) -> Result<Agent, SdkError> {
    let summarizer = options.connect().await?;
    summarizer
        .on_bid(
            "summarize",
            move |_ctx: chorus_sdk::Context, text: String| async move {
                let words = text.split_whitespace().count() as u64;
                Ok(if careful {
                    Proposal::at(5.0).eta_ms(40 * words).confidence(0.95)
                } else {
                    Proposal::at(1.0).eta_ms(10 * words).confidence(0.4)
                })
            },
        )
        .await?;
    summarizer
        .on_task_capability(
            "summarize",
            move |_task: TaskContext, text: String| async move {
                Ok::<_, HandlerError>(summarize(&text, careful))
            },
        )
        .await?;
    Ok(summarizer)
}

impl Demo {
    /// Connects the demo agents to `servers` and registers their handlers.
    pub async fn start(servers: &str, say: fn(&str)) -> Result<Demo, SdkError> {
        Demo::start_announcing(servers, None, say).await
    }

    /// As [`start`](Demo::start), each agent announcing `metrics_url` (where this process
    /// serves its metrics) for the coordinator's service discovery.
    pub async fn start_announcing(
        servers: &str,
        metrics_url: Option<&str>,
        say: fn(&str),
    ) -> Result<Demo, SdkError> {
        let mut agents = Vec::with_capacity(AGENTS.len() + 1);
        for name in AGENTS {
            if let Some(role) = Role::named(name) {
                agents.push(role.start(options(name, servers, metrics_url), say).await?);
            }
        }
        Demo::with_agents(servers, metrics_url, agents).await
    }

    /// The orchestrator alone, for demo agents that run elsewhere (a host runs them from
    /// their manifests): [`run`](Demo::run) finds them on the bus by their ids.
    pub async fn orchestrate(servers: &str) -> Result<Demo, SdkError> {
        Demo::with_agents(servers, None, Vec::new()).await
    }

    /// Starts the orchestrator beside `agents`: it hears the watchers tell of the events they
    /// got.
    async fn with_agents(
        servers: &str,
        metrics_url: Option<&str>,
        mut agents: Vec<Agent>,
    ) -> Result<Demo, SdkError> {
        let orchestrator = options(ORCHESTRATOR, servers, metrics_url)
            .connect()
            .await?;
        let (tx, rx) = mpsc::unbounded_channel();
        orchestrator
            .on_event(SEEN_TOPIC, move |_ctx: Context, seen: Seen| {
                let tx = tx.clone();
                async move {
                    // Closed only when the demo is gone.
                    let _ = tx.send(seen);
                    Ok(())
                }
            })
            .await?;
        agents.push(orchestrator.clone());
        Ok(Demo {
            agents,
            orchestrator,
            events: Mutex::new(rx),
        })
    }
}

/// The options of the demo agent `id` on `servers`, announcing `metrics_url` when given.
fn options(id: &str, servers: &str, metrics_url: Option<&str>) -> AgentOptions {
    let options = AgentOptions::new(id).servers([servers]);
    match metrics_url {
        Some(url) => options.metrics_url(url),
        None => options,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_demo_agent_has_a_role_and_nothing_else_does() {
        for name in AGENTS {
            assert!(Role::named(name).is_some(), "{name}");
        }
        assert_eq!(Role::named(ORCHESTRATOR), None);
        assert_eq!(Role::named("calculator-2"), None);
        assert_eq!(
            Role::named("relay-a"),
            Some(Role::Relay { peer: "relay-b" })
        );
    }
}
