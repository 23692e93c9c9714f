//! kvgate-core vs dynamo-kv-router 1.6.1 on the same Mooncake-derived workload, in one
//! run: its single-threaded `RadixTree`, and its production default since Dynamo 1.0,
//! the Flash Indexer (`ThreadPoolIndexer<ConcurrentRadixTreeCompressed>`) with one and
//! with two event threads:
//! - lookup: hash an 8,192-token prompt into block hashes + find per-worker overlap,
//!   with ~1,000,000 (block, worker) entries over 16 workers;
//! - events: apply a batch of BlockStored (hashing their token ids, as each router's
//!   event ingestion must) and then the matching BlockRemoved.
//!
//! At equal threads: the Flash Indexer's N event threads against kvgate's index behind
//! the gateway's lock (kvgate-events' `SharedIndex`, an `IndexLock`) written by
//! N threads, each applying its workers' events as the gateway's subscriber tasks do
//! (`kvgate_events::apply_batch` under the write lock);
//! lookups split over N threads on both (kvgate's under the read lock, the keys hashed
//! before it as the gateway does). At two threads, also the best any split of kvgate's
//! index between its writers could do: one index per writer thread, nothing shared.
//!
//! Each is measured twice: interleaved first (one run of each index per round, in
//! alternating order, printed as the median ratio: a machine whose speed drifts slows
//! both sides of a round alike, and each side runs after the other has used the
//! caches), then as criterion groups (each index's iterations back to back).
//! Results and the command: docs/BENCHMARKS.md.

mod common;
#[path = "../../../crates/kvgate-core/benches/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::thread;
use std::time::{Duration, Instant};

use common::Flash;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dynamo_kv_router::indexer::RadixTree;
use dynamo_kv_router::protocols::{compute_block_hash_for_seq, BlockHashOptions, RouterEvent};
use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, Tier, WorkerId, WorkerRef};
use kvgate_events::{apply_batch, EventBatch, IndexLock};
use support::mooncake::{scenario, StoredEvent};

const BLOCK_SIZE: usize = 16;

const WORKERS: u32 = 16;
const ENTRIES: usize = 1_000_000;
const QUERY_TOKENS: usize = 8192;

fn dyn_stored(ev: &StoredEvent, id: u64) -> RouterEvent {
    common::stored_event(ev, id, BLOCK_SIZE as u32)
}

fn dyn_removed(ev: &StoredEvent, id: u64) -> RouterEvent {
    common::removed(ev.worker, id, ev.engine_hashes.iter().rev().copied())
}

/// The event workload on kvgate: every churn event stored, then removed leaf first
/// (`removals`), newest first.
fn kvgate_events(kv: &mut PrefixIndex, churn: &[StoredEvent], removals: &[Vec<u64>]) {
    for ev in churn {
        ev.apply_to(kv);
    }
    for (ev, hashes) in churn.iter().zip(removals).rev() {
        kv.apply_removed(
            WorkerRef::new(WorkerId(ev.worker), 0),
            hashes,
            Some(Tier::Device),
        );
    }
}

/// The same workload on dynamo-kv-router, its events numbered from `id` on.
fn dynamo_events(dy: &mut RadixTree, churn: &[StoredEvent], id: &mut u64) {
    for ev in churn {
        *id += 1;
        let _ = dy.apply_event(dyn_stored(ev, *id));
    }
    for ev in churn.iter().rev() {
        *id += 1;
        let _ = dy.apply_event(dyn_removed(ev, *id));
    }
}

/// The event workload on the Flash Indexer: enqueued on this thread (hashing each
/// event's tokens), applied by its threads; done when they have applied it all.
fn flash_events(flash: &Flash, churn: &[StoredEvent], id: &mut u64) {
    for ev in churn {
        *id += 1;
        flash.enqueue(dyn_stored(ev, *id));
    }
    for ev in churn.iter().rev() {
        *id += 1;
        flash.enqueue(dyn_removed(ev, *id));
    }
    flash.flush();
}

