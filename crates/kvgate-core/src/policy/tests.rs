//! Policy behaviour tests: each policy's contract, consistent-hash movement, kv_aware's
//! preference for the prefix holder and its refusal to herd.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::hashing::BlockHasher;
use crate::ids::{Tier, WorkerRef};
use crate::index::{IndexConfig, PrefixIndex, StoredBlocks};
use crate::ledger::{BookingGuard, BookingSpec, Ledger};
use crate::timing::EngineLimits;

const BS: u32 = 16;

fn workers(n: u32) -> Vec<WorkerId> {
    (0..n).map(WorkerId).collect()
}

fn new_index() -> PrefixIndex {
    PrefixIndex::new(BlockHasher::new(BS).unwrap(), IndexConfig::default())
}

/// Plays the engine: `worker` now caches every full block of `tokens`.
fn engine_caches(index: &mut PrefixIndex, worker: WorkerId, tokens: &[u32]) {
    let n = tokens.len() / BS as usize;
    let keys = index.hasher().block_keys(tokens);
    let hashes: Vec<u64> = keys
        .iter()
        .map(|k| k.0 ^ (u64::from(worker.0) << 40))
        .collect();
    index
        .apply_stored(
            WorkerRef::new(worker, 0),
            &StoredBlocks {
                engine_hashes: &hashes,
                parent_engine_hash: None,
                token_ids: &tokens[..n * BS as usize],
                block_size: BS,
                tier: Tier::Device,
                lora_name: None,
                blocks_after: 0,
            },
        )
        .unwrap();
}

fn select(
    policy: &dyn RoutingPolicy,
    keys: Option<&[BlockKey]>,
    prompt_tokens: u32,
    session: Option<&str>,
    candidates: &[WorkerId],
    ledger: &Ledger,
    index: Option<&PrefixIndex>,
) -> Result<Decision, SelectError> {
    policy.select(
        &RouteRequest {
            block_keys: keys,
            prompt_tokens,
            session_key: session,
            now: Instant::now(),
        },
        &FleetView {
            candidates,
            ledger,
            index,
        },
    )
}

#[test]
fn policy_names_round_trip() {
    for kind in PolicyKind::ALL {
        assert_eq!(kind.as_str().parse::<PolicyKind>().unwrap(), kind);
    }
    assert_eq!(
        "kv-aware".parse::<PolicyKind>().unwrap(),
        PolicyKind::KvAware
    );
    assert!("fastest".parse::<PolicyKind>().is_err());
}

#[test]
fn every_policy_refuses_an_empty_candidate_set() {
    let ledger = Ledger::new(BS);
    let index = new_index();
    let keys = index.hasher().block_keys(&[1; 32]);
    for kind in PolicyKind::ALL {
        let policy = build_policy(&PolicyConfig::of(kind));
        let err = select(
            &*policy,
            Some(&keys),
            32,
            Some("s"),
            &[],
            &ledger,
            Some(&index),
        );
        assert_eq!(err.unwrap_err(), SelectError::NoCandidates, "{kind}");
    }
}

#[test]
fn every_policy_explains_every_candidate() {
    let ledger = Ledger::new(BS);
    let index = new_index();
    let keys = index.hasher().block_keys(&[1; 32]);
    let ws = workers(3);
    for kind in PolicyKind::ALL {
        let policy = build_policy(&PolicyConfig::of(kind));
        let d = select(
            &*policy,
            Some(&keys),
            32,
            Some("s"),
            &ws,
            &ledger,
            Some(&index),
        )
        .unwrap();
        assert_eq!(d.policy, kind);
        assert!(ws.contains(&d.worker));
        let explained: Vec<WorkerId> = d.scores.iter().map(|s| s.worker).collect();
        assert_eq!(explained, ws, "{kind}");
    }
}

#[test]
fn round_robin_cycles_through_candidates() {
    let ledger = Ledger::new(BS);
    let policy = RoundRobinPolicy::new();
    let ws = workers(3);
    let picks: Vec<u32> = (0..6)
        .map(|_| {
            select(&policy, None, 0, None, &ws, &ledger, None)
                .unwrap()
                .worker
                .0
        })
        .collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
}

