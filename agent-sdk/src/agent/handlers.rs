//! What an agent serves: command, capability and event handlers, and the permissions they
//! require.

use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Agent, SYNC_TIMEOUT};
use crate::error::{HandlerError, SdkError};
use crate::handler::endpoint::{ANY_NOTIFICATION, Endpoint, EndpointKind};
use crate::handler::{Context, EventHandler, Handler, Typed};
use crate::inbound::EventStream;
use crate::inbound::reader::Route;

impl Agent {
    /// Capabilities declared or served.
    pub fn capabilities(&self) -> Vec<String> {
        crate::sync::lock(&self.inner.presence.capabilities).clone()
    }

    /// Registers a typed handler for command `name`, sent to this agent with
    /// [`Call::agent`](crate::Call::agent). The payload is decoded into `T`; the handler's `R`
    /// is the reply. Returns once the server routes the agent's commands here.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `name` is not a valid command name; [`SdkError::Broker`] when the
    /// subscription or the durable inbox's consumers cannot be made, or the server does not confirm
    /// them in time.
    pub async fn on_command<T, R, F, Fut>(&self, name: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
    {
        self.handle_command(name, Typed::new(f)).await
    }

    /// Registers an untyped [`Handler`] for command `name`.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `name` is not a valid command name; [`SdkError::Broker`] when the
    /// subscription or the durable inbox's consumers cannot be made, or the server does not confirm
    /// them in time.
    pub async fn handle_command(&self, name: &str, handler: impl Handler) -> Result<(), SdkError> {
        let inner = &self.inner;
        let subject = inner.link.subjects.command(&inner.link.id, name)?;
        let endpoint = Arc::new(Endpoint::new(
            name.to_owned(),
            subject,
            None,
            EndpointKind::Command,
            Arc::new(handler),
        ));
        if inner.endpoints.add_command(endpoint) {
            tracing::warn!(agent = %inner.link.id, command = name, "command handler replaced");
        }
        inner.presence.changed.notify_one();
        self.receive_commands().await
    }

    /// Registers a [`Handler`] for every command of this agent that has no handler of its
    /// own, core or durable, through the same inbound pipeline: what a gateway needs to hold
    /// the commands sent to an identity it answers for. It is not listed among the agent's
    /// commands. Returns once the server routes the agent's commands here.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when the subscription or the durable inbox's consumers cannot be made,
    /// or the server does not confirm them in time.
    pub async fn handle_other_commands(&self, handler: impl Handler) -> Result<(), SdkError> {
        let inner = &self.inner;
        let subject = inner.link.subjects.agent_inbound(&inner.link.id)?;
        let endpoint = Arc::new(Endpoint::new(
            "*".to_owned(),
            subject,
            None,
            EndpointKind::Command,
            Arc::new(handler),
        ));
        if inner.endpoints.set_other_commands(endpoint) {
            tracing::warn!(agent = %inner.link.id, "handler of other commands replaced");
        }
        self.receive_commands().await
    }

    /// Handles notifications called `name` (`"*"`, [`ANY_NOTIFICATION`], for every one without
    /// a handler of its own) with a typed handler: pushes to this agent that expect no reply
    /// (`docs/PROTOCOL.md` section 7.14), sent with [`Agent::notify`] to it or to a group it
    /// belongs to. They travel on the agent's own subjects, so no topic subscription is needed
    /// (and an agent that serves commands subscribes to nothing more); durable ones come
    /// through its durable inbox, retried and dead-lettered by the retry policy when the
    /// handler fails. Nothing is ever answered; a notification no handler takes is counted
    /// ([`AgentStats::notifications_unhandled`](crate::AgentStats::notifications_unhandled))
    /// and dropped. Returns once the server routes the agent's notifications here.
    ///
    /// ```no_run
    /// # async fn run(agent: chorus_sdk::Agent) -> Result<(), chorus_sdk::SdkError> {
    /// agent
    ///     .on_notification("disk-full", |ctx, host: String| async move {
    ///         println!("{} says {host} is full ({:?})", ctx.from(), ctx.message().priority);
    ///         Ok(())
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `name` is neither `"*"` nor a valid notification name (one
    /// token, as a command name); [`SdkError::Broker`] when the subscription or the durable
    /// inbox's consumers cannot be made, or the server does not confirm them in time.
    pub async fn on_notification<T, F, Fut>(&self, name: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
    {
        self.handle_notifications(name, Typed::<F, T, ()>::new(f))
            .await
    }

    /// Handles notifications called `name` (`"*"` for every one without a handler of its
    /// own) with an untyped [`EventHandler`].
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `name` is neither `"*"` nor a valid notification name;
    /// [`SdkError::Broker`] when the subscription or the durable inbox's consumers cannot be
    /// made, or the server does not confirm them in time.
    pub async fn handle_notifications(
        &self,
        name: &str,
        handler: impl EventHandler,
    ) -> Result<(), SdkError> {
        if name != ANY_NOTIFICATION {
            crate::subject::validate_token("notification name", name)?;
        }
        let inner = &self.inner;
        if inner.endpoints.add_notification(name, Arc::new(handler)) {
            tracing::warn!(agent = %inner.link.id, notification = name, "notification handler replaced");
        }
        self.receive_commands().await
    }

    /// Starts the durable inbox and the subscription to the agent's commands, once.
    async fn receive_commands(&self) -> Result<(), SdkError> {
        let inner = &self.inner;
        if let Some(durable) = &inner.durable {
            durable.start().await?;
        }
        let mut subscribed = inner.commands_subscribed.lock().await;
        if !*subscribed {
            let subject = inner.link.subjects.agent_inbound(&inner.link.id)?;
            let sub = inner.link.broker.subscribe(&subject).await?;
            inner.link.broker.sync(SYNC_TIMEOUT).await?;
            inner.dispatcher.spawn(sub, Route::Commands);
            *subscribed = true;
        }
        Ok(())
    }

    /// Serves `capability` with a typed handler: requests to the capability's access point
    /// are shared among all agents serving it (a queue group). Returns once subscribed.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `capability` is not a valid capability name; [`SdkError::Broker`]
    /// when the subscription cannot be made or the server does not confirm it in time.
    pub async fn on_capability<T, R, F, Fut>(&self, capability: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<R, HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
    {
        self.handle_capability(capability, Typed::new(f)).await
    }

    /// Serves `capability` with an untyped [`Handler`].
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `capability` is not a valid capability name; [`SdkError::Broker`]
    /// when the subscription cannot be made or the server does not confirm it in time.
    pub async fn handle_capability(
        &self,
        capability: &str,
        handler: impl Handler,
    ) -> Result<(), SdkError> {
        let inner = &self.inner;
        let subject = inner.link.subjects.capability(capability)?;
        let sub = inner
            .link
            .broker
            .queue_subscribe(&subject, &subject)
            .await?;
        // Its own access point too, for callers that must reach this holder.
        let own = inner
            .link
            .broker
            .subscribe(
                &inner
                    .link
                    .subjects
                    .capability_at(&inner.link.id, capability)?,
            )
            .await?;
        inner.link.broker.sync(SYNC_TIMEOUT).await?;
        inner.presence.add_capability(capability);
        let endpoint = Arc::new(Endpoint::new(
            capability.to_owned(),
            subject.clone(),
            Some(subject),
            EndpointKind::Capability,
            Arc::new(handler),
        ));
        inner.endpoints.add(Arc::clone(&endpoint));
        inner
            .dispatcher
            .spawn(own, Route::Capability(Arc::clone(&endpoint)));
        inner.dispatcher.spawn(sub, Route::Capability(endpoint));
        inner.presence.changed.notify_one();
        Ok(())
    }

    /// Handles events on topics matching `pattern` (`*` one token, `>` the rest) with a typed
    /// handler. Every subscriber gets every event. Returns once subscribed.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `pattern` is not a valid topic pattern; [`SdkError::Broker`] when
    /// the events connection cannot be opened, or the subscription cannot be made or is not
    /// confirmed in time.
    pub async fn on_event<T, F, Fut>(&self, pattern: &str, f: F) -> Result<(), SdkError>
    where
        F: Fn(Context, T) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<(), HandlerError>> + Send + 'static,
        T: DeserializeOwned + Send + 'static,
    {
        self.handle_events(pattern, Typed::<F, T, ()>::new(f)).await
    }

    /// Handles events matching `pattern` with an untyped [`EventHandler`].
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `pattern` is not a valid topic pattern; [`SdkError::Broker`] when
    /// the events connection cannot be opened, or the subscription cannot be made or is not
    /// confirmed in time.
    pub async fn handle_events(
        &self,
        pattern: &str,
        handler: impl EventHandler,
    ) -> Result<(), SdkError> {
        let subject = self.inner.link.subjects.event_pattern(pattern)?;
        let events = self.inner.events_connection().await?;
        let sub = events.subscribe(&subject).await?;
        events.sync(SYNC_TIMEOUT).await?;
        self.inner
            .dispatcher
            .spawn(sub, Route::Event(Arc::new(handler)));
        Ok(())
    }

    /// Events on topics matching `pattern`, as a stream. Messages that are not valid events,
    /// or have expired or looped, are counted and skipped.
    ///
    /// # Errors
    /// [`SdkError::Subject`] when `pattern` is not a valid topic pattern; [`SdkError::Broker`] when
    /// the events connection cannot be opened, or the subscription cannot be made or is not
    /// confirmed in time.
    pub async fn subscribe(&self, pattern: &str) -> Result<EventStream, SdkError> {
        let subject = self.inner.link.subjects.event_pattern(pattern)?;
        let events = self.inner.events_connection().await?;
        let sub = events.subscribe(&subject).await?;
        events.sync(SYNC_TIMEOUT).await?;
        Ok(EventStream::new(sub, Arc::clone(&self.inner.pipeline)))
    }

    /// Serves requests on `subject` (a pattern may use `*` and `>`), a subject of the bus
    /// itself rather than of this agent
    /// (the coordinator's discovery and broadcast), through the same inbound pipeline as the
    /// agent's commands: size, version, expiry and loop checks, signatures, authorization,
    /// coded replies. With `queue_group`, the instances serving it share the requests.
    /// Returns once subscribed.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when `subject` is not a valid NATS subject (kind `InvalidSubject`), or
    /// the subscription cannot be made or is not confirmed in time.
    pub async fn handle_subject(
        &self,
        subject: &str,
        queue_group: Option<&str>,
        handler: impl Handler,
    ) -> Result<(), SdkError> {
        let inner = &self.inner;
        chorus_broker_adapter::validate_subject(subject, chorus_broker_adapter::Wildcards::Allow)?;
        let sub = match queue_group {
            Some(group) => inner.link.broker.queue_subscribe(subject, group).await?,
            None => inner.link.broker.subscribe(subject).await?,
        };
        inner.link.broker.sync(SYNC_TIMEOUT).await?;
        let endpoint = Arc::new(Endpoint::new(
            subject.to_owned(),
            subject.to_owned(),
            queue_group.map(str::to_owned),
            EndpointKind::Service,
            Arc::new(handler),
        ));
        inner.endpoints.add(Arc::clone(&endpoint));
        inner.dispatcher.spawn(sub, Route::Capability(endpoint));
        Ok(())
    }

    /// Handles messages without replies on the subject pattern `pattern` (a subject of the bus
    /// itself: the coordinator's heartbeats and goodbyes) through the inbound pipeline, like
    /// events. Returns once subscribed.
    ///
    /// # Errors
    /// [`SdkError::Broker`] when `pattern` is not a valid NATS subject (kind `InvalidSubject`), or
    /// the subscription cannot be made or is not confirmed in time.
    pub async fn handle_subject_events(
        &self,
        pattern: &str,
        handler: impl EventHandler,
    ) -> Result<(), SdkError> {
        chorus_broker_adapter::validate_subject(pattern, chorus_broker_adapter::Wildcards::Allow)?;
        let broker = &self.inner.link.broker;
        let sub = broker.subscribe(pattern).await?;
        broker.sync(SYNC_TIMEOUT).await?;
        self.inner
            .dispatcher
            .spawn(sub, Route::Event(Arc::new(handler)));
        Ok(())
    }

    /// Requires `permissions` of senders of command or capability `name` (registered before):
    /// a request from a sender not granted all of them is refused with 5007 and a reason
    /// naming what is missing.
    ///
    /// # Errors
    /// [`SdkError::InvalidCall`] when no command or capability handler is registered under `name`.
    pub fn require(&self, name: &str, permissions: &[&str]) -> Result<(), SdkError> {
        let endpoint = self.inner.endpoints.named(name).ok_or_else(|| {
            SdkError::InvalidCall(format!(
                "no command or capability handler is registered under {name:?}"
            ))
        })?;
        *crate::sync::write(&endpoint.required) =
            permissions.iter().map(|p| (*p).to_owned()).collect();
        Ok(())
    }

    /// Grants `agent` more permissions at run time.
    pub fn grant(&self, agent: &str, permissions: &[&str]) {
        self.inner.access.grant(agent, permissions.iter().copied());
    }
}
