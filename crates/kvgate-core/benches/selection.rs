//! Criterion benchmarks of kvgate-core's hot paths on a Mooncake-derived workload:
//! (a) selection (hash an 8,192-token prompt + index lookup + kv_aware cost) with
//! ~1,000,000 indexed blocks over 16 workers; (b) applying BlockStored/BlockRemoved;
//! (c) kv_aware's decision for a prompt cached nowhere when every worker's cache is full,
//! after 10,000 other prompts were routed; (d) the lookup alone when 256 workers share a
//! prompt's first 2,048 tokens (each of them a match to name).
//! Commands and results: docs/BENCHMARKS.md.

mod support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_core::policy::{KvAwareConfig, KvAwarePolicy};
use kvgate_core::{
    BlockHasher, Decision, FleetView, IndexConfig, Ledger, PrefixIndex, RouteRequest,
    RoutingPolicy, StoredBlocks, Tier, WorkerId, WorkerRef,
};
use support::mooncake::{scenario, Scenario, StoredEvent};

const BLOCK_SIZE: usize = 16;

const WORKERS: u32 = 16;
const ENTRIES: usize = 1_000_000;
const QUERY_TOKENS: usize = 8192;

fn populated(s: &Scenario) -> PrefixIndex {
    let mut index = PrefixIndex::new(
        BlockHasher::new(BLOCK_SIZE as u32).expect("block size"),
        IndexConfig::default(),
    );
    for ev in &s.population {
        ev.apply_to(&mut index);
    }
    index
}

/// kv_aware's decision for `tokens` (hashed here, as the gateway does) over `candidates`.
fn select(
    policy: &KvAwarePolicy,
    index: &PrefixIndex,
    candidates: &[WorkerId],
    ledger: &Ledger,
    tokens: &[u32],
) -> Decision {
    let keys = index.hasher().block_keys(tokens);
    let req = RouteRequest {
        block_keys: Some(&keys),
        prompt_tokens: tokens.len() as u32,
        session_key: None,
        now: Instant::now(),
    };
    let view = FleetView {
        candidates,
        ledger,
        index: Some(index),
    };
    policy.select(&req, &view).expect("select")
}

fn benches(c: &mut Criterion) {
    // Per-engine hash seeds, as vLLM has by default.
    let s = scenario(BLOCK_SIZE, WORKERS, ENTRIES, QUERY_TOKENS, false);
    let mut index = populated(&s);
    eprintln!(
        "index: {} entries, {} distinct blocks, {} workers; {} queries; churn batch {} blocks",
        index.len(),
        index.distinct_blocks(),
        WORKERS,
        s.queries.len(),
        s.churn_blocks
    );
    let hasher = *index.hasher();
    let ledger = Ledger::new(BLOCK_SIZE as u32);
    let candidates: Vec<WorkerId> = (0..WORKERS).map(WorkerId).collect();
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(1));

    let mut g = c.benchmark_group("core");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let mut q = 0;
    g.bench_function("select_8k_tokens_1M_blocks_16_workers", |b| {
        b.iter(|| {
            q = (q + 1) % s.queries.len();
            black_box(select(&policy, &index, &candidates, &ledger, &s.queries[q]))
        })
    });
    g.bench_function("hash_and_lookup_8k_tokens_1M_blocks", |b| {
        b.iter(|| {
            q = (q + 1) % s.queries.len();
            let keys = hasher.block_keys(&s.queries[q]);
            black_box(index.overlaps(&keys))
        })
    });
    g.bench_function("hash_only_8k_tokens", |b| {
        b.iter(|| {
            q = (q + 1) % s.queries.len();
            black_box(hasher.block_keys(&s.queries[q]))
        })
    });
    g.throughput(Throughput::Elements(2 * s.churn_blocks as u64));
    let removals: Vec<Vec<u64>> = s.churn.iter().map(StoredEvent::leaf_first).collect();
    g.bench_function("apply_stored_then_removed_on_1M_index", |b| {
        b.iter(|| {
            for ev in &s.churn {
                ev.apply_to(&mut index);
            }
            for (ev, hashes) in s.churn.iter().zip(&removals).rev() {
                index.apply_removed(
                    WorkerRef::new(WorkerId(ev.worker), 0),
                    hashes,
                    Some(Tier::Device),
                );
            }
        })
    });
    g.finish();
    assert_eq!(
        index.len(),
        populated(&s).len(),
        "churn must leave the index as it was"
    );
}

