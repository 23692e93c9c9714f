//! The prefix index: which worker rank holds which block keys, at which tier.
//!
//! Owns the per-model map from block key to holders, each worker rank's map from the
//! engine's opaque block hash to our key (so `BlockRemoved` can be applied), and the
//! eviction queue that bounds memory. It must not parse wire formats, talk to engines or
//! know about load: event ingestion translates events into these calls, and policies
//! only read [`PrefixIndex::overlaps`].
//!
//! # Layout
//! A flat hash table of block entries keyed by `BlockKey` (`block_table.rs`). Because a
//! key is chained with its parent, a flat table answers prefix questions as well as a
//! radix tree while keeping inserts and removals O(1) and independent of the order
//! engines evict blocks in (a parent removed before its child simply ends the matched
//! run earlier). Each entry (`entry.rs`) carries bitsets of the slots (worker ranks)
//! that hold it, its holders, its parent's key, and per slot the number of its children
//! that slot holds; the common case fits in one 64-byte cache line, so the event path
//! pays one cache miss per block in this table. Events look a chunk of blocks up before
//! applying them, so those misses overlap instead of stalling one after another, and a
//! removal looks each entry up once: a leaf-first run (the order engines evict in)
//! settles a parent's child count on the lookup that removes the parent itself.
//!
//! # Lookup by binary search
//! A block can only be stored with a parent the same rank holds, so a rank normally
//! holds a *closed prefix set*: if it holds a request's block `i` it holds blocks
//! `0..=i`, and its run length is found by binary search over the request's keys
//! (shared by all ranks: they are split at each probe), about `log2(blocks)` probes
//! instead of one per matched block. Two per-rank counters say when that shortcut is
//! exact: `orphans` (blocks the rank no longer holds although it still holds children
//! of them, e.g. an engine removed a parent first: a *hole*) and `lower_only` (blocks
//! held only on host/disk, which need a per-block tier count). A rank with either
//! non-zero is answered by the exact linear walk; holes heal (and the rank returns to
//! binary search) once the orphaned children are removed too, or on a clear.
//!
//! # Memory bound and eviction rule
//! The index holds at most [`IndexConfig::max_blocks`] holder entries (one per block,
//! worker rank and tier). Engines normally keep it far below that by reporting their
//! own evictions; the cap is the backstop for lost removals. When an insert exceeds the
//! cap, entries are evicted in the order they were last stored (oldest first), with a
//! second chance (CLOCK) for blocks that a lookup matched since they were last looked
//! at: those are moved to the back of the queue once. Eviction removes leaves only: a
//! rank's last entry for a block whose children that rank still holds is skipped, and
//! goes back to the front of the queue when its last held child goes, so eviction
//! never creates a hole (it trims branches from their tips, as engines do). The
//! eviction queue is only kept while the index is near its cap: it is built on demand
//! (holders sorted by store stamp) when the cap is first exceeded, compacted whenever
//! stale items outnumber live ones, and dropped again once the index falls below half
//! the cap, so the common case (engines reporting their own evictions) pays nothing for
//! it and no structure only grows. Under churn at the cap (live count flat, blocks
//! arriving and leaving) the hash tables would fill with deleted slots and double;
//! they are rebuilt at their size instead (`table_size.rs`).

mod block_table;
mod entry;
mod evict;
mod links;
mod query;
pub(crate) mod slot_bits;
mod table_size;

use std::collections::hash_map::Entry as HashMapEntry;
use std::collections::VecDeque;

use rustc_hash::FxHashMap;
use serde::Serialize;
use smallvec::SmallVec;

use block_table::BlockTable;
use entry::{BlockEntry, Holder};
use links::{held_block_lost_child, orphan_child_left};
pub use query::{Overlap, OverlapScores};
use table_size::TableSize;

use crate::hashing::{BlockHasher, BlockKey};
use crate::ids::{Tier, WorkerId, WorkerRef};

/// Limits of one model's index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexConfig {
    /// Maximum number of (block, worker rank, tier) entries kept. Memory: a 64-byte
    /// entry per distinct block and 16 bytes per entry in the engine-hash map, each up
    /// to twice that with hash-table slack, plus a small spill allocation for blocks
    /// held by several ranks.
    pub max_blocks: usize,
}

impl Default for IndexConfig {
    fn default() -> Self {
        Self {
            max_blocks: 4_000_000,
        }
    }
}

