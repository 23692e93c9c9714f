//! Worker health: what a failure, a success or a stall counts against a worker's
//! circuit breaker (one place, for proxied requests, health probes and the stall
//! watcher alike), and the health probe itself.
//!
//! A worker whose health check fails is, once its breaker opens, declared dead: its
//! prefix-index entries are purged and the requests in flight on it cut off, so none
//! waits on a dead engine. A worker whose engine stalled (stall.rs) is cut off the same
//! way, without a purge (its engine may resume with its cache). The periodic checks
//! that call these live in checks.rs. Health never touches the ledger's per-worker
//! load.

use std::time::Duration;

use http::StatusCode;

use crate::gateway::Gateway;
use crate::proxy::{get_status, SendError};
use crate::registry::{Endpoint, ModelState, Worker};

/// What a worker failed at.
#[derive(Clone, Copy, Debug)]
pub enum Failure<'a> {
    /// A proxied request's attempt (transport error, timeout, 5xx), with its reason.
    Request(&'a str),
    /// An active health probe, with what it got.
    HealthCheck(&'a str),
}

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