#[test]
fn random_uses_every_candidate() {
    let ledger = Ledger::new(BS);
    let policy = RandomPolicy::new(Some(7));
    let ws = workers(4);
    let mut seen = HashMap::new();
    for _ in 0..400 {
        *seen
            .entry(
                select(&policy, None, 0, None, &ws, &ledger, None)
                    .unwrap()
                    .worker,
            )
            .or_insert(0) += 1;
    }
    assert_eq!(seen.len(), 4);
    assert!(seen.values().all(|n| *n > 50), "{seen:?}");
}

#[test]
fn least_loaded_avoids_the_busy_worker() {
    let ledger = Ledger::new(BS);
    let now = Instant::now();
    let _busy: Vec<_> = (0..10)
        .map(|_| {
            ledger.book(
                WorkerId(0),
                BookingSpec {
                    prompt_tokens: 1000,
                    ..Default::default()
                },
                &[],
                now,
            )
        })
        .collect();
    let policy = LeastLoadedPolicy::new(Some(1));
    let ws = workers(2);
    for _ in 0..50 {
        assert_eq!(
            select(&policy, None, 0, None, &ws, &ledger, None)
                .unwrap()
                .worker,
            WorkerId(1)
        );
    }
}

/// Another replica reported three requests in flight on worker 0, this router booked
/// one on worker 1: policies score the whole fleet's load, so worker 1 (1 in flight)
/// beats worker 0 (3), though this router alone booked more on worker 1. Once the peer
/// goes silent, its load no longer counts.
#[test]
fn policies_score_the_load_peer_replicas_reported_as_well_as_their_own() {
    let ledger = Ledger::new(BS);
    let now = Instant::now();
    let _mine = ledger.book(
        WorkerId(1),
        BookingSpec {
            prompt_tokens: 1000,
            ..Default::default()
        },
        &[],
        now,
    );
    let peer = crate::peer_loads::PeerReport {
        replica: "replica-b".into(),
        incarnation: 1,
        seq: 1,
        loads: vec![(
            WorkerId(0),
            crate::load::WorkerLoad {
                in_flight: 3,
                prefill_tokens: 3000,
                decode_blocks: 200.0,
            },
        )],
        prefilling: Vec::new(),
        settled: Vec::new(),
        settled_below: 0,
    };
    ledger.apply_peer_report(peer, now);
    let ws = workers(2);
    let policy = LeastLoadedPolicy::new(Some(1));
    let d = select(&policy, None, 0, None, &ws, &ledger, None).unwrap();
    assert_eq!(d.worker, WorkerId(1), "{:?}", d.scores);
    assert_eq!(
        d.scores[0].in_flight, 3,
        "the score line shows the fleet's load"
    );
    // This router's own view (limits, metrics) stays its own.
    assert_eq!(ledger.load(WorkerId(0)).in_flight, 0);
    assert_eq!(ledger.peer_load(WorkerId(0)).in_flight, 3);
    ledger.expire_peers(now + Duration::from_secs(3), Duration::from_secs(2));
    let d = select(&policy, None, 0, None, &ws, &ledger, None).unwrap();
    assert_eq!(d.worker, WorkerId(0), "{:?}", d.scores);
}

fn session_assignment(policy: &SessionPolicy, ws: &[WorkerId], n: usize) -> Vec<WorkerId> {
    let ledger = Ledger::new(BS);
    (0..n)
        .map(|i| {
            let key = format!("session-{i}");
            select(policy, None, 0, Some(&key), ws, &ledger, None)
                .unwrap()
                .worker
        })
        .collect()
}

fn named(ws: &[WorkerId]) -> Vec<(WorkerId, String)> {
    ws.iter()
        .map(|w| (*w, format!("http://10.0.0.{}:8000", w.0)))
        .collect()
}

fn tell(policy: &SessionPolicy, ws: &[WorkerId]) {
    let names = named(ws);
    let refs: Vec<(WorkerId, &str)> = names.iter().map(|(w, n)| (*w, n.as_str())).collect();
    policy.workers_changed(&refs);
}

#[test]
fn session_is_sticky_and_adding_a_worker_moves_about_one_nth() {
    let policy = SessionPolicy::new(SessionConfig::default(), Some(3));
    let eight = workers(8);
    tell(&policy, &eight);
    let before = session_assignment(&policy, &eight, 10_000);
    assert_eq!(
        before,
        session_assignment(&policy, &eight, 10_000),
        "sticky"
    );
    let nine = workers(9);
    tell(&policy, &nine);
    let after = session_assignment(&policy, &nine, 10_000);
    let moved: Vec<usize> = (0..before.len())
        .filter(|i| before[*i] != after[*i])
        .collect();
    let fraction = moved.len() as f64 / before.len() as f64;
    assert!(
        (0.07..=0.16).contains(&fraction),
        "moved {fraction}, expected ≈ 1/9"
    );
    assert!(
        moved.iter().all(|i| after[*i] == WorkerId(8)),
        "only to the new worker"
    );
    // Spread across the nine workers is reasonable.
    let mut counts = HashMap::new();
    for w in &after {
        *counts.entry(*w).or_insert(0usize) += 1;
    }
    assert!(counts.values().all(|c| *c > 10_000 / 9 / 2), "{counts:?}");
}

