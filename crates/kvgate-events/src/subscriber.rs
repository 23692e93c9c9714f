//! One subscriber task per engine event endpoint: ZeroMQ SUB → decode → index.
//!
//! Owns the connection lifecycle (connect, subscribe, watch the link, reconnect with
//! backoff), the warm start on connecting (a peer router's snapshot of the worker rank
//! on the first connection, then the engine's replay buffer from where it ends, and
//! saying so when what came before cannot all be learned), sequence tracking with
//! replay on gaps, and purging a worker rank whose stream cannot be trusted
//! (unrecoverable gap, engine restart, lost connection). It
//! must not decide routing, and never holds the index lock across an `.await`: the
//! write lock is taken once per batch (and let go to waiting lookups between its
//! slices, `apply`).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvgate_core::{SnapshotImport, WorkerId, WorkerRef};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use zeromq::{Socket, SocketRecv, SubSocket};

use crate::apply::{apply_batch, import_snapshot};
use crate::bootstrap::Bootstrap;
use crate::link::LinkWatch;
use crate::metrics::DropReason;
use crate::metrics::{EventMetrics, WorkerCounters};
use crate::replay::{fetch_replay, ReplayLimits, ReplayedBatch};
use crate::sequence::{covers, Cursor, Verdict};
use crate::shared::{IndexLock, SharedIndex};
use crate::wire::decode_batch;

/// One engine event stream to follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventSource {
    pub worker: WorkerId,
    /// The worker's name (its URL): what a bootstrap asks peer routers about.
    pub name: String,
    /// The engine's PUB endpoint, `tcp://host:port` (vLLM: rank r publishes on port+r).
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint, if it has one.
    pub replay_endpoint: Option<String>,
    /// Topic prefix filter; empty subscribes to everything.
    pub topic: String,
    /// Data-parallel rank used when a batch does not say which rank published it.
    pub dp_rank: u32,
}

impl EventSource {
    pub fn new(worker: WorkerId, endpoint: impl Into<String>) -> Self {
        Self {
            worker,
            name: worker.to_string(),
            endpoint: endpoint.into(),
            replay_endpoint: None,
            topic: String::new(),
            dp_rank: 0,
        }
    }
}

/// Timing knobs of a subscriber.
#[derive(Clone, Copy, Debug)]
pub struct SubscriberConfig {
    /// Bound on establishing the SUB connection (and the link watch).
    pub connect_timeout: Duration,
    /// First reconnect delay; doubles up to `backoff_max`.
    pub backoff_initial: Duration,
    pub backoff_max: Duration,
    pub replay: ReplayLimits,
    /// On joining a stream that already started, replay the engine's buffer from 0 to
    /// learn what it cached before we connected.
    pub warm_start: bool,
}

impl Default for SubscriberConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(3),
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            replay: ReplayLimits::default(),
            warm_start: true,
        }
    }
}