/// The event workload on kvgate's index behind the gateway's lock, written by
/// `threads` threads, each applying the events of its share of the workers through the
/// gateway's ingestion (one `write()` per event, as a subscriber applies a batch):
/// `stores[i]` and `removals[i]` are churn event `i` and its removal as decoded.
/// Thread `t` writes `indexes[t % indexes.len()]`: one index shared by all, or one each.
fn shared_events(
    indexes: &[IndexLock],
    churn: &[StoredEvent],
    stores: &[EventBatch],
    removals: &[EventBatch],
    threads: u32,
) {
    thread::scope(|s| {
        for t in 0..threads {
            let index = &indexes[t as usize % indexes.len()];
            s.spawn(move || {
                let at = |ev: &StoredEvent| WorkerRef::new(WorkerId(ev.worker), 0);
                for (ev, batch) in churn.iter().zip(stores) {
                    if ev.worker % threads == t {
                        apply_batch(&mut index.write(), at(ev), batch);
                    }
                }
                for (ev, batch) in churn.iter().zip(removals).rev() {
                    if ev.worker % threads == t {
                        apply_batch(&mut index.write(), at(ev), batch);
                    }
                }
            });
        }
    });
}

/// `lookup` of every query `LOOKUP_PASSES` times, the queries split over `threads`
/// threads (the passes make a thread's start small beside its lookups).
fn split_lookups(queries: &[Vec<u32>], threads: usize, lookup: impl Fn(&[u32]) + Sync) {
    const LOOKUP_PASSES: usize = 16;
    let per = queries.len().div_ceil(threads);
    thread::scope(|s| {
        for part in queries.chunks(per) {
            let lookup = &lookup;
            s.spawn(move || {
                for _ in 0..LOOKUP_PASSES {
                    for tokens in part {
                        lookup(tokens);
                    }
                }
            });
        }
    });
}

fn benches(c: &mut Criterion) {
    // Fleet-wide consistent engine hashes: dynamo's radix tree requires them.
    let s = scenario(BLOCK_SIZE, WORKERS, ENTRIES, QUERY_TOKENS, true);
    let mut kv = PrefixIndex::new(
        BlockHasher::new(BLOCK_SIZE as u32).expect("bs"),
        IndexConfig::default(),
    );
    let mut dy = RadixTree::new();
    for (i, ev) in s.population.iter().enumerate() {
        ev.apply_to(&mut kv);
        dy.apply_event(dyn_stored(ev, i as u64))
            .expect("dynamo accepts the event");
    }
    eprintln!(
        "kvgate entries {} / dynamo size {}; {} queries; churn {} blocks",
        kv.len(),
        dy.current_size(),
        s.queries.len(),
        s.churn_blocks
    );
    let hasher = *kv.hasher();
    // Sanity: both see the same longest overlap for every query.
    for tokens in &s.queries {
        let ours = kv.overlaps(&hasher.block_keys(tokens)).longest;
        let local =
            compute_block_hash_for_seq(tokens, BLOCK_SIZE as u32, BlockHashOptions::default());
        let theirs = dy
            .find_matches(local, false)
            .scores
            .values()
            .copied()
            .max()
            .unwrap_or(0);
        assert_eq!(ours, theirs, "both indexes must agree on the overlap");
    }

    // The same comparisons interleaved: one kvgate run and one dynamo run per round, in
    // alternating order, so a machine whose speed drifts during the run (it is shared)
    // slows both sides of each ratio alike.
    let removals: Vec<Vec<u64>> = s.churn.iter().map(StoredEvent::leaf_first).collect();
    let mut id = 1u64 << 40;
    let events = interleaved(
        101,
        || kvgate_events(&mut kv, &s.churn, &removals),
        || dynamo_events(&mut dy, &s.churn, &mut id),
    );
    eprintln!("events interleaved: kvgate's rate / dynamo's {events}");
    let lookups = interleaved(
        101,
        || {
            for tokens in &s.queries {
                black_box(kv.overlaps(&hasher.block_keys(tokens)));
            }
        },
        || {
            for tokens in &s.queries {
                let local = compute_block_hash_for_seq(
                    tokens,
                    BLOCK_SIZE as u32,
                    BlockHashOptions::default(),
                );
                black_box(dy.find_matches(local, false));
            }
        },
    );
    eprintln!("lookup interleaved: kvgate's rate / dynamo's {lookups}");

    // Against the Flash Indexer at equal threads, kvgate's index behind the gateway's lock.
    let shared = [IndexLock::new(kv)];
    // What any split of kvgate's index between two writers could reach at best: one index
    // per writer thread, each holding only its own workers' blocks (nothing shared).
    let split: Vec<IndexLock> = (0..2)
        .map(|t| {
            let mut part = PrefixIndex::new(
                BlockHasher::new(BLOCK_SIZE as u32).expect("bs"),
                IndexConfig::default(),
            );
            for ev in s.population.iter().filter(|ev| ev.worker % 2 == t) {
                ev.apply_to(&mut part);
            }
            IndexLock::new(part)
        })
        .collect();
    let stores: Vec<EventBatch> = s
        .churn
        .iter()
        .map(|ev| common::kvgate_stored(ev, BLOCK_SIZE as u32))
        .collect();
    let removal_batches: Vec<EventBatch> =
        removals.iter().map(|h| common::kvgate_removed(h)).collect();
    for threads in [1usize, 2] {
        let flash = Flash::new(threads, BLOCK_SIZE as u32);
        for (i, ev) in s.population.iter().enumerate() {
            flash.enqueue(dyn_stored(ev, i as u64));
        }
        flash.flush();
        let events = interleaved(
            101,
            || shared_events(&shared, &s.churn, &stores, &removal_batches, threads as u32),
            || flash_events(&flash, &s.churn, &mut id),
        );
        eprintln!("events, {threads} thread(s), interleaved: kvgate's rate / the Flash Indexer's {events}");
        if threads == 2 {
            let bound = interleaved(
                101,
                || shared_events(&split, &s.churn, &stores, &removal_batches, 2),
                || flash_events(&flash, &s.churn, &mut id),
            );
            eprintln!("events, 2 threads, one kvgate index per thread (the bound of splitting it), interleaved: kvgate's rate / the Flash Indexer's {bound}");
        }
        let lookups = interleaved(
            101,
            || {
                split_lookups(&s.queries, threads, |tokens| {
                    let keys = hasher.block_keys(tokens);
                    black_box(shared[0].read().overlaps(&keys));
                })
            },
            || {
                split_lookups(&s.queries, threads, |tokens| {
                    black_box(flash.lookup(tokens));
                })
            },
        );
        eprintln!("lookup, {threads} thread(s), interleaved: kvgate's rate / the Flash Indexer's {lookups}");
    }
    let [shared] = shared;
    let mut kv = shared.into_inner();

    let mut g = c.benchmark_group("lookup_8k_tokens_1M_blocks_16_workers");
    g.sample_size(30)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4));
    let mut q = 0;
    g.bench_function("kvgate", |b| {
        b.iter(|| {
            q = (q + 1) % s.queries.len();
            black_box(kv.overlaps(&hasher.block_keys(&s.queries[q])))
        })
    });
    g.bench_function("dynamo", |b| {
        b.iter(|| {
            q = (q + 1) % s.queries.len();
            let local = compute_block_hash_for_seq(
                &s.queries[q],
                BLOCK_SIZE as u32,
                BlockHashOptions::default(),
            );
            black_box(dy.find_matches(local, false))
        })
    });
    g.finish();

    let mut g = c.benchmark_group("events_store_then_remove");
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5));
    g.throughput(Throughput::Elements(2 * s.churn_blocks as u64));
    g.bench_function("kvgate", |b| {
        b.iter(|| kvgate_events(&mut kv, &s.churn, &removals))
    });
    g.bench_function("dynamo", |b| {
        b.iter(|| dynamo_events(&mut dy, &s.churn, &mut id))
    });
    g.finish();
}

