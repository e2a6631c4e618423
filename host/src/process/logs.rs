//! A replica's log: its stdout and stderr as timestamped lines in `<log_dir>/<agent_id>.log`,
//! rotated by size into `.1` .. `.N` (the oldest dropped), each line cut at a byte limit, so a
//! chatty or broken agent can never fill the host's disk or memory.
//!
//! ```text
//! 2026-05-01T12:00:00.123456Z out connected to the bus
//! 2026-05-01T12:00:00.200000Z err warning: slow start
//! 2026-05-01T12:00:01.000000Z host exited: exit code 3
//! ```

use std::collections::VecDeque;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// Size at which a log file is rotated, by default.
pub const DEFAULT_LOG_FILE_BYTES: u64 = 1024 * 1024;
/// Rotated files kept besides the live one, by default.
pub const DEFAULT_LOG_FILES: u32 = 3;
/// Longest line kept whole, by default; longer ones are cut.
pub const DEFAULT_LOG_LINE_BYTES: usize = 16 * 1024;
/// Lines of stderr kept in memory per replica, for the reason of a failure.
pub const STDERR_TAIL_LINES: usize = 5;
/// What a cut line ends with.
const TRUNCATED_MARK: &str = " [truncated]";

/// Bounds on a replica's log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogLimits {
    /// A file reaching this size is rotated.
    pub file_bytes: u64,
    /// Rotated files kept besides the live one (`.1` is the newest).
    pub files: u32,
    /// Lines longer than this are cut.
    pub line_bytes: usize,
}

impl LogLimits {
    /// Limits of the given sizes.
    pub fn new(file_bytes: u64, files: u32, line_bytes: usize) -> LogLimits {
        LogLimits {
            file_bytes,
            files,
            line_bytes,
        }
    }
}

impl Default for LogLimits {
    fn default() -> LogLimits {
        LogLimits::new(
            DEFAULT_LOG_FILE_BYTES,
            DEFAULT_LOG_FILES,
            DEFAULT_LOG_LINE_BYTES,
        )
    }
}

/// Which stream a log line came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    /// The agent's stdout.
    Out,
    /// The agent's stderr.
    Err,
    /// The host itself: a start, an exit.
    Host,
}

impl Stream {
    fn label(self) -> &'static str {
        match self {
            Stream::Out => "out",
            Stream::Err => "err",
            Stream::Host => "host",
        }
    }
}

/// The live log file of one replica and its rotation.
#[derive(Debug)]
pub(crate) struct LogFile {
    path: PathBuf,
    file: File,
    size: u64,
    limits: LogLimits,
}

/// The live log file of an agent under `dir`.
pub(crate) fn log_path(dir: &Path, agent_id: &str) -> PathBuf {
    dir.join(format!("{agent_id}.log"))
}

/// The `n`th rotated file (1 = newest) of the live file `path`.
fn rotated(path: &Path, n: u32) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(format!(".{n}"));
    PathBuf::from(name)
}

impl LogFile {
    /// Opens (appending, creating the directory) the live log of `agent_id` under `dir`.
    pub(crate) fn open(dir: &Path, agent_id: &str, limits: LogLimits) -> io::Result<LogFile> {
        fs::create_dir_all(dir)?;
        let path = log_path(dir, agent_id);
        let file = OpenOptions::new().create(true).append(true).open(&path)?;
        let size = file.metadata()?.len();
        Ok(LogFile {
            path,
            file,
            size,
            limits,
        })
    }

    /// The live file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one line (cut at the line limit, prefixed with the time and the stream), rotating
    /// first when it would take the file past its size.
    pub(crate) fn write_line(
        &mut self,
        stream: Stream,
        line: &[u8],
        truncated: bool,
    ) -> io::Result<()> {
        let (kept, cut) = if line.len() > self.limits.line_bytes {
            (&line[..self.limits.line_bytes], true)
        } else {
            (line, truncated)
        };
        let now = OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_else(|_| String::from("-"));
        let mut record = format!("{now} {} ", stream.label()).into_bytes();
        record.extend_from_slice(kept);
        if cut {
            record.extend_from_slice(TRUNCATED_MARK.as_bytes());
        }
        record.push(b'\n');
        let len = u64::try_from(record.len()).unwrap_or(u64::MAX);
        if self.size > 0 && self.size.saturating_add(len) > self.limits.file_bytes {
            self.rotate()?;
        }
        self.file.write_all(&record)?;
        self.size = self.size.saturating_add(len);
        Ok(())
    }

    /// `.N-1` -> `.N` .. live -> `.1` (the oldest dropped), then a fresh live file.
    fn rotate(&mut self) -> io::Result<()> {
        let keep = self.limits.files;
        if keep > 0 {
            remove_if_present(&rotated(&self.path, keep))?;
            for n in (1..keep).rev() {
                rename_if_present(&rotated(&self.path, n), &rotated(&self.path, n + 1))?;
            }
            rename_if_present(&self.path, &rotated(&self.path, 1))?;
        }
        self.file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&self.path)?;
        self.size = 0;
        Ok(())
    }
}

