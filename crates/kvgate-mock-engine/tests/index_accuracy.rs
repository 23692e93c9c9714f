//! Index-accuracy check: the engine's KV event stream, encoded on the vLLM wire
//! format and decoded by kvgate's own ingestion (kvgate-events → kvgate-core
//! PrefixIndex), reproduces the engine's cache contents exactly after every step,
//! through evictions, preemptions, aborts and a reset.

use std::collections::{HashMap, HashSet};

use kvgate_core::{BlockHasher, BlockKey, IndexConfig, PrefixIndex, WorkerId, WorkerRef};
use kvgate_mock_engine::cache::EngineHasher;
use kvgate_mock_engine::wire::encode_batch;
use kvgate_mock_engine::{KvEvent, SimConfig, SimRequest, Simulator};

const BS: u32 = 16;

/// engine hash -> kvgate key, computed independently from the token sequences.
fn expected_keys(seed: u64, seqs: &[Vec<u32>]) -> HashMap<u64, BlockKey> {
    let mut eh = EngineHasher::new(seed);
    let kh = BlockHasher::new(BS).unwrap();
    let mut map = HashMap::new();
    for seq in seqs {
        let (mut pe, mut pk) = (None, None);
        for chunk in seq.chunks_exact(BS as usize) {
            let e = eh.block_hash(pe, chunk);
            let k = kh.chain(pk, chunk);
            map.insert(e, k);
            pe = Some(e);
            pk = Some(k);
        }
    }
    map
}

#[test]
fn kvgate_ingestion_reproduces_the_engine_cache() {
    let cfg = SimConfig {
        block_size: BS,
        num_blocks: 48,
        max_num_seqs: 6,
        max_batched_tokens: 128,
        seed: 42,
        ..SimConfig::default()
    };
    let outputs = cfg.output_tokens.clone();
    let mut sim = Simulator::new(cfg).unwrap();
    let at = WorkerRef {
        worker: WorkerId(3),
        dp_rank: 0,
    };
    let mut index = PrefixIndex::new(BlockHasher::new(BS).unwrap(), IndexConfig::default());
    let mut seqs = Vec::new();
    let mut ids = Vec::new();
    let shared: Vec<u32> = (0..150).collect();
    for i in 0..30u32 {
        let mut prompt = if i % 3 == 0 {
            shared.clone()
        } else {
            Vec::new()
        };
        prompt.extend((0..(40 + (i * 37) % 200)).map(|t| 5_000 + i * 1_000 + t));
        let max_tokens = 10 + (i * 13) % 60;
        let mut full = prompt.clone();
        full.extend((0..max_tokens as usize).map(|k| outputs[k % outputs.len()]));
        seqs.push(full);
        ids.push(
            sim.submit(SimRequest {
                prompt,
                max_tokens,
                ignore_eos: true,
                transferred_tokens: 0,
            })
            .unwrap(),
        );
    }
    let map = expected_keys(42, &seqs);
    let mut saw = HashSet::new();
    let mut steps = 0;
    let apply = |index: &mut PrefixIndex, events: &[KvEvent], saw: &mut HashSet<&'static str>| {
        for e in events {
            saw.insert(match e {
                KvEvent::BlockStored { .. } => "stored",
                KvEvent::BlockRemoved { .. } => "removed",
                KvEvent::AllBlocksCleared => "cleared",
            });
        }
        let payload = encode_batch(1.0, events, 0).unwrap();
        let batch = kvgate_events::decode_batch(&payload).unwrap();
        let out = kvgate_events::apply_batch(index, at, &batch);
        assert_eq!(out.unknown_parents, 0);
        assert_eq!(out.unknown_removals, 0);
        assert_eq!(out.token_count_mismatches + out.block_size_mismatches, 0);
        assert_eq!(
            out.skipped_extra_keys + out.skipped_group + out.unknown_events,
            0
        );
    };
    let check = |sim: &Simulator, index: &PrefixIndex| {
        let cached = sim.cache().cached_hashes();
        let expected: HashSet<BlockKey> = cached.iter().map(|h| map[h]).collect();
        let actual: HashSet<BlockKey> = index
            .worker_blocks(at)
            .into_iter()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(actual, expected);
        for h in cached {
            assert_eq!(index.key_of(at, h), Some(map[&h]));
        }
    };
    while let Some(step) = sim.step() {
        steps += 1;
        if !step.events.is_empty() {
            apply(&mut index, &step.events, &mut saw);
        }
        check(&sim, &index);
        if steps == 40 {
            assert!(sim.abort(ids[29]));
        }
    }
    assert!(
        sim.snapshot().counters.preemptions > 0,
        "workload should preempt"
    );
    assert!(saw.contains("stored") && saw.contains("removed"));
    // Reset: index follows.
    let ev = sim.reset_prefix_cache(false).unwrap();
    apply(&mut index, &ev, &mut saw);
    check(&sim, &index);
    assert_eq!(index.worker_len(at), 0);
    // The router's overlap for a shared-prefix request equals the engine's own probe.
    sim.submit(SimRequest {
        prompt: shared.clone(),
        max_tokens: 1,
        ignore_eos: true,
        transferred_tokens: 0,
    })
    .unwrap();
    while let Some(step) = sim.step() {
        apply(&mut index, &step.events, &mut saw);
    }
    let mut probe = shared.clone();
    probe.push(1);
    let engine_hit = sim.probe_prefix(&probe);
    let keys = BlockHasher::new(BS).unwrap().block_keys(&probe);
    let overlap = index
        .overlaps(&keys)
        .best_for(WorkerId(3))
        .map(|o| o.blocks[0])
        .unwrap_or(0);
    assert_eq!(overlap * BS, engine_hit);
    assert!(engine_hit > 0);
}
