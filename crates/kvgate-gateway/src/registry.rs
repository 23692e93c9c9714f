//! Workers and models as the running gateway knows them.
//!
//! Owns [`Worker`] (identity, URL pieces precomputed for the hot path, circuit breaker;
//! its in-flight count is the ledger's, taken with a lease) and [`ModelState`] (the
//! model's selection service, its tokenizer, the current worker list). Worker ids come
//! from one counter shared by every model's selection service and are never reused.
//! Adding and removing workers happens through [`ModelState::insert_worker`] /
//! [`ModelState::remove_worker`]; the gateway (`gateway.rs`) registers them with the
//! selection service (which runs their KV-event subscribers). The bottom of the fleet
//! state: imports only configuration, the breaker and the progress clock. Must not do
//! HTTP.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderName, HeaderValue, Uri};
use kvgate_core::{Ledger, PolicyKind, WorkerId};
use kvgate_events::SharedIndex;
use kvgate_selection::SelectionService;
use kvgate_tokenize::Tokenizer;
use parking_lot::{Mutex, RwLock};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::breaker::Breaker;
use crate::config::{ModelConfig, WorkerConfig};
use crate::progress::Progress;

/// The name of a disaggregated model's prefill pool (in peers' load reports, the admin
/// API and `/ready`).
pub const PREFILL_POOL: &str = "prefill";

/// The upstream paths the gateway forwards to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat = 0,
    Completions = 1,
    Tokenize = 2,
    Health = 3,
    Metrics = 4,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
            Endpoint::Tokenize => "/tokenize",
            Endpoint::Health => "/health",
            Endpoint::Metrics => "/metrics",
        }
    }
}

/// One engine replica.
#[derive(Debug)]
pub struct Worker {
    pub id: WorkerId,
    /// Normalized base URL (no trailing `/`).
    pub url: Arc<str>,
    /// `x-kvgate-worker` value.
    pub header_value: HeaderValue,
    scheme: Scheme,
    authority: Authority,
    paths: [PathAndQuery; 5],
    pub breaker: Breaker,
    /// When its engine last showed progress, and whether it is out as stalled
    /// (progress.rs).
    pub progress: Progress,
    pub config: WorkerConfig,
    /// Cancelled (and replaced) when health checks declare the worker dead, so requests
    /// in flight on it end now instead of waiting on an engine that will not answer.
    cut_off: Mutex<CancellationToken>,
}

impl Worker {
    /// Builds a worker from a validated config. `health_path` replaces `/health`.
    pub fn new(id: WorkerId, config: WorkerConfig, health_path: &str) -> anyhow::Result<Worker> {
        let url = crate::config::normalize_url(&config.url);
        crate::config::validate_worker_url(&url)?;
        let uri: Uri = url.parse()?;
        let parts = uri.into_parts();
        let scheme = parts.scheme.unwrap_or(Scheme::HTTP);
        let authority = parts
            .authority
            .ok_or_else(|| anyhow::anyhow!("worker URL {url:?} has no host"))?;
        let prefix = parts
            .path_and_query
            .map(|p| p.path().trim_end_matches('/').to_string())
            .unwrap_or_default();
        let path = |p: &str| -> anyhow::Result<PathAndQuery> {
            Ok(PathAndQuery::try_from(format!("{prefix}{p}"))?)
        };
        let health = if health_path.starts_with('/') {
            health_path.to_string()
        } else {
            format!("/{health_path}")
        };
        Ok(Worker {
            id,
            header_value: HeaderValue::from_str(&url)?,
            url: url.into(),
            scheme,
            authority,
            paths: [
                path(Endpoint::Chat.path())?,
                path(Endpoint::Completions.path())?,
                path(Endpoint::Tokenize.path())?,
                path(&health)?,
                path(Endpoint::Metrics.path())?,
            ],
            breaker: Breaker::new(),
            progress: Progress::default(),
            config,
            cut_off: Mutex::new(CancellationToken::new()),
        })
    }

    /// Full upstream URI of an endpoint (no allocation beyond the URI's parts).
    pub fn uri(&self, endpoint: Endpoint) -> Uri {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(self.scheme.clone());
        parts.authority = Some(self.authority.clone());
        parts.path_and_query = Some(self.paths[endpoint as usize].clone());
        Uri::from_parts(parts).unwrap_or_default()
    }

    /// The host of the worker's URL (an SGLang prefill worker's bootstrap host).
    pub fn host(&self) -> &str {
        self.authority.host()
    }

    /// The signal a request on this worker watches: cancelled when the worker is
    /// declared dead or stalled while the request is in flight.
    pub(crate) fn cut_off_signal(&self) -> CancellationToken {
        self.cut_off.lock().clone()
    }

    /// Ends every request in flight on this worker (each fails over, or ends its
    /// stream with an error event); requests sent later get a fresh signal.
    pub(crate) fn cut_off_in_flight(&self) {
        std::mem::take(&mut *self.cut_off.lock()).cancel();
    }
}

/// A disaggregated model's prefill side: its pool and how requests are handed over.
#[derive(Debug)]
pub struct PrefillPool {
    pub mode: crate::config::PdMode,
    /// The prefill workers as a model of their own (selection service, index,
    /// ledger, policy); never resolved by name.
    pub pool: Arc<ModelState>,
    /// Prompts with fewer uncached tokens skip the prefill leg (0 = never).
    pub uncached_token_threshold: u32,
}

