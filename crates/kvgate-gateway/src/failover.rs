//! Calling workers: the one attempt loop ([`call_workers`]) for routed requests
//! ([`dispatch`]: the policy chooses, each attempt takes a lease) and for calls that
//! book nothing ([`side_call`]: `/tokenize` forwarding, remote tokenization). Bounded
//! attempts, exponential backoff; a failure before any byte reached the client moves on
//! to another healthy worker.
//!
//! Owns the retry decision for every call to a worker (what a failure counts against
//! the worker is health.rs's; the sending itself is proxy.rs's). An answer that has
//! begun (its head, and for an event stream its first event: proxy.rs waits for both)
//! is committed: from then on bytes flow to the client and nothing is retried. So an
//! engine that dies after its API server sent a stream's head but before the first
//! token (vLLM sends the head at once) costs the request a retry, not an error event.
//! Must not parse bodies (observe.rs) or pick workers itself (routing.rs).

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::{header, StatusCode};
use kvgate_core::{BlockKey, Decision, WorkerId, WorkerScore};
use smallvec::SmallVec;

use crate::errors::ApiError;
use crate::front_door::{is_json_media_type, Admitted};
use crate::gateway::Gateway;
use crate::health::{probe, worker_failed, worker_ok, Failure};
use crate::lease::Lease;
use crate::limits::Admission;
use crate::observe::{Lifecycle, ObservedBody};
use crate::proxy::{is_event_stream, prepare_response_headers, SendError, UpstreamBody};
use crate::registry::{Endpoint, ModelState, Worker};
use crate::routing::{pick, Prepared};

/// The `reason` labels of `kvgate_retries_total`: a retryable HTTP status, or why the
/// request could not be sent.
pub(crate) const RETRY_REASONS: [&str; 5] = [
    "status",
    SendError::REASONS[0],
    SendError::REASONS[1],
    SendError::REASONS[2],
    SendError::REASONS[3],
];