/// Stops its subscriber when told to, or when dropped (the task is aborted).
#[derive(Debug)]
pub struct SubscriberHandle {
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl SubscriberHandle {
    /// Asks the subscriber to stop; it exits at its next await point.
    pub fn shutdown(&self) {
        let _ = self.stop.send(true);
    }

    /// Stops the subscriber and waits until its task has ended.
    pub async fn shutdown_and_wait(mut self) {
        self.shutdown();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }

    pub fn is_finished(&self) -> bool {
        self.task.as_ref().is_none_or(|t| t.is_finished())
    }
}

impl Drop for SubscriberHandle {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// Forgets everything a worker holds (all ranks): call when a worker is removed from
/// the fleet or declared dead. Returns the entries removed.
pub fn purge_worker(index: &IndexLock, worker: WorkerId) -> usize {
    index.write().remove_worker(worker)
}

/// Spawns a subscriber with default timing. Must be called inside a tokio runtime.
pub fn spawn_subscriber(
    source: EventSource,
    index: SharedIndex,
    metrics: Arc<EventMetrics>,
    bootstrap: Option<Bootstrap>,
) -> SubscriberHandle {
    spawn_subscriber_with(
        source,
        SubscriberConfig::default(),
        index,
        metrics,
        bootstrap,
    )
}

/// Spawns a subscriber with explicit timing. Must be called inside a tokio runtime.
/// With a `bootstrap`, its first connection loads a peer router's snapshot of the
/// worker rank before replaying the engine's buffer from where the snapshot ends.
pub fn spawn_subscriber_with(
    source: EventSource,
    config: SubscriberConfig,
    index: SharedIndex,
    metrics: Arc<EventMetrics>,
    bootstrap: Option<Bootstrap>,
) -> SubscriberHandle {
    let (stop, stop_rx) = watch::channel(false);
    let mut ingest = Ingest::new(source, index, metrics);
    ingest.bootstrap = bootstrap;
    let task = tokio::spawn(run(ingest, config, stop_rx));
    SubscriberHandle {
        stop,
        task: Some(task),
    }
}

/// Applies payloads of one stream to the index and keeps its counters.
struct Ingest {
    source: EventSource,
    index: SharedIndex,
    metrics: Arc<EventMetrics>,
    counters: Arc<WorkerCounters>,
    cursor: Cursor,
    /// Ranks this stream has written to the index (purged together).
    ranks_seen: Vec<u32>,
    /// Asks a peer router for its snapshot of this worker rank (first connection).
    bootstrap: Option<Bootstrap>,
}

impl Ingest {
    fn new(source: EventSource, index: SharedIndex, metrics: Arc<EventMetrics>) -> Self {
        let counters = metrics.worker(source.worker);
        Self {
            source,
            index,
            metrics,
            counters,
            cursor: Cursor::default(),
            ranks_seen: Vec::new(),
            bootstrap: None,
        }
    }

    /// Counts and (rate-limited) logs one dropped message.
    fn dropped(&self, reason: DropReason) {
        let at = WorkerRef::new(self.source.worker, self.source.dp_rank);
        self.counters.dropped(at, reason, 1);
    }

    /// Decodes and applies one payload; returns false if it could not be decoded.
    fn apply_payload(&mut self, seq: u64, payload: &[u8]) -> bool {
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                tracing::debug!(
                    worker = %self.source.worker,
                    endpoint = %self.source.endpoint,
                    seq,
                    error = %e,
                    "undecodable KV event payload"
                );
                self.dropped(DropReason::DecodeError);
                return false;
            }
        };
        let rank = batch.dp_rank.unwrap_or(self.source.dp_rank);
        if !self.ranks_seen.contains(&rank) {
            self.ranks_seen.push(rank);
        }
        let at = WorkerRef::new(self.source.worker, rank);
        let stream = WorkerRef::new(self.source.worker, self.source.dp_rank);
        let (outcome, block_size, entries) = {
            let mut index = self.index.write();
            // Lookups may get in between slices of the batch (`apply_batch`), and so may
            // a peer's snapshot: part of the batch under the previous sequence number,
            // which a router loading it replays from (stores and removals apply again
            // as no-ops, so it ends where this index does).
            let outcome = apply_batch(&mut index, at, &batch);
            index.set_applied_seq(stream, seq);
            (outcome, index.block_size(), index.len())
        };
        self.metrics.set_index_entries(entries);
        self.counters.record(at, block_size, &outcome);
        true
    }

    /// Drops everything this stream put in the index.
    fn purge(&mut self, reason: &str) {
        let mut ranks = self.ranks_seen.clone();
        if !ranks.contains(&self.source.dp_rank) {
            ranks.push(self.source.dp_rank);
        }
        let (removed, entries) = {
            let mut index = self.index.write();
            let removed: usize = ranks
                .iter()
                .map(|&r| index.clear(WorkerRef::new(self.source.worker, r)))
                .sum();
            (removed, index.len())
        };
        self.metrics.set_index_entries(entries);
        WorkerCounters::inc(&self.counters.purges);
        tracing::warn!(
            worker = %self.source.worker,
            endpoint = %self.source.endpoint,
            removed,
            reason,
            "purged worker's prefix-index entries"
        );
    }

