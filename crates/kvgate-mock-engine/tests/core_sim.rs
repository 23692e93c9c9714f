//! Behaviour of the pure simulation core: prefix hits, eviction events, preemption,
//! determinism in virtual time.

use std::collections::{HashMap, HashSet};

use kvgate_mock_engine::scheduler::FinishReason;
use kvgate_mock_engine::{run_virtual, KvEvent, SimConfig, SimRequest, Simulator, TimedRequest};

fn cfg(num_blocks: u32, block_size: u32) -> SimConfig {
    SimConfig {
        block_size,
        num_blocks,
        max_num_seqs: 8,
        max_batched_tokens: 64,
        seed: 7,
        ..SimConfig::default()
    }
}

fn req(prompt: Vec<u32>, max_tokens: u32) -> SimRequest {
    SimRequest {
        prompt,
        max_tokens,
        ignore_eos: true,
        transferred_tokens: 0,
    }
}

/// Apply events to a hash set, checking they are self-consistent.
#[derive(Default)]
struct Shadow {
    blocks: HashSet<u64>,
    stored: u64,
    removed: Vec<u64>,
}

impl Shadow {
    fn apply(&mut self, events: &[KvEvent]) {
        for e in events {
            match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size,
                } => {
                    assert_eq!(token_ids.len(), block_hashes.len() * *block_size as usize);
                    if let Some(p) = parent_block_hash {
                        assert!(self.blocks.contains(p), "parent {p} not cached");
                    }
                    for h in block_hashes {
                        assert!(self.blocks.insert(*h), "stored twice: {h}");
                        self.stored += 1;
                    }
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for h in block_hashes {
                        assert!(self.blocks.remove(h), "removed unknown {h}");
                        self.removed.push(*h);
                    }
                }
                KvEvent::AllBlocksCleared => self.blocks.clear(),
            }
        }
    }

    fn assert_matches(&self, sim: &Simulator) {
        let cached: HashSet<u64> = sim.cache().cached_hashes().into_iter().collect();
        assert_eq!(cached, self.blocks);
    }
}

fn run_to_idle(sim: &mut Simulator, shadow: &mut Shadow) -> HashMap<u64, (u32, u32)> {
    // id -> (cached_tokens, outputs)
    let mut out = HashMap::new();
    while let Some(step) = sim.step() {
        shadow.apply(&step.events);
        shadow.assert_matches(sim);
        for o in step.outputs {
            let e = out.entry(o.id).or_insert((o.cached_tokens, 0));
            e.1 = o.index + 1;
        }
    }
    out
}

#[test]
fn repeated_prompt_hits_its_full_block_prefix() {
    let mut sim = Simulator::new(cfg(64, 16)).unwrap();
    let mut shadow = Shadow::default();
    let prompt: Vec<u32> = (0..100).collect(); // 6 full blocks + 4 tokens
    let a = sim.submit(req(prompt.clone(), 4)).unwrap();
    let r = run_to_idle(&mut sim, &mut shadow);
    assert_eq!(r[&a], (0, 4));
    let b = sim.submit(req(prompt.clone(), 4)).unwrap();
    let r = run_to_idle(&mut sim, &mut shadow);
    assert_eq!(r[&b], (96, 4));
    // A prompt that is an exact multiple of the block size recomputes its last block
    // (vLLM always computes at least one token).
    let exact: Vec<u32> = (1000..1064).collect();
    sim.submit(req(exact.clone(), 2)).unwrap();
    run_to_idle(&mut sim, &mut shadow);
    let c = sim.submit(req(exact, 2)).unwrap();
    let r = run_to_idle(&mut sim, &mut shadow);
    assert_eq!(r[&c].0, 48);
    let snap = sim.snapshot();
    assert_eq!(snap.counters.prefix_hits_tokens, 96 + 48);
}

