//! The one place a core request's outcome becomes its reply: the result or a coded error, in
//! the encoding the request came in, signed when the agent signs. The coordinator answers
//! through the same function.

use crate::Report;
use chorus_broker_adapter::ErrorKind;

use crate::error::HandlerError;
use crate::handler::Output;
use crate::outbound::Outbound;
use crate::protocol::codec::{self, Encoding};
use crate::protocol::envelope::{Envelope, Kind, Performative};
use crate::protocol::status::StatusCode;
use crate::stats::AgentCounters;

/// Answers on `reply_to`: `result` as a reply to `request`, or, when the request never
/// decoded (`None`), as a bare refusal naming no one.
pub(crate) async fn send(
    out: &Outbound,
    reply_to: &str,
    request: Option<&Envelope>,
    encoding: Encoding,
    result: Result<Output, HandlerError>,
) {
    let status = result
        .as_ref()
        .map_or_else(|e| e.status, |_| StatusCode::OK);
    let mut reply = match request {
        Some(request) => request.reply(out.link.id.as_str(), status),
        None => {
            // Bytes that never decoded: there is no sender to name or message to answer.
            let mut blank = Envelope::new(Kind::Response, Performative::Refuse, "");
            blank.content_type = encoding.content_type().into();
            let mut reply = blank.reply(out.link.id.as_str(), status);
            reply.to.clear();
            reply.in_reply_to = None;
            reply.correlation_id = None;
            reply
        }
    };
    match result {
        Ok(output) => {
            reply.payload = output.payload;
            reply.content_type = output.content_type;
        }
        Err(err) => {
            reply.reason = Some(err.reason);
            // A request refused before its payload was fetched still names the reference's
            // content type: the refusal carries no payload of that kind.
            if reply.content_type == crate::payload::CONTENT_TYPE_OBJECT {
                reply.content_type = encoding.content_type().into();
            }
        }
    }
    if let Err(err) = out.fit(&mut reply).await {
        // Too large even by reference, or the object store refused it: tell the caller.
        tracing::debug!(agent = %out.link.id, error = %Report(&err), "reply payload does not fit");
        reply.status = Some(err.status());
        reply.performative = Performative::Failure;
        reply.payload = bytes::Bytes::new();
        reply.content_encoding = None;
        reply.reason = Some(format!("the reply could not be sent: {err}"));
    }
    let mut sent = publish(out, reply_to, &reply, encoding).await;
    if let Err(err) = &sent
        && err.kind() == ErrorKind::TooLarge
    {
        // Tell the caller rather than leave it to time out.
        reply.status = Some(StatusCode::DATA_FORMAT);
        reply.performative = Performative::Refuse;
        reply.payload = bytes::Bytes::new();
        reply.reason = Some("the reply is larger than the server's max_payload".into());
        sent = publish(out, reply_to, &reply, encoding).await;
    }
    match sent {
        Ok(()) => AgentCounters::bump(&out.link.counters.replies_sent),
        Err(err) => {
            AgentCounters::bump(&out.link.counters.reply_failures);
            tracing::warn!(agent = %out.link.id, error = %Report(&err), "reply not sent");
        }
    }
}

async fn publish(
    out: &Outbound,
    reply_to: &str,
    reply: &Envelope,
    encoding: Encoding,
) -> Result<(), chorus_broker_adapter::Error> {
    let mut sealed;
    let reply = if out.identity.is_some() {
        sealed = reply.clone();
        out.seal(reply_to, &mut sealed);
        &sealed
    } else {
        reply
    };
    // Through the agent's shared chunk, as everything it sends; nothing is left to an inbox
    // subject, so the caller reads the reply whole.
    let bytes = out
        .write(|scratch| {
            codec::encode_into(
                reply,
                encoding,
                &crate::subject::Implied::default(),
                scratch,
            )
        })
        .map_err(|e| {
            chorus_broker_adapter::Error::with_source(
                ErrorKind::InvalidInput,
                "reply does not encode",
                e,
            )
        })?;
    out.link.broker.publish(reply_to, bytes).await
}
