//! The load ledger: work this router has booked on each worker and not yet seen end.
//!
//! Owns per-request bookings and their per-worker sums: requests in flight, prompt
//! tokens still to prefill (the uncached part only) and decode blocks (prompt plus
//! output so far, weighted down as output approaches its expected length). It must not
//! observe streams or clocks itself: the gateway reports first token, progress and end.
//!
//! A booking is freed in exactly one place, [`BookingGuard`]'s `Drop`, so no code path
//! can leak it; [`Ledger::sweep_expired`] is the backstop for guards that were leaked
//! anyway (e.g. a task that never finished), and counts what it frees. Freeing twice or
//! freeing an unknown id is harmless.
//!
//! Two things the ledger learns from its bookings, for kv_aware:
//! * **Prompts in prefill.** While a booking's prefill is pending, its prompt's block
//!   keys (every [`PREFILL_CHECKPOINT_STRIDE`]-th one) are what that worker is computing
//!   now, before any KV event can say so. [`Ledger::prefill_credits`] answers "how much
//!   of this prompt is being prefilled on each candidate". The credit ends with the
//!   evidence: at the first token (the engine has stored the blocks and published
//!   their events, so the index takes over) or when the booking ends, whichever comes
//!   first. It is never renewed by being read or by a later booking of the same prefix.
//! * **Other replicas' load.** Router replicas in front of the same workers report the
//!   load they booked to each other; the ledger holds their reports
//!   ([`crate::peer_loads`]) beside its own bookings and never mixes the two:
//!   [`Ledger::loads_of`] and [`Ledger::load`] are this router's bookings (its limits,
//!   metrics and admin API), [`Ledger::fleet_loads_of`] adds the peers' (what policies
//!   score).
//! * **Load nobody booked.** An engine's own report of its queue (requests running and
//!   waiting, from its metrics) counts every request it holds, including those that
//!   reached it without this router or its peers: clients sending to the engine
//!   directly, another router in front of the same engines, requests whose bookings a
//!   restart lost. [`Ledger::engine_reported`] keeps, per worker, what the report shows
//!   beyond the fleet's bookings as that worker's unseen load, priced as the requests
//!   this router books typically are, until the next report; [`Ledger::fleet_loads_of`]
//!   adds it. Never more than the report: bookings whose requests have not reached the
//!   engine yet (or have left it) make the difference smaller, not larger.
//! * **Prediction accuracy.** When the engine reports how many prompt tokens it served
//!   from cache, the guard passes that on and the ledger keeps, per worker, decayed sums
//!   of predicted and reported cached tokens, and how much of the credited part and of
//!   the indexed part came true ([`WorkerAccuracy`]).
//! * **Time.** Each worker's [`WorkerTiming`] (module [`crate::timing`]): a booking
//!   records the worker's load ahead of it and the TTFT predicted there; its first
//!   token teaches the worker's TTFT rates and returns the receipt (predicted against
//!   observed, [`TtftReceipt`]); its end teaches the decode rates and output length.
//!   Callers pass the times (`now`); the ledger reads no clock.

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::Serialize;

use smallvec::SmallVec;

use crate::hashing::BlockKey;
use crate::ids::WorkerId;
use crate::load::WorkerLoad;
use crate::peer_loads::{self, PeerApplied, PeerLoads, PeerReport, PeerStats};
use crate::timing::{EngineLimits, TtftFeatures, WorkerTiming};

/// Callers report a booking's output progress every this many output tokens (the
/// gateway counts streamed events, the simulation tokens): often enough that a
/// request's decode weight tracks it, rarely enough to stay off the ledger's lock.
pub const PROGRESS_EVERY: u32 = 8;

/// A prompt in prefill is remembered by every this many block keys (positions
/// `stride - 1`, `2·stride - 1`, …; a chained key stands for its whole prefix), so an
/// 8,192-token prompt at block size 16 costs 32 map entries, and a credit is rounded
/// down to a multiple of the stride.
pub const PREFILL_CHECKPOINT_STRIDE: usize = 16;

/// Weight of one more sample in the per-worker accuracy sums: older samples decay by
/// `1 - 1/ACCURACY_WINDOW` per sample, so the sums describe about the last 64 responses.
const ACCURACY_WINDOW: f64 = 64.0;

/// Prior of the credit trust, in tokens credited and all realized: a worker starts fully
/// trusted, and a handful of short credits cannot swing it.
const CREDIT_TRUST_PRIOR_TOKENS: f64 = 2048.0;

/// Floor of a booking's decode weight: a request that has run past its expected length
/// still occupies its blocks until it ends.
const MIN_DECODE_WEIGHT: f64 = 0.1;

/// What is known about a request when it is booked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BookingSpec {
    pub prompt_tokens: u32,
    /// Prompt tokens predicted to be served from the worker's prefix cache (the whole
    /// prediction: the indexed part plus the credited part as far as it is trusted).
    pub cached_tokens: u32,
    /// Of the prediction, the tokens the prefix index showed cached on the worker.
    pub indexed_tokens: u32,
    /// Tokens credited beyond the index because another booking on this worker is
    /// prefilling them (raw, before trust), 0 when no credit was given.
    pub credited_tokens: u32,
    /// `max_tokens`, or a better hint of the output length, when known.
    pub expected_output_tokens: Option<u32>,
}

/// How well this router's predictions of cached tokens on one worker matched what the
/// engine reported, over about the last [`ACCURACY_WINDOW`] responses that carried a
/// report (sums decay per sample).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct WorkerAccuracy {
    /// Responses that carried a cached-token report (not decayed).
    pub samples: u64,
    /// Decayed sum of predicted cached tokens.
    pub predicted: f64,
    /// Decayed sum of engine-reported cached tokens.
    pub reported: f64,
    /// Decayed sum of tokens credited beyond the index (prefill in progress).
    pub credited: f64,
    /// Decayed sum of the credited tokens the engine did serve from cache.
    pub credit_realized: f64,
}

impl WorkerAccuracy {
    /// Predicted over reported cached tokens (1 = honest; above 1 = over-predicting),
    /// `None` until a report with cached tokens arrived.
    pub fn ratio(&self) -> Option<f64> {
        (self.reported > 0.0).then(|| self.predicted / self.reported)
    }

    /// The share of credited tokens that the engine turned out to serve from cache,
    /// shrunk toward 1 by a prior worth [`CREDIT_TRUST_PRIOR_TOKENS`]: in `(0, 1]`. A
    /// diagnostic (`kvgate_worker_credit_trust`): how far the prefill credit comes true.
    pub fn credit_trust(&self) -> f64 {
        (self.credit_realized + CREDIT_TRUST_PRIOR_TOKENS)
            / (self.credited + CREDIT_TRUST_PRIOR_TOKENS)
    }