    async fn replay(&self, from: u64, config: &SubscriberConfig) -> Option<Vec<ReplayedBatch>> {
        let endpoint = self.source.replay_endpoint.as_deref()?;
        WorkerCounters::inc(&self.counters.replays);
        match fetch_replay(endpoint, from, config.replay).await {
            Ok(mut batches) => {
                batches.sort_by_key(|b| b.seq);
                batches.dedup_by_key(|b| b.seq);
                Some(batches)
            }
            Err(e) => {
                WorkerCounters::inc(&self.counters.replay_failures);
                tracing::warn!(
                    worker = %self.source.worker,
                    endpoint,
                    from,
                    error = %e,
                    "KV event replay failed"
                );
                None
            }
        }
    }

    /// Applies replayed batches newer than the cursor, in order, stopping at a hole.
    fn apply_replayed(&mut self, batches: &[ReplayedBatch]) {
        let mut last = self.cursor.last();
        for b in batches {
            if last.is_some_and(|l| b.seq <= l) {
                continue;
            }
            if last.is_some_and(|l| b.seq != l + 1) {
                break;
            }
            self.apply_payload(b.seq, &b.payload);
            last = Some(b.seq);
        }
        if let Some(l) = last {
            self.cursor.replayed(l);
        }
    }

    /// On connecting: learns what the engine cached before from its replay buffer (from
    /// sequence 0), so a router that starts after the engines routes to their cached
    /// prefixes from its first request, before any new event arrives.
    async fn warm_start(&mut self, config: &SubscriberConfig, stop: &watch::Receiver<bool>) {
        if !config.warm_start || self.cursor.last().is_some() {
            return;
        }
        // A peer's snapshot first: it reaches back further than the engine's buffer.
        let from = match self.load_snapshot(stop).await {
            Some(last_seq) => last_seq.wrapping_add(1),
            None => 0,
        };
        if self.source.replay_endpoint.is_none() {
            // Nothing to ask; the first live message says whether anything came before.
            return;
        }
        match self.replay(from, config).await {
            Some(batches) => self.warm_from(from, &batches),
            None => self.incomplete("the replay at connect failed"),
        }
    }

    /// Loads a peer router's snapshot of this worker rank, if a bootstrap is set and a
    /// peer has one; returns the last sequence number it reflects.
    async fn load_snapshot(&mut self, stop: &watch::Receiver<bool>) -> Option<u64> {
        // Only the first connection: after a reconnect (an engine restart, a lost
        // link) the engine's own buffer is the truth, and a peer may not know yet.
        let bootstrap = self.bootstrap.take()?;
        let rank = self.source.dp_rank;
        let snapshot = bootstrap(self.source.name.clone(), rank).await?;
        let at = WorkerRef::new(self.source.worker, rank);
        let last_seq = snapshot.last_seq;
        let (index, stop) = (self.index.clone(), stop.clone());
        // A rank of a quarter of a million blocks takes about 0.2 s to prepare and
        // place: on the blocking pool, not a runtime thread, and in slices under the
        // write lock, so lookups go on in between. A subscriber told to stop by then
        // (its worker removed, and purged after that) places nothing: this task may
        // be aborted while the import runs on.
        let placed = tokio::task::spawn_blocking(move || {
            let mut import = SnapshotImport::new(&snapshot.blocks, &snapshot.hole_paths);
            let mut index = index.write();
            if *stop.borrow() {
                return None;
            }
            let held = import_snapshot(&mut index, at, &mut import);
            index.set_applied_seq(at, last_seq);
            Some((held, index.len()))
        })
        .await;
        let (held, entries) = match placed {
            Ok(Some(placed)) => placed,
            Ok(None) => return None,
            Err(e) => {
                tracing::error!(worker = %self.source.worker, rank, error = %e, "loading a peer router's index snapshot failed");
                return None;
            }
        };
        self.metrics.set_index_entries(entries);
        if !self.ranks_seen.contains(&rank) {
            self.ranks_seen.push(rank);
        }
        self.cursor.replayed(last_seq);
        WorkerCounters::inc(&self.counters.snapshot_loads);
        tracing::info!(
            worker = %self.source.worker,
            name = %self.source.name,
            rank,
            blocks = held,
            last_seq,
            "loaded a peer router's index snapshot of this worker; replaying the engine's events after it"
        );
        Some(last_seq)
    }

