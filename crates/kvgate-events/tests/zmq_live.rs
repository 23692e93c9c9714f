//! Real ZeroMQ sockets on loopback: a fake engine (PUB + replay ROUTER) in the test
//! process feeding a subscriber. Every wait is bounded.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use kvgate_core::{BlockHasher, BlockKey, IndexConfig, PrefixIndex, Tier, WorkerId, WorkerRef};
use kvgate_events::metrics::WorkerEventStats;
use kvgate_events::replay::ReplayLimits;
use kvgate_events::{
    spawn_subscriber_with, EventMetrics, EventSource, IndexLock, SharedIndex, SubscriberConfig,
    SubscriberHandle,
};
use parking_lot::Mutex;
use rmpv::Value;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const BS: u32 = 4;
const WORKER: WorkerId = WorkerId(3);
const AT: WorkerRef = WorkerRef {
    worker: WORKER,
    dp_rank: 0,
};
const WAIT: Duration = Duration::from_secs(10);

type Buffer = Arc<Mutex<Vec<(u64, Vec<u8>)>>>;

struct FakeEngine {
    publisher: PubSocket,
    endpoint: String,
    replay_endpoint: Option<String>,
    buffer: Buffer,
    router: Option<tokio::task::JoinHandle<()>>,
}

fn msg(frames: Vec<Vec<u8>>) -> ZmqMessage {
    let frames: Vec<Bytes> = frames.into_iter().map(Bytes::from).collect();
    ZmqMessage::try_from(frames).unwrap()
}

impl FakeEngine {
    async fn start(with_replay: bool) -> Self {
        let mut publisher = PubSocket::new();
        let ep = publisher.bind("tcp://127.0.0.1:0").await.unwrap();
        let buffer: Buffer = Arc::default();
        let (replay_endpoint, router) = if with_replay {
            let mut router = RouterSocket::new();
            let rep = router.bind("tcp://127.0.0.1:0").await.unwrap();
            let buf = buffer.clone();
            let task = tokio::spawn(async move {
                while let Ok(m) = router.recv().await {
                    let f = m.into_vec();
                    if f.len() != 3 {
                        continue;
                    }
                    let id = f[0].to_vec();
                    let start = u64::from_be_bytes(f[2].as_ref().try_into().unwrap());
                    let items: Vec<_> = buf
                        .lock()
                        .iter()
                        .filter(|b| b.0 >= start)
                        .cloned()
                        .collect();
                    for (seq, p) in items {
                        let m = msg(vec![
                            id.clone(),
                            vec![],
                            b"kv".to_vec(),
                            seq.to_be_bytes().to_vec(),
                            p,
                        ]);
                        if router.send(m).await.is_err() {
                            break;
                        }
                    }
                    let end = msg(vec![id, vec![], vec![], vec![0xff; 8], vec![]]);
                    let _ = router.send(end).await;
                }
            });
            (Some(rep.to_string()), Some(task))
        } else {
            (None, None)
        };
        Self {
            publisher,
            endpoint: ep.to_string(),
            replay_endpoint,
            buffer,
            router,
        }
    }

    /// Buffers the batch for replay without publishing it (a lost message).
    fn lose(&self, seq: u64, payload: Vec<u8>) {
        self.buffer.lock().push((seq, payload));
    }

    async fn publish(&mut self, seq: u64, payload: Vec<u8>) {
        self.buffer.lock().push((seq, payload.clone()));
        self.send(seq, payload).await;
    }

    async fn send(&mut self, seq: u64, payload: Vec<u8>) {
        let m = msg(vec![b"kv".to_vec(), seq.to_be_bytes().to_vec(), payload]);
        self.publisher.send(m).await.unwrap();
    }
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        if let Some(t) = self.router.take() {
            t.abort();
        }
    }
}

fn new_index() -> SharedIndex {
    IndexLock::shared(PrefixIndex::new(
        BlockHasher::new(BS).unwrap(),
        IndexConfig::default(),
    ))
}

