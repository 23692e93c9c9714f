//! Aggregation of a run into a report: latency percentiles, throughput, errors, prefix
//! hit rate, per-worker spread; rendered as a text table and serialized as JSON.
//!
//! Owns the statistics and their presentation for one run. It must not send requests
//! or know about fleets and routers.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::client::Outcome;
use crate::runner::RunResult;

/// Percentile of an ascending-sorted slice with linear interpolation between closest
/// ranks (the numpy default). `p` is in `[0, 100]`. `None` for an empty slice.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let p = p.clamp(0.0, 100.0);
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    let frac = rank - lo as f64;
    Some(sorted[lo] + (sorted[hi] - sorted[lo]) * frac)
}

/// Summary of one latency distribution, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    /// Number of samples.
    pub count: usize,
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Maximum.
    pub max: f64,
}

impl LatencyStats {
    /// Statistics of a set of durations (all zero when empty).
    pub fn from_durations(samples: impl IntoIterator<Item = Duration>) -> Self {
        let mut ms: Vec<f64> = samples
            .into_iter()
            .map(|d| d.as_secs_f64() * 1000.0)
            .collect();
        ms.sort_by(f64::total_cmp);
        if ms.is_empty() {
            return Self::default();
        }
        let pct = |p| percentile(&ms, p).unwrap_or(0.0);
        Self {
            count: ms.len(),
            mean: ms.iter().sum::<f64>() / ms.len() as f64,
            p50: pct(50.0),
            p90: pct(90.0),
            p99: pct(99.0),
            max: ms.last().copied().unwrap_or(0.0),
        }
    }
}

/// The report of one run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// What was measured (router/policy name or target URL).
    pub label: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that completed without error.
    pub ok: usize,
    /// Requests that failed.
    pub errors: usize,
    /// Failures by class (HTTP status or transport class).
    pub errors_by_kind: BTreeMap<String, usize>,
    /// Seconds from the first send to the last completion.
    pub duration_s: f64,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens of completed requests per second.
    pub output_tokens_per_s: f64,
    /// Time to first token.
    pub ttft_ms: LatencyStats,
    /// Inter-token latency (gap between streamed chunks).
    pub itl_ms: LatencyStats,
    /// End-to-end latency.
    pub e2e_ms: LatencyStats,
    /// Time requests waited in the bench before being sent (concurrency cap or overload
    /// of the bench itself); should be near zero for an open-loop run.
    pub dispatch_delay_ms: LatencyStats,
    /// Prompt tokens of completed requests.
    pub prompt_tokens: u64,
    /// Output tokens of completed requests.
    pub output_tokens: u64,
    /// Sum of `cached_tokens` reported by the engines.
    pub cached_tokens: u64,
    /// Completed requests whose usage carried `cached_tokens`.
    pub requests_with_cache_info: usize,
    /// `cached_tokens / prompt_tokens` over requests that reported it; `None` when none did.
    pub prefix_hit_rate: Option<f64>,
    /// Completed requests per worker (from the `x-kvgate-worker` header).
    pub per_worker: BTreeMap<String, usize>,
    /// Max over mean of `per_worker` (1.0 = perfectly even); `None` without worker info.
    pub worker_spread: Option<f64>,
    /// The TTFT distribution of completed requests: `(ms, share of requests at or
    /// below)`, at most 200 points (for the CDF plot).
    #[serde(default)]
    pub ttft_cdf_ms: Vec<(f64, f64)>,
    /// Requests sent per second of the replay, per worker that served them (for the
    /// per-worker load plot): element `i` counts those sent in second `i`.
    #[serde(default)]
    pub per_worker_per_second: BTreeMap<String, Vec<u32>>,
    /// The cached tokens the router predicted for the completed requests (kvgate rows;
    /// `None` when the router does not say), beside `cached_tokens`, what the engines
    /// reported.
    #[serde(default)]
    pub predicted_cached_tokens: Option<u64>,
    /// How far the router's predicted time to first token was from the observed one,
    /// over completed requests with a prediction (kvgate rows): |predicted − observed| /
    /// observed, median and 90th percentile.
    #[serde(default)]
    pub ttft_prediction_error: Option<PredictionError>,
    /// Of the requests sent with a TTFT objective, those answered within it per second
    /// of the run (`None` when no request had an objective).
    #[serde(default)]
    pub goodput_per_s: Option<f64>,
    /// Requests sent with a TTFT objective, and how many were answered within it.
    #[serde(default)]
    pub objectives_met: Option<(usize, usize)>,
}

/// The distribution of a prediction's relative error.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PredictionError {
    pub requests: usize,
    pub p50: f64,
    pub p90: f64,
}