/// One block a worker rank holds, as an index snapshot carries it: its key and parent
/// (to rebuild the entry) and the engine's hash (to apply the engine's later events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldBlock {
    pub key: BlockKey,
    pub parent: Option<BlockKey>,
    pub engine_hash: u64,
    pub tier: Tier,
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
    at: WorkerRef,
    engine_to_key: FxHashMap<u64, BlockKey>,
    /// Tells deleted slots in `engine_to_key` from growth (see `table_size.rs`).
    engine_to_key_size: TableSize,
    entries: usize,
    /// Blocks this slot does not hold although it holds children of them (holes), with
    /// the number of such children. Empty: the slot holds closed prefix sets.
    orphans: FxHashMap<BlockKey, u32>,
    /// Blocks this slot holds at some tier but not on the device tier.
    lower_only: usize,
    /// The last engine event sequence number the slot's entries reflect (set by the
    /// caller that applies the events), so a snapshot says where to continue from.
    applied_seq: Option<u64>,
}

impl SlotState {
    fn new(at: WorkerRef) -> Self {
        Self {
            at,
            engine_to_key: FxHashMap::default(),
            engine_to_key_size: TableSize::default(),
            entries: 0,
            orphans: FxHashMap::default(),
            lower_only: 0,
            applied_seq: None,
        }
    }

    /// Records that the slot holds its engine's block `engine_hash` as `key`; returns
    /// what the hash meant before. Rebuilds the map at its size first when only deleted
    /// slots would make it grow.
    fn map_engine_hash(&mut self, engine_hash: u64, key: BlockKey) -> Option<BlockKey> {
        let map = &mut self.engine_to_key;
        if self
            .engine_to_key_size
            .must_rebuild(map.len(), map.capacity())
            && !map.contains_key(&engine_hash)
        {
            let mut fresh = FxHashMap::with_capacity_and_hasher(
                self.engine_to_key_size.full(),
                Default::default(),
            );
            fresh.extend(std::mem::take(map));
            *map = fresh;
        }
        map.insert(engine_hash, key)
    }

    /// Whether binary search over a request's keys gives this slot's exact overlap.
    fn searchable(&self) -> bool {
        self.orphans.is_empty() && self.lower_only == 0
    }

    /// Accounts a change of the slot's membership of one block.
    fn membership_changed(&mut self, before: (bool, bool), after: (bool, bool)) {
        let lower = |(any, device): (bool, bool)| any && !device;
        match (lower(before), lower(after)) {
            (false, true) => self.lower_only += 1,
            (true, false) => self.lower_only -= 1,
            _ => {}
        }
    }
}

/// What one `remove_holders_owing` did.
#[derive(Clone, Copy, Debug, Default)]
struct Removal {
    removed: usize,
    /// The parent that lost a child because the slot left this block; its child count
    /// is still to be updated.
    left_parent: Option<BlockKey>,
}

#[derive(Clone, Copy, Debug)]
struct QueueItem {
    key: BlockKey,
    stamp: u32,
    slot: u16,
    tier: Tier,
}

/// Blocks of an event looked up together before they are applied (see `warm`).
const PIPELINE: usize = 32;

/// Maximum number of worker ranks one index tracks at once.
pub const MAX_SLOTS: usize = u16::MAX as usize;

/// One model's prefix index. Not internally synchronized: wrap it in a lock to share.
#[derive(Debug)]
pub struct PrefixIndex {
    hasher: BlockHasher,
    config: IndexConfig,
    blocks: BlockTable,
    slots: Vec<Option<SlotState>>,
    slot_of: FxHashMap<WorkerRef, u16>,
    free_slots: Vec<u16>,
    queue: VecDeque<QueueItem>,
    /// Whether `queue` is maintained (only near the cap).
    tracking: bool,
    /// The last (slot, block) whose membership a removal ended, while no block has
    /// been entered since: lets a root-first removal of a chain skip looking up the
    /// parent it has just removed.
    last_left: Option<(u16, BlockKey)>,
    next_stamp: u32,
    live: usize,
    stats: IndexStats,
}