#[test]
fn session_of_an_unhealthy_worker_moves_and_comes_back() {
    let policy = SessionPolicy::new(SessionConfig::default(), Some(3));
    let all = workers(4);
    tell(&policy, &all);
    let before = session_assignment(&policy, &all, 2000);
    let healthy: Vec<WorkerId> = all.iter().copied().filter(|w| *w != WorkerId(2)).collect();
    let during = session_assignment(&policy, &healthy, 2000);
    for i in 0..before.len() {
        if before[i] != WorkerId(2) {
            assert_eq!(before[i], during[i], "sessions of healthy workers stay");
        } else {
            assert_ne!(during[i], WorkerId(2));
        }
    }
    assert_eq!(session_assignment(&policy, &all, 2000), before);
}

#[test]
fn session_rings_agree_across_router_replicas() {
    let a = SessionPolicy::new(SessionConfig::default(), Some(1));
    let b = SessionPolicy::new(SessionConfig::default(), Some(2));
    let ws = workers(5);
    tell(&a, &ws);
    tell(&b, &ws);
    assert_eq!(
        session_assignment(&a, &ws, 1000),
        session_assignment(&b, &ws, 1000)
    );
}

#[test]
fn kv_aware_needs_an_index_and_tokens() {
    let ledger = Ledger::new(BS);
    let index = new_index();
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(1));
    let ws = workers(2);
    assert_eq!(
        select(&policy, Some(&[]), 0, None, &ws, &ledger, None).unwrap_err(),
        SelectError::NoIndex
    );
    assert_eq!(
        select(&policy, None, 10, None, &ws, &ledger, Some(&index)).unwrap_err(),
        SelectError::MissingTokens
    );
}

#[test]
fn kv_aware_sends_a_prompt_to_the_worker_holding_its_prefix() {
    let ledger = Ledger::new(BS);
    let mut index = new_index();
    let prompt: Vec<u32> = (0..1024).collect();
    engine_caches(&mut index, WorkerId(2), &prompt[..800]);
    engine_caches(&mut index, WorkerId(1), &prompt[..160]);
    let keys = index.hasher().block_keys(&prompt);
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(1));
    let ws = workers(4);
    for i in 0..20 {
        let d = select(&policy, Some(&keys), 1024, None, &ws, &ledger, Some(&index)).unwrap();
        assert_eq!(d.worker, WorkerId(2));
        if i == 0 {
            // Later rounds also credit this very prompt, just sent there.
            assert_eq!(d.predicted_cached_tokens, 800);
        }
        let line = d.scores.iter().find(|s| s.worker == WorkerId(1)).unwrap();
        assert_eq!(line.overlap_blocks, [10, 0, 0]);
    }
}

#[test]
fn kv_aware_breaks_cold_ties_at_random() {
    let ledger = Ledger::new(BS);
    let index = new_index();
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(9));
    let ws = workers(4);
    let mut seen = std::collections::HashSet::new();
    for i in 0..100u32 {
        let prompt: Vec<u32> = (0..64).map(|t| t + i * 1000).collect();
        let keys = index.hasher().block_keys(&prompt);
        seen.insert(
            select(&policy, Some(&keys), 64, None, &ws, &ledger, Some(&index))
                .unwrap()
                .worker,
        );
    }
    assert_eq!(
        seen.len(),
        4,
        "a cache miss must not always land on the same worker"
    );
}

