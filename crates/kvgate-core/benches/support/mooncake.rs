//! Benchmark workloads derived from the Mooncake conversation trace, shared by the
//! in-crate criterion benches and the standalone comparison with dynamo-kv-router
//! (bench/dynamo-compare, which includes this file by path).
//!
//! Each trace `hash_id` is one 512-token block of real prefix structure: equal ids
//! mean an identical prefix. Tokens are synthesized per hash id with a seeded
//! generator, so shared prefixes are real token sequences. Requests are assigned to
//! workers round-robin (spreading shared prefixes over every worker, the hard case for
//! a lookup), and each worker emits `BlockStored` only for blocks it does not yet hold,
//! with its own opaque engine hashes, as vLLM does.

#![allow(dead_code)]

use std::collections::HashSet;

use kvgate_core::{PrefixIndex, StoredBlocks, Tier, WorkerId, WorkerRef};
use xxhash_rust::xxh3::xxh3_64_with_seed;

pub const TRACE_BLOCK_TOKENS: usize = 512;

pub struct TraceRequest {
    pub input_length: usize,
    pub hash_ids: Vec<u64>,
}

/// Parses the JSONL trace (only the fields the workloads need).
pub fn parse_trace(text: &str) -> Vec<TraceRequest> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("trace line is JSON");
            TraceRequest {
                input_length: v["input_length"].as_u64().expect("input_length") as usize,
                hash_ids: v["hash_ids"]
                    .as_array()
                    .expect("hash_ids")
                    .iter()
                    .map(|h| h.as_u64().expect("hash id"))
                    .collect(),
            }
        })
        .collect()
}

pub fn load_conversation_trace() -> Vec<TraceRequest> {
    // Works from crates/kvgate-core and from bench/dynamo-compare alike.
    let text = ["../../traces", "../../../traces"]
        .iter()
        .map(|rel| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(rel)
                .join("mooncake/conversation_trace.jsonl")
        })
        .find_map(|p| std::fs::read_to_string(p).ok())
        .expect("traces/mooncake/conversation_trace.jsonl is in the repo");
    parse_trace(&text)
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The prompt's token ids: 512 synthesized tokens per hash id, the last block partial.
pub fn tokens_for(req: &TraceRequest) -> Vec<u32> {
    let mut out = Vec::with_capacity(req.input_length);
    for (i, h) in req.hash_ids.iter().enumerate() {
        let remaining = req.input_length.saturating_sub(i * TRACE_BLOCK_TOKENS);
        let n = remaining.min(TRACE_BLOCK_TOKENS);
        let mut state = splitmix(*h ^ 0x6b76_6761_7465);
        for _ in 0..n {
            state = splitmix(state);
            out.push((state % 150_000) as u32);
        }
    }
    out
}

/// One `BlockStored` as an engine would send it.
#[derive(Clone)]
pub struct StoredEvent {
    pub worker: u32,
    pub engine_hashes: Vec<u64>,
    pub parent: Option<u64>,
    pub tokens: Vec<u32>,
}

/// Engine-side bookkeeping that decides which blocks are new for a worker.
pub struct Fleet {
    pub workers: u32,
    pub block_size: usize,
    /// Every engine computes the same hash for the same content (vLLM with a fixed
    /// PYTHONHASHSEED). dynamo-kv-router's radix tree requires this; kvgate does not.
    pub consistent_engine_hashes: bool,
    held: Vec<HashSet<u64>>,
    pub entries: usize,
}

impl Fleet {
    pub fn new(workers: u32, block_size: usize, consistent_engine_hashes: bool) -> Self {
        Self {
            workers,
            block_size,
            consistent_engine_hashes,
            held: (0..workers).map(|_| HashSet::new()).collect(),
            entries: 0,
        }
    }

    /// Engine hashes of every full block of `tokens` on `worker` (opaque, seeded).
    pub fn engine_hashes(&self, worker: u32, tokens: &[u32]) -> Vec<u64> {
        let seed_worker = if self.consistent_engine_hashes {
            0
        } else {
            worker
        };
        let mut parent = 0x5eed_0000_u64 + u64::from(seed_worker);
        tokens
            .chunks_exact(self.block_size)
            .map(|block| {
                let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
                parent = xxh3_64_with_seed(&bytes, parent);
                parent
            })
            .collect()
    }