/// Times `ours` and `theirs` once per round for `rounds` rounds, alternating which goes
/// first, and summarizes each round's ratio of their time to ours (our rate over
/// theirs): the median with the lowest and highest round, and each side's median time.
fn interleaved(rounds: usize, mut ours: impl FnMut(), mut theirs: impl FnMut()) -> String {
    let time = |f: &mut dyn FnMut()| {
        let start = Instant::now();
        f();
        start.elapsed().as_secs_f64()
    };
    let mut rows: Vec<(f64, f64)> = (0..rounds)
        .map(|round| {
            if round % 2 == 0 {
                let a = time(&mut ours);
                (a, time(&mut theirs))
            } else {
                let b = time(&mut theirs);
                (time(&mut ours), b)
            }
        })
        .collect();
    // The first rounds warm both up.
    rows.drain(..rounds / 10);
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (ratio, low, high) = median(rows.iter().map(|(a, b)| b / a).collect());
    let (ours_s, _, _) = median(rows.iter().map(|r| r.0).collect());
    let (theirs_s, _, _) = median(rows.iter().map(|r| r.1).collect());
    format!(
        "median {ratio:.2}x (rounds {low:.2}x..{high:.2}x, {} rounds; median {:.2} ms against {:.2} ms)",
        rows.len(),
        ours_s * 1e3,
        theirs_s * 1e3
    )
}

criterion_group!(compare, benches);
criterion_main!(compare);
