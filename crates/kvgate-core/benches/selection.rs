//! Criterion benchmarks of kvgate-core's hot paths on a Mooncake-derived workload:
//! (a) selection (hash an 8,192-token prompt + index lookup + kv_aware cost) with
//! ~1,000,000 indexed blocks over 16 workers; (b) applying BlockStored/BlockRemoved.
//! Commands and results: docs/BENCHMARKS.md.

mod support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kvgate_core::policy::{KvAwareConfig, KvAwarePolicy};
use kvgate_core::{
    BlockHasher, FleetView, IndexConfig, Ledger, PrefixIndex, RouteRequest, RoutingPolicy, Tier,
    WorkerId, WorkerRef,
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
            let tokens = &s.queries[q];
            let keys = hasher.block_keys(tokens);
            let req = RouteRequest {
                block_keys: Some(&keys),
                prompt_tokens: tokens.len() as u32,
                session_key: None,
                now: Instant::now(),
            };
            let view = FleetView {
                candidates: &candidates,
                ledger: &ledger,
                index: Some(&index),
            };
            black_box(policy.select(&req, &view).expect("select"))
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

criterion_group!(core, benches);
criterion_main!(core);
