//! Priority for core messages (PROTOCOL.md section 7.9, "Priority"): when requests and
//! commands wait for a handler slot, the next slot goes to the most urgent (critical, high,
//! normal, low; arrival order within one), and a lower one is overtaken at most 8 times in a
//! row, so it is never starved. An agent handles one message at a time behind a handler held
//! until released; a raw client queues requests in a known order from several senders.

use std::sync::{Arc, Mutex};

use chorus_broker_adapter::{Broker, BrokerOptions};
use chorus_sdk::codec::{self, Encoding};
use chorus_sdk::envelope::CONTENT_TYPE_MSGPACK;
use chorus_sdk::{
    Agent, Call, Context, Envelope, HandlerError, Kind, Performative, Priority, StatusCode,
    Subjects,
};
use chorus_tests::{NatsServer, WAIT, agent_options, eventually, server, within};
use futures::StreamExt;

use Priority::{Critical, High, Low, Normal};

/// How many times in a row a waiting message may be overtaken (section 7.9).
const MAX_OVERTAKES: usize = 8;

/// An agent handling one message at a time with `capacity` waiting at most: `hold` takes the
/// slot until released; `work` records its label in the order handled and answers its place.
struct Backlogged {
    agent: Agent,
    raw: Broker,
    gate: Arc<tokio::sync::Semaphore>,
    started: tokio::sync::mpsc::UnboundedReceiver<()>,
    handled: Arc<Mutex<Vec<String>>>,
    /// Replies by label, as they came.
    replies: Arc<Mutex<Vec<Answered>>>,
}

/// A reply's label and status.
type Answered = (String, Option<StatusCode>);

impl Backlogged {
    async fn start(server: &NatsServer, id: &str, capacity: usize) -> Backlogged {
        let agent = within(
            WAIT,
            "agent connect",
            agent_options(server, id)
                .max_in_flight(1)
                .queue_capacity(capacity)
                .connect(),
        )
        .await
        .expect("connect");
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let (started_tx, started) = tokio::sync::mpsc::unbounded_channel();
        {
            let gate = Arc::clone(&gate);
            agent
                .on_command("hold", move |_ctx: Context, _label: String| {
                    let gate = Arc::clone(&gate);
                    let _ = started_tx.send(());
                    async move {
                        gate.acquire().await.expect("gate").forget();
                        Ok::<_, HandlerError>(())
                    }
                })
                .await
                .expect("serve hold");
        }
        let handled = Arc::new(Mutex::new(Vec::new()));
        {
            let handled = Arc::clone(&handled);
            agent
                .on_command("work", move |_ctx: Context, label: String| {
                    let mut handled = handled.lock().expect("lock");
                    handled.push(label);
                    let place = handled.len() - 1;
                    async move { Ok::<_, HandlerError>(place) }
                })
                .await
                .expect("serve work");
        }
        let raw = BrokerOptions::new([server.url()])
            .connect()
            .await
            .expect("raw client");
        let mut inbox = raw.subscribe("_INBOX.prio.*").await.expect("inbox");
        raw.flush().await.expect("flush");
        let replies = Arc::new(Mutex::new(Vec::new()));
        {
            let replies = Arc::clone(&replies);
            tokio::spawn(async move {
                while let Some(msg) = inbox.next().await {
                    let label = msg.subject().rsplit('.').next().unwrap_or_default();
                    let (reply, _) = codec::decode(msg.payload()).expect("a reply envelope");
                    replies
                        .lock()
                        .expect("lock")
                        .push((label.to_owned(), reply.status));
                }
            });
        }
        Backlogged {
            agent,
            raw,
            gate,
            started,
            handled,
            replies,
        }
    }

    /// Publishes a request for `command` from agent `sender-<label>`, after everything this
    /// client published before it.
    async fn send(&self, command: &str, label: &str, priority: Priority) {
        let mut env = Envelope::new(
            Kind::Request,
            Performative::Request,
            format!("sender-{label}"),
        );
        env.to = vec![self.agent.id().to_owned()];
        env.name = Some(command.to_owned());
        env.priority = priority;
        env.content_type = CONTENT_TYPE_MSGPACK.into();
        env.payload = codec::encode_payload(label, CONTENT_TYPE_MSGPACK).expect("payload");
        let subject = Subjects::default()
            .command(self.agent.id(), command)
            .expect("subject");
        let reply = format!("_INBOX.prio.{label}");
        let bytes = codec::encode(&env, Encoding::MsgPack).expect("encode");
        self.raw
            .publish_with(&subject, Some(&reply), None, bytes)
            .await
            .expect("publish");
    }

    /// Holds the slot, queues `waiting` in that order, and returns once all of them wait.
    async fn backlog(&mut self, waiting: &[(String, Priority)]) {
        self.hold().await;
        for (label, priority) in waiting {
            self.send("work", label, *priority).await;
        }
        self.probe().await;
    }

