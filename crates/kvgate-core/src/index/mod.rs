//! The prefix index: which worker rank holds which block keys, at which tier.
//!
//! Owns the per-model tree of block keys and who holds them, each worker rank's map
//! from the engine's opaque block hash to a block (so `BlockRemoved` can be applied),
//! and the eviction queue that bounds memory. It must not parse wire formats, talk to
//! engines or know about load: event ingestion translates events into these calls, and
//! policies only read [`PrefixIndex::overlaps`].
//!
//! # Layout
//! A radix tree of *runs* of chained block keys (`tree.rs`): engines store a request's
//! blocks as a run, and consecutive blocks of a run are consecutive keys in one node,
//! so a stored run is appended to one node and a lookup compares a prompt's keys with a
//! node's in one step (keys are chained: equal keys at an offset mean equal prefixes
//! up to it). Per node, each (worker slot, tier) that holds some of its blocks has a
//! *cover*: how many of the node's leading blocks it holds and the engine's hash of
//! each. The only per-(block, worker) state is that engine hash and its entry in the
//! rank's engine-hash map, which finds a block for a `BlockRemoved` or a stored run's
//! parent. Keys are our content keys, so per-process engine hash seeds work and blocks
//! from different engines meet in one tree.
//!
//! Holes (an engine removed a parent before its child) and blocks held only on
//! host/disk are exact by construction: a cover is always a prefix of its node, so a
//! hole splits the node where the coverage breaks, and a lookup counts per node how
//! many blocks each slot holds at which tier. Nodes without covers stay only while they
//! lead to nodes with covers.
//!
//! # Memory bound and eviction rule
//! The index holds at most [`IndexConfig::max_blocks`] holder entries (one per block,
//! worker rank and tier). Engines normally keep it far below that by reporting their
//! own evictions; the cap is the backstop for lost removals. When an insert exceeds the
//! cap, covers are trimmed from their tips in the order they were last stored into
//! (oldest first), with a second chance (CLOCK) for nodes that a lookup matched since
//! they were last looked at. Eviction takes leaves only: a block whose children the
//! rank still holds is skipped (its cover goes back to the front of the queue when its
//! last held child goes), so eviction never creates a hole. The eviction queue (one
//! item per cover, not per block) is only kept while the index is near its cap: built
//! on demand when the cap is first exceeded, compacted when stale items outnumber live
//! ones, and dropped once the index falls below half the cap. Hash tables are rebuilt
//! at their size when churn fills them with deleted slots (`table_size.rs`).

mod engine_map;
mod evict;
mod query;
mod snapshot;
mod table_size;
mod tree;

use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use serde::Serialize;
use smallvec::SmallVec;

use engine_map::EngineMap;
pub use query::{Overlap, OverlapScores};
pub use snapshot::{HeldBlock, SnapshotImport};
use table_size::TableSize;
use tree::{Cover, Node, Pos};

use crate::hashing::{BlockHasher, BlockKey};
use crate::ids::{Tier, WorkerId, WorkerRef};

/// Limits of one model's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Maximum number of (block, worker rank, tier) entries kept. Memory: the engine's
    /// hash of each entry (8 bytes) and its engine-hash map entry (12.8 bytes, about
    /// 15.5 with the table's free room), plus each distinct block's key (8 bytes) and a
    /// node per run: about 31 bytes per entry (docs/BENCHMARKS.md, "Memory and churn").
    pub max_blocks: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_blocks: 4_000_000,
        }
    }
}

/// A run of blocks an engine reports as stored, as `BlockStored` delivers them.
#[derive(Clone, Copy, Debug)]
pub struct StoredBlocks<'a> {
    /// The engine's opaque hash of each block, in order.
    pub engine_hashes: &'a [u64],
    /// The engine hash of the block before the first one, if it is not a root block.
    pub parent_engine_hash: Option<u64>,
    /// All tokens of the blocks, concatenated (`engine_hashes.len() * block_size`).
    pub token_ids: &'a [u32],
    /// Block size the engine used.
    pub block_size: u32,
    pub tier: Tier,
    /// LoRA adapter the blocks were computed with (salts the keys).
    pub lora_name: Option<&'a str>,
    /// Blocks of the same engine run that follow these in later stores (the rest of a
    /// run cut by [`StoredBlocks::slices`]; 0 for a run stored whole): the run's storage
    /// is sized for them too, so a long run grows once, not once per slice.
    pub blocks_after: usize,
}

/// The most blocks one write section of a shared index should apply before it lets
/// waiting lookups in: a writer holding the index's lock applies an event in slices
/// of at most this many blocks ([`StoredBlocks::slices`], removals in chunks) and
/// yields the lock to waiting readers between them, so a lookup waits for at most one
/// slice (a few µs to tens, more with the caches cold), not for an engine's whole
/// batch (thousands of blocks: a millisecond). With writers saturated, slices of 64
/// blocks against 256: lookups' p99 35-83 µs against 76-139 (two alternating rounds),
/// for about 8% of index_compare's event rate (three alternating pairs); without
/// slices, p99 above a millisecond (docs/BENCHMARKS.md section 10). A sliced run's
/// storage is still sized once for the whole run ([`StoredBlocks::blocks_after`]).
pub const WRITE_SLICE_BLOCKS: usize = 64;

