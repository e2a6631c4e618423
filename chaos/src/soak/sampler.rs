//! Memory and descriptors of every process the soak can see, sampled every few seconds from
//! `/proc` (Linux): resident memory (`VmRSS` in `/proc/<pid>/status`) and open file
//! descriptors (the entries of `/proc/<pid>/fd`). A process restarted under a new pid starts a
//! new series, its next incarnation, so that a restart is never read as growth or shrinkage.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::WAIT;

/// One sample of one process.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Seconds since the soak's traffic began.
    pub t_s: f64,
    /// Resident memory, bytes.
    pub rss_bytes: u64,
    /// Open file descriptors.
    pub fds: u64,
}

/// The samples of one incarnation of one process.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    /// The process, by its role: `agents` (this process; `agents+coordinator` when the
    /// coordinator runs in it too), `nats-server`, `coordinator`.
    pub process: String,
    /// 0 for the process the soak started with, then one more per restart.
    pub incarnation: u32,
    pub pid: u32,
    /// When this incarnation began, in seconds since the traffic began (0 if before).
    pub since_s: f64,
    pub samples: Vec<Sample>,
}

/// The processes to sample, by role, and the pid each role has now (none while it is down).
#[derive(Debug)]
pub(crate) struct Watched {
    start: Instant,
    slots: Mutex<Vec<Slot>>,
}

#[derive(Debug, Clone)]
struct Slot {
    process: String,
    pid: Option<u32>,
    since_s: f64,
}

impl Watched {
    /// Times count from `start`.
    pub(crate) fn new(start: Instant) -> Watched {
        Watched {
            start,
            slots: Mutex::new(Vec::new()),
        }
    }

    fn slots(&self) -> MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Seconds since the start.
    pub(crate) fn now_s(&self) -> f64 {
        self.start.elapsed().as_secs_f64()
    }

    /// `process` runs as `pid` from now on (or is down, with none).
    pub(crate) fn set(&self, process: &str, pid: Option<u32>) {
        let since_s = self.now_s();
        let mut slots = self.slots();
        match slots.iter_mut().find(|s| s.process == process) {
            Some(slot) => {
                if slot.pid != pid {
                    slot.since_s = since_s;
                }
                slot.pid = pid;
            }
            None => slots.push(Slot {
                process: process.to_owned(),
                pid,
                since_s: 0.0,
            }),
        }
    }

    /// The roles being watched, in the order they were first set.
    pub(crate) fn processes(&self) -> Vec<String> {
        self.slots().iter().map(|s| s.process.clone()).collect()
    }
}

/// Reads `pid`'s resident memory and open descriptors; `None` if it is gone (or no `/proc`).
fn read(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss_kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|kb| kb.parse().ok())?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss_kb * 1024, fds))
}

/// Samples the [`Watched`] processes every `every` until [`stop`](Sampler::stop).
#[derive(Debug)]
pub(crate) struct Sampler {
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
    series: Arc<Mutex<Vec<Series>>>,
}

impl Sampler {
    /// Starts sampling at once, then every `every`; each series has room for `expected`
    /// samples from the start (so that the samples themselves are no growth to speak of).
    pub(crate) fn start(watched: Arc<Watched>, every: Duration, expected: usize) -> Sampler {
        let stop = CancellationToken::new();
        let series: Arc<Mutex<Vec<Series>>> = Arc::default();
        let task = tokio::spawn({
            let (stop, series) = (stop.clone(), Arc::clone(&series));
            async move {
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
                loop {
                    tokio::select! {
                        _ = tick.tick() => {}
                        _ = stop.cancelled() => break,
                    }
                    let slots = watched.slots().clone();
                    let t_s = watched.now_s();
                    let read_all = tokio::task::spawn_blocking(move || {
                        slots
                            .into_iter()
                            .filter_map(|s| {
                                let pid = s.pid?;
                                read(pid).map(|(rss, fds)| (s, pid, rss, fds))
                            })
                            .collect::<Vec<_>>()
                    });
                    let Ok(Ok(read)) = tokio::time::timeout(WAIT, read_all).await else {
                        continue;
                    };
                    let mut all = series.lock().unwrap_or_else(|p| p.into_inner());
                    for (slot, pid, rss_bytes, fds) in read {
                        let sample = Sample {
                            t_s,
                            rss_bytes,
                            fds,
                        };
                        let last = all.iter_mut().rev().find(|s| s.process == slot.process);
                        match last {
                            Some(s) if s.pid == pid => s.samples.push(sample),
                            last => {
                                let incarnation = last.map_or(0, |s| s.incarnation + 1);
                                let mut samples = Vec::with_capacity(expected);
                                samples.push(sample);
                                all.push(Series {
                                    process: slot.process.clone(),
                                    incarnation,
                                    pid,
                                    since_s: slot.since_s,
                                    samples,
                                });
                            }
                        }
                    }
                }
            }
        });
        Sampler {
            stop,
            task: Some(task),
            series,
        }
    }

    /// The latest sample of each process, in the order they were first seen.
    pub(crate) fn latest(&self) -> Vec<(String, Sample)> {
        let all = self.series.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, Sample)> = Vec::new();
        for s in all.iter() {
            let Some(last) = s.samples.last() else {
                continue;
            };
            match out.iter_mut().find(|(p, _)| *p == s.process) {
                Some(entry) => entry.1 = *last,
                None => out.push((s.process.clone(), *last)),
            }
        }
        out
    }

    /// Stops sampling (waiting up to [`WAIT`] for a sample being taken) and hands the series
    /// over.
    pub(crate) async fn stop(mut self) -> Vec<Series> {
        self.stop.cancel();
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(WAIT, &mut task).await.is_err()
        {
            task.abort();
        }
        std::mem::take(&mut *self.series.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop.cancel();
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_can_be_read() {
        let Some((rss, fds)) = read(std::process::id()) else {
            // No /proc here: nothing to check.
            return;
        };
        assert!(rss > 0 && fds > 0, "{rss} {fds}");
        assert!(read(u32::MAX).is_none());
    }
}
