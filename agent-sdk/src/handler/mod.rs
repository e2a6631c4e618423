//! Handlers: what runs when a command, request or event arrives, the [`Context`] it runs
//! in, and the table of registered endpoints the inbound pipeline dispatches to.

pub(crate) mod context;
pub(crate) mod endpoint;

use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;

use bytes::Bytes;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::HandlerError;
use crate::protocol::codec::{decode_payload, encode_payload};
use crate::protocol::envelope::ContentType;
pub use context::Context;

/// The result of a request handler: the reply payload and its content type.
#[derive(Debug, Clone, Default)]
pub struct Output {
    /// Reply payload.
    pub payload: Bytes,
    /// Its content type.
    pub content_type: ContentType,
}

/// A boxed future returned by handlers.
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

/// Handles commands and requests. Most code uses the typed closures accepted by
/// [`Agent::on_command`](crate::Agent::on_command); implement this for full control over the
/// envelope.
pub trait Handler: Send + Sync + 'static {
    /// Handles one message (in [`Context::message`]); the result becomes the reply.
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>>;
}

/// Handles events.
pub trait EventHandler: Send + Sync + 'static {
    /// Handles one event (in [`Context::message`]).
    fn call(&self, ctx: Context) -> BoxFuture<Result<(), HandlerError>>;
}

/// Adapts `Fn(Context, T) -> Future<Output = Result<R, HandlerError>>` to [`Handler`]: the
/// payload is decoded into `T` by its content type, and `R` is encoded the same way, so a JSON
/// caller gets JSON back and a MessagePack caller MessagePack.
pub struct Typed<F, T, R> {
    f: F,
    _types: PhantomData<fn(T) -> R>,
}

impl<F, T, R> Typed<F, T, R> {
    /// Wraps `f`.
    pub fn new(f: F) -> Self {
        Typed {
            f,
            _types: PhantomData,
        }
    }
}

impl<F, T, R> std::fmt::Debug for Typed<F, T, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Typed")
    }
}

impl<F, Fut, T, R> Handler for Typed<F, T, R>
where
    F: Fn(Context, T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<R, HandlerError>> + Send + 'static,
    T: DeserializeOwned + Send + 'static,
    R: Serialize + Send + 'static,
{
    fn call(&self, ctx: Context) -> BoxFuture<Result<Output, HandlerError>> {
        let request = ctx.message();
        let content_type = request.content_type.clone();
        let args = decode_payload::<T>(&request.payload, &content_type);
        let fut = args.map(|args| (self.f)(ctx, args));
        Box::pin(async move {
            let result = fut?.await?;
            let payload = encode_payload(&result, &content_type)?;
            Ok(Output {
                payload,
                content_type,
            })
        })
    }
}

impl<F, Fut, T> EventHandler for Typed<F, T, ()>
where
    F: Fn(Context, T) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), HandlerError>> + Send + 'static,
    T: DeserializeOwned + Send + 'static,
{
    fn call(&self, ctx: Context) -> BoxFuture<Result<(), HandlerError>> {
        let event = ctx.message();
        let args = decode_payload::<T>(&event.payload, &event.content_type);
        let fut = args.map(|args| (self.f)(ctx, args));
        Box::pin(async move { fut?.await })
    }
}