impl<'a> StoredBlocks<'a> {
    /// The run cut into consecutive runs of at most `max_blocks` blocks (at least one),
    /// each naming the last block of the one before as its parent: applied in order,
    /// they store exactly what the whole run stores, and a writer can let readers in
    /// between. A run whose token count does not match its blocks comes whole, so that
    /// applying it reports the mismatch.
    pub fn slices(&self, max_blocks: usize) -> Slices<'a> {
        Slices {
            rest: Some(*self),
            max_blocks: max_blocks.max(1),
        }
    }
}

/// Iterator of [`StoredBlocks::slices`].
#[derive(Clone, Debug)]
pub struct Slices<'a> {
    rest: Option<StoredBlocks<'a>>,
    max_blocks: usize,
}

impl<'a> Iterator for Slices<'a> {
    type Item = StoredBlocks<'a>;

    fn next(&mut self) -> Option<StoredBlocks<'a>> {
        let run = self.rest.take()?;
        let n = run.engine_hashes.len();
        let block_size = run.block_size as usize;
        if n <= self.max_blocks || run.token_ids.len() != n * block_size {
            return Some(run);
        }
        let (hashes, later_hashes) = run.engine_hashes.split_at(self.max_blocks);
        let (token_ids, later_tokens) = run.token_ids.split_at(self.max_blocks * block_size);
        self.rest = Some(StoredBlocks {
            engine_hashes: later_hashes,
            parent_engine_hash: hashes.last().copied(),
            token_ids: later_tokens,
            ..run
        });
        Some(StoredBlocks {
            engine_hashes: hashes,
            token_ids,
            blocks_after: run.blocks_after + later_hashes.len(),
            ..run
        })
    }
}

/// What an accepted store did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreOutcome {
    /// Blocks newly held by this worker rank at this tier.
    pub inserted: usize,
    /// Blocks it already held there (refreshed).
    pub duplicates: usize,
    /// Entries evicted to stay under the cap.
    pub evicted: usize,
}

/// A worker rank's engine-hash map, grown ahead of a store
/// ([`PrefixIndex::grow_ahead`]).
#[derive(Debug)]
pub struct GrownEngineMap {
    at: WorkerRef,
    slot: u16,
    map: EngineMap,
}

/// Why a store was not applied. Each is also counted in [`IndexStats`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The engine's block size differs from the model's configured one: every key would
    /// be wrong, so nothing is indexed. Must be surfaced loudly by the caller.
    BlockSizeMismatch { expected: u32, got: u32 },
    /// `token_ids` is not `blocks × block_size` long.
    TokenCountMismatch {
        blocks: usize,
        tokens: usize,
        block_size: u32,
    },
    /// The parent block is not known for this worker rank (its store was missed), so
    /// the chained keys cannot be computed.
    UnknownParent { parent_engine_hash: u64 },
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::BlockSizeMismatch { expected, got } => write!(
                f,
                "engine block size {got} differs from the configured block size {expected}"
            ),
            StoreError::TokenCountMismatch {
                blocks,
                tokens,
                block_size,
            } => write!(
                f,
                "{tokens} token ids for {blocks} blocks of {block_size} tokens"
            ),
            StoreError::UnknownParent { parent_engine_hash } => {
                write!(f, "unknown parent block hash {parent_engine_hash}")
            }
        }
    }
}

impl std::error::Error for StoreError {}

/// What a removal did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoveOutcome {
    pub removed: usize,
    /// Hashes this worker rank was not known to hold (ignored).
    pub unknown: usize,
}

/// Cumulative counters of one index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct IndexStats {
    pub stored_blocks: u64,
    pub duplicate_stores: u64,
    pub removed_blocks: u64,
    pub unknown_removals: u64,
    pub unknown_parents: u64,
    pub evicted_blocks: u64,
    pub block_size_mismatches: u64,
    pub token_count_mismatches: u64,
    pub clears: u64,
    pub workers_removed: u64,
}

#[derive(Debug)]
struct SlotState {
    /// The engine's hash of every block the slot holds → where the block is.
    engine_map: EngineMap,
    entries: usize,
    /// The last engine event sequence number the slot's entries reflect (set by the
    /// caller that applies the events), so a snapshot says where to continue from.
    applied_seq: Option<u64>,
}

impl SlotState {
    fn new() -> Self {
        Self {
            engine_map: EngineMap::default(),
            entries: 0,
            applied_seq: None,
        }
    }