#[test]
fn shared_prefix_hit_and_parent_hash() {
    let mut sim = Simulator::new(cfg(64, 16)).unwrap();
    let mut shadow = Shadow::default();
    let mut p1: Vec<u32> = (0..40).collect();
    let mut p2 = p1.clone();
    p1.extend(500..540);
    p2.extend(900..940);
    sim.submit(req(p1, 1)).unwrap();
    run_to_idle(&mut sim, &mut shadow);
    let b = sim.submit(req(p2, 1)).unwrap();
    let mut stored_parent = None;
    let mut cached = 0;
    while let Some(step) = sim.step() {
        shadow.apply(&step.events);
        for e in &step.events {
            if let KvEvent::BlockStored {
                parent_block_hash, ..
            } = e
            {
                stored_parent = Some(*parent_block_hash);
            }
        }
        for o in step.outputs {
            if o.id == b {
                cached = o.cached_tokens;
            }
        }
    }
    assert_eq!(cached, 32);
    // The second request's new blocks chain onto the shared second block.
    assert!(matches!(stored_parent, Some(Some(_))));
    shadow.assert_matches(&sim);
}

#[test]
fn eviction_reports_exactly_the_evicted_blocks_lru_first() {
    // 8 blocks of 4 tokens. Request A caches 3 blocks; B (3 blocks) fits in the 5
    // empty blocks; C needs 5 blocks, so 2 cached blocks must go: A's, tail first.
    let mut sim = Simulator::new(cfg(8, 4)).unwrap();
    let mut shadow = Shadow::default();
    sim.submit(req((0..13).collect(), 1)).unwrap(); // 3 full blocks + 1 token
    run_to_idle(&mut sim, &mut shadow);
    let a_blocks: HashSet<u64> = shadow.blocks.clone();
    assert_eq!(a_blocks.len(), 3);
    sim.submit(req((100..111).collect(), 1)).unwrap(); // 2 full + 3 tokens
    run_to_idle(&mut sim, &mut shadow);
    assert!(shadow.removed.is_empty());
    assert_eq!(shadow.blocks.len(), 5);
    let before = shadow.blocks.clone();
    sim.submit(req((200..219).collect(), 1)).unwrap(); // 5 blocks (4 full + 3 tokens)
    run_to_idle(&mut sim, &mut shadow);
    assert_eq!(shadow.removed.len(), 2);
    for h in &shadow.removed {
        assert!(a_blocks.contains(h), "evicted a block that was not LRU");
        assert!(!sim.cache().contains(*h));
    }
    // Exactly the removed ones left; everything else from before is still there.
    let still: HashSet<u64> = before
        .difference(&shadow.removed.iter().copied().collect())
        .copied()
        .collect();
    for h in still {
        assert!(sim.cache().contains(h));
    }
    shadow.assert_matches(&sim);
    assert_eq!(sim.cache().stats().evictions, 2);
    // A's first block survives (its tail blocks were evicted first).
    let a_first = sim.probe_prefix(&(0..13).collect::<Vec<_>>());
    assert_eq!(a_first, 4);
}

#[test]
fn preemption_under_block_pressure_finishes_everything_consistently() {
    let mut c = cfg(24, 4);
    c.max_num_seqs = 16;
    c.max_batched_tokens = 32;
    let mut sim = Simulator::new(c).unwrap();
    let mut shadow = Shadow::default();
    let mut ids = Vec::new();
    for i in 0..6u32 {
        let prompt: Vec<u32> = (i * 1000..i * 1000 + 10).collect();
        ids.push(sim.submit(req(prompt, 30)).unwrap());
    }
    let r = run_to_idle(&mut sim, &mut shadow);
    for id in ids {
        assert_eq!(r[&id].1, 30);
    }
    let snap = sim.snapshot();
    assert!(snap.counters.preemptions > 0, "scenario should preempt");
    assert_eq!(snap.running + snap.waiting, 0);
    assert_eq!(sim.cache().num_used(), 0);
    shadow.assert_matches(&sim);
    // Decode blocks (prompt + generated tokens) were cached too.
    assert!(shadow.stored > 6 * 2);
}

#[test]
fn abort_frees_blocks_and_reset_clears() {
    let mut sim = Simulator::new(cfg(32, 4)).unwrap();
    let mut shadow = Shadow::default();
    let id = sim.submit(req((0..20).collect(), 50)).unwrap();
    for _ in 0..3 {
        let s = sim.step().unwrap();
        shadow.apply(&s.events);
    }
    assert!(sim.cache().num_used() > 0);
    assert!(
        sim.reset_prefix_cache(false).is_none(),
        "reset refused while busy"
    );
    assert!(sim.abort(id));
    assert!(!sim.abort(id));
    assert_eq!(sim.cache().num_used(), 0);
    assert!(sim.is_idle());
    let ev = sim.reset_prefix_cache(false).unwrap();
    shadow.apply(&ev);
    assert_eq!(sim.cache().num_cached(), 0);
    shadow.assert_matches(&sim);
}