    fn record(&mut self, spec: &BookingSpec, reported: u32) {
        let keep = 1.0 - 1.0 / ACCURACY_WINDOW;
        let reported = reported.min(spec.prompt_tokens);
        // The engine's report beyond what the index showed is what the credit bought.
        let realized = reported
            .saturating_sub(spec.indexed_tokens)
            .min(spec.credited_tokens);
        self.samples += 1;
        self.predicted = self.predicted * keep + f64::from(spec.cached_tokens);
        self.reported = self.reported * keep + f64::from(reported);
        self.credited = self.credited * keep + f64::from(spec.credited_tokens);
        self.credit_realized = self.credit_realized * keep + f64::from(realized);
    }
}

/// What an engine reports of its own queue (vLLM's `vllm:num_requests_running` and
/// `vllm:num_requests_waiting`, SGLang's `sglang:num_running_reqs` and
/// `sglang:num_queue_reqs`): every request it holds, whoever sent it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EngineQueue {
    pub running: u32,
    pub waiting: u32,
}

/// A typical booking's load, averaged over about the last [`ACCURACY_WINDOW`]
/// bookings: what one request the engine reports and nobody booked is assumed to weigh.
#[derive(Clone, Copy, Debug, Default)]
struct TypicalRequest {
    samples: u64,
    /// Uncached prompt tokens.
    prefill_tokens: f64,
    /// Decode blocks at booking.
    decode_blocks: f64,
}

impl TypicalRequest {
    fn record(&mut self, prefill_tokens: u32, decode_blocks: f64) {
        self.samples += 1;
        let weight = 1.0 / (self.samples as f64).min(ACCURACY_WINDOW);
        self.prefill_tokens += (f64::from(prefill_tokens) - self.prefill_tokens) * weight;
        self.decode_blocks += (decode_blocks - self.decode_blocks) * weight;
    }

    /// The load of `requests` such requests, `waiting` of them not started.
    fn load(&self, requests: u32, waiting: u32) -> WorkerLoad {
        WorkerLoad {
            in_flight: requests,
            prefill_tokens: (f64::from(waiting.min(requests)) * self.prefill_tokens).round() as u64,
            decode_blocks: f64::from(requests) * self.decode_blocks,
        }
    }
}

/// A first token's receipt: the TTFT predicted when the request was booked, the one
/// observed (booking to first token), and the situation the prediction was made from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TtftReceipt {
    pub predicted_secs: f64,
    pub observed_secs: f64,
    pub features: TtftFeatures,
}

/// Cumulative counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LedgerStats {
    pub booked: u64,
    pub freed: u64,
    /// Bookings freed by the TTL sweep rather than by their guard.
    pub swept: u64,
    pub active: u64,
}

#[derive(Clone, Debug)]
struct Booking {
    worker: WorkerId,
    spec: BookingSpec,
    prefill_pending: bool,
    output_tokens: u32,
    /// Decode blocks this booking currently contributes to its worker.
    decode_blocks: f64,
    booked_at: Instant,
    /// Checkpoint keys of the prompt while its prefill is pending (empty after).
    prefilling: Box<[BlockKey]>,
    /// The request's situation at booking (its worker's load ahead of it), as the
    /// time model reads it, and the TTFT predicted from it.
    ttft_features: TtftFeatures,
    predicted_ttft_secs: f64,
    /// When its first token came, and the fleet's requests in flight there then.
    first_token_at: Option<Instant>,
    in_flight_at_first_token: u32,
    /// When its latest progress was reported.
    last_progress_at: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    bookings: FxHashMap<u64, Booking>,
    loads: FxHashMap<WorkerId, WorkerLoad>,
    /// Checkpoint key → bookings whose prompt is being prefilled and has that key.
    prefilling: FxHashMap<BlockKey, SmallVec<[(WorkerId, u64); 2]>>,
    accuracy: FxHashMap<WorkerId, WorkerAccuracy>,
    stats: LedgerStats,
    peers: PeerLoads,
    /// Per worker, the load its engine last reported beyond the fleet's bookings.
    unseen: FxHashMap<WorkerId, WorkerLoad>,
    typical: TypicalRequest,
    /// Per worker, its time model (created with `default_limits` on first use).
    timing: FxHashMap<WorkerId, WorkerTiming>,
    default_limits: EngineLimits,
}

impl Inner {
    /// The whole fleet's load on `worker`: this router's bookings, the peers' reports
    /// and the engine's unseen load.
    fn fleet_load(&self, worker: WorkerId) -> WorkerLoad {
        let booked = peer_loads::sum(
            self.loads.get(&worker).copied().unwrap_or_default(),
            self.peers.load(worker),
        );
        peer_loads::sum(
            booked,
            self.unseen.get(&worker).copied().unwrap_or_default(),
        )
    }

    fn timing(&mut self, worker: WorkerId) -> &mut WorkerTiming {
        let limits = self.default_limits;
        self.timing
            .entry(worker)
            .or_insert_with(|| WorkerTiming::new(limits))
    }

    /// A copy of `worker`'s time model (a fresh one for a worker never booked).
    fn timing_of(&self, worker: WorkerId) -> WorkerTiming {
        self.timing
            .get(&worker)
            .copied()
            .unwrap_or_else(|| WorkerTiming::new(self.default_limits))
    }

    /// Ends a booking's prefill credit (first token, or the booking ended).
    fn end_prefill_credit(&mut self, id: u64, keys: &[BlockKey]) {
        for key in keys {
            if let Some(holders) = self.prefilling.get_mut(key) {
                holders.retain(|(_, b)| *b != id);
                if holders.is_empty() {
                    self.prefilling.remove(key);
                }
            }
        }
    }
}

/// The keys by which a prompt in prefill is remembered: every
/// [`PREFILL_CHECKPOINT_STRIDE`]-th block key.
fn prefill_checkpoints(prompt_keys: &[BlockKey]) -> Box<[BlockKey]> {
    prompt_keys
        .iter()
        .skip(PREFILL_CHECKPOINT_STRIDE - 1)
        .step_by(PREFILL_CHECKPOINT_STRIDE)
        .copied()
        .collect()
}

/// Per-worker load booked by this router. Internally synchronized; share as `Arc`.
#[derive(Debug)]
pub struct Ledger {
    block_size: u32,
    inner: Mutex<Inner>,
}

