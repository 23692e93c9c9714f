//! dynamo-kv-router events built as its KV-event ingestion builds them (the stored
//! blocks' token ids hashed into its local block hashes), shared by the benchmarks.

use dynamo_kv_router::protocols::{
    compute_block_hash_for_seq, BlockHashOptions, ExternalSequenceBlockHash, KvCacheEvent,
    KvCacheEventData, KvCacheRemoveData, KvCacheStoreData, KvCacheStoredBlockData, RouterEvent,
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
