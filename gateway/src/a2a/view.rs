//! A Chorus task as A2A shows it, made from the task's messages in the task stream: the
//! state, the messages exchanged (`history`), what was streamed and the result (`artifacts`),
//! and the stream events of each new message.
//!
//! - The context is the submission's session (`session_id`): a client's `contextId`, or the
//!   task id when the client gave none.
//! - History: the user's message (the submission's input, with the client's `messageId`), each
//!   answer to a question (user), and each agent message the task carried: progress with
//!   text, a question, a failure's reason.
//! - Artifacts: the chunks streamed, in order, as one `stream` artifact (a new attempt's
//!   chunks replace an earlier attempt's), then the `result`.
//! - A JSON result that is not text is a data part with a text part beside it (its JSON), so
//!   a client that reads text sees it too.
//! - Every timestamp is when the task stream stored the message: they never run backwards.

use chorus_sdk::TaskState;
use chorus_sdk::task::{TaskMessage, TaskUpdate};
use serde_json::{Value, json};
use uuid::Uuid;

use crate::tasks::json_of;

/// The header of a submission that keeps the client's `messageId`.
pub(super) const MESSAGE_ID_HEADER: &str = "a2a-message-id";

/// The A2A name of a Chorus state: submitted and accepted are `TASK_STATE_SUBMITTED`, expired
/// is failed (its status message says why).
pub(super) fn a2a_state(state: TaskState) -> &'static str {
    match state {
        TaskState::Working | TaskState::Running => "TASK_STATE_WORKING",
        TaskState::InputRequired => "TASK_STATE_INPUT_REQUIRED",
        TaskState::Completed => "TASK_STATE_COMPLETED",
        TaskState::Failed | TaskState::Expired => "TASK_STATE_FAILED",
        TaskState::Cancelled => "TASK_STATE_CANCELED",
        TaskState::Rejected => "TASK_STATE_REJECTED",
        _ => "TASK_STATE_SUBMITTED",
    }
}

/// The Chorus states an A2A state filter matches (`None`: not an A2A state).
pub(super) fn states_of(a2a: &str) -> Option<&'static [TaskState]> {
    Some(match a2a {
        "TASK_STATE_SUBMITTED" => &[TaskState::Submitted, TaskState::Accepted],
        "TASK_STATE_WORKING" => &[TaskState::Working, TaskState::Running],
        "TASK_STATE_INPUT_REQUIRED" => &[TaskState::InputRequired],
        "TASK_STATE_COMPLETED" => &[TaskState::Completed],
        "TASK_STATE_FAILED" => &[TaskState::Failed, TaskState::Expired],
        "TASK_STATE_CANCELED" => &[TaskState::Cancelled],
        "TASK_STATE_REJECTED" => &[TaskState::Rejected],
        _ => return None,
    })
}

pub(super) fn is_terminal(state: TaskState) -> bool {
    matches!(
        state,
        TaskState::Completed
            | TaskState::Failed
            | TaskState::Cancelled
            | TaskState::Rejected
            | TaskState::Expired
    )
}

/// Where a stream or a blocking send stops: a final state, or a question.
pub(super) fn stops(state: TaskState) -> bool {
    is_terminal(state) || state == TaskState::InputRequired
}

/// The parts holding `value`: a text part for a string; otherwise a data part and its JSON as
/// text beside it.
pub(super) fn parts(value: &Value) -> Vec<Value> {
    match value {
        Value::String(s) => vec![json!({"text": s})],
        other => vec![
            json!({"text": other.to_string(), "mediaType": "text/plain"}),
            json!({"data": other, "mediaType": "application/json"}),
        ],
    }
}

fn timestamp(ms: u64) -> String {
    chorus_sdk::envelope::rfc3339(ms)
}

/// What a task's messages say, folded: enough for its A2A task and its later events.
#[derive(Debug)]
pub(super) struct Folded {
    pub(super) id: Uuid,
    pub(super) context: String,
    pub(super) state: TaskState,
    /// The sequence of the last status message.
    pub(super) state_seq: u64,
    /// The sequence of the last message of any kind.
    pub(super) last_seq: u64,
    status: Value,
    history: Vec<Value>,
    stream: Vec<Value>,
    result: Option<Value>,
}

/// The text of a status message: its reason, or for an expiry without one, why.
fn status_text(state: TaskState, u: &TaskUpdate) -> Option<String> {
    match (u.text().filter(|t| !t.is_empty()), state) {
        (Some(t), _) => Some(t.to_owned()),
        (None, TaskState::Expired) => Some("the task's deadline passed".to_owned()),
        _ => None,
    }
}

impl Folded {
    /// The folded view of a task's messages, oldest first (the first is its submission).
    pub(super) fn new(id: Uuid, updates: &[TaskUpdate]) -> Self {
        let context = updates
            .first()
            .and_then(|u| u.envelope.session_id.clone())
            .unwrap_or_else(|| id.to_string());
        let mut folded = Folded {
            id,
            context,
            state: TaskState::Submitted,
            state_seq: 0,
            last_seq: 0,
            status: Value::Null,
            history: Vec::new(),
            stream: Vec::new(),
            result: None,
        };
        for u in updates {
            folded.apply(u);
        }
        folded
    }