/// Statuses worth another worker: the engine failed or is overloaded.
fn retryable(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

/// Counts a request that ended without an answer from the gateway (the client went
/// away while it waited for admission, tokenization, a worker slot or a worker's first
/// byte) as status 499, so every request that ends is in `kvgate_requests_total`,
/// however it ends. Marked answered when a response is handed back.
pub(crate) struct Unanswered {
    gw: Arc<Gateway>,
    pub(crate) model: Option<Arc<ModelState>>,
    worker: Option<Arc<Worker>>,
    answered: bool,
}

impl Unanswered {
    pub(crate) fn new(gw: &Arc<Gateway>) -> Self {
        Self {
            gw: gw.clone(),
            model: None,
            worker: None,
            answered: false,
        }
    }

    /// Marks the request answered and passes the response through.
    pub(crate) fn answered<T>(&mut self, response: T) -> T {
        self.answered = true;
        response
    }
}

impl Drop for Unanswered {
    fn drop(&mut self) {
        if self.answered {
            return;
        }
        let (model, policy) = self
            .model
            .as_ref()
            .map_or(("", ""), |m| (&*m.name, m.kind().as_str()));
        let worker = self.worker.as_ref().map_or("", |w| &*w.url);
        self.gw
            .metrics
            .requests
            .with_label_values(&[model, worker, policy, "499"])
            .inc();
    }
}

/// Routes and forwards one admitted request, with failover before the first byte. A
/// disaggregated model's request runs its prefill and decode legs (disaggregation.rs),
/// unless its prompt is short enough to skip the split.
pub(crate) async fn dispatch(
    gw: &Arc<Gateway>,
    endpoint: Endpoint,
    admitted: Admitted,
    p: Prepared,
    record: &mut Unanswered,
) -> Result<Response, ApiError> {
    let Admitted {
        headers,
        body,
        admission,
    } = admitted;
    let request = Forwarded {
        endpoint,
        headers,
        body,
        started: tokio::time::Instant::now(),
    };
    if let Some(prefill) = &p.model.prefill {
        if !crate::disaggregation::skips_prefill(gw, prefill, &p) {
            return crate::disaggregation::dispatch(gw, prefill, request, &p, &admission, record)
                .await;
        }
        crate::disaggregation::count(gw, &p.model.name, "whole");
    }
    let route = Route::Booked {
        p: &p,
        admission: &admission,
        record,
    };
    let accepted = call_workers(gw, &request, route).await?;
    answer(gw, &request, accepted).await
}

/// The client's response from an accepted routed attempt: an engine's non-JSON error
/// page re-made as OpenAI-style JSON, anything else passed through with its body
/// observed until it ends (the lease ends with it).
pub(crate) async fn answer(
    gw: &Arc<Gateway>,
    request: &Forwarded,
    accepted: Accepted,
) -> Result<Response, ApiError> {
    let Some((decision, lease)) = accepted.lease else {
        return Err(ApiError::internal(
            "a routed request was answered without a lease",
        ));
    };
    let status = accepted.resp.status();
    if (status.is_client_error() || status.is_server_error()) && !is_json(accepted.resp.headers()) {
        // A web server's or proxy's text page: OpenAI-style JSON instead.
        return Ok(json_error_of(accepted.resp, &accepted.worker).await);
    }
    Ok(commit(
        gw,
        request,
        &decision,
        lease,
        accepted.resp,
        accepted.cut_off,
    ))
}

/// A side call to a worker, one that books nothing (`/tokenize` forwarding, remote
/// tokenization): the available workers from a rotating start, through the same
/// attempt loop as routed requests ([`call_workers`]). Returns the accepted answer (any
/// status but a retryable one from a worker that was not the last) and its worker.
pub(crate) async fn side_call(
    gw: &Gateway,
    model: &ModelState,
    endpoint: Endpoint,
    headers: &http::HeaderMap,
    body: bytes::Bytes,
) -> Result<(Arc<Worker>, http::Response<UpstreamBody>), ApiError> {
    let request = Forwarded {
        endpoint,
        headers: headers.clone(),
        body,
        started: tokio::time::Instant::now(),
    };
    let route = Route::Side {
        model,
        order: model.rotated_available(gw.passive_open_ms()),
    };
    let accepted = call_workers(gw, &request, route).await?;
    Ok((accepted.worker, accepted.resp))
}

/// The request as it is sent to each worker it tries.
#[derive(Clone)]
pub(crate) struct Forwarded {
    pub(crate) endpoint: Endpoint,
    pub(crate) headers: http::HeaderMap,
    pub(crate) body: bytes::Bytes,
    /// When the first attempt began (the total timeout counts from here).
    pub(crate) started: tokio::time::Instant,
}

/// Which workers the attempt loop tries, and what each attempt holds.
pub(crate) enum Route<'a> {
    /// A routed request: the policy chooses, each attempt holds a lease (admission
    /// plus booking), and the request is counted in `kvgate_requests_total`.
    Booked {
        p: &'a Prepared,
        admission: &'a Arc<Admission>,
        record: &'a mut Unanswered,
    },
    /// A call that books nothing: the available workers in this order.
    Side {
        model: &'a ModelState,
        order: Vec<Arc<Worker>>,
    },
    /// One attempt on a worker already chosen and leased (a leg whose body names its
    /// worker, such as an SGLang prefill): no retry here, the caller decides.
    Leased {
        model: Arc<ModelState>,
        lease: Option<(Decision, Lease)>,
    },
}

impl Route<'_> {
    fn model(&self) -> &ModelState {
        match self {
            Route::Booked { p, .. } => &p.model,
            Route::Side { model, .. } => model,
            Route::Leased { model, .. } => model,
        }
    }
}

/// A response head the loop accepted, and what its attempt holds.
pub(crate) struct Accepted {
    pub(crate) worker: Arc<Worker>,
    pub(crate) resp: http::Response<UpstreamBody>,
    /// The routing decision and the lease (routed requests only).
    pub(crate) lease: Option<(Decision, Lease)>,
    /// Ends the response if the worker is declared dead or the grace period ends.
    pub(crate) cut_off: tokio_util::sync::CancellationToken,
}

/// What a failed attempt comes to.
enum Attempt {
    /// Failed before the first byte: another worker may be tried.
    Retry(ApiError),
    /// Failed in a way another worker would not fix.
    Final(ApiError),
}

