//! Plain-data KV cache events produced by the simulation core.
//!
//! Owns the event vocabulary (what the cache reports) only. It must not know about
//! msgpack, ZeroMQ or time: encoding lives in `wire`, publishing in `kv_publisher`.

use serde::{Deserialize, Serialize};

/// One change to the engine's prefix cache, in the order it happened.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum KvEvent {
    /// Consecutive full blocks of one request became cached. `token_ids` holds all
    /// tokens of those blocks, concatenated; `parent_block_hash` is the engine hash of
    /// the block before the first one (None for a prompt's first block).
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    },
    /// Cached blocks were evicted (vLLM reports one block per event; so do we).
    BlockRemoved { block_hashes: Vec<u64> },
    /// The whole prefix cache was dropped (POST /reset_prefix_cache).
    AllBlocksCleared,
}