    /// An agent message of this task with `parts`.
    fn agent_message(&self, message_id: String, parts: Vec<Value>) -> Value {
        json!({
            "messageId": message_id,
            "role": "ROLE_AGENT",
            "parts": parts,
            "taskId": self.id.to_string(),
            "contextId": self.context,
        })
    }

    fn user_message(&self, message_id: String, value: &Value) -> Value {
        json!({
            "messageId": message_id,
            "role": "ROLE_USER",
            "parts": parts(value),
            "taskId": self.id.to_string(),
            "contextId": self.context,
        })
    }

    /// Folds one more message in; returns the stream events it makes (none for the kinds A2A
    /// has no word for).
    pub(super) fn apply(&mut self, u: &TaskUpdate) -> Vec<Value> {
        self.last_seq = self.last_seq.max(u.seq);
        let payload = json_of(&u.envelope.payload, &u.envelope.content_type);
        let id = self.id.to_string();
        match u.kind {
            TaskMessage::Status => {
                let state = u.state().unwrap_or(TaskState::Unknown);
                let submission = self.state_seq == 0;
                self.state = state;
                self.state_seq = u.seq;
                let mut events = Vec::new();
                if submission {
                    let message_id = u
                        .envelope
                        .headers
                        .get(MESSAGE_ID_HEADER)
                        .cloned()
                        .unwrap_or_else(|| u.envelope.id.to_string());
                    let message = self.user_message(message_id, &payload);
                    self.history.push(message);
                }
                let mut message_parts = Vec::new();
                if state != TaskState::Completed
                    && let Some(text) = status_text(state, u)
                {
                    message_parts.push(json!({"text": text}));
                }
                if state == TaskState::InputRequired && !payload.is_null() {
                    message_parts.extend(parts(&payload));
                }
                if state == TaskState::Completed && !payload.is_null() {
                    let artifact = json!({
                        "artifactId": format!("{id}-result"),
                        "name": "result",
                        "parts": parts(&payload),
                    });
                    events.push(json!({"artifactUpdate": {
                        "taskId": id, "contextId": self.context,
                        "artifact": artifact, "lastChunk": true,
                    }}));
                    self.result = Some(artifact);
                }
                let mut status =
                    json!({"state": a2a_state(state), "timestamp": timestamp(u.stored_ms)});
                if !message_parts.is_empty() && !submission {
                    let message = self.agent_message(u.envelope.id.to_string(), message_parts);
                    self.history.push(message.clone());
                    status["message"] = message;
                }
                self.status = status.clone();
                events.push(json!({"statusUpdate": {
                    "taskId": id, "contextId": self.context, "status": status,
                }}));
                events
            }
            TaskMessage::Progress => {
                let mut status = json!({
                    "state": a2a_state(TaskState::Working),
                    "timestamp": timestamp(u.stored_ms),
                });
                if let Some(text) = u.text().filter(|t| !t.is_empty()) {
                    let message =
                        self.agent_message(u.envelope.id.to_string(), vec![json!({"text": text})]);
                    self.history.push(message.clone());
                    status["message"] = message;
                }
                vec![json!({"statusUpdate": {
                    "taskId": id, "contextId": self.context, "status": status,
                }})]
            }
            TaskMessage::Chunk => {
                let n = u.chunk().unwrap_or(1);
                if n <= 1 {
                    // A new attempt streams from its start.
                    self.stream.clear();
                }
                let chunk_parts = match &payload {
                    Value::String(s) => vec![json!({"text": s})],
                    other => vec![json!({"data": other, "mediaType": "application/json"})],
                };
                self.stream.extend(chunk_parts.iter().cloned());
                vec![json!({"artifactUpdate": {
                    "taskId": id, "contextId": self.context,
                    "artifact": {"artifactId": format!("{id}-stream"), "name": "stream", "parts": chunk_parts},
                    "append": n > 1,
                    "lastChunk": u.is_last_chunk(),
                }})]
            }
            TaskMessage::Input => {
                let message = self.user_message(u.envelope.id.to_string(), &payload);
                self.history.push(message);
                Vec::new()
            }
            _ => Vec::new(),
        }
    }