impl PrefixIndex {
    pub fn new(hasher: BlockHasher, config: IndexConfig) -> Self {
        Self {
            hasher,
            config,
            blocks: BlockTable::default(),
            slots: Vec::new(),
            slot_of: FxHashMap::default(),
            free_slots: Vec::new(),
            queue: VecDeque::new(),
            tracking: false,
            last_left: None,
            next_stamp: 0,
            live: 0,
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

    /// Number of distinct block keys held by anyone.
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
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
        let mut out = vec![0usize; workers.len()];
        for state in self.slots.iter().flatten() {
            if let Some(i) = workers.iter().position(|w| *w == state.at.worker) {
                out[i] += state.entries;
            }
        }
        out
    }

    /// Every (key, tier) one worker rank holds, sorted; for accuracy checks and debugging.
    pub fn worker_blocks(&self, at: WorkerRef) -> Vec<(BlockKey, Tier)> {
        let Some(&slot) = self.slot_of.get(&at) else {
            return Vec::new();
        };
        let Some(state) = self.slot(slot) else {
            return Vec::new();
        };
        let mut out: Vec<(BlockKey, Tier)> = Vec::new();
        for key in state.engine_to_key.values() {
            if let Some(entry) = self.blocks.get(key) {
                out.extend(
                    entry
                        .holders()
                        .filter(|h| h.slot == slot)
                        .map(|h| (*key, h.tier)),
                );
            }
        }
        out.sort();
        out.dedup();
        out
    }

    /// Every block one worker rank holds, for an index snapshot another router loads
    /// ([`Self::import_worker`]): key, parent and engine hash per tier held, sorted by
    /// key.
    pub fn export_worker(&self, at: WorkerRef) -> Vec<HeldBlock> {
        let Some(&slot) = self.slot_of.get(&at) else {
            return Vec::new();
        };
        let Some(state) = self.slot(slot) else {
            return Vec::new();
        };
        let mut keys: Vec<BlockKey> = state.engine_to_key.values().copied().collect();
        keys.sort();
        keys.dedup();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(entry) = self.blocks.get(&key) {
                out.extend(
                    entry
                        .holders()
                        .filter(|h| h.slot == slot)
                        .map(|h| HeldBlock {
                            key,
                            parent: entry.parent(),
                            engine_hash: h.engine_hash,
                            tier: h.tier,
                        }),
                );
            }
        }
        out
    }

