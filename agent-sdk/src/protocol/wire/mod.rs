//! The MessagePack form of the envelope, written and read by hand: the hot path of every
//! message. The bytes are exactly those the serde derive on [`Envelope`] produces (a map of
//! field names, empty optional fields left out, in declaration order), which the tests check
//! on every field; reading takes the common shapes directly, borrows the payload from the
//! message instead of copying it, and hands anything unusual (a field of an unexpected type, a
//! repeated or missing field, an array for a map) to the serde decoder, so that what is
//! accepted, and every error, stays serde's.

use rmp::encode as w;

pub(crate) mod compact;
mod decode;
#[cfg(test)]
mod tests;

pub(crate) use decode::{decode, peek_sequence};

use crate::protocol::envelope::{
    DEFAULT_HOP_LIMIT, DeliveryClass, Envelope, PROTOCOL_VERSION, Priority,
};

/// Writes `env` as MessagePack onto `out`.
pub(crate) fn encode(env: &Envelope, out: &mut Vec<u8>) {
    // Every field by name, none skipped: a new Envelope field is a compile error here until
    // the encoder writes it (and an unused binding fails the lint).
    let Envelope {
        version,
        id,
        correlation_id,
        in_reply_to,
        from,
        to,
        topic,
        capability,
        name,
        kind,
        performative,
        timestamp_ms,
        ttl_ms,
        deadline_ms,
        hops,
        hop_limit,
        priority,
        delivery,
        seq,
        expect,
        progress,
        status,
        reason,
        trace,
        session_id,
        customer_id,
        headers,
        content_type,
        content_encoding,
        payload,
        token,
        signature,
        encryption,
    } = env;
    // Writes to a Vec cannot fail, so the io results below are ignored.
    let fields = 7
        + usize::from(correlation_id.is_some())
        + usize::from(in_reply_to.is_some())
        + usize::from(!to.is_empty())
        + usize::from(topic.is_some())
        + usize::from(capability.is_some())
        + usize::from(name.is_some())
        + usize::from(ttl_ms.is_some())
        + usize::from(deadline_ms.is_some())
        + usize::from(*hops != 0)
        + usize::from(*hop_limit != DEFAULT_HOP_LIMIT)
        + usize::from(*priority != Priority::Normal)
        + usize::from(*delivery != DeliveryClass::AtMostOnce)
        + usize::from(seq.is_some())
        + usize::from(expect.is_some())
        + usize::from(progress.is_some())
        + usize::from(status.is_some())
        + usize::from(reason.is_some())
        + usize::from(trace.is_some())
        + usize::from(session_id.is_some())
        + usize::from(customer_id.is_some())
        + usize::from(!headers.is_empty())
        + usize::from(content_encoding.is_some())
        + usize::from(!payload.is_empty())
        + usize::from(token.is_some())
        + usize::from(signature.is_some())
        + usize::from(encryption.is_some());
    let _ = w::write_map_len(out, fields as u32);
    key(out, "version");
    if *version == PROTOCOL_VERSION {
        str(out, "1.0");
    } else {
        str(out, &version.to_string());
    }
    key(out, "id");
    bin(out, id.as_bytes());
    if let Some(id) = correlation_id {
        key(out, "correlation_id");
        bin(out, id.as_bytes());
    }
    if let Some(id) = in_reply_to {
        key(out, "in_reply_to");
        bin(out, id.as_bytes());
    }
    key(out, "from");
    str(out, from);
    if !to.is_empty() {
        key(out, "to");
        let _ = w::write_array_len(out, to.len() as u32);
        for to in to {
            str(out, to);
        }
    }
    opt_str(out, "topic", topic);
    opt_str(out, "capability", capability);
    opt_str(out, "name", name);
    key(out, "kind");
    str(out, kind.as_str());
    key(out, "performative");
    str(out, performative.as_str());
    key(out, "timestamp_ms");
    uint(out, *timestamp_ms);
    opt_uint(out, "ttl_ms", *ttl_ms);
    opt_uint(out, "deadline_ms", *deadline_ms);
    if *hops != 0 {
        key(out, "hops");
        uint(out, (*hops).into());
    }
    if *hop_limit != DEFAULT_HOP_LIMIT {
        key(out, "hop_limit");
        uint(out, (*hop_limit).into());
    }
    if *priority != Priority::Normal {
        key(out, "priority");
        str(out, priority.as_str());
    }
    if *delivery != DeliveryClass::AtMostOnce {
        key(out, "delivery");
        str(out, delivery.as_str());
    }
    if let Some(seq) = seq {
        key(out, "seq");
        let _ = w::write_map_len(out, 2);
        key(out, "epoch");
        uint(out, seq.epoch.into());
        key(out, "n");
        uint(out, seq.n);
    }
    if let Some(expect) = expect {
        key(out, "expect");
        let _ = w::write_map_len(out, 2);
        key(out, "performative");
        str(out, expect.performative.as_str());
        key(out, "timeout_ms");
        uint(out, expect.timeout_ms);
    }
    if let Some(progress) = progress {
        key(out, "progress");
        let _ = w::write_map_len(out, 1 + u32::from(progress.fraction.is_some()));
        key(out, "state");
        str(out, progress.state.as_str());
        if let Some(fraction) = progress.fraction {
            key(out, "fraction");
            let _ = w::write_f32(out, fraction);
        }
    }
    if let Some(status) = status {
        key(out, "status");
        uint(out, status.0.into());
    }
    opt_str(out, "reason", reason);
    if let Some(trace) = trace {
        key(out, "trace");
        let _ = w::write_map_len(out, 1 + u32::from(trace.tracestate.is_some()));
        key(out, "traceparent");
        trace.traceparent.with_text(|text| str(out, text));
        opt_str(out, "tracestate", &trace.tracestate);
    }
    opt_str(out, "session_id", session_id);
    opt_str(out, "customer_id", customer_id);
    if !headers.is_empty() {
        key(out, "headers");
        let _ = w::write_map_len(out, headers.len() as u32);
        for (k, v) in headers {
            str(out, k);
            str(out, v);
        }
    }
    key(out, "content_type");
    str(out, content_type);
    opt_str(out, "content_encoding", content_encoding);
    if !payload.is_empty() {
        key(out, "payload");
        bin(out, payload);
    }
    opt_str(out, "token", token);
    if let Some(sig) = signature {
        key(out, "signature");
        let _ = w::write_map_len(out, 3);
        key(out, "alg");
        str(out, &sig.alg);
        key(out, "key");
        str(out, &sig.key);
        key(out, "value");
        bin(out, &sig.value);
    }
    if let Some(enc) = encryption {
        key(out, "encryption");
        let _ = w::write_map_len(out, 3);
        key(out, "alg");
        str(out, &enc.alg);
        key(out, "inner_content_type");
        str(out, &enc.inner_content_type);
        key(out, "recipients");
        let _ = w::write_array_len(out, enc.recipients.len() as u32);
        for r in &enc.recipients {
            let _ = w::write_map_len(out, 2);
            key(out, "agent");
            str(out, &r.agent);
            key(out, "key");
            bin(out, &r.key);
        }
    }
}

fn key(out: &mut Vec<u8>, name: &str) {
    str(out, name);
}

fn str(out: &mut Vec<u8>, s: &str) {
    let _ = w::write_str(out, s);
}

fn bin(out: &mut Vec<u8>, b: &[u8]) {
    let _ = w::write_bin(out, b);
}

fn uint(out: &mut Vec<u8>, v: u64) {
    let _ = w::write_uint(out, v);
}

fn opt_str<S: AsRef<str>>(out: &mut Vec<u8>, name: &str, v: &Option<S>) {
    if let Some(v) = v {
        key(out, name);
        str(out, v.as_ref());
    }
}

fn opt_uint(out: &mut Vec<u8>, name: &str, v: Option<u64>) {
    if let Some(v) = v {
        key(out, name);
        uint(out, v);
    }
}
