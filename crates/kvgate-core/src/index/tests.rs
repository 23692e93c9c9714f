//! Index tests: targeted interleavings seen in practice, the memory cap, and a
//! property test against a simple reference model.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use super::*;

const BS: u32 = 2;

fn hasher() -> BlockHasher {
    BlockHasher::new(BS).unwrap()
}

fn at(w: u32, r: u32) -> WorkerRef {
    WorkerRef::new(WorkerId(w), r)
}

fn index(max_blocks: usize) -> PrefixIndex {
    PrefixIndex::new(hasher(), IndexConfig { max_blocks })
}

fn store(
    idx: &mut PrefixIndex,
    a: WorkerRef,
    hashes: &[u64],
    parent: Option<u64>,
    tokens: &[u32],
    tier: Tier,
) -> Result<StoreOutcome, StoreError> {
    idx.apply_stored(
        a,
        &StoredBlocks {
            engine_hashes: hashes,
            parent_engine_hash: parent,
            token_ids: tokens,
            block_size: BS,
            tier,
            lora_name: None,
            blocks_after: 0,
        },
    )
}

fn run_of(idx: &PrefixIndex, tokens: &[u32], w: u32) -> [u32; 3] {
    let keys = idx.hasher().block_keys(tokens);
    idx.overlaps(&keys)
        .best_for(WorkerId(w))
        .map_or([0; 3], |o| o.blocks)
}

#[test]
fn stored_run_with_parent_matches_whole_prefix() {
    let mut idx = index(1000);
    store(
        &mut idx,
        at(0, 0),
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        Tier::Device,
    )
    .unwrap();
    store(&mut idx, at(0, 0), &[12], Some(11), &[5, 6], Tier::Device).unwrap();
    assert_eq!(run_of(&idx, &[1, 2, 3, 4, 5, 6, 7], 0), [3, 0, 0]);
    assert_eq!(run_of(&idx, &[1, 2, 9, 9, 5, 6], 0), [1, 0, 0]);
    assert_eq!(run_of(&idx, &[9, 9], 0), [0, 0, 0]);
}

/// A rank's engine-hash map grown ahead of a store (a shared index's writer builds it
/// off the write lock) is swapped in, the store then needs no more room, and the index
/// ends as if the store had grown the map itself; a map grown before the rank's map
/// changed is refused.
#[test]
fn a_map_grown_ahead_is_swapped_in_unless_the_map_changed() {
    let (mut ahead, mut in_place) = (index(1_000_000), index(1_000_000));
    let tokens: Vec<u32> = (0..2_000).collect();
    let hashes: Vec<u64> = (1..=1_000).collect();
    for idx in [&mut ahead, &mut in_place] {
        store(
            idx,
            at(0, 0),
            &hashes[..40],
            None,
            &tokens[..80],
            Tier::Device,
        )
        .unwrap();
    }
    let more = 960;
    assert!(ahead.needs_room(at(0, 0), more));
    assert!(ahead.grow_ahead(at(1, 0), more).is_none(), "no such rank");
    let grown = ahead.grow_ahead(at(0, 0), more).expect("room needed");
    assert!(ahead.install_grown(grown));
    assert!(!ahead.needs_room(at(0, 0), more));
    for idx in [&mut ahead, &mut in_place] {
        store(
            idx,
            at(0, 0),
            &hashes[40..],
            Some(40),
            &tokens[80..],
            Tier::Device,
        )
        .unwrap();
    }
    assert_eq!(
        ahead.worker_blocks(at(0, 0)),
        in_place.worker_blocks(at(0, 0))
    );
    assert_eq!(run_of(&ahead, &tokens, 0), [1_000, 0, 0]);
    for h in hashes.iter().step_by(7) {
        assert_eq!(ahead.key_of(at(0, 0), *h), in_place.key_of(at(0, 0), *h));
    }

    let stale = ahead.grow_ahead(at(0, 0), 2_000).expect("room needed");
    ahead.apply_removed(at(0, 0), &[1_000], Some(Tier::Device));
    assert!(!ahead.install_grown(stale), "copied before a removal");
    assert_eq!(ahead.worker_len(at(0, 0)), 999);
    assert_eq!(ahead.key_of(at(0, 0), 1_000), None);
}

#[test]
fn duplicate_store_is_idempotent() {
    let mut idx = index(1000);
    store(
        &mut idx,
        at(0, 0),
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        Tier::Device,
    )
    .unwrap();
    let out = store(
        &mut idx,
        at(0, 0),
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        Tier::Device,
    )
    .unwrap();
    assert_eq!(out.duplicates, 2);
    assert_eq!(idx.len(), 2);
    idx.apply_removed(at(0, 0), &[10, 11], Some(Tier::Device));
    assert!(idx.is_empty());
    assert_eq!(idx.distinct_blocks(), 0);
}

#[test]
fn parent_removed_before_child_ends_the_run_at_the_gap() {
    let mut idx = index(1000);
    store(
        &mut idx,
        at(0, 0),
        &[10, 11, 12],
        None,
        &[1, 2, 3, 4, 5, 6],
        Tier::Device,
    )
    .unwrap();
    idx.apply_removed(at(0, 0), &[11], Some(Tier::Device));
    assert_eq!(run_of(&idx, &[1, 2, 3, 4, 5, 6], 0), [1, 0, 0]);
    // The child is still known, so removing it later works and leaves nothing behind.
    let out = idx.apply_removed(at(0, 0), &[12, 10], None);
    assert_eq!(
        out,
        RemoveOutcome {
            removed: 2,
            unknown: 0
        }
    );
    assert!(idx.is_empty());
}