    /// Replaces what one worker rank holds with a snapshot of it (from
    /// [`Self::export_worker`], usually another router's): the rank's entries are
    /// cleared, then each block is held as if its `BlockStored` had been applied, so
    /// the engine's later events (removals by engine hash, stores naming a parent)
    /// apply as they would have. Returns the blocks now held; the cap is enforced.
    pub fn import_worker(&mut self, at: WorkerRef, blocks: &[HeldBlock]) -> usize {
        self.clear(at);
        let Some(slot) = self.slot_for(at) else {
            return 0;
        };
        let mut held = 0;
        for b in blocks {
            if self.insert_holder(slot, b.key, b.parent, b.engine_hash, b.tier) {
                held += 1;
            }
        }
        self.stats.stored_blocks += held as u64;
        self.enforce_cap();
        held
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
        self.slot_state(at)
            .and_then(|s| s.engine_to_key.get(&engine_hash).copied())
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
        let mut parent = match blocks.parent_engine_hash {
            None => None,
            Some(p) => match self.slot(slot).and_then(|s| s.engine_to_key.get(&p)) {
                Some(key) => Some(*key),
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
        let mut keys: SmallVec<[BlockKey; PIPELINE]> = SmallVec::new();
        for (hashes, tokens) in blocks
            .engine_hashes
            .chunks(PIPELINE)
            .zip(blocks.token_ids.chunks(PIPELINE * block_size as usize))
        {
            keys.clear();
            let mut last = parent;
            for block in tokens.chunks_exact(block_size as usize) {
                let key = hasher.chain(last, block);
                keys.push(key);
                last = Some(key);
            }
            self.warm(slot, hashes, &keys);
            for (engine_hash, &key) in hashes.iter().zip(&keys) {
                if self.insert_holder(slot, key, parent, *engine_hash, blocks.tier) {
                    outcome.inserted += 1;
                } else {
                    outcome.duplicates += 1;
                }
                parent = Some(key);
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
        // Resolve every hash first: the lookups are independent, so their cache misses
        // overlap instead of each one stalling the dependent work below.
        let keys: SmallVec<[Option<BlockKey>; 64]> = match self.slot(slot) {
            Some(s) => engine_hashes
                .iter()
                .map(|eh| {
                    let key = s.engine_to_key.get(eh).copied();
                    if let Some(k) = key {
                        // Touch the entry too, so its miss overlaps the others'.
                        std::hint::black_box(self.blocks.contains_key(&k));
                    }
                    key
                })
                .collect(),
            None => SmallVec::from_elem(None, engine_hashes.len()),
        };
        // Engines usually remove a chain leaf first, so the block a removal takes a child
        // from is the next one removed: that child count is then settled together with
        // the next removal, on the entry it looks up anyway (`owes_child`; it is only set
        // when the next key is that parent).
        let mut owes_child = false;
        for (i, &engine_hash) in engine_hashes.iter().enumerate() {
            let removal = match keys[i] {
                Some(key) => self.remove_holders_owing(
                    slot,
                    key,
                    |h| h.engine_hash == engine_hash && tier.is_none_or(|t| h.tier == t),
                    owes_child,
                ),
                None => Removal::default(),
            };
            owes_child = false;
            if let Some(parent) = removal.left_parent {
                if keys.get(i + 1).copied().flatten() == Some(parent) {
                    owes_child = true;
                } else {
                    self.child_removed(slot, parent);
                }
            }
            if removal.removed == 0 {
                outcome.unknown += 1;
            }
            outcome.removed += removal.removed;
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
            self.free_slots.push(slot);
        }
        self.stats.workers_removed += 1;
        removed
    }

    /// Looks up a chunk's engine hashes and keys before they are applied. The lookups
    /// are independent, so the CPU overlaps their cache misses; the dependent updates
    /// that follow then find the lines in cache.
    fn warm(&self, slot: u16, engine_hashes: &[u64], keys: &[BlockKey]) {
        let mut found = 0usize;
        if let Some(state) = self.slot(slot) {
            for eh in engine_hashes {
                found += usize::from(state.engine_to_key.contains_key(eh));
            }
        }
        for key in keys {
            found += usize::from(self.blocks.contains_key(key));
        }
        std::hint::black_box(found);
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
                (self.slots.len() - 1) as u16
            }
            None => return None,
        };
        self.slots[slot as usize] = Some(SlotState::new(at));
        self.slot_of.insert(at, slot);
        Some(slot)
    }

    fn stamp(&mut self) -> u32 {
        self.next_stamp = self.next_stamp.wrapping_add(1);
        self.next_stamp
    }

    /// Records that `slot` holds `key` (child of `parent`) at `tier` under
    /// `engine_hash`. Returns whether the holder is new (false: a duplicate store,
    /// refreshed).
    fn insert_holder(
        &mut self,
        slot: u16,
        key: BlockKey,
        parent: Option<BlockKey>,
        engine_hash: u64,
        tier: Tier,
    ) -> bool {
        // One map operation: record the new mapping and learn what it meant before.
        let previous = self
            .slot_mut(slot)
            .and_then(|s| s.map_engine_hash(engine_hash, key));
        if let Some(old_key) = previous.filter(|k| *k != key) {
            // The engine hash meant another block before (a reset we did not see).
            let removed = self.remove_holders(slot, old_key, |h| h.engine_hash == engine_hash);
            self.stats.removed_blocks += removed as u64;
        }
        let stamp = self.stamp();
        let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
            return false;
        };
        let entry = self.blocks.get_or_insert(key, parent);
        let before = (entry.holds(slot), entry.holds_on_device(slot));
        let mut stale_engine_hash = None;
        let is_new = match entry
            .holders_mut()
            .find(|h| h.slot == slot && h.tier == tier)
        {
            Some(h) => {
                if h.engine_hash != engine_hash {
                    stale_engine_hash = Some(h.engine_hash);
                    h.engine_hash = engine_hash;
                }
                h.stamp = stamp;
                false
            }
            None => true,
        };
        let mut entered_parent = None;
        if is_new {
            entry.push_holder(Holder {
                engine_hash,
                stamp,
                slot,
                tier,
            });
            entry.mark(slot, tier == Tier::Device);
            self.live += 1;
            state.entries += 1;
            state.membership_changed(before, (true, before.1 || tier == Tier::Device));
            if !before.0 {
                // The slot now holds the block: adopt children it held while it did not,
                // and count the block as a child of its parent.
                if !state.orphans.is_empty() {
                    if let Some(n) = state.orphans.remove(&key) {
                        entry.add_children(slot, n);
                    }
                }
                entered_parent = entry.parent();
                self.last_left = None;
            }
        }
        if let Some(old) = stale_engine_hash {
            let still_used = entry
                .holders()
                .any(|h| h.slot == slot && h.engine_hash == old);
            if !still_used && state.engine_to_key.get(&old) == Some(&key) {
                state.engine_to_key.remove(&old);
            }
        }
        if self.tracking {
            self.queue.push_back(QueueItem {
                key,
                stamp,
                slot,
                tier,
            });
        }
        if let Some(parent) = entered_parent {
            self.child_added(slot, parent);
        }
        is_new
    }

    /// Removes the holders of `key` that belong to `slot` and match `pred`; keeps the
    /// slot's engine-hash map, child counts and holes consistent and drops the entry
    /// when nobody holds it.
    fn remove_holders(
        &mut self,
        slot: u16,
        key: BlockKey,
        pred: impl Fn(&Holder) -> bool,
    ) -> usize {
        let removal = self.remove_holders_owing(slot, key, pred, false);
        if let Some(parent) = removal.left_parent {
            self.child_removed(slot, parent);
        }
        removal.removed
    }

    /// [`Self::remove_holders`] without the parent's child count, which is left to the
    /// caller (`left_parent`); with `owed_child`, first does `child_removed(slot, key)`
    /// on the entry it looks up anyway.
    fn remove_holders_owing(
        &mut self,
        slot: u16,
        key: BlockKey,
        pred: impl Fn(&Holder) -> bool,
        owed_child: bool,
    ) -> Removal {
        // One lookup serves the update and, when nobody holds the block any more, its
        // removal.
        let Some(mut found) = self.blocks.find_entry(&key) else {
            if owed_child {
                self.child_removed(slot, key);
            }
            return Removal::default();
        };
        let entry = found.get_mut();
        if owed_child {
            if entry.holds(slot) {
                let queue = self.tracking.then_some(&mut self.queue);
                held_block_lost_child(entry, key, slot, &mut self.next_stamp, queue);
            } else if let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) {
                orphan_child_left(state, key);
            }
        }
        let before = (entry.holds(slot), entry.holds_on_device(slot));
        let mut gone: SmallVec<[u64; 2]> = SmallVec::new();
        entry.remove_holders(|h| h.slot == slot && pred(h), |h| gone.push(h.engine_hash));
        if gone.is_empty() {
            return Removal::default();
        }
        let after = entry.refresh_membership(slot);
        let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
            return Removal::default();
        };
        let mut left_parent = None;
        if before.0 && !after.0 {
            // The slot no longer holds the block: children it still holds become
            // orphans (a hole), and the parent loses a child.
            let children = entry.take_children(slot);
            if children > 0 {
                state.orphans.insert(key, children);
            }
            left_parent = entry.parent();
        }
        let left = before.0 && !after.0;
        state.membership_changed(before, after);
        for eh in &gone {
            let mapped = entry
                .holders()
                .any(|h| h.slot == slot && h.engine_hash == *eh);
            if !mapped {
                if let HashMapEntry::Occupied(o) = state.engine_to_key.entry(*eh) {
                    if *o.get() == key {
                        o.remove();
                    }
                }
            }
        }
        if !entry.has_holders() {
            found.remove();
        }
        let removed = gone.len();
        self.live -= removed;
        state.entries -= removed;
        if left {
            self.last_left = Some((slot, key));
        }
        Removal {
            removed,
            left_parent,
        }
    }

    fn clear_slot(&mut self, slot: u16) -> usize {
        let keys: Vec<BlockKey> = match self.slot_mut(slot) {
            Some(state) => {
                // Every block of the slot goes, so its child counts and holes do too.
                state.orphans = FxHashMap::default();
                state.lower_only = 0;
                state.entries = 0;
                state.applied_seq = None;
                state.engine_to_key.drain().map(|(_, k)| k).collect()
            }
            None => return 0,
        };
        let mut removed = 0;
        for key in keys {
            let Some(entry) = self.blocks.get_mut(&key) else {
                continue;
            };
            entry.remove_holders(|h| h.slot == slot, |_| removed += 1);
            entry.refresh_membership(slot);
            entry.take_children(slot);
            if !entry.has_holders() {
                self.blocks.remove(&key);
            }
        }
        self.live -= removed;
        removed
    }

    /// Length of the eviction queue (live plus stale items); exposed for memory checks.
    pub fn queue_len(&self) -> usize {
        self.queue.len()
    }

    fn entry(&self, key: &BlockKey) -> Option<&BlockEntry> {
        self.blocks.get(key)
    }

    fn slot_ref(&self, slot: u16) -> Option<WorkerRef> {
        self.slot(slot).map(|s| s.at)
    }
}

#[cfg(test)]
mod tests;