/// Prefixes kv_aware has routed lately before the cold decisions are timed.
const WANTED_PREFIXES: u32 = 10_000;
/// Cold prompts the timed decisions rotate through.
const COLD_PROMPTS: u32 = 1_000;

/// `len` tokens of their own: prompt `n`'s.
fn own_tokens(n: u32, len: u32) -> Vec<u32> {
    (0..len)
        .map(|i| n.wrapping_mul(8192).wrapping_add(i))
        .collect()
}

/// Stores `tokens`' full blocks on `worker`'s device, as one event whose engine hashes
/// are the worker's own; returns them.
fn store_on_device(index: &mut PrefixIndex, worker: WorkerId, tokens: &[u32]) -> Vec<u64> {
    let hashes: Vec<u64> = (0..tokens.len() / BLOCK_SIZE)
        .map(|b| (u64::from(worker.0) << 32) | b as u64)
        .collect();
    index
        .apply_stored(
            WorkerRef::new(worker, 0),
            &StoredBlocks {
                engine_hashes: &hashes,
                parent_engine_hash: None,
                token_ids: tokens,
                block_size: BLOCK_SIZE as u32,
                tier: Tier::Device,
                lora_name: None,
                blocks_after: 0,
            },
        )
        .expect("stored");
    hashes
}

/// A prompt of 2,048 tokens of its own (128 blocks).
fn own_prompt(n: u32) -> Vec<u32> {
    own_tokens(n, 2048)
}

/// The cold path: every one of 16 workers holds 512 blocks (room for three of the
/// prompts) and has evicted (its cache is full), kv_aware has routed [`WANTED_PREFIXES`]
/// other prompts lately, and each timed decision is for a prompt cached nowhere.
fn cold_benches(c: &mut Criterion) {
    let mut index = PrefixIndex::new(
        BlockHasher::new(BLOCK_SIZE as u32).expect("block size"),
        IndexConfig::default(),
    );
    let candidates: Vec<WorkerId> = (0..WORKERS).map(WorkerId).collect();
    for &w in &candidates {
        let hashes = store_on_device(&mut index, w, &own_tokens(u32::MAX - w.0, 8192));
        let last = hashes.len() - 1;
        index.apply_removed(WorkerRef::new(w, 0), &hashes[last..], Some(Tier::Device));
    }
    let ledger = Ledger::new(BLOCK_SIZE as u32);
    let decide = |policy: &KvAwarePolicy, tokens: &[u32]| {
        select(policy, &index, &candidates, &ledger, tokens).worker
    };
    let cold: Vec<Vec<u32>> = (0..COLD_PROMPTS)
        .map(|n| own_prompt(n + WANTED_PREFIXES))
        .collect();
    let mut g = c.benchmark_group("core");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(1));
    for n in 0..WANTED_PREFIXES {
        decide(&policy, &own_prompt(n));
    }
    let mut q = 0;
    g.bench_function("select_cold_all_full_16_workers_10k_wanted_prefixes", |b| {
        b.iter(|| {
            q = (q + 1) % cold.len();
            black_box(decide(&policy, &cold[q]))
        })
    });
    g.finish();
}

/// The lookup alone (keys hashed once) when every one of 256 workers holds the same
/// 2,048-token prompt (a fleet's system prompt) and 512 tokens of its own after it: one
/// node with 256 covers to read and 256 overlaps to report.
fn shared_prompt_benches(c: &mut Criterion) {
    const SHARING: u32 = 256;
    let mut index = PrefixIndex::new(
        BlockHasher::new(BLOCK_SIZE as u32).expect("block size"),
        IndexConfig::default(),
    );
    let shared = own_prompt(0);
    for w in 0..SHARING {
        let mut tokens = shared.clone();
        tokens.extend(own_tokens(w + 1, 512));
        store_on_device(&mut index, WorkerId(w), &tokens);
    }
    let mut query = shared;
    query.extend(own_tokens(SHARING + 1, 6144));
    let keys = index.hasher().block_keys(&query);
    assert_eq!(index.overlaps(&keys).per_ref.len(), SHARING as usize);
    let mut g = c.benchmark_group("core");
    g.bench_function("lookup_8k_tokens_256_workers_sharing_2k", |b| {
        b.iter(|| black_box(index.overlaps(&keys)))
    });
    g.finish();
}

criterion_group!(core, benches, cold_benches, shared_prompt_benches);
criterion_main!(core);