/// The one attempt loop for every call to a worker: bounded attempts with exponential
/// backoff; a transport failure, a first-byte timeout or a 5xx/429 before the first
/// byte moves on to another worker (each failure counted against its worker by
/// health.rs); the first other answer, or the last attempt's, is accepted.
pub(crate) async fn call_workers(
    gw: &Gateway,
    request: &Forwarded,
    mut route: Route<'_>,
) -> Result<Accepted, ApiError> {
    let max_attempts = match &route {
        Route::Booked { .. } => gw.config.failover.max_attempts as usize,
        Route::Side { order, .. } => order.len().min(gw.config.failover.max_attempts as usize),
        Route::Leased { .. } => 1,
    };
    let booked = !matches!(route, Route::Side { .. });
    let mut excluded: SmallVec<[WorkerId; 4]> = SmallVec::new();
    let mut last_err: Option<ApiError> = None;
    let mut backoff = Duration::from_millis(gw.config.failover.backoff_ms);
    for attempt in 0..max_attempts {
        if attempt > 0 {
            tokio::time::sleep(backoff).await;
            backoff = backoff.saturating_mul(2);
        }
        let mut rank = None;
        let (worker, lease) = match &mut route {
            Route::Booked {
                p,
                admission,
                record,
            } => match pick(gw, p, &request.headers, &excluded, admission).await {
                Ok((decision, lease)) => {
                    let worker = lease.worker().clone();
                    record.worker = Some(worker.clone());
                    rank = data_parallel_rank(p, &worker);
                    log_decision(
                        &p.model.name,
                        &worker.url,
                        &decision,
                        p.model.selection.block_size(),
                        p.keys.as_deref().and_then(|k| k.first()).copied(),
                    );
                    (worker, Some((decision, lease)))
                }
                // After a failed attempt, "nobody left" means the attempts failed.
                Err(e) => {
                    return Err(match last_err {
                        Some(prev) if e.status == StatusCode::SERVICE_UNAVAILABLE => prev,
                        _ => e,
                    })
                }
            },
            Route::Side { order, .. } => (order[attempt].clone(), None),
            Route::Leased { lease, .. } => match lease.take() {
                Some((decision, lease)) => (lease.worker().clone(), Some((decision, lease))),
                None => return Err(ApiError::internal("a leased call was attempted twice")),
            },
        };
        let model = route.model();
        let cut_off = worker.cut_off_signal();
        let upstream = gw.upstream();
        let pinned;
        let headers = match rank {
            Some(rank) => {
                pinned = with_rank(&request.headers, rank);
                &pinned
            }
            None => &request.headers,
        };
        let sent = tokio::select! {
            sent = upstream.send(&worker, request.endpoint, headers, request.body.clone()) => sent,
            () = cut_off.cancelled() => {
                if gw.grace_over.is_cancelled() {
                    return Err(ApiError::gateway_shutting_down());
                }
                Err(SendError::WorkerDown)
            }
        };
        let failed = match sent {
            Ok(resp) => {
                if booked {
                    worker.progress.touch();
                }
                let status = resp.status();
                if status.is_server_error() {
                    worker_failed(gw, model, &worker, Failure::Request("error status"));
                } else if !retryable(status) {
                    worker_ok(gw, model, &worker);
                }
                if booked {
                    gw.metrics
                        .requests
                        .with_label_values(&[
                            &*model.name,
                            &*worker.url,
                            model.kind().as_str(),
                            status.as_str(),
                        ])
                        .inc();
                }
                if !(retryable(status) && attempt + 1 < max_attempts) {
                    return Ok(Accepted {
                        worker,
                        resp,
                        lease,
                        cut_off,
                    });
                }
                gw.metrics
                    .retries
                    .with_label_values(&[&*model.name, "status"])
                    .inc();
                Attempt::Retry(ApiError::upstream_status(&worker.url, status))
            }
            Err(e) => after_send_error(gw, request, model, &worker, e).await,
        };
        match failed {
            Attempt::Final(e) => return Err(e),
            Attempt::Retry(e) => {
                tracing::debug!(worker = %worker.url, error = %e.message, attempt, "attempt failed before the first byte");
                excluded.push(worker.id);
                last_err = Some(e);
            }
        }
    }
    Err(last_err.unwrap_or_else(|| {
        ApiError::no_healthy_worker(&route.model().name, gw.config.health.open_ms.div_ceil(1000))
    }))
}

/// The header vLLM's and SGLang's API servers read to send a request to one of their
/// data-parallel ranks.
pub const DATA_PARALLEL_RANK_HEADER: http::HeaderName =
    http::HeaderName::from_static("x-data-parallel-rank");

