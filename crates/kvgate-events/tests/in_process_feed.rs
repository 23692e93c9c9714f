//! The in-process feed (`kvgate simulate`'s event path) applies messages as a
//! subscriber does: in order, stale ones dropped, a sequence that goes backwards taken
//! as an engine restart, a gap (no replay behind it) purging the worker.

mod common;

use std::sync::Arc;

use common::*;
use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, WorkerId, WorkerRef};
use kvgate_events::{EventFeed, EventMetrics, EventSource, IndexLock, SharedIndex};

const BS: u32 = 4;
const WORKER: WorkerId = WorkerId(5);

fn stored(hash: u64, parent: Option<u64>, seed: u64) -> Vec<u8> {
    batch(
        vec![stored_map(&[hash], parent, &block_tokens(seed, BS), BS)],
        Some(0),
    )
}

#[test]
fn the_feed_applies_in_order_and_purges_on_restart_and_gaps() {
    let index: SharedIndex = IndexLock::shared(PrefixIndex::new(
        BlockHasher::new(BS).unwrap(),
        IndexConfig::default(),
    ));
    let metrics = Arc::new(EventMetrics::default());
    let mut feed = EventFeed::new(
        EventSource::new(WORKER, "in-process:test"),
        index.clone(),
        metrics.clone(),
    );
    let held = || index.read().worker_len(WorkerRef::new(WORKER, 0));

    feed.deliver(0, &stored(10, None, 1));
    feed.deliver(1, &stored(11, Some(10), 2));
    assert_eq!(held(), 2);
    // A repeat of an applied sequence number is stale: nothing changes.
    feed.deliver(1, &stored(12, Some(11), 3));
    assert_eq!(held(), 2);
    // The engine restarted: its sequence starts over and what it held is gone.
    feed.deliver(0, &stored(20, None, 4));
    assert_eq!(held(), 1);
    // A gap cannot be replayed in process: the worker is purged, then rebuilt live.
    feed.deliver(5, &stored(30, None, 5));
    assert_eq!(held(), 1);
    let stats = metrics.worker(WORKER).snapshot(WORKER);
    assert_eq!((stats.restarts, stats.gaps, stats.purges), (1, 1, 2));
    assert_eq!(stats.batches, 4);
}