    /// Applies a replay asked from sequence `from`; a buffer that no longer reaches
    /// back to `from` means batches before it are lost to this router.
    fn warm_from(&mut self, from: u64, batches: &[ReplayedBatch]) {
        let Some(first) = batches.first() else {
            return;
        };
        let first = first.seq;
        self.apply_replayed(batches);
        if first > from {
            self.incomplete(&format!(
                "the engine's replay buffer starts at seq {first}, not {from}"
            ));
        }
    }

    /// Says (a counter and a warning) that the index may not show everything this
    /// worker cached before this router joined.
    fn incomplete(&self, why: &str) {
        WorkerCounters::inc(&self.counters.incomplete_starts);
        tracing::warn!(
            worker = %self.source.worker,
            endpoint = %self.source.endpoint,
            why,
            "prefix index may be incomplete for this worker: blocks it cached before this router joined are unknown until they are used again or evicted"
        );
    }

    /// Handles one live message.
    async fn on_live(&mut self, seq: u64, payload: Bytes, config: &SubscriberConfig) {
        match self.cursor.classify(seq) {
            Verdict::Apply => {}
            Verdict::Stale => {
                self.dropped(DropReason::Stale);
                return;
            }
            Verdict::Restart => self.restarted(seq),
            Verdict::Join => {
                // The connect-time warm start found nothing to replay (or could not):
                // what was published since may be in the buffer now.
                let replayed = if config.warm_start {
                    self.replay(0, config).await
                } else {
                    None
                };
                match replayed {
                    Some(batches) => self.warm_from(0, &batches),
                    None if seq > 0 => self.incomplete(&format!(
                        "joined the event stream at seq {seq} without a replay of what came before"
                    )),
                    None => {}
                }
            }
            Verdict::Gap { from } => {
                WorkerCounters::inc(&self.counters.gaps);
                let recovered = match self.replay(from, config).await {
                    Some(batches) => {
                        let seqs: Vec<u64> = batches.iter().map(|b| b.seq).collect();
                        if covers(&seqs, from, seq) {
                            self.apply_replayed(&batches);
                            true
                        } else {
                            WorkerCounters::inc(&self.counters.replay_failures);
                            false
                        }
                    }
                    None => false,
                };
                if !recovered {
                    self.purge("unrecoverable sequence gap");
                    self.cursor.reset();
                }
            }
        }
        self.apply_in_order(seq, &payload);
    }

    /// The sequence went backwards: the engine restarted with an empty cache.
    fn restarted(&mut self, seq: u64) {
        WorkerCounters::inc(&self.counters.restarts);
        tracing::warn!(
            worker = %self.source.worker,
            seq,
            last = ?self.cursor.last(),
            "KV event sequence went backwards: engine restarted"
        );
        self.purge("engine restart (sequence reset)");
        self.cursor.reset();
    }

    /// Applies a live message the cursor has not seen yet and advances the cursor.
    fn apply_in_order(&mut self, seq: u64, payload: &[u8]) {
        if self.cursor.already_applied(seq) {
            self.dropped(DropReason::Stale);
            return;
        }
        self.apply_payload(seq, payload);
        self.cursor.advance(seq);
    }
}

/// An engine's event stream handed over in process instead of read from a socket (the
/// virtual-time simulation, `kvgate simulate`): the same ingest as a subscriber (the
/// sequence cursor, a restart's purge, decoding, [`apply_batch`], the counters) without
/// the socket, so what the index learns is what a subscriber would have learned. There
/// is no replay buffer behind it: a gap purges the worker, as a failed replay does.
pub struct EventFeed {
    ingest: Ingest,
}

impl EventFeed {
    /// A feed for `source.worker` into `index`.
    pub fn new(source: EventSource, index: SharedIndex, metrics: Arc<EventMetrics>) -> Self {
        Self {
            ingest: Ingest::new(source, index, metrics),
        }
    }

    /// One message as the engine published it: its sequence number and payload.
    pub fn deliver(&mut self, seq: u64, payload: &[u8]) {
        let ingest = &mut self.ingest;
        match ingest.cursor.classify(seq) {
            Verdict::Apply | Verdict::Join => {}
            Verdict::Stale => {
                ingest.dropped(DropReason::Stale);
                return;
            }
            Verdict::Restart => ingest.restarted(seq),
            Verdict::Gap { .. } => {
                WorkerCounters::inc(&ingest.counters.gaps);
                ingest.purge("unrecoverable sequence gap");
                ingest.cursor.reset();
            }
        }
        ingest.apply_in_order(seq, payload);
    }
}