impl PredictionError {
    /// |predicted − observed| / observed over the pairs with a positive observation
    /// (`None` when there are none).
    pub fn of(pairs: impl IntoIterator<Item = (f64, f64)>) -> Option<Self> {
        let mut errors: Vec<f64> = pairs
            .into_iter()
            .filter(|&(_, observed)| observed > 0.0)
            .map(|(predicted, observed)| (predicted - observed).abs() / observed)
            .collect();
        errors.sort_by(f64::total_cmp);
        Some(Self {
            requests: errors.len(),
            p50: percentile(&errors, 50.0)?,
            p90: percentile(&errors, 90.0)?,
        })
    }
}

/// What the engines reported of their prefix caches over some answered requests: the
/// ones whose usage carried `cached_tokens`, their cached and their prompt tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheReports {
    pub requests: usize,
    pub cached_tokens: u64,
    pub prompt_tokens: u64,
}

impl CacheReports {
    pub fn of<'a>(answered: impl IntoIterator<Item = &'a Outcome>) -> Self {
        let mut out = Self::default();
        for o in answered {
            if let Some(cached) = o.cached_tokens {
                out.requests += 1;
                out.cached_tokens += cached;
                out.prompt_tokens += o.prompt_tokens;
            }
        }
        out
    }

    /// Cached over prompt tokens; `None` when no request reported.
    pub fn prefix_hit_rate(&self) -> Option<f64> {
        (self.prompt_tokens > 0).then(|| self.cached_tokens as f64 / self.prompt_tokens as f64)
    }
}

impl Report {
    /// Aggregate a run.
    pub fn from_run(label: &str, run: &RunResult) -> Self {
        let outs = &run.outcomes;
        let ok: Vec<&Outcome> = outs.iter().filter(|o| o.is_ok()).collect();
        let mut errors_by_kind = BTreeMap::new();
        for o in outs.iter().filter(|o| !o.is_ok()) {
            let kind = o.error.clone().unwrap_or_else(|| "unknown".into());
            *errors_by_kind.entry(kind).or_insert(0) += 1;
        }
        let secs = run.wall.as_secs_f64();
        let output_tokens: u64 = ok.iter().map(|o| o.completion_tokens).sum();
        let prompt_tokens: u64 = ok.iter().map(|o| o.prompt_tokens).sum();
        let cache = CacheReports::of(ok.iter().copied());
        let mut per_worker = BTreeMap::new();
        let mut per_worker_per_second: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for o in &ok {
            if let Some(w) = &o.worker {
                *per_worker.entry(w.clone()).or_insert(0) += 1;
                let bins = per_worker_per_second.entry(w.clone()).or_default();
                let second = o.sent_at.as_secs() as usize;
                if bins.len() <= second {
                    bins.resize(second + 1, 0);
                }
                bins[second] += 1;
            }
        }
        let worker_spread = spread(&per_worker);
        // Same length for every worker: a worker that got nothing late shows zeros.
        let seconds = per_worker_per_second
            .values()
            .map(Vec::len)
            .max()
            .unwrap_or(0);
        for bins in per_worker_per_second.values_mut() {
            bins.resize(seconds, 0);
        }
        let ttft_values: Vec<f64> = ok
            .iter()
            .filter_map(|o| o.ttft)
            .map(|d| d.as_secs_f64() * 1e3)
            .collect();
        let rate = |x: f64| if secs > 0.0 { x / secs } else { 0.0 };
        let with_objective = outs.iter().filter(|o| o.objective.ttft_ms.is_some());
        let (met, asked) = with_objective.fold((0, 0), |(met, asked), o| {
            let ok = o.is_ok() && o.ttft.and_then(|t| o.objective.met(t)) == Some(true);
            (met + usize::from(ok), asked + 1)
        });
        let objectives_met = (asked > 0).then_some((met, asked));
        Self {
            label: label.to_string(),
            requests: outs.len(),
            ok: ok.len(),
            errors: outs.len() - ok.len(),
            errors_by_kind,
            duration_s: secs,
            requests_per_s: rate(ok.len() as f64),
            output_tokens_per_s: rate(output_tokens as f64),
            ttft_ms: LatencyStats::from_durations(ok.iter().filter_map(|o| o.ttft)),
            itl_ms: LatencyStats::from_durations(ok.iter().flat_map(|o| o.itl.iter().copied())),
            e2e_ms: LatencyStats::from_durations(ok.iter().map(|o| o.e2e)),
            dispatch_delay_ms: LatencyStats::from_durations(outs.iter().map(|o| o.dispatch_delay)),
            prompt_tokens,
            output_tokens,
            cached_tokens: cache.cached_tokens,
            requests_with_cache_info: cache.requests,
            prefix_hit_rate: cache.prefix_hit_rate(),
            per_worker,
            worker_spread,
            ttft_cdf_ms: crate::plot::cdf_points(&ttft_values, 200),
            per_worker_per_second,
            predicted_cached_tokens: None,
            ttft_prediction_error: PredictionError::of(
                ok.iter()
                    .filter_map(|o| Some((o.predicted_ttft?.as_secs_f64(), o.ttft?.as_secs_f64()))),
            ),
            goodput_per_s: objectives_met.map(|(met, _)| rate(met as f64)),
            objectives_met,
        }
    }