#[test]
fn kv_aware_gives_host_tier_partial_credit() {
    let ledger = Ledger::new(BS);
    let mut index = new_index();
    let prompt: Vec<u32> = (0..640).collect();
    // Worker 0 holds all 40 blocks in host memory, worker 1 holds 25 on device.
    let keys = index.hasher().block_keys(&prompt);
    let hashes: Vec<u64> = keys.iter().map(|k| k.0).collect();
    index
        .apply_stored(
            WorkerRef::new(WorkerId(0), 0),
            &StoredBlocks {
                engine_hashes: &hashes,
                parent_engine_hash: None,
                token_ids: &prompt,
                block_size: BS,
                tier: Tier::Host,
                lora_name: None,
                blocks_after: 0,
            },
        )
        .unwrap();
    engine_caches(&mut index, WorkerId(1), &prompt[..400]);
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(1));
    let d = select(
        &policy,
        Some(&keys),
        640,
        None,
        &workers(2),
        &ledger,
        Some(&index),
    )
    .unwrap();
    // 40 host blocks at 0.5 credit = 20 < 25 device blocks.
    assert_eq!(d.worker, WorkerId(1));
    let full_credit = KvAwarePolicy::new(
        KvAwareConfig {
            host_credit: 1.0,
            ..Default::default()
        },
        Some(1),
    );
    let d = select(
        &full_credit,
        Some(&keys),
        640,
        None,
        &workers(2),
        &ledger,
        Some(&index),
    )
    .unwrap();
    assert_eq!(d.worker, WorkerId(0));
}

/// 1,000 requests sharing a 2,000-token system prompt over 8 equally fast workers:
/// the holder's growing load must push requests to the others.
#[test]
fn kv_aware_does_not_herd_on_a_shared_prefix() {
    let ledger = Ledger::new(BS);
    let mut index = new_index();
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(11));
    let ws = workers(8);
    let system: Vec<u32> = (0..2000).map(|t| 50_000 + t).collect();
    let mut in_flight = std::collections::VecDeque::new();
    let mut counts: HashMap<WorkerId, usize> = HashMap::new();
    for i in 0..1000u32 {
        let mut prompt = system.clone();
        prompt.extend((0..200).map(|t| i * 1000 + t));
        let keys = index.hasher().block_keys(&prompt);
        let d = select(
            &policy,
            Some(&keys),
            prompt.len() as u32,
            None,
            &ws,
            &ledger,
            Some(&index),
        )
        .unwrap();
        let guard = ledger.book(
            d.worker,
            d.booking(prompt.len() as u32, Some(200)),
            &keys,
            Instant::now(),
        );
        engine_caches(&mut index, d.worker, &prompt);
        *counts.entry(d.worker).or_default() += 1;
        in_flight.push_back(guard);
        // Equally fast workers: prefill finishes after a few arrivals, requests after 32.
        if in_flight.len() > 4 {
            in_flight[in_flight.len() - 5].prefill_done(Instant::now());
        }
        if in_flight.len() > 32 {
            in_flight.pop_front();
        }
    }
    eprintln!("herding counts: {counts:?}");
    let mean = 1000.0 / 8.0;
    let max = *counts.values().max().unwrap() as f64;
    assert_eq!(counts.len(), 8, "{counts:?}");
    assert!(max <= 2.0 * mean, "max {max} vs mean {mean}: {counts:?}");
}

#[test]
fn prefix_affinity_follows_its_own_decisions_until_load_is_imbalanced() {
    let ledger = Ledger::new(BS);
    let hasher = BlockHasher::new(BS).unwrap();
    let policy = PrefixAffinityPolicy::new(PrefixAffinityConfig::default(), Some(2));
    let ws = workers(4);
    let prompt: Vec<u32> = (0..512).collect();
    let keys = hasher.block_keys(&prompt);
    let first = select(&policy, Some(&keys), 512, None, &ws, &ledger, None)
        .unwrap()
        .worker;
    let mut longer = prompt.clone();
    longer.extend(9000..9100);
    let longer_keys = hasher.block_keys(&longer);
    let mut guards = Vec::new();
    for _ in 0..10 {
        let d = select(&policy, Some(&longer_keys), 612, None, &ws, &ledger, None).unwrap();
        assert_eq!(d.worker, first);
        assert!(d.predicted_cached_tokens >= 512);
        guards.push(ledger.book(
            d.worker,
            BookingSpec {
                prompt_tokens: 612,
                ..Default::default()
            },
            &[],
            Instant::now(),
        ));
    }
    // Load the remembered worker far beyond the others: affinity yields.
    for _ in 0..20 {
        guards.push(ledger.book(
            first,
            BookingSpec {
                prompt_tokens: 612,
                ..Default::default()
            },
            &[],
            Instant::now(),
        ));
    }
    let d = select(&policy, Some(&longer_keys), 612, None, &ws, &ledger, None).unwrap();
    assert_ne!(d.worker, first);
    assert_eq!(d.reason, "load imbalanced: least loaded");
}

