//! Growth, per process and resource: after a warm-up, a least-squares slope fitted over the
//! samples of each incarnation around its own mean (so a restarted process is compared with
//! itself, never with its predecessor), projected over the measured window and compared with a
//! threshold relative to the level.

use serde::Serialize;

use super::sampler::{Sample, Series};

/// Fewest measured samples a verdict is given on.
const MIN_MEASURED: usize = 5;

/// When projected growth counts as growth: more than `ratio` of the mean level plus `plus`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct GrowthLimits {
    /// Resident memory: the share of its mean level.
    pub rss_ratio: f64,
    /// Resident memory: bytes on top.
    pub rss_bytes: u64,
    /// Descriptors: the share of their mean level.
    pub fd_ratio: f64,
    /// Descriptors: count on top.
    pub fds: u64,
}

impl Default for GrowthLimits {
    /// 10 % + 8 MiB of memory, 10 % + 5 descriptors.
    fn default() -> Self {
        GrowthLimits {
            rss_ratio: 0.10,
            rss_bytes: 8 << 20,
            fd_ratio: 0.10,
            fds: 5,
        }
    }
}

/// What is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Resource {
    /// Resident memory, bytes.
    Rss,
    /// Open file descriptors.
    Fds,
}

impl Resource {
    fn of(self, s: &Sample) -> f64 {
        match self {
            Resource::Rss => s.rss_bytes as f64,
            Resource::Fds => s.fds as f64,
        }
    }

    /// Its name in the table.
    pub fn name(self) -> &'static str {
        match self {
            Resource::Rss => "rss",
            Resource::Fds => "fds",
        }
    }

    /// `value` as the table prints it: MiB with one decimal, or a count.
    pub fn show(self, value: f64) -> String {
        match self {
            Resource::Rss => format!("{:.1}M", value / f64::from(1 << 20)),
            Resource::Fds => format!("{value:.0}"),
        }
    }
}

/// The verdict on one process and resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The projected growth is within the limit.
    Steady,
    /// The projected growth exceeds the limit: a leak, or retention that has not levelled.
    Growth,
    /// Too few samples after the warm-up to judge (a process restarted near the end).
    TooFew,
}

/// One process and resource over the soak.
#[derive(Debug, Clone, Serialize)]
pub struct Trend {
    pub process: String,
    pub resource: Resource,
    /// Incarnations seen (restarts + 1).
    pub incarnations: usize,
    /// Samples in all, and after the warm-up (each incarnation's own).
    pub samples: usize,
    pub measured: usize,
    /// The first and last sample of the run, and the extremes, over every incarnation.
    pub first: f64,
    pub last: f64,
    pub min: f64,
    pub max: f64,
    /// The fitted slope, per hour (bytes or descriptors), if there were samples to fit.
    pub slope_per_hour: Option<f64>,
    /// The slope projected over the measured window (its first to its last sample).
    pub growth: Option<f64>,
    /// The growth allowed: the limits applied to the measured mean level.
    pub limit: Option<f64>,
    pub verdict: Verdict,
}

/// Whether a sample of `series` counts: `warmup` after its incarnation began (and so after
/// the soak began).
fn measured(series: &Series, sample: &Sample, warmup: f64) -> bool {
    sample.t_s >= series.since_s.max(0.0) + warmup
}

/// The trends of every process (in the order of `processes`) and both resources.
pub(crate) fn trends(
    processes: &[String],
    series: &[Series],
    warmup: f64,
    limits: &GrowthLimits,
) -> Vec<Trend> {
    let mut out = Vec::new();
    for process in processes {
        let own: Vec<&Series> = series.iter().filter(|s| &s.process == process).collect();
        for resource in [Resource::Rss, Resource::Fds] {
            out.push(trend(process, resource, &own, warmup, limits));
        }
    }
    out
}

fn trend(
    process: &str,
    resource: Resource,
    own: &[&Series],
    warmup: f64,
    limits: &GrowthLimits,
) -> Trend {
    let all: Vec<f64> = own
        .iter()
        .flat_map(|s| s.samples.iter().map(|x| resource.of(x)))
        .collect();
    // Per incarnation, the measured (t, value) points.
    let groups: Vec<Vec<(f64, f64)>> = own
        .iter()
        .map(|s| {
            s.samples
                .iter()
                .filter(|x| measured(s, x, warmup))
                .map(|x| (x.t_s, resource.of(x)))
                .collect()
        })
        .collect();
    let measured: usize = groups.iter().map(Vec::len).sum();
    let fit = fit(&groups);
    let (slope_per_hour, growth, limit, verdict) = match fit {
        Some(f) if measured >= MIN_MEASURED => {
            let growth = f.slope * f.span;
            let limit = match resource {
                Resource::Rss => limits.rss_ratio * f.mean + limits.rss_bytes as f64,
                Resource::Fds => limits.fd_ratio * f.mean + limits.fds as f64,
            };
            let verdict = if growth > limit {
                Verdict::Growth
            } else {
                Verdict::Steady
            };
            (Some(f.slope * 3600.0), Some(growth), Some(limit), verdict)
        }
        Some(f) => (Some(f.slope * 3600.0), None, None, Verdict::TooFew),
        None => (None, None, None, Verdict::TooFew),
    };
    Trend {
        process: process.to_owned(),
        resource,
        incarnations: own.len(),
        samples: all.len(),
        measured,
        first: all.first().copied().unwrap_or(0.0),
        last: all.last().copied().unwrap_or(0.0),
        min: if all.is_empty() {
            0.0
        } else {
            all.iter().copied().fold(f64::INFINITY, f64::min)
        },
        max: all.iter().copied().fold(0.0, f64::max),
        slope_per_hour,
        growth,
        limit,
        verdict,
    }
}

