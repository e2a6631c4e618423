//! The worker side: the handlers every scenario registers, and [`Isolated`], something run on
//! its own runtime and thread so that it can vanish the way a killed process does.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use chorus_sdk::{Agent, Context, HandlerError};

use crate::WAIT;
use crate::ledger::Probe;

/// The command every worker takes: one message id, recorded when its run begins and when it
/// takes effect, `work` apart.
pub(crate) const WORK: &str = "work";
/// A command every worker refuses at once (a non-retryable failure): poison.
pub(crate) const REFUSE: &str = "refuse";
/// A command that fails on every worker until the retry policy's attempts run out: poison.
pub(crate) const FAIL: &str = "fail";

/// Registers [`WORK`], [`REFUSE`] and [`FAIL`] on `agent`, recording every run in `probe`.
pub(crate) async fn serve(agent: &Agent, probe: &Arc<Probe>, work: Duration) -> anyhow::Result<()> {
    let p = Arc::clone(probe);
    agent
        .on_command(WORK, move |_ctx: Context, id: u64| {
            p.start(id);
            let p = Arc::clone(&p);
            async move {
                if !work.is_zero() {
                    tokio::time::sleep(work).await;
                }
                p.complete(id);
                Ok::<_, HandlerError>(())
            }
        })
        .await
        .context("cannot register the work handler")?;
    let p = Arc::clone(probe);
    agent
        .on_command(REFUSE, move |_ctx: Context, id: u64| {
            p.start(id);
            async move {
                Err::<(), _>(HandlerError::invalid_argument(format!(
                    "poison {id} refused"
                )))
            }
        })
        .await
        .context("cannot register the refusing handler")?;
    let p = Arc::clone(probe);
    agent
        .on_command(FAIL, move |_ctx: Context, id: u64| {
            p.start(id);
            async move { Err::<(), _>(HandlerError::failed(format!("poison {id} failed"))) }
        })
        .await
        .context("cannot register the failing handler")?;
    Ok(())
}

/// Something (an agent, a coordinator) running on a runtime and thread of its own: [`crash`]
/// drops every task of that runtime without letting any run again and closes its connections,
/// as `kill -9` of its process would, while the rest of this process goes on.
///
/// [`crash`]: Isolated::crash
#[derive(Debug)]
pub struct Isolated {
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Isolated {
    /// Runs `setup` on a fresh single-threaded-worker runtime and keeps what it returns alive
    /// there until [`crash`](Isolated::crash); returns once `setup` has, or fails after
    /// [`WAIT`].
    pub async fn start<T, F, Fut>(name: &str, setup: F) -> anyhow::Result<Isolated>
    where
        T: Send + 'static,
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = anyhow::Result<T>> + Send + 'static,
    {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
        let (kill_tx, kill_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("isolated-{name}"))
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.into()));
                        return;
                    }
                };
                let kept = match rt.block_on(setup()) {
                    Ok(kept) => {
                        let _ = ready_tx.send(Ok(()));
                        kept
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // Waits for the crash (or for the handle to go: a dropped sender ends it too).
                let _ = rt.block_on(kill_rx);
                // Every task dropped where it stands: no goodbye, no drain, no ack.
                rt.shutdown_background();
                drop(kept);
            })
            .context("cannot start a thread")?;
        let mut isolated = Isolated {
            kill: Some(kill_tx),
            thread: Some(thread),
        };
        match tokio::time::timeout(WAIT, ready_rx).await {
            Ok(Ok(Ok(()))) => Ok(isolated),
            Ok(Ok(Err(e))) => {
                isolated.crash().await;
                Err(e.context(format!("{name} did not start")))
            }
            Ok(Err(_)) => {
                isolated.crash().await;
                Err(anyhow::anyhow!("{name} did not start: its thread ended"))
            }
            Err(_) => {
                isolated.crash().await;
                Err(anyhow::anyhow!("{name} did not start within {WAIT:?}"))
            }
        }
    }

    /// Makes it vanish, and waits (up to [`WAIT`]) for its thread to end.
    pub async fn crash(&mut self) {
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
        if let Some(thread) = self.thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join());
            if tokio::time::timeout(WAIT, joined).await.is_err() {
                tracing::warn!("an isolated runtime's thread did not end within {WAIT:?}");
            }
        }
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        // The thread ends on its own once it sees the kill; nothing here waits for it.
        if let Some(kill) = self.kill.take() {
            let _ = kill.send(());
        }
    }
}