fn remove_if_present(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

fn rename_if_present(from: &Path, to: &Path) -> io::Result<()> {
    match fs::rename(from, to) {
        Err(err) if err.kind() != io::ErrorKind::NotFound => Err(err),
        _ => Ok(()),
    }
}

/// A replica's log shared by its stream pumps and its supervisor; a failed write is reported
/// once per replica and never stops the agent.
#[derive(Debug, Clone)]
pub(crate) struct SharedLog {
    inner: Arc<Mutex<(LogFile, bool)>>,
}

impl SharedLog {
    pub(crate) fn new(file: LogFile) -> SharedLog {
        SharedLog {
            inner: Arc::new(Mutex::new((file, false))),
        }
    }

    pub(crate) fn write(&self, stream: Stream, line: &[u8], truncated: bool) {
        let mut guard = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let (file, warned) = &mut *guard;
        if let Err(err) = file.write_line(stream, line, truncated)
            && !*warned
        {
            *warned = true;
            tracing::warn!(path = %file.path().display(), error = %err, "cannot write an agent's log; its lines are dropped");
        }
    }
}

/// The last stderr lines of a replica, for the reason of a failure.
#[derive(Debug, Clone, Default)]
pub(crate) struct StderrTail {
    lines: Arc<Mutex<VecDeque<String>>>,
}

impl StderrTail {
    pub(crate) fn push(&self, line: String) {
        let mut lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        if lines.len() == STDERR_TAIL_LINES {
            lines.pop_front();
        }
        lines.push_back(line);
    }

    /// The last non-empty stderr line.
    pub(crate) fn last(&self) -> Option<String> {
        let lines = self.lines.lock().unwrap_or_else(PoisonError::into_inner);
        lines
            .iter()
            .rev()
            .find(|line| !line.trim().is_empty())
            .cloned()
    }

    pub(crate) fn clear(&self) {
        self.lines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
    }
}

/// Reads one line of at most `max` bytes into `line` (without its end of line). Returns `None`
/// at the end of the stream, else whether the line was cut; the rest of a cut line is read and
/// dropped, so an agent printing without newlines never grows the host's memory.
pub(crate) async fn read_bounded_line<R: AsyncBufRead + Unpin>(
    reader: &mut R,
    max: usize,
    line: &mut Vec<u8>,
) -> io::Result<Option<bool>> {
    line.clear();
    let mut truncated = false;
    let mut any = false;
    loop {
        let buf = reader.fill_buf().await?;
        if buf.is_empty() {
            return Ok(any.then_some(truncated));
        }
        any = true;
        let (content, used, done) = match buf.iter().position(|&b| b == b'\n') {
            Some(at) => (&buf[..at], at + 1, true),
            None => (buf, buf.len(), false),
        };
        let room = max.saturating_sub(line.len());
        if content.len() > room {
            line.extend_from_slice(&content[..room]);
            truncated = true;
        } else {
            line.extend_from_slice(content);
        }
        reader.consume(used);
        if done {
            if line.last() == Some(&b'\r') {
                line.pop();
            }
            return Ok(Some(truncated));
        }
    }
}

/// The last `max_lines` lines of an agent's log, oldest first, across its rotated files.
/// `None` when it has no log file at all.
pub(crate) fn tail(
    dir: &Path,
    agent_id: &str,
    files: u32,
    max_lines: usize,
) -> io::Result<Option<Vec<String>>> {
    let live = log_path(dir, agent_id);
    let mut paths = vec![live.clone()];
    // Rotated files beyond the configured count may remain from an earlier configuration:
    // read on while they exist, newest first.
    let mut n = 1;
    loop {
        let path = rotated(&live, n);
        if n > files && !path.exists() {
            break;
        }
        paths.push(path);
        n += 1;
    }
    let mut found = false;
    let mut lines: VecDeque<String> = VecDeque::new();
    for path in paths {
        if found && lines.len() >= max_lines {
            break;
        }
        let bytes = match fs::read(&path) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => return Err(err),
        };
        found = true;
        let text = String::from_utf8_lossy(&bytes);
        for line in text.lines().rev() {
            if lines.len() >= max_lines {
                break;
            }
            lines.push_front(line.to_owned());
        }
    }
    Ok(found.then(|| lines.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numbered(lines: &[String]) -> Vec<u32> {
        lines
            .iter()
            .map(|line| {
                line.rsplit(' ')
                    .next()
                    .and_then(|n| n.parse().ok())
                    .expect("a numbered line")
            })
            .collect()
    }

    #[test]
    fn lines_carry_the_time_and_the_stream() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut log = LogFile::open(dir.path(), "a", LogLimits::default()).expect("open");
        log.write_line(Stream::Out, b"hello", false).expect("write");
        log.write_line(Stream::Err, b"oops", false).expect("write");
        let lines = tail(dir.path(), "a", 3, 10).expect("read").expect("a log");
        assert_eq!(lines.len(), 2);
        let (time, rest) = lines[0].split_once(' ').expect("a time");
        OffsetDateTime::parse(time, &Rfc3339).expect("an RFC 3339 time");
        assert!(time.ends_with('Z'), "UTC: {time}");
        assert_eq!(rest, "out hello");
        assert!(lines[1].ends_with(" err oops"));
    }

    #[test]
    fn files_rotate_at_the_size_and_keep_n() {
        let dir = tempfile::tempdir().expect("temp dir");
        let limits = LogLimits::new(200, 2, 64);
        let mut log = LogFile::open(dir.path(), "a", limits).expect("open");
        for n in 0..100 {
            log.write_line(Stream::Out, format!("line {n}").as_bytes(), false)
                .expect("write");
        }
        let live = log_path(dir.path(), "a");
        for path in [live.clone(), rotated(&live, 1), rotated(&live, 2)] {
            let size = fs::metadata(&path).expect("a kept file").len();
            assert!(
                size > 0 && size <= 200,
                "{} is {size} bytes",
                path.display()
            );
        }
        assert!(!rotated(&live, 3).exists(), "only 2 rotated files are kept");

        let all = tail(dir.path(), "a", 2, 1000)
            .expect("read")
            .expect("a log");
        let numbers = numbered(&all);
        assert!(numbers.len() < 100, "old lines were dropped");
        assert_eq!(numbers.last(), Some(&99));
        assert!(
            numbers.windows(2).all(|w| w[1] == w[0] + 1),
            "in order, none missing: {numbers:?}"
        );
        let last = tail(dir.path(), "a", 2, 5).expect("read").expect("a log");
        assert_eq!(numbered(&last), vec![95, 96, 97, 98, 99]);
    }

    #[test]
    fn no_rotated_files_means_the_live_file_starts_over() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut log = LogFile::open(dir.path(), "a", LogLimits::new(100, 0, 64)).expect("open");
        for n in 0..20 {
            log.write_line(Stream::Out, format!("line {n}").as_bytes(), false)
                .expect("write");
        }
        assert!(fs::metadata(log.path()).expect("live").len() <= 100);
        assert!(!rotated(log.path(), 1).exists());
        let lines = tail(dir.path(), "a", 0, 100).expect("read").expect("a log");
        assert_eq!(numbered(&lines).last(), Some(&19));
    }

    #[test]
    fn a_reopened_log_appends_and_rotates_by_the_total() {
        let dir = tempfile::tempdir().expect("temp dir");
        let limits = LogLimits::new(120, 1, 64);
        LogFile::open(dir.path(), "a", limits)
            .expect("open")
            .write_line(Stream::Out, b"first 1", false)
            .expect("write");
        let mut again = LogFile::open(dir.path(), "a", limits).expect("reopen");
        again
            .write_line(Stream::Out, b"second 2", false)
            .expect("write");
        again
            .write_line(Stream::Out, b"third 3", false)
            .expect("write");
        let lines = tail(dir.path(), "a", 1, 10).expect("read").expect("a log");
        assert_eq!(numbered(&lines), vec![1, 2, 3]);
        assert!(
            rotated(again.path(), 1).exists(),
            "rotated by the size of both runs"
        );
    }

    #[test]
    fn long_lines_are_cut() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut log = LogFile::open(dir.path(), "a", LogLimits::new(10_000, 1, 8)).expect("open");
        log.write_line(Stream::Out, b"0123456789abcdef", false)
            .expect("write");
        let lines = tail(dir.path(), "a", 1, 10).expect("read").expect("a log");
        assert!(
            lines[0].ends_with(" out 01234567 [truncated]"),
            "{}",
            lines[0]
        );
    }

    #[test]
    fn a_missing_log_is_none_and_an_existing_one_some() {
        let dir = tempfile::tempdir().expect("temp dir");
        assert_eq!(tail(dir.path(), "nobody", 3, 10).expect("read"), None);
        LogFile::open(dir.path(), "quiet", LogLimits::default()).expect("open");
        assert_eq!(
            tail(dir.path(), "quiet", 3, 0).expect("read"),
            Some(Vec::new())
        );
        assert_eq!(
            tail(dir.path(), "quiet", 3, 10).expect("read"),
            Some(Vec::new())
        );
    }

    #[tokio::test]
    async fn bounded_lines_cut_and_skip_the_rest() {
        let input: &[u8] = b"short\r\nabcdefghijklmnop\nlast-without-newline";
        let mut reader = tokio::io::BufReader::with_capacity(4, input);
        let mut line = Vec::new();
        let mut got = Vec::new();
        while let Some(cut) = read_bounded_line(&mut reader, 6, &mut line)
            .await
            .expect("read")
        {
            got.push((String::from_utf8_lossy(&line).into_owned(), cut));
        }
        assert_eq!(
            got,
            vec![
                ("short".to_owned(), false),
                ("abcdef".to_owned(), true),
                ("last-w".to_owned(), true),
            ]
        );
    }

    #[test]
    fn the_stderr_tail_keeps_the_last_lines() {
        let tail = StderrTail::default();
        for n in 0..10 {
            tail.push(format!("e{n}"));
        }
        tail.push(String::from("  "));
        assert_eq!(tail.last().as_deref(), Some("e9"));
        tail.clear();
        assert_eq!(tail.last(), None);
    }
}
