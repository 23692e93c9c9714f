//! # kvgate-selection: the selection service
//!
//! Owns one model's routing state and every operation on it, for both faces of
//! kvgate: the gateway (`kvgate serve`, one service per model) and the Python package
//! (`kvgate.ray`, one service per Ray Serve deployment). It holds the model's prefix
//! index and the KV-event subscribers that feed it (one per data-parallel rank, with
//! replay and purges), the load ledger, and the policy (with kv_aware's fallback).
//!
//! Operations: add, upsert and remove workers at run time ([`SelectionService::upsert_worker`]);
//! [`SelectionService::select`] (a decision with per-worker scores, nothing booked);
//! booking, either as a [`BookingGuard`] the caller holds ([`SelectionService::try_book`],
//! the gateway's lease) or keyed by a request id for callers that cannot hold a Rust
//! value across calls ([`SelectionService::book_request`], `prefill_done`,
//! `decode_progress`, `free`: the Python package). Either way a booking ends in one
//! place, its guard's drop; [`SelectionService::sweep_expired`] is the TTL backstop.
//!
//! It must not do HTTP, judge worker health, admit requests or tokenize: callers pass
//! the candidates (healthy, not excluded) and the prompt's token ids or block keys.
//! Adding a worker with KV events spawns subscribers, so that must happen inside a
//! tokio runtime; a worker whose events the caller feeds in process
//! ([`SelectionService::add_worker_with_feed`], the simulation) needs none.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvgate_core::{
    build_policy, judge, BlockHasher, BlockKey, BookingGuard, BookingSpec, Decision, EngineLimits,
    FleetView, IndexConfig, Judgement, Ledger, Objective, PolicyConfig, PolicyKind, PrefixIndex,
    RouteRequest, RoutingPolicy, SelectError, WorkerId,
};
use kvgate_events::{
    spawn_subscriber, Bootstrap, EventFeed, EventMetrics, EventSource, IndexLock, RankSnapshot,
    SharedIndex, SubscriberHandle,
};
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;

/// What a selection service is built from.
#[derive(Clone, Debug)]
pub struct SelectionConfig {
    /// The model's name (logs).
    pub model: String,
    /// The engines' KV block size in tokens.
    pub block_size: u32,
    /// The engines' prefix-cache hash salt, if one is configured.
    pub hash_salt: Option<String>,
    pub policy: PolicyConfig,
    /// kv_aware without any KV event source routes with this policy (else it refuses).
    pub fallback: Option<PolicyKind>,
    pub index_max_blocks: usize,
    /// ZeroMQ topic prefix the subscribers filter on ("" for everything).
    pub kv_topic: String,
    /// Bookings older than this are freed by [`SelectionService::sweep_expired`].
    pub booking_ttl: Duration,
    /// The engines' batch limits, which the time model reads (`kvgate_core::timing`).
    pub engine_limits: EngineLimits,
}

impl SelectionConfig {
    /// A config with defaults for everything but the model, block size and policy.
    pub fn new(model: impl Into<String>, block_size: u32, policy: PolicyConfig) -> Self {
        Self {
            model: model.into(),
            block_size,
            hash_salt: None,
            policy,
            fallback: None,
            index_max_blocks: IndexConfig::default().max_blocks,
            kv_topic: String::new(),
            booking_ttl: Duration::from_secs(3600),
            engine_limits: EngineLimits::default(),
        }
    }
}

/// Where a worker publishes its KV events.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEvents {
    /// Rank 0's PUB endpoint, `tcp://HOST:PORT`; rank r publishes on PORT + r.
    pub endpoint: String,
    /// Rank 0's replay ROUTER endpoint (rank r on PORT + r), if the engine has one.
    pub replay_endpoint: Option<String>,
    /// Data-parallel ranks (1..=1024).
    pub dp_size: u32,
    /// The block size the worker says it uses, checked against the service's.
    pub block_size: Option<u32>,
}

impl WorkerEvents {
    pub fn new(endpoint: impl Into<String>) -> Self {
        Self {
            endpoint: endpoint.into(),
            replay_endpoint: None,
            dp_size: 1,
            block_size: None,
        }
    }
}

