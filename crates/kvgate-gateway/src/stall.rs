//! Stalled engines: an engine core that stops working behind an API server that still
//! answers. vLLM's `/health` answers 200 while its engine process is stopped, and its
//! API server sends a stream's head at once, so neither health checks nor the head
//! show it; only the first-byte timeout (600 s by default) bounded such requests.
//!
//! The rule: a worker with routed requests in flight whose engine has sent no byte of
//! an answer and published no KV event for `health.stall_ms` is stalled. A working
//! engine shows one or the other within seconds while it holds requests: streamed
//! tokens, a finished answer, and the KV events of every block it fills (during
//! prefill and during decode, a block every `block_size` tokens), so a long
//! non-streamed generation is not taken for a stall. The rule judges only workers whose
//! KV events kvgate reads (kv_aware's) and has seen (it has no signal for a
//! non-streamed answer without them; those keep the first-byte timeout). A stalled
//! worker leaves rotation at once and its requests are cut off (health.rs's
//! `worker_stalled`: those waiting for their first byte go to another worker, streams
//! under way end with an error event). It comes
//! back only when the engine generates again: the health checks probe it with a
//! one-token completion instead of `GET /health` (a 2xx within the probe timeout
//! brings it back; a timeout keeps it out; an answer that cannot tell, such as an
//! engine refusing the probe's model name or credentials, hands it back to the plain
//! health check).
//!
//! Owns the watcher task (reading each worker's progress clock, progress.rs, touched
//! by failover.rs when an answer starts and by observe.rs on every body chunk, and
//! counting KV events from the event counters) and the generation probe (checks.rs
//! sends it). What a stall does to the breaker and the requests in flight is
//! health.rs's. Must not touch the index or the ledger.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderValue};
use kvgate_core::WorkerId;
use rustc_hash::FxHashMap;

use crate::gateway::Gateway;
use crate::health::worker_stalled;
use crate::progress::Progress;
use crate::proxy::Upstream;
use crate::registry::{Endpoint, ModelState, Worker};

/// The watcher's view of one worker between ticks.
#[derive(Debug, Default)]
struct Watch {
    /// Since when the worker has had requests in flight without a break.
    busy_since: Option<Instant>,
    /// The worker's KV event batches counted at the last tick.
    event_batches: u64,
}

impl Watch {
    /// One look at a worker at `now`: true when it has been busy for `stall` and its
    /// engine showed no progress in that time.
    fn stalled(
        &mut self,
        now: Instant,
        in_flight: u32,
        event_batches: u64,
        progress: &Progress,
        stall: Duration,
    ) -> bool {
        if event_batches != self.event_batches {
            self.event_batches = event_batches;
            progress.touch_at(now);
        }
        if in_flight == 0 {
            self.busy_since = None;
            return false;
        }
        let busy_since = *self.busy_since.get_or_insert(now);
        // No KV events from this engine yet: nothing shows a non-streamed answer's
        // progress, so no verdict.
        if event_batches == 0 {
            return false;
        }
        let quiet_since = busy_since.max(progress.last());
        now.saturating_duration_since(quiet_since) >= stall
    }
}

/// Watches every worker for stalls until shutdown (no-op when `health.stall_ms` is 0).
pub async fn run_stall_watch(gw: Arc<Gateway>) {
    let stall = Duration::from_millis(gw.config.health.stall_ms);
    if stall.is_zero() {
        return;
    }
    let period = (stall / 4).clamp(Duration::from_millis(50), Duration::from_secs(1));
    let mut watches: FxHashMap<WorkerId, Watch> = FxHashMap::default();
    let mut ticks = gw.ticks(period);
    while ticks.next().await {
        let now = Instant::now();
        let mut live = Vec::new();
        for model in gw.pools() {
            for worker in model.workers().iter() {
                live.push(worker.id);
                if worker.progress.is_stalled() {
                    watches.remove(&worker.id);
                    // Out of rotation; the health checks probe it. Without active
                    // checks its breaker half-opens by itself, and the watch resumes.
                    let passive = gw.passive_open_ms();
                    if passive.is_none() || !worker.breaker.available(passive) {
                        continue;
                    }
                    worker.progress.set_stalled(false);
                    worker.progress.touch();
                }
                let in_flight = model.selection.ledger().load(worker.id).in_flight;
                let batches = gw.events.batches_of(worker.id);
                let watch = watches.entry(worker.id).or_default();
                if watch.stalled(now, in_flight, batches, &worker.progress, stall) {
                    worker_stalled(&gw, model, worker, stall);
                    watches.remove(&worker.id);
                }
            }
        }
        watches.retain(|id, _| live.contains(id));
    }
}