    /// The `BlockStored` a worker emits when it serves `tokens`: its blocks past the
    /// longest prefix it already holds (None when it holds them all).
    pub fn serve(&mut self, worker: u32, tokens: &[u32]) -> Option<StoredEvent> {
        let hashes = self.engine_hashes(worker, tokens);
        let held = &mut self.held[worker as usize];
        let first_new = hashes.iter().position(|h| !held.contains(h))?;
        for h in &hashes[first_new..] {
            if held.insert(*h) {
                self.entries += 1;
            }
        }
        Some(StoredEvent {
            worker,
            parent: first_new.checked_sub(1).map(|i| hashes[i]),
            tokens: tokens[first_new * self.block_size..hashes.len() * self.block_size].to_vec(),
            engine_hashes: hashes[first_new..].to_vec(),
        })
    }

    pub fn forget(&mut self, worker: u32, hashes: &[u64]) {
        for h in hashes {
            if self.held[worker as usize].remove(h) {
                self.entries -= 1;
            }
        }
    }
}

/// The benchmark scenario: an index population of about `target_entries` (block,
/// worker) entries, a churn batch of later requests (stored, then removed again so
/// every iteration starts from the same state), and 8,192-token query prompts.
pub struct Scenario {
    pub block_size: usize,
    pub workers: u32,
    pub population: Vec<StoredEvent>,
    pub churn: Vec<StoredEvent>,
    pub churn_blocks: usize,
    pub queries: Vec<Vec<u32>>,
}

/// Serves the trace from its start, request `i` on worker `i mod workers`, until the
/// fleet holds about `target_entries` (block, worker) entries: the `BlockStored` events
/// it emitted, and how many requests that took.
pub fn populate(
    trace: &[TraceRequest],
    fleet: &mut Fleet,
    target_entries: usize,
) -> (Vec<StoredEvent>, usize) {
    let mut population = Vec::new();
    let mut next = 0;
    while fleet.entries < target_entries && next < trace.len() {
        let worker = (next as u32) % fleet.workers;
        if let Some(ev) = fleet.serve(worker, &tokens_for(&trace[next])) {
            population.push(ev);
        }
        next += 1;
    }
    (population, next)
}

/// Up to 64 prompts of `requests` at least `tokens` long, cut to `tokens`.
pub fn long_prompts(requests: &[TraceRequest], tokens: usize) -> Vec<Vec<u32>> {
    requests
        .iter()
        .filter(|r| r.input_length >= tokens)
        .take(64)
        .map(|r| tokens_for(r)[..tokens].to_vec())
        .collect()
}

pub fn scenario(
    block_size: usize,
    workers: u32,
    target_entries: usize,
    query_tokens: usize,
    consistent_engine_hashes: bool,
) -> Scenario {
    let trace = load_conversation_trace();
    let mut fleet = Fleet::new(workers, block_size, consistent_engine_hashes);
    let (population, next) = populate(&trace, &mut fleet, target_entries);
    let mut churn = Vec::new();
    let mut churn_blocks = 0;
    for (i, req) in trace[next..].iter().take(64).enumerate() {
        let worker = (next + i) as u32 % workers;
        if let Some(ev) = fleet.serve(worker, &tokens_for(req)) {
            churn_blocks += ev.engine_hashes.len();
            churn.push(ev);
        }
    }
    let queries = long_prompts(&trace[..next], query_tokens);
    Scenario {
        block_size,
        workers,
        population,
        churn,
        churn_blocks,
        queries,
    }
}

impl StoredEvent {
    /// Applies this `BlockStored` to a kvgate index, as event ingestion would.
    pub fn apply_to(&self, index: &mut PrefixIndex) {
        index
            .apply_stored(
                WorkerRef::new(WorkerId(self.worker), 0),
                &StoredBlocks {
                    engine_hashes: &self.engine_hashes,
                    parent_engine_hash: self.parent,
                    token_ids: &self.tokens,
                    block_size: index.block_size(),
                    tier: Tier::Device,
                    lora_name: None,
                    blocks_after: 0,
                },
            )
            .expect("workload events are consistent");
    }

    /// Its blocks in the order an engine removes them: leaf first (vLLM frees a
    /// finished request's blocks in reverse, so the tail is evicted first).
    pub fn leaf_first(&self) -> Vec<u64> {
        self.engine_hashes.iter().rev().copied().collect()
    }
}
