//! Starting a real `nats-server` process: for tests, benchmarks and the local demo.
//!
//! ```no_run
//! let server = chorus_nats_server::NatsServer::start()?;
//! println!("listening at {}", server.url());
//! # Ok::<(), chorus_nats_server::Error>(())
//! ```
//!
//! The server listens on loopback on a port the OS chooses (unless told otherwise), keeps its
//! store and log in its own temporary directory, and is ready when it has written its ports
//! file; [`NatsServer::start`] waits for that with a deadline. Dropping the handle kills the
//! process and removes the directory.

// Every public item is documented, and every fallible one says how it fails.
#![warn(missing_docs, clippy::missing_errors_doc)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

mod cluster;
mod error;

pub use cluster::{Cluster, ClusterBuilder, DEAD_ADDRESS, HUB_DOMAIN};
pub use error::{Error, Result};

/// How long [`ServerBuilder::start`] waits for the server by default.
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How often the ports file is looked for while the server starts; the deadline bounds it.
const READY_POLL: Duration = Duration::from_millis(5);
/// Log lines quoted in an error when the server exits or does not come up.
const LOG_TAIL_LINES: usize = 10;

/// Finds the `nats-server` binary: `$NATS_SERVER`, then `$CHORUS_TOOLS/bin`, then the
/// workspace's `.tools/bin` (where `scripts/install-nats-server` puts it), then `PATH`.
pub fn find_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("NATS_SERVER") {
        return Some(PathBuf::from(path));
    }
    let mut candidates = Vec::new();
    if let Some(tools) = std::env::var_os("CHORUS_TOOLS") {
        candidates.push(PathBuf::from(tools).join("bin/nats-server"));
    }
    candidates.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/nats-server"));
    if let Ok(cwd) = std::env::current_dir() {
        candidates.push(cwd.join(".tools/bin/nats-server"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        candidates.extend(std::env::split_paths(&path).map(|d| d.join("nats-server")));
    }
    candidates.into_iter().find(|p| p.is_file())
}

/// Options for one server process.
#[derive(Debug, Clone)]
pub struct ServerBuilder {
    binary: Option<PathBuf>,
    config: Option<PathBuf>,
    jetstream: bool,
    port: Option<u16>,
    extra_args: Vec<String>,
    ready_timeout: Duration,
    current_dir: Option<PathBuf>,
    sync_always: bool,
}

impl Default for ServerBuilder {
    fn default() -> Self {
        ServerBuilder {
            binary: None,
            current_dir: None,
            sync_always: false,
            config: None,
            jetstream: true,
            port: None,
            extra_args: Vec::new(),
            ready_timeout: DEFAULT_READY_TIMEOUT,
        }
    }
}

impl ServerBuilder {
    /// Use this binary instead of [`find_binary`].
    pub fn binary(mut self, path: impl Into<PathBuf>) -> Self {
        self.binary = Some(path.into());
        self
    }

    /// Start with this config file (`-c`). Its listen address, if set, wins over the port here.
    pub fn config(mut self, path: impl Into<PathBuf>) -> Self {
        self.config = Some(path.into());
        self
    }

    /// Run the server in this directory (relative paths in a config file resolve from it).
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.current_dir = Some(dir.into());
        self
    }

    /// JetStream fsyncs every write before acknowledging it (`sync_interval: always`), so an
    /// acknowledged message survives the process being killed. Off by default, as on the
    /// server; on in `nats.conf` and wherever a test claims durability.
    pub fn sync_always(mut self, on: bool) -> Self {
        self.sync_always = on;
        self
    }

    /// Whether JetStream is on (default: on, stored in the server's temporary directory).
    pub fn jetstream(mut self, on: bool) -> Self {
        self.jetstream = on;
        self
    }

    /// A fixed client port instead of one the OS chooses.
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// More command-line arguments for `nats-server`.
    pub fn arg(mut self, arg: impl Into<String>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// How long to wait for readiness.
    pub fn ready_timeout(mut self, timeout: Duration) -> Self {
        self.ready_timeout = timeout;
        self
    }

    /// Starts the server and waits until it listens.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no binary is found or it cannot be run, [`Error::Io`] when its
    /// directory, log or config cannot be written, [`Error::Exited`] when it exits before it
    /// listens, [`Error::TimedOut`] when it is not ready within the ready timeout.
    pub fn start(self) -> Result<NatsServer> {
        let binary = match self.binary.clone().or_else(find_binary) {
            Some(b) => b,
            None => {
                return Err(Error::NotFound {
                    context: "nats-server not found: run scripts/install-nats-server or set \
                              NATS_SERVER"
                        .to_owned(),
                    source: None,
                });
            }
        };
        let dir = tempfile::Builder::new()
            .prefix("chorus-nats-")
            .tempdir()
            .map_err(Error::io("cannot create a temp dir"))?;
        let mut server = NatsServer {
            child: None,
            dir,
            binary,
            builder: self,
            client_url: String::new(),
            monitor_url: None,
            port: 0,
        };
        server.spawn()?;
        Ok(server)
    }
}

/// A running `nats-server`. Killed, and its directory removed, on drop.
#[derive(Debug)]
pub struct NatsServer {
    child: Option<Child>,
    dir: tempfile::TempDir,
    binary: PathBuf,
    builder: ServerBuilder,
    client_url: String,
    monitor_url: Option<String>,
    port: u16,
}

impl NatsServer {
    /// Starts a server with defaults: loopback, OS-chosen port, JetStream on.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no binary is found, [`Error::Io`] when its directory cannot be
    /// written, [`Error::Exited`] or [`Error::TimedOut`] when it does not come up (the message
    /// quotes its log).
    pub fn start() -> Result<NatsServer> {
        ServerBuilder::default().start()
    }

    /// A builder for a server with other settings.
    pub fn builder() -> ServerBuilder {
        ServerBuilder::default()
    }

    /// The client URL, `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> &str {
        &self.client_url
    }

    /// The monitoring URL, when the server has a monitoring port.
    pub fn monitor_url(&self) -> Option<&str> {
        self.monitor_url.as_deref()
    }

    /// The server's working directory (store, log, ports file).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The server log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("nats-server.log")).unwrap_or_default()
    }

    /// The process id, while the server runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops the process with SIGSTOP, as a machine that hangs would: its sockets stay open
    /// and nothing answers on them until [`resume`](NatsServer::resume).
    ///
    /// # Errors
    /// [`Error::Exited`] when the process is not running or is gone, [`Error::Io`] when `kill`
    /// cannot be run.
    pub fn pause(&self) -> Result<()> {
        self.signal("-STOP")
    }

    /// Lets a [`pause`](NatsServer::pause)d process run again (SIGCONT).
    ///
    /// # Errors
    /// [`Error::Exited`] when the process is not running or is gone, [`Error::Io`] when `kill`
    /// cannot be run.
    pub fn resume(&self) -> Result<()> {
        self.signal("-CONT")
    }

    /// Sends a signal with `kill(1)` (the workspace has no unsafe code for `kill(2)`).
    fn signal(&self, signal: &str) -> Result<()> {
        let Some(pid) = self.pid() else {
            return Err(Error::Exited("nats-server is not running".to_owned()));
        };
        let status = Command::new("kill")
            .arg(signal)
            .arg(pid.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(Error::io("cannot run kill to signal nats-server"))?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Exited(format!(
                "kill {signal} {pid} failed ({status}): nats-server is gone"
            )))
        }
    }

    /// Kills the process with SIGKILL, as a crash would; the store stays for [`restart`].
    ///
    /// [`restart`]: NatsServer::restart
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port with the same store, and waits until ready.
    ///
    /// # Errors
    /// [`Error::NotFound`] when the binary cannot be run, [`Error::Io`] when its log or config
    /// cannot be written, [`Error::Exited`] or [`Error::TimedOut`] when it does not come back up
    /// (the message quotes its log).
    pub fn restart(&mut self) -> Result<()> {
        self.kill();
        if self.port != 0 {
            self.builder.port = Some(self.port);
        }
        self.spawn()
    }

    fn spawn(&mut self) -> Result<()> {
        let dir = self.dir.path().to_owned();
        let ports_dir = dir.join("ports");
        let _ = fs::remove_dir_all(&ports_dir);
        fs::create_dir_all(&ports_dir).map_err(Error::io("cannot create ports dir"))?;
        let log_path = dir.join("nats-server.log");
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(Error::io("cannot open server log"))?;
        let log_err = log
            .try_clone()
            .map_err(Error::io("cannot open server log"))?;

        let b = &self.builder;
        let mut cmd = Command::new(&self.binary);
        if b.sync_always && b.config.is_none() {
            let port = b.port.map_or_else(|| "-1".to_owned(), |p| p.to_string());
            let conf = dir.join("sync.conf");
            let text = format!(
                "listen: \"127.0.0.1:{port}\"\njetstream {{\n  store_dir: \"{}\"\n  sync_interval: always\n}}\n",
                dir.join("jetstream").display()
            );
            fs::write(&conf, text).map_err(Error::io("cannot write server config"))?;
            cmd.arg("-c").arg(conf);
        } else if let Some(config) = &b.config {
            cmd.arg("-c").arg(config);
        } else {
            cmd.args(["-a", "127.0.0.1"]);
            match b.port {
                Some(port) => cmd.arg("-p").arg(port.to_string()),
                None => cmd.args(["-p", "-1"]),
            };
            if b.jetstream {
                cmd.arg("-js").arg("-sd").arg(dir.join("jetstream"));
            }
        }
        if let Some(cwd) = &b.current_dir {
            cmd.current_dir(cwd);
        }
        cmd.arg("--ports_file_dir")
            .arg(&ports_dir)
            .args(&b.extra_args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd.spawn().map_err(|e| Error::NotFound {
            context: format!("cannot run {}", self.binary.display()),
            source: Some(e),
        })?;
        let pid = child.id();
        self.child = Some(child);

        let deadline = Instant::now() + b.ready_timeout;
        let ports_file = ports_dir.join(format!(
            "{}_{pid}.ports",
            self.binary
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "nats-server".into())
        ));
        loop {
            if let Ok(text) = fs::read_to_string(&ports_file)
                && let Ok(ports) = serde_json::from_str::<Ports>(&text)
                && let Some(url) = ports.nats.first()
            {
                self.client_url = url.replace("0.0.0.0", "127.0.0.1");
                self.monitor_url = ports.monitoring.first().cloned();
                self.port = self
                    .client_url
                    .rsplit(':')
                    .next()
                    .and_then(|p| p.parse().ok())
                    .unwrap_or(0);
                return Ok(());
            }
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                self.child = None;
                return Err(Error::Exited(format!(
                    "nats-server exited with {status}: {}",
                    self.log_tail()
                )));
            }
            if Instant::now() >= deadline {
                return Err(Error::TimedOut(format!(
                    "nats-server not ready within {:?}: {}",
                    self.builder.ready_timeout,
                    self.log_tail()
                )));
            }
            // Polling a file the server writes once it listens; the deadline bounds it.
            std::thread::sleep(READY_POLL);
        }
    }

    fn log_tail(&self) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(serde::Deserialize)]
struct Ports {
    #[serde(default)]
    nats: Vec<String>,
    #[serde(default)]
    monitoring: Vec<String>,
}
