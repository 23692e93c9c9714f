//! Applying one decoded [`EventBatch`] to the prefix index for one worker rank, and a
//! peer's snapshot of one ([`import_snapshot`]).
//!
//! Owns the filtering rules (which events the router may index), the translation into
//! [`PrefixIndex`] calls, and how long one write section lasts. It must not take locks,
//! log, count into shared metrics or touch sockets: the caller takes the write lock for
//! the batch and turns the returned [`ApplyOutcome`] into metrics and log lines; this
//! module applies the batch in slices of at most [`WRITE_SLICE_BLOCKS`] blocks and
//! lets waiting lookups in between them ([`IndexWriter::let_waiters_in`]: nothing when
//! none waits), so a routing decision never waits for a whole batch; before a slice
//! that could fill a rank's engine-hash map it has the writer make room
//! ([`IndexWriter::make_room`]), so no slice rehashes the map under the lock.
//!
//! Rules:
//! * only group 0 and `full_attention` blocks are indexed, when those fields are present
//!   (sliding-window or mamba groups do not describe a reusable prefix);
//! * blocks carrying extra keys other than their LoRA name (multimodal content, cache
//!   salts, prompt embeddings) are skipped: their token ids do not identify them;
//! * `medium` maps to a tier with [`Tier::from_medium`]; removals apply to that tier;
//! * a block-size mismatch is reported in the outcome (never silently dropped);
//! * a LoRA block known only by `lora_id` is keyed under a synthetic `lora-id:N` name so
//!   it can never match base-model requests.

use kvgate_core::index::StoreError;
use kvgate_core::{PrefixIndex, SnapshotImport, StoredBlocks, Tier, WorkerRef, WRITE_SLICE_BLOCKS};

use crate::wire::{BlockRemoved, BlockStored, EventBatch, KvEvent};

/// What applying one batch did. All counts are events unless named `blocks`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// Events that changed (or refreshed) the index.
    pub events_applied: u64,
    /// Blocks newly held (stores that were duplicates are not counted).
    pub blocks_stored: u64,
    /// Duplicate stores (block already held at that tier).
    pub blocks_refreshed: u64,
    /// Holder entries removed by `BlockRemoved`.
    pub blocks_removed: u64,
    /// Removed hashes this rank was not known to hold.
    pub unknown_removals: u64,
    /// `AllBlocksCleared` events (entries removed in `cleared_entries`).
    pub clears: u64,
    pub cleared_entries: u64,
    /// Entries the index evicted to stay under its cap.
    pub evicted: u64,
    /// Events for another KV-cache group or a non-full-attention spec.
    pub skipped_group: u64,
    /// Stores with multimodal / salted / embedding extra keys.
    pub skipped_extra_keys: u64,
    /// Stores whose parent block is unknown (its store was missed or skipped).
    pub unknown_parents: u64,
    /// Stores whose token count is not `blocks × block_size`.
    pub token_count_mismatches: u64,
    /// Stores rejected because the engine's block size differs from the index's.
    pub block_size_mismatches: u64,
    /// The last mismatching engine block size seen in this batch.
    pub mismatched_block_size: Option<u32>,
    /// Unknown event types the decoder skipped.
    pub unknown_events: u64,
}

impl ApplyOutcome {
    /// Adds another outcome's counts to this one.
    pub fn merge(&mut self, o: &ApplyOutcome) {
        self.events_applied += o.events_applied;
        self.blocks_stored += o.blocks_stored;
        self.blocks_refreshed += o.blocks_refreshed;
        self.blocks_removed += o.blocks_removed;
        self.unknown_removals += o.unknown_removals;
        self.clears += o.clears;
        self.cleared_entries += o.cleared_entries;
        self.evicted += o.evicted;
        self.skipped_group += o.skipped_group;
        self.skipped_extra_keys += o.skipped_extra_keys;
        self.unknown_parents += o.unknown_parents;
        self.token_count_mismatches += o.token_count_mismatches;
        self.block_size_mismatches += o.block_size_mismatches;
        if o.mismatched_block_size.is_some() {
            self.mismatched_block_size = o.mismatched_block_size;
        }
        self.unknown_events += o.unknown_events;
    }
}

/// What a batch is applied to: an index of one's own, or a shared index under its
/// write guard ([`crate::IndexWriteGuard`]), which lets waiting lookups in between
/// slices.
pub trait IndexWriter {
    fn index(&mut self) -> &mut PrefixIndex;

    /// Lets threads waiting to read the index go first (nothing for an unshared one).
    fn let_waiters_in(&mut self) {}

    /// Before `blocks` blocks are stored for `at`: grows the rank's engine-hash map
    /// if they could fill it, off the write lock where the index is shared
    /// ([`PrefixIndex::grow_ahead`]); nothing for an unshared one (the store grows it).
    fn make_room(&mut self, _at: WorkerRef, _blocks: usize) {}
}

impl IndexWriter for PrefixIndex {
    fn index(&mut self) -> &mut PrefixIndex {
        self
    }
}

