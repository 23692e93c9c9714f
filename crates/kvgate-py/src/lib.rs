//! # kvgate._native: the selection service and the tokenizer, for Python
//!
//! Owns the Python face of kvgate's core: [`PySelectionService`] wraps
//! `kvgate_selection::SelectionService` (the same service `kvgate serve` routes with;
//! nothing here scores or books on its own) and [`PyTokenizer`] wraps kvgate-tokenize
//! (local tokenizer with the chat template, or an engine's `/tokenize`). Workers are
//! named by strings at this boundary (Ray replica ids) and mapped to the service's ids.
//!
//! Every method that does work is awaitable and runs on one process-wide tokio runtime
//! without the GIL (the KV-event subscribers live on that runtime too), except the two
//! `_now` fast paths for a router's own thread (`select_and_book_now`, `free_now`),
//! which take microseconds and hold the GIL for them. Errors arrive as
//! Python exceptions: `ValueError` for bad input (HTTP 400 at an ingress),
//! `KvgateUnavailableError` (a `RuntimeError`) when routing cannot happen now (503).
//! Must not contain routing logic: policy, ledger and index stay in the Rust crates.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_core::{
    Decision, KvAwareConfig, Objective, PolicyConfig, PolicyKind, SelectError, WorkerId,
};
use kvgate_events::EventMetrics;
use kvgate_selection::{BookError, SelectRequest, SelectionConfig, SelectionService, WorkerEvents};
use kvgate_tokenize::{
    LocalTokenizer, RemoteTokenizer, RequestBody, RequestKind, RoutingTokens, TokenizeError,
};
use pyo3::exceptions::PyValueError;
use pyo3::import_exception;
use pyo3::prelude::*;
use pyo3::types::PyDict;

// Defined in Python (kvgate/_errors.py) so that code catching it never needs the
// native module: routing cannot happen now, retry later (HTTP 503).
import_exception!(kvgate._errors, KvgateUnavailableError);

fn value_error(msg: impl Into<String>) -> PyErr {
    PyValueError::new_err(msg.into())
}

fn unavailable(msg: impl Into<String>) -> PyErr {
    KvgateUnavailableError::new_err(msg.into())
}

fn select_error(e: SelectError) -> PyErr {
    match e {
        SelectError::MissingTokens => value_error(e.to_string()),
        SelectError::NoCandidates | SelectError::NoIndex | SelectError::Shed { .. } => {
            unavailable(e.to_string())
        }
    }
}

fn book_error(e: BookError) -> PyErr {
    match e {
        BookError::UnknownWorker(_) => unavailable(e.to_string()),
        BookError::DuplicateRequest(_) => value_error(e.to_string()),
    }
}

fn tokenize_error(e: TokenizeError) -> PyErr {
    match e {
        TokenizeError::Invalid(m) => value_error(m),
        TokenizeError::TooLong { limit } => value_error(format!(
            "the prompt is longer than the model's context length ({limit} tokens)"
        )),
        TokenizeError::Unavailable(m) => unavailable(m),
    }
}

/// An expected output length from Python: missing, zero or negative means unknown.
fn expected_output(v: Option<i64>) -> Option<u32> {
    v.filter(|x| *x > 0)
        .map(|x| u32::try_from(x).unwrap_or(u32::MAX))
}

fn prompt_len(ids: &[u32]) -> u32 {
    u32::try_from(ids.len()).unwrap_or(u32::MAX)
}

/// A request's latency objectives (milliseconds; None: none) and priority (higher is
/// more important, below 0 sheddable); an objective that is not a positive number is a
/// `ValueError`.
fn objective_of(
    slo_ttft_ms: Option<f64>,
    slo_tpot_ms: Option<f64>,
    priority: i32,
) -> PyResult<Objective> {
    let ms = |v: Option<f64>, name: &str| match v.map(Objective::millis) {
        None => Ok(None),
        Some(Some(d)) => Ok(Some(d)),
        Some(None) => Err(value_error(format!(
            "{name} must be a positive number of milliseconds"
        ))),
    };
    Ok(Objective {
        ttft: ms(slo_ttft_ms, "slo_ttft_ms")?,
        tpot: ms(slo_tpot_ms, "slo_tpot_ms")?,
        priority,
    })
}