/// The endpoint of data-parallel rank `rank` (vLLM publishes rank r on port + r).
pub fn rank_endpoint(endpoint: &str, rank: u32) -> anyhow::Result<String> {
    let shape = || format!("KV event endpoint {endpoint:?} must look like tcp://HOST:PORT");
    let rest = endpoint.strip_prefix("tcp://").with_context(shape)?;
    let (host, port) = rest.rsplit_once(':').with_context(shape)?;
    if host.is_empty() {
        bail!(shape());
    }
    let port: u16 = port.parse().with_context(shape)?;
    let ranked = u16::try_from(rank)
        .ok()
        .and_then(|r| port.checked_add(r))
        .with_context(|| {
            format!("KV event endpoint {endpoint:?}: port {port} + rank {rank} exceeds 65535")
        })?;
    Ok(format!("tcp://{host}:{ranked}"))
}

struct WorkerEntry {
    name: String,
    events: Option<WorkerEvents>,
    subscribers: Vec<SubscriberHandle>,
    /// Its KV events are handed over in process ([`SelectionService::add_worker_with_feed`]).
    fed: bool,
}

/// A booking made by request id, held by the service until `free` or the sweep.
struct HeldBooking {
    guard: BookingGuard,
    booked_at: Instant,
}

/// Why a request-keyed operation was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BookError {
    /// The worker is not (or no longer) part of the fleet.
    UnknownWorker(String),
    /// A booking with this request id is already held.
    DuplicateRequest(String),
}

impl std::fmt::Display for BookError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BookError::UnknownWorker(w) => write!(f, "unknown worker {w:?}"),
            BookError::DuplicateRequest(r) => {
                write!(f, "request {r:?} already has a booking; free it first")
            }
        }
    }
}

impl std::error::Error for BookError {}

/// What a request asks of a selection.
#[derive(Clone, Copy, Debug)]
pub struct SelectRequest<'a> {
    /// The prompt's block keys ([`SelectionService::block_keys`]); `None` when the
    /// request has no routing tokens.
    pub block_keys: Option<&'a [BlockKey]>,
    pub prompt_tokens: u32,
    pub session_key: Option<&'a str>,
    pub now: Instant,
    /// Its latency objectives and priority (`Objective::default()`: none).
    pub objective: Objective,
}

/// One model's selection service. Internally synchronized; share it as `Arc`.
pub struct SelectionService {
    config: SelectionConfig,
    hasher: BlockHasher,
    policy: Box<dyn RoutingPolicy>,
    fallback: Option<Box<dyn RoutingPolicy>>,
    index: Option<SharedIndex>,
    ledger: Arc<Ledger>,
    workers: RwLock<FxHashMap<WorkerId, WorkerEntry>>,
    /// Workers with a KV event source (kept with `workers`, read on every selection).
    with_events: AtomicUsize,
    /// Worker ids come from this counter, shared by every service of one process so
    /// ids (and the event counters keyed by them) are unique across models.
    ids: Arc<AtomicU32>,
    events: Arc<EventMetrics>,
    requests: Mutex<FxHashMap<String, HeldBooking>>,
    /// Given to each new worker's subscribers: asks peer routers for a snapshot of
    /// the worker before replaying its engine's buffer ([`Self::set_bootstrap`]).
    bootstrap: RwLock<Option<Bootstrap>>,
}

impl std::fmt::Debug for SelectionService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SelectionService")
            .field("model", &self.config.model)
            .field("policy", &self.policy.kind())
            .finish_non_exhaustive()
    }
}

