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

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::ids::WorkerId;

/// Floor of a booking's decode weight: a request that has run past its expected length
/// still occupies its blocks until it ends.
const MIN_DECODE_WEIGHT: f64 = 0.1;

/// What is known about a request when it is booked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BookingSpec {
    pub prompt_tokens: u32,
    /// Prompt tokens predicted to be served from the worker's prefix cache.
    pub cached_tokens: u32,
    /// `max_tokens`, or a better hint of the output length, when known.
    pub expected_output_tokens: Option<u32>,
}

/// Load one worker carries, as booked by this router.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct WorkerLoad {
    pub in_flight: u32,
    /// Uncached prompt tokens of requests whose first token has not arrived.
    pub prefill_tokens: u64,
    /// Weighted KV blocks of requests in flight.
    pub decode_blocks: f64,
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

#[derive(Clone, Copy, Debug)]
struct Booking {
    worker: WorkerId,
    spec: BookingSpec,
    prefill_pending: bool,
    output_tokens: u32,
    /// Decode blocks this booking currently contributes to its worker.
    decode_blocks: f64,
    booked_at: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    bookings: FxHashMap<u64, Booking>,
    loads: FxHashMap<WorkerId, WorkerLoad>,
    stats: LedgerStats,
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

    /// Books a request on `worker`. The returned guard frees the booking when dropped.
    pub fn book(
        self: &Arc<Self>,
        worker: WorkerId,
        spec: BookingSpec,
        now: Instant,
    ) -> BookingGuard {
        let spec = BookingSpec {
            cached_tokens: spec.cached_tokens.min(spec.prompt_tokens),
            ..spec
        };
        let mut booking = Booking {
            worker,
            spec,
            prefill_pending: true,
            output_tokens: 0,
            decode_blocks: 0.0,
            booked_at: now,
        };
        booking.decode_blocks = self.decode_blocks(&booking);
        let mut inner = self.inner.lock();
        inner.next_id += 1;
        let id = inner.next_id;
        let load = inner.loads.entry(worker).or_default();
        load.in_flight += 1;
        load.prefill_tokens += u64::from(spec.prompt_tokens - spec.cached_tokens);
        load.decode_blocks += booking.decode_blocks;
        inner.bookings.insert(id, booking);
        inner.stats.booked += 1;
        inner.stats.active += 1;
        drop(inner);
        BookingGuard {
            ledger: Arc::clone(self),
            id,
            worker,
        }
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

    /// Marks the request's prefill done (its first token arrived). Idempotent.
    pub fn prefill_done(&self, id: u64) {
        let mut inner = self.inner.lock();
        let Inner {
            bookings, loads, ..
        } = &mut *inner;
        if let Some(b) = bookings.get_mut(&id) {
            if b.prefill_pending {
                b.prefill_pending = false;
                if let Some(load) = loads.get_mut(&b.worker) {
                    load.prefill_tokens = load
                        .prefill_tokens
                        .saturating_sub(u64::from(b.spec.prompt_tokens - b.spec.cached_tokens));
                }
            }
        }
    }

    /// Records that the request has produced `output_tokens` tokens so far.
    pub fn progress(&self, id: u64, output_tokens: u32) {
        let mut inner = self.inner.lock();
        let Inner {
            bookings, loads, ..
        } = &mut *inner;
        if let Some(b) = bookings.get_mut(&id) {
            if output_tokens <= b.output_tokens {
                return;
            }
            b.output_tokens = output_tokens;
            let old = b.decode_blocks;
            b.decode_blocks = self.decode_blocks(b);
            if let Some(load) = loads.get_mut(&b.worker) {
                load.decode_blocks = (load.decode_blocks - old + b.decode_blocks).max(0.0);
            }
        }
    }

    /// Frees a booking. Returns false when it was already freed or never existed.
    pub fn free(&self, id: u64) -> bool {
        let mut inner = self.inner.lock();
        Self::free_locked(&mut inner, id)
    }

    fn free_locked(inner: &mut Inner, id: u64) -> bool {
        let Some(b) = inner.bookings.remove(&id) else {
            return false;
        };
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
            Self::free_locked(&mut inner, *id);
        }
        inner.stats.swept += expired.len() as u64;
        expired.len()
    }

