//! Decoding and applying the real vLLM 0.32 captures in fixtures/vllm-0.32/.

mod common;

use common::*;
use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, Tier, WorkerId, WorkerRef};
use kvgate_events::replay::{parse_replay_frames, END_SEQ};
use kvgate_events::{apply_batch, decode_batch, KvEvent};

fn index32() -> PrefixIndex {
    PrefixIndex::new(BlockHasher::new(32).unwrap(), IndexConfig::default())
}

const AT: WorkerRef = WorkerRef {
    worker: WorkerId(7),
    dp_rank: 0,
};

fn stored_tokens(payload: &[u8]) -> Vec<u32> {
    let b = decode_batch(payload).unwrap();
    b.events
        .iter()
        .find_map(|e| match e {
            KvEvent::BlockStored(s) => Some(s.token_ids.clone()),
            _ => None,
        })
        .unwrap()
}

#[test]
fn every_pub_capture_decodes_as_the_json_says() {
    let msgs = pub_messages();
    assert_eq!(msgs.len(), 9);
    let json: serde_json::Value =
        serde_json::from_slice(&fixture("vllm-0.32-pub-frames.decoded.json")).unwrap();
    for ((seq, payload), want) in msgs.iter().zip(json.as_array().unwrap()) {
        assert_eq!(*seq, want["seq"].as_u64().unwrap());
        let b = decode_batch(payload).unwrap();
        let p = &want["payload"];
        assert_eq!(b.ts, p[0].as_f64().unwrap());
        assert_eq!(b.dp_rank, Some(0));
        assert_eq!(b.unknown_events, 0);
        let events = p[1].as_array().unwrap();
        assert_eq!(b.events.len(), events.len());
        for (got, want) in b.events.iter().zip(events) {
            let hashes: Vec<u64> = want["block_hashes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect();
            match (got, want["type"].as_str().unwrap()) {
                (KvEvent::BlockStored(s), "BlockStored") => {
                    assert_eq!(s.block_hashes, hashes);
                    assert_eq!(s.parent_block_hash, want["parent_block_hash"].as_u64());
                    let toks: Vec<u32> = want["token_ids"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_u64().unwrap() as u32)
                        .collect();
                    assert_eq!(s.token_ids, toks);
                    assert_eq!(s.block_size, 32);
                    assert_eq!(s.medium.as_deref(), Some("GPU"));
                    assert_eq!(s.lora_name, None);
                    assert_eq!(s.lora_id, None);
                    assert!(s.extra_keys.is_empty(), "all-null extra keys collapse");
                    assert_eq!(s.group_idx, Some(0));
                    assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
                }
                (KvEvent::BlockRemoved(r), "BlockRemoved") => {
                    assert_eq!(r.block_hashes, hashes);
                    assert_eq!(r.medium.as_deref(), Some("GPU"));
                    assert_eq!(r.group_idx, Some(0));
                }
                (g, w) => panic!("decoded {g:?}, capture says {w}"),
            }
        }
    }
    // Hashes above i64::MAX survive.
    let b = decode_batch(&msgs[0].1).unwrap();
    let KvEvent::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(s.block_hashes[1], 16757920041695501639);
}

#[test]
fn clear_captures_begin_with_all_blocks_cleared() {
    let msgs = clear_messages();
    assert_eq!(msgs.iter().map(|m| m.0).collect::<Vec<_>>(), vec![9, 10]);
    for (_, payload) in &msgs {
        let b = decode_batch(payload).unwrap();
        assert_eq!(b.events[0], KvEvent::AllBlocksCleared);
        assert!(matches!(b.events[1], KvEvent::BlockStored(_)));
    }
}

#[test]
fn replay_capture_matches_the_live_stream() {
    let live = pub_messages();
    let replay = frames_of("vllm-0.32-replay-from-seq1.msgpack");
    assert_eq!(replay.len(), 9);
    let mut seqs = Vec::new();
    for frames in &replay {
        let frames: Vec<bytes::Bytes> = frames.iter().map(|f| f.clone().into()).collect();
        let (seq, payload) = parse_replay_frames(&frames).unwrap();
        if seq == END_SEQ {
            assert!(payload.is_empty());
            continue;
        }
        seqs.push(seq);
        assert_eq!(payload.as_ref(), live[seq as usize].1.as_slice());
        decode_batch(&payload).unwrap();
    }
    assert_eq!(seqs, (1..=8).collect::<Vec<_>>());
    assert_eq!(seq_of(&replay[8][2]), END_SEQ);
}

fn overlap(index: &PrefixIndex, keys: &[kvgate_core::BlockKey]) -> u32 {
    index
        .overlaps(keys)
        .best_for(AT.worker)
        .map_or(0, |o| o.blocks[Tier::Device.index()])
}

#[test]
fn applying_the_captures_gives_the_cache_vllm_had() {
    let msgs = pub_messages();
    let mut index = index32();
    let hasher = *index.hasher();

    // The three chat prompts: 208 tokens = 6 full blocks each, sharing 5.
    let req1 = stored_tokens(&msgs[0].1);
    let mut req2 = req1[..160].to_vec();
    req2.extend(stored_tokens(&msgs[1].1));
    let mut req3 = req1[..160].to_vec();
    req3.extend(stored_tokens(&msgs[2].1));
    let (k1, k2, k3) = (
        hasher.block_keys(&req1),
        hasher.block_keys(&req2),
        hasher.block_keys(&req3),
    );
    assert_eq!(k1[..5], k2[..5]);
    assert_eq!(k1[..5], k3[..5]);
    assert_ne!(k1[5], k2[5]);

    let o = apply_batch(&mut index, AT, &decode_batch(&msgs[0].1).unwrap());
    assert_eq!(o.blocks_stored, 6);
    // vLLM reported cached_tokens = 160 for requests 2 and 3: 5 blocks of 32.
    assert_eq!(overlap(&index, &k2) * 32, 160);
    assert_eq!(overlap(&index, &k3) * 32, 160);
    for (_, p) in &msgs[1..3] {
        let o = apply_batch(&mut index, AT, &decode_batch(p).unwrap());
        assert_eq!((o.blocks_stored, o.unknown_parents), (1, 0));
    }
    assert_eq!(index.worker_len(AT), 8, "5 shared + 3 distinct chat blocks");
    for k in [&k1, &k2, &k3] {
        assert_eq!(overlap(&index, k), 6);
    }

    let mut total = kvgate_events::ApplyOutcome::default();
    for (_, p) in &msgs[3..] {
        total.merge(&apply_batch(&mut index, AT, &decode_batch(p).unwrap()));
    }
    assert_eq!(total.blocks_stored, 60);
    assert_eq!(total.blocks_removed, 22);
    assert_eq!(total.unknown_removals, 0);
    assert_eq!(total.block_size_mismatches, 0);

    // Evictions removed every chat block, all of completion 1 and the tail of
    // completion 2; completions 3..6 are whole.
    for k in [&k1, &k2, &k3] {
        assert_eq!(overlap(&index, k), 0);
    }
    let comp = |i: usize| hasher.block_keys(&stored_tokens(&msgs[i].1));
    assert_eq!(overlap(&index, &comp(3)), 0);
    assert_eq!(overlap(&index, &comp(4)), 6);
    for i in 5..9 {
        assert_eq!(overlap(&index, &comp(i)), 10);
    }
    assert_eq!(index.worker_len(AT), 46);
    let mut expected: Vec<_> = comp(4)[..6].to_vec();
    for i in 5..9 {
        expected.extend(comp(i));
    }
    expected.sort();
    let got: Vec<_> = index
        .worker_blocks(AT)
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(got, expected);

    // reset_prefix_cache: AllBlocksCleared (twice), each followed by a new store.
    let clears = clear_messages();
    let o = apply_batch(&mut index, AT, &decode_batch(&clears[0].1).unwrap());
    assert_eq!((o.clears, o.cleared_entries, o.blocks_stored), (1, 46, 2));
    assert_eq!(index.worker_len(AT), 2);
    let o = apply_batch(&mut index, AT, &decode_batch(&clears[1].1).unwrap());
    assert_eq!((o.clears, o.cleared_entries, o.blocks_stored), (1, 2, 1));
    assert_eq!(index.worker_len(AT), 1);
}

#[test]
fn block_size_mismatch_is_reported_not_dropped_silently() {
    let msgs = pub_messages();
    let mut index = PrefixIndex::new(BlockHasher::new(16).unwrap(), IndexConfig::default());
    let o = apply_batch(&mut index, AT, &decode_batch(&msgs[0].1).unwrap());
    assert_eq!(o.block_size_mismatches, 1);
    assert_eq!(o.mismatched_block_size, Some(32));
    assert_eq!(o.blocks_stored, 0);

    let metrics = kvgate_events::EventMetrics::new();
    let c = metrics.worker(AT.worker);
    c.record(AT, 16, &o);
    c.record(AT, 16, &o);
    let snap = metrics.snapshot();
    assert_eq!(snap.workers[0].block_size_mismatches, 2);
    assert_eq!(snap.workers[0].mismatched_block_size, Some(32));
}