    /// Takes the only slot with `hold`.
    async fn hold(&mut self) {
        self.send("hold", "hold", Normal).await;
        within(WAIT, "hold started", self.started.recv())
            .await
            .expect("started");
    }

    /// Returns once everything published before waits: a probe sent after it is refused with
    /// 5019, the queue being full.
    async fn probe(&self) {
        self.send("work", "probe", Normal).await;
        let probe = eventually(WAIT, "the probe refused", || async {
            let replies = self.replies.lock().expect("lock");
            replies
                .iter()
                .find(|(label, _)| label == "probe")
                .map(|(_, status)| *status)
        })
        .await;
        assert_eq!(probe, Some(StatusCode::UNAVAILABLE), "the queue was full");
    }

    /// Lets `hold` go; the labels in the order handled and the replies in the order they
    /// came, once every request is answered.
    async fn release(&self, count: usize) -> (Vec<String>, Vec<String>) {
        self.gate.add_permits(1);
        let replies = eventually(WAIT, "every request answered", || async {
            let replies = self.replies.lock().expect("lock").clone();
            (replies.len() == count + 2).then_some(replies)
        })
        .await;
        for (label, status) in &replies {
            if label != "probe" {
                assert_eq!(*status, Some(StatusCode::OK), "{label}");
            }
        }
        let answered = replies
            .into_iter()
            .map(|(label, _)| label)
            .filter(|label| label != "probe" && label != "hold")
            .collect();
        (self.handled.lock().expect("lock").clone(), answered)
    }
}

fn labelled(items: &[(&str, Priority)]) -> Vec<(String, Priority)> {
    items.iter().map(|(l, p)| ((*l).to_owned(), *p)).collect()
}

#[tokio::test]
async fn a_backlog_answers_critical_then_high_then_normal_then_low() {
    let server = server();
    let waiting = labelled(&[
        ("n0", Normal),
        ("l0", Low),
        ("n1", Normal),
        ("l1", Low),
        ("n2", Normal),
        ("l2", Low),
        ("n3", Normal),
        ("l3", Low),
        ("high", High),
        ("critical", Critical),
    ]);
    let mut b = Backlogged::start(&server, "busy", waiting.len()).await;
    b.backlog(&waiting).await;
    let (handled, answered) = b.release(waiting.len()).await;
    let expected = [
        "critical", "high", "n0", "n1", "n2", "n3", "l0", "l1", "l2", "l3",
    ];
    assert_eq!(handled, expected, "handled in priority order");
    // One at a time: the replies came back in the same order, the high ones first.
    assert_eq!(answered, expected, "answered in priority order");
}

#[tokio::test]
async fn a_low_request_gets_through_a_stream_of_high_ones() {
    let server = server();
    let mut waiting = labelled(&[("low", Low)]);
    waiting.extend((0..20).map(|i| (format!("h{i}"), High)));
    let mut b = Backlogged::start(&server, "busy", waiting.len()).await;
    b.backlog(&waiting).await;
    let (handled, _) = b.release(waiting.len()).await;
    let first: Vec<String> = (0..MAX_OVERTAKES).map(|i| format!("h{i}")).collect();
    assert_eq!(handled[..MAX_OVERTAKES], first[..], "{handled:?}");
    assert_eq!(
        handled[MAX_OVERTAKES], "low",
        "overtaken {MAX_OVERTAKES} times, then served: {handled:?}"
    );
    assert_eq!(handled.len(), waiting.len());
}

/// A command (no reply) with a priority is ordered as a request is, and a sender's own
/// `Call::priority` reaches the receiver.
#[tokio::test]
async fn commands_from_an_agent_are_ordered_by_their_priority() {
    let server = server();
    let waiting = labelled(&[("n0", Normal), ("l0", Low), ("n1", Normal)]);
    let mut b = Backlogged::start(&server, "busy", waiting.len() + 1).await;
    b.hold().await;
    for (label, priority) in &waiting {
        b.send("work", label, *priority).await;
    }
    // Then a high-priority command from another agent through the SDK's API, on the raw
    // client's connection so that the probe after it arrives after it. A core command carries
    // no reply: its turn shows in the order handled.
    let sender = within(
        WAIT,
        "sender connect",
        agent_options(&server, "urgent")
            .connection(b.raw.clone())
            .connect(),
    )
    .await
    .expect("sender connects");
    let call = Call::agent("busy", "work")
        .command()
        .priority(High)
        .payload("urgent")
        .expect("payload");
    sender.send(call).await.expect("sent");
    b.probe().await;
    b.gate.add_permits(1);
    let handled = eventually(WAIT, "everything handled", || async {
        let handled = b.handled.lock().expect("lock").clone();
        (handled.len() > waiting.len()).then_some(handled)
    })
    .await;
    assert_eq!(handled, ["urgent", "n0", "n1", "l0"]);
}
