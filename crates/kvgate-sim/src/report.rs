//! A simulated run as the bench reports a real one.
//!
//! Owns the translation from [`SimRun`] records to `kvgate bench`'s per-request
//! outcomes, so a simulated row goes through the same statistics, table, JSON and
//! plots as a real-time `kvgate bench compare` row ([`Report::from_run`]). It must not
//! compute statistics of its own beyond what the bench's report has no field for.

use std::time::Duration;

use kvgate_bench::client::Outcome;
use kvgate_bench::report::Report;
use kvgate_bench::runner::RunResult;

use crate::simulation::{engine_name, RequestRecord, SimRun, Target};

fn ms(v: f64) -> Duration {
    Duration::from_secs_f64((v / 1000.0).max(0.0))
}

fn outcome(r: &RequestRecord) -> Outcome {
    let sent = r.sent_ms;
    Outcome {
        id: r.id,
        status: r.error.is_none().then_some(200),
        error: r.error.map(|e| e.class().to_string()),
        error_detail: None,
        dispatch_delay: Duration::ZERO,
        sent_at: ms(sent),
        ttft: r.first_token_ms.map(|t| ms(t - sent)),
        itl: r.itl_ms.iter().map(|&g| ms(g)).collect(),
        e2e: ms(r.done_ms.unwrap_or(sent) - sent),
        prompt_tokens: u64::from(r.prompt_tokens),
        completion_tokens: u64::from(r.output_tokens),
        cached_tokens: r.cached_tokens.map(u64::from),
        worker: r.engine.map(engine_name),
        response_id: None,
        predicted_ttft: r.predicted_ttft_ms.map(ms),
        objective: r.objective,
    }
}

/// The bench's report of the requests sent through the router, with the router's
/// predicted cached tokens beside the engines' reports.
pub fn report(label: &str, run: &SimRun) -> Report {
    let routed: Vec<&RequestRecord> = run
        .records
        .iter()
        .filter(|r| r.target == Target::Router)
        .collect();
    let first = routed
        .iter()
        .map(|r| r.sent_ms)
        .fold(f64::INFINITY, f64::min);
    let last = routed
        .iter()
        .filter_map(|r| r.done_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let wall = if last > first {
        ms(last - first)
    } else {
        Duration::ZERO
    };
    let outcomes = routed_outcomes(run);
    let mut report = Report::from_run(label, &RunResult { outcomes, wall });
    report.include_idle_workers(&run.engine_names);
    let predictions: Vec<u64> = routed
        .iter()
        .filter(|r| r.error.is_none())
        .filter_map(|r| r.predicted_cached_tokens)
        .map(u64::from)
        .collect();
    report.predicted_cached_tokens = (!predictions.is_empty()).then(|| predictions.iter().sum());
    report
}

/// The requests sent through the router, as the bench's per-request outcomes.
pub fn routed_outcomes(run: &SimRun) -> Vec<Outcome> {
    run.records
        .iter()
        .filter(|r| r.target == Target::Router)
        .map(outcome)
        .collect()
}

/// Share of the routed requests sent in `[from_ms, to_ms)` that engine `engine` served.
pub fn share_between(run: &SimRun, engine: usize, from_ms: f64, to_ms: f64) -> Option<f64> {
    let window: Vec<&RequestRecord> = run
        .records
        .iter()
        .filter(|r| r.target == Target::Router && r.sent_ms >= from_ms && r.sent_ms < to_ms)
        .collect();
    if window.is_empty() {
        return None;
    }
    let hits = window.iter().filter(|r| r.engine == Some(engine)).count();
    Some(hits as f64 / window.len() as f64)
}