#[test]
fn prefix_affinity_memory_is_bounded_and_expires() {
    let ledger = Ledger::new(BS);
    let hasher = BlockHasher::new(BS).unwrap();
    let config = PrefixAffinityConfig {
        max_entries: 1000,
        ttl: Duration::from_secs(10),
        ..Default::default()
    };
    let policy = PrefixAffinityPolicy::new(config, Some(2));
    let ws = workers(4);
    let t0 = Instant::now();
    for i in 0..500u32 {
        let prompt: Vec<u32> = (0..160).map(|t| t + i * 1000).collect();
        let keys = hasher.block_keys(&prompt);
        let req = RouteRequest {
            block_keys: Some(&keys),
            prompt_tokens: 160,
            session_key: None,
            now: t0,
        };
        policy
            .select(
                &req,
                &FleetView {
                    candidates: &ws,
                    ledger: &ledger,
                    index: None,
                },
            )
            .unwrap();
        assert!(policy.remembered_entries() <= 1000);
    }
    let keys = hasher.block_keys(&(0..160).collect::<Vec<u32>>());
    let later = RouteRequest {
        block_keys: Some(&keys),
        prompt_tokens: 160,
        session_key: None,
        now: t0 + Duration::from_secs(60),
    };
    policy
        .select(
            &later,
            &FleetView {
                candidates: &ws,
                ledger: &ledger,
                index: None,
            },
        )
        .unwrap();
    assert_eq!(
        policy.remembered_entries(),
        10,
        "only the fresh request remains"
    );
}

/// A follow-up that arrives before the engine has published events for the previous
/// request (its prefill is still queued) must still find the worker that request went
/// to: kv_aware credits its own recent decisions until the events arrive.
#[test]
fn kv_aware_credits_its_own_recent_decisions_before_events_arrive() {
    let ledger = Ledger::new(BS);
    let index = new_index();
    // Without a credit the holder shows nothing cached and a prefill queued, so an idle
    // worker is cheaper; only the credit can find it.
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(3));
    let ws = workers(4);
    let first: Vec<u32> = (0..4096).collect();
    let keys = index.hasher().block_keys(&first);
    let d = select(&policy, Some(&keys), 4096, None, &ws, &ledger, Some(&index)).unwrap();
    let _booking = ledger.book(d.worker, d.booking(4096, Some(64)), &keys, Instant::now());
    // Next turn: the whole first prompt plus a little more, no events yet.
    let mut next = first.clone();
    next.extend(90_000..90_256);
    let next_keys = index.hasher().block_keys(&next);
    let route_next = |policy: &KvAwarePolicy| {
        select(
            policy,
            Some(&next_keys),
            next.len() as u32,
            None,
            &ws,
            &ledger,
            Some(&index),
        )
        .unwrap()
    };
    let d2 = route_next(&policy);
    assert_eq!(
        d2.worker, d.worker,
        "follow-up goes where its prefix is being computed"
    );
    assert_eq!(d2.predicted_cached_tokens, 4096);
    // Without the credit (TTL 0) it goes to an idle worker.
    let forgetful = KvAwarePolicy::new(
        KvAwareConfig {
            pending_credit_secs: 0.0,
            ..Default::default()
        },
        Some(3),
    );
    assert_ne!(route_next(&forgetful).worker, d.worker);
}

/// Four workers; worker 0 caches a conversation's history and has prompts of the given
/// sizes queued (booked, prefill not done); the next turn adds 512 new tokens.
struct QueuedHolder {
    ledger: Arc<Ledger>,
    index: PrefixIndex,
    turn: Vec<u32>,
    _queued: Vec<BookingGuard>,
}

impl QueuedHolder {
    fn new(history_tokens: u32, queued_prompts: &[u32]) -> Self {
        let ledger = Ledger::new(BS);
        let mut index = new_index();
        let history: Vec<u32> = (0..history_tokens).collect();
        engine_caches(&mut index, WorkerId(0), &history);
        // A steady fleet: the other workers cache conversations of their own (an empty
        // worker would be warming up, which is another rule's business).
        for w in 1..4u32 {
            let own: Vec<u32> = (0..history_tokens).map(|t| 1_000_000 * w + t).collect();
            engine_caches(&mut index, WorkerId(w), &own);
        }
        let queued = queued_prompts
            .iter()
            .map(|&prompt_tokens| {
                ledger.book(
                    WorkerId(0),
                    BookingSpec {
                        prompt_tokens,
                        expected_output_tokens: Some(64),
                        ..Default::default()
                    },
                    &[],
                    Instant::now(),
                )
            })
            .collect();
        let mut turn = history;
        turn.extend(70_000..70_512);
        Self {
            ledger,
            index,
            turn,
            _queued: queued,
        }
    }