    /// Predicted over engine-reported cached tokens (1 = honest), when both are known.
    pub fn predicted_over_reported(&self) -> Option<f64> {
        let predicted = self.predicted_cached_tokens?;
        (self.cached_tokens > 0).then(|| predicted as f64 / self.cached_tokens as f64)
    }

    /// Set per-worker counts from another source (e.g. the engines' own counters) when
    /// the responses carried no worker header.
    pub fn set_per_worker(&mut self, per_worker: BTreeMap<String, usize>) {
        self.worker_spread = spread(&per_worker);
        self.per_worker = per_worker;
    }

    /// Counts every worker of the fleet (`all`), those that served nothing at 0, so
    /// the spread sees a herd: 64 requests on one of two engines is 2.0, not 1.0.
    pub fn include_idle_workers<'a>(&mut self, all: impl IntoIterator<Item = &'a String>) {
        if self.per_worker.is_empty() {
            return; // no worker named per request: nothing to compare against
        }
        let seconds = self
            .per_worker_per_second
            .values()
            .map(Vec::len)
            .max()
            .unwrap_or(0);
        for name in all {
            self.per_worker.entry(name.clone()).or_insert(0);
            self.per_worker_per_second
                .entry(name.clone())
                .or_insert_with(|| vec![0; seconds]);
        }
        self.worker_spread = spread(&self.per_worker);
    }

    /// A human-readable multi-line table.
    pub fn render_table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "== {} ==", self.label);
        let _ = writeln!(
            s,
            "requests {}  ok {}  errors {}{}",
            self.requests,
            self.ok,
            self.errors,
            if self.errors_by_kind.is_empty() {
                String::new()
            } else {
                format!(
                    " ({})",
                    self.errors_by_kind
                        .iter()
                        .map(|(k, v)| format!("{k}: {v}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        );
        let _ = writeln!(
            s,
            "duration {:.1} s  throughput {:.2} req/s  {:.1} output tok/s",
            self.duration_s, self.requests_per_s, self.output_tokens_per_s
        );
        let _ = writeln!(
            s,
            "{:<10} {:>10} {:>10} {:>10} {:>10} {:>10}",
            "latency ms", "mean", "p50", "p90", "p99", "max"
        );
        for (name, st) in [
            ("TTFT", &self.ttft_ms),
            ("ITL", &self.itl_ms),
            ("E2E", &self.e2e_ms),
        ] {
            let _ = writeln!(
                s,
                "{:<10} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1}",
                name, st.mean, st.p50, st.p90, st.p99, st.max
            );
        }
        let _ = writeln!(
            s,
            "prefix hit rate {}  ({} cached / {} prompt tokens)",
            fmt_pct(self.prefix_hit_rate),
            self.cached_tokens,
            self.prompt_tokens
        );
        if let Some(ratio) = self.predicted_over_reported() {
            let _ = writeln!(s, "predicted / reported cached tokens {ratio:.3}");
        }
        if let (Some(g), Some((met, asked))) = (self.goodput_per_s, self.objectives_met) {
            let _ = writeln!(
                s,
                "goodput {g:.2} req/s: {met} of {asked} requests with a TTFT objective met it"
            );
        }
        if let Some(e) = self.ttft_prediction_error {
            let _ = writeln!(
                s,
                "TTFT prediction error (|predicted - observed| / observed) p50 {:.1}%  p90 {:.1}%  over {} requests",
                e.p50 * 100.0,
                e.p90 * 100.0,
                e.requests
            );
        }
        if !self.per_worker.is_empty() {
            let _ = writeln!(
                s,
                "per worker: {}  spread (max/mean) {}",
                self.per_worker
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" "),
                fmt_opt(self.worker_spread, 2)
            );
        }
        s
    }
}

/// Max over mean of per-worker counts.
pub fn spread(per_worker: &BTreeMap<String, usize>) -> Option<f64> {
    if per_worker.is_empty() {
        return None;
    }
    let total: usize = per_worker.values().sum();
    let max = per_worker.values().copied().max().unwrap_or(0);
    let mean = total as f64 / per_worker.len() as f64;
    (mean > 0.0).then(|| max as f64 / mean)
}

/// `Some(0.4321)` → `"43.2%"`, `None` → `"n/a"`.
pub fn fmt_pct(v: Option<f64>) -> String {
    v.map_or_else(|| "n/a".into(), |x| format!("{:.1}%", x * 100.0))
}

/// Optional float with `digits` decimals, `"n/a"` when absent.
pub fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "n/a".into(), |x| format!("{x:.digits$}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_interpolates_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        // numpy.percentile([1,2,3,4], 90) == 3.7
        assert!((percentile(&v, 90.0).unwrap() - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[5.0], 99.0), Some(5.0));
        assert_eq!(percentile(&[], 50.0), None);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&hundred, 99.0).unwrap() - 99.01).abs() < 1e-9);
    }

    #[test]
    fn latency_stats_from_unsorted_durations() {
        let st = LatencyStats::from_durations([30, 10, 20].into_iter().map(Duration::from_millis));
        assert_eq!(st.count, 3);
        assert!((st.p50 - 20.0).abs() < 1e-9);
        assert!((st.mean - 20.0).abs() < 1e-9);
        assert!((st.max - 30.0).abs() < 1e-9);
        assert_eq!(LatencyStats::from_durations([]), LatencyStats::default());
    }

    fn outcome(id: u64, worker: &str, cached: Option<u64>, error: Option<&str>) -> Outcome {
        Outcome {
            id,
            status: Some(if error.is_some() { 503 } else { 200 }),
            error: error.map(str::to_string),
            ttft: error
                .is_none()
                .then(|| Duration::from_millis(10 * (id + 1))),
            itl: vec![Duration::from_millis(2); 3],
            e2e: Duration::from_millis(100),
            prompt_tokens: 100,
            completion_tokens: 4,
            cached_tokens: cached,
            worker: Some(worker.to_string()),
            ..Outcome::default()
        }
    }

    fn sample_run() -> RunResult {
        RunResult {
            outcomes: vec![
                outcome(0, "a", Some(0), None),
                outcome(1, "a", Some(50), None),
                outcome(2, "b", Some(100), None),
                outcome(3, "b", None, Some("503")),
                outcome(4, "a", None, None),
            ],
            wall: Duration::from_secs(2),
        }
    }

    #[test]
    fn report_aggregates_hits_errors_and_spread() {
        let r = Report::from_run("x", &sample_run());
        assert_eq!(r.requests, 5);
        assert_eq!(r.ok, 4);
        assert_eq!(r.errors, 1);
        assert_eq!(r.errors_by_kind.get("503"), Some(&1));
        // Hit rate over requests that reported cached tokens: 150 / 300.
        assert!((r.prefix_hit_rate.unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(r.per_worker.get("a"), Some(&3));
        assert_eq!(r.per_worker.get("b"), Some(&1));
        assert!((r.worker_spread.unwrap() - 1.5).abs() < 1e-12);
        // A third worker of the fleet that served nothing counts: 3 / (4 / 3).
        let mut with_idle = r.clone();
        with_idle.include_idle_workers(&["a".to_owned(), "b".to_owned(), "c".to_owned()]);
        assert_eq!(with_idle.per_worker.get("c"), Some(&0));
        assert!((with_idle.worker_spread.unwrap() - 2.25).abs() < 1e-12);
        assert_eq!(
            with_idle.per_worker_per_second["c"].len(),
            with_idle.per_worker_per_second["a"].len()
        );
        assert!((r.requests_per_s - 2.0).abs() < 1e-12);
        assert!((r.output_tokens_per_s - 8.0).abs() < 1e-12);
        assert_eq!(r.ttft_ms.count, 4);
        assert_eq!(r.itl_ms.count, 12);
        let table = r.render_table();
        assert!(table.contains("TTFT") && table.contains("50.0%"), "{table}");
    }

    #[test]
    fn report_json_shape() {
        let r = Report::from_run("kv_aware", &sample_run());
        let v = serde_json::to_value(&r).unwrap();
        for key in [
            "label",
            "requests",
            "ok",
            "errors",
            "errors_by_kind",
            "duration_s",
            "requests_per_s",
            "output_tokens_per_s",
            "ttft_ms",
            "itl_ms",
            "e2e_ms",
            "prefix_hit_rate",
            "per_worker",
            "worker_spread",
        ] {
            assert!(v.get(key).is_some(), "missing {key}");
        }
        for key in ["count", "mean", "p50", "p90", "p99", "max"] {
            assert!(v["ttft_ms"][key].is_number(), "ttft_ms.{key}");
        }
        assert_eq!(v["label"], "kv_aware");
        let back: Report = serde_json::from_value(v).unwrap();
        assert_eq!(back, r);
    }
}
