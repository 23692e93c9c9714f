//! Memory of kvgate-core's prefix index against dynamo-kv-router 1.6.1's `RadixTree`,
//! measured by a counting global allocator in this one process:
//! - bytes per (block, worker) entry on the Mooncake-derived population of the lookup
//!   benchmark (~1M entries over 16 workers);
//! - churn: 16 workers serving requests that each add unique blocks under a shared
//!   system-prompt block, every engine at its cache capacity so each new request's
//!   blocks evict the oldest request's (leaf first, as vLLM frees them), for at least
//!   20M block events (stores + removals); kvgate's index runs at its own entry cap.
//!   Live bytes and resident memory when the index first reaches its steady size and at
//!   the end: an index that leaks nodes under prefix churn grows between the two. Also
//!   the longest single event: a table resized or rebuilt at once stalls the event (and
//!   the routing decisions waiting on the index) that triggers it.
//!
//! Run: `CARGO_TARGET_DIR=target/dynamo-compare cargo bench --manifest-path
//! bench/dynamo-compare/Cargo.toml --bench memory_churn` (results: docs/BENCHMARKS.md).

mod common;
#[path = "../../../crates/kvgate-core/benches/support/counting_alloc.rs"]
mod counting_alloc;
#[path = "../../../crates/kvgate-core/benches/support/mod.rs"]
mod support;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use counting_alloc::live;
use dynamo_kv_router::indexer::RadixTree;
use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, StoredBlocks, Tier, WorkerId, WorkerRef};
use support::mooncake::scenario;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Resident set size from /proc/self/statm, in bytes (0 where unavailable).
fn rss() -> usize {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<usize>().ok())
        .map_or(0, |pages| pages * 4096)
}

const BLOCK_SIZE: usize = 16;
const WORKERS: u32 = 16;

/// The two indexes behind one interface: a run of new blocks (with their tokens, which
/// each router's ingestion hashes), and removals.
trait Index {
    fn store(&mut self, worker: u32, parent: Option<u64>, hashes: &[u64], tokens: &[u32]);
    fn remove(&mut self, worker: u32, hashes: &[u64]);
    fn entries(&self) -> usize;
}

struct Kvgate(PrefixIndex);

impl Index for Kvgate {
    fn store(&mut self, worker: u32, parent: Option<u64>, hashes: &[u64], tokens: &[u32]) {
        self.0
            .apply_stored(
                WorkerRef::new(WorkerId(worker), 0),
                &StoredBlocks {
                    engine_hashes: hashes,
                    parent_engine_hash: parent,
                    token_ids: tokens,
                    block_size: BLOCK_SIZE as u32,
                    tier: Tier::Device,
                    lora_name: None,
                    blocks_after: 0,
                },
            )
            .expect("consistent events");
    }

    fn remove(&mut self, worker: u32, hashes: &[u64]) {
        self.0.apply_removed(
            WorkerRef::new(WorkerId(worker), 0),
            hashes,
            Some(Tier::Device),
        );
    }

    fn entries(&self) -> usize {
        self.0.len()
    }
}

struct Dynamo {
    tree: RadixTree,
    next_id: u64,
}

impl Index for Dynamo {
    fn store(&mut self, worker: u32, parent: Option<u64>, hashes: &[u64], tokens: &[u32]) {
        self.next_id += 1;
        let event = common::stored(
            worker,
            self.next_id,
            parent,
            hashes,
            tokens,
            BLOCK_SIZE as u32,
        );
        self.tree
            .apply_event(event)
            .expect("dynamo accepts the event");
    }

    fn remove(&mut self, worker: u32, hashes: &[u64]) {
        self.next_id += 1;
        let event = common::removed(worker, self.next_id, hashes.iter().copied());
        let _ = self.tree.apply_event(event);
    }

    fn entries(&self) -> usize {
        self.tree.current_size()
    }
}

/// The churn workload's shape.
struct Churn {
    /// Blocks each engine caches; a new request evicts the oldest ones beyond this.
    capacity: usize,
    /// Shared system-prompt blocks (each request continues one of them).
    roots: u64,
    /// Unique blocks per request.
    unique_blocks: usize,
    /// Stop after this many block events (stores + removals).
    events: u64,
}

