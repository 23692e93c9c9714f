//! The attempt loop: book, forward, and on a failure before any byte reached the
//! client, retry on another healthy worker (bounded attempts, exponential backoff).
//!
//! Owns the retry decision and the breaker bookkeeping for proxied requests. A
//! response whose head has been accepted is committed: from then on bytes flow to the
//! client and nothing is retried. Must not parse bodies (observe.rs) or pick workers
//! itself (routing.rs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::{header, HeaderMap, StatusCode};
use kvgate_core::{BookingSpec, WorkerId};
use smallvec::SmallVec;

use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::observe::{Lifecycle, ObservedBody};
use crate::proxy::{prepare_response_headers, send, SendError};
use crate::registry::{Endpoint, ModelState, Worker};
use crate::routing::{pick, Prepared};

/// Statuses worth another worker: the engine failed or is overloaded.
fn retryable(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

/// Counts a failure against a worker's breaker, logging when it opens.
pub(crate) fn worker_failed(gw: &Gateway, model: &ModelState, worker: &Worker, why: &str) {
    if worker
        .breaker
        .record_failure(gw.config.health.failure_threshold)
    {
        tracing::warn!(model = %model.name, worker = %worker.url, why, "circuit breaker opened: worker taken out of rotation");
        gw.metrics
            .health_transitions
            .with_label_values(&[&*model.name, &*worker.url, "open"])
            .inc();
    }
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

/// Routes and forwards one request, with failover before the first byte.
pub async fn dispatch(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: Bytes,
    p: Prepared,
) -> Result<Response, ApiError> {
    let started = tokio::time::Instant::now();
    let mut global = gw.limiter.acquire().await?;
    let model = p.model.clone();
    let policy = model.kind().as_str();
    let cfg = &gw.config;
    let auth = gw.forward_auth();
    let mut excluded: SmallVec<[WorkerId; 4]> = SmallVec::new();
    let mut last_err: Option<ApiError> = None;
    let mut backoff = Duration::from_millis(cfg.failover.backoff_ms);
    for attempt in 0..cfg.failover.max_attempts {
        if attempt > 0 {
            tokio::time::sleep(backoff).await;
            backoff = backoff.saturating_mul(2);
        }
        let (decision, worker, permit) = match pick(gw, &p, headers, &excluded).await {
            Ok(x) => x,
            Err(e) => {
                // After a failed attempt, "nobody left" means the attempts failed.
                return Err(match last_err {
                    Some(prev) if e.status == StatusCode::SERVICE_UNAVAILABLE => prev,
                    _ => e,
                });
            }
        };
        let guard = model.ledger.book(
            worker.id,
            BookingSpec {
                prompt_tokens: p.prompt_tokens,
                cached_tokens: decision.predicted_cached_tokens,
                expected_output_tokens: p.max_tokens,
            },
            Instant::now(),
        );
        let last = attempt + 1 == cfg.failover.max_attempts;
        match send(
            &gw.client,
            &worker,
            endpoint,
            headers,
            auth,
            body.clone(),
            cfg.timeouts.first_byte(),
        )
        .await
        {
            Ok(resp) if retryable(resp.status()) && !last => {
                let status = resp.status();
                if status.is_server_error() {
                    worker_failed(gw, &model, &worker, "error status");
                }
                gw.metrics
                    .requests
                    .with_label_values(&[&*model.name, &*worker.url, policy, status.as_str()])
                    .inc();
                gw.metrics
                    .retries
                    .with_label_values(&[&*model.name, "status"])
                    .inc();
                tracing::debug!(worker = %worker.url, %status, attempt, "retrying on another worker");
                excluded.push(worker.id);
                last_err = Some(ApiError::new(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    "upstream_error",
                    format!("worker {} answered {status}", worker.url),
                ));
                drop((resp, guard, permit));
            }
            Ok(resp) => {
                let status = resp.status();
                if status.is_server_error() {
                    worker_failed(gw, &model, &worker, "error status");
                } else {
                    worker_ok(gw, &model, &worker);
                }
                gw.metrics
                    .requests
                    .with_label_values(&[&*model.name, &*worker.url, policy, status.as_str()])
                    .inc();
                let (mut parts, incoming) = resp.into_parts();
                prepare_response_headers(&mut parts.headers, &worker);
                let sse = parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
                let life = Lifecycle {
                    guard: Some(guard),
                    permit: Some(permit),
                    global: global.take(),
                    gw: gw.clone(),
                    model: model.clone(),
                    predicted_cached: decision.predicted_cached_tokens,
                };
                let deadline = cfg
                    .timeouts
                    .total()
                    .map(|d| Box::pin(tokio::time::sleep_until(started + d)));
                let body = ObservedBody::new(incoming, life, sse, deadline);
                return Ok(Response::from_parts(parts, Body::new(body)));
            }
            Err(e) => {
                worker_failed(gw, &model, &worker, e.reason());
                gw.metrics
                    .retries
                    .with_label_values(&[&*model.name, e.reason()])
                    .inc();
                tracing::debug!(worker = %worker.url, error = %e, attempt, "attempt failed before the first byte");
                excluded.push(worker.id);
                let (status, code) = match e {
                    SendError::Timeout => (StatusCode::GATEWAY_TIMEOUT, "upstream_timeout"),
                    SendError::Transport(_) => (StatusCode::BAD_GATEWAY, "upstream_unreachable"),
                };
                last_err = Some(ApiError::new(
                    status,
                    "upstream_error",
                    code,
                    format!("worker {} failed: {e}", worker.url),
                ));
                drop((guard, permit));
            }
        }
    }
    Err(last_err.unwrap_or_else(|| ApiError::internal("no attempt was made")))
}