impl Ledger {
    /// A ledger counting decode load in blocks of `block_size` tokens (0 is treated as 1).
    pub fn new(block_size: u32) -> Arc<Self> {
        Arc::new(Self {
            block_size: block_size.max(1),
            inner: Mutex::new(Inner::default()),
        })
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Books a request on `worker`; `prompt_keys` are the prompt's block keys (empty
    /// when unknown), credited as "being prefilled on `worker`" until the first token.
    /// The returned guard frees the booking when dropped.
    pub fn book(
        self: &Arc<Self>,
        worker: WorkerId,
        spec: BookingSpec,
        prompt_keys: &[BlockKey],
        now: Instant,
    ) -> BookingGuard {
        match self.try_book(worker, spec, prompt_keys, now, 0) {
            Some(guard) => guard,
            None => unreachable!("a booking without a limit is never refused"),
        }
    }

    /// [`Ledger::book`] if `worker` has fewer than `max_in_flight` bookings (0 = no
    /// limit), in one step under the ledger's lock: the limit check and the count are the
    /// same counter, so a request is never chosen without being counted. `None` (and
    /// nothing changed) when the worker is full.
    pub fn try_book(
        self: &Arc<Self>,
        worker: WorkerId,
        spec: BookingSpec,
        prompt_keys: &[BlockKey],
        now: Instant,
        max_in_flight: u32,
    ) -> Option<BookingGuard> {
        let booking = self.new_booking(worker, spec, prefill_checkpoints(prompt_keys), now);
        let spec = booking.spec;
        let mut inner = self.inner.lock();
        if max_in_flight > 0
            && inner
                .loads
                .get(&worker)
                .is_some_and(|l| l.in_flight >= max_in_flight)
        {
            return None;
        }
        let mut booking = booking;
        let ahead = inner.fleet_load(worker);
        let timing = inner.timing(worker);
        let uncached = u64::from(spec.prompt_tokens - spec.cached_tokens);
        booking.ttft_features = timing.features(&ahead, uncached);
        booking.predicted_ttft_secs = timing.predict(&ahead, uncached).ttft_secs;
        inner.next_id += 1;
        let id = inner.next_id;
        for key in booking.prefilling.iter() {
            inner.prefilling.entry(*key).or_default().push((worker, id));
        }
        let load = inner.loads.entry(worker).or_default();
        *load = load.plus_request(uncached, booking.decode_blocks);
        inner.typical.record(
            spec.prompt_tokens - spec.cached_tokens,
            booking.decode_blocks,
        );
        inner.bookings.insert(id, booking);
        inner.stats.booked += 1;
        inner.stats.active += 1;
        drop(inner);
        Some(BookingGuard {
            ledger: Arc::clone(self),
            id,
            worker,
        })
    }

    /// A booking of `spec` (its predictions bounded by the prompt) made at `now`, with
    /// its decode weight.
    fn new_booking(
        &self,
        worker: WorkerId,
        spec: BookingSpec,
        prefilling: Box<[BlockKey]>,
        now: Instant,
    ) -> Booking {
        let cached_tokens = spec.cached_tokens.min(spec.prompt_tokens);
        let spec = BookingSpec {
            cached_tokens,
            indexed_tokens: spec.indexed_tokens.min(cached_tokens),
            credited_tokens: spec.credited_tokens.min(spec.prompt_tokens),
            ..spec
        };
        let mut booking = Booking {
            worker,
            spec,
            prefill_pending: true,
            output_tokens: 0,
            decode_blocks: 0.0,
            booked_at: now,
            prefilling,
            ttft_features: TtftFeatures::default(),
            predicted_ttft_secs: 0.0,
            first_token_at: None,
            in_flight_at_first_token: 0,
            last_progress_at: None,
        };
        booking.decode_blocks = self.decode_blocks(&booking);
        booking
    }

    fn decode_blocks(&self, b: &Booking) -> f64 {
        let tokens = u64::from(b.spec.prompt_tokens) + u64::from(b.output_tokens);
        let blocks = tokens.div_ceil(u64::from(self.block_size)) as f64;
        let weight = match b.spec.expected_output_tokens {
            Some(expected) if expected > 0 => {
                (1.0 - f64::from(b.output_tokens) / f64::from(expected)).max(MIN_DECODE_WEIGHT)
            }
            _ => 1.0,
        };
        blocks * weight
    }

    /// Marks the request's prefill done (its first token arrived at `now`), which also
    /// ends its prefill credit, and teaches its worker's time model. Returns the
    /// receipt the first time; later calls do nothing.
    fn prefill_done(&self, id: u64, now: Instant) -> Option<TtftReceipt> {
        let mut inner = self.inner.lock();
        let worker = inner.bookings.get(&id)?.worker;
        let in_flight = inner.fleet_load(worker).in_flight;
        let Inner {
            bookings,
            loads,
            timing,
            ..
        } = &mut *inner;
        let b = bookings.get_mut(&id)?;
        if !b.prefill_pending {
            return None;
        }
        b.prefill_pending = false;
        b.first_token_at = Some(now);
        b.in_flight_at_first_token = in_flight;
        let observed_secs = now.saturating_duration_since(b.booked_at).as_secs_f64();
        // Booking made its worker's model; a worker forgotten since learns nothing.
        if let Some(t) = timing.get_mut(&worker) {
            t.observe_ttft(b.ttft_features, observed_secs);
        }
        let receipt = TtftReceipt {
            predicted_secs: b.predicted_ttft_secs,
            observed_secs,
            features: b.ttft_features,
        };
        if let Some(load) = loads.get_mut(&b.worker) {
            load.prefill_tokens = load
                .prefill_tokens
                .saturating_sub(u64::from(b.spec.prompt_tokens - b.spec.cached_tokens));
        }
        let keys = std::mem::take(&mut b.prefilling);
        inner.end_prefill_credit(id, &keys);
        Some(receipt)
    }

    /// The engine reported `reported` prompt tokens served from cache for booking `id`.
    fn engine_reported_cached(&self, id: u64, reported: u32) {
        let mut inner = self.inner.lock();
        let Inner {
            bookings, accuracy, ..
        } = &mut *inner;
        if let Some(b) = bookings.get(&id) {
            accuracy
                .entry(b.worker)
                .or_default()
                .record(&b.spec, reported);
        }
    }

    /// Per candidate (in `candidates` order): the leading blocks of `keys` that a booking
    /// on it, made within `max_age` of `now`, is prefilling now (a multiple of
    /// [`PREFILL_CHECKPOINT_STRIDE`]; none when `max_age` is zero: the credit is off).
    /// Probes the request's checkpoints from the deepest down, so the cost is a few map
    /// lookups however many bookings exist.
    pub fn prefill_credits(
        &self,
        keys: &[BlockKey],
        candidates: &[WorkerId],
        now: Instant,
        max_age: Duration,
    ) -> Vec<u32> {
        let inner = self.inner.lock();
        let mut out = vec![0u32; candidates.len()];
        if (inner.prefilling.is_empty() && !inner.peers.has_prefilling()) || max_age.is_zero() {
            return out;
        }
        let stride = PREFILL_CHECKPOINT_STRIDE;
        let mut missing = candidates.len();
        let mut p = (keys.len() / stride) * stride;
        while p >= stride && missing > 0 {
            let key = &keys[p - 1];
            let own = inner.prefilling.get(key).into_iter().flatten();
            let fresh_own = own
                .filter(|(_, id)| {
                    inner
                        .bookings
                        .get(id)
                        .is_some_and(|b| now.saturating_duration_since(b.booked_at) <= max_age)
                })
                .map(|(worker, _)| worker);
            // Prompts peer replicas are prefilling leave the peer's next report at their
            // first token, so they are fresh.
            for worker in fresh_own.chain(inner.peers.prefilling_on(key)) {
                if let Some(i) = candidates.iter().position(|w| w == worker) {
                    if out[i] == 0 {
                        out[i] = p as u32;
                        missing -= 1;
                    }
                }
            }
            p -= stride;
        }
        out
    }

    /// This router's prompts in prefill: per booking whose first token has not
    /// arrived, its worker and its prompt's checkpoint keys (for peer replicas' credit).
    pub fn prefilling_checkpoints(&self) -> Vec<(WorkerId, Vec<BlockKey>)> {
        let inner = self.inner.lock();
        let mut out: Vec<(WorkerId, Vec<BlockKey>)> = inner
            .bookings
            .values()
            .filter(|b| b.prefill_pending && !b.prefilling.is_empty())
            .map(|b| (b.worker, b.prefilling.to_vec()))
            .collect();
        out.sort();
        out
    }

    /// Prediction accuracy of one worker (default when nothing was reported yet).
    pub fn accuracy(&self, worker: WorkerId) -> WorkerAccuracy {
        self.inner
            .lock()
            .accuracy
            .get(&worker)
            .copied()
            .unwrap_or_default()
    }

    /// The engines' batch limits, for every worker's time model (those known now and
    /// those to come); what each learned stays.
    pub fn set_engine_limits(&self, limits: EngineLimits) {
        let mut inner = self.inner.lock();
        inner.default_limits = limits;
        for t in inner.timing.values_mut() {
            t.set_limits(limits);
        }
    }

    /// The KV-cache blocks `worker`'s engine holds (its metrics said so; `None`:
    /// unknown), for its time model; the other limits stay.
    pub fn set_kv_capacity(&self, worker: WorkerId, num_gpu_blocks: Option<u32>) {
        let mut inner = self.inner.lock();
        let t = inner.timing(worker);
        t.set_limits(EngineLimits {
            num_gpu_blocks,
            ..t.limits()
        });
    }

    /// The time models of `workers`, in order (copies: predict with
    /// [`WorkerTiming::predict`] against the loads of [`Ledger::fleet_loads_of`]).
    pub fn timings_of(&self, workers: &[WorkerId]) -> Vec<WorkerTiming> {
        let inner = self.inner.lock();
        workers.iter().map(|w| inner.timing_of(*w)).collect()
    }

    /// Forgets a removed worker's accuracy record, time model, peer load and unseen
    /// load (its bookings end with their guards).
    pub fn forget_worker(&self, worker: WorkerId) {
        let mut inner = self.inner.lock();
        inner.accuracy.remove(&worker);
        inner.timing.remove(&worker);
        inner.peers.forget_worker(worker);
        inner.unseen.remove(&worker);
    }

    /// Takes `worker`'s engine's report of its queue: the requests it holds beyond those
    /// this router and its peers booked there are its unseen load until the next report
    /// (module comment), priced as a typical booking here (the waiting ones with their
    /// prefill). Returns that load.
    pub fn engine_reported(&self, worker: WorkerId, queue: EngineQueue) -> WorkerLoad {
        let mut inner = self.inner.lock();
        let booked = inner.loads.get(&worker).map_or(0, |l| l.in_flight)
            + inner.peers.load(worker).in_flight;
        let unseen_requests = (queue.running.saturating_add(queue.waiting)).saturating_sub(booked);
        let unseen = inner.typical.load(unseen_requests, queue.waiting);
        if unseen_requests == 0 {
            inner.unseen.remove(&worker);
        } else {
            inner.unseen.insert(worker, unseen);
        }
        unseen
    }

    /// Forgets `worker`'s unseen load (its engine's report could not be read).
    pub fn engine_queue_unknown(&self, worker: WorkerId) {
        self.inner.lock().unseen.remove(&worker);
    }

    /// The load `worker`'s engine last reported beyond the fleet's bookings.
    pub fn unseen_load(&self, worker: WorkerId) -> WorkerLoad {
        self.inner
            .lock()
            .unseen
            .get(&worker)
            .copied()
            .unwrap_or_default()
    }

    /// Applies another replica's report of its bookings ([`PeerLoads::apply`]).
    pub fn apply_peer_report(&self, report: PeerReport, now: Instant) -> PeerApplied {
        self.inner.lock().peers.apply(report, now)
    }

    /// Holds a choice this router made for peer `replica` (run `incarnation`) as that
    /// replica's booking until one of its reports settles `id`
    /// ([`PeerLoads::delegate`]): the load and prefill credit are what this router's
    /// own booking of `spec` would carry. False when no report of that run is held.
    #[allow(clippy::too_many_arguments)]
    pub fn book_for_peer(
        &self,
        replica: &str,
        incarnation: u64,
        id: u64,
        worker: WorkerId,
        spec: BookingSpec,
        prompt_keys: &[BlockKey],
        now: Instant,
    ) -> bool {
        let booking = self.new_booking(worker, spec, prefill_checkpoints(prompt_keys), now);
        let load = WorkerLoad {
            in_flight: 1,
            prefill_tokens: u64::from(booking.spec.prompt_tokens - booking.spec.cached_tokens),
            decode_blocks: booking.decode_blocks,
        };
        let checkpoints = booking.prefilling.into_vec();
        self.inner
            .lock()
            .peers
            .delegate(replica, incarnation, id, worker, load, checkpoints, now)
    }

    /// Choices made here for peer replicas and not yet settled by their reports.
    pub fn booked_for_peers(&self) -> usize {
        self.inner.lock().peers.delegated()
    }

    /// Drops a replica's reported bookings when the stream of its run `incarnation`
    /// ended ([`PeerLoads::remove`]). True when held.
    pub fn remove_peer(&self, replica: &str, incarnation: u64) -> bool {
        self.inner.lock().peers.remove(replica, incarnation)
    }

    /// Drops the reports of replicas silent for longer than `silence`; returns them.
    pub fn expire_peers(&self, now: Instant, silence: Duration) -> Vec<String> {
        self.inner.lock().peers.expire(now, silence)
    }

    /// The other replicas' summed load on one worker.
    pub fn peer_load(&self, worker: WorkerId) -> WorkerLoad {
        self.inner.lock().peers.load(worker)
    }

    pub fn peer_stats(&self) -> PeerStats {
        self.inner.lock().peers.stats()
    }

    /// Names of the replicas whose reports are held.
    pub fn peer_replicas(&self) -> Vec<String> {
        self.inner.lock().peers.replicas()
    }

    /// Records that the request has produced `output_tokens` tokens by `now`.
    fn progress(&self, id: u64, output_tokens: u32, now: Instant) {
        let mut inner = self.inner.lock();
        let Inner {
            bookings, loads, ..
        } = &mut *inner;
        if let Some(b) = bookings.get_mut(&id) {
            if output_tokens <= b.output_tokens {
                return;
            }
            b.output_tokens = output_tokens;
            b.last_progress_at = Some(now);
            let old = b.decode_blocks;
            b.decode_blocks = self.decode_blocks(b);
            if let Some(load) = loads.get_mut(&b.worker) {
                load.decode_blocks = (load.decode_blocks - old + b.decode_blocks).max(0.0);
            }
        }
    }

    /// Frees a booking. Returns false when it was already freed or never existed.
    /// Only the guard and the sweep free bookings.
    fn free(&self, id: u64) -> bool {
        let mut inner = self.inner.lock();
        Self::free_locked(&mut inner, id, self.block_size)
    }

    fn free_locked(inner: &mut Inner, id: u64, block_size: u32) -> bool {
        let Some(b) = inner.bookings.remove(&id) else {
            return false;
        };
        inner.end_prefill_credit(id, &b.prefilling);
        if let Some(first) = b.first_token_at {
            // The decode it did: its output length, and its mean time per output token
            // from the first token to the last progress reported.
            let last = b.last_progress_at.unwrap_or(first);
            let tokens = b.output_tokens.max(1);
            let tpot = last.saturating_duration_since(first).as_secs_f64()
                / f64::from(tokens.saturating_sub(1).max(1));
            // The KV it held at its end: the prompt beyond what was cached (shared with
            // whoever cached it) and its output.
            let own_tokens =
                u64::from(b.spec.prompt_tokens - b.spec.cached_tokens) + u64::from(b.output_tokens);
            let kv_blocks = own_tokens.div_ceil(u64::from(block_size)) as f64;
            if let Some(t) = inner.timing.get_mut(&b.worker) {
                t.observe_decode(b.in_flight_at_first_token, tokens, tpot, kv_blocks);
            }
        }
        if let Some(load) = inner.loads.get_mut(&b.worker) {
            load.in_flight = load.in_flight.saturating_sub(1);
            if b.prefill_pending {
                load.prefill_tokens = load
                    .prefill_tokens
                    .saturating_sub(u64::from(b.spec.prompt_tokens - b.spec.cached_tokens));
            }
            load.decode_blocks = (load.decode_blocks - b.decode_blocks).max(0.0);
            if load.in_flight == 0 {
                // Re-zero so float drift cannot accumulate across bookings.
                *load = WorkerLoad::default();
            }
        }
        inner.stats.freed += 1;
        inner.stats.active -= 1;
        true
    }

    /// Frees bookings older than `ttl` (leaked guards, streams that never ended).
    /// Returns how many were freed; they are also counted in [`LedgerStats::swept`].
    pub fn sweep_expired(&self, now: Instant, ttl: Duration) -> usize {
        let mut inner = self.inner.lock();
        let expired: Vec<u64> = inner
            .bookings
            .iter()
            .filter(|(_, b)| now.saturating_duration_since(b.booked_at) > ttl)
            .map(|(id, _)| *id)
            .collect();
        for id in &expired {
            Self::free_locked(&mut inner, *id, self.block_size);
        }
        inner.stats.swept += expired.len() as u64;
        expired.len()
    }

    /// Load this router booked on one worker (zero when it has nothing booked).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.inner
            .lock()
            .loads
            .get(&worker)
            .copied()
            .unwrap_or_default()
    }