/// Runs `f` on the selection request of a prompt (its block keys, salted per LoRA
/// adapter) with `objective`; an empty prompt is a `ValueError`.
fn with_prompt<R>(
    svc: &SelectionService,
    token_ids: &[u32],
    lora: Option<&str>,
    objective: Objective,
    f: impl FnOnce(&SelectRequest<'_>) -> Result<R, SelectError>,
) -> PyResult<R> {
    if token_ids.is_empty() {
        return Err(value_error(
            "token_ids is empty: there is nothing to route on",
        ));
    }
    let keys = svc.block_keys(token_ids, lora);
    let req = SelectRequest {
        block_keys: Some(&keys),
        prompt_tokens: prompt_len(token_ids),
        session_key: None,
        now: Instant::now(),
        objective,
    };
    f(&req).map_err(select_error)
}

/// One worker's line in a selection.
#[pyclass(name = "WorkerScore", module = "kvgate._native", frozen, get_all)]
#[derive(Clone)]
pub struct PyWorkerScore {
    worker_id: String,
    /// Leading prompt blocks the worker holds on device.
    overlap_blocks: u32,
    in_flight: u32,
    prefill_tokens: u64,
    decode_blocks: f64,
    /// The policy's cost (lower is better), for cost-based policies.
    cost: Option<f64>,
}

#[pymethods]
impl PyWorkerScore {
    fn __repr__(&self) -> String {
        format!(
            "WorkerScore(worker_id={:?}, overlap_blocks={}, in_flight={}, cost={:?})",
            self.worker_id, self.overlap_blocks, self.in_flight, self.cost
        )
    }
}

/// The service's choice for one request and why.
#[pyclass(name = "Selection", module = "kvgate._native", frozen, get_all)]
#[derive(Clone)]
pub struct PySelection {
    worker_id: String,
    /// Leading prompt blocks the chosen worker holds (device tier).
    overlap_blocks: u32,
    /// Prompt tokens predicted to be served from the chosen worker's cache.
    predicted_cached_tokens: u32,
    policy: String,
    /// The rule that decided (kv_aware: `cached`, `least_work`, `warmup`).
    rule: String,
    reason: String,
    scores: Vec<PyWorkerScore>,
}

#[pymethods]
impl PySelection {
    fn __repr__(&self) -> String {
        format!(
            "Selection(worker_id={:?}, overlap_blocks={}, predicted_cached_tokens={}, rule={:?})",
            self.worker_id, self.overlap_blocks, self.predicted_cached_tokens, self.rule
        )
    }
}

fn selection_of(svc: &SelectionService, d: &Decision) -> PySelection {
    let name = |id: WorkerId| svc.worker_name(id).unwrap_or_else(|| id.to_string());
    let scores: Vec<PyWorkerScore> = d
        .scores
        .iter()
        .map(|s| PyWorkerScore {
            worker_id: name(s.worker),
            overlap_blocks: s.overlap_blocks[0],
            in_flight: s.in_flight,
            prefill_tokens: s.prefill_tokens,
            decode_blocks: s.decode_blocks,
            cost: s.cost,
        })
        .collect();
    PySelection {
        worker_id: name(d.worker),
        overlap_blocks: scores
            .iter()
            .zip(&d.scores)
            .find(|(_, s)| s.worker == d.worker)
            .map_or(0, |(p, _)| p.overlap_blocks),
        predicted_cached_tokens: d.predicted_cached_tokens,
        policy: d.policy.as_str().to_string(),
        rule: d.rule.to_string(),
        reason: d.reason.to_string(),
        scores,
    }
}

/// One model's selection service: the prefix index fed by the workers' KV events, the
/// load ledger and the policy. Share one per deployment.
#[pyclass(name = "SelectionService", module = "kvgate._native", frozen)]
pub struct PySelectionService {
    svc: Arc<SelectionService>,
}

impl PySelectionService {
    /// Allowed worker names → ids the service knows (unknown names are not candidates).
    fn candidates(&self, allowed: Option<Vec<String>>) -> Vec<WorkerId> {
        let known = self.svc.worker_list();
        match allowed {
            None => known.into_iter().map(|(id, _)| id).collect(),
            Some(names) => known
                .into_iter()
                .filter(|(_, n)| names.iter().any(|a| a == n))
                .map(|(id, _)| id)
                .collect(),
        }
    }
}

#[pymethods]
impl PySelectionService {
    /// `policy`: kv_aware (default), prefix_affinity, least_loaded, round_robin, random.
    /// `kv_aware`: overrides of the kv_aware weights (e.g. `{"overlap_weight": 4.0}`).
    /// `max_num_seqs`, `max_num_batched_tokens`: the engines' batch limits (vLLM's flags;
    /// default vLLM's on an H100: 1024, 8192), which the time model and kv_aware read;
    /// `num_gpu_blocks`: their KV-cache size in blocks (None: not a limit).
    #[new]
    #[pyo3(signature = (
        block_size = 16, policy = "kv_aware", *, model = "default", kv_aware = None,
        hash_salt = None, kv_topic = "", index_max_blocks = None, booking_ttl_s = 3600.0,
        fallback = None, seed = None, max_num_seqs = None, max_num_batched_tokens = None,
        num_gpu_blocks = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        block_size: u32,
        policy: &str,
        model: &str,
        kv_aware: Option<Bound<'_, PyDict>>,
        hash_salt: Option<String>,
        kv_topic: &str,
        index_max_blocks: Option<usize>,
        booking_ttl_s: f64,
        fallback: Option<&str>,
        seed: Option<u64>,
        max_num_seqs: Option<u32>,
        max_num_batched_tokens: Option<u32>,
        num_gpu_blocks: Option<u32>,
    ) -> PyResult<Self> {
        let kind: PolicyKind = policy
            .parse()
            .map_err(|e: kvgate_core::policy::UnknownPolicy| value_error(e.to_string()))?;
        let kv: KvAwareConfig = match kv_aware {
            None => KvAwareConfig::default(),
            Some(d) => {
                let text: String = py.import("json")?.call_method1("dumps", (d,))?.extract()?;
                serde_json::from_str(&text).map_err(|e| value_error(format!("kv_aware: {e}")))?
            }
        };
        if !(booking_ttl_s.is_finite() && booking_ttl_s > 0.0) {
            return Err(value_error(
                "booking_ttl_s must be a positive number of seconds",
            ));
        }
        let mut config = SelectionConfig::new(
            model,
            block_size,
            PolicyConfig {
                kind,
                seed,
                kv_aware: kv,
                ..PolicyConfig::default()
            },
        );
        config.hash_salt = hash_salt;
        config.kv_topic = kv_topic.to_string();
        if let Some(n) = index_max_blocks {
            config.index_max_blocks = n;
        }
        config.booking_ttl = Duration::from_secs_f64(booking_ttl_s);
        let limits = &mut config.engine_limits;
        if [max_num_seqs, max_num_batched_tokens, num_gpu_blocks].contains(&Some(0)) {
            return Err(value_error(
                "max_num_seqs, max_num_batched_tokens and num_gpu_blocks must be at least 1",
            ));
        }
        limits.max_num_seqs = max_num_seqs.unwrap_or(limits.max_num_seqs);
        limits.max_num_batched_tokens =
            max_num_batched_tokens.unwrap_or(limits.max_num_batched_tokens);
        limits.num_gpu_blocks = num_gpu_blocks.or(limits.num_gpu_blocks);
        config.fallback = fallback
            .map(|f| {
                f.parse()
                    .map_err(|e: kvgate_core::policy::UnknownPolicy| value_error(e.to_string()))
            })
            .transpose()?;
        let svc = SelectionService::new(config, EventMetrics::new(), Arc::new(AtomicU32::new(0)))
            .map_err(|e| value_error(format!("{e:#}")))?;
        let svc = Arc::new(svc);
        // The TTL backstop runs for as long as the service lives.
        let weak = Arc::downgrade(&svc);
        let ttl = svc.config().booking_ttl;
        pyo3_async_runtimes::tokio::get_runtime().spawn(async move {
            let period = (ttl / 4).clamp(Duration::from_millis(100), Duration::from_secs(60));
            let mut tick = tokio::time::interval(period);
            loop {
                tick.tick().await;
                let Some(svc) = weak.upgrade() else { return };
                svc.sweep_expired(Instant::now());
            }
        });
        Ok(Self { svc })
    }

    #[getter]
    fn block_size(&self) -> u32 {
        self.svc.block_size()
    }

    #[getter]
    fn policy(&self) -> &'static str {
        self.svc.kind().as_str()
    }

    /// The engines' limits the time model uses: `max_num_seqs`,
    /// `max_num_batched_tokens` and `num_gpu_blocks` (None: unknown).
    fn engine_limits(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let limits = self.svc.config().engine_limits;
        let out = PyDict::new(py);
        out.set_item("max_num_seqs", limits.max_num_seqs)?;
        out.set_item("max_num_batched_tokens", limits.max_num_batched_tokens)?;
        out.set_item("num_gpu_blocks", limits.num_gpu_blocks)?;
        Ok(out.unbind())
    }

    /// Adds a worker, or updates its KV-event endpoint (a changed endpoint restarts
    /// its subscribers and forgets what it held). `kv_events_endpoint`: rank 0's PUB
    /// socket, `tcp://HOST:PORT` (rank r on PORT + r); None routes it on load only.
    #[pyo3(signature = (worker_id, kv_events_endpoint = None, replay_endpoint = None, dp_size = 1, block_size = None))]
    fn upsert_worker<'py>(
        &self,
        py: Python<'py>,
        worker_id: String,
        kv_events_endpoint: Option<String>,
        replay_endpoint: Option<String>,
        dp_size: u32,
        block_size: Option<u32>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let svc = self.svc.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let events = kv_events_endpoint.map(|endpoint| WorkerEvents {
                endpoint,
                replay_endpoint,
                dp_size,
                block_size,
            });
            svc.upsert_worker(&worker_id, events)
                .map(|_| ())
                .map_err(|e| value_error(format!("{e:#}")))
        })
    }

    /// Removes a worker (its events stop, its index entries are forgotten). Returns
    /// whether it was known.
    fn remove_worker<'py>(
        &self,
        py: Python<'py>,
        worker_id: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        let svc = self.svc.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            Ok(match svc.worker_id(&worker_id) {
                Some(id) => svc.remove_worker(id).is_some(),
                None => false,
            })
        })
    }

    /// The workers' names.
    fn workers(&self) -> Vec<String> {
        self.svc.worker_list().into_iter().map(|(_, n)| n).collect()
    }

    /// Chooses a worker among `allowed_workers` (None: every worker) for a prompt,
    /// without booking it.
    #[pyo3(signature = (
        request_id, token_ids, allowed_workers = None, expected_output_tokens = None,
        lora = None, *, slo_ttft_ms = None, slo_tpot_ms = None, priority = 0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn select<'py>(
        &self,
        py: Python<'py>,
        request_id: String,
        token_ids: Vec<u32>,
        allowed_workers: Option<Vec<String>>,
        expected_output_tokens: Option<i64>,
        lora: Option<String>,
        slo_ttft_ms: Option<f64>,
        slo_tpot_ms: Option<f64>,
        priority: i32,
    ) -> PyResult<Bound<'py, PyAny>> {
        // Accepted for parity with select_and_book; a selection books nothing.
        let _ = (request_id, expected_output_tokens);
        let candidates = self.candidates(allowed_workers);
        let objective = objective_of(slo_ttft_ms, slo_tpot_ms, priority)?;
        let svc = self.svc.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let d = with_prompt(&svc, &token_ids, lora.as_deref(), objective, |req| {
                svc.select(req, &candidates)
            })?;
            Ok(selection_of(&svc, &d))
        })
    }

    /// Chooses a worker and books the request on it in one step (concurrent requests
    /// see each other's bookings). Booking a request id again re-routes it.
    /// `slo_ttft_ms`, `slo_tpot_ms`, `priority`: the request's latency objectives and
    /// priority (as the gateway's `x-slo-*-ms` and `x-priority` headers): the policy's
    /// choice stands when predicted to meet them, else it chooses among the workers
    /// predicted to; when none is, a sheddable request (priority below 0) raises
    /// `KvgateUnavailableError` and any other goes to the closest miss.
    #[pyo3(signature = (
        request_id, token_ids, allowed_workers = None, expected_output_tokens = None,
        lora = None, *, slo_ttft_ms = None, slo_tpot_ms = None, priority = 0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn select_and_book<'py>(
        &self,
        py: Python<'py>,
        request_id: String,
        token_ids: Vec<u32>,
        allowed_workers: Option<Vec<String>>,
        expected_output_tokens: Option<i64>,
        lora: Option<String>,
        slo_ttft_ms: Option<f64>,
        slo_tpot_ms: Option<f64>,
        priority: i32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let candidates = self.candidates(allowed_workers);
        let expected = expected_output(expected_output_tokens);
        let objective = objective_of(slo_ttft_ms, slo_tpot_ms, priority)?;
        let svc = self.svc.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let d = with_prompt(&svc, &token_ids, lora.as_deref(), objective, |req| {
                svc.select_and_book_request(&request_id, req, &candidates, expected)
            })?;
            Ok(selection_of(&svc, &d))
        })
    }

    /// [`select_and_book`](Self::select_and_book) without the round trip through the
    /// async runtime: for callers on an event loop where the selection itself (tens of
    /// microseconds) costs less than a hop to another thread and back (a Ray Serve
    /// router). Runs holding the GIL, so it blocks the calling thread and the
    /// interpreter for that long: releasing the GIL for tens of microseconds costs
    /// more, since taking it back in a busy process (a Ray worker's threads) can wait
    /// up to the interpreter's switch interval (5 ms), which is what the router's p99
    /// measured with it released (docs/BENCHMARKS.md). Nothing the selection waits
    /// on (the index's and ledger's locks) is ever held by a thread that needs the GIL.
    #[pyo3(signature = (
        request_id, token_ids, allowed_workers = None, expected_output_tokens = None,
        lora = None, *, slo_ttft_ms = None, slo_tpot_ms = None, priority = 0,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn select_and_book_now(
        &self,
        request_id: String,
        token_ids: Vec<u32>,
        allowed_workers: Option<Vec<String>>,
        expected_output_tokens: Option<i64>,
        lora: Option<String>,
        slo_ttft_ms: Option<f64>,
        slo_tpot_ms: Option<f64>,
        priority: i32,
    ) -> PyResult<PySelection> {
        let candidates = self.candidates(allowed_workers);
        let expected = expected_output(expected_output_tokens);
        let objective = objective_of(slo_ttft_ms, slo_tpot_ms, priority)?;
        let svc = &self.svc;
        with_prompt(svc, &token_ids, lora.as_deref(), objective, |req| {
            svc.select_and_book_request(&request_id, req, &candidates, expected)
        })
        .map(|d| selection_of(svc, &d))
    }

    /// [`free`](Self::free) on the calling thread (a dictionary removal).
    fn free_now(&self, request_id: &str) -> bool {
        self.svc.free(request_id)
    }

    /// Books a request on a worker chosen elsewhere (no cached tokens predicted).
    #[pyo3(signature = (request_id, worker_id, token_ids, expected_output_tokens = None, lora = None))]
    fn book<'py>(
        &self,
        py: Python<'py>,
        request_id: String,
        worker_id: String,
        token_ids: Vec<u32>,
        expected_output_tokens: Option<i64>,
        lora: Option<String>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let expected = expected_output(expected_output_tokens);
        let svc = self.svc.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            let id = svc
                .worker_id(&worker_id)
                .ok_or_else(|| book_error(BookError::UnknownWorker(worker_id.clone())))?;
            let keys = svc.block_keys(&token_ids, lora.as_deref());
            svc.book_request(
                &request_id,
                id,
                None,
                prompt_len(&token_ids),
                expected,
                &keys,
            )
            .map_err(book_error)
        })
    }

    /// The request's first token arrived. Returns whether a booking has this id.
    fn prefill_done<'py>(
        &self,
        py: Python<'py>,
        request_id: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        let svc = self.svc.clone();
        pyo3_async_runtimes::tokio::future_into_py(
            py,
            async move { Ok(svc.prefill_done(&request_id)) },
        )
    }

    /// The request has produced `output_tokens` tokens so far (cumulative).
    fn decode_progress<'py>(
        &self,
        py: Python<'py>,
        request_id: String,
        output_tokens: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let svc = self.svc.clone();
        let tokens = u32::try_from(output_tokens.max(0)).unwrap_or(u32::MAX);
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            Ok(svc.decode_progress(&request_id, tokens))
        })
    }

    /// Ends a request's booking (finished, failed or cancelled). Idempotent.
    fn free<'py>(&self, py: Python<'py>, request_id: String) -> PyResult<Bound<'py, PyAny>> {
        let svc = self.svc.clone();
        pyo3_async_runtimes::tokio::future_into_py(py, async move { Ok(svc.free(&request_id)) })
    }

    /// The worker a request is booked on, if any.
    fn booked_worker(&self, request_id: &str) -> Option<String> {
        self.svc
            .booked_worker(request_id)
            .and_then(|id| self.svc.worker_name(id))
    }

    /// Bookings held by request id.
    fn open_requests(&self) -> usize {
        self.svc.open_requests()
    }

    /// Per worker: requests in flight, prompt tokens waiting for prefill, decode blocks,
    /// and the prefix-index entries held.
    fn loads(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        let out = PyDict::new(py);
        let workers = self.svc.worker_list();
        let ids: Vec<WorkerId> = workers.iter().map(|(id, _)| *id).collect();
        let loads = self.svc.ledger().loads_of(&ids);
        let entries = self
            .svc
            .index()
            .map(|i| i.read().entries_of(&ids))
            .unwrap_or_else(|| vec![0; ids.len()]);
        for (((_, name), load), held) in workers.iter().zip(loads).zip(entries) {
            let d = PyDict::new(py);
            d.set_item("in_flight", load.in_flight)?;
            d.set_item("prefill_tokens", load.prefill_tokens)?;
            d.set_item("decode_blocks", load.decode_blocks)?;
            d.set_item("index_entries", held)?;
            out.set_item(name, d)?;
        }
        Ok(out.unbind())
    }

    /// Frees bookings older than the TTL now (it also runs periodically). Returns how
    /// many were freed.
    fn sweep_expired(&self) -> usize {
        self.svc.sweep_expired(Instant::now())
    }

    /// Stops every KV-event subscriber.
    fn close(&self) {
        self.svc.shutdown();
    }
}