/// Applies every event of `batch` to the index as held by `at`, in order, letting
/// waiting lookups in whenever a slice's worth of blocks ([`WRITE_SLICE_BLOCKS`]) was
/// applied since they last could.
pub fn apply_batch(
    index: &mut impl IndexWriter,
    at: WorkerRef,
    batch: &EventBatch,
) -> ApplyOutcome {
    let mut out = ApplyOutcome {
        unknown_events: batch.unknown_events as u64,
        ..ApplyOutcome::default()
    };
    let mut section = Section {
        writer: index,
        blocks: 0,
    };
    for event in &batch.events {
        match event {
            KvEvent::BlockStored(e) => apply_stored(&mut section, at, e, &mut out),
            KvEvent::BlockRemoved(e) => apply_removed(&mut section, at, e, &mut out),
            KvEvent::AllBlocksCleared => {
                out.clears += 1;
                out.events_applied += 1;
                // One write section however much the rank held (1.1-1.5 ms at a quarter
                // of a million blocks): an engine reset is rare (DESIGN.md section 2).
                let index = section.for_blocks(WRITE_SLICE_BLOCKS);
                out.cleared_entries += index.clear(at) as u64;
            }
        }
    }
    out
}

/// Replaces what `at` holds with a peer's snapshot of it, prepared beforehand (off the
/// lock: [`SnapshotImport::new`]), placed like a batch: [`WRITE_SLICE_BLOCKS`] blocks
/// at a time, with waiting lookups let in between and the rank's engine-hash map grown
/// once, for all it will hold, off the write lock. Returns the blocks held.
pub fn import_snapshot(
    index: &mut impl IndexWriter,
    at: WorkerRef,
    import: &mut SnapshotImport<'_>,
) -> usize {
    while !index.index().import_some(at, import, WRITE_SLICE_BLOCKS) {
        index.make_room(at, import.remaining());
        index.let_waiters_in();
    }
    import.held()
}

/// A batch's write section, cut into slices.
struct Section<'s, W: IndexWriter> {
    writer: &'s mut W,
    /// Blocks applied since waiting lookups last could go.
    blocks: usize,
}

impl<W: IndexWriter> Section<'_, W> {
    /// The index, to apply `blocks` more blocks: first yields the lock to waiting
    /// readers if that would take this slice past [`WRITE_SLICE_BLOCKS`].
    fn for_blocks(&mut self, blocks: usize) -> &mut PrefixIndex {
        if self.blocks > 0 && self.blocks + blocks > WRITE_SLICE_BLOCKS {
            self.writer.let_waiters_in();
            self.blocks = 0;
        }
        self.blocks += blocks;
        self.writer.index()
    }

    /// The index, to store `blocks` more blocks for `at`: as [`Self::for_blocks`],
    /// with room made in the rank's engine-hash map first ([`IndexWriter::make_room`]).
    fn for_stored(&mut self, at: WorkerRef, blocks: usize) -> &mut PrefixIndex {
        self.for_blocks(blocks);
        self.writer.make_room(at, blocks);
        self.writer.index()
    }
}

fn indexable_group(group_idx: Option<u32>, spec_kind: Option<&str>) -> bool {
    group_idx.is_none_or(|g| g == 0) && spec_kind.is_none_or(|k| k == "full_attention")
}

fn apply_stored(
    section: &mut Section<'_, impl IndexWriter>,
    at: WorkerRef,
    e: &BlockStored,
    out: &mut ApplyOutcome,
) {
    if !indexable_group(e.group_idx, e.kv_cache_spec_kind.as_deref()) {
        out.skipped_group += 1;
        return;
    }
    if e.cache_salt.is_some() || e.has_foreign_extra_keys() {
        out.skipped_extra_keys += 1;
        return;
    }
    let synthetic;
    let lora_name = match (e.lora_name.as_deref(), e.lora_id) {
        (Some(name), _) if !name.is_empty() => Some(name),
        (_, Some(id)) if id > 0 => {
            synthetic = format!("lora-id:{id}");
            Some(synthetic.as_str())
        }
        _ => None,
    };
    let blocks = StoredBlocks {
        engine_hashes: &e.block_hashes,
        parent_engine_hash: e.parent_block_hash,
        token_ids: &e.token_ids,
        block_size: e.block_size,
        tier: Tier::from_medium(e.medium.as_deref()),
        lora_name,
        blocks_after: 0,
    };
    for slice in blocks.slices(WRITE_SLICE_BLOCKS) {
        let index = section.for_stored(at, slice.engine_hashes.len());
        match index.apply_stored(at, &slice) {
            Ok(o) => {
                out.blocks_stored += o.inserted as u64;
                out.blocks_refreshed += o.duplicates as u64;
                out.evicted += o.evicted as u64;
            }
            // A later slice finds its parent unless the cap evicted it in between.
            Err(e) => {
                match e {
                    StoreError::BlockSizeMismatch { got, .. } => {
                        out.block_size_mismatches += 1;
                        out.mismatched_block_size = Some(got);
                    }
                    StoreError::TokenCountMismatch { .. } => out.token_count_mismatches += 1,
                    StoreError::UnknownParent { .. } => out.unknown_parents += 1,
                }
                return;
            }
        }
    }
    out.events_applied += 1;
}

fn apply_removed(
    section: &mut Section<'_, impl IndexWriter>,
    at: WorkerRef,
    e: &BlockRemoved,
    out: &mut ApplyOutcome,
) {
    if !indexable_group(e.group_idx, None) {
        out.skipped_group += 1;
        return;
    }
    let tier = Tier::from_medium(e.medium.as_deref());
    for hashes in e.block_hashes.chunks(WRITE_SLICE_BLOCKS) {
        let o = section
            .for_blocks(hashes.len())
            .apply_removed(at, hashes, Some(tier));
        out.blocks_removed += o.removed as u64;
        out.unknown_removals += o.unknown as u64;
    }
    out.events_applied += 1;
}