/// One served model and its fleet.
pub struct ModelState {
    pub name: Arc<str>,
    pub config: ModelConfig,
    /// The model's routing state: prefix index and its KV-event subscribers, the load
    /// ledger, the policy (kvgate-selection; the Python package uses the same service).
    pub selection: SelectionService,
    /// Local tokenizer (None with remote tokenization or token-less policies).
    pub tokenizer: Option<Tokenizer>,
    pub session_header: HeaderName,
    /// Prefill/decode disaggregation: this model's workers are the decode pool and
    /// requests first go through the prefill pool.
    pub prefill: Option<PrefillPool>,
    workers: RwLock<Arc<Vec<Arc<Worker>>>>,
    /// Signalled when a lease ends while someone waits for a worker slot.
    pub(crate) capacity: Notify,
    pub(crate) waiting: AtomicUsize,
    tokenize_cursor: AtomicUsize,
    /// Held while a worker is chosen and booked (for this replica's requests, and at
    /// the leader for its peers'), so that requests arriving together see each other's
    /// bookings instead of all choosing the worker that looked idle.
    pub(crate) choosing: parking_lot::Mutex<()>,
}

impl std::fmt::Debug for ModelState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelState")
            .field("name", &self.name)
            .field("policy", &self.selection.kind())
            .finish_non_exhaustive()
    }
}

impl ModelState {
    pub(crate) fn new(
        config: ModelConfig,
        selection: SelectionService,
        tokenizer: Option<Tokenizer>,
        session_header: HeaderName,
        prefill: Option<PrefillPool>,
    ) -> ModelState {
        ModelState {
            name: config.name.as_str().into(),
            config,
            selection,
            tokenizer,
            session_header,
            prefill,
            workers: RwLock::new(Arc::new(Vec::new())),
            capacity: Notify::new(),
            waiting: AtomicUsize::new(0),
            tokenize_cursor: AtomicUsize::new(0),
            choosing: parking_lot::Mutex::new(()),
        }
    }

    /// Requests waiting for a slot on one of this model's workers.
    pub fn waiting_for_slot(&self) -> usize {
        self.waiting.load(Ordering::Acquire)
    }

    pub fn kind(&self) -> PolicyKind {
        self.selection.kind()
    }

    /// This model's pools, each with its name within the model: itself (`""`: its own
    /// workers, a disaggregated model's decode pool), then its prefill pool if any.
    pub fn pools(self: &Arc<Self>) -> impl Iterator<Item = (&Arc<ModelState>, &'static str)> {
        std::iter::once((self, "")).chain(self.prefill.as_ref().map(|p| (&p.pool, PREFILL_POOL)))
    }

    /// Whether routing a request needs its token ids (this pool's policy, or the
    /// prefill pool's).
    pub fn uses_tokens(&self) -> bool {
        self.kind().uses_tokens()
            || self
                .prefill
                .as_ref()
                .is_some_and(|p| p.pool.kind().uses_tokens())
    }

    /// The load ledger (the selection service's).
    pub fn ledger(&self) -> &Arc<Ledger> {
        self.selection.ledger()
    }

    /// The prefix index (kv_aware only).
    pub fn index(&self) -> Option<&SharedIndex> {
        self.selection.index()
    }

    /// The current workers (a cheap snapshot).
    #[inline]
    pub fn workers(&self) -> Arc<Vec<Arc<Worker>>> {
        self.workers.read().clone()
    }

    pub fn worker_by_url(&self, url: &str) -> Option<Arc<Worker>> {
        let url = crate::config::normalize_url(url);
        self.workers().iter().find(|w| *w.url == *url).cloned()
    }

    /// Whether KV events feed this model's index (some worker has an event source).
    pub fn has_event_source(&self) -> bool {
        self.selection.has_event_source()
    }

    /// Adds a worker; fails when its URL is already present.
    pub(crate) fn insert_worker(&self, worker: Arc<Worker>) -> anyhow::Result<()> {
        {
            let mut guard = self.workers.write();
            if guard.iter().any(|w| w.url == worker.url) {
                anyhow::bail!(
                    "worker {} is already registered for model {:?}",
                    worker.url,
                    &*self.name
                );
            }
            let mut next: Vec<Arc<Worker>> = guard.as_ref().clone();
            next.push(worker);
            *guard = Arc::new(next);
        }
        Ok(())
    }

    /// Removes a worker by id, returning it.
    pub(crate) fn remove_worker(&self, id: WorkerId) -> Option<Arc<Worker>> {
        let removed = {
            let mut guard = self.workers.write();
            let pos = guard.iter().position(|w| w.id == id)?;
            let mut next: Vec<Arc<Worker>> = guard.as_ref().clone();
            let removed = next.remove(pos);
            *guard = Arc::new(next);
            removed
        };
        self.capacity.notify_waiters();
        Some(removed)
    }

    /// Available workers, starting at a rotating position (spreads side calls such as
    /// remote tokenization over the fleet).
    pub(crate) fn rotated_available(&self, passive_open_ms: Option<u64>) -> Vec<Arc<Worker>> {
        let workers = self.workers();
        let n = workers.len();
        if n == 0 {
            return Vec::new();
        }
        let start = self.tokenize_cursor.fetch_add(1, Ordering::Relaxed) % n;
        (0..n)
            .map(|i| &workers[(start + i) % n])
            .filter(|w| w.breaker.available(passive_open_ms))
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uri_keeps_path_prefix() {
        let w = Worker::new(
            WorkerId(0),
            WorkerConfig::new("http://127.0.0.1:9/engine/"),
            "/health",
        )
        .unwrap();
        assert_eq!(
            w.uri(Endpoint::Chat).to_string(),
            "http://127.0.0.1:9/engine/v1/chat/completions"
        );
        assert_eq!(
            w.uri(Endpoint::Health).to_string(),
            "http://127.0.0.1:9/engine/health"
        );
        assert_eq!(&*w.url, "http://127.0.0.1:9/engine");
    }
}
