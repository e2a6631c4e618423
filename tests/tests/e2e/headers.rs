//! Application headers (the envelope's `headers`) through a real server: set with
//! `Call::header`, read by the handler with `Context::headers`, in a request, a durable command
//! and a task; the reply and the handler's own calls do not carry them on; headers past the
//! limits are refused before anything is sent. Events published with `Publish` carry headers,
//! priority, session and customer to their handlers.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use chorus_sdk::{
    Call, Context, DeliveryClass, HandlerError, MAX_HEADER_NAME_BYTES, MAX_HEADERS,
    MAX_HEADERS_BYTES, Priority, Publish, SdkError, StatusCode, TaskContext,
};
use chorus_tests::{WAIT, agent, agent_options, eventually, server, within};

type Headers = BTreeMap<String, String>;

/// A call of `command` at `reader` with a unit payload.
fn to_reader(command: &str) -> Call {
    Call::agent("reader", command)
        .payload(&())
        .expect("payload encodes")
}

fn expected(pairs: &[(&str, &str)]) -> Headers {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

#[tokio::test]
async fn application_headers_reach_the_handler_and_stay_with_their_message() {
    let server = server();
    let reader = within(
        WAIT,
        "reader connect",
        agent_options(&server, "reader")
            .durable_inbox(true)
            .connect(),
    )
    .await
    .expect("reader connects");
    reader
        .on_command("read", |ctx: Context, (): ()| async move {
            let one = ctx.header("tenant").map(str::to_owned);
            let missing = ctx.header("missing").map(str::to_owned);
            Ok::<_, HandlerError>((ctx.headers().clone(), one, missing))
        })
        .await
        .expect("serve read");
    reader
        .on_command("relay", |ctx: Context, (): ()| async move {
            // A call made while handling a message with headers: a forward, without them.
            let (forwarded, _, _): (Headers, Option<String>, Option<String>) =
                ctx.call(to_reader("read")).await?.payload_as()?;
            Ok::<_, HandlerError>((ctx.headers().clone(), forwarded))
        })
        .await
        .expect("serve relay");
    let noted = Arc::new(Mutex::new(Vec::<(Headers, u32)>::new()));
    let seen = Arc::clone(&noted);
    reader
        .on_command("note", move |ctx: Context, (): ()| {
            seen.lock()
                .expect("lock")
                .push((ctx.headers().clone(), ctx.attempt()));
            async move { Ok::<_, HandlerError>(()) }
        })
        .await
        .expect("serve note");
    reader
        .on_task("report", |task: TaskContext, (): ()| async move {
            // A task handler reads its submission's headers through its Context.
            Ok::<_, HandlerError>(task.headers().clone())
        })
        .await
        .expect("serve report");
    let caller = agent(&server, "caller").await;
    let sent = expected(&[
        ("x-request-id", "r-17"),
        ("tenant", "globex"),
        ("empty", ""),
        ("ünïcode", "ṽalue"),
    ]);
    let with_headers = |call: Call| {
        call.header("tenant", "acme")
            .header("x-request-id", "r-17")
            .header("tenant", "globex")
            .header("empty", "")
            .header("ünïcode", "ṽalue")
    };

    // A request: the handler reads every header (a name set twice keeps its last value).
    let reply = within(WAIT, "read", caller.call(with_headers(to_reader("read"))))
        .await
        .expect("read answers");
    let (got, one, missing): (Headers, Option<String>, Option<String>) =
        reply.payload_as().expect("decodes");
    assert_eq!(got, sent);
    assert_eq!(one.as_deref(), Some("globex"));
    assert_eq!(missing, None);
    // The reply carries none of them.
    assert!(reply.envelope.headers.is_empty(), "{:?}", reply.envelope);
    // A message without headers: the handler sees none.
    let (none, _, _): (Headers, Option<String>, Option<String>) =
        within(WAIT, "read", caller.request("reader", "read", &()))
            .await
            .expect("read answers");
    assert!(none.is_empty());

    // The handler's own call does not carry the headers of the message it handles.
    let (own, forwarded): (Headers, Headers) =
        within(WAIT, "relay", caller.call(with_headers(to_reader("relay"))))
            .await
            .expect("relay answers")
            .payload_as()
            .expect("decodes");
    assert_eq!(own, sent);
    assert!(forwarded.is_empty(), "{forwarded:?}");

    // A durable command keeps its headers in the inbox stream.
    let note = to_reader("note")
        .command()
        .delivery(DeliveryClass::AtLeastOnce)
        .header("x-batch", "7");
    within(WAIT, "send durable", caller.send(note))
        .await
        .expect("stored");
    let (headers, attempt) = eventually(WAIT, "the note handled", || async {
        noted.lock().expect("lock").first().cloned()
    })
    .await;
    assert_eq!(headers, expected(&[("x-batch", "7")]));
    assert_eq!(attempt, 1);

    // A task: the worker reads the submission's headers.
    let task = within(
        WAIT,
        "submit",
        caller.submit(to_reader("report").header("x-task", "t-1")),
    )
    .await
    .expect("submitted");
    let report = within(WAIT, "the task's end", task.result())
        .await
        .expect("result");
    let output: Headers = report.output_as().expect("output decodes");
    assert_eq!(output, expected(&[("x-task", "t-1")]));
}

#[tokio::test]
async fn headers_past_the_limits_are_refused_before_anything_is_sent() {
    let server = server();
    let reader = agent(&server, "reader").await;
    let calls = Arc::new(Mutex::new(0usize));
    let counted = Arc::clone(&calls);
    reader
        .on_command("read", move |ctx: Context, (): ()| {
            *counted.lock().expect("lock") += 1;
            let count = ctx.headers().len();
            async move { Ok::<_, HandlerError>(count) }
        })
        .await
        .expect("serve read");
    let caller = agent(&server, "caller").await;

    let too_many = (0..=MAX_HEADERS).fold(to_reader("read"), |call, i| {
        call.header(format!("h{i}"), "")
    });
    let long_name = "n".repeat(MAX_HEADER_NAME_BYTES + 1);
    let cases = [
        (too_many, "65 application headers: at most 64 are allowed"),
        (
            to_reader("read").header(long_name.as_str(), "v"),
            "1 to 128 bytes, not 129",
        ),
        (to_reader("read").header("", "v"), "1 to 128 bytes, not 0"),
        (
            to_reader("read").header("a\nb", "v"),
            "holds a control character",
        ),
        (
            to_reader("read").header("k", "v".repeat(MAX_HEADERS_BYTES)),
            "application headers of 16385 bytes: at most 16384 are allowed",
        ),
    ];
    for (call, why) in cases {
        // Refused the same way as a request, a core command and a durable command.
        for attempt in [
            caller.call(call.clone()).await.map(|_| ()),
            caller.send(call.clone().command()).await.map(|_| ()),
            caller
                .send(call.clone().command().delivery(DeliveryClass::AtLeastOnce))
                .await
                .map(|_| ()),
        ] {
            match attempt {
                Err(err @ SdkError::InvalidCall(_)) => {
                    assert_eq!(err.status(), StatusCode::INVALID_ARGUMENT);
                    assert!(err.to_string().contains(why), "{err} lacks {why:?}");
                }
                other => panic!("expected a refusal ({why}), got {other:?}"),
            }
        }
    }
    // At the limits exactly: sent and read whole.
    let largest = (0..MAX_HEADERS).fold(to_reader("read"), |call, i| {
        call.header(format!("h{i:02}"), "v".repeat(200))
    });
    let count: usize = within(WAIT, "read", caller.call(largest))
        .await
        .expect("read answers")
        .payload_as()
        .expect("decodes");
    assert_eq!(count, MAX_HEADERS);
    assert_eq!(*calls.lock().expect("lock"), 1, "nothing refused was sent");
}

#[tokio::test]
async fn an_event_published_with_headers_priority_session_and_customer_carries_them_to_its_handler()
{
    let server = server();
    let listener = agent(&server, "listener").await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    listener
        .on_event("alerts.>", move |ctx: Context, text: String| {
            let env = ctx.message();
            let _ = tx.send((
                text,
                ctx.headers().clone(),
                env.priority,
                env.session_id.clone(),
                env.customer_id.clone(),
            ));
            async move { Ok::<_, HandlerError>(()) }
        })
        .await
        .expect("subscribe");
    let publisher = agent(&server, "publisher").await;
    let alert = Publish::topic("alerts.disk")
        .payload("disk 91% full")
        .expect("payload encodes")
        .priority(Priority::High)
        .header("x-host", "db-2")
        .session("incident-4")
        .customer("acme");
    within(WAIT, "publish", publisher.publish_with(alert))
        .await
        .expect("published");
    let (text, headers, priority, session, customer) = within(WAIT, "the alert", rx.recv())
        .await
        .expect("received");
    assert_eq!(text, "disk 91% full");
    assert_eq!(headers, expected(&[("x-host", "db-2")]));
    assert_eq!(priority, Priority::High);
    assert_eq!(session.as_deref(), Some("incident-4"));
    assert_eq!(customer.as_deref(), Some("acme"));

    // A plain one (nothing but a topic and a payload) arrives as `publish` sends it.
    within(
        WAIT,
        "publish",
        publisher.publish_with(Publish::topic("alerts.cpu").payload("ok").expect("encodes")),
    )
    .await
    .expect("published");
    let (text, headers, priority, session, customer) = within(WAIT, "the plain one", rx.recv())
        .await
        .expect("received");
    assert_eq!(text, "ok");
    assert!(headers.is_empty());
    assert_eq!(priority, Priority::Normal);
    assert_eq!((session, customer), (None, None));

    // Headers past the limits are refused before anything is sent.
    let refused = publisher
        .publish_with(Publish::topic("alerts.x").header("", "v"))
        .await;
    match refused {
        Err(err @ SdkError::InvalidCall(_)) => {
            assert_eq!(err.status(), StatusCode::INVALID_ARGUMENT);
        }
        other => panic!("expected InvalidCall, got {other:?}"),
    }
}
