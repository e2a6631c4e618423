//! `chorus`: run the local bus and demo, and talk to any running bus.
//!
//! This file parses the command line, sets up logging, waits for signals and turns errors
//! into an exit code; each subcommand lives in its own file under `cli/`.

/// `println!` that ends the process quietly when standard output is a closed pipe (`chorus
/// dlq ls | head`), with the status a process killed by SIGPIPE has, as other command-line
/// tools do, instead of panicking.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            $crate::output_failed(e)
        }
    }};
}

/// `print!` as [`outln!`] is `println!`.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = write!(std::io::stdout().lock(), $($arg)*) {
            $crate::output_failed(e)
        }
    }};
}

mod cli;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let mut args = std::env::args_os();
    if args.nth(1).is_some_and(|first| first == "host-exec") {
        return cli::host_exec(args.collect());
    }
    match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime.block_on(run()),
        Err(err) => {
            eprintln!("chorus: cannot start its runtime: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run() -> ExitCode {
    let cli = cli::Cli::parse();
    // The demo narrates what happens; its agents' warnings (a dead letter is expected) are
    // noise there unless asked for with RUST_LOG. `chaos` breaks things on purpose and
    // counts what follows: the errors its agents log (a lost connection, an uncertain
    // message) are its subject, reported in its table, so only its own warnings show.
    let default_filter = match cli.command {
        cli::Command::Up(_) => "error",
        cli::Command::Chaos(_) => "off,chorus_chaos=warn",
        cli::Command::Serve(_) | cli::Command::Bench(_) => "warn",
        // A host says what it starts, restarts and stops.
        cli::Command::Host(_) => "warn,chorus_host=info",
        // A client command says in plain words when it loses and regains the bus
        // ([`cli::connection_notices`]); the connection's own log lines would say it twice.
        _ => "warn,chorus_broker_adapter::events=error",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    // Colour only for a person at a terminal, and never with NO_COLOR set; JSON lines on
    // request, for log collectors.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colour);
    if std::env::var("CHORUS_LOG_FORMAT").is_ok_and(|f| f.eq_ignore_ascii_case("json")) {
        logs.json().init();
    } else {
        logs.init();
    }
    match cli::run(cli).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("chorus: {}", error_chain(&err));
            ExitCode::from(cli::exit_code(&err))
        }
    }
}

/// Ends the process when standard output cannot be written: quietly with 141 (128 + SIGPIPE)
/// when the reader went away, with a message and 1 otherwise.
pub(crate) fn output_failed(e: std::io::Error) -> ! {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        std::process::exit(141);
    }
    eprintln!("chorus: cannot write the output: {e}");
    std::process::exit(1);
}

/// An error and its causes on one line, each cause once, as the library crates' logs print
/// them ([`chorus_sdk::Report`]).
fn error_chain(err: &anyhow::Error) -> String {
    let err: &(dyn std::error::Error + 'static) = err.as_ref();
    chorus_sdk::Report(err).to_string()
}

/// Ctrl-C and SIGTERM, caught from the moment this is made: one that arrives while the command
/// is busy (a demo round, a shutdown) is kept until [`Signals::recv`] is next awaited, not
/// lost, as it is with a fresh [`shutdown_signal`] each time.
pub(crate) struct Signals {
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
}

impl Signals {
    pub(crate) fn new() -> std::io::Result<Signals> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Signals {
                interrupt: signal(SignalKind::interrupt())?,
                terminate: signal(SignalKind::terminate())?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(Signals {})
        }
    }

    /// The next Ctrl-C or SIGTERM (or one that came since the last call).
    pub(crate) async fn recv(&mut self) {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.interrupt.recv() => {}
                _ = self.terminate.recv() => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn each_cause_is_told_once() {
        let inner = std::io::Error::other("disk full");
        let err = anyhow::Error::new(inner)
            .context("write failed (disk full)")
            .context("cannot create stream");
        assert_eq!(
            super::error_chain(&err),
            "cannot create stream: write failed (disk full)"
        );
        let err = anyhow::anyhow!("root").context("outer");
        assert_eq!(super::error_chain(&err), "outer: root");
    }
}
