//! Open-loop replay: sends each request at its arrival time divided by the speedup.
//!
//! Owns scheduling (arrival clock, optional concurrency cap) and the progress bar.
//! Requests are sent on time whether or not earlier ones finished (open loop), unless a
//! concurrency cap makes the dispatcher wait for a free slot. It must not build
//! requests, parse responses or aggregate statistics.

use std::sync::Arc;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::client::{BenchClient, Outcome};
use crate::request::Request;

/// How to replay.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// Arrival times are divided by this (2.0 = twice as fast). Must be > 0.
    pub speedup: f64,
    /// At most this many requests in flight (open loop when `None`).
    pub concurrency: Option<usize>,
    /// Show a progress bar on stderr (hidden anyway when stderr is not a terminal).
    pub progress: bool,
    /// Label shown beside the progress bar.
    pub label: String,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            speedup: 1.0,
            concurrency: None,
            progress: true,
            label: String::new(),
        }
    }
}

/// Everything a replay measured.
#[derive(Debug, Clone, Default)]
pub struct RunResult {
    /// One outcome per request, sorted by request id.
    pub outcomes: Vec<Outcome>,
    /// From the first send to the last completion.
    pub wall: Duration,
}

fn progress_bar(n: usize, cfg: &RunConfig) -> ProgressBar {
    if !cfg.progress {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(n as u64), ProgressDrawTarget::stderr());
    let style = ProgressStyle::with_template(
        "{prefix:>16} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_prefix(cfg.label.clone());
    pb
}

/// Replay `requests` through `client`. Dropping the returned future aborts every
/// request still in flight.
pub async fn run(client: &BenchClient, requests: Vec<Request>, cfg: &RunConfig) -> RunResult {
    let speedup = if cfg.speedup > 0.0 && cfg.speedup.is_finite() {
        cfg.speedup
    } else {
        1.0
    };
    let n = requests.len();
    let pb = progress_bar(n, cfg);
    let limit = cfg
        .concurrency
        .filter(|&c| c > 0)
        .map(|c| Arc::new(Semaphore::new(c)));
    let mut tasks: JoinSet<Outcome> = JoinSet::new();
    let mut outcomes = Vec::with_capacity(n);
    let mut errors = 0u64;
    let start = Instant::now();
    let start_tokio = tokio::time::Instant::from_std(start);
    for req in requests {
        let due = start_tokio + req.arrival.div_f64(speedup);
        tokio::time::sleep_until(due).await;
        let permit = match &limit {
            Some(sem) => Arc::clone(sem).acquire_owned().await.ok(),
            None => None,
        };
        // Collect what has finished so far, to keep the progress bar live.
        while let Some(done) = tasks.try_join_next() {
            record(done, &mut outcomes, &mut errors, &pb);
        }
        let client = client.clone();
        let scheduled = req.arrival.div_f64(speedup);
        let delay = Instant::now().saturating_duration_since(start + scheduled);
        tasks.spawn(async move {
            let mut out = client.send(&req).await;
            out.dispatch_delay = delay;
            out.sent_at = scheduled + delay;
            drop(permit);
            out
        });
    }
    while let Some(done) = tasks.join_next().await {
        record(done, &mut outcomes, &mut errors, &pb);
    }
    let wall = start.elapsed();
    pb.finish_and_clear();
    outcomes.sort_by_key(|o| o.id);
    RunResult { outcomes, wall }
}

fn record(
    done: Result<Outcome, tokio::task::JoinError>,
    outcomes: &mut Vec<Outcome>,
    errors: &mut u64,
    pb: &ProgressBar,
) {
    match done {
        Ok(out) => {
            if !out.is_ok() {
                *errors += 1;
                pb.set_message(format!("{errors} errors"));
            }
            outcomes.push(out);
        }
        Err(e) => {
            // A panicking request task is a bench bug; count it rather than lose it.
            *errors += 1;
            tracing::error!("request task failed: {e}");
        }
    }
    pb.inc(1);
}