impl SelectionService {
    /// Builds a service with no workers. `ids` is the process's worker-id counter.
    pub fn new(
        config: SelectionConfig,
        events: Arc<EventMetrics>,
        ids: Arc<AtomicU32>,
    ) -> anyhow::Result<SelectionService> {
        let hasher = BlockHasher::with_salt(
            config.block_size,
            config.hash_salt.as_deref().unwrap_or("").as_bytes(),
        )
        .map_err(|e| anyhow::anyhow!("model {:?}: {e}", config.model))?;
        let kind = config.policy.kind;
        if let Some(fb) = config.fallback {
            if kind != PolicyKind::KvAware {
                bail!(
                    "model {:?}: a fallback policy only applies to kv_aware",
                    config.model
                );
            }
            if fb == PolicyKind::KvAware {
                bail!(
                    "model {:?}: the fallback cannot be kv_aware itself",
                    config.model
                );
            }
        }
        let policy = build_policy(&config.policy);
        let fallback = config.fallback.map(|k| {
            build_policy(&PolicyConfig {
                kind: k,
                ..config.policy.clone()
            })
        });
        let index = (kind == PolicyKind::KvAware).then(|| {
            IndexLock::shared(PrefixIndex::new(
                hasher,
                IndexConfig {
                    max_blocks: config.index_max_blocks,
                },
            ))
        });
        let ledger = Ledger::new(config.block_size);
        ledger.set_engine_limits(config.engine_limits);
        Ok(SelectionService {
            ledger,
            hasher,
            policy,
            fallback,
            index,
            workers: RwLock::new(FxHashMap::default()),
            with_events: AtomicUsize::new(0),
            ids,
            events,
            requests: Mutex::new(FxHashMap::default()),
            bootstrap: RwLock::new(None),
            config,
        })
    }

    pub fn config(&self) -> &SelectionConfig {
        &self.config
    }

    pub fn kind(&self) -> PolicyKind {
        self.policy.kind()
    }

    pub fn block_size(&self) -> u32 {
        self.config.block_size
    }

    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    /// The ledger (loads, accuracy and counters for metrics and explanations).
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// The prefix index (kv_aware only).
    pub fn index(&self) -> Option<&SharedIndex> {
        self.index.as_ref()
    }

    /// The event counters the subscribers update.
    pub fn event_metrics(&self) -> &Arc<EventMetrics> {
        &self.events
    }

    /// The block keys of a prompt (salted per LoRA adapter), as the index keys them.
    pub fn block_keys(&self, token_ids: &[u32], lora: Option<&str>) -> Vec<BlockKey> {
        self.hasher.for_lora(lora).block_keys(token_ids)
    }

    /// A fresh worker id from the process's counter.
    pub fn allocate_id(&self) -> WorkerId {
        WorkerId(self.ids.fetch_add(1, Ordering::Relaxed))
    }

    /// Whether some worker publishes KV events (kv_aware has something to read).
    pub fn has_event_source(&self) -> bool {
        self.index.is_some() && self.with_events.load(Ordering::Acquire) > 0
    }

    /// Recounts the workers with an event source (under the workers' write lock).
    fn count_events(&self, workers: &FxHashMap<WorkerId, WorkerEntry>) {
        let n = workers
            .values()
            .filter(|w| w.events.is_some() || w.fed)
            .count();
        self.with_events.store(n, Ordering::Release);
    }

    /// The id of a worker by the name it was added with.
    pub fn worker_id(&self, name: &str) -> Option<WorkerId> {
        self.workers
            .read()
            .iter()
            .find(|(_, w)| w.name == name)
            .map(|(id, _)| *id)
    }

    /// The name a worker was added with.
    pub fn worker_name(&self, id: WorkerId) -> Option<String> {
        self.workers.read().get(&id).map(|w| w.name.clone())
    }

    /// Every worker's id and name, by id.
    pub fn worker_list(&self) -> Vec<(WorkerId, String)> {
        let mut out: Vec<_> = self
            .workers
            .read()
            .iter()
            .map(|(id, w)| (*id, w.name.clone()))
            .collect();
        out.sort_by_key(|(id, _)| *id);
        out
    }

    /// Adds a worker under `id` (from [`Self::allocate_id`]) and starts its
    /// subscribers. Fails on a duplicate id or name, a malformed endpoint, or a
    /// block size other than the service's.
    pub fn add_worker(
        &self,
        id: WorkerId,
        name: &str,
        events: Option<WorkerEvents>,
    ) -> anyhow::Result<()> {
        self.check_events(name, events.as_ref())?;
        let mut workers = self.workers.write();
        if workers.contains_key(&id) || workers.values().any(|w| w.name == name) {
            bail!(
                "worker {name:?} is already part of model {:?}",
                self.config.model
            );
        }
        self.insert_locked(&mut workers, id, name, events)
    }