/// What one index's churn run measured.
struct ChurnResult {
    steady_entries: usize,
    steady_live: usize,
    end_live: usize,
    steady_rss: usize,
    end_rss: usize,
    block_events: u64,
    seconds: f64,
    /// Live bytes every 4M block events after the steady state.
    trend: Vec<usize>,
    /// The longest single event (one store or one removal), and how many took over 1 ms:
    /// a table resized or rebuilt in one go stalls the event that triggers it.
    longest_event: Duration,
    events_over_1ms: u64,
}

/// The longest event and the count of events over 1 ms.
#[derive(Default)]
struct Stalls {
    longest: Duration,
    over_1ms: u64,
}

impl Stalls {
    fn time(&mut self, f: impl FnOnce()) {
        let started = Instant::now();
        f();
        let took = started.elapsed();
        self.longest = self.longest.max(took);
        if took > Duration::from_millis(1) {
            self.over_1ms += 1;
        }
    }
}

fn tokens_of(key: u64) -> Vec<u32> {
    let mut x = key.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..BLOCK_SIZE)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            100 + (x % 150_000) as u32
        })
        .collect()
}

fn chain_hash(parent: u64, tokens: &[u32]) -> u64 {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_64_with_seed(&bytes, parent)
}

/// Serves requests round robin over the workers until `c.events` block events; the
/// measurement points are the first time every engine is full and the end.
fn churn(index: &mut dyn Index, c: &Churn) -> ChurnResult {
    let root_tokens: Vec<Vec<u32>> = (0..c.roots).map(|r| tokens_of(1 << 50 | r)).collect();
    let root_hashes: Vec<u64> = root_tokens.iter().map(|t| chain_hash(7, t)).collect();
    let mut held_roots = vec![vec![false; c.roots as usize]; WORKERS as usize];
    // Per engine: its requests' unique blocks, oldest first. Sized up front: the
    // counting allocator counts this driver too, and its growth is neither index's.
    let mut fifo: Vec<VecDeque<Vec<u64>>> = (0..WORKERS)
        .map(|_| VecDeque::with_capacity(c.capacity / c.unique_blocks + 2))
        .collect();
    let mut held = vec![0usize; WORKERS as usize];
    let mut events = 0u64;
    let mut steady: Option<(usize, usize, usize)> = None;
    let started = Instant::now();
    let mut request = 0u64;
    let mut trend = Vec::new();
    let mut next_sample = 0u64;
    let mut stalls = Stalls::default();
    while events < c.events {
        let worker = (request % u64::from(WORKERS)) as u32;
        let w = worker as usize;
        let root = (request / u64::from(WORKERS)) % c.roots;
        if !held_roots[w][root as usize] {
            stalls.time(|| {
                index.store(
                    worker,
                    None,
                    &[root_hashes[root as usize]],
                    &root_tokens[root as usize],
                )
            });
            held_roots[w][root as usize] = true;
            events += 1;
        }
        let mut tokens = Vec::with_capacity(c.unique_blocks * BLOCK_SIZE);
        let mut hashes = Vec::with_capacity(c.unique_blocks);
        let mut parent = root_hashes[root as usize];
        for b in 0..c.unique_blocks {
            let t = tokens_of(request << 8 | b as u64);
            parent = chain_hash(parent, &t);
            hashes.push(parent);
            tokens.extend_from_slice(&t);
        }
        stalls.time(|| index.store(worker, Some(root_hashes[root as usize]), &hashes, &tokens));
        events += hashes.len() as u64;
        held[w] += hashes.len();
        fifo[w].push_back(hashes);
        while held[w] > c.capacity {
            let Some(old) = fifo[w].pop_front() else {
                break;
            };
            let leaf_first: Vec<u64> = old.iter().rev().copied().collect();
            stalls.time(|| index.remove(worker, &leaf_first));
            events += old.len() as u64;
            held[w] -= old.len();
        }
        if steady.is_none() && held.iter().all(|&h| h + c.unique_blocks > c.capacity) {
            steady = Some((index.entries(), live(), rss()));
            next_sample = events + 4_000_000;
        }
        if steady.is_some() && events >= next_sample {
            trend.push(live());
            next_sample += 4_000_000;
        }
        request += 1;
    }
    let (steady_entries, steady_live, steady_rss) = steady.unwrap_or((0, 0, 0));
    ChurnResult {
        steady_entries,
        steady_live,
        end_live: live(),
        steady_rss,
        end_rss: rss(),
        block_events: events,
        seconds: started.elapsed().as_secs_f64(),
        trend,
        longest_event: stalls.longest,
        events_over_1ms: stalls.over_1ms,
    }
}