    /// Loads this router booked on several workers at once, under one lock
    /// acquisition, in `workers` order.
    pub fn loads_of(&self, workers: &[WorkerId]) -> Vec<WorkerLoad> {
        let inner = self.inner.lock();
        workers
            .iter()
            .map(|w| inner.loads.get(w).copied().unwrap_or_default())
            .collect()
    }

    /// The whole fleet's load on each of `workers`, in order: this router's bookings,
    /// what the other replicas reported, and what the engine reported beyond both.
    /// What policies score.
    pub fn fleet_loads_of(&self, workers: &[WorkerId]) -> Vec<WorkerLoad> {
        let inner = self.inner.lock();
        workers.iter().map(|w| inner.fleet_load(*w)).collect()
    }

    /// [`Ledger::fleet_loads_of`] and [`Ledger::timings_of`] under one lock.
    pub fn fleet_loads_and_timings_of(
        &self,
        workers: &[WorkerId],
    ) -> Vec<(WorkerLoad, WorkerTiming)> {
        let inner = self.inner.lock();
        workers
            .iter()
            .map(|w| (inner.fleet_load(*w), inner.timing_of(*w)))
            .collect()
    }

    /// Every worker with a load entry.
    pub fn loads(&self) -> Vec<(WorkerId, WorkerLoad)> {
        let inner = self.inner.lock();
        let mut out: Vec<_> = inner.loads.iter().map(|(w, l)| (*w, *l)).collect();
        out.sort_by_key(|(w, _)| *w);
        out
    }