    /// Adds a worker whose KV events the caller hands over in process instead of a
    /// subscriber reading them from a socket (the virtual-time simulation): returns the
    /// [`EventFeed`] to deliver them through, `None` when the policy keeps no index.
    /// The feed applies them exactly as a subscriber would.
    pub fn add_worker_with_feed(
        &self,
        id: WorkerId,
        name: &str,
    ) -> anyhow::Result<Option<EventFeed>> {
        let mut workers = self.workers.write();
        if workers.contains_key(&id) || workers.values().any(|w| w.name == name) {
            bail!(
                "worker {name:?} is already part of model {:?}",
                self.config.model
            );
        }
        workers.insert(
            id,
            WorkerEntry {
                name: name.to_string(),
                events: None,
                subscribers: Vec::new(),
                fed: self.index.is_some(),
            },
        );
        self.count_events(&workers);
        self.notify_policy(&workers);
        Ok(self.index.as_ref().map(|index| {
            let mut source = EventSource::new(id, format!("in-process:{name}"));
            source.topic = self.config.kv_topic.clone();
            EventFeed::new(source, index.clone(), self.events.clone())
        }))
    }

    /// Starts a new worker's subscribers and adds it, under the workers' write lock.
    fn insert_locked(
        &self,
        workers: &mut FxHashMap<WorkerId, WorkerEntry>,
        id: WorkerId,
        name: &str,
        events: Option<WorkerEvents>,
    ) -> anyhow::Result<()> {
        let subscribers = self.spawn_subscribers(id, name, events.as_ref())?;
        workers.insert(
            id,
            WorkerEntry {
                name: name.to_string(),
                events,
                subscribers,
                fed: false,
            },
        );
        self.count_events(workers);
        self.notify_policy(workers);
        Ok(())
    }

    /// Sets how workers added from now on bootstrap their index entries: their
    /// subscribers first ask `bootstrap` (the gateway asks its peer replicas) for a
    /// snapshot of the worker, then replay the engine's events after it.
    pub fn set_bootstrap(&self, bootstrap: Bootstrap) {
        *self.bootstrap.write() = Some(bootstrap);
    }

    /// A snapshot of what the index holds for one worker rank, and the last event
    /// sequence number it reflects (for a peer router's bootstrap); `None` when this
    /// router has applied no event of that rank.
    pub fn snapshot_rank(&self, id: WorkerId, rank: u32) -> Option<RankSnapshot> {
        let index = self.index.as_ref()?.read();
        let at = kvgate_core::WorkerRef::new(id, rank);
        let last_seq = index.applied_seq(at)?;
        Some(RankSnapshot {
            blocks: index.export_worker(at),
            hole_paths: index.hole_paths(at),
            last_seq,
        })
    }

    /// Adds a worker by name, or updates its event endpoints when it is known. A
    /// changed endpoint means the engine moved or restarted: its subscribers restart
    /// and what the index held for it is purged (its bookings stay). Returns its id.
    pub fn upsert_worker(
        &self,
        name: &str,
        events: Option<WorkerEvents>,
    ) -> anyhow::Result<WorkerId> {
        self.check_events(name, events.as_ref())?;
        let mut workers = self.workers.write();
        let known = workers
            .iter_mut()
            .find(|(_, w)| w.name == name)
            .map(|(id, w)| (*id, w));
        match known {
            Some((id, entry)) if entry.events == events => Ok(id),
            Some((id, entry)) => {
                for s in entry.subscribers.drain(..) {
                    s.shutdown();
                }
                entry.subscribers = self.spawn_subscribers(id, name, events.as_ref())?;
                entry.events = events;
                self.count_events(&workers);
                let purged = self.purge_index(id);
                tracing::info!(model = %self.config.model, worker = name, purged, "worker's KV event endpoint changed: subscribers restarted");
                Ok(id)
            }
            None => {
                let id = self.allocate_id();
                self.insert_locked(&mut workers, id, name, events)?;
                tracing::info!(model = %self.config.model, worker = name, id = %id, "worker added");
                Ok(id)
            }
        }
    }

    /// Removes a worker: its subscribers stop, its index entries and accuracy record
    /// are forgotten. Bookings on it end as their requests end. Returns the index
    /// entries purged, `None` when the worker was unknown.
    pub fn remove_worker(&self, id: WorkerId) -> Option<usize> {
        let entry = {
            let mut workers = self.workers.write();
            let entry = workers.remove(&id)?;
            self.count_events(&workers);
            self.notify_policy(&workers);
            entry
        };
        for s in &entry.subscribers {
            s.shutdown();
        }
        let purged = self.purge_index(id);
        self.ledger.forget_worker(id);
        self.events.forget(id);
        Some(purged)
    }

