//! The agent manifest: how to run an agent on a Chorus host (docs/HOSTING.md, "The manifest").
//!
//! A manifest is written in TOML and read by `chorus deploy MANIFEST` ([`Manifest::load`]); it
//! travels on the bus as JSON to the coordinator and the hosts ([`Manifest::to_json`],
//! [`Manifest::from_json`]). Both paths run the same checks ([`Manifest::validate`]), refuse
//! fields they do not know, and name the field that is wrong (and for TOML its line), so a typo
//! in `max_backof` is an error rather than a default silently taken.
//!
//! ```toml
//! id = "calculator"
//! capabilities = ["calculation"]
//! replicas = 2
//!
//! [run]
//! command = "calculator-agent"
//! args = ["--fast"]
//!
//! [restart]
//! policy = "on-failure"
//! max_backoff = "30s"
//! ```
//!
//! Durations are strings in the syntax of [`crate::duration`] (`500ms`, `30s`, `10m`) and are
//! written back so, in the largest unit that holds them exactly. Every default and every limit
//! is a named constant of this module.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use chorus_sdk::subject::{MAX_TOKEN_LEN, validate_dotted};
use serde::{Deserialize, Serialize};

use crate::duration::format_duration;

mod checks;
mod text;

use checks::{
    check_count, check_duration, check_no_nul, check_path, check_size, check_token, check_unique,
};
use text::{duration_text, path_text};

/// Largest manifest accepted, as TOML text or as JSON bytes (64 KiB): far above any real one,
/// and small enough that a host never holds much of a hostile one.
pub const MAX_MANIFEST_BYTES: usize = 64 * 1024;
/// Digits and dash a replica number adds to an id: `-1000` for [`MAX_REPLICAS`].
const REPLICA_SUFFIX_LEN: usize = 5;
/// Longest deployment id, in bytes: its replica ids (`<id>-1000`) must stay agent ids, which
/// are at most [`MAX_TOKEN_LEN`] (64) bytes.
pub const MAX_ID_LEN: usize = MAX_TOKEN_LEN - REPLICA_SUFFIX_LEN;
/// Longest description, in characters.
pub const MAX_DESCRIPTION_CHARS: usize = 1024;
/// Most capabilities one manifest serves.
pub const MAX_CAPABILITIES: usize = 64;
/// Most commands one manifest serves.
pub const MAX_COMMANDS: usize = 256;
/// Replicas when the manifest does not say.
pub const DEFAULT_REPLICAS: u32 = 1;
/// Most replicas of one deployment.
pub const MAX_REPLICAS: u32 = 1000;
/// Most arguments to the agent's program (and to a health-check command).
pub const MAX_ARGS: usize = 256;
/// Most environment variables set for the agent.
pub const MAX_ENV: usize = 256;
/// The prefix of the variables the host sets itself (`CHORUS_URL`, `CHORUS_AGENT_ID`, ...),
/// which a manifest cannot set.
pub const RESERVED_ENV_PREFIX: &str = "CHORUS_";
/// Least memory limit, in MiB: below it no agent process starts.
pub const MIN_MEMORY_MB: u64 = 16;
/// Greatest memory limit, in MiB (1 TiB).
pub const MAX_MEMORY_MB: u64 = 1_048_576;
/// Greatest CPU limit, in cores.
pub const MAX_CPU: f64 = 1024.0;
/// Most hosts a placement may name.
pub const MAX_HOSTS: usize = 256;
/// Longest duration any manifest field may hold (a day): every wait a host makes is bounded.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);
/// Restart policy when the manifest does not say.
pub const DEFAULT_RESTART_POLICY: RestartPolicy = RestartPolicy::OnFailure;
/// Restarts allowed within the window when the manifest does not say.
pub const DEFAULT_MAX_RESTARTS: u32 = 5;
/// Most restarts a window may allow.
pub const MAX_RESTARTS_LIMIT: u32 = 1000;
/// The window restarts are counted in, when the manifest does not say.
pub const DEFAULT_RESTART_WINDOW: Duration = Duration::from_secs(600);
/// Wait before the first restart, when the manifest does not say.
pub const DEFAULT_INITIAL_BACKOFF: Duration = Duration::from_millis(500);
/// Longest wait between restarts, when the manifest does not say.
pub const DEFAULT_MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Health check when the manifest does not say.
pub const DEFAULT_HEALTH_CHECK: HealthCheck = HealthCheck::Heartbeat;
/// Time between health checks, when the manifest does not say.
pub const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(10);
/// Time one health check may take, when the manifest does not say.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// Consecutive failed checks before a restart, when the manifest does not say.
pub const DEFAULT_HEALTH_FAILURES: u32 = 3;
/// Most consecutive failed checks a manifest may ask to wait for.
pub const MAX_HEALTH_FAILURES: u32 = 100;
/// Time a new replica has to become healthy, when the manifest does not say.
pub const DEFAULT_START_GRACE: Duration = Duration::from_secs(20);

