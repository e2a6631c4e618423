//! The broker handle: a cheap clone in front of one NATS connection.

use crate::Report;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use futures::Stream;
use tokio::sync::broadcast;

use crate::classify::classified;
use crate::events::{ConnectionEvent, EventSink, StatsSnapshot};
use crate::subject::{Wildcards, validate_queue_group, validate_subject};
use crate::{BrokerOptions, Credentials, Error, ErrorKind, Headers, Message, Result};

/// A connection to NATS. Cloning is cheap and every clone shares the connection; it closes
/// when the last clone is dropped or on [`drain`](Broker::drain).
#[derive(Debug, Clone)]
pub struct Broker {
    pub(crate) client: async_nats::Client,
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    events: Arc<EventSink>,
    inbox_prefix: String,
    name: String,
    /// The JetStream domain JetStream calls go to, if not the local one.
    jetstream_domain: Option<String>,
    /// Messages handed out by this adapter's subscriptions.
    yielded: Arc<AtomicU64>,
    /// Messages `sync` sent to itself and received.
    sync_echoes: AtomicU64,
    /// The subscription every `sync` on this connection shares, made at the first.
    sync_inbox: tokio::sync::Mutex<Option<Arc<SyncInbox>>>,
    /// The next `sync`'s token.
    sync_tokens: AtomicU64,
}

/// The connection's sync inbox: one subscription that every [`sync`](Broker::sync) on the
/// connection shares, each sending a token of its own to it and waiting for that token to come
/// back. Agents sharing a connection sync after each subscription they make: with an inbox of
/// their own each time, a process starting 1,000 agents added and removed 6,000 subscriptions
/// on the server, each a change to its subscription index (docs/SCALE.md).
#[derive(Debug)]
struct SyncInbox {
    subject: String,
    /// Read by one waiter at a time, which hands the others their tokens as they come.
    reader: tokio::sync::Mutex<async_nats::Subscriber>,
    /// The waiters, by token.
    waiting: std::sync::Mutex<Waiters>,
}

/// The syncs waiting for their token, by token.
type Waiters = std::collections::HashMap<u64, tokio::sync::oneshot::Sender<()>>;

/// What a sync heard of the connection's events while it waited.
enum Heard {
    /// The server refused the sync inbox (its words).
    Refused(String),
    /// No more events.
    Closed,
    Other,
}

/// Whether `event` is the server refusing the subject `quoted` (in quotes, as the server
/// names it).
fn refusal(
    event: std::result::Result<ConnectionEvent, broadcast::error::RecvError>,
    quoted: &str,
) -> Heard {
    match event {
        Ok(ConnectionEvent::PermissionViolation(text)) if text.contains(quoted) => {
            Heard::Refused(text)
        }
        Err(broadcast::error::RecvError::Closed) => Heard::Closed,
        _ => Heard::Other,
    }
}

impl SyncInbox {
    /// Hands a token that came back to its waiter (one that gave up is no longer waiting).
    fn arrived(&self, payload: &[u8]) {
        let token = std::str::from_utf8(payload)
            .ok()
            .and_then(|t| t.parse::<u64>().ok());
        if let Some(token) = token
            && let Some(waiter) = self.waiters().remove(&token)
        {
            let _ = waiter.send(());
        }
    }