    /// Forgets what the index says a worker holds (it was declared dead); its
    /// subscribers keep running and rebuild the entries from live events.
    pub fn purge_worker(&self, id: WorkerId) -> usize {
        self.purge_index(id)
    }

    /// Stops every subscriber (process shutdown).
    pub fn shutdown(&self) {
        for w in self.workers.write().values_mut() {
            for s in w.subscribers.drain(..) {
                s.shutdown();
            }
        }
    }

    fn purge_index(&self, id: WorkerId) -> usize {
        self.index
            .as_ref()
            .map_or(0, |i| kvgate_events::purge_worker(i, id))
    }

    fn check_events(&self, name: &str, events: Option<&WorkerEvents>) -> anyhow::Result<()> {
        let Some(ev) = events else { return Ok(()) };
        if !(1..=1024).contains(&ev.dp_size) {
            bail!(
                "worker {name:?}: dp_size must be between 1 and 1024, got {}",
                ev.dp_size
            );
        }
        if let Some(bs) = ev.block_size {
            if bs != self.config.block_size {
                bail!(
                    "worker {name:?} uses KV block size {bs} and model {:?} is configured with {}: \
                     its KV events could not be applied; set the model's block size to the engine's",
                    self.config.model,
                    self.config.block_size
                );
            }
        }
        for rank in 0..ev.dp_size {
            rank_endpoint(&ev.endpoint, rank)?;
            if let Some(r) = &ev.replay_endpoint {
                rank_endpoint(r, rank)?;
            }
        }
        Ok(())
    }

    fn spawn_subscribers(
        &self,
        id: WorkerId,
        name: &str,
        events: Option<&WorkerEvents>,
    ) -> anyhow::Result<Vec<SubscriberHandle>> {
        let (Some(index), Some(ev)) = (&self.index, events) else {
            return Ok(Vec::new());
        };
        let bootstrap = self.bootstrap.read().clone();
        (0..ev.dp_size)
            .map(|rank| {
                let source = EventSource {
                    worker: id,
                    name: name.to_string(),
                    endpoint: rank_endpoint(&ev.endpoint, rank)?,
                    replay_endpoint: ev
                        .replay_endpoint
                        .as_deref()
                        .map(|r| rank_endpoint(r, rank))
                        .transpose()?,
                    topic: self.config.kv_topic.clone(),
                    dp_rank: rank,
                };
                Ok(spawn_subscriber(
                    source,
                    index.clone(),
                    self.events.clone(),
                    bootstrap.clone(),
                ))
            })
            .collect()
    }

    fn notify_policy(&self, workers: &FxHashMap<WorkerId, WorkerEntry>) {
        let mut list: Vec<(WorkerId, &str)> = workers
            .iter()
            .map(|(id, w)| (*id, w.name.as_str()))
            .collect();
        list.sort_by_key(|(id, _)| *id);
        self.policy.workers_changed(&list);
        if let Some(fb) = &self.fallback {
            fb.workers_changed(&list);
        }
    }

    /// The policy's choice among `candidates`, with its explanation; books nothing.
    /// kv_aware without any KV event source uses the fallback policy, or fails with
    /// [`SelectError::NoIndex`]. The index's read lock is held only for this call.
    ///
    /// A request with a latency objective ([`Objective`]) keeps the policy's choice when
    /// the time model predicts it meets the objective; else the policy chooses again
    /// among the candidates predicted to meet it (rule `objective`); when none is, a
    /// sheddable request fails with [`SelectError::Shed`] and any other goes to the
    /// candidate predicted to miss by least (rule `objective_missed`).
    pub fn select(
        &self,
        req: &SelectRequest<'_>,
        candidates: &[WorkerId],
    ) -> Result<Decision, SelectError> {
        let decision = self.policy_choice(req, candidates)?;
        if !req.objective.is_set() {
            return Ok(decision);
        }
        let (among, rule, reason) = match judge(&decision.scores, decision.worker, &req.objective) {
            Judgement::Met => return Ok(decision),
            Judgement::Elsewhere(meeting) => (
                meeting,
                "objective",
                "latency objective: the policy's choice among the workers predicted to meet it",
            ),
            Judgement::Unmet { late, .. } if req.objective.sheddable() => {
                return Err(SelectError::Shed { late });
            }
            Judgement::Unmet { closest, .. } => (
                vec![closest],
                "objective_missed",
                "latency objective: no worker is predicted to meet it; the closest miss",
            ),
        };
        let mut again = self.policy_choice(req, &among)?;
        again.rule = rule;
        again.reason = reason;
        Ok(again)
    }

