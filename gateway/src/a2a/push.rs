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
//! - Configs are kept in JetStream, in the key-value bucket `<root>_a2a_push`, each under
//!   `<identity>.<task>.<config id>` with the last update delivered to it: a config is
//!   answered once the server has it, and a gateway that restarts reads its identities' configs
//!   back and goes on from the first update each has not had. An identity's credentials reach
//!   its own keys only (`chorus creds <identity> --gateway`): the credentials a webhook was
//!   given are readable by that identity's user and the coordinator's, nobody else's.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use chorus_broker_adapter::jetstream::{Kv, KvSpec};
use chorus_sdk::durable::{DeadLetter, DeadLetterReason, write_dead_letter};
use chorus_sdk::task::TaskHandle;
use chorus_sdk::{Agent, Envelope, Kind, Performative, StatusCode};
use futures::StreamExt;
use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
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

/// The key-value bucket (under the root) that keeps push configs.
pub const PUSH_BUCKET: &str = "a2a_push";

/// Most messages of a task read back to resume its pushes after a restart.
const MAX_RESUME_MESSAGES: usize = 10_000;

/// A config as kept in the bucket: what it was given, and the sequence of the last task
/// message whose updates were delivered to it.
#[derive(Debug, Serialize, Deserialize)]
struct Record {
    url: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    token: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    authorization: Option<String>,
    delivered_seq: u64,
}

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

