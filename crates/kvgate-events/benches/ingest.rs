//! Ingestion throughput: decode + apply vLLM-0.32 map-format batches derived from the
//! Mooncake conversation trace (each hash id = 512 tokens = 32 blocks of 16 tokens),
//! as a bounded engine cache would publish them (stores with parents, evictions).
//!
//! Run: cargo bench -p kvgate-events --bench ingest

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, WorkerId, WorkerRef};
use kvgate_events::{apply_batch, decode_batch};
use rmpv::Value;

const BLOCK: u32 = 16;
const BLOCKS_PER_HASH_ID: u64 = 512 / BLOCK as u64;
/// Requests taken from the trace, requests per published batch, engine cache size.
const REQUESTS: usize = 3000;
const REQUESTS_PER_BATCH: usize = 4;
const CACHE_HASH_IDS: usize = 4096; // 131 072 blocks

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

fn engine_hash(hash_id: u64, j: u64) -> u64 {
    mix(hash_id * BLOCKS_PER_HASH_ID + j + 1)
}

fn tokens(hash_id: u64, out: &mut Vec<u32>) {
    for t in 0..512u64 {
        out.push((mix(hash_id << 10 | t) % 151_000) as u32);
    }
}

fn s(x: &str) -> Value {
    Value::from(x)
}

fn stored(hashes: Vec<u64>, parent: Option<u64>, toks: Vec<u32>) -> Value {
    let n = hashes.len();
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (
            s("block_hashes"),
            Value::Array(hashes.into_iter().map(Value::from).collect()),
        ),
        (
            s("parent_block_hash"),
            parent.map_or(Value::Nil, Value::from),
        ),
        (
            s("token_ids"),
            Value::Array(toks.into_iter().map(Value::from).collect()),
        ),
        (s("block_size"), Value::from(BLOCK)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("GPU")),
        (s("lora_name"), Value::Nil),
        (s("extra_keys"), Value::Array(vec![Value::Nil; n])),
        (s("group_idx"), Value::from(0)),
        (s("kv_cache_spec_kind"), s("full_attention")),
    ])
}

fn removed(hashes: Vec<u64>) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockRemoved")),
        (
            s("block_hashes"),
            Value::Array(hashes.into_iter().map(Value::from).collect()),
        ),
        (s("medium"), s("GPU")),
        (s("group_idx"), Value::from(0)),
    ])
}

struct Stream {
    payloads: Vec<Vec<u8>>,
    stored_blocks: u64,
    removed_blocks: u64,
}

/// Replays the trace through a FIFO-evicting engine cache of hash ids and encodes what
/// it would publish.
fn build_stream() -> Stream {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../traces/mooncake/conversation_trace.jsonl");
    let text = std::fs::read_to_string(&path).expect("trace");
    let mut cached: HashSet<u64> = HashSet::new();
    let mut order: VecDeque<u64> = VecDeque::new();
    let (mut stored_blocks, mut removed_blocks) = (0u64, 0u64);
    let mut payloads = Vec::new();
    let mut events = Vec::new();
    for (n, line) in text.lines().take(REQUESTS).enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json");
        let ids: Vec<u64> = v["hash_ids"]
            .as_array()
            .expect("hash_ids")
            .iter()
            .filter_map(|x| x.as_u64())
            .collect();
        let first_new = ids
            .iter()
            .position(|h| !cached.contains(h))
            .unwrap_or(ids.len());
        if first_new < ids.len() {
            let parent =
                (first_new > 0).then(|| engine_hash(ids[first_new - 1], BLOCKS_PER_HASH_ID - 1));
            let (mut hashes, mut toks) = (Vec::new(), Vec::new());
            for &h in &ids[first_new..] {
                hashes.extend((0..BLOCKS_PER_HASH_ID).map(|j| engine_hash(h, j)));
                tokens(h, &mut toks);
                if cached.insert(h) {
                    order.push_back(h);
                }
            }
            stored_blocks += hashes.len() as u64;
            events.push(stored(hashes, parent, toks));
            while order.len() > CACHE_HASH_IDS {
                if let Some(old) = order.pop_front() {
                    cached.remove(&old);
                    removed_blocks += BLOCKS_PER_HASH_ID;
                    events.push(removed(
                        (0..BLOCKS_PER_HASH_ID)
                            .map(|j| engine_hash(old, j))
                            .collect(),
                    ));
                }
            }
        }
        if (n + 1) % REQUESTS_PER_BATCH == 0 && !events.is_empty() {
            let b = Value::Array(vec![
                Value::F64(n as f64),
                Value::Array(std::mem::take(&mut events)),
                Value::from(0),
            ]);
            let mut out = Vec::new();
            rmpv::encode::write_value(&mut out, &b).expect("encode");
            payloads.push(out);
        }
    }
    Stream {
        payloads,
        stored_blocks,
        removed_blocks,
    }
}

fn fresh_index() -> PrefixIndex {
    PrefixIndex::new(BlockHasher::new(BLOCK).expect("bs"), IndexConfig::default())
}

fn bench(c: &mut Criterion) {
    let stream = build_stream();
    let bytes: usize = stream.payloads.iter().map(|p| p.len()).sum();
    eprintln!(
        "stream: {} batches, {} MiB, {} blocks stored, {} removed",
        stream.payloads.len(),
        bytes >> 20,
        stream.stored_blocks,
        stream.removed_blocks
    );
    let at = WorkerRef::new(WorkerId(0), 0);
    // Sanity: everything applies, nothing is rejected.
    {
        let mut idx = fresh_index();
        let mut stored = 0;
        for p in &stream.payloads {
            let o = apply_batch(&mut idx, at, &decode_batch(p).expect("decode"));
            assert_eq!(
                o.unknown_parents + o.token_count_mismatches + o.block_size_mismatches,
                0
            );
            stored += o.blocks_stored + o.blocks_refreshed;
        }
        assert_eq!(stored, stream.stored_blocks);
    }

    let mut g = c.benchmark_group("ingest");
    g.sample_size(10);
    g.throughput(Throughput::Elements(stream.stored_blocks));
    g.bench_function("decode_only", |b| {
        b.iter(|| {
            let mut n = 0usize;
            for p in &stream.payloads {
                n += decode_batch(p).expect("decode").events.len();
            }
            n
        })
    });
    g.bench_function("rmpv_value_parse_only", |b| {
        b.iter(|| {
            let mut n = 0usize;
            for p in &stream.payloads {
                let v = rmpv::decode::read_value(&mut &p[..]).expect("rmpv");
                n += v.as_array().map_or(0, |a| a.len());
            }
            n
        })
    });
    g.bench_function("decode_and_apply", |b| {
        b.iter_batched(
            fresh_index,
            |mut idx| {
                for p in &stream.payloads {
                    let batch = decode_batch(p).expect("decode");
                    apply_batch(&mut idx, at, &batch);
                }
                idx
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