#[test]
fn unknown_hashes_and_parents_are_counted_not_fatal() {
    let mut idx = index(1000);
    let out = idx.apply_removed(at(3, 0), &[1, 2], None);
    assert_eq!(out.unknown, 2);
    store(&mut idx, at(0, 0), &[10], None, &[1, 2], Tier::Device).unwrap();
    assert_eq!(idx.apply_removed(at(0, 0), &[99], None).unknown, 1);
    let err = store(&mut idx, at(0, 0), &[12], Some(77), &[5, 6], Tier::Device).unwrap_err();
    assert_eq!(
        err,
        StoreError::UnknownParent {
            parent_engine_hash: 77
        }
    );
    assert_eq!(idx.stats().unknown_removals, 3);
    assert_eq!(idx.stats().unknown_parents, 1);
}

#[test]
fn clear_twice_is_harmless_and_other_workers_keep_their_blocks() {
    let mut idx = index(1000);
    store(
        &mut idx,
        at(0, 0),
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        Tier::Device,
    )
    .unwrap();
    store(
        &mut idx,
        at(1, 0),
        &[20, 21],
        None,
        &[1, 2, 3, 4],
        Tier::Device,
    )
    .unwrap();
    assert_eq!(idx.clear(at(0, 0)), 2);
    assert_eq!(idx.clear(at(0, 0)), 0);
    assert_eq!(run_of(&idx, &[1, 2, 3, 4], 0), [0; 3]);
    assert_eq!(run_of(&idx, &[1, 2, 3, 4], 1), [2, 0, 0]);
    // After a clear the same engine hashes can be stored again.
    store(&mut idx, at(0, 0), &[10], None, &[1, 2], Tier::Device).unwrap();
    assert_eq!(run_of(&idx, &[1, 2, 3, 4], 0), [1, 0, 0]);
}

#[test]
fn remove_worker_purges_every_rank_and_recycles_the_slot() {
    let mut idx = index(1000);
    store(&mut idx, at(0, 0), &[10], None, &[1, 2], Tier::Device).unwrap();
    store(&mut idx, at(0, 1), &[10], None, &[1, 2], Tier::Device).unwrap();
    store(&mut idx, at(1, 0), &[20], None, &[1, 2], Tier::Device).unwrap();
    assert_eq!(idx.remove_worker(WorkerId(0)), 2);
    assert_eq!(idx.worker_refs(), vec![at(1, 0)]);
    store(&mut idx, at(2, 0), &[30], None, &[1, 2], Tier::Device).unwrap();
    let scores = idx.overlaps(&idx.hasher().block_keys(&[1, 2]));
    let holders: BTreeSet<WorkerRef> = scores.per_ref.iter().map(|o| o.at).collect();
    assert_eq!(holders, [at(1, 0), at(2, 0)].into_iter().collect());
}