    /// The A2A task: its last `history` messages (all when `None`), and its artifacts when
    /// `artifacts` is set.
    pub(super) fn task(&self, history: Option<usize>, artifacts: bool) -> Value {
        let mut task = json!({
            "id": self.id.to_string(),
            "contextId": self.context,
            "status": self.status,
        });
        let keep = history.map_or(self.history.len(), |n| n.min(self.history.len()));
        if keep > 0 {
            task["history"] = Value::Array(self.history[self.history.len() - keep..].to_vec());
        }
        if artifacts {
            let mut list = Vec::new();
            if !self.stream.is_empty() {
                list.push(json!({
                    "artifactId": format!("{}-stream", self.id),
                    "name": "stream",
                    "parts": self.stream,
                }));
            }
            list.extend(self.result.iter().cloned());
            if !list.is_empty() {
                task["artifacts"] = Value::Array(list);
            }
        }
        task
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chorus_sdk::envelope::{Envelope, Kind, Performative, Progress};

    fn update(
        seq: u64,
        kind: TaskMessage,
        state: Option<TaskState>,
        payload: &Value,
    ) -> TaskUpdate {
        let mut env = Envelope::new(Kind::Event, Performative::Inform, "worker");
        env.progress = state.map(|state| Progress {
            state,
            fraction: None,
        });
        env.content_type = "application/json".into();
        env.payload = serde_json::to_vec(payload).expect("as built").into();
        TaskUpdate {
            seq,
            stored_ms: 1_700_000_000_000 + seq,
            kind,
            envelope: env,
        }
    }

    fn chunk(seq: u64, n: u64, text: &str) -> TaskUpdate {
        let mut u = update(seq, TaskMessage::Chunk, None, &json!(text));
        u.envelope.seq = Some(chorus_sdk::envelope::Sequence { n, epoch: 0 });
        u
    }

    #[test]
    fn the_final_task_carries_the_chunks_in_order_then_the_result_beside_its_text() {
        let id = Uuid::now_v7();
        let mut submission = update(
            1,
            TaskMessage::Status,
            Some(TaskState::Submitted),
            &json!("hi"),
        );
        submission.envelope.session_id = Some("ctx-1".into());
        submission
            .envelope
            .headers
            .insert(MESSAGE_ID_HEADER.into(), "m-1".into());
        let updates = vec![
            submission,
            update(
                2,
                TaskMessage::Status,
                Some(TaskState::Working),
                &Value::Null,
            ),
            chunk(3, 1, "one "),
            chunk(4, 2, "two "),
            chunk(5, 3, "three"),
            update(
                6,
                TaskMessage::Status,
                Some(TaskState::Completed),
                &json!({"n": 3}),
            ),
        ];
        let task = Folded::new(id, &updates).task(None, true);
        assert_eq!(task["contextId"], "ctx-1");
        assert_eq!(task["status"]["state"], "TASK_STATE_COMPLETED");
        let artifacts = task["artifacts"].as_array().expect("as built");
        let stream: Vec<&str> = artifacts[0]["parts"]
            .as_array()
            .expect("as built")
            .iter()
            .map(|p| p["text"].as_str().expect("as built"))
            .collect();
        assert_eq!(stream, ["one ", "two ", "three"]);
        assert_eq!(artifacts[1]["parts"][0]["text"], r#"{"n":3}"#);
        assert_eq!(artifacts[1]["parts"][1]["data"], json!({"n": 3}));
        assert_eq!(task["history"][0]["messageId"], "m-1");
        assert_eq!(task["history"][0]["role"], "ROLE_USER");
        // Without artifacts (a listing's default), and with the last message only.
        let short = Folded::new(id, &updates).task(Some(1), false);
        assert!(short.get("artifacts").is_none());
        assert_eq!(short["history"].as_array().expect("as built").len(), 1);
        assert!(
            Folded::new(id, &updates)
                .task(Some(0), false)
                .get("history")
                .is_none()
        );
    }

    #[test]
    fn a_new_attempt_streams_over_the_last_and_a_question_is_an_agent_message() {
        let id = Uuid::now_v7();
        let mut question = update(
            6,
            TaskMessage::Status,
            Some(TaskState::InputRequired),
            &json!("which?"),
        );
        question.envelope.reason = Some("a question".into());
        let updates = vec![
            update(
                1,
                TaskMessage::Status,
                Some(TaskState::Submitted),
                &json!("go"),
            ),
            chunk(2, 1, "old"),
            update(
                3,
                TaskMessage::Status,
                Some(TaskState::Submitted),
                &Value::Null,
            ),
            chunk(4, 1, "new"),
            chunk(5, 2, "er"),
            question,
        ];
        let folded = Folded::new(id, &updates);
        let task = folded.task(None, true);
        assert_eq!(task["contextId"], id.to_string());
        assert_eq!(
            task["artifacts"][0]["parts"]
                .as_array()
                .expect("as built")
                .len(),
            2
        );
        assert_eq!(task["status"]["state"], "TASK_STATE_INPUT_REQUIRED");
        assert_eq!(task["status"]["message"]["role"], "ROLE_AGENT");
        assert_eq!(task["status"]["message"]["parts"][0]["text"], "a question");
        assert_eq!(folded.state_seq, 6);
        assert_eq!(states_of("TASK_STATE_FAILED").expect("as built").len(), 2);
        assert!(states_of("done").is_none());
    }
}