/// Why a manifest cannot be used: told apart by kind, each naming what was wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManifestError {
    /// The manifest file cannot be read (missing, unreadable).
    #[error("cannot read manifest {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The text is not a manifest: bad TOML or JSON, a missing or unknown field, a value of the
    /// wrong type. `message` is the parser's own (for TOML with the line and column).
    #[error("manifest does not parse{}: {message}", at(field.as_deref()))]
    Parse {
        /// Where the parser stopped, as a dotted path (`restart.window`), when it knows.
        field: Option<String>,
        /// The parser's message.
        message: String,
    },
    /// A field holds a value the host cannot use.
    #[error("manifest field {field}: {problem}")]
    Invalid {
        /// The field, as a dotted path: `restart.max_backoff`, `run.env.CHORUS_X`, `args[2]`.
        field: String,
        /// What is wrong with it, and what would be right.
        problem: String,
    },
    /// The manifest is larger than [`MAX_MANIFEST_BYTES`].
    #[error("manifest is {bytes} bytes, more than the limit of {limit} bytes")]
    TooLarge {
        /// Its size (at least `limit + 1` when read from a file that grew).
        bytes: u64,
        /// [`MAX_MANIFEST_BYTES`].
        limit: usize,
    },
}

fn at(field: Option<&str>) -> String {
    field.map(|f| format!(" at {f}")).unwrap_or_default()
}

impl ManifestError {
    /// The field the error is about, as a dotted path, when there is one.
    pub fn field(&self) -> Option<&str> {
        match self {
            ManifestError::Invalid { field, .. } => Some(field),
            ManifestError::Parse { field, .. } => field.as_deref(),
            ManifestError::Read { .. } | ManifestError::TooLarge { .. } => None,
        }
    }

    fn invalid(field: impl Into<String>, problem: impl Into<String>) -> Self {
        ManifestError::Invalid {
            field: field.into(),
            problem: problem.into(),
        }
    }

    fn parse<E: std::fmt::Display>(error: serde_path_to_error::Error<E>) -> Self {
        let path = error.path();
        let field = path.iter().next().is_some().then(|| path.to_string());
        ManifestError::Parse {
            field,
            message: error.inner().to_string().trim_end().to_owned(),
        }
    }
}

/// How to run an agent on a Chorus host: what, how many, where, and how to keep it running.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The deployment's id, which is also its first replica's agent id (the others are
    /// `<id>-2`, `<id>-3`, ...: [`Manifest::replica_id`]).
    pub id: String,
    /// What the agent does, for people.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The capabilities its agents serve (dotted names such as `text.ocr`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capabilities: Vec<String>,
    /// The commands its agents serve.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub commands: Vec<String>,
    /// How many replicas run; 0 keeps the deployment without running it.
    #[serde(default = "default_replicas")]
    pub replicas: u32,
    /// The customer it runs for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub customer: Option<String>,
    /// Where its program comes from, when the host is to fetch and build it first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<Build>,
    /// The program to run.
    pub run: Run,
    /// Limits on memory and CPU.
    #[serde(default)]
    pub resources: Resources,
    /// Where its replicas may run.
    #[serde(default)]
    pub placement: Placement,
    /// When and how fast a stopped replica is started again.
    #[serde(default)]
    pub restart: Restart,
    /// How the host tells a replica is healthy.
    #[serde(default)]
    pub health: Health,
    /// What the agent authenticates with.
    #[serde(default)]
    pub credentials: Credentials,
}

