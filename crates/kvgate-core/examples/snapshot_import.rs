//! What loading a peer's snapshot of one worker rank costs, and how long it holds the
//! index: the Mooncake trace served by 16 workers until the index holds 4M entries
//! (its default cap; a quarter of a million per rank), then, for three ranks, the
//! export (blocks and hole paths: what a peer holds its read lock for), the
//! preparation (`SnapshotImport::new`, off the lock), the placing in one piece,
//! clearing the rank, and placing it again into the empty rank in slices of
//! `WRITE_SLICE_BLOCKS` blocks (the longest slice is the longest a lookup waits; the
//! rank's engine-hash map is grown ahead as the gateway's writer does, off the lock).
//! `cargo run --release -p kvgate-core --example snapshot_import [entries]`.
#[path = "../benches/support/mod.rs"]
mod support;

use std::time::{Duration, Instant};

use kvgate_core::{
    BlockHasher, IndexConfig, PrefixIndex, SnapshotImport, WorkerId, WorkerRef, WRITE_SLICE_BLOCKS,
};
use support::mooncake::{load_conversation_trace, populate, Fleet};

fn main() {
    let entries: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4_000_000);
    let trace = load_conversation_trace();
    let mut fleet = Fleet::new(16, 16, true);
    let (population, _) = populate(&trace, &mut fleet, entries);
    let hasher = BlockHasher::new(16).expect("block size");
    let mut index = PrefixIndex::new(hasher, IndexConfig::default());
    for ev in &population {
        ev.apply_to(&mut index);
    }
    println!("{} entries", index.len());
    for w in 0..3 {
        let at = WorkerRef::new(WorkerId(w), 0);
        let start = Instant::now();
        let (blocks, paths) = (index.export_worker(at), index.hole_paths(at));
        let export = start.elapsed();

        let start = Instant::now();
        let mut whole = SnapshotImport::new(&blocks, &paths);
        let prepare = start.elapsed();
        let start = Instant::now();
        index.import_some(at, &mut whole, usize::MAX);
        let in_one_piece = start.elapsed();

        // A router loads a snapshot into an empty rank: the clear (what an engine's
        // restart costs) is timed on its own.
        let start = Instant::now();
        index.clear(at);
        let clear = start.elapsed();
        let mut sliced = SnapshotImport::new(&blocks, &paths);
        let (mut slices, mut longest, mut placing) = (0, Duration::ZERO, Duration::ZERO);
        loop {
            let start = Instant::now();
            let done = index.import_some(at, &mut sliced, WRITE_SLICE_BLOCKS);
            if let Some(grown) = index.grow_ahead(at, sliced.remaining()) {
                index.install_grown(grown);
            }
            let took = start.elapsed();
            (slices, longest, placing) = (slices + 1, longest.max(took), placing + took);
            if done {
                break;
            }
        }
        println!(
            "rank {w}: {} blocks; export {export:.1?}, prepare {prepare:.1?}; placed in one piece {in_one_piece:.1?}; cleared {clear:.1?}; placed in {slices} slices {placing:.1?} (longest {longest:.2?})",
            sliced.held()
        );
    }
}