    /// Where kv_aware with `config` sends the next turn.
    fn route(&self, config: KvAwareConfig) -> Decision {
        let keys = self.index.hasher().block_keys(&self.turn);
        let policy = KvAwarePolicy::new(config, Some(5));
        select(
            &policy,
            Some(&keys),
            self.turn.len() as u32,
            None,
            &workers(4),
            &self.ledger,
            Some(&self.index),
        )
        .unwrap()
    }
}

/// A conversation's next turn stays on the worker holding its history although that
/// worker has another request's prefill queued; the DESIGN cost alone (locality weight
/// 0) sends it to an idle worker that must recompute the whole history.
#[test]
fn kv_aware_keeps_a_conversation_on_its_holder_despite_a_queue() {
    let fleet = QueuedHolder::new(4096, &[6000]);
    let d = fleet.route(KvAwareConfig::default());
    assert_eq!(d.worker, WorkerId(0), "{:?}", d.scores);
    assert_eq!(d.predicted_cached_tokens, 4096);
    let design_only = fleet.route(KvAwareConfig {
        locality_weight: 0.0,
        ..Default::default()
    });
    assert_ne!(design_only.worker, WorkerId(0));
}

/// A holder's cached lead ends while its engine's batch is full: the request that goes
/// to the holder while its batch has room goes elsewhere once the holder runs
/// `max_num_seqs` requests (its decode then outweighs recomputing the prompt).
#[test]
fn kv_aware_a_full_batch_ends_a_holders_lead() {
    let ledger = Ledger::new(BS);
    let mut index = new_index();
    let prompt: Vec<u32> = (0..2048).collect();
    engine_caches(&mut index, WorkerId(0), &prompt);
    for w in 1..3u32 {
        let own: Vec<u32> = (0..2048).map(|t| 1_000_000 * w + t).collect();
        engine_caches(&mut index, WorkerId(w), &own);
    }
    let bookings: Vec<_> = (0..20)
        .map(|_| {
            let b = ledger.book(
                WorkerId(0),
                BookingSpec {
                    prompt_tokens: 1600,
                    expected_output_tokens: Some(16),
                    ..Default::default()
                },
                &[],
                Instant::now(),
            );
            b.prefill_done(Instant::now());
            b
        })
        .collect();
    let keys = index.hasher().block_keys(&prompt);
    let ws = workers(3);
    let pick = |config: KvAwareConfig| {
        let policy = KvAwarePolicy::new(config, Some(2));
        select(&policy, Some(&keys), 2048, None, &ws, &ledger, Some(&index)).unwrap()
    };
    let roomy = pick(KvAwareConfig::default());
    assert_eq!(
        (roomy.worker, roomy.rule),
        (WorkerId(0), "cached"),
        "{:?}",
        roomy.scores
    );
    let batch_of_16 = EngineLimits {
        max_num_seqs: 16,
        max_num_batched_tokens: 8192,
        num_gpu_blocks: None,
    };
    ledger.set_engine_limits(batch_of_16);
    let full = pick(KvAwareConfig::default());
    assert_ne!(full.worker, WorkerId(0), "{:?}", full.scores);
    assert_eq!(full.rule, "least_work");
    drop(bookings);
}

/// The case that cost the most hit rate on the Mooncake trace (docs/BENCHMARKS.md): a
/// conversation with a short history (2,048 tokens) whose holder has long prompts queued
/// (96k tokens over six requests). The default locality
/// weight keeps the turn with its history; weight 16 sent it to an idle worker, which
/// recomputes the history, and the conversation's copy on the holder goes dead.
#[test]
fn kv_aware_defaults_keep_a_short_history_behind_a_long_queue() {
    let fleet = QueuedHolder::new(2048, &[16_000; 6]);
    let d = fleet.route(KvAwareConfig::default());
    assert_eq!(d.worker, WorkerId(0), "{:?}", d.scores);
    let weaker = fleet.route(KvAwareConfig {
        locality_weight: 16.0,
        ..Default::default()
    });
    assert_ne!(weaker.worker, WorkerId(0), "{:?}", weaker.scores);
}