#[test]
fn slices_chain_each_to_the_last_block_before_it() {
    let hashes = [10, 11, 12, 13, 14];
    let tokens: Vec<u32> = (0..10).collect();
    let run = StoredBlocks {
        engine_hashes: &hashes,
        parent_engine_hash: Some(9),
        token_ids: &tokens,
        block_size: BS,
        tier: Tier::Host,
        lora_name: Some("adapter"),
        blocks_after: 0,
    };
    let parts: Vec<_> = run.slices(2).collect();
    let shape: Vec<_> = parts
        .iter()
        .map(|p| {
            (
                p.engine_hashes.to_vec(),
                p.parent_engine_hash,
                p.token_ids.to_vec(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (vec![10, 11], Some(9), vec![0, 1, 2, 3]),
            (vec![12, 13], Some(11), vec![4, 5, 6, 7]),
            (vec![14], Some(13), vec![8, 9]),
        ]
    );
    let after: Vec<usize> = parts.iter().map(|p| p.blocks_after).collect();
    assert_eq!(after, [3, 1, 0]);
    assert!(parts
        .iter()
        .all(|p| p.tier == Tier::Host && p.lora_name == Some("adapter")));
    // Whole when it fits, and when its token count is wrong (so applying it says so);
    // a slice size of 0 is taken as 1.
    assert_eq!(run.slices(5).count(), 1);
    assert_eq!(
        run.slices(0)
            .map(|p| p.engine_hashes.len())
            .collect::<Vec<_>>(),
        [1; 5]
    );
    let short = StoredBlocks {
        token_ids: &tokens[..9],
        ..run
    };
    assert_eq!(short.slices(2).count(), 1);
}

/// A long run's first slice sizes the run's storage (its keys, the cover's engine
/// hashes) for the whole run, so a run stored in slices grows once, as a whole one
/// does, not once per slice (reallocating what it held each time).
#[test]
fn a_runs_first_slice_sizes_its_storage_for_the_whole_run() {
    let mut idx = index(1_000_000);
    let tokens: Vec<u32> = (0..2_000).collect();
    let hashes: Vec<u64> = (1..=1_000).collect();
    let run = StoredBlocks {
        engine_hashes: &hashes,
        parent_engine_hash: None,
        token_ids: &tokens,
        block_size: BS,
        tier: Tier::Device,
        lora_name: None,
        blocks_after: 0,
    };
    let first = run.slices(64).next().expect("a slice");
    idx.apply_stored(at(0, 0), &first).unwrap();
    let node = idx.nodes.iter().find(|n| n.is_live()).expect("a node");
    assert_eq!(node.keys.len(), 64);
    assert_eq!(node.keys.capacity(), 1_000);
    assert_eq!(node.covers[0].engine_hashes.capacity(), 1_000);
}

#[test]
fn block_size_and_token_count_mismatches_are_errors() {
    let mut idx = index(1000);
    let err = idx
        .apply_stored(
            at(0, 0),
            &StoredBlocks {
                engine_hashes: &[1],
                parent_engine_hash: None,
                token_ids: &[1, 2, 3, 4],
                block_size: 4,
                tier: Tier::Device,
                lora_name: None,
                blocks_after: 0,
            },
        )
        .unwrap_err();
    assert_eq!(
        err,
        StoreError::BlockSizeMismatch {
            expected: 2,
            got: 4
        }
    );
    let err = store(&mut idx, at(0, 0), &[1, 2], None, &[1, 2, 3], Tier::Device).unwrap_err();
    assert!(matches!(err, StoreError::TokenCountMismatch { .. }));
    assert_eq!(idx.stats().block_size_mismatches, 1);
    assert!(idx.is_empty());
}

#[test]
fn tiers_are_reported_separately_and_device_wins() {
    let mut idx = index(1000);
    store(
        &mut idx,
        at(0, 0),
        &[10, 11],
        None,
        &[1, 2, 3, 4],
        Tier::Host,
    )
    .unwrap();
    store(&mut idx, at(0, 0), &[10], None, &[1, 2], Tier::Device).unwrap();
    assert_eq!(run_of(&idx, &[1, 2, 3, 4], 0), [1, 1, 0]);
    idx.apply_removed(at(0, 0), &[11], Some(Tier::Host));
    assert_eq!(run_of(&idx, &[1, 2, 3, 4], 0), [1, 0, 0]);
    idx.apply_removed(at(0, 0), &[10], Some(Tier::Device));
    assert_eq!(run_of(&idx, &[1, 2, 3, 4], 0), [0, 1, 0]);
}

#[test]
fn lora_blocks_do_not_match_base_model_prompts() {
    let mut idx = index(1000);
    idx.apply_stored(
        at(0, 0),
        &StoredBlocks {
            engine_hashes: &[10],
            parent_engine_hash: None,
            token_ids: &[1, 2],
            block_size: BS,
            tier: Tier::Device,
            lora_name: Some("adapter"),
            blocks_after: 0,
        },
    )
    .unwrap();
    assert_eq!(run_of(&idx, &[1, 2], 0), [0; 3]);
    let lora_keys = idx.hasher().for_lora(Some("adapter")).block_keys(&[1, 2]);
    assert_eq!(idx.overlaps(&lora_keys).longest, 1);
}

#[test]
fn cap_bounds_entries_and_queue_and_evicts_oldest_stored_first() {
    let mut idx = index(100);
    for i in 0..1000u32 {
        store(&mut idx, at(0, 0), &[i as u64], None, &[i, i], Tier::Device).unwrap();
        assert!(idx.len() <= 100);
        assert!(idx.queue_len() <= 2 * idx.len() + 1024 + 1);
    }
    assert_eq!(idx.stats().evicted_blocks, 900);
    assert_eq!(run_of(&idx, &[999, 999], 0), [1, 0, 0]);
    assert_eq!(run_of(&idx, &[0, 0], 0), [0; 3]);
    // Engine removals of evicted blocks are unknown, not errors.
    assert_eq!(idx.apply_removed(at(0, 0), &[0], None).unknown, 1);
}

#[test]
fn matched_blocks_get_a_second_chance() {
    let mut idx = index(3);
    for i in 0..3u32 {
        store(&mut idx, at(0, 0), &[i as u64], None, &[i, i], Tier::Device).unwrap();
    }
    // Block 0 is hot: a lookup matched it.
    assert_eq!(run_of(&idx, &[0, 0], 0), [1, 0, 0]);
    store(&mut idx, at(0, 0), &[3], None, &[3, 3], Tier::Device).unwrap();
    assert_eq!(run_of(&idx, &[0, 0], 0), [1, 0, 0], "hot block survived");
    assert_eq!(
        run_of(&idx, &[1, 1], 0),
        [0; 3],
        "cold oldest block evicted"
    );
}

#[test]
fn queue_is_dropped_when_far_below_the_cap() {
    let mut idx = index(100);
    for i in 0..200u32 {
        store(&mut idx, at(0, 0), &[i as u64], None, &[i, i], Tier::Device).unwrap();
    }
    assert!(idx.queue_len() >= 100);
    idx.clear(at(0, 0));
    store(&mut idx, at(0, 0), &[7], None, &[7, 7], Tier::Device).unwrap();
    assert_eq!(idx.queue_len(), 0);
    // And rebuilt, oldest first, when the cap is exceeded again.
    for i in 1000..1200u32 {
        store(&mut idx, at(0, 0), &[i as u64], None, &[i, i], Tier::Device).unwrap();
    }
    assert_eq!(idx.len(), 100);
    assert_eq!(run_of(&idx, &[7, 7], 0), [0; 3], "oldest entry went first");
    assert_eq!(run_of(&idx, &[1199, 1199], 0), [1, 0, 0]);
}

#[test]
fn repeated_churn_does_not_grow_the_queue() {
    let mut idx = index(150);
    for round in 0..50u64 {
        for i in 0..100u32 {
            store(
                &mut idx,
                at(0, 0),
                &[i as u64 + round * 1000],
                None,
                &[i, i],
                Tier::Device,
            )
            .unwrap();
        }
        idx.clear(at(0, 0));
    }
    assert!(idx.is_empty());
    assert!(idx.queue_len() <= 1024 + 100, "queue {}", idx.queue_len());
}

/// Whether some slot holds a block without holding the block before it (a hole).
fn has_hole(idx: &PrefixIndex) -> bool {
    idx.nodes.iter().filter(|n| n.is_live()).any(|n| {
        n.parent != super::tree::NO_NODE
            && n.covers.iter().any(|c| {
                let p = idx.node(n.parent);
                !p.slot_holds(c.slot, p.len() - 1)
            })
    })
}

/// Checks the tree's invariants and recomputes the counts and maps from the covers.
fn assert_bookkeeping(idx: &PrefixIndex) {
    use super::tree::NO_NODE;
    let mut live = 0;
    let mut entries: BTreeMap<u16, usize> = BTreeMap::new();
    let mut mapped: BTreeMap<(u16, u64), super::tree::Pos> = BTreeMap::new();
    for (id, n) in idx.nodes.iter().enumerate() {
        let id = id as u32;
        if !n.is_live() {
            assert!(idx.free_nodes.contains(&id), "dead node {id} is free");
            continue;
        }
        assert_eq!(
            idx.starts.get(&n.keys[0]),
            Some(&id),
            "node {id} is in starts"
        );
        assert!(
            !n.covers.is_empty() || !n.children.is_empty(),
            "node {id} has covers or children"
        );
        if n.children.is_empty() {
            let longest = n.covers.iter().map(|c| c.len()).max().unwrap_or(0);
            assert_eq!(
                longest,
                n.len(),
                "leaf {id} is trimmed to its longest cover"
            );
        }
        for c in &n.children {
            assert_eq!(idx.node(*c).parent, id, "child {c} of {id} names it");
        }
        if n.parent != NO_NODE {
            assert_eq!(
                idx.node(n.parent).children.get(n.at_parent as usize),
                Some(&id),
                "{id} is its parent's child where it says"
            );
        }
        let mut last = None;
        for c in &n.covers {
            assert!(c.len() > 0 && c.len() <= n.len(), "cover within node {id}");
            assert!(last < Some((c.slot, c.tier)), "covers sorted");
            last = Some((c.slot, c.tier));
            live += c.len();
            *entries.entry(c.slot).or_default() += c.len();
            for (i, eh) in c.engine_hashes.iter().enumerate() {
                let pos = super::tree::Pos {
                    node: id,
                    abs: n.base + i as u32,
                };
                if let Some(other) = mapped.insert((c.slot, *eh), pos) {
                    assert_eq!(
                        other, pos,
                        "engine hash {eh} of slot {} at one block",
                        c.slot
                    );
                }
            }
        }
    }
    assert_eq!(idx.live, live, "live entries");
    for (slot, state) in idx.slots.iter().enumerate() {
        let Some(state) = state else { continue };
        let slot = slot as u16;
        assert_eq!(
            state.entries,
            entries.get(&slot).copied().unwrap_or(0),
            "entries of slot {slot}"
        );
        let expected: BTreeMap<(u16, u64), super::tree::Pos> = mapped
            .iter()
            .filter(|((s, _), _)| *s == slot)
            .map(|(k, v)| (*k, *v))
            .collect();
        assert_eq!(
            state.engine_map.len(),
            expected.len(),
            "engine-hash map of slot {slot}"
        );
        for ((_, eh), pos) in expected {
            assert_eq!(
                idx.lookup(slot, eh),
                Some(pos),
                "engine hash {eh} of slot {slot}"
            );
        }
    }
}

#[test]
fn a_hole_ends_the_run_and_heals() {
    let mut idx = index(1000);
    let tokens = [1, 2, 3, 4, 5, 6, 7, 8];
    store(
        &mut idx,
        at(0, 0),
        &[10, 11, 12, 13],
        None,
        &tokens,
        Tier::Device,
    )
    .unwrap();
    assert_eq!(run_of(&idx, &tokens, 0), [4, 0, 0]);
    // The engine drops a parent first: blocks 2 and 3 are still held but unreachable.
    idx.apply_removed(at(0, 0), &[11], Some(Tier::Device));
    assert_eq!(run_of(&idx, &tokens, 0), [1, 0, 0]);
    assert_bookkeeping(&idx);
    // Re-storing the parent adopts its held children: the run is whole again.
    store(
        &mut idx,
        at(0, 0),
        &[11],
        Some(10),
        &tokens[2..4],
        Tier::Device,
    )
    .unwrap();
    assert_eq!(run_of(&idx, &tokens, 0), [4, 0, 0]);
    // Removing the orphaned children heals a hole too.
    idx.apply_removed(at(0, 0), &[11], None);
    idx.apply_removed(at(0, 0), &[13], None);
    idx.apply_removed(at(0, 0), &[12], None);
    assert_eq!(run_of(&idx, &tokens, 0), [1, 0, 0]);
    assert_bookkeeping(&idx);
    // A clear resets everything.
    idx.apply_removed(at(0, 0), &[10], None);
    store(
        &mut idx,
        at(0, 0),
        &[10, 11, 12],
        None,
        &tokens[..6],
        Tier::Device,
    )
    .unwrap();
    idx.apply_removed(at(0, 0), &[10], None);
    idx.clear(at(0, 0));
    assert_bookkeeping(&idx);
}

#[test]
fn a_stored_run_is_one_node_and_a_divergence_splits_it_once() {
    let mut idx = index(10_000);
    let tokens: Vec<u32> = (0..200).collect();
    let hashes: Vec<u64> = (0..100).collect();
    store(&mut idx, at(0, 0), &hashes, None, &tokens, Tier::Device).unwrap();
    assert_eq!(idx.runs(), 1, "100 blocks in one event: one node");
    // Another engine shares the first 40 blocks, then goes its own way: the node splits
    // once, and the new blocks are one more node.
    let mut other = tokens[..80].to_vec();
    other.extend(1000..1040u32);
    let other_hashes: Vec<u64> = (500..560).collect();
    store(
        &mut idx,
        at(1, 0),
        &other_hashes,
        None,
        &other,
        Tier::Device,
    )
    .unwrap();
    assert_eq!(idx.runs(), 3);
    assert_eq!(run_of(&idx, &tokens, 0), [100, 0, 0]);
    assert_eq!(run_of(&idx, &tokens, 1), [40, 0, 0]);
    assert_eq!(run_of(&idx, &other, 1), [60, 0, 0]);
    // The conversation goes on: a later event appends to the leaf run.
    let mut longer = tokens.clone();
    longer.extend(5000..5020u32);
    store(
        &mut idx,
        at(0, 0),
        &[100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
        Some(99),
        &longer[200..],
        Tier::Device,
    )
    .unwrap();
    assert_eq!(idx.runs(), 3, "appended in place");
    assert_eq!(run_of(&idx, &longer, 0), [110, 0, 0]);
    // Removing the other engine's blocks leaf first takes its node away again.
    let rev: Vec<u64> = other_hashes.iter().rev().copied().collect();
    idx.apply_removed(at(1, 0), &rev, None);
    assert_eq!(idx.len(), 110);
    assert_eq!(idx.runs(), 2, "the branch is pruned; the split stays");
    assert_bookkeeping(&idx);
}

#[test]
fn runs_under_a_wide_parent_come_and_go_in_any_order() {
    // One shared first block and 300 runs under it (a system prompt and its
    // conversations): removing them in an order unlike their arrival keeps every
    // child's place in its parent right.
    let mut idx = index(100_000);
    let root = [7u32, 7];
    store(&mut idx, at(0, 0), &[1], None, &root, Tier::Device).unwrap();
    for c in 0..300u32 {
        let tokens = [c + 100, c + 100, c + 100, c + 101];
        let hashes = [10_000 + u64::from(c) * 2, 10_001 + u64::from(c) * 2];
        store(&mut idx, at(0, 0), &hashes, Some(1), &tokens, Tier::Device).unwrap();
    }
    assert_eq!(idx.runs(), 301);
    assert_bookkeeping(&idx);
    for c in (0..300u32).map(|i| (i * 7) % 300) {
        let hashes = [10_001 + u64::from(c) * 2, 10_000 + u64::from(c) * 2];
        idx.apply_removed(at(0, 0), &hashes, None);
        if c % 50 == 0 {
            assert_bookkeeping(&idx);
        }
    }
    assert_eq!(idx.len(), 1);
    assert_eq!(idx.runs(), 1);
    assert_bookkeeping(&idx);
}

#[test]
fn a_run_trimmed_back_gives_its_storage_back() {
    let mut idx = index(100_000);
    let tokens: Vec<u32> = (0..2000).collect();
    let hashes: Vec<u64> = (0..1000).collect();
    store(&mut idx, at(0, 0), &hashes, None, &tokens, Tier::Device).unwrap();
    let leaf_first: Vec<u64> = (10..1000).rev().collect();
    idx.apply_removed(at(0, 0), &leaf_first, None);
    assert_eq!(idx.len(), 10);
    let node = idx.nodes.iter().find(|n| n.is_live()).expect("one run");
    assert!(
        node.keys.capacity() < 40,
        "keys hold {}",
        node.keys.capacity()
    );
    let cover = &node.covers[0];
    assert!(
        cover.engine_hashes.capacity() < 40,
        "engine hashes hold {}",
        cover.engine_hashes.capacity()
    );
    assert_bookkeeping(&idx);
}

#[test]
fn ranks_with_different_runs_share_one_walk() {
    let mut idx = index(10_000);
    let tokens: Vec<u32> = (0..64).collect();
    let hashes: Vec<u64> = (0..32).collect();
    // Worker w holds the first 2 * w + 1 blocks (worker 15 holds all 32... capped).
    for w in 0..16u32 {
        let n = (2 * w as usize + 1).min(32);
        store(
            &mut idx,
            at(w, 0),
            &hashes[..n],
            None,
            &tokens[..n * BS as usize],
            Tier::Device,
        )
        .unwrap();
    }
    let keys = idx.hasher().block_keys(&tokens);
    let scores = idx.overlaps(&keys);
    for w in 0..16u32 {
        let n = (2 * w + 1).min(32);
        assert_eq!(
            scores.best_for(WorkerId(w)).map(|o| o.blocks),
            Some([n, 0, 0])
        );
    }
    assert_eq!(scores.longest, 31);
}

#[test]
fn eviction_takes_leaves_first_and_never_leaves_a_hole() {
    let mut idx = index(5);
    let tokens: Vec<u32> = (0..10).collect();
    store(
        &mut idx,
        at(0, 0),
        &[10, 11, 12, 13, 14],
        None,
        &tokens,
        Tier::Device,
    )
    .unwrap();
    // Newer root blocks exceed the cap: the chain's tip goes, not its (older) root,
    // and then its new tip.
    store(&mut idx, at(0, 0), &[20], None, &[50, 50], Tier::Device).unwrap();
    store(&mut idx, at(0, 0), &[21], None, &[51, 51], Tier::Device).unwrap();
    assert_eq!(idx.len(), 5);
    assert_eq!(idx.stats().evicted_blocks, 2);
    assert_eq!(run_of(&idx, &tokens, 0), [3, 0, 0]);
    assert_eq!(run_of(&idx, &[50, 50], 0), [1, 0, 0]);
    assert_eq!(run_of(&idx, &[51, 51], 0), [1, 0, 0]);
    assert_bookkeeping(&idx);
}

#[test]
fn lower_tier_blocks_count_on_their_tier() {
    let mut idx = index(1000);
    let tokens = [1, 2, 3, 4, 5, 6];
    store(
        &mut idx,
        at(0, 0),
        &[10, 11, 12],
        None,
        &tokens,
        Tier::Device,
    )
    .unwrap();
    store(
        &mut idx,
        at(0, 0),
        &[12],
        Some(11),
        &tokens[4..],
        Tier::Host,
    )
    .unwrap();
    idx.apply_removed(at(0, 0), &[12], Some(Tier::Device));
    assert_eq!(run_of(&idx, &tokens, 0), [2, 1, 0]);
    idx.apply_removed(at(0, 0), &[12], None);
    assert_eq!(run_of(&idx, &tokens, 0), [2, 0, 0]);
    assert_bookkeeping(&idx);
}

// ---------------------------------------------------------------------------
// Property test against a reference model.

/// Reference: per worker rank, the set of holders `(key, tier) → engine hash`.
#[derive(Default)]
struct Model {
    holders: BTreeMap<WorkerRef, BTreeMap<(BlockKey, Tier), u64>>,
}

impl Model {
    fn key_of(&self, a: WorkerRef, eh: u64) -> Option<BlockKey> {
        self.holders
            .get(&a)?
            .iter()
            .find(|(_, h)| **h == eh)
            .map(|((k, _), _)| *k)
    }

    fn store(
        &mut self,
        a: WorkerRef,
        hashes: &[u64],
        parent: Option<u64>,
        tokens: &[u32],
        tier: Tier,
    ) {
        let h = hasher();
        let mut parent_key = match parent {
            None => None,
            Some(p) => match self.key_of(a, p) {
                Some(k) => Some(k),
                None => return,
            },
        };
        let held = self.holders.entry(a).or_default();
        for (eh, block) in hashes.iter().zip(tokens.chunks_exact(BS as usize)) {
            let key = h.chain(parent_key, block);
            held.retain(|(k, _), e| !(*e == *eh && *k != key));
            held.insert((key, tier), *eh);
            parent_key = Some(key);
        }
    }

    fn remove(&mut self, a: WorkerRef, hashes: &[u64], tier: Option<Tier>) {
        if let Some(held) = self.holders.get_mut(&a) {
            for eh in hashes {
                held.retain(|(_, t), e| !(*e == *eh && tier.is_none_or(|x| x == *t)));
            }
        }
    }

    fn blocks(&self, a: WorkerRef) -> Vec<(BlockKey, Tier)> {
        self.holders
            .get(&a)
            .map(|h| h.keys().copied().collect())
            .unwrap_or_default()
    }

    fn overlap(&self, a: WorkerRef, keys: &[BlockKey]) -> [u32; 3] {
        let mut out = [0u32; 3];
        let Some(held) = self.holders.get(&a) else {
            return out;
        };
        for key in keys {
            let best = Tier::ALL.iter().find(|t| held.contains_key(&(*key, **t)));
            match best {
                Some(t) => out[t.index()] += 1,
                None => break,
            }
        }
        out
    }
}

#[derive(Clone, Debug)]
enum Op {
    Store {
        w: u32,
        r: u32,
        seq: usize,
        start: usize,
        len: usize,
        tier: Tier,
        bogus_parent: bool,
    },
    /// Removes `len` consecutive blocks of a sequence in one event, leaf first (as
    /// engines evict) or root first; `bogus` puts an unknown hash in the middle.
    Remove {
        w: u32,
        r: u32,
        seq: usize,
        block: usize,
        len: usize,
        leaf_first: bool,
        tier: Option<Tier>,
        bogus: bool,
    },
    Clear {
        w: u32,
        r: u32,
    },
    RemoveWorker {
        w: u32,
    },
}

fn tier_strategy() -> impl Strategy<Value = Tier> {
    prop_oneof![4 => Just(Tier::Device), 1 => Just(Tier::Host), 1 => Just(Tier::Disk)]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..3u32, 0..2u32, 0..4usize, 0..6usize, 1..4usize, tier_strategy(), prop::bool::weighted(0.05))
            .prop_map(|(w, r, seq, start, len, tier, bogus_parent)| Op::Store { w, r, seq, start, len, tier, bogus_parent }),
        3 => (0..3u32, 0..2u32, 0..4usize, 0..8usize, 1..4usize, prop::bool::weighted(0.7), prop::option::of(tier_strategy()), prop::bool::weighted(0.1))
            .prop_map(|(w, r, seq, block, len, leaf_first, tier, bogus)| Op::Remove { w, r, seq, block, len, leaf_first, tier, bogus }),
        1 => (0..3u32, 0..2u32).prop_map(|(w, r)| Op::Clear { w, r }),
        1 => (0..3u32).prop_map(|w| Op::RemoveWorker { w }),
    ]
}

/// Token content of the test sequences: sequences 0 and 1 share their first 3 blocks.
fn sequence(seq: usize) -> Vec<u32> {
    let mut t: Vec<u32> = (0..16).map(|i| (seq as u32 * 100) + i).collect();
    if seq == 1 {
        t[..6].copy_from_slice(&[0, 1, 2, 3, 4, 5]);
    }
    t
}

/// What an engine would call block `b` of `seq` on worker `w`: content-derived but
/// worker-specific and opaque, like vLLM's seeded hashes.
fn engine_hash(w: u32, seq: usize, b: usize) -> u64 {
    let tokens = sequence(seq);
    let key = hasher().block_keys(&tokens[..(b + 1) * BS as usize])[b];
    key.0.rotate_left(7) ^ u64::from(w).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// Applies one operation to the index and to the model.
fn apply_op(idx: &mut PrefixIndex, model: &mut Model, op: Op) {
    apply_op_in_slices(idx, model, op, usize::MAX);
}

/// [`apply_op`], its stores and removals applied `slice` blocks at a time, as a writer
/// of a shared index does ([`WRITE_SLICE_BLOCKS`]).
fn apply_op_in_slices(idx: &mut PrefixIndex, model: &mut Model, op: Op, slice: usize) {
    match op {
        Op::Store {
            w,
            r,
            seq,
            start,
            len,
            tier,
            bogus_parent,
        } => {
            let tokens = sequence(seq);
            let end = (start + len).min(8);
            if start >= end {
                return;
            }
            let hashes: Vec<u64> = (start..end).map(|b| engine_hash(w, seq, b)).collect();
            let parent = if bogus_parent {
                Some(12345)
            } else if start > 0 {
                Some(engine_hash(w, seq, start - 1))
            } else {
                None
            };
            let toks = &tokens[start * BS as usize..end * BS as usize];
            let blocks = StoredBlocks {
                engine_hashes: &hashes,
                parent_engine_hash: parent,
                token_ids: toks,
                block_size: BS,
                tier,
                lora_name: None,
                blocks_after: 0,
            };
            for part in blocks.slices(slice) {
                if idx.apply_stored(at(w, r), &part).is_err() {
                    break;
                }
            }
            model.store(at(w, r), &hashes, parent, toks, tier);
        }
        Op::Remove {
            w,
            r,
            seq,
            block,
            len,
            leaf_first,
            tier,
            bogus,
        } => {
            let end = (block + len).min(8);
            let mut hashes: Vec<u64> = (block..end).map(|b| engine_hash(w, seq, b)).collect();
            if leaf_first {
                hashes.reverse();
            }
            if bogus {
                hashes.insert(hashes.len() / 2, 999_999);
            }
            for part in hashes.chunks(slice) {
                idx.apply_removed(at(w, r), part, tier);
            }
            model.remove(at(w, r), &hashes, tier);
        }
        Op::Clear { w, r } => {
            idx.clear(at(w, r));
            model.holders.remove(&at(w, r));
        }
        Op::RemoveWorker { w } => {
            idx.remove_worker(WorkerId(w));
            model.holders.retain(|a, _| a.worker != WorkerId(w));
        }
    }
}

/// Under a cap the index holds a subset of the model (evictions), and its lookups are
/// exact for what it does hold: a model rebuilt from its own holdings agrees.
fn assert_exact_subset(idx: &PrefixIndex, model: &Model, cap: usize) -> Result<(), TestCaseError> {
    prop_assert!(idx.len() <= cap);
    let mut own = Model::default();
    for w in 0..3 {
        for r in 0..2 {
            let a = at(w, r);
            let held = idx.worker_blocks(a);
            let model_blocks: BTreeSet<(BlockKey, Tier)> = model.blocks(a).into_iter().collect();
            for b in &held {
                prop_assert!(
                    model_blocks.contains(b),
                    "{:?} holds {:?} the model does not",
                    a,
                    b
                );
            }
            own.holders
                .insert(a, held.into_iter().map(|b| (b, 0)).collect());
        }
    }
    for w in 0..3 {
        for r in 0..2 {
            let a = at(w, r);
            for seq in 0..4 {
                let keys = hasher().block_keys(&sequence(seq));
                let got = idx
                    .overlaps(&keys)
                    .per_ref
                    .iter()
                    .find(|o| o.at == a)
                    .map_or([0; 3], |o| o.blocks);
                prop_assert_eq!(got, own.overlap(a, &keys), "worker {:?} seq {}", a, seq);
            }
        }
    }
    Ok(())
}

/// `got` holds what `want` holds: as many entries, the same blocks per worker rank
/// under test, and the same overlaps with every test sequence.
fn assert_same_holdings(got: &PrefixIndex, want: &PrefixIndex) -> Result<(), TestCaseError> {
    prop_assert_eq!(got.len(), want.len());
    for w in 0..3 {
        for r in 0..2 {
            let a = at(w, r);
            prop_assert_eq!(got.worker_blocks(a), want.worker_blocks(a));
            for seq in 0..4 {
                let keys = hasher().block_keys(&sequence(seq));
                let of = |idx: &PrefixIndex| {
                    idx.overlaps(&keys)
                        .per_ref
                        .iter()
                        .find(|o| o.at == a)
                        .map_or([0; 3], |o| o.blocks)
                };
                prop_assert_eq!(of(got), of(want), "worker {:?} seq {}", a, seq);
            }
        }
    }
    Ok(())
}

/// An index where `n` other worker ranks already hold the first two blocks of the test
/// sequences, so the ranks under test get slot numbers from `n` on (slots past 63 live
/// in an entry's wide part) and share entries with many holders.
fn index_with_bystanders(n: u32) -> PrefixIndex {
    let mut idx = index(1_000_000);
    for i in 0..n {
        let seq = (i % 4) as usize;
        let hashes = [5_000_000 + u64::from(i) * 2, 5_000_001 + u64::from(i) * 2];
        let tokens = sequence(seq);
        store(
            &mut idx,
            at(1000 + i, 0),
            &hashes,
            None,
            &tokens[..2 * BS as usize],
            Tier::Device,
        )
        .expect("bystander store");
    }
    idx
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn index_matches_reference_model(
        ops in prop::collection::vec(op_strategy(), 1..60),
        bystanders in prop::sample::select(vec![0u32, 63, 130]),
    ) {
        let mut idx = index_with_bystanders(bystanders);
        let mut model = Model::default();
        for op in ops {
            apply_op(&mut idx, &mut model, op);
            assert_bookkeeping(&idx);
        }
        let mut total = 0;
        for w in 0..3 {
            for r in 0..2 {
                let a = at(w, r);
                prop_assert_eq!(idx.worker_blocks(a), model.blocks(a));
                total += model.blocks(a).len();
                for seq in 0..4 {
                    let keys = hasher().block_keys(&sequence(seq));
                    let got = idx.overlaps(&keys).per_ref.iter().find(|o| o.at == a).map_or([0; 3], |o| o.blocks);
                    prop_assert_eq!(got, model.overlap(a, &keys), "worker {:?} seq {}", a, seq);
                }
            }
        }
        prop_assert_eq!(idx.len(), total + 2 * bystanders as usize);
    }

    #[test]
    fn lookups_stay_exact_under_a_small_cap(ops in prop::collection::vec(op_strategy(), 1..60), cap in 1..12usize) {
        let mut idx = index(cap);
        let mut model = Model::default();
        for op in ops {
            apply_op(&mut idx, &mut model, op);
            assert_bookkeeping(&idx);
            assert_exact_subset(&idx, &model, cap)?;
        }
    }

    /// A router that loads another's snapshot of every worker rank, then applies the
    /// same later events, ends up with the same index: the snapshot carries what the
    /// events need (engine hashes, parents), and rebuilding keeps the bookkeeping
    /// (child counts, orphans) consistent, also between the slices of an import placed
    /// a few blocks at a time (a shared index's writer letting lookups in between).
    #[test]
    fn a_loaded_snapshot_continues_like_the_original(
        before in prop::collection::vec(op_strategy(), 1..40),
        after in prop::collection::vec(op_strategy(), 0..40),
        slice in prop::sample::select(vec![1usize, 2, 5, usize::MAX]),
    ) {
        let mut original = index(1_000_000);
        let mut model = Model::default();
        for op in before {
            apply_op(&mut original, &mut model, op);
        }
        let mut loaded = index(1_000_000);
        for w in 0..3 {
            for r in 0..2 {
                let blocks = original.export_worker(at(w, r));
                let paths = original.hole_paths(at(w, r));
                let mut import = SnapshotImport::new(&blocks, &paths);
                while !loaded.import_some(at(w, r), &mut import, slice) {
                    assert_bookkeeping(&loaded);
                }
                prop_assert_eq!(import.held(), original.worker_blocks(at(w, r)).len());
            }
        }
        assert_bookkeeping(&loaded);
        let mut model_copy = Model { holders: model.holders.clone() };
        for op in after {
            apply_op(&mut original, &mut model, op.clone());
            apply_op(&mut loaded, &mut model_copy, op);
            assert_bookkeeping(&loaded);
        }
        assert_same_holdings(&loaded, &original)?;
    }

    /// An event applied in slices (a shared index's writer letting lookups in between)
    /// leaves the index as the whole event does: the same holdings, overlaps and counts.
    #[test]
    fn events_applied_in_slices_leave_the_index_as_whole_ones(
        ops in prop::collection::vec(op_strategy(), 1..60),
        slice in 1..4usize,
    ) {
        let (mut whole, mut sliced) = (index(1_000_000), index(1_000_000));
        let (mut model, mut model_copy) = (Model::default(), Model::default());
        for op in ops {
            apply_op(&mut whole, &mut model, op.clone());
            apply_op_in_slices(&mut sliced, &mut model_copy, op, slice);
            assert_bookkeeping(&sliced);
        }
        prop_assert_eq!(sliced.stats().stored_blocks, whole.stats().stored_blocks);
        prop_assert_eq!(sliced.stats().removed_blocks, whole.stats().removed_blocks);
        prop_assert_eq!(sliced.stats().unknown_parents, whole.stats().unknown_parents);
        assert_same_holdings(&sliced, &whole)?;
    }

    /// Without engine removals, no hole can appear: eviction only takes leaves.
    #[test]
    fn eviction_never_creates_holes(ops in prop::collection::vec(op_strategy(), 1..60), cap in 1..12usize) {
        let mut idx = index(cap);
        let mut model = Model::default();
        for op in ops.into_iter().filter(|op| !matches!(op, Op::Remove { .. })) {
            apply_op(&mut idx, &mut model, op);
            prop_assert!(!has_hole(&idx), "eviction left a hole");
            assert_exact_subset(&idx, &model, cap)?;
        }
    }
}
