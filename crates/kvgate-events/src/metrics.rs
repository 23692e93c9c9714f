//! Per-worker event-ingestion counters, readable as a plain snapshot.
//!
//! Owns the counters and the rate limit of the loud block-size-mismatch log line. It
//! must not depend on a metrics library: the gateway turns [`EventMetricsSnapshot`]
//! into Prometheus text. Counters are relaxed atomics written by one subscriber task
//! each and read by scrapes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvgate_core::{WorkerId, WorkerRef};
use parking_lot::{Mutex, RwLock};
use rustc_hash::FxHashMap;
use serde::Serialize;

use crate::apply::ApplyOutcome;

/// How often the block-size mismatch error is logged again for the same worker.
pub const MISMATCH_LOG_INTERVAL: Duration = Duration::from_secs(60);
/// How often a drop reason is logged again for the same worker.
pub const DROP_LOG_INTERVAL: Duration = Duration::from_secs(60);

/// Why an event (or a whole message) was not applied to the index. Every drop is
/// counted under one of these (`kvgate_kv_events_dropped_total{reason}`) and logged at
/// least once per [`DROP_LOG_INTERVAL`] per worker and reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// A message whose payload could not be decoded (or whose frames are malformed).
    DecodeError,
    /// A live message already applied (replay overlap, duplicate).
    Stale,
    /// An event type this decoder does not know.
    UnknownEvent,
    /// A store whose block size differs from the configured one.
    BlockSizeMismatch,
    /// A store whose token count is not `blocks × block_size`.
    TokenCountMismatch,
    /// A store whose parent block is unknown (its own store was missed or skipped).
    UnknownParent,
    /// An event for another KV-cache group or a non-full-attention spec.
    SkippedGroup,
    /// A store with multimodal / salted / embedding extra keys.
    SkippedExtraKeys,
    /// A removal of blocks this worker was not known to hold.
    UnknownRemoval,
}

impl DropReason {
    pub const ALL: [DropReason; 9] = [
        DropReason::DecodeError,
        DropReason::Stale,
        DropReason::UnknownEvent,
        DropReason::BlockSizeMismatch,
        DropReason::TokenCountMismatch,
        DropReason::UnknownParent,
        DropReason::SkippedGroup,
        DropReason::SkippedExtraKeys,
        DropReason::UnknownRemoval,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            DropReason::DecodeError => "decode_error",
            DropReason::Stale => "stale",
            DropReason::UnknownEvent => "unknown_event",
            DropReason::BlockSizeMismatch => "block_size_mismatch",
            DropReason::TokenCountMismatch => "token_count_mismatch",
            DropReason::UnknownParent => "unknown_parent",
            DropReason::SkippedGroup => "skipped_group",
            DropReason::SkippedExtraKeys => "skipped_extra_keys",
            DropReason::UnknownRemoval => "unknown_removal",
        }
    }

    fn explain(self) -> &'static str {
        match self {
            DropReason::DecodeError => "undecodable KV event message skipped",
            DropReason::Stale => {
                "KV event message already applied (replay overlap or duplicate) dropped"
            }
            DropReason::UnknownEvent => "KV event of an unknown type skipped",
            DropReason::BlockSizeMismatch => {
                "stored blocks with a block size other than the configured one dropped"
            }
            DropReason::TokenCountMismatch => {
                "stored blocks whose token count is not blocks x block_size dropped"
            }
            DropReason::UnknownParent => {
                "stored blocks whose parent block is unknown dropped (their prefix was missed)"
            }
            DropReason::SkippedGroup => {
                "event for another KV-cache group or a non-full-attention layer skipped"
            }
            DropReason::SkippedExtraKeys => {
                "stored blocks with multimodal, salted or embedding extra keys skipped"
            }
            DropReason::UnknownRemoval => {
                "removal of blocks the index did not hold for this worker ignored"
            }
        }
    }
}

/// Counters of one worker (all of its data-parallel ranks).
#[derive(Debug, Default)]
pub struct WorkerCounters {
    pub batches: AtomicU64,
    pub events_applied: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_removed: AtomicU64,
    pub clears: AtomicU64,
    pub decode_errors: AtomicU64,
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub replay_failures: AtomicU64,
    pub purges: AtomicU64,
    pub restarts: AtomicU64,
    pub reconnects: AtomicU64,
    pub block_size_mismatches: AtomicU64,
    /// Last engine block size that mismatched the configuration (0 = none yet).
    pub mismatched_block_size: AtomicU64,
    pub skipped_group: AtomicU64,
    pub skipped_extra_keys: AtomicU64,
    pub unknown_events: AtomicU64,
    pub unknown_parents: AtomicU64,
    pub unknown_removals: AtomicU64,
    pub token_count_mismatches: AtomicU64,
    pub stale_messages: AtomicU64,
    /// Times this router joined the engine's stream without learning everything the
    /// engine cached before (no replay endpoint, a failed replay, or a replay buffer
    /// that no longer reaches back to the stream's start): its index may be incomplete
    /// until the cache turns over.
    pub incomplete_starts: AtomicU64,
    /// Snapshots of this worker's index entries loaded from a peer router.
    pub snapshot_loads: AtomicU64,
    /// 1 while the subscriber holds a live connection to the engine.
    pub connected: AtomicU64,
    last_mismatch_log: Mutex<Option<Instant>>,
    /// When each [`DropReason`] was last logged for this worker.
    last_drop_log: Mutex<[Option<Instant>; DropReason::ALL.len()]>,
}