enum TokenizerKind {
    Local(Arc<LocalTokenizer>),
    Remote(Arc<RemoteTokenizer>),
}

/// Pre-routing tokenization, as the engine tokenizes: a local `tokenizer.json` and
/// chat template (vLLM parity), or an engine's `/tokenize`.
#[pyclass(name = "Tokenizer", module = "kvgate._native", frozen)]
pub struct PyTokenizer {
    kind: TokenizerKind,
}

#[pymethods]
impl PyTokenizer {
    /// A local tokenizer from a model directory (`tokenizer.json`, `tokenizer_config.json`,
    /// chat template). `max_model_len` refuses longer prompts.
    #[staticmethod]
    #[pyo3(signature = (path, max_model_len = None))]
    fn from_dir(path: std::path::PathBuf, max_model_len: Option<u32>) -> PyResult<Self> {
        let t = LocalTokenizer::from_dir(&path)
            .map_err(|e| {
                value_error(format!(
                    "cannot load a tokenizer from {}: {e:#}",
                    path.display()
                ))
            })?
            .with_max_prompt_tokens(max_model_len);
        Ok(Self {
            kind: TokenizerKind::Local(Arc::new(t)),
        })
    }

    /// A tokenizer that asks an engine's `/tokenize` (`base_url` like
    /// `http://127.0.0.1:8001`).
    #[staticmethod]
    #[pyo3(signature = (base_url, timeout_s = 10.0))]
    fn remote(base_url: &str, timeout_s: f64) -> PyResult<Self> {
        if !(timeout_s.is_finite() && timeout_s > 0.0) {
            return Err(value_error("timeout_s must be positive"));
        }
        let t = RemoteTokenizer::new(base_url, Duration::from_secs_f64(timeout_s))
            .map_err(|e| value_error(format!("{e:#}")))?;
        Ok(Self {
            kind: TokenizerKind::Remote(Arc::new(t)),
        })
    }