    fn policy_choice(
        &self,
        req: &SelectRequest<'_>,
        candidates: &[WorkerId],
    ) -> Result<Decision, SelectError> {
        let route = RouteRequest {
            block_keys: req.block_keys,
            prompt_tokens: req.prompt_tokens,
            session_key: req.session_key,
            now: req.now,
        };
        let index = if self.has_event_source() {
            self.index.as_ref().map(|i| i.read())
        } else {
            None
        };
        let view = FleetView {
            candidates,
            ledger: &self.ledger,
            index: index.as_deref(),
        };
        match self.policy.select(&route, &view) {
            Err(SelectError::NoIndex) => match &self.fallback {
                Some(fb) => fb.select(
                    &route,
                    &FleetView {
                        index: None,
                        ..view
                    },
                ),
                None => Err(SelectError::NoIndex),
            },
            other => other,
        }
    }

    /// Books `decision`'s worker if it has fewer than `max_in_flight` bookings (0: no
    /// limit), in one step; `None` when it is full. The guard ends the booking when
    /// dropped. `block_keys` are the prompt's (credited as being prefilled there until
    /// the first token, for kv_aware); `now` is when the booking is made (the
    /// simulation passes its virtual clock).
    pub fn try_book(
        &self,
        decision: &Decision,
        prompt_tokens: u32,
        expected_output_tokens: Option<u32>,
        block_keys: &[BlockKey],
        max_in_flight: u32,
        now: Instant,
    ) -> Option<BookingGuard> {
        let spec = decision.booking(prompt_tokens, expected_output_tokens);
        self.try_book_spec(decision.worker, spec, block_keys, max_in_flight, now)
    }

    /// The data-parallel rank of `worker` holding the longest run of `keys`: the rank
    /// to pin the request to (vLLM's and SGLang's `X-data-parallel-rank`). `None`
    /// without an index, or when no rank of the worker holds the prompt's first block
    /// (the engine's own balancer then chooses).
    pub fn best_rank(&self, worker: WorkerId, keys: &[BlockKey]) -> Option<u32> {
        let index = self.index.as_ref()?;
        if keys.is_empty() {
            return None;
        }
        let scores = index.read().overlaps(keys);
        scores
            .best_for(worker)
            .filter(|o| o.total() > 0)
            .map(|o| o.at.dp_rank)
    }

    /// As [`Self::try_book`] with the booking spelled out (a leg whose prompt's KV
    /// arrives by transfer books it as cached).
    pub fn try_book_spec(
        &self,
        worker: WorkerId,
        spec: BookingSpec,
        block_keys: &[BlockKey],
        max_in_flight: u32,
        now: Instant,
    ) -> Option<BookingGuard> {
        // Only kv_aware reads the prompts in prefill (its credit).
        let keys = if self.kind() == PolicyKind::KvAware {
            block_keys
        } else {
            &[]
        };
        self.ledger.try_book(worker, spec, keys, now, max_in_flight)
    }

    /// Books a request by id on `worker` (the decision that chose it supplies the
    /// prediction; `None` books with no cached tokens predicted).
    pub fn book_request(
        &self,
        request_id: &str,
        worker: WorkerId,
        decision: Option<&Decision>,
        prompt_tokens: u32,
        expected_output_tokens: Option<u32>,
        block_keys: &[BlockKey],
    ) -> Result<(), BookError> {
        if !self.workers.read().contains_key(&worker) {
            return Err(BookError::UnknownWorker(worker.to_string()));
        }
        let mut requests = self.requests.lock();
        if requests.contains_key(request_id) {
            return Err(BookError::DuplicateRequest(request_id.to_string()));
        }
        let spec = match decision.filter(|d| d.worker == worker) {
            Some(d) => d.booking(prompt_tokens, expected_output_tokens),
            None => BookingSpec {
                prompt_tokens,
                expected_output_tokens,
                ..BookingSpec::default()
            },
        };
        self.hold(&mut requests, request_id, worker, spec, block_keys);
        Ok(())
    }