fn add(c: &AtomicU64, v: u64) {
    if v != 0 {
        c.fetch_add(v, Ordering::Relaxed);
    }
}

impl WorkerCounters {
    pub fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `n` drops for `reason` and logs them, at most once per
    /// [`DROP_LOG_INTERVAL`] per worker and reason.
    pub fn dropped(&self, at: WorkerRef, reason: DropReason, n: u64) {
        if n == 0 {
            return;
        }
        let counter = match reason {
            DropReason::DecodeError => &self.decode_errors,
            DropReason::Stale => &self.stale_messages,
            DropReason::UnknownEvent => &self.unknown_events,
            DropReason::BlockSizeMismatch => &self.block_size_mismatches,
            DropReason::TokenCountMismatch => &self.token_count_mismatches,
            DropReason::UnknownParent => &self.unknown_parents,
            DropReason::SkippedGroup => &self.skipped_group,
            DropReason::SkippedExtraKeys => &self.skipped_extra_keys,
            DropReason::UnknownRemoval => &self.unknown_removals,
        };
        let total = counter.fetch_add(n, Ordering::Relaxed) + n;
        let slot = DropReason::ALL
            .iter()
            .position(|r| *r == reason)
            .unwrap_or_default();
        let now = Instant::now();
        let mut last = self.last_drop_log.lock();
        if last[slot].is_none_or(|t| now.duration_since(t) >= DROP_LOG_INTERVAL) {
            last[slot] = Some(now);
            tracing::warn!(
                worker = %at.worker,
                dp_rank = at.dp_rank,
                reason = reason.as_str(),
                total,
                "{}",
                reason.explain()
            );
        }
    }

    /// Records one applied batch, and logs a block-size mismatch loudly (once per
    /// [`MISMATCH_LOG_INTERVAL`] per worker; the counter counts every one).
    pub fn record(&self, at: WorkerRef, expected_block_size: u32, o: &ApplyOutcome) {
        add(&self.batches, 1);
        add(&self.events_applied, o.events_applied);
        add(&self.blocks_stored, o.blocks_stored);
        add(&self.blocks_removed, o.blocks_removed);
        add(&self.clears, o.clears);
        self.dropped(at, DropReason::SkippedGroup, o.skipped_group);
        self.dropped(at, DropReason::SkippedExtraKeys, o.skipped_extra_keys);
        self.dropped(at, DropReason::UnknownEvent, o.unknown_events);
        self.dropped(at, DropReason::UnknownParent, o.unknown_parents);
        self.dropped(at, DropReason::UnknownRemoval, o.unknown_removals);
        self.dropped(at, DropReason::TokenCountMismatch, o.token_count_mismatches);
        // Logged below as an error with the fix.
        add(&self.block_size_mismatches, o.block_size_mismatches);
        if let Some(got) = o.mismatched_block_size {
            self.mismatched_block_size
                .store(got as u64, Ordering::Relaxed);
            let now = Instant::now();
            let mut last = self.last_mismatch_log.lock();
            if last.is_none_or(|t| now.duration_since(t) >= MISMATCH_LOG_INTERVAL) {
                *last = Some(now);
                tracing::error!(
                    worker = %at.worker,
                    dp_rank = at.dp_rank,
                    engine_block_size = got,
                    configured_block_size = expected_block_size,
                    mismatches = self.block_size_mismatches.load(Ordering::Relaxed),
                    "KV events rejected: the engine's block size differs from the configured \
                     block size, so this worker's cache cannot be indexed; fix --block-size"
                );
            }
        }
    }