fn config() -> SubscriberConfig {
    SubscriberConfig {
        connect_timeout: Duration::from_secs(2),
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(200),
        replay: ReplayLimits {
            timeout: Duration::from_millis(700),
            max_batches: 10_000,
        },
        warm_start: true,
    }
}

fn stats(m: &EventMetrics) -> WorkerEventStats {
    m.worker(WORKER).snapshot(WORKER)
}

async fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Publishes seq 0 (an empty batch) until the subscriber has applied it: the SUB
/// connection and subscription are then live (no slow-joiner loss afterwards).
async fn handshake(engine: &mut FakeEngine, metrics: &EventMetrics) {
    let empty = batch(vec![], Some(0));
    engine.buffer.lock().push((0, empty.clone()));
    let deadline = tokio::time::Instant::now() + WAIT;
    while stats(metrics).batches == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "subscriber never joined"
        );
        engine.send(0, empty.clone()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn start(
    engine: &FakeEngine,
    index: &SharedIndex,
    metrics: &Arc<EventMetrics>,
) -> SubscriberHandle {
    let source = EventSource {
        worker: WORKER,
        name: "engine".into(),
        endpoint: engine.endpoint.clone(),
        replay_endpoint: engine.replay_endpoint.clone(),
        topic: "kv".into(),
        dp_rank: 0,
    };
    spawn_subscriber_with(source, config(), index.clone(), metrics.clone(), None)
}

/// Batch `i` (seq i, from 1): two chained blocks continuing the previous batch (a new
/// root every third), and every fourth batch evicts batch i-2's blocks.
fn workload(n: u64) -> Vec<Vec<u8>> {
    let hashes = |i: u64| [i * 1000 + 1, i * 1000 + 2];
    (1..=n)
        .map(|i| {
            let mut toks = block_tokens(i * 2, BS);
            toks.extend(block_tokens(i * 2 + 1, BS));
            let parent = (i % 3 != 1 && i > 1).then(|| hashes(i - 1)[1]);
            let mut events = vec![stored_map(&hashes(i), parent, &toks, BS)];
            if i % 4 == 0 {
                events.insert(0, removed_map(&hashes(i - 2)));
            }
            batch(events, Some(0))
        })
        .collect()
}

fn blocks(index: &SharedIndex) -> Vec<(BlockKey, Tier)> {
    index.read().worker_blocks(AT)
}

#[tokio::test]
async fn gap_recovered_by_replay_equals_a_gap_free_run() {
    let n = 24;
    let work = workload(n);

    // Gap-free reference run.
    let mut engine = FakeEngine::start(true).await;
    let (index_a, metrics_a) = (new_index(), EventMetrics::new());
    let sub = start(&engine, &index_a, &metrics_a);
    handshake(&mut engine, &metrics_a).await;
    for (i, p) in work.iter().enumerate() {
        engine.publish(i as u64 + 1, p.clone()).await;
    }
    wait_until("gap-free run applied", || stats(&metrics_a).batches > n).await;
    let expected = blocks(&index_a);
    assert!(expected.len() > 20);
    let s = stats(&metrics_a);
    // One replay: the warm start at connect (the buffer was empty then).
    assert_eq!((s.gaps, s.replays, s.purges), (0, 1, 0));
    assert_eq!(s.incomplete_starts, 0);
    sub.shutdown_and_wait().await;
    drop(engine);

    // Same stream, seqs 7..=9 lost on the live socket (still in the replay buffer).
    let mut engine = FakeEngine::start(true).await;
    let (index_b, metrics_b) = (new_index(), EventMetrics::new());
    let sub = start(&engine, &index_b, &metrics_b);
    handshake(&mut engine, &metrics_b).await;
    for (i, p) in work.iter().enumerate() {
        let seq = i as u64 + 1;
        if (7..=9).contains(&seq) {
            engine.lose(seq, p.clone());
        } else {
            engine.publish(seq, p.clone()).await;
        }
    }
    wait_until("replayed run converges", || blocks(&index_b) == expected).await;
    let s = stats(&metrics_b);
    assert_eq!(s.gaps, 1);
    assert_eq!(s.replays, 2, "the warm start at connect, then the gap's");
    assert_eq!((s.replay_failures, s.purges, s.decode_errors), (0, 0, 0));
    sub.shutdown_and_wait().await;
}

#[tokio::test]
async fn unrecoverable_gap_purges_then_rebuilds_from_live_events() {
    // Replay endpoint configured but nothing listens there: replay must fail fast.
    let mut engine = FakeEngine::start(false).await;
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("tcp://{}", l.local_addr().unwrap())
    };
    engine.replay_endpoint = Some(dead);
    let (index, metrics) = (new_index(), EventMetrics::new());
    let sub = start(&engine, &index, &metrics);
    handshake(&mut engine, &metrics).await;

    let root = |h: u64, seed: u64| stored_map(&[h], None, &block_tokens(seed, BS), BS);
    engine.publish(1, batch(vec![root(11, 1)], Some(0))).await;
    engine.publish(2, batch(vec![root(12, 2)], Some(0))).await;
    wait_until("first blocks", || index.read().worker_len(AT) == 2).await;

    engine.lose(3, batch(vec![removed_map(&[11])], Some(0)));
    engine.publish(4, batch(vec![root(14, 4)], Some(0))).await;
    wait_until("purge after failed replay", || stats(&metrics).purges == 1).await;
    wait_until("live batch after purge", || {
        index.read().worker_len(AT) == 1
    })
    .await;
    let s = stats(&metrics);
    // The warm start at connect failed too, and said the index may be incomplete.
    assert_eq!((s.gaps, s.replays, s.replay_failures), (1, 2, 2));
    assert_eq!(s.incomplete_starts, 1);
    let key = |seed| index.read().hasher().block_keys(&block_tokens(seed, BS))[0];
    let held: Vec<BlockKey> = blocks(&index).into_iter().map(|(k, _)| k).collect();
    assert_eq!(held, vec![key(4)], "entries from before the gap are gone");

    engine.publish(5, batch(vec![root(15, 5)], Some(0))).await;
    wait_until("rebuilt from live", || index.read().worker_len(AT) == 2).await;
    assert_eq!(stats(&metrics).purges, 1);
    sub.shutdown_and_wait().await;
}

