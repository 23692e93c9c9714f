//! The prefix index's memory under prefix churn at its entry cap: 16 engines serve
//! requests that each add unique blocks under a shared system-prompt block, every engine
//! full so each new request's blocks evict its oldest request's (leaf first, as vLLM
//! frees them), and the index's own cap below the engines' total so its eviction runs
//! too. The bytes the index holds (counted by this test binary's global allocator) must
//! stay where they were when it first reached that steady size: a hash table that fills
//! with deleted slots and doubles, or any structure that only grows, fails it.
//!
//! One test per binary: the allocator counts the whole process.

#[path = "../benches/support/counting_alloc.rs"]
mod counting_alloc;

use std::collections::VecDeque;

use counting_alloc::live;
use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, StoredBlocks, Tier, WorkerId, WorkerRef};

const BLOCK_SIZE: u32 = 4;
const WORKERS: u32 = 16;
/// Blocks each engine caches.
const ENGINE_BLOCKS: usize = 1024;
/// Unique blocks per request.
const UNIQUE: usize = 8;
const ROOTS: u64 = 16;

fn tokens_of(seed: u64) -> [u32; BLOCK_SIZE as usize] {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::array::from_fn(|_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % 150_000) as u32
    })
}

fn at(worker: u32) -> WorkerRef {
    WorkerRef::new(WorkerId(worker), 0)
}

fn store(
    index: &mut PrefixIndex,
    worker: u32,
    parent: Option<u64>,
    hashes: &[u64],
    tokens: &[u32],
) {
    index
        .apply_stored(
            at(worker),
            &StoredBlocks {
                engine_hashes: hashes,
                parent_engine_hash: parent,
                token_ids: tokens,
                block_size: BLOCK_SIZE,
                tier: Tier::Device,
                lora_name: None,
                blocks_after: 0,
            },
        )
        .expect("consistent events");
}

#[test]
fn memory_stays_flat_under_prefix_churn_at_the_cap() {
    // Below the engines' 16 × 1,024 blocks (plus roots): the index's own eviction runs.
    let cap = 15_000;
    let mut index = PrefixIndex::new(
        BlockHasher::new(BLOCK_SIZE).expect("block size"),
        IndexConfig { max_blocks: cap },
    );
    let base = live();
    // The test's own per-engine queues are sized up front: this process's allocator
    // counts them too, and their growth is not the index's.
    let mut fifo: Vec<VecDeque<Vec<u64>>> = (0..WORKERS)
        .map(|_| VecDeque::with_capacity(ENGINE_BLOCKS / UNIQUE + 2))
        .collect();
    let mut held = vec![0usize; WORKERS as usize];
    let mut roots_held = vec![vec![false; ROOTS as usize]; WORKERS as usize];
    let mut steady: Option<usize> = None;
    let mut peak_after = 0usize;
    let mut events = 0u64;
    let mut request = 0u64;
    // Long enough for the tables to fill with deleted slots several times over.
    let total_events = 60 * cap as u64;
    while events < total_events {
        let worker = (request % u64::from(WORKERS)) as u32;
        let w = worker as usize;
        let root = (request / u64::from(WORKERS)) % ROOTS;
        let root_hash = 1_000_000 + root;
        if !roots_held[w][root as usize] {
            store(
                &mut index,
                worker,
                None,
                &[root_hash],
                &tokens_of(1 << 50 | root),
            );
            roots_held[w][root as usize] = true;
            events += 1;
        }
        let hashes: Vec<u64> = (0..UNIQUE as u64)
            .map(|b| (request << 8 | b) + (1 << 32))
            .collect();
        let tokens: Vec<u32> = (0..UNIQUE as u64)
            .flat_map(|b| tokens_of(request << 8 | b))
            .collect();
        store(&mut index, worker, Some(root_hash), &hashes, &tokens);
        events += UNIQUE as u64;
        held[w] += UNIQUE;
        fifo[w].push_back(hashes);
        while held[w] > ENGINE_BLOCKS {
            let Some(old) = fifo[w].pop_front() else {
                break;
            };
            let leaf_first: Vec<u64> = old.iter().rev().copied().collect();
            index.apply_removed(at(worker), &leaf_first, Some(Tier::Device));
            events += old.len() as u64;
            held[w] -= old.len();
        }
        let live = live().saturating_sub(base);
        match steady {
            None if held.iter().all(|&h| h + UNIQUE > ENGINE_BLOCKS) => steady = Some(live),
            Some(_) => peak_after = peak_after.max(live),
            None => {}
        }
        request += 1;
    }
    let steady = steady.expect("every engine filled up");
    println!(
        "{steady} bytes at the steady state, at most {peak_after} ({:+.2}%) over {events} block events after it",
        (peak_after as f64 / steady as f64 - 1.0) * 100.0
    );
    assert!(index.len() <= cap);
    assert!(
        peak_after as f64 <= steady as f64 * 1.05,
        "the index held {steady} bytes when it first reached its steady size and up to \
         {peak_after} ({:+.1}%) over {events} block events of churn after it",
        (peak_after as f64 / steady as f64 - 1.0) * 100.0
    );
}