fn relaxed() -> std::sync::atomic::Ordering {
    std::sync::atomic::Ordering::Relaxed
}

/// Splits a live SUB message into `(seq, payload)`: `[topic, seq, payload]` or
/// `[seq, payload]`.
fn parse_live(frames: &[Bytes]) -> Option<(u64, Bytes)> {
    let (seq, payload) = match frames.len() {
        3 => (&frames[1], &frames[2]),
        2 => (&frames[0], &frames[1]),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload.clone()))
}

async fn connect(
    source: &EventSource,
    config: &SubscriberConfig,
) -> Result<(SubSocket, LinkWatch), String> {
    let link = LinkWatch::connect(&source.endpoint, config.connect_timeout)
        .await
        .map_err(|e| e.to_string())?;
    let mut sub = SubSocket::new();
    tokio::time::timeout(config.connect_timeout, sub.connect(&source.endpoint))
        .await
        .map_err(|_| "connect timed out".to_owned())?
        .map_err(|e| e.to_string())?;
    sub.subscribe(&source.topic)
        .await
        .map_err(|e| e.to_string())?;
    Ok((sub, link))
}

/// Sleeps `d` unless told to stop; returns true if stopping.
async fn sleep_or_stop(d: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        _ = tokio::time::sleep(d) => *stop.borrow(),
        _ = stop.changed() => true,
    }
}

async fn run(mut ingest: Ingest, config: SubscriberConfig, mut stop: watch::Receiver<bool>) {
    let mut backoff = config.backoff_initial;
    let mut connected_before = false;
    let worker = ingest.source.worker;
    while !*stop.borrow() {
        let (mut sub, mut link) = match connect(&ingest.source, &config).await {
            Ok(s) => s,
            Err(error) => {
                tracing::debug!(%worker, endpoint = %ingest.source.endpoint, %error,
                    ?backoff, "KV event endpoint not reachable; retrying");
                if sleep_or_stop(backoff, &mut stop).await {
                    break;
                }
                backoff = (backoff * 2).min(config.backoff_max);
                continue;
            }
        };
        backoff = config.backoff_initial;
        if connected_before {
            WorkerCounters::inc(&ingest.counters.reconnects);
        }
        connected_before = true;
        ingest.counters.connected.store(1, relaxed());
        tracing::info!(%worker, endpoint = %ingest.source.endpoint, "subscribed to KV events");
        ingest.warm_start(&config, &stop).await;
        let stopping = loop {
            tokio::select! {
                _ = stop.changed() => break true,
                error = link.closed() => {
                    tracing::warn!(%worker, endpoint = %ingest.source.endpoint, %error,
                        "KV event publisher went away; purging and reconnecting");
                    break false;
                }
                msg = sub.recv() => match msg {
                    Ok(msg) => match parse_live(&msg.into_vec()) {
                        Some((seq, payload)) => ingest.on_live(seq, payload, &config).await,
                        None => ingest.dropped(DropReason::DecodeError),
                    },
                    Err(error) => {
                        tracing::warn!(%worker, %error, "KV event socket failed; reconnecting");
                        break false;
                    }
                },
            }
        };
        ingest.counters.connected.store(0, relaxed());
        if stopping {
            break;
        }
        // The engine is gone or restarting: its cache will not survive, so neither may
        // its entries. The next connection starts a fresh stream.
        ingest.purge("lost connection to engine");
        ingest.cursor.reset();
        drop(sub);
        if sleep_or_stop(backoff, &mut stop).await {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_frames() {
        let b = |s: &[u8]| Bytes::copy_from_slice(s);
        let seq = 3u64.to_be_bytes();
        assert_eq!(
            parse_live(&[b(b"kv"), b(&seq), b(b"x")]),
            Some((3, b(b"x")))
        );
        assert_eq!(parse_live(&[b(&seq), b(b"x")]), Some((3, b(b"x"))));
        assert_eq!(parse_live(&[b(b"kv"), b(b"bad"), b(b"x")]), None);
        assert_eq!(parse_live(&[b(b"x")]), None);
    }
}