/// What a one-token completion said about a stalled worker's engine.
#[derive(Debug)]
pub(crate) enum ProbeAnswer {
    /// It generated: the engine works.
    Generated,
    /// No answer within the probe timeout (or no connection): still stalled.
    Silent(String),
    /// An answer that does not say whether the engine generates (an error status:
    /// the API server refused the probe before its engine saw it).
    CannotTell(String),
}

/// Longest a generation probe waits (at least the health timeout).
pub(crate) fn probe_timeout(gw: &Gateway) -> Duration {
    Duration::from_millis(gw.config.health.timeout_ms.max(5_000))
}

/// Asks a stalled worker's engine for one token of a tiny completion.
pub(crate) async fn generation_probe(
    gw: &Gateway,
    model: &ModelState,
    worker: &Worker,
) -> ProbeAnswer {
    let body = serde_json::json!({
        "model": &*model.name,
        "prompt": "ping",
        "max_tokens": 1,
        "temperature": 0,
        "stream": false,
    });
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let upstream = Upstream {
        first_byte_timeout: Some(probe_timeout(gw)),
        ..gw.upstream()
    };
    let sent = upstream
        .send(
            worker,
            Endpoint::Completions,
            &headers,
            Bytes::from(body.to_string()),
        )
        .await;
    match sent {
        Ok(resp) if resp.status().is_success() => ProbeAnswer::Generated,
        Ok(resp) => ProbeAnswer::CannotTell(format!("probe answered {}", resp.status())),
        Err(e) => ProbeAnswer::Silent(format!("generation probe failed: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_secs(60);

    fn secs(t0: Instant, s: u64) -> Instant {
        t0 + Duration::from_secs(s)
    }

    /// Busy with no token and no event for the whole window: stalled; a byte or an
    /// event inside the window restarts it; an idle worker is never stalled.
    #[test]
    fn a_busy_worker_without_progress_for_the_window_is_stalled() {
        let p = Progress::default();
        let t0 = p.epoch;
        let mut w = Watch::default();
        assert!(!w.stalled(secs(t0, 1), 0, 5, &p, STALL), "idle");
        assert!(!w.stalled(secs(t0, 100), 0, 5, &p, STALL), "idle for long");
        // Busy from 100 s on.
        assert!(!w.stalled(secs(t0, 101), 2, 5, &p, STALL));
        assert!(!w.stalled(secs(t0, 150), 2, 5, &p, STALL));
        // A streamed token at 150 s.
        p.touch_at(secs(t0, 150));
        assert!(!w.stalled(secs(t0, 200), 2, 5, &p, STALL));
        // A KV event batch between ticks counts at the tick that sees it.
        assert!(!w.stalled(secs(t0, 205), 2, 6, &p, STALL));
        assert!(!w.stalled(secs(t0, 264), 2, 6, &p, STALL));
        assert!(
            w.stalled(secs(t0, 265), 2, 6, &p, STALL),
            "60 s quiet while busy"
        );
    }

    /// The window starts when the worker got busy, not at its last progress: a worker
    /// idle for an hour is not stalled the moment a request arrives.
    #[test]
    fn the_window_starts_when_the_worker_got_busy() {
        let p = Progress::default();
        let t0 = p.epoch;
        let mut w = Watch::default();
        assert!(!w.stalled(secs(t0, 3600), 1, 5, &p, STALL));
        assert!(!w.stalled(secs(t0, 3659), 1, 5, &p, STALL));
        assert!(w.stalled(secs(t0, 3660), 1, 5, &p, STALL));
        // Requests ended: the next busy spell has its own window.
        assert!(!w.stalled(secs(t0, 3700), 0, 5, &p, STALL));
        assert!(!w.stalled(secs(t0, 3701), 1, 5, &p, STALL));
        assert!(!w.stalled(secs(t0, 3760), 1, 5, &p, STALL));
    }

    /// An engine that has published no KV event gives no signal for a non-streamed
    /// answer's progress: no verdict, however long.
    #[test]
    fn no_verdict_without_kv_events() {
        let p = Progress::default();
        let t0 = p.epoch;
        let mut w = Watch::default();
        assert!(!w.stalled(secs(t0, 1), 3, 0, &p, STALL));
        assert!(!w.stalled(secs(t0, 1000), 3, 0, &p, STALL));
    }
}