#[derive(Debug)]
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
    /// Each identity's view of the bucket, through its own connection.
    stores: Mutex<HashMap<String, Kv>>,
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
            stores: Mutex::new(HashMap::new()),
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
                    && id.split('.').all(|t| {
                        !t.is_empty()
                            && t.chars()
                                .all(|c| c.is_ascii_alphanumeric() || "-_".contains(c))
                    }) =>
            {
                id.to_owned()
            }
            Some(_) => {
                return Err(invalid(
                    "id: up to 128 letters, digits, '-', '_' and '.' (not first, last or twice in a row)",
                ));
            }
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

    /// The bucket key of config `id` of `task`, registered by `identity`'s caller.
    fn key(identity: &str, task: Uuid, id: &str) -> String {
        format!("{identity}.{task}.{id}")
    }

    /// `identity`'s view of the bucket.
    fn store(&self, identity: &str) -> Result<Kv, RpcError> {
        self.stores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(identity)
            .cloned()
            .ok_or_else(|| {
                RpcError::new(
                    code::INTERNAL,
                    format!("push configs cannot be kept for {identity} on this gateway"),
                )
            })
    }

    /// Keeps `config` of `task` in `store` with the last delivered message `delivered_seq`.
    async fn keep(
        store: &Kv,
        identity: &str,
        task: Uuid,
        config: &Config,
        delivered_seq: u64,
    ) -> chorus_broker_adapter::Result<()> {
        let record = Record {
            url: config.url.to_string(),
            token: config.token.clone(),
            authorization: config.authorization.clone(),
            delivered_seq,
        };
        let bytes = serde_json::to_vec(&record).unwrap_or_default();
        store
            .put(&Self::key(identity, task, &config.id), Bytes::from(bytes))
            .await
            .map(|_| ())
    }

    /// Opens the bucket for `agent`'s identity (making it if it is missing) and resumes the
    /// pushes its callers registered before the gateway last stopped: each from the first
    /// update its configs have not had. Configs of tasks that are gone or ended, or whose
    /// webhook this gateway no longer allows, are removed.
    ///
    /// # Errors
    /// A message naming the identity when the bucket cannot be opened or read (its
    /// credentials, most often: `chorus creds <identity> --gateway`).
    pub(crate) async fn open(self: &Arc<Self>, agent: &Agent) -> Result<(), String> {
        let identity = agent.id().to_owned();
        let why = |e: &dyn std::fmt::Display| {
            format!(
                "identity {identity} cannot keep A2A push configs in JetStream ({e}); its NATS user needs `chorus creds {identity} --gateway`"
            )
        };
        let spec = KvSpec {
            description: "A2A push notification configs, by gateway identity".into(),
            ..KvSpec::new(agent.subjects().bucket_name(PUSH_BUCKET))
        };
        let store = agent
            .broker()
            .jetstream(chorus_sdk::JETSTREAM_TIMEOUT)
            .ensure_kv_exists(&spec)
            .await
            .map_err(|e| why(&chorus_sdk::Report(&e)))?;
        let entries = store
            .entries_under(&identity)
            .await
            .map_err(|e| why(&chorus_sdk::Report(&e)))?;
        self.stores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(identity.clone(), store.clone());
        let mut by_task: BTreeMap<Uuid, Vec<(Config, u64)>> = BTreeMap::new();
        for entry in entries {
            match self.config_of_record(&identity, &entry.key, &entry.value) {
                Some((task, config, delivered)) => {
                    by_task.entry(task).or_default().push((config, delivered));
                }
                None => {
                    tracing::warn!(key = %entry.key, "push: a kept config this gateway no longer takes is removed");
                    let _ = store.delete(&entry.key).await;
                }
            }
        }
        let mut resumed = 0usize;
        for (task, configs) in by_task {
            let forget = || async {
                for (config, _) in &configs {
                    let _ = store.delete(&Self::key(&identity, task, &config.id)).await;
                }
            };
            let handle = match agent.task(task).await {
                Ok(handle) => handle,
                Err(chorus_sdk::SdkError::TaskNotFound(_)) => {
                    forget().await;
                    continue;
                }
                Err(err) => {
                    tracing::warn!(%task, error = %chorus_sdk::Report(&err), "push: a kept task cannot be read; its configs wait for the next start");
                    continue;
                }
            };
            let mut updates = match handle.history(MAX_RESUME_MESSAGES).await {
                Ok(updates) => updates,
                Err(err) => {
                    tracing::warn!(%task, error = %chorus_sdk::Report(&err), "push: a kept task cannot be read; its configs wait for the next start");
                    continue;
                }
            };
            let delivered = configs.iter().map(|(_, d)| *d).min().unwrap_or_default();
            updates.truncate(updates.partition_point(|u| u.seq <= delivered));
            let folded = Folded::new(task, &updates);
            if updates.is_empty() || is_terminal(folded.state) {
                forget().await;
                continue;
            }
            self.tasks().insert(
                task,
                TaskPush {
                    configs: configs
                        .into_iter()
                        .map(|(c, _)| (c.id.clone(), c))
                        .collect(),
                    watched: true,
                },
            );
            let push = Arc::clone(self);
            let (agent, store) = (agent.clone(), store.clone());
            self.tracker
                .spawn(async move { push.watch(agent, handle, folded, store).await });
            resumed += 1;
        }
        if resumed > 0 {
            tracing::info!(%identity, tasks = resumed, "push: resumed the kept configs");
        }
        Ok(())
    }

    /// A kept entry read back: its task, its config (the webhook still allowed) and the last
    /// message delivered to it; `None` when it no longer reads as one.
    fn config_of_record(
        &self,
        identity: &str,
        key: &str,
        value: &[u8],
    ) -> Option<(Uuid, Config, u64)> {
        let rest = key.strip_prefix(identity)?.strip_prefix('.')?;
        let (task, id) = rest.split_once('.')?;
        let task: Uuid = task.parse().ok()?;
        let record: Record = serde_json::from_slice(value).ok()?;
        let (hook, url) = Webhook::parse(&record.url).ok()?;
        if !self.allow.iter().any(|prefix| hook.under(prefix)) {
            return None;
        }
        Some((
            task,
            Config {
                id: id.to_owned(),
                url,
                token: record.token,
                authorization: record.authorization,
            },
            record.delivered_seq,
        ))
    }

    /// Registers a config for the task `handle` names, whose messages so far are folded in
    /// `folded`, kept in JetStream before it is answered; starts its watcher unless it has
    /// one.
    pub(super) async fn create(
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
        let identity = agent.id().to_owned();
        let store = self.store(&identity)?;
        {
            let tasks = self.tasks();
            if !tasks.contains_key(&task) && tasks.len() >= MAX_TASKS {
                return Err(RpcError::new(
                    code::INTERNAL,
                    "too many tasks have push configs on this gateway",
                ));
            }
            if let Some(entry) = tasks.get(&task)
                && !entry.configs.contains_key(&config.id)
                && entry.configs.len() >= self.config.max_configs_per_task
            {
                return Err(invalid(format!(
                    "task {task} has {} push configs already",
                    entry.configs.len()
                )));
            }
        }
        Self::keep(&store, &identity, task, &config, folded.last_seq)
            .await
            .map_err(|e| {
                RpcError::new(
                    code::INTERNAL,
                    format!("the push config was not kept: {}", chorus_sdk::Report(&e)),
                )
            })?;
        let answer = config.json(task);
        let start = {
            let mut tasks = self.tasks();
            let entry = tasks.entry(task).or_insert_with(|| TaskPush {
                configs: BTreeMap::new(),
                watched: false,
            });
            entry.configs.insert(config.id.clone(), config);
            let start = !entry.watched;
            entry.watched |= start;
            start
        };
        if start {
            let push = Arc::clone(self);
            let agent = agent.clone();
            self.tracker
                .spawn(async move { push.watch(agent, handle, folded, store).await });
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

    /// Removes the config `id` of `task`, from memory and from the bucket (nothing if there
    /// is none: deleting twice is fine).
    pub(super) async fn delete(&self, agent: &Agent, task: Uuid, id: &str) -> Result<(), RpcError> {
        if let Some(t) = self.tasks().get_mut(&task) {
            t.configs.remove(id);
        }
        let store = self.store(agent.id())?;
        store
            .delete(&Self::key(agent.id(), task, id))
            .await
            .map_err(|e| {
                RpcError::new(
                    code::INTERNAL,
                    format!(
                        "the push config was not removed: {}",
                        chorus_sdk::Report(&e)
                    ),
                )
            })
    }

    /// Follows the task and delivers each update to its configs, until it ends, its configs
    /// are gone, or the gateway stops; each config's progress is kept after each update it
    /// had, and its record removed when the task ends or its webhook gives up (a gateway
    /// that stops keeps them, to go on when it starts again).
    async fn watch(
        self: Arc<Self>,
        agent: Agent,
        handle: TaskHandle,
        mut folded: Folded,
        store: Kv,
    ) {
        let task = folded.id;
        let identity = agent.id().to_owned();
        let mut updates = match handle.updates_after(folded.last_seq).await {
            Ok(updates) => updates,
            Err(err) => {
                tracing::warn!(%task, error = %chorus_sdk::Report(&err), "push: the task cannot be followed");
                self.tasks().remove(&task);
                return;
            }
        };
        let mut ended = false;
        loop {
            let next = tokio::select! {
                () = self.stop.cancelled() => break,
                next = updates.next() => next,
            };
            let Some(Ok(update)) = next else { break };
            ended = update.state().is_some_and(is_terminal);
            let mut delivered = false;
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
                    if self.deliver(&config, &body).await {
                        delivered = true;
                    } else {
                        self.dead_letter(&agent, task, &config, &body).await;
                        if let Some(t) = self.tasks().get_mut(&task) {
                            t.configs.remove(&config.id);
                        }
                        let _ = store.delete(&Self::key(&identity, task, &config.id)).await;
                    }
                }
            }
            if delivered && !ended {
                let configs: Vec<Config> = self
                    .tasks()
                    .get(&task)
                    .map(|t| t.configs.values().cloned().collect())
                    .unwrap_or_default();
                for config in &configs {
                    if let Err(err) = Self::keep(&store, &identity, task, config, update.seq).await
                    {
                        tracing::debug!(%task, error = %chorus_sdk::Report(&err), "push: progress not kept (a restart sends this update again)");
                    }
                }
            }
            if ended || self.tasks().get(&task).is_none_or(|t| t.configs.is_empty()) {
                break;
            }
        }
        updates.close().await;
        let left = self.tasks().remove(&task);
        if ended && let Some(left) = left {
            for id in left.configs.keys() {
                let _ = store.delete(&Self::key(&identity, task, id)).await;
            }
        }
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
