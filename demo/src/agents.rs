//! The demo's agents: who they are and what each does with a message.

use chorus_sdk::{
    AgentOptions, Context, Description, HandlerError, RetryPolicies, RetryPolicy, SdkError,
};
use tokio::sync::{Mutex, mpsc};

use super::model::{Calculation, OcrReport, Posting, ScannedDocument};
use super::skills::{analyse, calculate, draft, summarize};
use super::{Demo, LEDGER_ATTEMPTS, RELAY_HOP_LIMIT, WATCHERS};
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
        let options = |id: &str| {
            let options = AgentOptions::new(id).servers([servers]);
            match metrics_url {
                Some(url) => options.metrics_url(url),
                None => options,
            }
        };
        let connect = |id: &str| options(id).connect();

        let ocr = connect("ocr-agent").await?;
        ocr.on_capability("ocr", move |ctx: Context, doc: ScannedDocument| async move {
            let text = doc.lines.join(" ");
            say(&format!(
                "[AIXP]   ocr-agent read {:?}: {} lines -> handing the text to capability nlp.analyze",
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
        })
        .await?;

        let nlp = connect("nlp-agent").await?;
        nlp.on_capability(
            "nlp.analyze",
            move |ctx: Context, text: String| async move {
                let analysis = analyse(&text);
                say(&format!(
                    "[AIXP]   nlp-agent analysed text from {} (hop {}): {} words",
                    ctx.from(),
                    ctx.message().hops,
                    analysis.word_count
                ));
                Ok::<_, HandlerError>(analysis)
            },
        )
        .await?;

        let calculator = connect("calculator").await?;
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

        // Two agents that relay to each other: a loop the hop limit cuts.
        let mut relays = Vec::new();
        for (me, peer) in [("relay-a", "relay-b"), ("relay-b", "relay-a")] {
            let relay = options(me).hop_limit(RELAY_HOP_LIMIT).connect().await?;
            relay
                .on_command("relay", move |ctx: Context, n: u32| async move {
                    Ok::<u32, HandlerError>(ctx.request(peer, "relay", &(n + 1)).await?)
                })
                .await?;
            relays.push(relay);
        }

        // The ledger takes postings through its durable inbox; a negative amount always fails.
        let ledger = options("ledger")
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

        let (tx, rx) = mpsc::unbounded_channel();
        let mut watchers = Vec::new();
        for name in WATCHERS {
            let watcher = options(name).group("watchers").connect().await?;
            watcher
                .on_command("status", |ctx: Context, (): ()| async move {
                    Ok::<_, HandlerError>(format!("{} ok", ctx.agent_id()))
                })
                .await?;
            let tx = tx.clone();
            watcher
                .on_event("task.>", move |ctx: Context, task: String| {
                    let tx = tx.clone();
                    async move {
                        let topic = ctx.message().topic.clone().unwrap_or_default();
                        let _ = tx.send((name.to_owned(), format!("{topic}: {task}")));
                        Ok(())
                    }
                })
                .await?;
            watchers.push(watcher);
        }

        // Tasks: a writer that streams its draft word by word, a researcher whose work is
        // long (it reports progress until cancelled), and two summarizers, one sloppy.
        let writer = connect("writer").await?;
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
            Description::new(
                "Drafts a haiku on a topic, streamed word by word; answers its length.",
            )
            .input_schema(serde_json::json!({"type": "string", "minLength": 1})),
        )?;
        let researcher = connect("researcher").await?;
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
            Description::new(
                "Researches a question, one source at a time, until done or cancelled.",
            )
            .input_schema(serde_json::json!({"type": "string", "minLength": 1})),
        )?;
        let mut summarizers = Vec::new();
        for (id, careful) in [("summarizer-fast", false), ("summarizer-careful", true)] {
            let summarizer = connect(id).await?;
            // Contract-net: the fast one is cheap, the careful one sure of itself.
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
            summarizers.push(summarizer);
        }

        let orchestrator = connect(super::ORCHESTRATOR).await?;
        let mut agents = vec![ocr, nlp, calculator, ledger, writer, researcher];
        agents.extend(summarizers);
        agents.extend(relays);
        agents.extend(watchers);
        agents.push(orchestrator.clone());
        Ok(Demo {
            agents,
            orchestrator,
            events: Mutex::new(rx),
        })
    }
}
