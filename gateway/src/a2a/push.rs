//! A2A push notifications: a client registers a webhook for one of its tasks, and the gateway
//! posts each of the task's later updates there (the same `StreamResponse` objects a stream
//! carries), until the task ends or the config is deleted.
//!
//! - A webhook must fall under one of `[gateway.push] allow`'s URL prefixes (same scheme, host
//!   and port, a path under it); nothing else is ever requested, so a client cannot make the
//!   gateway reach an internal address. No user info, no fragment.
//! - Each delivery carries the config's `Authorization: <scheme> <credentials>` and
//!   `X-A2A-Notification-Token: <token>` when given, and, with `signing_secret_file`,
//!   `X-Chorus-Timestamp: <ms>` and `X-Chorus-Signature: sha256=<hex HMAC-SHA256 of
//!   "<timestamp>.<body>">`.
//! - An update is delivered in order, each up to `max_attempts` times with doubling waits; one
//!   that never gets a 2xx is dead-lettered (reason `max_attempts`, the update as the payload
//!   of an event envelope from the caller's identity, the webhook named in its headers) and the
//!   config is dropped: the rest of that task's updates are not sent to it.
//! - A task's configs go when it ends; one asked for an ended task is refused (-32004).
//! - Configs live in the gateway's memory: a gateway that restarts forgets them (a client
//!   registers again, or reads the task).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use chorus_sdk::durable::{DeadLetter, DeadLetterReason, write_dead_letter};
use chorus_sdk::task::TaskHandle;
use chorus_sdk::{Agent, Envelope, Kind, Performative, StatusCode};
use futures::StreamExt;
use hmac::{Hmac, Mac};
use serde_json::{Value, json};
use sha2::Sha256;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use uuid::Uuid;

use super::view::{Folded, is_terminal};
use super::{RpcError, code};
use crate::config::PushConfig;
use crate::webhook::Webhook;

/// Most tasks with push configs at once.
const MAX_TASKS: usize = 10_000;

/// One push config, as registered.
#[derive(Debug, Clone)]
struct Config {
    id: String,
    url: url::Url,
    token: Option<String>,
    /// `<scheme> <credentials>`, for the `Authorization` header.
    authorization: Option<String>,
}

impl Config {
    /// The config as A2A shows it (credentials left out).
    fn json(&self, task: Uuid) -> Value {
        let mut out = json!({"id": self.id, "taskId": task.to_string(), "url": self.url.as_str()});
        if let Some(token) = &self.token {
            out["token"] = json!(token);
        }
        if let Some(scheme) = self
            .authorization
            .as_deref()
            .and_then(|a| a.split(' ').next())
        {
            out["authentication"] = json!({"scheme": scheme});
        }
        out
    }
}

#[derive(Debug, Default)]
struct TaskPush {
    configs: BTreeMap<String, Config>,
    watched: bool,
}

/// The gateway's push notifications: configs by task, and a watcher per task that has any.
pub(crate) struct Push {
    config: PushConfig,
    allow: Vec<Webhook>,
    secret: Option<Vec<u8>>,
    client: reqwest::Client,
    tasks: Mutex<HashMap<Uuid, TaskPush>>,
    tracker: TaskTracker,
    stop: CancellationToken,
}

impl std::fmt::Debug for Push {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Push")
            .field("allow", &self.allow)
            .finish_non_exhaustive()
    }
}

fn invalid(what: impl Into<String>) -> RpcError {
    RpcError::new(code::INVALID_PARAMS, what)
}

/// A string param, if given and not empty.
fn text<'a>(params: &'a Value, name: &str) -> Result<Option<&'a str>, RpcError> {
    match params.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(format!("{name}: a string"))),
    }
}