    fn waiters(&self) -> std::sync::MutexGuard<'_, Waiters> {
        self.waiting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Broker {
    /// Connects with `options`.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use chorus_broker_adapter::{Broker, BrokerOptions};
    ///
    /// # async fn run() -> chorus_broker_adapter::Result<()> {
    /// let broker = Broker::connect(BrokerOptions::new(["nats://127.0.0.1:4222"]).name("reader")).await?;
    /// let mut sub = broker.subscribe("doc.>").await?;
    /// broker.sync(Duration::from_secs(5)).await?; // the server has the subscription
    /// broker.publish("doc.ready", "page 1".into()).await?;
    /// # let _ = futures::StreamExt::next(&mut sub).await;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`ErrorKind::Refused`] when the server rejects the credentials,
    /// [`ErrorKind::ConnectionLimit`] when it has all the connections its `max_connections` allows,
    /// [`ErrorKind::Tls`] when TLS cannot be set up, [`ErrorKind::Broker`] when no server can be
    /// reached; [`ErrorKind::InvalidInput`] when the options cannot work (no server, a bad address,
    /// unreadable credentials), [`ErrorKind::InvalidSubject`] for a bad inbox prefix.
    pub async fn connect(options: BrokerOptions) -> Result<Broker> {
        if options.servers.is_empty() {
            return Err(Error::new(ErrorKind::InvalidInput, "no NATS server given"));
        }
        let name = options.name.clone().unwrap_or_else(|| "chorus".to_owned());
        let inbox_prefix = options
            .inbox_prefix
            .clone()
            .unwrap_or_else(|| "_INBOX".to_owned());
        validate_subject(&inbox_prefix, Wildcards::Refuse)?;

        let events = Arc::new(EventSink::new(name.clone()));
        let sink = Arc::clone(&events);
        let max_delay = options.reconnect_max_delay;
        let mut nats = async_nats::ConnectOptions::new()
            .name(&name)
            .ping_interval(options.ping_interval)
            .connection_timeout(options.connect_timeout)
            .subscription_capacity(options.subscription_capacity)
            .custom_inbox_prefix(&inbox_prefix)
            // Subjects are validated here, with typed errors, before they reach the client.
            .skip_subject_validation(true)
            // Requests always carry their own timeout.
            .request_timeout(None)
            .reconnect_delay_callback(move |attempt| {
                crate::options::reconnect_delay(attempt, max_delay)
            })
            .event_callback(move |event| {
                let sink = Arc::clone(&sink);
                async move { sink.handle(event) }
            });
        nats = match options.credentials {
            Credentials::None => nats,
            Credentials::Token(token) => nats.token(token),
            Credentials::UserPassword { user, password } => nats.user_and_password(user, password),
            Credentials::NKeySeed(seed) => nats.nkey(seed),
            Credentials::CredsFile(path) => nats.credentials_file(&path).await.map_err(|e| {
                Error::with_source(
                    ErrorKind::InvalidInput,
                    format!("cannot read credentials file {}", path.display()),
                    e,
                )
            })?,
        };
        let tls = options.tls;
        if tls.required {
            nats = nats.require_tls(true);
        }
        if let Some(ca) = tls.ca_file {
            nats = nats.add_root_certificates(ca);
        }
        if let Some((cert, key)) = tls.client_cert {
            nats = nats.add_client_certificate(cert, key);
        }
        if tls.handshake_first {
            nats = nats.tls_first();
        }
        if options.retry_initial_connect {
            nats = nats.retry_on_initial_connect();
        }
        let servers = options
            .servers
            .iter()
            .map(|s| {
                s.parse::<async_nats::ServerAddr>().map_err(|e| {
                    Error::with_source(
                        ErrorKind::InvalidInput,
                        format!("bad server address {s:?}"),
                        e,
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let client = nats
            .connect(servers)
            .await
            .map_err(|e| classified("cannot connect to NATS", e))?;
        events.attach(&client);
        Ok(Broker {
            client,
            shared: Arc::new(Shared {
                events,
                inbox_prefix,
                name,
                jetstream_domain: options.jetstream_domain.clone(),
                yielded: Arc::new(AtomicU64::new(0)),
                sync_echoes: AtomicU64::new(0),
                sync_inbox: tokio::sync::Mutex::new(None),
                sync_tokens: AtomicU64::new(0),
            }),
        })
    }

    /// Publishes `payload` to `subject`. Returns once the message is queued for the socket,
    /// not when the server has it: call [`flush`](Broker::flush) to know it was written.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSubject`] for a malformed or wildcard subject, [`ErrorKind::TooLarge`]
    /// over the server's `max_payload`, [`ErrorKind::Broker`] when the connection is closed. A
    /// forbidden subject fails only as a [`ConnectionEvent::PermissionViolation`].
    pub async fn publish(&self, subject: &str, payload: Bytes) -> Result<()> {
        self.publish_with(subject, None, None, payload).await
    }

    /// [`publish`](Broker::publish) of a subject its caller built from tokens it checked
    /// already (printable ASCII, none empty, no wildcard: what [`validate_subject`] checks),
    /// as the SDK builds an event's subject from a checked root and topic: only its length is
    /// checked again. Taken by value and handed to the client as it is, without a copy (the
    /// hot path of a sender that builds its subjects).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSubject`] for a subject over [`MAX_SUBJECT_LEN`](crate::MAX_SUBJECT_LEN)
    /// (in debug builds, for any malformed one); [`ErrorKind::TooLarge`] over the server's
    /// `max_payload`; [`ErrorKind::Broker`] when the connection is closed.
    pub async fn publish_built(&self, subject: String, payload: Bytes) -> Result<()> {
        if subject.len() > crate::MAX_SUBJECT_LEN || cfg!(debug_assertions) {
            // The full check, which refuses a subject too long as it does any other.
            validate_subject(&subject, Wildcards::Refuse)?;
        }
        self.send(subject, None, None, payload).await
    }

    /// Publishes with an optional reply subject and headers.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSubject`] for a malformed or wildcard subject or reply; the others as
    /// [`publish`](Broker::publish) says.
    pub async fn publish_with(
        &self,
        subject: &str,
        reply: Option<&str>,
        headers: Option<Headers>,
        payload: Bytes,
    ) -> Result<()> {
        self.publish_subject(subject.to_owned(), reply, headers, payload)
            .await
    }

    async fn publish_subject(
        &self,
        subject: String,
        reply: Option<&str>,
        headers: Option<Headers>,
        payload: Bytes,
    ) -> Result<()> {
        validate_subject(&subject, Wildcards::Refuse)?;
        if let Some(reply) = reply {
            validate_subject(reply, Wildcards::Refuse)?;
        }
        self.send(subject, reply, headers, payload).await
    }

    /// Hands a checked subject's message to the client.
    async fn send(
        &self,
        subject: String,
        reply: Option<&str>,
        headers: Option<Headers>,
        payload: Bytes,
    ) -> Result<()> {
        let result = match (reply, headers) {
            (None, None) => self.client.publish(subject, payload).await,
            (None, Some(h)) => {
                self.client
                    .publish_with_headers(subject, h.0, payload)
                    .await
            }
            (Some(r), None) => {
                self.client
                    .publish_with_reply(subject, r.to_owned(), payload)
                    .await
            }
            (Some(r), Some(h)) => {
                self.client
                    .publish_with_reply_and_headers(subject, r.to_owned(), h.0, payload)
                    .await
            }
        };
        result.map_err(|e| classified("publish failed", e))
    }

    /// Subscribes to `subject` (wildcards allowed).
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSubject`] for a malformed subject; [`ErrorKind::Broker`] when the
    /// connection is closed. A forbidden subject fails only as a
    /// [`ConnectionEvent::PermissionViolation`].
    pub async fn subscribe(&self, subject: &str) -> Result<Subscription> {
        validate_subject(subject, Wildcards::Allow)?;
        let inner = self
            .client
            .subscribe(subject.to_owned())
            .await
            .map_err(|e| classified("subscribe failed", e))?;
        Ok(Subscription {
            inner,
            yielded: Arc::clone(&self.shared.yielded),
            draining: false,
        })
    }

    /// Subscribes to `subject` as a member of queue group `group`: each message goes to one
    /// member of the group.
    ///
    /// # Errors
    /// [`ErrorKind::InvalidSubject`] for a malformed subject or queue group; [`ErrorKind::Broker`]
    /// when the connection is closed. A forbidden subject fails only as a
    /// [`ConnectionEvent::PermissionViolation`].
    pub async fn queue_subscribe(&self, subject: &str, group: &str) -> Result<Subscription> {
        validate_subject(subject, Wildcards::Allow)?;
        validate_queue_group(group)?;
        let inner = self
            .client
            .queue_subscribe(subject.to_owned(), group.to_owned())
            .await
            .map_err(|e| classified("queue subscribe failed", e))?;
        Ok(Subscription {
            inner,
            yielded: Arc::clone(&self.shared.yielded),
            draining: false,
        })
    }

    /// Sends a request and waits up to `timeout` for the first reply.
    ///
    /// # Errors
    /// [`ErrorKind::NoResponders`] at once when nobody is subscribed, [`ErrorKind::TimedOut`] when
    /// someone is but no reply came in time; [`ErrorKind::InvalidSubject`], [`ErrorKind::TooLarge`]
    /// and [`ErrorKind::Broker`] as for [`publish`](Broker::publish).
    pub async fn request(
        &self,
        subject: &str,
        headers: Option<Headers>,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Message> {
        validate_subject(subject, Wildcards::Refuse)?;
        let mut request = async_nats::Request::new()
            .payload(payload)
            .timeout(Some(timeout));
        if let Some(h) = headers {
            request = request.headers(h.0);
        }
        self.client
            .send_request(subject.to_owned(), request)
            .await
            .map(Message::from_nats)
            .map_err(|e| classified(format!("request to {subject} failed"), e))
    }

    /// Waits until everything published so far is written to the server.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the connection is closed.
    pub async fn flush(&self) -> Result<()> {
        self.client
            .flush()
            .await
            .map_err(|e| classified("flush failed", e))
    }

    /// Waits until the server has processed everything this connection sent so far, by
    /// sending a message to an inbox of its own and waiting for it to come back. Use it after
    /// subscribing, before relying on the subscription: [`flush`](Broker::flush) only writes to
    /// the socket, it does not wait for the server. Every sync on the connection (its clones
    /// included) shares one inbox subscription, made at the first, each with a token of its
    /// own: syncing adds no subscription to the server.
    ///
    /// # Errors
    /// [`ErrorKind::Refused`] at once when the server refuses this connection's inbox to its user
    /// (its permissions do not allow the inbox prefix), the server's words as a
    /// [`PermissionViolation`](crate::PermissionViolation) source; [`ErrorKind::TimedOut`] when the
    /// server does not answer within `timeout`; [`ErrorKind::Broker`] when the connection closes.
    pub async fn sync(&self, timeout: Duration) -> Result<()> {
        let mut events = self.events();
        let inbox = self.sync_inbox().await?;
        let token = self.shared.sync_tokens.fetch_add(1, Ordering::Relaxed);
        let (done, mut echoed) = tokio::sync::oneshot::channel();
        inbox.waiters().insert(token, done);
        if let Err(e) = self
            .publish(&inbox.subject, Bytes::from(token.to_string()))
            .await
        {
            inbox.waiters().remove(&token);
            return Err(e);
        }
        let quoted = format!("\"{}\"", inbox.subject);
        // A closed event stream stops the listening: only the echo (or the timeout) can end the
        // wait then.
        let mut listening = true;
        let answer = async {
            loop {
                tokio::select! {
                    biased;
                    _ = &mut echoed => return Ok(true),
                    event = events.recv(), if listening => match refusal(event, &quoted) {
                        Heard::Refused(text) => return Err(text),
                        Heard::Closed => listening = false,
                        Heard::Other => {}
                    },
                    mut reader = inbox.reader.lock() => loop {
                        // This waiter reads for every waiter until its own token comes back.
                        tokio::select! {
                            biased;
                            _ = &mut echoed => return Ok(true),
                            echo = futures::StreamExt::next(&mut *reader) => match echo {
                                Some(echo) => {
                                    self.shared.sync_echoes.fetch_add(1, Ordering::Relaxed);
                                    inbox.arrived(&echo.payload);
                                }
                                None => return Ok(false),
                            },
                            event = events.recv(), if listening => match refusal(event, &quoted) {
                                Heard::Refused(text) => return Err(text),
                                Heard::Closed => listening = false,
                                Heard::Other => {}
                            },
                        }
                    },
                }
            }
        };
        let answered = tokio::time::timeout(timeout, answer).await;
        inbox.waiters().remove(&token);
        match answered {
            Ok(Ok(true)) => Ok(()),
            Ok(Err(text)) => {
                // The inbox is refused: the next sync subscribes again, and hears so again.
                self.forget_sync_inbox(&inbox).await;
                Err(Error::with_source(
                    ErrorKind::Refused,
                    format!(
                        "the server refused this connection's inbox {} to its user",
                        self.inbox_prefix()
                    ),
                    crate::PermissionViolation(text),
                ))
            }
            Ok(Ok(false)) => Err(Error::new(
                ErrorKind::Broker,
                "connection closed during sync",
            )),
            Err(_) => Err(Error::new(
                ErrorKind::TimedOut,
                format!("server did not answer a sync within {timeout:?}"),
            )),
        }
    }

    /// The connection's sync inbox, subscribed at the first call.
    async fn sync_inbox(&self) -> Result<Arc<SyncInbox>> {
        let mut slot = self.shared.sync_inbox.lock().await;
        if let Some(inbox) = slot.as_ref() {
            return Ok(Arc::clone(inbox));
        }
        let subject = self.client.new_inbox();
        let reader = self
            .client
            .subscribe(subject.clone())
            .await
            .map_err(|e| classified("sync subscribe failed", e))?;
        let inbox = Arc::new(SyncInbox {
            subject,
            reader: tokio::sync::Mutex::new(reader),
            waiting: std::sync::Mutex::default(),
        });
        *slot = Some(Arc::clone(&inbox));
        Ok(inbox)
    }

    /// Lets go of `inbox` (refused by the server), unless another sync already did: its
    /// subscription ends when the last sync using it lets go of it too.
    async fn forget_sync_inbox(&self, inbox: &Arc<SyncInbox>) {
        let mut slot = self.shared.sync_inbox.lock().await;
        if slot.as_ref().is_some_and(|now| Arc::ptr_eq(now, inbox)) {
            *slot = None;
        }
    }

    /// Drains the connection: unsubscribes everything, lets buffered messages be delivered,
    /// flushes what was published, then closes.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the connection is already closed.
    pub async fn drain(&self) -> Result<()> {
        self.client
            .drain()
            .await
            .map_err(|e| classified("drain failed", e))
    }

    /// A fresh reply subject under this connection's inbox prefix.
    pub fn new_inbox(&self) -> String {
        self.client.new_inbox()
    }

    /// This connection's inbox prefix.
    pub fn inbox_prefix(&self) -> &str {
        &self.shared.inbox_prefix
    }

    /// The connection's state, for requests that must end soon after it was lost.
    pub(crate) fn link(&self) -> crate::events::Link {
        self.shared.events.link()
    }

    /// The JetStream domain its JetStream calls go to, if not the local one.
    pub fn jetstream_domain(&self) -> Option<&str> {
        self.shared.jetstream_domain.as_deref()
    }

    /// The connection's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The largest message the server accepts, in bytes.
    pub fn max_payload(&self) -> usize {
        self.client.server_info().max_payload
    }

    /// The server's version, as it reported it.
    pub fn server_version(&self) -> String {
        self.client.server_info().version
    }

    /// The name of the server this connection is on now (its `server_name`), which changes
    /// when it reconnects elsewhere.
    pub fn server_name(&self) -> String {
        self.client.server_info().server_name
    }

    /// The address of the server this connection is on now (`host:port`, as the server
    /// reports it), which changes when it reconnects elsewhere.
    pub fn server_addr(&self) -> String {
        let info = self.client.server_info();
        format!("{}:{}", info.host, info.port)
    }

    /// Tells connections apart: the same for every clone of this connection, different for
    /// any other open at the same time.
    pub fn connection_id(&self) -> usize {
        Arc::as_ptr(&self.shared) as usize
    }

    /// Whether the connection is up right now.
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Connection events from now on.
    pub fn events(&self) -> broadcast::Receiver<ConnectionEvent> {
        self.shared.events.tx.subscribe()
    }

    /// Messages the server sent this connection that no subscription of this adapter handed
    /// out: dropped by the client for a full subscription buffer, or left in a buffer when its
    /// subscription ended. Exact for a connection used only through this adapter's
    /// subscriptions (no requests, no JetStream), where every message the server sends is
    /// either handed out or lost; the client library's own slow-consumer events are not (its
    /// event queue drops events under load).
    pub fn undelivered(&self) -> u64 {
        let received = self.client.statistics().in_messages.load(Ordering::Relaxed);
        received
            .saturating_sub(self.shared.yielded.load(Ordering::Relaxed))
            .saturating_sub(self.shared.sync_echoes.load(Ordering::Relaxed))
    }

    /// Messages the server has sent this connection, of every kind (subscriptions' messages,
    /// replies, JetStream deliveries).
    pub fn received(&self) -> u64 {
        self.client.statistics().in_messages.load(Ordering::Relaxed)
    }

    /// Counters of connection events.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.events.stats.snapshot()
    }
}

/// A subscription: a stream of [`Message`]s that ends after [`drain`](Subscription::drain) or
/// [`unsubscribe`](Subscription::unsubscribe), or when the connection closes.
#[derive(Debug)]
pub struct Subscription {
    inner: async_nats::Subscriber,
    yielded: Arc<AtomicU64>,
    draining: bool,
}

impl Subscription {
    /// Stops interest at once; messages already buffered are still yielded.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the connection is closed.
    pub async fn unsubscribe(&mut self) -> Result<()> {
        self.inner
            .unsubscribe()
            .await
            .map_err(|e| classified("unsubscribe failed", e))
    }

    /// The next message, until `stop` completes: then the subscription drains (the server stops
    /// routing here, what it already routed still arrives) and this yields the rest, then
    /// `None`. The graceful loop of every reader: `while let Some(m) = sub.next_until(stop).await`.
    pub async fn next_until(
        &mut self,
        stop: impl std::future::Future<Output = ()>,
    ) -> Option<Message> {
        if !self.draining {
            tokio::select! {
                msg = futures::StreamExt::next(self) => return msg,
                () = stop => {
                    if let Err(err) = self.drain().await {
                        tracing::debug!(error = %Report(&err), "subscription drain failed");
                        return None;
                    }
                    self.draining = true;
                }
            }
        }
        futures::StreamExt::next(self).await
    }

    /// Stops interest after the server has sent what it already routed here; the stream then
    /// yields the rest and ends. This is the graceful way to stop taking new messages.
    ///
    /// # Errors
    /// [`ErrorKind::Broker`] when the connection is closed.
    pub async fn drain(&mut self) -> Result<()> {
        self.inner
            .drain()
            .await
            .map_err(|e| classified("drain failed", e))
    }
}

impl Stream for Subscription {
    type Item = Message;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Message>> {
        let polled = Pin::new(&mut self.inner).poll_next(cx);
        if let Poll::Ready(Some(_)) = &polled {
            self.yielded.fetch_add(1, Ordering::Relaxed);
        }
        polled.map(|m| m.map(Message::from_nats))
    }
}