#[tokio::test]
async fn engine_restart_purges_ghosts_and_resubscribes() {
    let mut engine = FakeEngine::start(false).await;
    let (index, metrics) = (new_index(), EventMetrics::new());
    let sub = start(&engine, &index, &metrics);
    handshake(&mut engine, &metrics).await;
    let root = |h: u64, seed: u64| stored_map(&[h], None, &block_tokens(seed, BS), BS);
    engine.publish(1, batch(vec![root(21, 1)], Some(0))).await;
    wait_until("block stored", || index.read().worker_len(AT) == 1).await;

    // The engine dies; a new one binds the same port and numbers from 0 again.
    let endpoint = engine.endpoint.clone();
    drop(engine);
    wait_until("ghosts purged", || index.read().worker_len(AT) == 0).await;
    let mut publisher = PubSocket::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while publisher.bind(&endpoint).await.is_err() {
        assert!(tokio::time::Instant::now() < deadline, "port not reusable");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut engine = FakeEngine {
        publisher,
        endpoint,
        replay_endpoint: None,
        buffer: Arc::default(),
        router: None,
    };
    let before = stats(&metrics).batches;
    let probe = batch(vec![], Some(0));
    let deadline = tokio::time::Instant::now() + WAIT;
    while stats(&metrics).batches == before {
        assert!(tokio::time::Instant::now() < deadline, "never resubscribed");
        engine.send(0, probe.clone()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    engine.publish(1, batch(vec![root(31, 9)], Some(0))).await;
    wait_until("new engine's block", || index.read().worker_len(AT) == 1).await;
    let s = stats(&metrics);
    assert!(s.reconnects >= 1 && s.purges >= 1 && s.connected, "{s:?}");
    sub.shutdown_and_wait().await;
}

#[tokio::test]
async fn warm_start_replays_history_on_join() {
    let mut engine = FakeEngine::start(true).await;
    let root = |h: u64, seed: u64| stored_map(&[h], None, &block_tokens(seed, BS), BS);
    // History published before anyone subscribed (kept in the replay buffer).
    engine.lose(0, batch(vec![root(41, 1)], Some(0)));
    engine.lose(1, batch(vec![root(42, 2)], Some(0)));
    let (index, metrics) = (new_index(), EventMetrics::new());
    let sub = start(&engine, &index, &metrics);
    let probe = batch(vec![Value::Array(vec![s("Heartbeat")])], Some(0));
    engine.buffer.lock().push((2, probe.clone()));
    let deadline = tokio::time::Instant::now() + WAIT;
    while stats(&metrics).batches < 3 {
        assert!(tokio::time::Instant::now() < deadline, "never joined");
        engine.send(2, probe.clone()).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(index.read().worker_len(AT), 2);
    let s = stats(&metrics);
    assert_eq!(
        (s.replays, s.gaps, s.purges, s.unknown_events),
        (1, 0, 0, 1)
    );
    sub.shutdown_and_wait().await;
}

/// The sequence number is a u64 that wraps: the batch numbered 0 right after
/// u64::MAX is applied, not dropped as stale.
#[tokio::test]
async fn a_batch_after_the_sequence_wraps_is_applied() {
    let mut engine = FakeEngine::start(false).await;
    let (index, metrics) = (new_index(), EventMetrics::new());
    let sub = start(&engine, &index, &metrics);
    handshake(&mut engine, &metrics).await;
    let root = |h: u64, seed: u64| stored_map(&[h], None, &block_tokens(seed, BS), BS);
    // A jump to u64::MAX (just before 0 in the wrapping space: taken as a restart,
    // purge, then apply).
    engine
        .publish(u64::MAX, batch(vec![root(41, 1)], Some(0)))
        .await;
    wait_until("batch u64::MAX", || index.read().worker_len(AT) == 1).await;
    engine.publish(0, batch(vec![root(42, 2)], Some(0))).await;
    wait_until("batch 0 after the wrap", || {
        index.read().worker_len(AT) == 2
    })
    .await;
    let s = stats(&metrics);
    assert_eq!((s.stale_messages, s.restarts), (0, 1), "{s:?}");
    sub.shutdown_and_wait().await;
}

/// A subscriber told to stop (its worker removed, and purged after that) while its
/// peer's snapshot waits to be placed places nothing: the import runs on the blocking
/// pool, where it outlives the subscriber's task, and would put back what the purge
/// removed.
#[tokio::test]
async fn a_snapshot_placed_after_its_subscriber_stopped_is_dropped() {
    use std::sync::atomic::{AtomicBool, Ordering};

    use kvgate_core::HeldBlock;
    use kvgate_events::{Bootstrap, RankSnapshot};

    let engine = FakeEngine::start(false).await;
    let (index, metrics) = (new_index(), EventMetrics::new());
    let snapshot = RankSnapshot {
        blocks: vec![HeldBlock {
            key: BlockKey(7),
            parent: None,
            engine_hash: 70,
            tier: Tier::Device,
        }],
        hole_paths: Vec::new(),
        last_seq: 5,
    };
    let asked = Arc::new(AtomicBool::new(false));
    let bootstrap: Bootstrap = {
        let asked = asked.clone();
        Arc::new(move |_, _| {
            asked.store(true, Ordering::SeqCst);
            let snapshot = snapshot.clone();
            Box::pin(async move { Some(snapshot) })
        })
    };
    let source = EventSource {
        worker: WORKER,
        name: "engine".into(),
        endpoint: engine.endpoint.clone(),
        replay_endpoint: None,
        topic: "kv".into(),
        dp_rank: 0,
    };
    // The index is busy: the snapshot waits for it.
    let writer = index.write();
    let sub = spawn_subscriber_with(source, config(), index.clone(), metrics, Some(bootstrap));
    wait_until("the peer was asked", || asked.load(Ordering::SeqCst)).await;
    sub.shutdown();
    drop(writer);
    // Its task ends once the import on the blocking pool has returned.
    wait_until("the subscriber ended", || sub.is_finished()).await;
    assert_eq!(index.read().worker_len(AT), 0);
}
