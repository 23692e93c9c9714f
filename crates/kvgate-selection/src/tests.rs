//! The service's operations, with a real ZeroMQ publisher (the mock engine's) for the
//! event-fed parts.

use std::time::Duration;

use kvgate_core::KvAwareConfig;
use kvgate_mock_engine::events::KvEvent;
use kvgate_mock_engine::kv_publisher::{KvPublisher, PublisherConfig};
use tokio_util::sync::CancellationToken;

use super::*;

const BS: u32 = 4;

fn service(kind: PolicyKind) -> SelectionService {
    let mut policy = PolicyConfig::of(kind);
    policy.seed = Some(7);
    policy.kv_aware = KvAwareConfig::default();
    SelectionService::new(
        SelectionConfig::new("m", BS, policy),
        EventMetrics::new(),
        Arc::new(AtomicU32::new(0)),
    )
    .unwrap()
}

fn request<'a>(keys: &'a [BlockKey], prompt_tokens: u32) -> SelectRequest<'a> {
    SelectRequest {
        block_keys: Some(keys),
        prompt_tokens,
        session_key: None,
        now: Instant::now(),
        objective: Objective::default(),
    }
}

async fn publisher(shutdown: &CancellationToken) -> KvPublisher {
    KvPublisher::start(
        PublisherConfig {
            topic: String::new(),
            ..PublisherConfig::default()
        },
        shutdown.clone(),
    )
    .await
    .unwrap()
}

fn stored(tokens: &[u32], first_hash: u64) -> KvEvent {
    let blocks = tokens.len() as u32 / BS;
    KvEvent::BlockStored {
        block_hashes: (0..u64::from(blocks)).map(|i| first_hash + i).collect(),
        parent_block_hash: None,
        token_ids: tokens.to_vec(),
        block_size: BS,
    }
}