    pub fn snapshot(&self, worker: WorkerId) -> WorkerEventStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mismatch = g(&self.mismatched_block_size);
        WorkerEventStats {
            worker,
            connected: g(&self.connected) != 0,
            batches: g(&self.batches),
            events_applied: g(&self.events_applied),
            blocks_stored: g(&self.blocks_stored),
            blocks_removed: g(&self.blocks_removed),
            clears: g(&self.clears),
            decode_errors: g(&self.decode_errors),
            gaps: g(&self.gaps),
            replays: g(&self.replays),
            replay_failures: g(&self.replay_failures),
            purges: g(&self.purges),
            restarts: g(&self.restarts),
            reconnects: g(&self.reconnects),
            block_size_mismatches: g(&self.block_size_mismatches),
            mismatched_block_size: (mismatch != 0).then_some(mismatch as u32),
            skipped_group: g(&self.skipped_group),
            skipped_extra_keys: g(&self.skipped_extra_keys),
            unknown_events: g(&self.unknown_events),
            unknown_parents: g(&self.unknown_parents),
            unknown_removals: g(&self.unknown_removals),
            token_count_mismatches: g(&self.token_count_mismatches),
            stale_messages: g(&self.stale_messages),
            incomplete_starts: g(&self.incomplete_starts),
            snapshot_loads: g(&self.snapshot_loads),
        }
    }
}

/// A point-in-time copy of one worker's counters.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WorkerEventStats {
    pub worker: WorkerId,
    pub connected: bool,
    pub batches: u64,
    pub events_applied: u64,
    pub blocks_stored: u64,
    pub blocks_removed: u64,
    pub clears: u64,
    pub decode_errors: u64,
    pub gaps: u64,
    pub replays: u64,
    pub replay_failures: u64,
    pub purges: u64,
    pub restarts: u64,
    pub reconnects: u64,
    pub block_size_mismatches: u64,
    pub mismatched_block_size: Option<u32>,
    pub skipped_group: u64,
    pub skipped_extra_keys: u64,
    pub unknown_events: u64,
    pub unknown_parents: u64,
    pub unknown_removals: u64,
    pub token_count_mismatches: u64,
    /// Live messages dropped as already applied (replay overlap, duplicates).
    pub stale_messages: u64,
    /// Joins of the stream that could not learn everything cached before them.
    pub incomplete_starts: u64,
    /// Snapshots of this worker loaded from a peer router.
    pub snapshot_loads: u64,
}

impl WorkerEventStats {
    /// Drops by reason, every [`DropReason`] in order.
    pub fn drops(&self) -> [(DropReason, u64); DropReason::ALL.len()] {
        DropReason::ALL.map(|r| {
            let n = match r {
                DropReason::DecodeError => self.decode_errors,
                DropReason::Stale => self.stale_messages,
                DropReason::UnknownEvent => self.unknown_events,
                DropReason::BlockSizeMismatch => self.block_size_mismatches,
                DropReason::TokenCountMismatch => self.token_count_mismatches,
                DropReason::UnknownParent => self.unknown_parents,
                DropReason::SkippedGroup => self.skipped_group,
                DropReason::SkippedExtraKeys => self.skipped_extra_keys,
                DropReason::UnknownRemoval => self.unknown_removals,
            };
            (r, n)
        })
    }
}

/// Every worker's counters plus the index size, for one scrape.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EventMetricsSnapshot {
    pub workers: Vec<WorkerEventStats>,
    /// Holder entries in the index after the most recent batch any subscriber applied.
    pub index_entries: u64,
}

/// Registry of per-worker counters shared by all subscribers (`Arc<EventMetrics>`).
#[derive(Debug, Default)]
pub struct EventMetrics {
    workers: RwLock<FxHashMap<WorkerId, Arc<WorkerCounters>>>,
    index_entries: AtomicU64,
}

impl EventMetrics {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The counters of `worker`, created on first use.
    pub fn worker(&self, worker: WorkerId) -> Arc<WorkerCounters> {
        if let Some(c) = self.workers.read().get(&worker) {
            return c.clone();
        }
        self.workers.write().entry(worker).or_default().clone()
    }

    /// Event batches applied for `worker` so far (0 when none, without creating its
    /// counters).
    pub fn batches_of(&self, worker: WorkerId) -> u64 {
        self.workers
            .read()
            .get(&worker)
            .map_or(0, |c| c.batches.load(Ordering::Relaxed))
    }

    /// Drops a removed worker's counters (its series disappear from the next scrape).
    pub fn forget(&self, worker: WorkerId) {
        self.workers.write().remove(&worker);
    }

    /// Records the index size (holder entries).
    pub fn set_index_entries(&self, entries: usize) {
        self.index_entries.store(entries as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> EventMetricsSnapshot {
        let mut workers: Vec<WorkerEventStats> = self
            .workers
            .read()
            .iter()
            .map(|(w, c)| c.snapshot(*w))
            .collect();
        workers.sort_by_key(|s| s.worker);
        EventMetricsSnapshot {
            workers,
            index_entries: self.index_entries.load(Ordering::Relaxed),
        }
    }
}