fn default_replicas() -> u32 {
    DEFAULT_REPLICAS
}

/// The program an agent runs as.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Run {
    /// A program path, or a name found on the host's `PATH`.
    pub command: String,
    /// Its arguments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,
    /// Environment variables set for it (on top of the `CHORUS_*` ones the host sets).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// The folder it runs in; relative to the manifest's folder in a file
    /// ([`Manifest::load`] makes it absolute).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "path_text::serialize"
    )]
    pub working_dir: Option<PathBuf>,
    /// Whether the replicas placed on one host run in one process, each an agent of its own
    /// on one shared connection: the process gets their ids in `CHORUS_AGENT_IDS`
    /// (comma-separated) and is started again with the new list when they change.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
}

/// A program the host fetches and builds before it starts the agent (Agentify's build
/// configuration): a clone of `repository` at `branch`, then `command` run in it. The host
/// builds once per deployment and source, not per replica; `run.working_dir` and a relative
/// `run.command` are then taken inside the clone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Build {
    /// What `git clone` takes: a URL or a path on the host.
    pub repository: String,
    /// The branch or tag; the repository's default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub branch: Option<String>,
    /// Run with `sh -c` in the clone, if given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<String>,
    /// How long the clone and the build may take together.
    #[serde(default = "default_build_timeout", with = "duration_text")]
    pub timeout: Duration,
}

/// How long a build may take unless its manifest says.
pub const DEFAULT_BUILD_TIMEOUT: Duration = Duration::from_secs(600);
/// The longest `build.repository` and `build.command`, in bytes.
pub const MAX_BUILD_TEXT: usize = 4096;

fn default_build_timeout() -> Duration {
    DEFAULT_BUILD_TIMEOUT
}

/// Limits on what one replica may use.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Resources {
    /// Memory limit in MiB, [`MIN_MEMORY_MB`]`..=`[`MAX_MEMORY_MB`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    /// CPU limit in cores (0.5 is half a core), above 0 and at most [`MAX_CPU`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<f64>,
    /// GPUs each replica needs (Agentify's `gpu_required`), 1 to [`MAX_GPUS`]: only a host
    /// that announces that many free (`chorus host --gpus`) takes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u32>,
}

/// The most GPUs a replica may ask for.
pub const MAX_GPUS: u32 = 64;

/// Where replicas may be placed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// An agent id: place replicas on the host where that agent runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub co_locate_with: Option<String>,
    /// Only these hosts; empty means any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hosts: Vec<String>,
    /// Hosts in this region first (Agentify's `preferred_region`; `chorus host --region`),
    /// others when none there has room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_region: Option<String>,
}

/// When and how fast a replica that stopped is started again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Restart {
    /// Which exits are restarted.
    pub policy: RestartPolicy,
    /// Restarts allowed within `window` before the replica is given up (a `deploy_failure`).
    pub max_restarts: u32,
    /// The window restarts are counted in.
    #[serde(with = "duration_text")]
    pub window: Duration,
    /// Wait before the first restart; it doubles on each one after, up to `max_backoff`.
    #[serde(with = "duration_text")]
    pub initial_backoff: Duration,
    /// Longest wait between restarts.
    #[serde(with = "duration_text")]
    pub max_backoff: Duration,
}