    /// Books `worker` without a limit and keeps the guard under `request_id`.
    fn hold(
        &self,
        requests: &mut FxHashMap<String, HeldBooking>,
        request_id: &str,
        worker: WorkerId,
        spec: BookingSpec,
        block_keys: &[BlockKey],
    ) {
        let now = Instant::now();
        let Some(guard) = self.try_book_spec(worker, spec, block_keys, 0, now) else {
            unreachable!("a booking without a limit is never refused")
        };
        requests.insert(
            request_id.to_string(),
            HeldBooking {
                guard,
                booked_at: now,
            },
        );
    }

    /// Selects among `candidates` and books the choice under `request_id` in one step:
    /// request-keyed selections are serialized, so concurrent requests for one prefix
    /// see each other's bookings and spread instead of herding. A booking the request
    /// already holds is replaced (the caller re-routes it). Returns the decision.
    pub fn select_and_book_request(
        &self,
        request_id: &str,
        req: &SelectRequest<'_>,
        candidates: &[WorkerId],
        expected_output_tokens: Option<u32>,
    ) -> Result<Decision, SelectError> {
        let mut requests = self.requests.lock();
        // A re-route gives up the old booking before choosing again.
        let previous = requests.remove(request_id);
        drop(previous);
        let decision = self.select(req, candidates)?;
        self.hold(
            &mut requests,
            request_id,
            decision.worker,
            decision.booking(req.prompt_tokens, expected_output_tokens),
            req.block_keys.unwrap_or_default(),
        );
        Ok(decision)
    }

    /// The worker a request's booking is on.
    pub fn booked_worker(&self, request_id: &str) -> Option<WorkerId> {
        self.requests
            .lock()
            .get(request_id)
            .map(|h| h.guard.worker())
    }

    /// The request's first token arrived (now). False when no booking has this id.
    pub fn prefill_done(&self, request_id: &str) -> bool {
        self.with_request(request_id, |g| {
            g.prefill_done(Instant::now());
        })
    }

    /// The request has produced `output_tokens` tokens so far (its decode weight
    /// shrinks as it nears its expected length). False when no booking has this id.
    pub fn decode_progress(&self, request_id: &str, output_tokens: u32) -> bool {
        self.with_request(request_id, |g| g.progress(output_tokens, Instant::now()))
    }

    /// The engine reported `tokens` prompt tokens served from its cache.
    pub fn engine_reported_cached(&self, request_id: &str, tokens: u32) -> bool {
        self.with_request(request_id, |g| g.engine_reported_cached(tokens))
    }

    /// Ends a request's booking (finished, failed or cancelled). Idempotent: false when
    /// no booking has this id.
    pub fn free(&self, request_id: &str) -> bool {
        // The guard drops outside the map's lock.
        let held = self.requests.lock().remove(request_id);
        held.is_some()
    }

    /// Bookings held by request id.
    pub fn open_requests(&self) -> usize {
        self.requests.lock().len()
    }

    fn with_request(&self, request_id: &str, f: impl FnOnce(&BookingGuard)) -> bool {
        let requests = self.requests.lock();
        match requests.get(request_id) {
            Some(h) => {
                f(&h.guard);
                true
            }
            None => false,
        }
    }

    /// The TTL backstop: frees request-keyed bookings older than the TTL (their guards
    /// drop) and then any ledger booking older than it whose guard leaked. Returns how
    /// many were freed.
    pub fn sweep_expired(&self, now: Instant) -> usize {
        let ttl = self.config.booking_ttl;
        let expired: Vec<HeldBooking> = {
            let mut requests = self.requests.lock();
            let ids: Vec<String> = requests
                .iter()
                .filter(|(_, h)| now.saturating_duration_since(h.booked_at) > ttl)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| requests.remove(id)).collect()
        };
        let held = expired.len();
        drop(expired);
        held + self.ledger.sweep_expired(now, ttl)
    }
}

#[cfg(test)]
mod tests;