    fn add_entry(&mut self) {
        self.entries += 1;
    }
}

/// Whether `slot` holds the block at `pos` under `engine_hash` (at some tier): confirms
/// an engine-hash map entry, which keeps only a tag of the hash.
#[inline]
fn holds_under(nodes: &[Node], slot: u16, pos: Pos, engine_hash: u64) -> bool {
    nodes.get(pos.node as usize).is_some_and(|n| {
        n.is_live()
            && pos.abs >= n.base
            && n.slot_covers(slot).iter().any(|c| {
                let i = (pos.abs - n.base) as usize;
                c.len() > i && c.engine_hashes[i] == engine_hash
            })
    })
}

/// A cover in the eviction queue, as of `stamp` (stale once the cover was stored into
/// again or is gone).
#[derive(Clone, Copy, Debug)]
struct QueueItem {
    node: u32,
    stamp: u32,
    slot: u16,
    tier: Tier,
}

/// How many blocks ahead of the one being applied an event's engine-hash map lines
/// are prefetched (`prefetch_ahead`), and how many blocks a store hashes at a time.
/// Far enough ahead for a line to arrive from memory, near enough that the lines in
/// flight (two per block) stay within what the CPU can track: with the caches cold
/// (another index's work in between), prefetching 32 blocks ahead, in chunks, made a
/// stored block cost 2.4x what 8 did; 8 and 12 were as fast as each other, 4 and 16
/// slower (docs/BENCHMARKS.md, "Event apply").
const PIPELINE: usize = 8;

/// Maximum number of worker ranks one index tracks at once.
pub const MAX_SLOTS: usize = u16::MAX as usize;

/// One model's prefix index. Not internally synchronized: wrap it in a lock to share.
#[derive(Debug)]
pub struct PrefixIndex {
    hasher: BlockHasher,
    config: IndexConfig,
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// The first key of every node → the node.
    starts: FxHashMap<BlockKey, u32>,
    starts_size: TableSize,
    slots: Vec<Option<SlotState>>,
    /// Each slot's rank (`None` for a free slot), apart from `slots`: a lookup names the
    /// rank of every slot that matched (hundreds share a system prompt) and reads 12
    /// bytes a slot here instead of a cache line or two of its `SlotState`.
    slot_refs: Vec<Option<WorkerRef>>,
    slot_of: FxHashMap<WorkerRef, u16>,
    free_slots: Vec<u16>,
    queue: VecDeque<QueueItem>,
    /// Whether `queue` is maintained (only near the cap).
    tracking: bool,
    next_stamp: u32,
    live: usize,
    /// Covers in the tree (bounds the eviction queue).
    covers: usize,
    stats: IndexStats,
}

impl PrefixIndex {
    pub fn new(hasher: BlockHasher, config: IndexConfig) -> Self {
        Self {
            hasher,
            config,
            nodes: Vec::new(),
            free_nodes: Vec::new(),
            starts: FxHashMap::default(),
            starts_size: TableSize::default(),
            slots: Vec::new(),
            slot_refs: Vec::new(),
            slot_of: FxHashMap::default(),
            free_slots: Vec::new(),
            queue: VecDeque::new(),
            tracking: false,
            next_stamp: 0,
            live: 0,
            covers: 0,
            stats: IndexStats::default(),
        }
    }

    /// The hasher requests must be keyed with to be comparable with this index.
    pub fn hasher(&self) -> &BlockHasher {
        &self.hasher
    }

    pub fn block_size(&self) -> u32 {
        self.hasher.block_size()
    }

    pub fn config(&self) -> IndexConfig {
        self.config
    }

    /// Number of (block, worker rank, tier) entries held.
    pub fn len(&self) -> usize {
        self.live
    }

    pub fn is_empty(&self) -> bool {
        self.live == 0
    }

    /// Number of distinct block keys held by anyone (walks the nodes).
    pub fn distinct_blocks(&self) -> usize {
        self.nodes
            .iter()
            .map(|n| n.covers.iter().map(Cover::len).max().unwrap_or(0))
            .sum()
    }

    /// Number of runs (tree nodes); for memory checks.
    pub fn runs(&self) -> usize {
        self.nodes.len() - self.free_nodes.len()
    }

    pub fn stats(&self) -> &IndexStats {
        &self.stats
    }

    /// Worker ranks with state in the index.
    pub fn worker_refs(&self) -> Vec<WorkerRef> {
        let mut refs: Vec<WorkerRef> = self.slot_of.keys().copied().collect();
        refs.sort();
        refs
    }

    /// Entries held by one worker rank.
    pub fn worker_len(&self, at: WorkerRef) -> usize {
        self.slot_state(at).map_or(0, |s| s.entries)
    }

    /// Entries held by each of `workers` (all its ranks together), in `workers` order.
    pub fn entries_of(&self, workers: &[WorkerId]) -> Vec<usize> {
        self.per_worker(workers, |n, s| *n += s.entries)
    }

