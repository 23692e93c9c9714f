//! kvgate's index against Dynamo's Flash Indexer under a mixed load: the KV event
//! streams of 64 and 256 workers applied at a steady rate while another thread routes
//! (hashes an 8,192-token prompt and finds each worker's overlap) once a millisecond
//! (`MIXED_LOOKUP_EVERY_US`, default 1000).
//! Per index: lookup latency p50 / p99 / max, the part of it spent hashing the prompt
//! (p50 / p99, and its share of the slowest 1% of lookups), the event rate it sustained,
//! and (kvgate's) the share of lookups that found a writer in and waited for it, each the
//! median over `MIXED_REPEATS` runs (default 3; the two indexes' runs alternate).
//!
//! The workload: the Mooncake conversation trace as tokens, block size 16, ~1M (block,
//! worker) entries to start with; then each worker serves more of the trace (its new
//! blocks stored) and, past eight requests' worth, evicts its oldest request's blocks
//! leaf first, at `MIXED_BLOCKS_PER_WORKER` stored blocks per second per worker (default
//! 500: a worker prefilling ~8k new tokens a second) for `MIXED_SECONDS` (default 5).
//!
//! Each used as its router uses it:
//! - kvgate: the gateway's `SharedIndex` (kvgate-events' `IndexLock`: a readers-writer
//!   lock whose writers take turns); each event applied by the thread that received it
//!   through the gateway's ingestion (`kvgate_events::apply_batch` under the write lock,
//!   as a subscriber task applies a batch, letting waiting lookups in between slices of
//!   `WRITE_SLICE_BLOCKS` blocks; one writer thread, or two with the workers split
//!   between them); a lookup hashes the prompt, then takes the read lock for the
//!   overlap (as selection does).
//! - Dynamo: `ThreadPoolIndexer<ConcurrentRadixTreeCompressed>` with one or two event
//!   threads; the thread that receives an event builds it (hashing its tokens) and
//!   enqueues it; a lookup hashes and matches on the caller's thread, without a lock.
//!
//! Run: `CARGO_TARGET_DIR=target/dynamo-compare cargo bench --manifest-path
//! bench/dynamo-compare/Cargo.toml --bench mixed_load` (results: docs/BENCHMARKS.md).

mod common;
#[path = "../../../crates/kvgate-core/benches/support/mod.rs"]
mod support;

use std::collections::VecDeque;
use std::hint::black_box;
use std::thread;
use std::time::{Duration, Instant};

use common::Flash;
use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, WorkerId, WorkerRef};
use kvgate_events::{apply_batch, EventBatch, IndexLock};
use support::mooncake::{
    load_conversation_trace, long_prompts, populate, tokens_for, Fleet, StoredEvent,
};

const BLOCK_SIZE: usize = 16;
const ENTRIES: usize = 1_000_000;
const QUERY_TOKENS: usize = 8192;
/// Requests a worker keeps cached before it evicts its oldest.
const KEPT_PER_WORKER: usize = 8;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One event of the timed stream.
enum Op {
    Stored(StoredEvent),
    /// A worker's blocks evicted, leaf first.
    Removed {
        worker: u32,
        hashes: Vec<u64>,
    },
}

impl Op {
    fn worker(&self) -> u32 {
        match self {
            Op::Stored(ev) => ev.worker,
            Op::Removed { worker, .. } => *worker,
        }
    }

    fn blocks(&self) -> usize {
        match self {
            Op::Stored(ev) => ev.engine_hashes.len(),
            Op::Removed { hashes, .. } => hashes.len(),
        }
    }
}

struct Workload {
    population: Vec<StoredEvent>,
    /// The timed stream, each op with its due time from the start.
    ops: Vec<(Duration, Op)>,
    /// Each op as kvgate's event ingestion decodes it.
    batches: Vec<EventBatch>,
    stored_blocks: usize,
    queries: Vec<Vec<u32>>,
}

fn workload(workers: u32, blocks_per_worker_s: u64, seconds: u64) -> Workload {
    let trace = load_conversation_trace();
    let mut fleet = Fleet::new(workers, BLOCK_SIZE, true);
    let (population, next) = populate(&trace, &mut fleet, ENTRIES);
    let queries = long_prompts(&trace[..next], QUERY_TOKENS);
    // More of the trace, each request on another worker than it had (so most of its
    // blocks are new there), until the rate times the duration is stored.
    let target = (blocks_per_worker_s * u64::from(workers) * seconds) as usize;
    let rate = (blocks_per_worker_s * u64::from(workers)) as f64;
    let mut kept: Vec<VecDeque<Vec<u64>>> = (0..workers).map(|_| VecDeque::new()).collect();
    let mut ops = Vec::new();
    let mut stored_blocks = 0;
    let mut k = 0usize;
    while stored_blocks < target {
        let req = &trace[(next + k) % trace.len()];
        let worker = ((next + k) as u32).wrapping_mul(31).wrapping_add(7) % workers;
        k += 1;
        let Some(ev) = fleet.serve(worker, &tokens_for(req)) else {
            continue;
        };
        let due = Duration::from_secs_f64(stored_blocks as f64 / rate);
        stored_blocks += ev.engine_hashes.len();
        let queue = &mut kept[worker as usize];
        queue.push_back(ev.leaf_first());
        ops.push((due, Op::Stored(ev)));
        if queue.len() > KEPT_PER_WORKER {
            let hashes = queue.pop_front().expect("longer than kept");
            fleet.forget(worker, &hashes);
            ops.push((due, Op::Removed { worker, hashes }));
        }
    }
    let batches = ops
        .iter()
        .map(|(_, op)| match op {
            Op::Stored(ev) => common::kvgate_stored(ev, BLOCK_SIZE as u32),
            Op::Removed { hashes, .. } => common::kvgate_removed(hashes),
        })
        .collect();
    Workload {
        population,
        ops,
        batches,
        stored_blocks,
        queries,
    }
}

