//! The periodic checks: active health checks (and the generation probe of a stalled
//! worker) and the ledger TTL sweep, each a background task that stops on shutdown.
//!
//! Owns their schedules: every worker's `GET {worker}/health` every `interval_ms`, a
//! worker out of rotation every `unhealthy_interval_ms` too (so a restarted engine
//! rejoins soon after it answers; one declared dead waits about `failure_threshold ×
//! interval + timeout` at most), and the sweep that frees bookings older than the TTL
//! (a backstop; freed bookings are counted). What a probe's answer counts is
//! health.rs's; whether an engine stalled is stall.rs's.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::task::JoinSet;

use crate::gateway::Gateway;
use crate::health::{probe, worker_failed, worker_ok, Failure};
use crate::registry::{ModelState, Worker};
use crate::stall::{generation_probe, ProbeAnswer};

/// Runs health checks until shutdown (no-op when `health.interval_ms` is 0): every
/// worker every `interval_ms`, and a worker out of rotation (breaker open, not stalled)
/// every `unhealthy_interval_ms` too, so a restarted engine rejoins soon after it
/// answers. The regular cadence is kept by time, not by counting rounds, since a round
/// lasts as long as its slowest probe (up to the health timeout).
pub async fn run_health_checks(gw: Arc<Gateway>) {
    let cfg = gw.config.health.clone();
    if cfg.interval_ms == 0 {
        return;
    }
    let regular = Duration::from_millis(cfg.interval_ms);
    let period = match cfg.unhealthy_interval_ms {
        0 => regular,
        ms => regular.min(Duration::from_millis(ms)),
    };
    let mut ticks = gw.ticks(period);
    let mut last_regular: Option<Instant> = None;
    while ticks.next().await {
        let now = Instant::now();
        // A round within a tenth of a period of its due time counts as on time.
        let all = last_regular.is_none_or(|t| now.duration_since(t) + period / 10 >= regular);
        if all {
            last_regular = Some(now);
        }
        let mut set = JoinSet::new();
        for model in gw.pools() {
            for worker in model.workers().iter() {
                let out_of_rotation = worker.breaker.is_open() && !worker.progress.is_stalled();
                if !all && !out_of_rotation {
                    continue;
                }
                let (gw, model, worker) = (gw.clone(), model.clone(), worker.clone());
                set.spawn(async move {
                    if worker.progress.is_stalled() && !probe_stalled(&gw, &model, &worker).await {
                        return;
                    }
                    match probe(&gw, &worker).await {
                        Ok(s) if s.is_success() => worker_ok(&gw, &model, &worker),
                        Ok(s) => {
                            let why = format!("health check answered {s}");
                            worker_failed(&gw, &model, &worker, Failure::HealthCheck(&why));
                        }
                        Err(e) => {
                            let why = format!("health check failed: {e}");
                            worker_failed(&gw, &model, &worker, Failure::HealthCheck(&why));
                        }
                    }
                });
            }
        }
        while set.join_next().await.is_some() {}
    }
}

/// The health check of a stalled worker: a one-token completion. Returns whether the
/// plain health check should decide next (the engine generated, or the probe's answer
/// cannot tell); false keeps the worker out.
async fn probe_stalled(gw: &Gateway, model: &ModelState, worker: &Worker) -> bool {
    match generation_probe(gw, model, worker).await {
        ProbeAnswer::Generated => {
            worker.progress.set_stalled(false);
            worker.progress.touch();
            tracing::info!(model = %model.name, worker = %worker.url, "stalled worker's engine generates again");
            true
        }
        ProbeAnswer::CannotTell(why) => {
            worker.progress.set_stalled(false);
            tracing::warn!(model = %model.name, worker = %worker.url, why, "a generation probe cannot tell whether the stalled worker's engine works; its health check decides");
            true
        }
        ProbeAnswer::Silent(why) => {
            worker_failed(gw, model, worker, Failure::HealthCheck(&why));
            false
        }
    }
}

/// Frees bookings older than the ledger TTL, periodically, until shutdown.
pub async fn run_ledger_sweep(gw: Arc<Gateway>) {
    let ttl = Duration::from_secs(gw.config.ledger_ttl_secs.max(1));
    let period = (ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
    let mut ticks = gw.ticks(period);
    while ticks.next().await {
        for model in gw.pools() {
            let n = model.selection.sweep_expired(Instant::now());
            if n > 0 {
                tracing::warn!(model = %model.name, swept = n, "ledger TTL sweep freed bookings whose request never ended");
            }
        }
    }
}