    /// The prompt token ids of an OpenAI body (a JSON string or bytes), as the engine
    /// will prefill them: `kind` is "chat" (template with the generation prompt, no
    /// added special tokens) or "completion" (special tokens added). None when the body
    /// has no single prompt (a list of prompts). Raises ValueError when the engine
    /// would reject it.
    fn tokenize<'py>(
        &self,
        py: Python<'py>,
        kind: &str,
        body: Vec<u8>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let kind = match kind {
            "chat" => RequestKind::Chat,
            "completion" | "completions" => RequestKind::Completion,
            other => {
                return Err(value_error(format!(
                    "kind must be \"chat\" or \"completion\", got {other:?}"
                )))
            }
        };
        let tokenizer = match &self.kind {
            TokenizerKind::Local(t) => TokenizerKind::Local(t.clone()),
            TokenizerKind::Remote(t) => TokenizerKind::Remote(t.clone()),
        };
        pyo3_async_runtimes::tokio::future_into_py(py, async move {
            fn parse(body: &[u8]) -> PyResult<RequestBody<'_>> {
                let parsed = RequestBody::parse(body)
                    .map_err(|e| value_error(format!("the body is not valid JSON: {e}")))?;
                if !parsed.is_object() {
                    return Err(value_error("the body must be a JSON object"));
                }
                Ok(parsed)
            }
            // Parsed where it is tokenized (the parsed body borrows from the bytes).
            let tokens = match tokenizer {
                TokenizerKind::Local(t) => tokio::task::spawn_blocking(move || {
                    parse(&body).map(|parsed| t.tokenize(kind, &parsed))
                })
                .await
                .map_err(|e| unavailable(format!("tokenization failed: {e}")))??,
                TokenizerKind::Remote(t) => t.tokenize(kind, &parse(&body)?).await,
            }
            .map_err(tokenize_error)?;
            Ok(match tokens {
                RoutingTokens::Tokens { ids, .. } if !ids.is_empty() => Some(ids),
                _ => None,
            })
        })
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    if !kvgate_core::cpu_can_hash_blocks() {
        // Refused at import, not an illegal instruction at the first request.
        return Err(pyo3::exceptions::PyImportError::new_err(
            kvgate_core::CPU_CANNOT_HASH_BLOCKS,
        ));
    }
    m.add_class::<PySelectionService>()?;
    m.add_class::<PySelection>()?;
    m.add_class::<PyWorkerScore>()?;
    m.add_class::<PyTokenizer>()?;
    m.add(
        "KvgateUnavailableError",
        m.py().get_type::<KvgateUnavailableError>(),
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