/// One index under the mixed load.
trait Mixed: Sync {
    /// Applies (or hands over) the workload's op `i`, on the thread that received it.
    fn receive(&self, w: &Workload, i: usize);
    /// Returns once every op received is applied.
    fn settle(&self);
    /// Routes `tokens`; returns the part of the time spent hashing them.
    fn lookup(&self, tokens: &[u32]) -> Duration;
    /// Lookups so far that waited for a writer, where the index counts them.
    fn lookup_waits(&self) -> Option<u64>;
}

struct Kvgate {
    index: IndexLock,
    hasher: BlockHasher,
}

impl Mixed for Kvgate {
    fn receive(&self, w: &Workload, i: usize) {
        let at = WorkerRef::new(WorkerId(w.ops[i].1.worker()), 0);
        apply_batch(&mut self.index.write(), at, &w.batches[i]);
    }

    fn settle(&self) {}

    fn lookup(&self, tokens: &[u32]) -> Duration {
        let start = Instant::now();
        let keys = self.hasher.block_keys(tokens);
        let hashing = start.elapsed();
        black_box(self.index.read().overlaps(&keys));
        hashing
    }

    fn lookup_waits(&self) -> Option<u64> {
        Some(self.index.read_waits())
    }
}

impl Mixed for Flash {
    fn receive(&self, w: &Workload, i: usize) {
        let id = (1 << 40) + i as u64;
        self.enqueue(match &w.ops[i].1 {
            Op::Stored(ev) => common::stored_event(ev, id, BLOCK_SIZE as u32),
            Op::Removed { worker, hashes } => common::removed(*worker, id, hashes.iter().copied()),
        });
    }

    fn settle(&self) {
        self.flush();
    }

    fn lookup(&self, tokens: &[u32]) -> Duration {
        let start = Instant::now();
        let local = self.hash(tokens);
        let hashing = start.elapsed();
        black_box(self.find_matches(&local));
        hashing
    }

    fn lookup_waits(&self) -> Option<u64> {
        None
    }
}

struct Outcome {
    /// Lookup latencies, sorted.
    lookups_us: Vec<f64>,
    /// The time of each lookup (in `lookups_us`' order) spent hashing the prompt.
    hashing_us: Vec<f64>,
    blocks_per_s: f64,
    behind_ms: f64,
    /// Share of the lookups that found a writer in and waited (kvgate's only).
    waited: Option<f64>,
}

/// Runs the timed stream through `index` from `receivers` threads (each for its share
/// of the workers), a lookup every `lookup_every` on another thread meanwhile.
fn run(index: &dyn Mixed, w: &Workload, receivers: u32, lookup_every: Duration) -> Outcome {
    let start = Instant::now();
    let mut lookups = Vec::new();
    let mut behind = Duration::ZERO;
    thread::scope(|s| {
        let senders: Vec<_> = (0..receivers)
            .map(|r| {
                s.spawn(move || {
                    let mut behind = Duration::ZERO;
                    for (i, (due, op)) in w.ops.iter().enumerate() {
                        if op.worker() % receivers != r {
                            continue;
                        }
                        let now = start.elapsed();
                        if *due > now {
                            thread::sleep(*due - now);
                        } else {
                            behind = behind.max(now - *due);
                        }
                        index.receive(w, i);
                    }
                    behind
                })
            })
            .collect();
        let mut q = 0;
        let mut tick = Instant::now();
        while senders.iter().any(|h| !h.is_finished()) {
            tick += lookup_every;
            if let Some(wait) = tick.checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            q = (q + 1) % w.queries.len();
            let t = Instant::now();
            let hashing = index.lookup(&w.queries[q]);
            lookups.push((t.elapsed().as_secs_f64() * 1e6, hashing.as_secs_f64() * 1e6));
        }
        for h in senders {
            behind = behind.max(h.join().expect("sender"));
        }
    });
    index.settle();
    let took = start.elapsed().as_secs_f64();
    let blocks: usize = w.ops.iter().map(|(_, op)| op.blocks()).sum();
    lookups.sort_by(|a, b| a.0.total_cmp(&b.0));
    let (lookups_us, hashing_us): (Vec<f64>, Vec<f64>) = lookups.into_iter().unzip();
    let waited = index
        .lookup_waits()
        .map(|n| n as f64 / lookups_us.len().max(1) as f64);
    Outcome {
        waited,
        lookups_us,
        hashing_us,
        blocks_per_s: blocks as f64 / took,
        behind_ms: behind.as_secs_f64() * 1e3,
    }
}