fn report(name: &str, r: &ChurnResult, base: usize) {
    let mb = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "churn {name}: {} block events in {:.1} s; entries at steady state {}; live bytes above the start {:.1} MiB at steady state, {:.1} MiB at the end ({:+.2}%); RSS {:.1} -> {:.1} MiB",
        r.block_events,
        r.seconds,
        r.steady_entries,
        mb(r.steady_live.saturating_sub(base)),
        mb(r.end_live.saturating_sub(base)),
        (r.end_live as f64 - r.steady_live as f64) / (r.steady_live.saturating_sub(base)).max(1) as f64 * 100.0,
        mb(r.steady_rss),
        mb(r.end_rss),
    );
    let trend: Vec<String> = r
        .trend
        .iter()
        .map(|b| format!("{:.1}", mb(b.saturating_sub(base))))
        .collect();
    println!(
        "churn {name}: live MiB every 4M block events after the steady state: {}",
        trend.join(", ")
    );
    println!(
        "churn {name}: longest single event {:.1} ms; {} events took over 1 ms",
        r.longest_event.as_secs_f64() * 1000.0,
        r.events_over_1ms
    );
}

fn main() {
    // 1. Bytes per (block, worker) entry on the lookup benchmark's population.
    let s = scenario(BLOCK_SIZE, WORKERS, 1_000_000, 8192, true);
    let base = live();
    let mut kv = PrefixIndex::new(
        BlockHasher::new(BLOCK_SIZE as u32).expect("block size"),
        IndexConfig::default(),
    );
    for ev in &s.population {
        ev.apply_to(&mut kv);
    }
    let kv_entries = kv.len();
    let kv_bytes = live() - base;
    println!(
        "population: {kv_entries} (block, worker) entries over {} distinct blocks ({:.2} workers per block)",
        kv.distinct_blocks(),
        kv_entries as f64 / kv.distinct_blocks().max(1) as f64
    );
    drop(kv);
    let base = live();
    let mut dy = Dynamo {
        tree: RadixTree::new(),
        next_id: 0,
    };
    for ev in &s.population {
        dy.store(ev.worker, ev.parent, &ev.engine_hashes, &ev.tokens);
    }
    let dy_entries = dy.entries();
    let dy_bytes = live() - base;
    drop(dy);
    let kv_per = kv_bytes as f64 / kv_entries as f64;
    let dy_per = dy_bytes as f64 / dy_entries as f64;
    println!("memory kvgate: {kv_entries} entries, {kv_bytes} bytes, {kv_per:.1} bytes per entry");
    println!("memory dynamo: {dy_entries} entries, {dy_bytes} bytes, {dy_per:.1} bytes per entry");
    println!("memory ratio kvgate / dynamo: {:.2}", kv_per / dy_per);
    drop(s);

    // 2. Churn at capacity.
    let c = Churn {
        capacity: 65_536,
        roots: 64,
        unique_blocks: 8,
        // KVGATE_CHURN_EVENTS overrides the length (a longer run shows a slow leak).
        events: std::env::var("KVGATE_CHURN_EVENTS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000_000),
    };
    let base = live();
    let mut kv = Kvgate(PrefixIndex::new(
        BlockHasher::new(BLOCK_SIZE as u32).expect("block size"),
        // Below the engines' 16 × 65,536 blocks: kvgate's own eviction runs too.
        IndexConfig {
            max_blocks: 1_000_000,
        },
    ));
    let r = churn(&mut kv, &c);
    report("kvgate", &r, base);
    drop(kv);
    let base = live();
    let mut dy = Dynamo {
        tree: RadixTree::new(),
        next_id: 0,
    };
    let r = churn(&mut dy, &c);
    report("dynamo", &r, base);
}