impl Default for Restart {
    fn default() -> Self {
        Restart {
            policy: DEFAULT_RESTART_POLICY,
            max_restarts: DEFAULT_MAX_RESTARTS,
            window: DEFAULT_RESTART_WINDOW,
            initial_backoff: DEFAULT_INITIAL_BACKOFF,
            max_backoff: DEFAULT_MAX_BACKOFF,
        }
    }
}

/// Which exits of a replica are followed by a restart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RestartPolicy {
    /// Every exit, a clean one too (`"always"`).
    Always,
    /// Exits with a failure: a non-zero status, a signal, a failed health check
    /// (`"on-failure"`).
    #[default]
    OnFailure,
    /// None: a replica that exits stays stopped (`"never"`).
    Never,
}

/// How the host tells that a replica is healthy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Health {
    /// What is checked.
    pub check: HealthCheck,
    /// The program and arguments run for [`HealthCheck::Command`]: healthy when it exits 0
    /// within `timeout`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// Time between checks.
    #[serde(with = "duration_text")]
    pub interval: Duration,
    /// Time one check may take; shorter than `interval`.
    #[serde(with = "duration_text")]
    pub timeout: Duration,
    /// Consecutive failed checks before the replica is restarted.
    pub failures: u32,
    /// Time a new replica has to become healthy (a first heartbeat, or a passing check).
    #[serde(with = "duration_text")]
    pub start_grace: Duration,
}

impl Default for Health {
    fn default() -> Self {
        Health {
            check: DEFAULT_HEALTH_CHECK,
            command: Vec::new(),
            interval: DEFAULT_HEALTH_INTERVAL,
            timeout: DEFAULT_HEALTH_TIMEOUT,
            failures: DEFAULT_HEALTH_FAILURES,
            start_grace: DEFAULT_START_GRACE,
        }
    }
}

/// What a health check looks at.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HealthCheck {
    /// The agent's heartbeats in the registry (`"heartbeat"`).
    #[default]
    Heartbeat,
    /// A command the host runs ([`Health::command`]) (`"command"`).
    Command,
    /// Nothing: a replica is healthy while its process runs (`"none"`).
    None,
}

/// What the agent authenticates with.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credentials {
    /// The agent's nkey seed file, given to it as `CHORUS_NKEY_FILE`; relative to the
    /// manifest's folder in a file ([`Manifest::load`] makes it absolute).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "path_text::serialize"
    )]
    pub nkey_file: Option<PathBuf>,
}

impl Manifest {
    /// A manifest that runs `command` as the deployment `id`, with every default (one
    /// replica). Not validated: [`Manifest::validate`] says whether it can be used.
    pub fn new(id: impl Into<String>, command: impl Into<String>) -> Self {
        Manifest {
            id: id.into(),
            description: None,
            capabilities: Vec::new(),
            commands: Vec::new(),
            replicas: DEFAULT_REPLICAS,
            customer: None,
            build: None,
            run: Run {
                command: command.into(),
                args: Vec::new(),
                env: BTreeMap::new(),
                working_dir: None,
                shared: false,
            },
            resources: Resources::default(),
            placement: Placement::default(),
            restart: Restart::default(),
            health: Health::default(),
            credentials: Credentials::default(),
        }
    }

    /// Reads a manifest from TOML text and checks it. Relative paths stay relative (only
    /// [`Manifest::load`] knows the folder they are relative to).
    ///
    /// # Errors
    /// [`ManifestError::TooLarge`] above [`MAX_MANIFEST_BYTES`]; [`ManifestError::Parse`] for
    /// bad TOML, a missing or unknown field, or a value of the wrong type (the message names
    /// the field and its line); [`ManifestError::Invalid`] as [`Manifest::validate`] fails.
    pub fn from_toml(text: &str) -> Result<Self, ManifestError> {
        let manifest = Self::parse_toml(text)?;
        manifest.validate()?;
        Ok(manifest)
    }

    fn parse_toml(text: &str) -> Result<Self, ManifestError> {
        check_size(text.len())?;
        let document = toml::Deserializer::parse(text).map_err(|e| ManifestError::Parse {
            field: None,
            message: e.to_string().trim_end().to_owned(),
        })?;
        serde_path_to_error::deserialize(document).map_err(ManifestError::parse)
    }

