//! Calling workers: the one attempt loop. Every call to a worker goes through
//! [`call_workers`], whichever worker each attempt goes to: a routed request's (a
//! [`Picker`] that asks the policy and takes a lease, select.rs), a side call's that
//! books nothing ([`side_call`]: `/tokenize` forwarding, remote tokenization), a leg
//! whose worker is already leased ([`Given`]: an SGLang prefill leg). An SGLang
//! prefill/decode pair is tried again through the same [`Attempts`].
//!
//! Owns the retry decision: bounded attempts with exponential backoff; a transport
//! failure, a first-byte timeout or a 5xx/429 before the first byte moves on to another
//! worker; "no worker left" after a failed attempt answers with that failure
//! ([`Attempts::none_left`]). What a failure counts against the worker is health.rs's;
//! the sending itself is proxy.rs's. An answer that has begun (its head, and for an
//! event stream its first event: proxy.rs waits for both) is committed: from then on
//! bytes flow to the client and nothing is retried. So an engine that dies after its
//! API server sent a stream's head but before the first token (vLLM sends the head at
//! once) costs the request a retry, not an error event. Must not parse bodies
//! (observe.rs) or choose workers itself (select.rs).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use kvgate_core::{Decision, WorkerId};
use smallvec::SmallVec;

use crate::body::read_bounded;
use crate::config::FailoverConfig;
use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::health::{probe, worker_failed, worker_ok, Failure};
use crate::lease::Lease;
use crate::proxy::{SendError, UpstreamBody};
use crate::registry::{Endpoint, ModelState, Worker};

/// A routed attempt's hold: the policy's decision and the lease on its worker.
pub type Held = (Decision, Lease);

/// The header vLLM's and SGLang's API servers read to send a request to one of their
/// data-parallel ranks.
pub const DATA_PARALLEL_RANK_HEADER: http::HeaderName =
    http::HeaderName::from_static("x-data-parallel-rank");

/// Statuses worth another worker: the engine failed or is overloaded.
fn retryable(status: StatusCode) -> bool {
    status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS
}

/// The attempts of one call: how many are left, the backoff before the next, the
/// workers that failed (not tried again), and the last failure.
pub struct Attempts {
    made: usize,
    max: usize,
    backoff: Duration,
    excluded: SmallVec<[WorkerId; 4]>,
    last_err: Option<ApiError>,
}

impl Attempts {
    /// At most `max` attempts (at least one), backing off as `cfg` says.
    pub fn new(cfg: &FailoverConfig, max: usize) -> Self {
        Self {
            made: 0,
            max: max.max(1),
            backoff: Duration::from_millis(cfg.backoff_ms),
            excluded: SmallVec::new(),
            last_err: None,
        }
    }

    /// Starts the next attempt, after the backoff if one failed before; false when
    /// none is left.
    pub async fn next(&mut self) -> bool {
        if self.made >= self.max {
            return false;
        }
        if self.made > 0 {
            tokio::time::sleep(self.backoff).await;
            self.backoff = self.backoff.saturating_mul(2);
        }
        self.made += 1;
        true
    }

    /// Whether the attempt under way is the last one.
    pub fn is_last(&self) -> bool {
        self.made >= self.max
    }

    /// The workers not to try again.
    pub fn excluded(&self) -> &[WorkerId] {
        &self.excluded
    }

    /// The attempt on `worker` failed before the first byte with `e`.
    pub fn failed(&mut self, worker: WorkerId, e: ApiError) {
        self.excluded.push(worker);
        self.last_err = Some(e);
    }

    /// No worker could be chosen (`e`): after a failed attempt, "none left" (a 503)
    /// means the attempts failed, so the client hears the last failure.
    pub fn none_left(self, e: ApiError) -> ApiError {
        match self.last_err {
            Some(prev) if e.status == StatusCode::SERVICE_UNAVAILABLE => prev,
            _ => e,
        }
    }

    /// Every attempt failed: the last failure (`otherwise` when none was made).
    pub fn exhausted(self, otherwise: impl FnOnce() -> ApiError) -> ApiError {
        self.last_err.unwrap_or_else(otherwise)
    }
}

/// The worker an attempt goes to, and what it holds there.
pub struct Picked {
    pub worker: Arc<Worker>,
    /// The routed decision and its lease (`None` for a call that books nothing).
    pub held: Option<Held>,
    /// The data-parallel rank to pin the request to on the worker.
    pub rank: Option<u32>,
}

/// Chooses the worker of each attempt.
pub trait Picker: Send {
    /// The pool the workers are in.
    fn model(&self) -> &ModelState;

    /// How many attempts the call may make, given the configured most.
    fn max_attempts(&self, configured: usize) -> usize;

    /// The worker of the next attempt, never one of `excluded`.
    fn pick(
        &mut self,
        gw: &Gateway,
        excluded: &[WorkerId],
    ) -> impl Future<Output = Result<Picked, ApiError>> + Send;
}

/// A side call's workers: the available ones in a given order, booking nothing.
pub struct Rotation<'a> {
    model: &'a ModelState,
    order: Vec<Arc<Worker>>,
}

