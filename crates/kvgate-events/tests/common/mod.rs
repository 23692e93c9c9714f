//! Shared test helpers: fixture loading and payload builders.
#![allow(dead_code)]

use std::path::PathBuf;

use rmpv::Value;

pub fn fixture(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/vllm-0.32")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A fixture file: a msgpack array of messages, each an array of binary frames.
pub fn frames_of(name: &str) -> Vec<Vec<Vec<u8>>> {
    let bytes = fixture(name);
    let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| {
            m.as_array()
                .unwrap()
                .iter()
                .map(|f| match f {
                    Value::Binary(b) => b.clone(),
                    Value::String(s) => s.as_bytes().to_vec(),
                    other => panic!("frame is {other:?}"),
                })
                .collect()
        })
        .collect()
}

pub fn seq_of(frame: &[u8]) -> u64 {
    u64::from_be_bytes(frame.try_into().unwrap())
}

/// `(seq, payload)` of the live PUB captures.
pub fn pub_messages() -> Vec<(u64, Vec<u8>)> {
    frames_of("vllm-0.32-pub-frames.msgpack")
        .into_iter()
        .map(|f| {
            assert_eq!(f.len(), 3);
            assert_eq!(f[0], b"kv");
            (seq_of(&f[1]), f[2].clone())
        })
        .collect()
}

pub fn clear_messages() -> Vec<(u64, Vec<u8>)> {
    frames_of("vllm-0.32-pub-frames-clear.msgpack")
        .into_iter()
        .map(|f| (seq_of(&f[1]), f[2].clone()))
        .collect()
}

pub fn encode(v: &Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).unwrap();
    out
}

pub fn s(x: &str) -> Value {
    Value::from(x)
}

pub fn uints(xs: &[u64]) -> Value {
    Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
}

pub fn tokens(xs: &[u32]) -> Value {
    Value::Array(xs.iter().map(|&x| Value::from(x)).collect())
}

/// vLLM ≥ mid-2026 map-encoded BlockStored.
pub fn stored_map(hashes: &[u64], parent: Option<u64>, toks: &[u32], block_size: u32) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), uints(hashes)),
        (
            s("parent_block_hash"),
            parent.map_or(Value::Nil, Value::from),
        ),
        (s("token_ids"), tokens(toks)),
        (s("block_size"), Value::from(block_size)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (
            s("extra_keys"),
            Value::Array(vec![Value::Nil; hashes.len()]),
        ),
        (s("group_idx"), Value::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
    ])
}

pub fn removed_map(hashes: &[u64]) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (s("block_hashes"), uints(hashes)),
        (s("medium"), s("GPU")),
        (s("group_idx"), Value::from(0)),
    ])
}

pub fn batch(events: Vec<Value>, dp_rank: Option<u32>) -> Vec<u8> {
    let mut items = vec![Value::F64(1.0), Value::Array(events)];
    if let Some(r) = dp_rank {
        items.push(Value::from(r));
    }
    encode(&Value::Array(items))
}

/// Deterministic token ids for block `i` of a synthetic request.
pub fn block_tokens(seed: u64, block_size: u32) -> Vec<u32> {
    (0..block_size as u64)
        .map(|j| {
            ((seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 17) as u32).wrapping_add(j as u32)
                % 150_000
        })
        .collect()
}