/// A slope fitted to several groups of points, each about its own mean.
#[derive(Debug, Clone, Copy)]
struct Fit {
    /// Per second.
    slope: f64,
    /// From the first point to the last, seconds.
    span: f64,
    /// The mean of every point.
    mean: f64,
}

/// The least-squares slope common to `groups`, each with its own intercept (the
/// within-groups estimator): Σ(t − t̄ᵍ)(y − ȳᵍ) / Σ(t − t̄ᵍ)². `None` without two distinct
/// times in some group.
fn fit(groups: &[Vec<(f64, f64)>]) -> Option<Fit> {
    let (mut sxy, mut sxx, mut n, mut sum) = (0.0, 0.0, 0usize, 0.0);
    let (mut t0, mut t1) = (f64::INFINITY, f64::NEG_INFINITY);
    for g in groups.iter().filter(|g| !g.is_empty()) {
        let len = g.len() as f64;
        let tm = g.iter().map(|p| p.0).sum::<f64>() / len;
        let ym = g.iter().map(|p| p.1).sum::<f64>() / len;
        for &(t, y) in g {
            sxy += (t - tm) * (y - ym);
            sxx += (t - tm) * (t - tm);
            t0 = t0.min(t);
            t1 = t1.max(t);
            sum += y;
        }
        n += g.len();
    }
    (sxx > 0.0).then(|| Fit {
        slope: sxy / sxx,
        span: t1 - t0,
        mean: sum / n as f64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(process: &str, incarnation: u32, since_s: f64, points: &[(f64, u64, u64)]) -> Series {
        Series {
            process: process.to_owned(),
            incarnation,
            pid: 100 + incarnation,
            since_s,
            samples: points
                .iter()
                .map(|&(t_s, mib, fds)| Sample {
                    t_s,
                    rss_bytes: mib << 20,
                    fds,
                })
                .collect(),
        }
    }

    #[test]
    fn a_steady_leak_is_flagged_and_a_flat_line_is_not() {
        // 100 MiB growing 1 MiB every 10 s for 10 minutes: 60 MiB over the window, far above
        // 10 % + 8 MiB; descriptors flat at 40 with noise.
        let points: Vec<(f64, u64, u64)> = (0u32..60)
            .map(|i| {
                (
                    f64::from(i) * 10.0,
                    100 + u64::from(i),
                    40 + u64::from(i % 2),
                )
            })
            .collect();
        let all = [series("p", 0, 0.0, &points)];
        let t = trends(&["p".into()], &all, 60.0, &GrowthLimits::default());
        assert_eq!(t[0].verdict, Verdict::Growth, "{t:?}");
        assert_eq!(t[1].verdict, Verdict::Steady, "{t:?}");
        assert_eq!(t[0].measured, 54);
        assert!((t[0].slope_per_hour.expect("slope") - 360.0 * f64::from(1 << 20)).abs() < 1.0);
    }

    #[test]
    fn a_restart_starts_a_series_of_its_own_and_is_no_growth() {
        // A process at 20 MiB killed at 300 s and back at 60 MiB (a store loaded): flat within
        // each incarnation, so no growth, though the level jumped.
        let before: Vec<_> = (0..30).map(|i| (f64::from(i) * 10.0, 20, 10)).collect();
        let after: Vec<_> = (31..60).map(|i| (f64::from(i) * 10.0, 60, 30)).collect();
        let all = [series("s", 0, 0.0, &before), series("s", 1, 305.0, &after)];
        let t = trends(&["s".into()], &all, 60.0, &GrowthLimits::default());
        assert_eq!(t[0].incarnations, 2);
        assert_eq!(t[0].verdict, Verdict::Steady, "{t:?}");
        assert_eq!(t[1].verdict, Verdict::Steady, "{t:?}");
        assert_eq!(
            (t[1].first, t[1].last, t[1].min, t[1].max),
            (10.0, 30.0, 10.0, 30.0)
        );
        // The second incarnation's first minute is its warm-up.
        assert_eq!(t[0].measured, 24 + 23);
    }

    #[test]
    fn too_few_samples_get_no_verdict() {
        let all = [series("x", 0, 0.0, &[(0.0, 1, 1), (100.0, 50, 90)])];
        let t = trends(&["x".into()], &all, 60.0, &GrowthLimits::default());
        assert_eq!(t[0].verdict, Verdict::TooFew);
        let t = trends(&["none".into()], &all, 60.0, &GrowthLimits::default());
        assert_eq!((t[0].samples, t[0].verdict), (0, Verdict::TooFew));
    }
}