/// Issue 18's "a worker added under load gets nothing", in the core: one worker's cache
/// thrashes (every prompt it computes is evicted before its events could show it in
/// the index, so the index never holds the tenant's prompt), and kv_aware keeps
/// routing the tenant's requests. A credit that each decision renewed kept that worker
/// ahead forever; a credit that ends with its request's prefill leaves both workers at
/// zero cached, so the tenants' homes and load decide and the just-added worker takes
/// its share. Eight tenants, so that which worker a tenant's cold prompt homes on
/// (a rendezvous of its key) is not one coin flip (with one tenant, the test passed or
/// failed with the key scheme).
#[test]
fn kv_aware_credit_ends_with_the_prefill_so_an_added_worker_gets_traffic() {
    let ledger = Ledger::new(BS);
    let index = new_index();
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(9));
    let mut counts = [0usize; 2];
    let mut running: std::collections::VecDeque<BookingGuard> = Default::default();
    for i in 0..200u32 {
        // Worker 1 joins after 20 requests.
        let ws = if i < 20 { workers(1) } else { workers(2) };
        let tenant: Vec<u32> = (0..1536).map(|t| (i % 8) * 10_000 + t).collect();
        let mut prompt = tenant.clone();
        prompt.extend((0..64).map(|t| 100_000 + i * 100 + t));
        let keys = index.hasher().block_keys(&prompt);
        let d = select(
            &policy,
            Some(&keys),
            prompt.len() as u32,
            None,
            &ws,
            &ledger,
            Some(&index),
        )
        .unwrap();
        if i >= 20 {
            counts[d.worker.0 as usize] += 1;
        }
        // Four in flight: each request's prefill is done before the next arrives.
        let guard = ledger.book(
            d.worker,
            d.booking(prompt.len() as u32, Some(64)),
            &keys,
            Instant::now(),
        );
        guard.prefill_done(Instant::now());
        running.push_back(guard);
        if running.len() > 4 {
            running.pop_front();
        }
    }
    assert!(
        counts[1] >= 180 / 4,
        "the added worker got {} of 180 requests: {counts:?}",
        counts[1]
    );
}

/// A fleet that already caches its tenants: worker 0 holds the tenant's prompt and has
/// three requests in flight; worker 1 was just added and holds nothing. Per request,
/// both the locality term and the DESIGN cost keep the prompt on worker 0 (one
/// recompute costs more than a short queue), so without warm-up worker 1 would get
/// nothing. Warming up, it takes the request; once it caches as much as the others, the
/// same request stays with its holder.
#[test]
fn kv_aware_warm_up_sends_load_to_an_empty_worker_until_it_caches_its_share() {
    let ledger = Ledger::new(BS);
    let mut index = new_index();
    let tenant: Vec<u32> = (0..1536).collect();
    engine_caches(&mut index, WorkerId(0), &tenant);
    let mut prompt = tenant.clone();
    prompt.extend(60_000..60_064);
    let keys = index.hasher().block_keys(&prompt);
    let _busy: Vec<BookingGuard> = (0..3)
        .map(|i| {
            let g = ledger.book(
                WorkerId(0),
                BookingSpec {
                    prompt_tokens: 1600,
                    cached_tokens: 1536,
                    expected_output_tokens: Some(32),
                    ..Default::default()
                },
                &[],
                Instant::now(),
            );
            if i > 0 {
                g.prefill_done(Instant::now());
            }
            g
        })
        .collect();
    let route = |config: KvAwareConfig, index: &PrefixIndex| {
        let policy = KvAwarePolicy::new(config, Some(6));
        select(
            &policy,
            Some(&keys),
            1600,
            None,
            &workers(2),
            &ledger,
            Some(index),
        )
        .unwrap()
    };
    let d = route(KvAwareConfig::default(), &index);
    assert_eq!(d.worker, WorkerId(1), "{:?}", d.scores);
    assert_eq!(d.rule, "warmup", "the decision names the rule that decided");
    assert!(d.reason.starts_with("warm-up"), "{}", d.reason);
    let off = route(
        KvAwareConfig {
            warmup_fraction: 0.0,
            ..Default::default()
        },
        &index,
    );
    assert_eq!(
        off.worker,
        WorkerId(0),
        "without warm-up the holder keeps it"
    );
    // Worker 1 now caches as much as worker 0 (other tenants): not warming any more, and
    // a one-request lead is within the slack anyway.
    let other: Vec<u32> = (100_000..101_536).collect();
    engine_caches(&mut index, WorkerId(1), &other);
    let warm = route(KvAwareConfig::default(), &index);
    assert_eq!(warm.worker, WorkerId(0), "{:?}", warm.scores);
    assert_eq!(warm.rule, "cached");
}

