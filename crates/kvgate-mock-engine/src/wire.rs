//! The vLLM 0.32 wire format of KV event batches: msgpack, map-encoded events.
//!
//! Owns byte layout only (what vLLM's `ZmqEventPublisher` puts in a payload frame and
//! the sequence-number frame). It is written independently of kvgate's decoder: the
//! mock engine plays vLLM. No sockets here; `kv_publisher` sends what this builds.
//!
//! A payload is the array `[ts (float64), [event, ...], dp_rank]`. Events are maps whose
//! first key is `"type"`, with the exact field set and order of vLLM 0.32:
//! `BlockStored {block_hashes, parent_block_hash, token_ids, block_size, lora_id,
//! medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind}`,
//! `BlockRemoved {block_hashes, medium, group_idx}`, `AllBlocksCleared {}`.

use serde::Serialize;

use crate::events::KvEvent;

/// Storage tier reported in events (the simulated cache is device memory).
pub const MEDIUM_GPU: &str = "GPU";
/// The only KV cache spec the simulated engine has.
pub const SPEC_FULL_ATTENTION: &str = "full_attention";
/// Sequence number that ends a replay answer (-1 as 8 bytes, all 0xFF).
pub const REPLAY_END_SEQ: [u8; 8] = [0xFF; 8];

#[derive(Serialize)]
#[serde(tag = "type")]
enum WireEvent<'a> {
    BlockStored {
        block_hashes: &'a [u64],
        parent_block_hash: Option<u64>,
        token_ids: &'a [u32],
        block_size: u32,
        lora_id: Option<u64>,
        medium: &'static str,
        lora_name: Option<&'static str>,
        extra_keys: Vec<Option<u8>>,
        group_idx: u32,
        kv_cache_spec_kind: &'static str,
    },
    BlockRemoved {
        block_hashes: &'a [u64],
        medium: &'static str,
        group_idx: u32,
    },
    AllBlocksCleared {},
}

impl<'a> From<&'a KvEvent> for WireEvent<'a> {
    fn from(e: &'a KvEvent) -> Self {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
            } => WireEvent::BlockStored {
                block_hashes,
                parent_block_hash: *parent_block_hash,
                token_ids,
                block_size: *block_size,
                lora_id: None,
                medium: MEDIUM_GPU,
                lora_name: None,
                extra_keys: vec![None; block_hashes.len()],
                group_idx: 0,
                kv_cache_spec_kind: SPEC_FULL_ATTENTION,
            },
            KvEvent::BlockRemoved { block_hashes } => WireEvent::BlockRemoved {
                block_hashes,
                medium: MEDIUM_GPU,
                group_idx: 0,
            },
            KvEvent::AllBlocksCleared => WireEvent::AllBlocksCleared {},
        }
    }
}

/// Encode one event batch as vLLM 0.32 does: `[ts, [events], dp_rank]`.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    dp_rank: u32,
) -> Result<Vec<u8>, rmp_serde::encode::Error> {
    let wire: Vec<WireEvent<'_>> = events.iter().map(WireEvent::from).collect();
    rmp_serde::to_vec_named(&(ts, wire, dp_rank))
}

/// The sequence-number frame: u64 big-endian.
pub fn seq_frame(seq: u64) -> [u8; 8] {
    seq.to_be_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleared_matches_vllm_bytes() {
        let bytes = encode_batch(1.5, &[KvEvent::AllBlocksCleared], 0).unwrap();
        let mut expected = vec![0x93, 0xcb];
        expected.extend_from_slice(&1.5f64.to_be_bytes());
        expected.extend_from_slice(&[0x91, 0x81, 0xa4]);
        expected.extend_from_slice(b"type");
        expected.push(0xb0);
        expected.extend_from_slice(b"AllBlocksCleared");
        expected.push(0x00);
        assert_eq!(bytes, expected);
    }
}