impl Picker for Rotation<'_> {
    fn model(&self) -> &ModelState {
        self.model
    }

    fn max_attempts(&self, configured: usize) -> usize {
        self.order.len().min(configured)
    }

    async fn pick(&mut self, gw: &Gateway, excluded: &[WorkerId]) -> Result<Picked, ApiError> {
        let worker = self
            .order
            .iter()
            .find(|w| !excluded.contains(&w.id))
            .cloned()
            .ok_or_else(|| {
                ApiError::no_healthy_worker(
                    &self.model.name,
                    gw.config.health.open_ms.div_ceil(1000),
                )
            })?;
        Ok(Picked {
            worker,
            held: None,
            rank: None,
        })
    }
}

/// One attempt on a worker already chosen and leased: no retry here, the caller
/// decides (an SGLang prefill leg).
pub struct Given {
    pub model: Arc<ModelState>,
    pub held: Option<Held>,
}

impl Picker for Given {
    fn model(&self) -> &ModelState {
        &self.model
    }

    fn max_attempts(&self, _configured: usize) -> usize {
        1
    }

    async fn pick(&mut self, _gw: &Gateway, _excluded: &[WorkerId]) -> Result<Picked, ApiError> {
        let (decision, lease) = self
            .held
            .take()
            .ok_or_else(|| ApiError::internal("a leased call was attempted twice"))?;
        Ok(Picked {
            worker: lease.worker().clone(),
            held: Some((decision, lease)),
            rank: None,
        })
    }
}

/// The request as it is sent to each worker it tries.
#[derive(Clone)]
pub struct Forwarded {
    pub endpoint: Endpoint,
    pub headers: http::HeaderMap,
    pub body: bytes::Bytes,
    /// When the first attempt began (the total timeout counts from here).
    pub started: tokio::time::Instant,
}

/// A response head the loop accepted, and what its attempt holds.
pub struct Accepted {
    pub worker: Arc<Worker>,
    pub resp: http::Response<UpstreamBody>,
    /// The routing decision and the lease (routed requests only).
    pub held: Option<Held>,
    /// Ends the response if the worker is declared dead or the grace period ends.
    pub cut_off: tokio_util::sync::CancellationToken,
}

/// What a failed attempt comes to.
enum Attempt {
    /// Failed before the first byte: another worker may be tried.
    Retry(ApiError),
    /// Failed in a way another worker would not fix.
    Final(ApiError),
}

/// The one attempt loop for every call to a worker: each attempt's worker from
/// `picker`; a transport failure, a first-byte timeout or a 5xx/429 before the first
/// byte moves on to another worker (each failure counted against its worker by
/// health.rs); the first other answer, or the last attempt's, is accepted.
pub async fn call_workers(
    gw: &Gateway,
    request: &Forwarded,
    picker: &mut impl Picker,
) -> Result<Accepted, ApiError> {
    let max = picker.max_attempts(gw.config.failover.max_attempts as usize);
    let mut attempts = Attempts::new(&gw.config.failover, max);
    while attempts.next().await {
        let Picked { worker, held, rank } = match picker.pick(gw, attempts.excluded()).await {
            Ok(p) => p,
            Err(e) => return Err(attempts.none_left(e)),
        };
        let booked = held.is_some();
        let model = picker.model();
        let cut_off = worker.cut_off_signal();
        let pinned;
        let headers = match rank {
            Some(rank) => {
                pinned = with_rank(&request.headers, rank);
                &pinned
            }
            None => &request.headers,
        };
        let upstream = gw.upstream();
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
                if !retryable(status) || attempts.is_last() {
                    return Ok(Accepted {
                        worker,
                        resp,
                        held,
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
                tracing::debug!(worker = %worker.url, error = %e.message, "attempt failed before the first byte");
                attempts.failed(worker.id, e);
            }
        }
    }
    let model = &picker.model().name;
    Err(attempts
        .exhausted(|| ApiError::no_healthy_worker(model, gw.config.health.open_ms.div_ceil(1000))))
}

/// A side call to a worker, one that books nothing (`/tokenize` forwarding, remote
/// tokenization): the available workers from a rotating start, through the attempt
/// loop. Returns the accepted answer (any status but a retryable one from a worker
/// that was not the last) and its worker.
pub async fn side_call(
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
    let mut picker = Rotation {
        model,
        order: model.rotated_available(gw.passive_open_ms()),
    };
    let accepted = call_workers(gw, &request, &mut picker).await?;
    Ok((accepted.worker, accepted.resp))
}

/// The request's headers with the rank header set (the client's own replaced).
fn with_rank(headers: &http::HeaderMap, rank: u32) -> http::HeaderMap {
    let mut pinned = headers.clone();
    pinned.insert(DATA_PARALLEL_RANK_HEADER, http::HeaderValue::from(rank));
    pinned
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
fn attempt_error(worker: &str, e: &SendError) -> ApiError {
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

/// An engine's error answer as an [`ApiError`] with the engine's status, quoting its
/// body (read up to a bound, within a short timeout).
pub async fn engine_error(resp: http::Response<UpstreamBody>, worker: &Worker) -> ApiError {
    let status = resp.status();
    let mut body = resp.into_body();
    let text = read_bounded(
        &mut body,
        ENGINE_ERROR_TEXT_MAX,
        Some(Duration::from_secs(5)),
    )
    .await
    .map(|b| String::from_utf8_lossy(&b).into_owned())
    .unwrap_or_default();
    ApiError::engine_error_text(status, &worker.url, &text)
}