/// A prompt nobody holds goes to the least work and says so; one that a worker holds
/// goes there and says it was the cached prefix.
#[test]
fn kv_aware_names_the_rule_that_decided() {
    let ledger = Ledger::new(BS);
    let mut index = new_index();
    let held: Vec<u32> = (0..1024).collect();
    engine_caches(&mut index, WorkerId(0), &held);
    let other: Vec<u32> = (500_000..501_024).collect();
    engine_caches(&mut index, WorkerId(1), &other);
    let policy = KvAwarePolicy::new(KvAwareConfig::default(), Some(1));
    let route = |tokens: &[u32]| {
        let keys = index.hasher().block_keys(tokens);
        select(
            &policy,
            Some(&keys),
            tokens.len() as u32,
            None,
            &workers(2),
            &ledger,
            Some(&index),
        )
        .unwrap()
    };
    let cached = route(&held);
    assert_eq!((cached.worker, cached.rule), (WorkerId(0), "cached"));
    let cold: Vec<u32> = (900_000..901_024).collect();
    assert_eq!(route(&cold).rule, "least_work");
}

/// A kv_aware option that was removed is refused with the reason it went, in YAML
/// (here through serde, as the gateway's config reads it) and as a flag name; an
/// unknown field is refused too, and the four knobs and tier credits still parse.
#[test]
fn kv_aware_refuses_a_removed_option_naming_why() {
    let parse = |json: &str| serde_json::from_str::<KvAwareConfig>(json);
    let err = parse(r#"{"cold_homing": false}"#).unwrap_err().to_string();
    assert!(
        err.contains("`cold_homing` was removed: cold homing is gone"),
        "{err}"
    );
    let err = parse(r#"{"balance_abs_threshold": 16}"#)
        .unwrap_err()
        .to_string();
    assert!(err.contains("the load bound is gone"), "{err}");
    let err = parse(r#"{"temperature": 0.1}"#).unwrap_err().to_string();
    assert!(err.contains("the softmax never helped"), "{err}");
    let err = parse(r#"{"overlap_weigth": 2}"#).unwrap_err().to_string();
    assert!(
        err.contains("unknown kv_aware field `overlap_weigth`"),
        "{err}"
    );
    let ok = parse(r#"{"overlap_weight": 2, "locality_weight": 8, "pending_credit_secs": 1, "warmup_fraction": 0, "host_credit": 1, "disk_credit": 0}"#).unwrap();
    assert_eq!((ok.overlap_weight, ok.locality_weight), (2.0, 8.0));
    assert_eq!(parse("{}").unwrap(), KvAwareConfig::default());
    for (name, _) in crate::policy::kv_aware::REMOVED {
        let flag = format!("--{}", name.replace('_', "-"));
        assert!(crate::removed_kv_aware_option(&flag).is_some(), "{flag}");
    }
    assert_eq!(crate::removed_kv_aware_option("--overlap-weight"), None);
}

/// Each line's `predicted_next_ttft_secs` is what a like request is predicted to get
/// once this one is booked there: the same prediction the line shows after the booking.
#[test]
fn the_next_requests_prediction_is_the_one_after_booking() {
    let ledger = Ledger::new(BS);
    let policy = build_policy(&PolicyConfig::of(PolicyKind::LeastLoaded));
    let w = workers(1);
    let _queued = ledger.book(
        w[0],
        BookingSpec {
            prompt_tokens: 3000,
            ..BookingSpec::default()
        },
        &[],
        Instant::now(),
    );
    let before = select(policy.as_ref(), None, 5000, None, &w, &ledger, None).unwrap();
    let line = before.chosen().unwrap().clone();
    let next = line.predicted_next_ttft_secs.unwrap();
    assert!(next > line.predicted_ttft_secs.unwrap(), "{line:?}");
    let _booked = ledger.book(w[0], before.booking(5000, None), &[], Instant::now());
    let after = select(policy.as_ref(), None, 5000, None, &w, &ledger, None).unwrap();
    let now = after.predicted_ttft_secs().unwrap();
    assert!((now - next).abs() < 1e-12, "predicted {next}, then {now}");
}