fn main() {
    // `cargo bench` passes flags (`--bench`); this benchmark takes none.
    let per_worker = env_or("MIXED_BLOCKS_PER_WORKER", 500);
    let seconds = env_or("MIXED_SECONDS", 5);
    let repeats = env_or("MIXED_REPEATS", 3) as usize;
    let lookup_every = Duration::from_micros(env_or("MIXED_LOOKUP_EVERY_US", 1000));
    println!(
        "| workers | index | event threads | offered / sustained block events/s | latest event behind, ms | lookups | lookup p50 / p99 / max µs | hashing p50 / p99 µs | hashing's share of the slowest 1% | lookups that waited for a writer |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    eprintln!("each cell: the median over {repeats} runs (each index's runs alternating with the other's)");
    for workers in [64u32, 256] {
        let w = workload(workers, per_worker, seconds);
        let offered: usize = w.ops.iter().map(|(_, op)| op.blocks()).sum();
        let offered = offered as f64 / seconds as f64;
        for threads in [1u32, 2] {
            // A fresh index of each per run, populated alike.
            let kv = || {
                let hasher = BlockHasher::new(BLOCK_SIZE as u32).expect("block size");
                let mut index = PrefixIndex::new(hasher, IndexConfig::default());
                for ev in &w.population {
                    ev.apply_to(&mut index);
                }
                Kvgate {
                    index: IndexLock::new(index),
                    hasher,
                }
            };
            let flash = || {
                let flash = Flash::new(threads as usize, BLOCK_SIZE as u32);
                for (i, ev) in w.population.iter().enumerate() {
                    flash.enqueue(common::stored_event(ev, i as u64, BLOCK_SIZE as u32));
                }
                flash.flush();
                flash
            };
            // Per index, its runs' outcomes; the two alternate which runs first.
            let mut runs: [Vec<Outcome>; 2] = [Vec::new(), Vec::new()];
            for r in 0..repeats {
                for kvgate in [r % 2 == 0, r % 2 == 1] {
                    if kvgate {
                        runs[0].push(run(&kv(), &w, threads, lookup_every));
                    } else {
                        runs[1].push(run(&flash(), &w, 1, lookup_every));
                    }
                }
            }
            for (name, outcomes) in ["kvgate (IndexLock)", "Dynamo Flash Indexer"]
                .iter()
                .zip(&runs)
            {
                let median = |f: &dyn Fn(&Outcome) -> f64| {
                    let mut v: Vec<f64> = outcomes.iter().map(f).collect();
                    v.sort_by(f64::total_cmp);
                    v[v.len() / 2]
                };
                // The `q` quantile of `sorted`.
                let pct = |sorted: &[f64], q: f64| sorted[((sorted.len() - 1) as f64 * q) as usize];
                let sorted = |v: &[f64]| {
                    let mut v = v.to_vec();
                    v.sort_by(f64::total_cmp);
                    v
                };
                // The slowest 1% of lookups: what part of their time went to hashing.
                let slowest_hashing_share = |o: &Outcome| {
                    let from = o.lookups_us.len() * 99 / 100;
                    let total: f64 = o.lookups_us[from..].iter().sum();
                    o.hashing_us[from..].iter().sum::<f64>() / total.max(f64::MIN_POSITIVE)
                };
                let waited = if outcomes.iter().all(|o| o.waited.is_some()) {
                    format!("{:.2}%", 100.0 * median(&|o| o.waited.unwrap_or(0.0)))
                } else {
                    "not counted".to_owned()
                };
                println!(
                    "| {workers} | {name} | {threads} | {offered:.0} / {:.0} | {:.1} | {:.0} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} | {:.0}% | {waited} |",
                    median(&|o| o.blocks_per_s),
                    median(&|o| o.behind_ms),
                    median(&|o| o.lookups_us.len() as f64),
                    median(&|o| pct(&o.lookups_us, 0.5)),
                    median(&|o| pct(&o.lookups_us, 0.99)),
                    median(&|o| o.lookups_us.last().copied().unwrap_or(0.0)),
                    median(&|o| pct(&sorted(&o.hashing_us), 0.5)),
                    median(&|o| pct(&sorted(&o.hashing_us), 0.99)),
                    100.0 * median(&slowest_hashing_share),
                );
            }
        }
        let largest = w.ops.iter().map(|(_, op)| op.blocks()).max().unwrap_or(0);
        eprintln!(
            "{workers} workers: {} stored blocks in the stream, the largest event {largest} blocks",
            w.stored_blocks
        );
    }
}
