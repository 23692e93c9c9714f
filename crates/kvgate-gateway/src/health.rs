//! Worker health: what a failure or success counts against a worker's circuit breaker
//! (one place, for proxied requests and health probes alike), and the background
//! tasks: active health checks and the ledger TTL sweep.
//!
//! Owns the periodic `GET {worker}/health` probes that feed each worker's circuit
//! breaker (a worker declared dead has its prefix-index entries purged and the requests
//! in flight on it cut off, so none waits on a dead engine longer than about
//! `failure_threshold × interval + timeout`; it returns to rotation on its next
//! successful probe, which comes every `unhealthy_interval_ms` while it is out), and
//! the sweep that frees bookings older
//! than the TTL (a backstop; freed bookings are counted). A worker whose engine
//! stalled (stall.rs) is cut off the same way, without a purge (its engine may
//! resume with its cache), and is probed with a one-token completion instead of its
//! health path until it generates again. Health never touches the ledger's per-worker
//! load. Both tasks stop on gateway shutdown.

use std::sync::Arc;
use std::time::{Duration, Instant};

use http::StatusCode;
use tokio::task::JoinSet;

use crate::gateway::Gateway;
use crate::proxy::{get_status, SendError};
use crate::registry::{Endpoint, ModelState, Worker};
use crate::stall::{generation_probe, ProbeAnswer};

/// What a worker failed at.
#[derive(Clone, Copy, Debug)]
pub enum Failure<'a> {
    /// A proxied request's attempt (transport error, timeout, 5xx), with its reason.
    Request(&'a str),
    /// An active health probe, with what it got.
    HealthCheck(&'a str),
}

/// The `to` labels of `kvgate_worker_health_transitions_total` (the only two written
/// below).
pub(crate) const BREAKER_TRANSITIONS: [&str; 2] = ["open", "closed"];

/// Counts a failure against a worker's breaker, logging when it opens. A worker whose
/// health check fails is, once its breaker is open, declared dead: its prefix-index
/// entries are purged (when the breaker opens) and the requests in flight on it are
/// cut off (each time its probe fails while open), so none waits on a dead engine.
pub(crate) fn worker_failed(gw: &Gateway, model: &ModelState, worker: &Worker, failure: Failure) {
    let opened = worker
        .breaker
        .record_failure(gw.config.health.failure_threshold);
    if opened {
        gw.metrics
            .health_transitions
            .with_label_values(&[&*model.name, &*worker.url, "open"])
            .inc();
    }
    match failure {
        Failure::Request(why) => {
            if opened {
                tracing::warn!(model = %model.name, worker = %worker.url, why, "circuit breaker opened: worker taken out of rotation");
            }
        }
        Failure::HealthCheck(why) => {
            if opened {
                tracing::warn!(model = %model.name, worker = %worker.url, why, "worker declared dead: taken out of rotation");
                gw.purge(model, worker, "dead");
            } else {
                tracing::debug!(model = %model.name, worker = %worker.url, why);
            }
            if worker.breaker.is_open() {
                // Its engine does not answer health checks: requests waiting on it
                // would wait for the first-byte timeout.
                worker.cut_off_in_flight();
            }
        }
    }
}

/// Takes a worker whose engine stalled (stall.rs) out of rotation and cuts off its
/// requests in flight: those still waiting for a first byte go to another worker,
/// streams under way end with an error event. Its index entries stay (the engine may
/// resume with its cache); it comes back when a generation probe answers.
pub(crate) fn worker_stalled(gw: &Gateway, model: &ModelState, worker: &Worker, stall: Duration) {
    if worker.progress.set_stalled(true) {
        return;
    }
    if worker.breaker.trip() {
        gw.metrics
            .health_transitions
            .with_label_values(&[&*model.name, &*worker.url, "open"])
            .inc();
    }
    gw.metrics
        .worker_stalls
        .with_label_values(&[&*model.name, &*worker.url])
        .inc();
    tracing::warn!(
        model = %model.name,
        worker = %worker.url,
        stall_ms = stall.as_millis() as u64,
        "worker stalled: requests in flight and no answer byte or KV event from its engine; taken out of rotation, its requests cut off"
    );
    worker.cut_off_in_flight();
}

/// Counts a success, logging when it closes an open breaker.
pub(crate) fn worker_ok(gw: &Gateway, model: &ModelState, worker: &Worker) {
    if worker.breaker.record_success() {
        tracing::info!(model = %model.name, worker = %worker.url, "circuit breaker closed: worker back in rotation");
        gw.metrics
            .health_transitions
            .with_label_values(&[&*model.name, &*worker.url, "closed"])
            .inc();
    }
}

/// One health probe of a worker (`GET` its health path within the health timeout),
/// for the periodic checks and for failover's "is it alive?" question alike.
pub(crate) async fn probe(gw: &Gateway, worker: &Worker) -> Result<StatusCode, SendError> {
    let timeout = Duration::from_millis(gw.config.health.timeout_ms.max(1));
    get_status(&gw.client, worker, Endpoint::Health, timeout).await
}

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