    pub fn stats(&self) -> LedgerStats {
        self.inner.lock().stats
    }

    /// Requests in flight across all workers.
    pub fn in_flight(&self) -> u64 {
        self.inner.lock().stats.active
    }
}

/// Holds one booking; dropping it frees the booking (end, error, cancel, panic unwind).
#[derive(Debug)]
pub struct BookingGuard {
    ledger: Arc<Ledger>,
    id: u64,
    worker: WorkerId,
}

impl BookingGuard {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    /// First token seen at `now`: the prompt is no longer waiting to be prefilled.
    /// Returns the TTFT receipt the first time (`None` after, or once freed).
    pub fn prefill_done(&self, now: Instant) -> Option<TtftReceipt> {
        self.ledger.prefill_done(self.id, now)
    }

    /// `output_tokens` produced by `now`.
    pub fn progress(&self, output_tokens: u32, now: Instant) {
        self.ledger.progress(self.id, output_tokens, now);
    }

    /// The engine reported `tokens` prompt tokens served from its prefix cache (the
    /// response's `usage.prompt_tokens_details.cached_tokens`).
    pub fn engine_reported_cached(&self, tokens: u32) {
        self.ledger.engine_reported_cached(self.id, tokens);
    }
}

impl Drop for BookingGuard {
    fn drop(&mut self) {
        self.ledger.free(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The per-worker limit and the booking are one step on one counter: a booking
    /// beyond the limit is refused and changes nothing; freeing one makes room.
    #[test]
    fn booking_within_a_limit_is_one_step() {
        let l = Ledger::new(16);
        let now = Instant::now();
        let w = WorkerId(0);
        let a = l.try_book(w, spec(100, 0, None), &[], now, 2).unwrap();
        let _b = l.try_book(w, spec(100, 0, None), &[], now, 2).unwrap();
        assert!(l.try_book(w, spec(100, 0, None), &[], now, 2).is_none());
        assert_eq!(l.load(w).in_flight, 2);
        assert_eq!(l.stats().booked, 2);
        // Another worker has its own count; 0 means no limit.
        assert!(l
            .try_book(WorkerId(1), spec(1, 0, None), &[], now, 1)
            .is_some());
        drop(a);
        assert!(l.try_book(w, spec(100, 0, None), &[], now, 2).is_some());
        let many: Vec<_> = (0..10)
            .map(|_| l.try_book(w, spec(1, 0, None), &[], now, 0))
            .collect();
        assert!(many.iter().all(Option::is_some));
    }

    fn spec(prompt: u32, cached: u32, expected: Option<u32>) -> BookingSpec {
        BookingSpec {
            prompt_tokens: prompt,
            cached_tokens: cached,
            indexed_tokens: cached,
            credited_tokens: 0,
            expected_output_tokens: expected,
        }
    }

    /// A first token returns its receipt once (the TTFT predicted at booking against
    /// the one observed, and the situation predicted from) and teaches its worker's
    /// time model: after a window of requests each worker is predicted at its own
    /// speed, the requests queued ahead of a booking raise its prediction, and the
    /// decode rate comes from progress times.
    #[test]
    fn first_tokens_return_receipts_and_teach_each_worker() {
        let ledger = Ledger::new(16);
        let t0 = Instant::now();
        let (fast, slow) = (WorkerId(0), WorkerId(1));
        let ms = Duration::from_millis;
        for i in 0..96u64 {
            let at = t0 + Duration::from_secs(i);
            for (w, ttft) in [(fast, 50), (slow, 200)] {
                let g = ledger.book(w, spec(1024 + 64 * (i as u32 % 8), 0, Some(17)), &[], at);
                let r = g.prefill_done(at + ms(ttft)).unwrap();
                assert!((r.observed_secs - ttft as f64 / 1e3).abs() < 1e-9);
                assert!(
                    g.prefill_done(at + ms(ttft + 1)).is_none(),
                    "a receipt is given once"
                );
                g.progress(17, at + ms(ttft + 160));
            }
        }
        let t = ledger.timings_of(&[fast, slow]);
        let idle = WorkerLoad::default();
        let (f, s) = (t[0].predict(&idle, 1200), t[1].predict(&idle, 1200));
        assert!((f.ttft_secs - 0.05).abs() < 0.005, "{f:?}");
        assert!((s.ttft_secs - 0.2).abs() < 0.02, "{s:?}");
        assert!((f.tpot_secs - 0.01).abs() < 0.001, "{f:?}");
        // Requests queued ahead raise the prediction of the next one.
        let first = ledger.book(fast, spec(1024, 0, None), &[], t0);
        let second = ledger.book(fast, spec(1024, 0, None), &[], t0);
        let a = first.prefill_done(t0 + ms(50)).unwrap();
        let b = second.prefill_done(t0 + ms(90)).unwrap();
        assert!(b.predicted_secs > a.predicted_secs, "{a:?} {b:?}");
        // Each receipt carries the situation it was predicted from.
        assert_eq!(a.features.prefill_tokens(), 1024.0);
        assert_eq!(
            b.features.prefill_tokens(),
            2048.0,
            "the first one queued ahead"
        );
    }

    /// An ended request teaches its worker the KV it held (its uncached prompt and its
    /// output, in blocks); with the engine's cache size told, the batch that fits is
    /// what the time model waits on.
    #[test]
    fn ended_requests_teach_the_kv_they_held() {
        let ledger = Ledger::new(16);
        let w = WorkerId(3);
        ledger.set_kv_capacity(w, Some(320));
        let t0 = Instant::now();
        for i in 0..40u64 {
            let at = t0 + Duration::from_secs(i);
            // 512 prompt tokens, 192 of them cached, 32 output: 352 tokens, 22 blocks.
            let g = ledger.book(w, spec(512, 192, Some(32)), &[], at);
            g.prefill_done(at + Duration::from_millis(40));
            g.progress(32, at + Duration::from_millis(400));
        }
        let rates = ledger.timings_of(&[w])[0].rates();
        assert!((rates.mean_kv_blocks - 22.0).abs() < 1e-6, "{rates:?}");
        assert!(
            (rates.effective_max_seqs - 320.0 / 22.0).abs() < 1e-6,
            "{rates:?}"
        );
        assert_eq!(
            ledger.timings_of(&[w])[0].limits().num_gpu_blocks,
            Some(320)
        );
    }

    #[test]
    fn lifecycle_tracks_prefill_and_decode() {
        let ledger = Ledger::new(16);
        let now = Instant::now();
        let g = ledger.book(WorkerId(1), spec(160, 32, Some(100)), &[], now);
        let l = ledger.load(WorkerId(1));
        assert_eq!((l.in_flight, l.prefill_tokens), (1, 128));
        assert!((l.decode_blocks - 10.0).abs() < 1e-9);
        g.prefill_done(Instant::now());
        g.prefill_done(Instant::now());
        assert_eq!(ledger.load(WorkerId(1)).prefill_tokens, 0);
        g.progress(50, Instant::now()); // 210 tokens = 14 blocks, half of the expected output left
        assert!((ledger.load(WorkerId(1)).decode_blocks - 7.0).abs() < 1e-9);
        g.progress(200, Instant::now()); // past the expected length: floor weight
        let blocks = (360f64 / 16.0).ceil() * MIN_DECODE_WEIGHT;
        assert!((ledger.load(WorkerId(1)).decode_blocks - blocks).abs() < 1e-9);
        drop(g);
        assert_eq!(ledger.load(WorkerId(1)), WorkerLoad::default());
        assert_eq!(ledger.stats().freed, 1);
    }

    /// An engine reporting more requests than the fleet booked on it carries the rest as
    /// unseen load, priced as a typical booking, in what policies score (not in this
    /// router's own load); a report at or below the bookings, an unreadable report, or
    /// the worker's removal clears it.
    #[test]
    fn an_engine_reporting_more_than_was_booked_carries_unseen_load() {
        let ledger = Ledger::new(16);
        let now = Instant::now();
        let ws = [WorkerId(0), WorkerId(1)];
        // Two bookings of 320 tokens, 160 of them cached, 100 output: 160 prefill
        // tokens and 20 decode blocks each.
        let _a = ledger.book(WorkerId(0), spec(320, 160, Some(100)), &[], now);
        let _b = ledger.book(WorkerId(1), spec(320, 160, Some(100)), &[], now);
        // Engine 1 holds 4 requests, 1 waiting: 3 nobody here booked, 1 not started.
        let queue = EngineQueue {
            running: 3,
            waiting: 1,
        };
        let unseen = ledger.engine_reported(WorkerId(1), queue);
        assert_eq!(unseen.in_flight, 3);
        assert_eq!(unseen.prefill_tokens, 160);
        assert!(
            (unseen.decode_blocks - 3.0 * 20.0).abs() < 1e-9,
            "{unseen:?}"
        );
        let loads = ledger.fleet_loads_of(&ws);
        assert_eq!(loads[1].in_flight, 4);
        assert_eq!(loads[1].prefill_tokens, 320);
        assert_eq!(loads[0].in_flight, 1);
        assert_eq!(
            ledger.load(WorkerId(1)).in_flight,
            1,
            "own load is bookings"
        );
        // Fewer than booked (requests not at the engine yet): no unseen load.
        let idle = EngineQueue::default();
        assert_eq!(
            ledger.engine_reported(WorkerId(1), idle),
            WorkerLoad::default()
        );
        assert_eq!(ledger.fleet_loads_of(&ws)[1].in_flight, 1);
        // An absurd report (it comes from outside) saturates rather than overflows.
        let absurd = EngineQueue {
            running: u32::MAX,
            waiting: u32::MAX,
        };
        assert_eq!(
            ledger.engine_reported(WorkerId(1), absurd).in_flight,
            u32::MAX - 1
        );
        ledger.engine_reported(WorkerId(1), queue);
        ledger.engine_queue_unknown(WorkerId(1));
        assert_eq!(ledger.unseen_load(WorkerId(1)), WorkerLoad::default());
        ledger.engine_reported(WorkerId(1), queue);
        ledger.forget_worker(WorkerId(1));
        assert_eq!(ledger.fleet_loads_of(&ws)[1].in_flight, 1);
    }

    #[test]
    fn freeing_twice_or_unknown_is_harmless() {
        let ledger = Ledger::new(16);
        let g = ledger.book(WorkerId(0), spec(10, 0, None), &[], Instant::now());
        assert!(ledger.free(g.id()));
        assert!(!ledger.free(g.id()));
        assert!(!ledger.free(12345));
        drop(g); // the guard frees again: no effect, no underflow
        assert_eq!(ledger.stats().active, 0);
        assert_eq!(ledger.stats().freed, 1);
    }

    #[test]
    fn sweep_frees_only_stale_bookings_and_counts_them() {
        let ledger = Ledger::new(16);
        let t0 = Instant::now();
        let old = ledger.book(WorkerId(0), spec(10, 0, None), &[], t0);
        let fresh = ledger.book(
            WorkerId(0),
            spec(10, 0, None),
            &[],
            t0 + Duration::from_secs(50),
        );
        let swept = ledger.sweep_expired(t0 + Duration::from_secs(61), Duration::from_secs(60));
        assert_eq!(swept, 1);
        assert_eq!(ledger.stats().swept, 1);
        assert_eq!(ledger.load(WorkerId(0)).in_flight, 1);
        drop(old); // its guard drops later: harmless
        drop(fresh);
        assert_eq!(ledger.stats().active, 0);
    }

    /// Block keys of a prompt: shared across workers for the first 64 blocks.
    fn keys(worker: u32, prompt: u32) -> Vec<BlockKey> {
        (0..u64::from(prompt / 16))
            .map(|i| {
                BlockKey(if i < 64 {
                    i
                } else {
                    (u64::from(worker) << 32) | i
                })
            })
            .collect()
    }

    /// A choice made here for a peer weighs as that peer's booking would (load and
    /// prefill credit) until the peer's report settles it, and only for a peer whose
    /// reports are held.
    #[test]
    fn a_choice_made_for_a_peer_weighs_as_its_booking_until_settled() {
        let ledger = Ledger::new(16);
        let ws = [WorkerId(0), WorkerId(1)];
        let prompt = keys(0, 16 * 40);
        let report = |seq, settled| crate::peer_loads::PeerReport {
            replica: "b".into(),
            incarnation: 1,
            seq,
            loads: Vec::new(),
            prefilling: Vec::new(),
            settled,
            settled_below: 0,
        };
        let now = Instant::now();
        let choice = spec(16 * 40, 160, Some(100));
        assert!(!ledger.book_for_peer("b", 1, 7, WorkerId(1), choice, &prompt, now));
        ledger.apply_peer_report(report(1, Vec::new()), now);
        assert!(ledger.book_for_peer("b", 1, 7, WorkerId(1), choice, &prompt, now));
        assert_eq!(ledger.booked_for_peers(), 1);
        let loads = ledger.fleet_loads_of(&ws);
        assert_eq!(loads[0], WorkerLoad::default());
        assert_eq!(loads[1].in_flight, 1);
        assert_eq!(loads[1].prefill_tokens, 16 * 40 - 160);
        assert_eq!(loads[1].decode_blocks, 40.0);
        assert_eq!(prefilling_blocks(&ledger, &prompt, &ws), [0, 32]);
        // Not this router's own booking: its limits and reports do not see it.
        assert_eq!(ledger.load(WorkerId(1)), WorkerLoad::default());
        ledger.apply_peer_report(report(2, vec![7]), now);
        assert_eq!(ledger.booked_for_peers(), 0);
        assert_eq!(ledger.fleet_loads_of(&ws)[1], WorkerLoad::default());
        assert_eq!(prefilling_blocks(&ledger, &prompt, &ws), [0, 0]);
    }

    fn prefilling_blocks(ledger: &Ledger, keys: &[BlockKey], ws: &[WorkerId]) -> Vec<u32> {
        ledger.prefill_credits(keys, ws, Instant::now(), Duration::from_secs(60))
    }

    /// A prompt is credited to its worker while its prefill is pending, and no longer
    /// once the first token arrived: the engine's events take over from there.
    #[test]
    fn prefill_credit_lasts_until_the_first_token() {
        let ledger = Ledger::new(16);
        let ws = [WorkerId(0), WorkerId(1)];
        let prompt = keys(0, 16 * 40);
        let g = ledger.book(WorkerId(1), spec(16 * 40, 0, None), &prompt, Instant::now());
        // 40 blocks: checkpoints at 16 and 32, so the credit is 32 blocks.
        assert_eq!(prefilling_blocks(&ledger, &prompt, &ws), [0, 32]);
        // A request sharing only the first 20 blocks is credited 16.
        assert_eq!(prefilling_blocks(&ledger, &prompt[..20], &ws), [0, 16]);
        g.prefill_done(Instant::now());
        assert_eq!(prefilling_blocks(&ledger, &prompt, &ws), [0, 0]);
        drop(g);
        assert!(ledger.inner.lock().prefilling.is_empty());
    }

    /// A prompt another replica reported in prefill on a worker is credited there as
    /// this router's own would be, and no longer once the peer's report drops it.
    #[test]
    fn a_peer_replicas_prompt_in_prefill_is_credited_too() {
        let ledger = Ledger::new(16);
        let ws = [WorkerId(0), WorkerId(1)];
        let prompt = keys(0, 16 * 40);
        let theirs = Ledger::new(16);
        let g = theirs.book(WorkerId(1), spec(16 * 40, 0, None), &prompt, Instant::now());
        let report = |seq, prefilling| crate::peer_loads::PeerReport {
            replica: "b".into(),
            incarnation: 1,
            seq,
            loads: Vec::new(),
            prefilling,
            settled: Vec::new(),
            settled_below: 0,
        };
        ledger.apply_peer_report(report(1, theirs.prefilling_checkpoints()), Instant::now());
        assert_eq!(prefilling_blocks(&ledger, &prompt, &ws), [0, 32]);
        g.prefill_done(Instant::now());
        assert!(theirs.prefilling_checkpoints().is_empty());
        ledger.apply_peer_report(report(2, theirs.prefilling_checkpoints()), Instant::now());
        assert_eq!(prefilling_blocks(&ledger, &prompt, &ws), [0, 0]);
        // Credit off: nothing, peers' or own.
        ledger.apply_peer_report(
            report(
                3,
                vec![(
                    WorkerId(1),
                    prompt.iter().skip(15).step_by(16).copied().collect(),
                )],
            ),
            Instant::now(),
        );
        let off = ledger.prefill_credits(&prompt, &ws, Instant::now(), Duration::ZERO);
        assert_eq!(off, [0, 0]);
    }

    /// Reading a credit or booking the same prefix again never extends an old credit:
    /// each booking's credit ends with its own prefill, and a credit older than
    /// `max_age` (a request stuck in a queue) counts for nothing.
    #[test]
    fn prefill_credit_is_never_renewed_by_use() {
        let ledger = Ledger::new(16);
        let ws = [WorkerId(0)];
        let prompt = keys(0, 16 * 16);
        let t0 = Instant::now();
        let first = ledger.book(WorkerId(0), spec(256, 0, None), &prompt, t0);
        let later = t0 + Duration::from_secs(5);
        let at =
            |now: Instant| ledger.prefill_credits(&prompt, &ws, now, Duration::from_secs(10))[0];
        assert_eq!(at(later), 16);
        assert_eq!(at(t0 + Duration::from_secs(11)), 0, "older than max_age");
        let second = ledger.book(WorkerId(0), spec(256, 0, None), &prompt, later);
        assert_eq!(
            at(t0 + Duration::from_secs(11)),
            16,
            "the second booking's own credit"
        );
        second.prefill_done(Instant::now());
        assert_eq!(
            at(t0 + Duration::from_secs(11)),
            0,
            "the first one was not renewed"
        );
        drop(first);
    }

    /// The accuracy record compares predictions with the engine's reports, and the
    /// credit trust falls to the share of credited tokens that came true.
    #[test]
    fn accuracy_tracks_predicted_against_reported_and_credit_trust() {
        let ledger = Ledger::new(16);
        let w = WorkerId(3);
        assert_eq!(ledger.accuracy(w).ratio(), None);
        assert!((ledger.accuracy(w).credit_trust() - 1.0).abs() < 1e-12);
        // Predicted 1,024 cached: 512 from the index, 512 credited.
        let respond = |reported: u32| {
            let g = ledger.book(
                w,
                BookingSpec {
                    prompt_tokens: 2048,
                    cached_tokens: 1024,
                    indexed_tokens: 512,
                    credited_tokens: 512,
                    expected_output_tokens: None,
                },
                &[],
                Instant::now(),
            );
            g.engine_reported_cached(reported);
        };
        // The engine served only the indexed 512 from cache.
        (0..200).for_each(|_| respond(512));
        let a = ledger.accuracy(w);
        assert_eq!(a.samples, 200);
        assert!((a.ratio().unwrap() - 2.0).abs() < 1e-9, "{a:?}");
        assert!(
            a.credit_trust() < 0.1,
            "credits that never come true lose trust: {a:?}"
        );
        // Credits that come true restore it.
        (0..400).for_each(|_| respond(1024));
        assert!(ledger.accuracy(w).credit_trust() > 0.99);
        assert!((ledger.accuracy(w).ratio().unwrap() - 1.0).abs() < 0.01);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Book {
            worker: u32,
            prompt: u32,
            cached: u32,
            expected: Option<u32>,
        },
        Prefill(usize),
        Progress(usize, u32),
        Free(usize),
        Drop(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..4u32, 0..5000u32, 0..5000u32, prop::option::of(1..500u32)).prop_map(
                |(worker, prompt, cached, expected)| Op::Book {
                    worker,
                    prompt,
                    cached,
                    expected
                }
            ),
            (0..20usize).prop_map(Op::Prefill),
            (0..20usize, 0..1000u32).prop_map(|(i, n)| Op::Progress(i, n)),
            (0..20usize).prop_map(Op::Free),
            (0..20usize).prop_map(Op::Drop),
        ]
    }

    proptest! {
        #[test]
        fn no_leak_after_any_sequence(ops in prop::collection::vec(op(), 0..80)) {
            let ledger = Ledger::new(16);
            let mut guards: Vec<Option<BookingGuard>> = Vec::new();
            for op in ops {
                match op {
                    Op::Book { worker, prompt, cached, expected } => guards.push(Some(
                        ledger.book(WorkerId(worker), spec(prompt, cached, expected), &keys(worker, prompt), Instant::now()),
                    )),
                    Op::Prefill(i) => if let Some(Some(g)) = guards.get(i) { g.prefill_done(Instant::now()); },
                    Op::Progress(i, n) => if let Some(Some(g)) = guards.get(i) { g.progress(n, Instant::now()) },
                    Op::Free(i) => if let Some(Some(g)) = guards.get(i) { ledger.free(g.id()); },
                    Op::Drop(i) => if let Some(g) = guards.get_mut(i) { g.take(); },
                }
                for (_, load) in ledger.loads() {
                    prop_assert!(load.decode_blocks >= 0.0);
                }
            }
            drop(guards);
            prop_assert_eq!(ledger.stats().active, 0);
            prop_assert!(ledger.inner.lock().prefilling.is_empty(), "a prefill credit outlived its booking");
            for (_, load) in ledger.loads() {
                prop_assert_eq!(load, WorkerLoad::default());
            }
        }
    }
}
