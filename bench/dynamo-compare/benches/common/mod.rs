//! dynamo-kv-router events built as its KV-event ingestion builds them (the stored
//! blocks' token ids hashed into its local block hashes), and its Flash Indexer; the
//! same events as kvgate's ingestion decodes them. Shared by the benchmarks.

use kvgate_events::wire::{BlockRemoved, BlockStored};
use kvgate_events::{EventBatch, KvEvent};

use dynamo_kv_router::indexer::{
    concurrent_radix_tree_compressed::ConcurrentRadixTreeCompressed, SyncIndexer, ThreadPoolIndexer,
};
use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, LocalBlockHash,
    OverlapScores, RouterEvent,
};

/// A `BlockStored` of `engine_hashes` (whose tokens are `tokens`) under `parent`.
pub fn stored(
    worker: u32,
    id: u64,
    parent: Option<u64>,
    engine_hashes: &[u64],
    tokens: &[u32],
    block_size: u32,
) -> RouterEvent {
    let local = compute_block_hash_for_seq(tokens, block_size, BlockHashOptions::default());
    event(
        worker,
        id,
        KvCacheEventData::Stored(KvCacheStoreData {
            parent_hash: parent.map(ExternalSequenceBlockHash),
            start_position: None,
            blocks: local
                .into_iter()
                .zip(engine_hashes)
                .map(|(tokens_hash, h)| KvCacheStoredBlockData {
                    block_hash: ExternalSequenceBlockHash(*h),
                    tokens_hash,
                    mm_extra_info: None,
                })
                .collect(),
        }),
    )
}

/// The Mooncake workload's `BlockStored` (benches/support) as event number `id`.
#[allow(dead_code)] // memory_churn builds its own
pub fn stored_event(
    ev: &crate::support::mooncake::StoredEvent,
    id: u64,
    block_size: u32,
) -> RouterEvent {
    stored(
        ev.worker,
        id,
        ev.parent,
        &ev.engine_hashes,
        &ev.tokens,
        block_size,
    )
}

/// A `BlockRemoved` of `engine_hashes`, in the order given.
pub fn removed(worker: u32, id: u64, engine_hashes: impl Iterator<Item = u64>) -> RouterEvent {
    event(
        worker,
        id,
        KvCacheEventData::Removed(KvCacheRemoveData {
            block_hashes: engine_hashes.map(ExternalSequenceBlockHash).collect(),
        }),
    )
}

fn event(worker: u32, id: u64, data: KvCacheEventData) -> RouterEvent {
    RouterEvent::new(
        u64::from(worker),
        KvCacheEvent {
            event_id: id,
            dp_rank: 0,
            data,
        },
    )
}

/// Dynamo's production indexer since 1.0, the Flash Indexer: a
/// `ConcurrentRadixTreeCompressed` behind a `ThreadPoolIndexer` whose `threads` OS
/// threads apply events (each worker's events on one thread, in order), while lookups
/// run on the caller's thread against the shared tree.
#[allow(dead_code)] // memory_churn measures the old tree only
pub struct Flash {
    pub index: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    block_size: u32,
    /// Waits for the pool's flush (an async barrier).
    runtime: tokio::runtime::Runtime,
}

#[allow(dead_code)]
impl Flash {
    pub fn new(threads: usize, block_size: u32) -> Self {
        Self {
            index: ThreadPoolIndexer::new(
                ConcurrentRadixTreeCompressed::new(),
                threads,
                block_size,
            ),
            block_size,
            runtime: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a runtime to wait on"),
        }
    }

    /// Hands an event to its worker's thread (applied later).
    pub fn enqueue(&self, event: RouterEvent) {
        self.index
            .enqueue_event(event)
            .expect("the indexer's threads run");
    }

    /// Returns once every event enqueued before is applied.
    pub fn flush(&self) {
        self.runtime
            .block_on(self.index.flush_and_wait())
            .expect("the indexer's threads run");
    }

    /// Hashes `tokens` into local block hashes and finds each worker's overlap, as its
    /// router does per request.
    #[allow(dead_code)] // mixed_load calls the two steps itself, to time them apart
    pub fn lookup(&self, tokens: &[u32]) -> OverlapScores {
        self.find_matches(&self.hash(tokens))
    }

    /// A lookup's first step: `tokens`' local block hashes.
    pub fn hash(&self, tokens: &[u32]) -> Vec<LocalBlockHash> {
        compute_block_hash_for_seq(tokens, self.block_size, BlockHashOptions::default())
    }

    /// A lookup's second step: each worker's overlap with the blocks `local`.
    pub fn find_matches(&self, local: &[LocalBlockHash]) -> OverlapScores {
        self.index.backend().find_matches(local, false)
    }
}

/// The Mooncake workload's `BlockStored` as kvgate's event ingestion decodes it (one
/// event in a batch), for `kvgate_events::apply_batch`.
#[allow(dead_code)] // memory_churn applies to the index directly
pub fn kvgate_stored(ev: &crate::support::mooncake::StoredEvent, block_size: u32) -> EventBatch {
    kvgate_batch(KvEvent::BlockStored(BlockStored {
        block_hashes: ev.engine_hashes.clone(),
        parent_block_hash: ev.parent,
        token_ids: ev.tokens.clone(),
        block_size,
        ..BlockStored::default()
    }))
}

/// A `BlockRemoved` of `engine_hashes` (in that order) as kvgate's ingestion decodes it.
#[allow(dead_code)]
pub fn kvgate_removed(engine_hashes: &[u64]) -> EventBatch {
    kvgate_batch(KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: engine_hashes.to_vec(),
        ..BlockRemoved::default()
    }))
}

fn kvgate_batch(event: KvEvent) -> EventBatch {
    EventBatch {
        events: vec![event],
        ..EventBatch::default()
    }
}