/// vLLM's `reset_running_requests`: a busy engine preempts its running requests,
/// drops the whole cache (one `AllBlocksCleared`, the shadow index agrees), and the
/// preempted request is recomputed and still finishes.
#[test]
fn reset_with_running_requests_preempts_them_and_they_still_finish() {
    let mut sim = Simulator::new(cfg(32, 4)).unwrap();
    let mut shadow = Shadow::default();
    sim.submit(req((0..20).collect(), 6)).unwrap();
    for _ in 0..2 {
        shadow.apply(&sim.step().unwrap().events);
    }
    assert!(sim.cache().num_used() > 0);
    assert!(
        sim.reset_prefix_cache(false).is_none(),
        "refused while busy"
    );
    let ev = sim
        .reset_prefix_cache(true)
        .expect("preempting resets succeed");
    shadow.apply(&ev);
    assert_eq!(sim.cache().num_cached(), 0);
    assert_eq!(sim.cache().num_used(), 0);
    shadow.assert_matches(&sim);
    let mut steps = 0;
    while let Some(s) = sim.step() {
        shadow.apply(&s.events);
        steps += 1;
        assert!(steps < 100, "the preempted request never finished");
    }
    assert!(sim.is_idle());
    shadow.assert_matches(&sim);
}

#[test]
fn rejects_what_can_never_run() {
    let mut sim = Simulator::new(cfg(4, 4)).unwrap();
    assert!(sim.submit(req(vec![], 1)).is_err());
    assert!(sim.submit(req(vec![1], 0)).is_err());
    assert!(sim.submit(req((0..15).collect(), 2)).is_err());
    assert!(sim.submit(req((0..14).collect(), 2)).is_ok());
}

#[test]
fn eos_is_deterministic_and_honours_ignore_eos() {
    let mut c = cfg(256, 16);
    c.eos_probability = 0.2;
    let reqs = |ignore| {
        (0..10u64)
            .map(|i| TimedRequest {
                arrival_ms: i,
                request: SimRequest {
                    prompt: (0..20).map(|t| t + i as u32 * 100).collect(),
                    max_tokens: 64,
                    ignore_eos: ignore,
                    transferred_tokens: 0,
                },
            })
            .collect::<Vec<_>>()
    };
    let a = run_virtual(c.clone(), reqs(false)).unwrap();
    let b = run_virtual(c.clone(), reqs(false)).unwrap();
    assert_eq!(a, b);
    assert!(a
        .requests
        .iter()
        .any(|r| r.finish_reason == FinishReason::Stop));
    let c2 = run_virtual(c, reqs(true)).unwrap();
    assert!(c2.requests.iter().all(|r| r.output_tokens == 64));
}

fn workload() -> Vec<TimedRequest> {
    let mut out = Vec::new();
    let shared: Vec<u32> = (0..200).collect();
    for i in 0..40u32 {
        let mut prompt = if i % 2 == 0 {
            shared.clone()
        } else {
            Vec::new()
        };
        prompt.extend((0..(50 + i * 7)).map(|t| 10_000 + i * 1000 + t));
        out.push(TimedRequest {
            arrival_ms: (i as u64) * 13,
            request: SimRequest {
                prompt,
                max_tokens: 5 + i % 17,
                ignore_eos: true,
                transferred_tokens: 0,
            },
        });
    }
    out
}

#[test]
fn virtual_time_is_deterministic() {
    let mut c = cfg(128, 16);
    c.max_num_seqs = 6;
    c.max_batched_tokens = 256;
    let a = run_virtual(c.clone(), workload()).unwrap();
    let b = run_virtual(c.clone(), workload()).unwrap();
    assert_eq!(a, b);
    assert!(a.requests.iter().all(|r| r.finish_ms >= r.first_token_ms));
    assert!(a.requests.iter().any(|r| r.cached_tokens > 0));
    assert!(a.batches.iter().any(|b| b
        .events
        .iter()
        .any(|e| matches!(e, KvEvent::BlockRemoved { .. }))));
    // Another seed: different engine hashes, same schedule and timings.
    let mut c2 = c.clone();
    c2.seed = 8;
    let d = run_virtual(c2, workload()).unwrap();
    assert_eq!(a.requests, d.requests);
    assert_ne!(a.batches, d.batches);
}