/// The rank a routed request is pinned to on a worker with several data-parallel ranks:
/// the one whose cache holds most of its prompt (`None`: one rank, no prompt keys, or
/// no rank holds it, and the engine balances itself).
fn data_parallel_rank(p: &Prepared, worker: &Worker) -> Option<u32> {
    if worker.config.dp_size <= 1 {
        return None;
    }
    // SGLang's disaggregated legs find their rank by bootstrap room (the prefill's
    // room is chosen for its rank, disaggregation.rs); a header could contradict it.
    let sglang_decode = p
        .model
        .prefill
        .as_ref()
        .is_some_and(|pd| pd.mode == crate::config::PdMode::Sglang);
    if sglang_decode {
        return None;
    }
    p.model
        .selection
        .best_rank(worker.id, p.keys.as_deref().unwrap_or_default())
}

/// The request's headers with the rank header set (the client's own replaced).
fn with_rank(headers: &http::HeaderMap, rank: u32) -> http::HeaderMap {
    let mut pinned = headers.clone();
    pinned.insert(DATA_PARALLEL_RANK_HEADER, http::HeaderValue::from(rank));
    pinned
}

/// The response the client gets: the worker's head, and its body observed until it
/// ends (the lease ends with it).
fn commit(
    gw: &Arc<Gateway>,
    request: &Forwarded,
    decision: &Decision,
    lease: Lease,
    resp: http::Response<UpstreamBody>,
    cut_off: tokio_util::sync::CancellationToken,
) -> Response {
    let (mut parts, incoming) = resp.into_parts();
    prepare_response_headers(&mut parts.headers, lease.worker());
    let sse = is_event_stream(&parts.headers);
    let life = Lifecycle {
        lease: Some(lease),
        gw: gw.clone(),
        predicted_cached: decision.predicted_cached_tokens,
    };
    let deadline = gw
        .config
        .timeouts
        .total()
        .map(|d| Box::pin(tokio::time::sleep_until(request.started + d)));
    let body = ObservedBody::new(incoming, life, sse, deadline, cut_off);
    Response::from_parts(parts, Body::new(body))
}

/// An attempt that got no response head. A broken connection from a worker that still
/// answers its health check is this request's doing (a body refused for its size, a
/// closed keep-alive connection), not the worker's: no breaker charge, and a large body
/// is not sent to another worker to be refused again.
async fn after_send_error(
    gw: &Gateway,
    request: &Forwarded,
    model: &ModelState,
    worker: &Worker,
    e: SendError,
) -> Attempt {
    let alive = matches!(e, SendError::Transport(_)) && answers_health(gw, worker).await;
    if alive && request.body.len() >= REFUSED_BODY_MIN_BYTES {
        tracing::debug!(worker = %worker.url, error = %e, "worker hung up on a large request body");
        return Attempt::Final(ApiError::upstream_refused_body(&worker.url));
    }
    if !alive {
        worker_failed(gw, model, worker, Failure::Request(e.reason()));
    }
    gw.metrics
        .retries
        .with_label_values(&[&*model.name, e.reason()])
        .inc();
    Attempt::Retry(attempt_error(&worker.url, &e))
}

/// The client-facing error for an attempt that got no response head.
pub(crate) fn attempt_error(worker: &str, e: &SendError) -> ApiError {
    match e {
        SendError::Timeout => ApiError::upstream_first_byte_timeout(worker),
        SendError::Connect(_) | SendError::Transport(_) | SendError::BrokeBeforeFirstEvent(_) => {
            ApiError::upstream_unreachable(worker, e)
        }
        SendError::WorkerDown => ApiError::worker_gone(worker),
    }
}

/// A body at least this large that a live worker hung up on is taken as refused
/// (answered 502 `upstream_refused_body`) rather than sent to another worker.
const REFUSED_BODY_MIN_BYTES: usize = 1 << 20;

/// Longest part of a non-JSON engine error page quoted to the client.
const ENGINE_ERROR_TEXT_MAX: usize = 4096;

/// Whether the worker answers its health check now (bounded by the health timeout).
async fn answers_health(gw: &Gateway, worker: &Worker) -> bool {
    matches!(probe(gw, worker).await, Ok(s) if s.is_success())
}

fn is_json(headers: &http::HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(is_json_media_type)
}

/// The engine's error answer with a non-JSON body, re-made as OpenAI-style JSON with
/// the engine's status (the body is read up to a bound, within a short timeout).
async fn json_error_of(resp: http::Response<UpstreamBody>, worker: &Worker) -> Response {
    use axum::response::IntoResponse;
    let mut out = engine_error(resp, worker).await.into_response();
    prepare_response_headers(out.headers_mut(), worker);
    out
}