impl Push {
    /// The gateway's push notifications as `config` says, run on `tracker` until `stop`.
    ///
    /// # Errors
    /// A message naming the file when the signing secret or the CA file cannot be read.
    pub(crate) fn new(
        config: &PushConfig,
        tracker: TaskTracker,
        stop: CancellationToken,
    ) -> Result<Self, String> {
        let allow = config
            .allow
            .iter()
            .map(|p| Webhook::prefix(p))
            .collect::<Result<Vec<_>, _>>()?;
        let secret = match &config.signing_secret_file {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("signing_secret_file {}: {e}", path.display()))?;
                let secret = text.trim().as_bytes().to_vec();
                if secret.len() < 32 {
                    return Err(format!(
                        "signing_secret_file {}: at least 32 bytes",
                        path.display()
                    ));
                }
                Some(secret)
            }
            None => None,
        };
        let client = crate::https::client(
            config.ca_file.as_deref(),
            Duration::from_millis(config.timeout_ms),
        )
        .map_err(|e| format!("ca_file {e}"))?;
        Ok(Push {
            config: config.clone(),
            allow,
            secret,
            client,
            tasks: Mutex::new(HashMap::new()),
            tracker,
            stop,
        })
    }

    fn tasks(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, TaskPush>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A config from a client's `TaskPushNotificationConfig` (its `url` checked).
    fn config_of(&self, params: &Value) -> Result<Config, RpcError> {
        let url = text(params, "url")?.ok_or_else(|| invalid("url is required"))?;
        let (hook, url) = Webhook::parse(url).map_err(|e| invalid(format!("url: {e}")))?;
        if !self.allow.iter().any(|prefix| hook.under(prefix)) {
            return Err(invalid(format!(
                "url: {url} is not under a webhook prefix this gateway allows"
            )));
        }
        let authorization = match params.get("authentication") {
            None | Some(Value::Null) => None,
            Some(auth) => {
                let scheme = text(auth, "scheme")?
                    .ok_or_else(|| invalid("authentication.scheme is required"))?;
                let credentials = text(auth, "credentials")?.unwrap_or_default();
                let line = format!("{scheme} {credentials}");
                if !scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                    || line.chars().any(char::is_control)
                {
                    return Err(invalid(
                        "authentication: a scheme name and one line of credentials",
                    ));
                }
                Some(line.trim_end().to_owned())
            }
        };
        let token = text(params, "token")?.map(str::to_owned);
        if token
            .as_deref()
            .is_some_and(|t| t.chars().any(char::is_control) || t.len() > 1024)
        {
            return Err(invalid("token: one line, at most 1024 bytes"));
        }
        let id = match text(params, "id")? {
            Some(id)
                if id.len() <= 128
                    && id
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) =>
            {
                id.to_owned()
            }
            Some(_) => return Err(invalid("id: up to 128 letters, digits, '-', '_' and '.'")),
            None => Uuid::now_v7().to_string(),
        };
        Ok(Config {
            id,
            url,
            token,
            authorization,
        })
    }

    /// Whether a client's config would be taken (its URL allowed, its fields well formed).
    pub(super) fn check(&self, params: &Value) -> Result<(), RpcError> {
        self.config_of(params).map(|_| ())
    }

    /// Registers a config for the task `handle` names, whose messages so far are folded in
    /// `folded`; starts its watcher unless it has one.
    pub(super) fn create(
        self: &Arc<Self>,
        agent: &Agent,
        handle: TaskHandle,
        folded: Folded,
        params: &Value,
    ) -> Result<Value, RpcError> {
        let config = self.config_of(params)?;
        let task = folded.id;
        // A finished task has no update left to send: a config for it would never be used,
        // and nothing would ever remove it.
        if is_terminal(folded.state) {
            return Err(RpcError::new(
                code::UNSUPPORTED,
                format!(
                    "task {task} is {}: no update will follow",
                    folded.state.as_str()
                ),
            ));
        }
        let answer = config.json(task);
        let start = {
            let mut tasks = self.tasks();
            if !tasks.contains_key(&task) && tasks.len() >= MAX_TASKS {
                return Err(RpcError::new(
                    code::INTERNAL,
                    "too many tasks have push configs on this gateway",
                ));
            }
            let entry = tasks.entry(task).or_default();
            if !entry.configs.contains_key(&config.id)
                && entry.configs.len() >= self.config.max_configs_per_task
            {
                return Err(invalid(format!(
                    "task {task} has {} push configs already",
                    entry.configs.len()
                )));
            }
            entry.configs.insert(config.id.clone(), config);
            let start = !entry.watched;
            entry.watched |= start;
            start
        };
        if start {
            let push = Arc::clone(self);
            let agent = agent.clone();
            self.tracker
                .spawn(async move { push.watch(agent, handle, folded).await });
        }
        Ok(answer)
    }

    /// The config `id` of `task`.
    pub(super) fn get(&self, task: Uuid, id: &str) -> Result<Value, RpcError> {
        self.tasks()
            .get(&task)
            .and_then(|t| t.configs.get(id))
            .map(|c| c.json(task))
            .ok_or_else(|| {
                RpcError::new(
                    code::TASK_NOT_FOUND,
                    format!("no push config {id} for task {task}"),
                )
            })
    }

    /// Every config of `task`.
    pub(super) fn list(&self, task: Uuid) -> Value {
        let configs: Vec<Value> = self
            .tasks()
            .get(&task)
            .map(|t| t.configs.values().map(|c| c.json(task)).collect())
            .unwrap_or_default();
        json!({"configs": configs, "nextPageToken": ""})
    }

    /// Removes the config `id` of `task` (nothing if there is none: deleting twice is fine).
    pub(super) fn delete(&self, task: Uuid, id: &str) {
        if let Some(t) = self.tasks().get_mut(&task) {
            t.configs.remove(id);
        }
    }

    /// Follows the task and delivers each update to its configs, until it ends, its configs
    /// are gone, or the gateway stops.
    async fn watch(self: Arc<Self>, agent: Agent, handle: TaskHandle, mut folded: Folded) {
        let task = folded.id;
        let mut updates = match handle.updates_after(folded.last_seq).await {
            Ok(updates) => updates,
            Err(err) => {
                tracing::warn!(%task, error = %chorus_sdk::Report(&err), "push: the task cannot be followed");
                self.tasks().remove(&task);
                return;
            }
        };
        loop {
            let next = tokio::select! {
                () = self.stop.cancelled() => break,
                next = updates.next() => next,
            };
            let Some(Ok(update)) = next else { break };
            let ended = update.state().is_some_and(is_terminal);
            for event in folded.apply(&update) {
                let configs: Vec<Config> = match self.tasks().get(&task) {
                    Some(t) if !t.configs.is_empty() => t.configs.values().cloned().collect(),
                    _ => Vec::new(),
                };
                if configs.is_empty() {
                    break;
                }
                let body = Bytes::from(event.to_string());
                for config in configs {
                    if !self.deliver(&config, &body).await {
                        self.dead_letter(&agent, task, &config, &body).await;
                        if let Some(t) = self.tasks().get_mut(&task) {
                            t.configs.remove(&config.id);
                        }
                    }
                }
            }
            if ended || self.tasks().get(&task).is_none_or(|t| t.configs.is_empty()) {
                break;
            }
        }
        updates.close().await;
        self.tasks().remove(&task);
    }

    /// Posts `body` to the config's webhook until it answers 2xx or the attempts run out.
    async fn deliver(&self, config: &Config, body: &Bytes) -> bool {
        let mut wait = Duration::from_millis(self.config.first_backoff_ms);
        let most = Duration::from_millis(self.config.max_backoff_ms);
        for attempt in 1..=self.config.max_attempts {
            let mut request = self
                .client
                .post(config.url.clone())
                .header("content-type", "application/json")
                .body(body.clone());
            if let Some(auth) = &config.authorization {
                request = request.header("authorization", auth);
            }
            if let Some(token) = &config.token {
                request = request.header("x-a2a-notification-token", token);
            }
            if let Some((at, signature)) = self.secret.as_deref().and_then(|s| sign(s, body)) {
                request = request
                    .header("x-chorus-timestamp", at)
                    .header("x-chorus-signature", signature);
            }
            match request.send().await {
                Ok(answer) if answer.status().is_success() => return true,
                Ok(answer) => {
                    tracing::debug!(url = %config.url, attempt, status = %answer.status(), "push delivery refused");
                }
                Err(err) => {
                    tracing::debug!(url = %config.url, attempt, error = %chorus_sdk::Report(&err), "push delivery failed");
                }
            }
            if attempt < self.config.max_attempts {
                tokio::select! {
                    () = self.stop.cancelled() => return false,
                    () = tokio::time::sleep(wait) => {}
                }
                wait = (wait * 2).min(most);
            }
        }
        false
    }

    /// Keeps an update no webhook took in the dead-letter stream.
    async fn dead_letter(&self, agent: &Agent, task: Uuid, config: &Config, body: &Bytes) {
        let mut url = config.url.clone();
        url.set_query(None);
        let mut env = Envelope::new(Kind::Event, Performative::Inform, agent.id());
        env.correlation_id = Some(task);
        env.content_type = chorus_sdk::envelope::CONTENT_TYPE_JSON.into();
        env.payload = body.clone();
        env.headers
            .insert("a2a-push-webhook".into(), url.to_string());
        env.headers
            .insert("a2a-push-config".into(), config.id.clone());
        let bytes = match chorus_sdk::codec::encode(&env, chorus_sdk::Encoding::Json) {
            Ok(bytes) => bytes,
            Err(err) => {
                tracing::warn!(%task, error = %chorus_sdk::Report(&err), "push: a dead letter cannot be encoded");
                return;
            }
        };
        let now = chorus_sdk::envelope::now_ms();
        let letter = DeadLetter {
            reason: DeadLetterReason::MaxAttempts,
            status: StatusCode::UNAVAILABLE,
            detail: format!(
                "A2A push to {url}: no 2xx answer in {} attempts",
                self.config.max_attempts
            ),
            agent: agent.id().to_owned(),
            subject: agent
                .subjects()
                .dead_letter(&format!("a2a.push.{task}"))
                .unwrap_or_default(),
            envelope: bytes,
            headers: Vec::new(),
            message_id: Some(env.id),
            attempts: u64::from(self.config.max_attempts),
            stored_ms: now,
            dead_lettered_ms: now,
            source: None,
            omitted: None,
        };
        let broker = agent.broker();
        let js = broker.jetstream(chorus_sdk::JETSTREAM_TIMEOUT);
        match write_dead_letter(&js, agent.subjects(), &letter, broker.max_payload()).await {
            Ok(_) => {
                tracing::warn!(%task, %url, "push: an update no webhook took was dead-lettered")
            }
            Err(err) => {
                tracing::warn!(%task, %url, error = %chorus_sdk::Report(&err), "push: a dead letter was not written")
            }
        }
    }
}

/// The timestamp (ms) and `sha256=<hex>` HMAC of `<timestamp>.<body>` under `secret` (HMAC
/// takes a key of any length: `None` does not happen).
fn sign(secret: &[u8], body: &[u8]) -> Option<(String, String)> {
    let at = chorus_sdk::envelope::now_ms().to_string();
    let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).ok()?;
    mac.update(at.as_bytes());
    mac.update(b".");
    mac.update(body);
    let signature = format!("sha256={}", hex::encode(mac.finalize().into_bytes()));
    Some((at, signature))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_is_the_hmac_of_the_timestamp_and_body() {
        let secret = b"0123456789abcdef0123456789abcdef";
        let (at, signature) = sign(secret, b"{}").expect("signed");
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("a key");
        mac.update(format!("{at}.{{}}").as_bytes());
        assert_eq!(
            signature,
            format!("sha256={}", hex::encode(mac.finalize().into_bytes()))
        );
    }
}