/// Step jitter (a noisy host) scatters each step's duration around the fit, the same
/// way for the same seed, and changes nothing but time: the same requests finish with
/// the same outputs and hits. Over many steps the factor averages 1.
#[test]
fn step_jitter_scatters_time_only_and_is_deterministic() {
    let mut c = cfg(128, 16);
    c.max_num_seqs = 6;
    c.max_batched_tokens = 256;
    let steady = run_virtual(c.clone(), workload()).unwrap();
    c.latency.step_jitter = 0.5;
    let a = run_virtual(c.clone(), workload()).unwrap();
    assert_eq!(a, run_virtual(c.clone(), workload()).unwrap());
    let work = |r: &kvgate_mock_engine::virtual_time::VirtualRun| {
        r.requests
            .iter()
            .map(|q| (q.output_tokens, q.cached_tokens))
            .collect::<Vec<_>>()
    };
    assert_eq!(work(&a), work(&steady));
    let ttfts = |r: &kvgate_mock_engine::virtual_time::VirtualRun| {
        r.requests
            .iter()
            .map(|q| q.first_token_ms - q.arrival_ms)
            .collect::<Vec<_>>()
    };
    assert_ne!(ttfts(&a), ttfts(&steady));

    let m = c.latency;
    let n = 20_000;
    let unit = kvgate_mock_engine::cache::unit_draw;
    let mean = (0..n)
        .map(|i| m.jitter_factor(|| (unit(2 * i), unit(2 * i + 1))))
        .sum::<f64>()
        / n as f64;
    assert!((mean - 1.0).abs() < 0.05, "mean factor {mean}");
    let none = kvgate_mock_engine::LatencyModel::default();
    assert_eq!(
        none.jitter_factor(|| unreachable!("no jitter, no draws")),
        1.0
    );
}

#[test]
fn uncached_tokens_cost_more_than_cached_ones() {
    let c = cfg(256, 16);
    let prompt: Vec<u32> = (0..1000).collect();
    let mk = |at| TimedRequest {
        arrival_ms: at,
        request: req(prompt.clone(), 1),
    };
    let run = run_virtual(c, vec![mk(0), mk(10_000)]).unwrap();
    let ttft =
        |r: &kvgate_mock_engine::virtual_time::RequestTiming| r.first_token_ms - r.arrival_ms;
    assert_eq!(run.requests[1].cached_tokens, 992);
    assert!(ttft(&run.requests[1]) < ttft(&run.requests[0]));
}

/// A decode engine's request whose prompt KV arrived from a prefill engine: no prefill
/// work (the first step only decodes, and costs a decode step), its prompt's full
/// blocks are stored and published like any, and a later request hits them.
#[test]
fn transferred_prompt_tokens_cost_no_prefill_and_are_cached() {
    let mut sim = Simulator::new(cfg(64, 4)).unwrap();
    let mut shadow = Shadow::default();
    let prompt: Vec<u32> = (100..140).collect(); // 40 tokens, 10 blocks of 4
    sim.submit(SimRequest {
        transferred_tokens: 40,
        ..req(prompt.clone(), 3)
    })
    .unwrap();
    let first = sim.step().unwrap();
    shadow.apply(&first.events);
    // One prompt token is always computed here; the rest arrived.
    assert_eq!(first.prefill_tokens, 1);
    assert_eq!(first.outputs.len(), 1, "the first token in the first step");
    let latency = sim.config().latency;
    assert!((first.duration_ms - latency.prefill_ms(1)).abs() < 1e-9);
    assert_eq!(shadow.stored, 10, "the prompt's full blocks are stored");
    run_to_idle(&mut sim, &mut shadow);
    let s = sim.snapshot().counters;
    assert_eq!(s.transferred_tokens, 39);
    assert_eq!(s.prefill_computed_tokens, 1);
    // The same prompt again (an ordinary request) is served from the cache.
    let id = sim.submit(req(prompt, 1)).unwrap();
    let out = run_to_idle(&mut sim, &mut shadow);
    assert_eq!(out[&id].0, 36);
}