    /// One value per worker of `workers` (in that order), folded over its ranks' slots.
    fn per_worker<T: Default + Clone>(
        &self,
        workers: &[WorkerId],
        add: impl Fn(&mut T, &SlotState),
    ) -> Vec<T> {
        let mut out = vec![T::default(); workers.len()];
        for (state, at) in self.slots.iter().zip(&self.slot_refs) {
            let (Some(state), Some(at)) = (state, at) else {
                continue;
            };
            if let Some(i) = workers.iter().position(|w| *w == at.worker) {
                add(&mut out[i], state);
            }
        }
        out
    }

    /// The nodes a rank's engine-hash map points into (those holding its blocks), each
    /// once, in id order: a bit per node, as a quarter of a million blocks lie in a few
    /// hundred nodes (sorting their positions took 3 of a 4 ms clear, and most of a
    /// snapshot's export).
    fn nodes_holding(&self, map: &EngineMap) -> Vec<u32> {
        let mut marked = vec![0u64; self.nodes.len().div_ceil(64)];
        for p in map.positions() {
            marked[p.node as usize / 64] |= 1 << (p.node % 64);
        }
        let mut nodes = Vec::new();
        for (word, &bits) in marked.iter().enumerate() {
            let mut bits = bits;
            while bits != 0 {
                nodes.push((word * 64) as u32 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        nodes
    }

    /// Every (key, tier) one worker rank holds, sorted; for accuracy checks and debugging.
    pub fn worker_blocks(&self, at: WorkerRef) -> Vec<(BlockKey, Tier)> {
        let mut out: Vec<(BlockKey, Tier)> = self
            .export_worker(at)
            .into_iter()
            .map(|b| (b.key, b.tier))
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Records that a worker rank's entries reflect its engine's events through
    /// sequence number `seq` (the event ingest calls this with each batch it applies).
    pub fn set_applied_seq(&mut self, at: WorkerRef, seq: u64) {
        if let Some(slot) = self.slot_for(at) {
            if let Some(state) = self.slot_mut(slot) {
                state.applied_seq = Some(seq);
            }
        }
    }

    /// The last event sequence number a worker rank's entries reflect (`None` before
    /// any, and after a clear).
    pub fn applied_seq(&self, at: WorkerRef) -> Option<u64> {
        self.slot_state(at).and_then(|s| s.applied_seq)
    }

    /// Our key for an engine block hash held by a worker rank.
    pub fn key_of(&self, at: WorkerRef, engine_hash: u64) -> Option<BlockKey> {
        let slot = *self.slot_of.get(&at)?;
        self.lookup(slot, engine_hash).map(|pos| self.key_at(pos))
    }

    /// Whether storing `blocks` more blocks for a worker rank could grow its
    /// engine-hash map, a rehash of all it holds: a shared index's writer then builds
    /// the grown map beside the index ([`Self::grow_ahead`]) while lookups go on, and
    /// swaps it in ([`Self::install_grown`]), instead of rehashing under the write lock
    /// (the longest writes: 0.2-0.9 ms for a rank holding tens of thousands of blocks,
    /// docs/BENCHMARKS.md section 10).
    pub fn needs_room(&self, at: WorkerRef, blocks: usize) -> bool {
        self.slot_state(at)
            .is_some_and(|s| s.engine_map.would_grow(blocks))
    }

    /// The rank's engine-hash map grown to take `blocks` more blocks, built from a
    /// shared borrow (readers may use the index meanwhile); `None` when it needs no room.
    pub fn grow_ahead(&self, at: WorkerRef, blocks: usize) -> Option<GrownEngineMap> {
        let slot = *self.slot_of.get(&at)?;
        let map = &self.slot(slot)?.engine_map;
        map.would_grow(blocks).then(|| GrownEngineMap {
            at,
            slot,
            map: map.grown_copy(blocks),
        })
    }

    /// Swaps in a map from [`Self::grow_ahead`] if the rank's map has not changed since
    /// it was copied (otherwise drops it: the store then grows the map itself). Returns
    /// whether it was swapped in.
    pub fn install_grown(&mut self, grown: GrownEngineMap) -> bool {
        if self.slot_of.get(&grown.at) != Some(&grown.slot) {
            return false;
        }
        match self.slot_mut(grown.slot) {
            Some(state) if state.engine_map.changes() == grown.map.changes() => {
                state.engine_map = grown.map;
                true
            }
            _ => false,
        }
    }

    /// Applies a `BlockStored` run for one worker rank.
    pub fn apply_stored(
        &mut self,
        at: WorkerRef,
        blocks: &StoredBlocks<'_>,
    ) -> Result<StoreOutcome, StoreError> {
        let block_size = self.hasher.block_size();
        if blocks.block_size != block_size {
            self.stats.block_size_mismatches += 1;
            return Err(StoreError::BlockSizeMismatch {
                expected: block_size,
                got: blocks.block_size,
            });
        }
        let n = blocks.engine_hashes.len();
        if blocks.token_ids.len() != n * block_size as usize {
            self.stats.token_count_mismatches += 1;
            return Err(StoreError::TokenCountMismatch {
                blocks: n,
                tokens: blocks.token_ids.len(),
                block_size,
            });
        }
        let Some(slot) = self.slot_for(at) else {
            // More worker ranks than the index can number: refuse rather than corrupt.
            self.stats.unknown_parents += 1;
            return Err(StoreError::UnknownParent {
                parent_engine_hash: blocks.parent_engine_hash.unwrap_or(0),
            });
        };
        let mut prev = match blocks.parent_engine_hash {
            None => None,
            Some(p) => match self.lookup(slot, p) {
                Some(pos) => Some(pos),
                None => {
                    self.stats.unknown_parents += 1;
                    return Err(StoreError::UnknownParent {
                        parent_engine_hash: p,
                    });
                }
            },
        };
        let hasher = self.hasher.for_lora(blocks.lora_name);
        let mut outcome = StoreOutcome::default();
        let mut keys = [BlockKey(0); PIPELINE];
        let mut last_key = prev.map(|p| self.key_at(p));
        let mut done = 0;
        self.prefetch(slot, &blocks.engine_hashes[..n.min(PIPELINE)]);
        for (hashes, tokens) in blocks
            .engine_hashes
            .chunks(PIPELINE)
            .zip(blocks.token_ids.chunks(PIPELINE * block_size as usize))
        {
            let chunk_keys = &mut keys[..tokens.len() / block_size as usize];
            last_key = hasher.write_keys(last_key, tokens, chunk_keys);
            for (engine_hash, &key) in hashes.iter().zip(chunk_keys.iter()) {
                // The blocks still to come, so a run's storage grows once, exactly.
                let rest = n - done + blocks.blocks_after;
                self.prefetch_ahead(slot, blocks.engine_hashes, done);
                done += 1;
                if let Some(pos) = prev
                    .and_then(|p| self.extend_cover(slot, blocks.tier, p, key, *engine_hash, rest))
                {
                    outcome.inserted += 1;
                    prev = Some(pos);
                    continue;
                }
                let pos = self.ensure_child(prev, key, rest);
                let (new, pos) = self.hold(slot, blocks.tier, pos, *engine_hash, rest);
                if new {
                    outcome.inserted += 1;
                } else {
                    outcome.duplicates += 1;
                }
                prev = Some(pos);
            }
        }
        self.stats.stored_blocks += outcome.inserted as u64;
        self.stats.duplicate_stores += outcome.duplicates as u64;
        outcome.evicted = self.enforce_cap();
        Ok(outcome)
    }

    /// Applies a `BlockRemoved` for one worker rank. `tier: None` removes the blocks
    /// from every tier. Unknown hashes are ignored and counted.
    pub fn apply_removed(
        &mut self,
        at: WorkerRef,
        engine_hashes: &[u64],
        tier: Option<Tier>,
    ) -> RemoveOutcome {
        let mut outcome = RemoveOutcome::default();
        let Some(&slot) = self.slot_of.get(&at) else {
            outcome.unknown = engine_hashes.len();
            self.stats.unknown_removals += outcome.unknown as u64;
            return outcome;
        };
        self.prefetch(slot, &engine_hashes[..engine_hashes.len().min(PIPELINE)]);
        let mut k = 0;
        while k < engine_hashes.len() {
            let engine_hash = engine_hashes[k];
            self.prefetch_ahead(slot, engine_hashes, k);
            let Some(pos) = self.lookup(slot, engine_hash) else {
                outcome.unknown += 1;
                k += 1;
                continue;
            };
            let run = self.release_tip_run(slot, pos, &engine_hashes[k..], tier);
            if run > 0 {
                outcome.removed += run;
                k += run;
                continue;
            }
            let removed = self.release(slot, pos, |c, i| {
                c.engine_hashes[i] == engine_hash && tier.is_none_or(|t| c.tier == t)
            });
            if removed == 0 {
                outcome.unknown += 1;
            }
            outcome.removed += removed;
            k += 1;
        }
        self.stats.removed_blocks += outcome.removed as u64;
        self.stats.unknown_removals += outcome.unknown as u64;
        outcome
    }

    /// Forgets everything one worker rank holds (`AllBlocksCleared`, an engine restart,
    /// or an unrecoverable sequence gap). Idempotent; returns the entries removed.
    pub fn clear(&mut self, at: WorkerRef) -> usize {
        self.stats.clears += 1;
        match self.slot_of.get(&at) {
            Some(&slot) => self.clear_slot(slot),
            None => 0,
        }
    }

    /// Purges every rank of a worker that died or was removed. Returns entries removed.
    pub fn remove_worker(&mut self, worker: WorkerId) -> usize {
        let refs: Vec<(WorkerRef, u16)> = self
            .slot_of
            .iter()
            .filter(|(at, _)| at.worker == worker)
            .map(|(at, slot)| (*at, *slot))
            .collect();
        let mut removed = 0;
        for (at, slot) in refs {
            removed += self.clear_slot(slot);
            self.slot_of.remove(&at);
            if let Some(s) = self.slots.get_mut(slot as usize) {
                *s = None;
            }
            if let Some(r) = self.slot_refs.get_mut(slot as usize) {
                *r = None;
            }
            self.free_slots.push(slot);
        }
        self.stats.workers_removed += 1;
        removed
    }

    /// Starts loading the engine-hash map lines of `engine_hashes` (see
    /// [`EngineMap::touch`]).
    fn prefetch(&self, slot: u16, engine_hashes: &[u64]) {
        if let Some(state) = self.slot(slot) {
            for eh in engine_hashes {
                state.engine_map.touch(*eh);
            }
        }
    }

    /// Called as an event's block `at` is applied: starts loading the map lines of the
    /// block `PIPELINE` further on, so that many blocks' lines are in flight while
    /// blocks are applied and each arrives before it is needed.
    #[inline]
    fn prefetch_ahead(&self, slot: u16, engine_hashes: &[u64], at: usize) {
        if let Some(eh) = engine_hashes.get(at + PIPELINE) {
            self.prefetch(slot, std::slice::from_ref(eh));
        }
    }

    /// Where `slot` holds its engine's block `engine_hash`.
    fn lookup(&self, slot: u16, engine_hash: u64) -> Option<Pos> {
        let nodes = &self.nodes;
        self.slot(slot)?
            .engine_map
            .get(engine_hash, |p| holds_under(nodes, slot, p, engine_hash))
    }

    fn slot(&self, slot: u16) -> Option<&SlotState> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    fn slot_mut(&mut self, slot: u16) -> Option<&mut SlotState> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    fn slot_state(&self, at: WorkerRef) -> Option<&SlotState> {
        self.slot_of.get(&at).and_then(|&slot| self.slot(slot))
    }

    fn slot_for(&mut self, at: WorkerRef) -> Option<u16> {
        if let Some(&slot) = self.slot_of.get(&at) {
            return Some(slot);
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None if self.slots.len() < MAX_SLOTS => {
                self.slots.push(None);
                self.slot_refs.push(None);
                (self.slots.len() - 1) as u16
            }
            None => return None,
        };
        self.slots[slot as usize] = Some(SlotState::new());
        self.slot_refs[slot as usize] = Some(at);
        self.slot_of.insert(at, slot);
        Some(slot)
    }

    fn stamp(&mut self) -> u32 {
        self.next_stamp = self.next_stamp.wrapping_add(1);
        self.next_stamp
    }

    /// Records that `slot` holds the block at `pos` at `tier` under `engine_hash`
    /// (`rest`: blocks of the run still to be held, this one included, to size the
    /// cover once). Returns whether the holder is new (false: a duplicate store,
    /// refreshed) and where the block is now (holding it after a gap splits its node).
    fn hold(
        &mut self,
        slot: u16,
        tier: Tier,
        mut pos: Pos,
        engine_hash: u64,
        rest: usize,
    ) -> (bool, Pos) {
        let stamp = self.stamp();
        let i = self.node(pos.node).index(pos.abs);
        let mut replaced = None;
        // One search for the cover serves the common cases: a duplicate, or the next
        // block of the slot's run at this tier.
        let mut outcome = None;
        if let Some(c) = self.nodes[pos.node as usize].cover_mut(slot, tier) {
            if c.len() > i {
                if c.engine_hashes[i] != engine_hash {
                    replaced = Some(std::mem::replace(&mut c.engine_hashes[i], engine_hash));
                }
                c.stamp = stamp;
                outcome = Some(false);
            } else if c.len() == i {
                tree::push_sized(&mut c.engine_hashes, engine_hash, rest);
                c.stamp = stamp;
                outcome = Some(true);
            }
        }
        let is_new = match outcome {
            Some(new) => new,
            None if i == 0 => {
                self.covers += 1;
                self.node_mut(pos.node).add_cover(Cover {
                    engine_hashes: vec![engine_hash],
                    stamp,
                    slot,
                    tier,
                });
                true
            }
            _ => {
                // The slot holds a block at this tier without the one before it: the
                // block starts a node of its own, so its cover is a prefix again.
                let (_, tail) = self.split(pos.node, i);
                pos.node = tail;
                self.covers += 1;
                self.node_mut(tail).add_cover(Cover {
                    engine_hashes: vec![engine_hash],
                    stamp,
                    slot,
                    tier,
                });
                true
            }
        };
        self.queue_store(pos.node, stamp, slot, tier);
        if is_new {
            self.live += 1;
            if let Some(state) = self.slot_mut(slot) {
                state.add_entry();
            }
        }
        if let Some(old) = replaced {
            // The entry of the hash it replaced goes after the new one is mapped.
            let pos = self.map_block(slot, pos, engine_hash);
            self.unmap_if_unused(slot, pos, old);
            return (is_new, pos);
        }
        (is_new, self.map_block(slot, pos, engine_hash))
    }

    /// The common case of a store, for one block: the slot's cover at `tier` ends at
    /// `prev`, and the block is the next one of `prev`'s run, either already there (a
    /// prefix others hold) or appended to it (`prev` ends a leaf run). Extends the cover
    /// (and the run) with no search and returns the block's position; `None` (nothing
    /// changed) where `ensure_child` and `hold` must.
    fn extend_cover(
        &mut self,
        slot: u16,
        tier: Tier,
        prev: Pos,
        key: BlockKey,
        engine_hash: u64,
        rest: usize,
    ) -> Option<Pos> {
        let stamp = self.next_stamp.wrapping_add(1);
        let n = self.nodes.get_mut(prev.node as usize)?;
        let len = n.len();
        let next = (prev.abs.checked_sub(n.base)? as usize).checked_add(1)?;
        let append = next == len;
        if next > len
            || (append && (!n.children.is_empty() || n.base as usize + len >= u32::MAX as usize))
            || (!append && n.keys[next] != key)
        {
            return None;
        }
        let cover = n.cover_mut(slot, tier)?;
        if cover.len() != next {
            return None;
        }
        tree::push_sized(&mut cover.engine_hashes, engine_hash, rest);
        cover.stamp = stamp;
        if append {
            tree::push_sized(&mut n.keys, key, rest);
        }
        self.next_stamp = stamp;
        let pos = Pos {
            node: prev.node,
            abs: prev.abs + 1,
        };
        self.queue_store(pos.node, stamp, slot, tier);
        self.live += 1;
        if let Some(state) = self.slot_mut(slot) {
            state.add_entry();
        }
        Some(self.map_block(slot, pos, engine_hash))
    }

    /// Notes in the eviction queue (when it is kept) that `slot` stored into its cover
    /// of `node` at `tier`.
    fn queue_store(&mut self, node: u32, stamp: u32, slot: u16, tier: Tier) {
        if !self.tracking {
            return;
        }
        let item = QueueItem {
            node,
            stamp,
            slot,
            tier,
        };
        // A run stored into one cover needs one item (the last stamp), not one per
        // block.
        match self.queue.back_mut() {
            Some(b) if (b.node, b.slot, b.tier) == (node, slot, tier) => *b = item,
            _ => self.queue.push_back(item),
        }
    }

    /// Maps `engine_hash` to the block at `pos` that `slot` now holds under it, and
    /// returns where that block is afterwards: if the hash meant another block of the
    /// slot before (a reset we did not see), that block is released first, which may
    /// move this one to another node.
    fn map_block(&mut self, slot: u16, pos: Pos, engine_hash: u64) -> Pos {
        let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
            return pos;
        };
        let nodes = &self.nodes;
        let before = state.engine_map.insert(engine_hash, pos, |p| {
            holds_under(nodes, slot, p, engine_hash)
        });
        let Some(elsewhere) = before.filter(|p| *p != pos) else {
            return pos;
        };
        let removed = self.release(slot, elsewhere, |c, i| c.engine_hashes[i] == engine_hash);
        self.stats.removed_blocks += removed as u64;
        self.lookup(slot, engine_hash).unwrap_or(pos)
    }

    /// Drops the slot's map entry for `engine_hash` at `pos` unless one of its tiers
    /// still holds the block under that hash.
    fn unmap_if_unused(&mut self, slot: u16, pos: Pos, engine_hash: u64) {
        if holds_under(&self.nodes, slot, pos, engine_hash) {
            return;
        }
        if let Some(state) = self.slot_mut(slot) {
            state.engine_map.remove_at(engine_hash, pos);
        }
    }

    /// Removes the holders of the block at `pos` that belong to `slot` and that `pred`
    /// selects (given the cover and the block's index in it); keeps the engine-hash map
    /// consistent, splits the node when the block was not the last the slot held at
    /// that tier (a hole), and prunes nodes nobody needs. Returns holders removed.
    fn release(&mut self, slot: u16, pos: Pos, pred: impl Fn(&Cover, usize) -> bool) -> usize {
        let mut node = pos.node;
        let n = self.node(node);
        if !n.is_live() || pos.abs < n.base || n.index(pos.abs) >= n.len() {
            return 0;
        }
        let i = n.index(pos.abs);
        let mut matching = 0;
        let mut beyond = false;
        for c in n.slot_covers(slot).iter().filter(|c| c.len() > i) {
            if pred(c, i) {
                matching += 1;
                beyond |= c.len() > i + 1;
            }
        }
        if matching == 0 {
            return 0;
        }
        if beyond {
            node = self.split(node, i + 1).0;
        }
        let i = self.node(node).index(pos.abs);
        let mut gone: SmallVec<[u64; 2]> = SmallVec::new();
        let mut emptied = false;
        {
            let n = &mut self.nodes[node as usize];
            let range = n.slot_range(slot);
            let mut k = range.start;
            let mut end = range.end;
            while k < end {
                let c = &mut n.covers[k];
                if c.len() == i + 1 && pred(c, i) {
                    if let Some(eh) = c.engine_hashes.pop() {
                        gone.push(eh);
                    }
                    tree::shrink_trimmed(&mut c.engine_hashes);
                    if c.engine_hashes.is_empty() {
                        n.covers.remove(k);
                        self.covers -= 1;
                        emptied = true;
                        end -= 1;
                        continue;
                    }
                }
                k += 1;
            }
        }
        let removed = gone.len();
        self.live -= removed;
        if let Some(state) = self.slot_mut(slot) {
            state.entries -= removed;
        }
        let at = Pos { node, abs: pos.abs };
        for eh in gone {
            self.unmap_if_unused(slot, at, eh);
        }
        if emptied && self.tracking && !self.node(node).slot_present(slot) {
            self.slot_left_child(slot, node);
        }
        self.prune(node);
        removed
    }

    /// The common case of a removal, in bulk: `hashes` are, from the first on, the tip
    /// blocks of the slot's only cover in `pos`'s node, from `pos` back towards the
    /// node's start (an engine frees a request's blocks leaf first). Removes that run
    /// with one trim of the cover and one prune, finding each block after the first
    /// through the cover instead of the engine-hash map, and returns its length; 0 (and
    /// nothing changed) where the case does not apply and [`Self::release`] must.
    fn release_tip_run(
        &mut self,
        slot: u16,
        pos: Pos,
        hashes: &[u64],
        tier: Option<Tier>,
    ) -> usize {
        let node = pos.node;
        let Some(n) = self.nodes.get(node as usize) else {
            return 0;
        };
        if !n.is_live() || pos.abs < n.base {
            return 0;
        }
        let i = n.index(pos.abs);
        let range = n.slot_range(slot);
        // Another tier's cover of the same slot may hold these blocks under the same
        // hashes; the general path sorts that out.
        if range.len() != 1 {
            return 0;
        }
        let at = range.start;
        let cover = &n.covers[at];
        if cover.len() != i + 1 || tier.is_some_and(|t| cover.tier != t) {
            return 0;
        }
        let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
            return 0;
        };
        let mut run = 0;
        // Each block's map entry must name this very block (`remove_at` checks it), as
        // the first's did when it was looked up.
        while run < hashes.len()
            && run <= i
            && cover.engine_hashes[i - run] == hashes[run]
            && state.engine_map.remove_at(
                hashes[run],
                Pos {
                    node,
                    abs: pos.abs - run as u32,
                },
            )
        {
            run += 1;
            // The caller prefetched up to the first block's `PIPELINE`-th successor;
            // keep that distance as the run goes on.
            if let Some(eh) = hashes.get(run + PIPELINE) {
                state.engine_map.touch(*eh);
            }
        }
        if run == 0 {
            return 0;
        }
        state.entries -= run;
        self.live -= run;
        let n = &mut self.nodes[node as usize];
        let cover = &mut n.covers[at];
        cover.engine_hashes.truncate(i + 1 - run);
        tree::shrink_trimmed(&mut cover.engine_hashes);
        if cover.engine_hashes.is_empty() {
            n.covers.remove(at);
            self.covers -= 1;
            if self.tracking {
                self.slot_left_child(slot, node);
            }
        }
        self.prune(node);
        run
    }

    fn clear_slot(&mut self, slot: u16) -> usize {
        let map = match self.slot_mut(slot) {
            Some(state) => {
                state.entries = 0;
                state.applied_seq = None;
                std::mem::take(&mut state.engine_map)
            }
            None => return 0,
        };
        let nodes = self.nodes_holding(&map);
        drop(map);
        let mut removed = 0;
        for id in nodes {
            let n = self.node_mut(id);
            if !n.is_live() {
                continue;
            }
            let before = n.covers.len();
            n.covers.retain(|c| {
                if c.slot == slot {
                    removed += c.len();
                    false
                } else {
                    true
                }
            });
            let gone = before - n.covers.len();
            if gone > 0 {
                self.covers -= gone;
                self.prune(id);
            }
        }
        self.live -= removed;
        removed
    }

    /// Length of the eviction queue (live plus stale items); exposed for memory checks.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    fn slot_ref(&self, slot: u16) -> Option<WorkerRef> {
        self.slot_refs.get(slot as usize).copied().flatten()
    }
}

#[cfg(test)]
mod tests;