/// Publishes `event` until the index shows `blocks` leading blocks of `keys` on
/// `worker` (a PUB socket drops what it sends before the subscriber has connected).
async fn publish_until_indexed(
    s: &SelectionService,
    p: &KvPublisher,
    event: KvEvent,
    keys: &[BlockKey],
    worker: WorkerId,
    blocks: u32,
) {
    for _ in 0..200 {
        p.publish(vec![event.clone()]);
        let held = s
            .index()
            .unwrap()
            .read()
            .overlaps(keys)
            .best_for(worker)
            .map_or(0, |o| o.total());
        if held >= blocks {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the index never showed {blocks} blocks on {worker}");
}

#[tokio::test]
async fn a_prompt_cached_on_a_worker_is_routed_there() {
    let stop = CancellationToken::new();
    let (a, b) = (publisher(&stop).await, publisher(&stop).await);
    let s = service(PolicyKind::KvAware);
    let ev = |p: &KvPublisher| {
        let mut e = WorkerEvents::new(p.endpoint.clone());
        e.replay_endpoint = p.replay_endpoint.clone();
        e.block_size = Some(BS);
        Some(e)
    };
    let wa = s.upsert_worker("a", ev(&a)).unwrap();
    let wb = s.upsert_worker("b", ev(&b)).unwrap();
    assert!(s.has_event_source());
    let prompt: Vec<u32> = (0..64).collect();
    let keys = s.block_keys(&prompt, None);
    // Worker b's engine caches the prompt.
    publish_until_indexed(&s, &b, stored(&prompt, 1000), &keys, wb, 16).await;
    let d = s.select(&request(&keys, 64), &[wa, wb]).unwrap();
    assert_eq!(d.worker, wb);
    assert_eq!(d.indexed_cached_tokens, 64);
    let score_b = d.scores.iter().find(|x| x.worker == wb).unwrap();
    assert_eq!(score_b.overlap_blocks[0], 16);
    // Only a allowed: a, whatever b holds.
    assert_eq!(s.select(&request(&keys, 64), &[wa]).unwrap().worker, wa);
    // Removing b purges what it held.
    assert!(s.remove_worker(wb).unwrap() >= 16);
    assert_eq!(s.worker_id("b"), None);
    stop.cancel();
}

#[tokio::test]
async fn upsert_keeps_a_known_worker_and_restarts_a_moved_one() {
    let stop = CancellationToken::new();
    let (first, moved) = (publisher(&stop).await, publisher(&stop).await);
    let s = service(PolicyKind::KvAware);
    let id = s
        .upsert_worker("r1", Some(WorkerEvents::new(first.endpoint.clone())))
        .unwrap();
    assert_eq!(
        s.upsert_worker("r1", Some(WorkerEvents::new(first.endpoint.clone())))
            .unwrap(),
        id,
        "the same advertisement is a no-op"
    );
    let prompt: Vec<u32> = (100..132).collect();
    let keys = s.block_keys(&prompt, None);
    publish_until_indexed(&s, &first, stored(&prompt, 5), &keys, id, 8).await;
    // The engine restarted elsewhere: same worker id, old entries purged, new events read.
    assert_eq!(
        s.upsert_worker("r1", Some(WorkerEvents::new(moved.endpoint.clone())))
            .unwrap(),
        id
    );
    let held = s.index().unwrap().read().overlaps(&keys).best_for(id);
    assert_eq!(held.map_or(0, |o| o.total()), 0);
    publish_until_indexed(&s, &moved, stored(&prompt, 9), &keys, id, 8).await;
    // Back to no event source: kv_aware has nothing to read.
    assert!(s.has_event_source());
    s.upsert_worker("r1", None).unwrap();
    assert!(!s.has_event_source());
    s.upsert_worker("r1", Some(WorkerEvents::new(moved.endpoint.clone())))
        .unwrap();
    s.remove_worker(id);
    assert!(!s.has_event_source());
    stop.cancel();
}

#[test]
fn a_worker_with_another_block_size_is_refused_loudly() {
    let s = service(PolicyKind::KvAware);
    let mut ev = WorkerEvents::new("tcp://127.0.0.1:5557");
    ev.block_size = Some(16);
    let err = s.upsert_worker("w", Some(ev)).unwrap_err().to_string();
    assert!(err.contains("block size 16"), "{err}");
    assert!(s
        .upsert_worker("w", Some(WorkerEvents::new("udp://x")))
        .is_err());
    assert!(s.worker_list().is_empty());
}

#[test]
fn request_keyed_bookings_follow_the_request_and_end_once() {
    let s = service(PolicyKind::LeastLoaded);
    let w = s.upsert_worker("w", None).unwrap();
    let keys = s.block_keys(&[1; 64], None);
    let d = s.select(&request(&keys, 64), &[w]).unwrap();
    s.book_request("r1", w, Some(&d), 64, Some(100), &keys)
        .unwrap();
    assert_eq!(
        s.book_request("r1", w, Some(&d), 64, None, &keys),
        Err(BookError::DuplicateRequest("r1".into()))
    );
    assert!(matches!(
        s.book_request("r2", WorkerId(99), None, 1, None, &[]),
        Err(BookError::UnknownWorker(_))
    ));
    let load = s.ledger().load(w);
    assert_eq!((load.in_flight, load.prefill_tokens), (1, 64));
    assert!(s.prefill_done("r1"));
    assert_eq!(s.ledger().load(w).prefill_tokens, 0);
    let full = s.ledger().load(w).decode_blocks;
    assert!(s.decode_progress("r1", 90));
    let late = s.ledger().load(w).decode_blocks;
    assert!(late < full * 0.5, "decode weight decays: {full} -> {late}");
    assert!(s.free("r1"));
    assert!(!s.free("r1"), "freeing twice is harmless");
    assert!(!s.prefill_done("r1") && !s.decode_progress("r1", 1));
    assert_eq!(s.ledger().load(w).in_flight, 0);
    assert_eq!(s.ledger().stats().active, 0);
}

#[test]
fn zero_or_missing_expected_output_never_breaks_the_decode_weight() {
    let s = service(PolicyKind::LeastLoaded);
    let w = s.upsert_worker("w", None).unwrap();
    for (i, expected) in [None, Some(0)].into_iter().enumerate() {
        let id = format!("r{i}");
        s.book_request(&id, w, None, 32, expected, &[]).unwrap();
        s.decode_progress(&id, 1_000_000);
        let blocks = s.ledger().load(w).decode_blocks;
        assert!(blocks.is_finite() && blocks > 0.0, "{expected:?}: {blocks}");
        s.free(&id);
    }
    assert_eq!(s.ledger().load(w), Default::default());
}

#[test]
fn the_sweep_frees_request_bookings_that_never_ended() {
    let mut cfg = SelectionConfig::new("m", BS, PolicyConfig::of(PolicyKind::RoundRobin));
    cfg.booking_ttl = Duration::from_secs(5);
    let s = SelectionService::new(cfg, EventMetrics::new(), Arc::new(AtomicU32::new(0))).unwrap();
    let w = s.upsert_worker("w", None).unwrap();
    s.book_request("old", w, None, 8, None, &[]).unwrap();
    assert_eq!(s.sweep_expired(Instant::now()), 0);
    assert_eq!(s.sweep_expired(Instant::now() + Duration::from_secs(6)), 1);
    assert_eq!(s.open_requests(), 0);
    assert_eq!(s.ledger().stats().active, 0);
    assert!(!s.free("old"));
}

#[test]
fn kv_aware_without_events_uses_its_fallback_or_says_why() {
    let s = service(PolicyKind::KvAware);
    let w = s.upsert_worker("w", None).unwrap();
    let keys = s.block_keys(&[1; 8], None);
    assert_eq!(
        s.select(&request(&keys, 8), &[w]).unwrap_err(),
        SelectError::NoIndex
    );
    let mut cfg = SelectionConfig::new("m", BS, PolicyConfig::of(PolicyKind::KvAware));
    cfg.fallback = Some(PolicyKind::RoundRobin);
    let s = SelectionService::new(cfg, EventMetrics::new(), Arc::new(AtomicU32::new(0))).unwrap();
    let w = s.upsert_worker("w", None).unwrap();
    assert_eq!(s.select(&request(&keys, 8), &[w]).unwrap().worker, w);
}

#[test]
fn select_and_book_spreads_a_burst_and_a_reroute_replaces_the_booking() {
    let s = service(PolicyKind::LeastLoaded);
    let ws: Vec<WorkerId> = (0..4)
        .map(|i| s.upsert_worker(&format!("w{i}"), None).unwrap())
        .collect();
    let keys = s.block_keys(&[3; 64], None);
    for i in 0..8 {
        s.select_and_book_request(&format!("r{i}"), &request(&keys, 64), &ws, Some(10))
            .unwrap();
    }
    for w in &ws {
        assert_eq!(
            s.ledger().load(*w).in_flight,
            2,
            "every booking is seen by the next selection"
        );
    }
    // r0 re-routed away from its worker: one booking, on the new worker.
    let first = s.booked_worker("r0").unwrap();
    let others: Vec<WorkerId> = ws.iter().copied().filter(|w| *w != first).collect();
    let d = s
        .select_and_book_request("r0", &request(&keys, 64), &others, Some(10))
        .unwrap();
    assert_ne!(d.worker, first);
    assert_eq!(s.open_requests(), 8);
    assert_eq!(s.ledger().load(first).in_flight, 1);
    for i in 0..8 {
        assert!(s.free(&format!("r{i}")));
    }
    assert_eq!(s.ledger().stats().active, 0);
}

/// A request with a TTFT objective goes where the time model predicts it is met: the
/// worker round robin would choose is passed over while its queue is predicted too
/// slow (rule `objective`); when no worker can meet it, a sheddable request is refused
/// at once and any other goes to the closest miss (rule `objective_missed`).
#[test]
fn objectives_steer_choices_and_shed_what_no_worker_can_meet() {
    let s = service(PolicyKind::RoundRobin);
    let a = s.upsert_worker("a", None).unwrap();
    let b = s.upsert_worker("b", None).unwrap();
    // 100k tokens queued for prefill on `a`: about 2 s at the prior's rate.
    let queued = BookingSpec {
        prompt_tokens: 100_000,
        ..BookingSpec::default()
    };
    let _held = s.ledger().book(a, queued, &[], Instant::now());
    let keys = s.block_keys(&[1; 64], None);
    let with = |ttft_ms: u64, priority: i32| SelectRequest {
        objective: Objective {
            ttft: Some(Duration::from_millis(ttft_ms)),
            tpot: None,
            priority,
        },
        ..request(&keys, 64)
    };
    let rules: Vec<&str> = (0..4)
        .map(|_| {
            let d = s.select(&with(500, 0), &[a, b]).unwrap();
            assert_eq!(d.worker, b, "{d:?}");
            d.rule
        })
        .collect();
    assert!(rules.contains(&"objective"), "{rules:?}");
    assert!(matches!(
        s.select(&with(1, -1), &[a, b]),
        Err(SelectError::Shed { late }) if late > Duration::ZERO
    ));
    let d = s.select(&with(1, 0), &[a, b]).unwrap();
    assert_eq!((d.worker, d.rule), (b, "objective_missed"));
    // Without an objective, the policy alone decides.
    let plain: Vec<WorkerId> = (0..2)
        .map(|_| s.select(&request(&keys, 64), &[a, b]).unwrap().worker)
        .collect();
    assert!(plain.contains(&a), "{plain:?}");
}

/// A sheddable request must leave room for the one after it where prefill is queued:
/// with its objective between its own predicted first token and the next like
/// request's, it is served by an idle worker and shed by a busy one.
#[test]
fn a_busy_worker_sheds_what_would_leave_no_room_after_it() {
    let s = service(PolicyKind::LeastLoaded);
    let w = s.upsert_worker("w", None).unwrap();
    let keys = s.block_keys(&[1; 64], None);
    let between = |d: &kvgate_core::policy::Decision| {
        let line = d.chosen().unwrap();
        let (own, next) = (
            line.predicted_ttft_secs.unwrap(),
            line.predicted_next_ttft_secs.unwrap(),
        );
        assert!(next > own, "{line:?}");
        SelectRequest {
            objective: Objective {
                ttft: Some(Duration::from_secs_f64((own + next) / 2.0)),
                tpot: None,
                priority: -1,
            },
            ..request(&keys, 20_000)
        }
    };
    let idle = s.select(&request(&keys, 20_000), &[w]).unwrap();
    assert_eq!(s.select(&between(&idle), &[w]).unwrap().worker, w);
    let queued = BookingSpec {
        prompt_tokens: 20_000,
        ..BookingSpec::default()
    };
    let _held = s.ledger().book(w, queued, &[], Instant::now());
    let busy = s.select(&request(&keys, 20_000), &[w]).unwrap();
    assert!(matches!(
        s.select(&between(&busy), &[w]),
        Err(SelectError::Shed { .. })
    ));
}