    /// Reads the manifest file at `path`, checks it, and makes its relative paths
    /// (`run.working_dir`, `credentials.nkey_file`) absolute against the file's folder.
    ///
    /// # Errors
    /// [`ManifestError::Read`] naming `path` when the file cannot be read (or the current
    /// folder, needed for a relative `path`, cannot); [`ManifestError::Parse`] when it is not
    /// UTF-8; otherwise as [`Manifest::from_toml`].
    pub fn load(path: &Path) -> Result<Self, ManifestError> {
        let read_error = |source| ManifestError::Read {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(read_error)?;
        let mut bytes = Vec::new();
        // One byte past the limit tells "too large" without reading all of a huge file.
        let limit = u64::try_from(MAX_MANIFEST_BYTES).unwrap_or(u64::MAX);
        (&file)
            .take(limit.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(read_error)?;
        if bytes.len() > MAX_MANIFEST_BYTES {
            let size = file.metadata().map_or(bytes.len() as u64, |m| m.len());
            return Err(ManifestError::TooLarge {
                bytes: size,
                limit: MAX_MANIFEST_BYTES,
            });
        }
        let text = String::from_utf8(bytes).map_err(|e| ManifestError::Parse {
            field: None,
            message: format!("{} is not UTF-8 text: {e}", path.display()),
        })?;
        let mut manifest = Self::parse_toml(&text)?;
        let folder = match path.parent() {
            Some(folder) if !folder.as_os_str().is_empty() => folder,
            _ => Path::new("."),
        };
        let folder = std::path::absolute(folder).map_err(read_error)?;
        // A built agent's folder is inside its clone, which only the host knows.
        let working_dir = if manifest.build.is_some() {
            None
        } else {
            manifest.run.working_dir.as_mut()
        };
        for relative in [working_dir, manifest.credentials.nkey_file.as_mut()]
            .into_iter()
            .flatten()
        {
            if relative.is_relative() {
                *relative = folder.join(&*relative);
            }
        }
        manifest.validate()?;
        Ok(manifest)
    }

    /// Reads a manifest from its bus form (JSON, as [`Manifest::to_json`] writes it) and
    /// checks it. Paths are taken as they are.
    ///
    /// # Errors
    /// [`ManifestError::TooLarge`] above [`MAX_MANIFEST_BYTES`]; [`ManifestError::Parse`] for
    /// bad JSON, a missing or unknown field, or a value of the wrong type;
    /// [`ManifestError::Invalid`] as [`Manifest::validate`] fails.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ManifestError> {
        check_size(bytes.len())?;
        let mut json = serde_json::Deserializer::from_slice(bytes);
        let manifest: Manifest =
            serde_path_to_error::deserialize(&mut json).map_err(ManifestError::parse)?;
        json.end().map_err(|e| ManifestError::Parse {
            field: None,
            message: e.to_string(),
        })?;
        manifest.validate()?;
        Ok(manifest)
    }

    /// The bus form: JSON, which [`Manifest::from_json`] reads back equal.
    pub fn to_json(&self) -> Vec<u8> {
        // Cannot fail: every map has string keys and paths are written as (lossy) text. A
        // floating-point value that is not finite is written as `null`, which validation
        // refuses anyway.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The agent id of replica number `replica` (counted from 1): replica 1 is the
    /// deployment's `id` itself, replica `n >= 2` is `<id>-<n>`. Replica 0 is read as 1.
    ///
    /// ```
    /// let manifest = chorus_hosting::manifest::Manifest::new("calc", "calc-agent");
    /// assert_eq!(manifest.replica_id(1), "calc");
    /// assert_eq!(manifest.replica_id(3), "calc-3");
    /// ```
    pub fn replica_id(&self, replica: u32) -> String {
        replica_id(&self.id, replica)
    }

    /// Checks every field: names are subject tokens, numbers and durations within their
    /// limits, and fields that go together agree.
    ///
    /// # Errors
    /// [`ManifestError::Invalid`] naming the first field found wrong and what is wrong with it.
    pub fn validate(&self) -> Result<(), ManifestError> {
        self.validate_identity()?;
        self.validate_build()?;
        self.validate_run()?;
        self.validate_resources()?;
        self.validate_placement()?;
        self.validate_restart()?;
        self.validate_health()?;
        if let Some(path) = &self.credentials.nkey_file {
            check_path("credentials.nkey_file", path)?;
        }
        Ok(())
    }

    fn validate_identity(&self) -> Result<(), ManifestError> {
        check_token("id", "agent id", &self.id)?;
        if self.id.len() > MAX_ID_LEN {
            return Err(ManifestError::invalid(
                "id",
                format!(
                    "{} bytes is longer than {MAX_ID_LEN}: replica ids append up to \"-{MAX_REPLICAS}\" \
                     and must stay within {MAX_TOKEN_LEN} bytes",
                    self.id.len()
                ),
            ));
        }
        if let Some((_, digits)) = self.id.rsplit_once('-')
            && !digits.is_empty()
            && digits.bytes().all(|b| b.is_ascii_digit())
        {
            return Err(ManifestError::invalid(
                "id",
                format!(
                    "{:?} ends in \"-{digits}\", which is how replica ids are made from a \
                     deployment id: choose one that does not end in a dash and digits",
                    self.id
                ),
            ));
        }
        if let Some(description) = &self.description {
            let chars = description.chars().count();
            if chars > MAX_DESCRIPTION_CHARS {
                return Err(ManifestError::invalid(
                    "description",
                    format!("{chars} characters, more than {MAX_DESCRIPTION_CHARS}"),
                ));
            }
        }
        check_count("capabilities", self.capabilities.len(), MAX_CAPABILITIES)?;
        for (i, capability) in self.capabilities.iter().enumerate() {
            let field = format!("capabilities[{i}]");
            validate_dotted("capability", capability)
                .map_err(|e| ManifestError::invalid(&field, e.to_string()))?;
        }
        check_unique("capabilities", &self.capabilities)?;
        check_count("commands", self.commands.len(), MAX_COMMANDS)?;
        for (i, command) in self.commands.iter().enumerate() {
            check_token(&format!("commands[{i}]"), "command name", command)?;
        }
        check_unique("commands", &self.commands)?;
        if self.replicas > MAX_REPLICAS {
            return Err(ManifestError::invalid(
                "replicas",
                format!(
                    "{} is more than {MAX_REPLICAS} (give 0..={MAX_REPLICAS}; 0 keeps the \
                     deployment without running it)",
                    self.replicas
                ),
            ));
        }
        if let Some(customer) = &self.customer {
            check_token("customer", "customer", customer)?;
        }
        Ok(())
    }

    fn validate_build(&self) -> Result<(), ManifestError> {
        let Some(build) = &self.build else {
            return Ok(());
        };
        let text = |field: &str, value: &str| -> Result<(), ManifestError> {
            if value.trim().is_empty() {
                return Err(ManifestError::invalid(field, "is empty"));
            }
            if value.len() > MAX_BUILD_TEXT {
                return Err(ManifestError::invalid(
                    field,
                    format!("is longer than {MAX_BUILD_TEXT} bytes"),
                ));
            }
            check_no_nul(field, value)
        };
        text("build.repository", &build.repository)?;
        if build.repository.starts_with('-') || build.repository.contains(['\n', '\r']) {
            return Err(ManifestError::invalid(
                "build.repository",
                "not a repository: it starts with '-' or has a line break",
            ));
        }
        if let Some(branch) = &build.branch {
            let fine = !branch.is_empty()
                && branch.len() <= 255
                && !branch.starts_with('-')
                && branch
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "._/-".contains(c));
            if !fine {
                return Err(ManifestError::invalid(
                    "build.branch",
                    "not a branch name: letters, digits, '.', '_', '/' and '-', not starting \
                     with '-', at most 255",
                ));
            }
        }
        if let Some(command) = &build.command {
            text("build.command", command)?;
        }
        check_duration("build.timeout", build.timeout)
    }

    fn validate_run(&self) -> Result<(), ManifestError> {
        let run = &self.run;
        if run.command.is_empty() {
            return Err(ManifestError::invalid(
                "run.command",
                "is empty: give a program path or a name found on PATH",
            ));
        }
        check_no_nul("run.command", &run.command)?;
        check_count("run.args", run.args.len(), MAX_ARGS)?;
        for (i, arg) in run.args.iter().enumerate() {
            check_no_nul(&format!("run.args[{i}]"), arg)?;
        }
        check_count("run.env", run.env.len(), MAX_ENV)?;
        for (name, value) in &run.env {
            let field = format!("run.env.{name}");
            let mut bytes = name.bytes();
            let well_formed = bytes
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                && bytes.all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !well_formed {
                return Err(ManifestError::invalid(
                    field,
                    "not a variable name: use letters, digits and '_', not starting with a digit",
                ));
            }
            let reserved = name
                .get(..RESERVED_ENV_PREFIX.len())
                .is_some_and(|head| head.eq_ignore_ascii_case(RESERVED_ENV_PREFIX));
            if reserved {
                return Err(ManifestError::invalid(
                    field,
                    format!(
                        "variables starting with {RESERVED_ENV_PREFIX} are set by the host \
                         (bus address, agent id, credentials) and cannot be set by a manifest"
                    ),
                ));
            }
            check_no_nul(&field, value)?;
        }
        if let Some(path) = &run.working_dir {
            check_path("run.working_dir", path)?;
        }
        Ok(())
    }

    fn validate_resources(&self) -> Result<(), ManifestError> {
        if let Some(memory) = self.resources.memory_mb
            && !(MIN_MEMORY_MB..=MAX_MEMORY_MB).contains(&memory)
        {
            return Err(ManifestError::invalid(
                "resources.memory_mb",
                format!(
                    "{memory} MiB is impossible: give {MIN_MEMORY_MB}..={MAX_MEMORY_MB} \
                     (16 MiB to 1 TiB)"
                ),
            ));
        }
        if let Some(cpu) = self.resources.cpu
            && !(cpu.is_finite() && cpu > 0.0 && cpu <= MAX_CPU)
        {
            return Err(ManifestError::invalid(
                "resources.cpu",
                format!(
                    "{cpu} cores is impossible: give a number of cores above 0 and at most \
                     {MAX_CPU} (0.5 is half a core)"
                ),
            ));
        }
        if let Some(gpus) = self.resources.gpus
            && !(1..=MAX_GPUS).contains(&gpus)
        {
            return Err(ManifestError::invalid(
                "resources.gpus",
                format!("{gpus} GPUs is impossible: give 1..={MAX_GPUS}"),
            ));
        }
        Ok(())
    }

    fn validate_placement(&self) -> Result<(), ManifestError> {
        let placement = &self.placement;
        if let Some(agent) = &placement.co_locate_with {
            check_token("placement.co_locate_with", "agent id", agent)?;
        }
        if let Some(region) = &placement.preferred_region {
            check_token("placement.preferred_region", "region", region)?;
        }
        check_count("placement.hosts", placement.hosts.len(), MAX_HOSTS)?;
        for (i, host) in placement.hosts.iter().enumerate() {
            check_token(&format!("placement.hosts[{i}]"), "host id", host)?;
        }
        check_unique("placement.hosts", &placement.hosts)
    }

    fn validate_restart(&self) -> Result<(), ManifestError> {
        let restart = &self.restart;
        if restart.max_restarts > MAX_RESTARTS_LIMIT {
            return Err(ManifestError::invalid(
                "restart.max_restarts",
                format!(
                    "{} is more than {MAX_RESTARTS_LIMIT} (give 0..={MAX_RESTARTS_LIMIT})",
                    restart.max_restarts
                ),
            ));
        }
        check_duration("restart.window", restart.window)?;
        check_duration("restart.initial_backoff", restart.initial_backoff)?;
        check_duration("restart.max_backoff", restart.max_backoff)?;
        if restart.max_backoff < restart.initial_backoff {
            return Err(ManifestError::invalid(
                "restart.max_backoff",
                format!(
                    "{} is shorter than restart.initial_backoff ({})",
                    format_duration(restart.max_backoff),
                    format_duration(restart.initial_backoff)
                ),
            ));
        }
        Ok(())
    }

    fn validate_health(&self) -> Result<(), ManifestError> {
        let health = &self.health;
        match health.check {
            HealthCheck::Command => {
                let Some(program) = health.command.first() else {
                    return Err(ManifestError::invalid(
                        "health.command",
                        "is required when health.check = \"command\": give the program and its \
                         arguments, e.g. [\"curl\", \"-fs\", \"http://127.0.0.1:8000/health\"]",
                    ));
                };
                if program.is_empty() {
                    return Err(ManifestError::invalid(
                        "health.command[0]",
                        "the program is empty",
                    ));
                }
                check_count("health.command", health.command.len(), MAX_ARGS + 1)?;
                for (i, part) in health.command.iter().enumerate() {
                    check_no_nul(&format!("health.command[{i}]"), part)?;
                }
            }
            HealthCheck::Heartbeat | HealthCheck::None if !health.command.is_empty() => {
                let check = match health.check {
                    HealthCheck::Heartbeat => "heartbeat",
                    _ => "none",
                };
                return Err(ManifestError::invalid(
                    "health.command",
                    format!(
                        "is only used when health.check = \"command\", and health.check is \
                         {check:?}: remove it or set check = \"command\""
                    ),
                ));
            }
            HealthCheck::Heartbeat | HealthCheck::None => {}
        }
        check_duration("health.interval", health.interval)?;
        check_duration("health.timeout", health.timeout)?;
        check_duration("health.start_grace", health.start_grace)?;
        if health.timeout >= health.interval {
            return Err(ManifestError::invalid(
                "health.timeout",
                format!(
                    "{} is not shorter than health.interval ({}): a check must end before the \
                     next one starts",
                    format_duration(health.timeout),
                    format_duration(health.interval)
                ),
            ));
        }
        if !(1..=MAX_HEALTH_FAILURES).contains(&health.failures) {
            return Err(ManifestError::invalid(
                "health.failures",
                format!(
                    "{} is out of range: give 1..={MAX_HEALTH_FAILURES}",
                    health.failures
                ),
            ));
        }
        Ok(())
    }
}

/// The agent id of replica `replica` of deployment `id` (what [`Manifest::replica_id`] gives).
pub fn replica_id(id: &str, replica: u32) -> String {
    if replica <= 1 {
        id.to_owned()
    } else {
        format!("{id}-{replica}")
    }
}

/// The deployment an agent id belongs to, and its replica number: the inverse of
/// [`Manifest::replica_id`]. An id without a `-<n>` suffix (n >= 2, no leading zero) is
/// replica 1 of the deployment of that id.
///
/// ```
/// use chorus_hosting::manifest::deployment_of;
/// assert_eq!(deployment_of("calc-3"), ("calc", 3));
/// assert_eq!(deployment_of("calc"), ("calc", 1));
/// ```
pub fn deployment_of(agent_id: &str) -> (&str, u32) {
    if let Some((deployment, digits)) = agent_id.rsplit_once('-')
        && !deployment.is_empty()
        && !digits.starts_with('0')
        && digits.bytes().all(|b| b.is_ascii_digit())
        && let Ok(replica) = digits.parse::<u32>()
        && replica >= 2
    {
        return (deployment, replica);
    }
    (agent_id, 1)
}

#[cfg(test)]
mod tests;