/// An engine's error answer as an [`ApiError`] with the engine's status, quoting its
/// body (read up to a bound, within a short timeout).
pub(crate) async fn engine_error(resp: http::Response<UpstreamBody>, worker: &Worker) -> ApiError {
    use http_body_util::BodyExt;
    let status = resp.status();
    let limited = http_body_util::Limited::new(resp.into_body(), ENGINE_ERROR_TEXT_MAX);
    let text = match tokio::time::timeout(Duration::from_secs(5), limited.collect()).await {
        Ok(Ok(body)) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
        _ => String::new(),
    };
    ApiError::engine_error_text(status, &worker.url, &text)
}

/// One debug line per routing decision (target `kvgate::decision`): what the policy
/// chose, why, and the chosen worker's overlap and load beside those of the best-cached
/// candidate, so a fleet's routing can be audited from logs
/// (`--log info,kvgate::decision=debug`). `prefix` is the prompt's first block key,
/// so the requests of one shared prefix (a tenant's system prompt) can be followed.
fn log_decision(
    model: &str,
    worker_url: &str,
    decision: &Decision,
    block_size: u32,
    prefix: Option<BlockKey>,
) {
    if !tracing::enabled!(target: "kvgate::decision", tracing::Level::DEBUG) {
        return;
    }
    let device = |s: &WorkerScore| s.overlap_blocks[0];
    let Some(chosen) = decision.scores.iter().find(|s| s.worker == decision.worker) else {
        return;
    };
    let best = decision
        .scores
        .iter()
        .max_by_key(|s| (device(s), s.worker == decision.worker))
        .unwrap_or(chosen);
    let least_in_flight = decision
        .scores
        .iter()
        .map(|s| s.in_flight)
        .min()
        .unwrap_or(0);
    tracing::debug!(
        target: "kvgate::decision",
        model,
        worker = worker_url,
        policy = decision.policy.as_str(),
        rule = decision.rule,
        reason = decision.reason,
        prefix = prefix.map(|k| format!("{:016x}", k.0)),
        predicted_cached_tokens = decision.predicted_cached_tokens,
        chosen_cached_tokens = device(chosen) * block_size,
        chosen_in_flight = chosen.in_flight,
        chosen_prefill_tokens = chosen.prefill_tokens,
        chosen_decode_blocks = chosen.decode_blocks,
        chosen_cost = chosen.cost,
        best_cached_tokens = device(best) * block_size,
        best_in_flight = best.in_flight,
        best_prefill_tokens = best.prefill_tokens,
        best_decode_blocks = best.decode_blocks,
        best_cost = best.cost,
        least_in_flight,
        "routed"
    );
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use kvgate_core::PolicyKind;

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buffer").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn score(worker: u32, device_blocks: u32, in_flight: u32) -> WorkerScore {
        WorkerScore {
            worker: WorkerId(worker),
            overlap_blocks: [device_blocks, 0, 0],
            in_flight,
            prefill_tokens: u64::from(in_flight) * 1000,
            decode_blocks: 0.0,
            cost: Some(1.0),
        }
    }

    /// The decision line names the chosen worker's cached tokens and load beside the
    /// best-cached worker's, so a decision that left the holder shows in the log.
    #[test]
    fn decision_log_compares_the_choice_with_the_best_cached_worker() {
        let decision = Decision {
            worker: WorkerId(1),
            policy: PolicyKind::KvAware,
            predicted_cached_tokens: 32,
            indexed_cached_tokens: 32,
            credited_tokens: 0,
            rule: "warmup",
            reason: "warm-up: a worker with little cached is further behind on load",
            scores: vec![score(0, 128, 30), score(1, 2, 3), score(2, 0, 2)],
        };
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("kvgate::decision=debug")
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            log_decision("m", "http://w1", &decision, 16, Some(BlockKey(0xab)))
        });
        let text = String::from_utf8(out.0.lock().expect("buffer").clone()).expect("utf-8");
        for field in [
            "worker=\"http://w1\"",
            "chosen_cached_tokens=32",
            "chosen_in_flight=3",
            "best_cached_tokens=2048",
            "best_in_flight=30",
            "least_in_flight=2",
            "prefix=\"00000000000000ab\"",
            "rule=\"warmup\"",
        ] {
            assert!(text.contains(field), "{field} missing from {text}");
        }
    }
}