    /// Load of one worker (zero when it has nothing booked).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.inner
            .lock()
            .loads
            .get(&worker)
            .copied()
            .unwrap_or_default()
    }

    /// Loads of several workers at once, under one lock acquisition, in `workers` order.
    pub fn loads_of(&self, workers: &[WorkerId]) -> Vec<WorkerLoad> {
        let inner = self.inner.lock();
        workers
            .iter()
            .map(|w| inner.loads.get(w).copied().unwrap_or_default())
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

    /// First token seen: the prompt is no longer waiting to be prefilled.
    pub fn prefill_done(&self) {
        self.ledger.prefill_done(self.id);
    }

    /// `output_tokens` produced so far.
    pub fn progress(&self, output_tokens: u32) {
        self.ledger.progress(self.id, output_tokens);
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

    fn spec(prompt: u32, cached: u32, expected: Option<u32>) -> BookingSpec {
        BookingSpec {
            prompt_tokens: prompt,
            cached_tokens: cached,
            expected_output_tokens: expected,
        }
    }

    #[test]
    fn lifecycle_tracks_prefill_and_decode() {
        let ledger = Ledger::new(16);
        let now = Instant::now();
        let g = ledger.book(WorkerId(1), spec(160, 32, Some(100)), now);
        let l = ledger.load(WorkerId(1));
        assert_eq!((l.in_flight, l.prefill_tokens), (1, 128));
        assert!((l.decode_blocks - 10.0).abs() < 1e-9);
        g.prefill_done();
        g.prefill_done();
        assert_eq!(ledger.load(WorkerId(1)).prefill_tokens, 0);
        g.progress(50); // 210 tokens = 14 blocks, half of the expected output left
        assert!((ledger.load(WorkerId(1)).decode_blocks - 7.0).abs() < 1e-9);
        g.progress(200); // past the expected length: floor weight
        let blocks = (360f64 / 16.0).ceil() * MIN_DECODE_WEIGHT;
        assert!((ledger.load(WorkerId(1)).decode_blocks - blocks).abs() < 1e-9);
        drop(g);
        assert_eq!(ledger.load(WorkerId(1)), WorkerLoad::default());
        assert_eq!(ledger.stats().freed, 1);
    }

    #[test]
    fn freeing_twice_or_unknown_is_harmless() {
        let ledger = Ledger::new(16);
        let g = ledger.book(WorkerId(0), spec(10, 0, None), Instant::now());
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
        let old = ledger.book(WorkerId(0), spec(10, 0, None), t0);
        let fresh = ledger.book(WorkerId(0), spec(10, 0, None), t0 + Duration::from_secs(50));
        let swept = ledger.sweep_expired(t0 + Duration::from_secs(61), Duration::from_secs(60));
        assert_eq!(swept, 1);
        assert_eq!(ledger.stats().swept, 1);
        assert_eq!(ledger.load(WorkerId(0)).in_flight, 1);
        drop(old); // its guard drops later: harmless
        drop(fresh);
        assert_eq!(ledger.stats().active, 0);
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
                        ledger.book(WorkerId(worker), spec(prompt, cached, expected), Instant::now()),
                    )),
                    Op::Prefill(i) => if let Some(Some(g)) = guards.get(i) { g.prefill_done() },
                    Op::Progress(i, n) => if let Some(Some(g)) = guards.get(i) { g.progress(n) },
                    Op::Free(i) => if let Some(Some(g)) = guards.get(i) { ledger.free(g.id()); },
                    Op::Drop(i) => if let Some(g) = guards.get_mut(i) { g.take(); },
                }
                for (_, load) in ledger.loads() {
                    prop_assert!(load.decode_blocks >= 0.0);
                }
            }
            drop(guards);
            prop_assert_eq!(ledger.stats().active, 0);
            for (_, load) in ledger.loads() {
                prop_assert_eq!(load, WorkerLoad::default());
            }
        }
    }
}
