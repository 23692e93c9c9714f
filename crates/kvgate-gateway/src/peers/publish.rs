//! Publishing this replica's report: its booked load per model and worker (by URL),
//! whenever it changes and at least every heartbeat, and expiring silent peers. Must
//! not read peers' reports (follow.rs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::gateway::Gateway;

use crate::peer_link::wire::{WireLoad, WireModel, WireReport};

/// This replica's load per model and worker, by URL.
fn local_loads(gw: &Gateway) -> Vec<WireModel> {
    gw.pools_named()
        .map(|(m, pool)| {
            let workers = m.workers();
            let ids: Vec<_> = workers.iter().map(|w| w.id).collect();
            let loads = m.ledger().loads_of(&ids);
            let mut prefilling = m.ledger().prefilling_checkpoints();
            WireModel {
                model: m.name.to_string(),
                pool: pool.to_string(),
                workers: workers
                    .iter()
                    .zip(loads)
                    .filter(|(_, l)| l.in_flight > 0)
                    .map(|(w, l)| WireLoad {
                        url: w.url.to_string(),
                        in_flight: l.in_flight,
                        prefill_tokens: l.prefill_tokens,
                        decode_blocks: l.decode_blocks,
                        prefilling: prefilling
                            .iter_mut()
                            .filter(|(on, _)| *on == w.id)
                            .map(|(_, keys)| keys.drain(..).map(|k| k.0).collect())
                            .collect(),
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Publishes this replica's report whenever its bookings change (checked every
/// `publish_ms`) and at least every `heartbeat_ms`, and expires silent peers, until
/// shutdown. Runs whether or not peers are configured: a peer may follow this
/// replica without this one following it.
pub async fn run_publisher(gw: Arc<Gateway>) {
    let Some(identity) = gw.peers.identity().cloned() else {
        return;
    };
    let cfg = &gw.config.peers;
    let heartbeat = Duration::from_millis(cfg.heartbeat_ms);
    let expiry = Duration::from_millis(cfg.expiry_ms);
    let mut ticks = gw.ticks(Duration::from_millis(cfg.publish_ms));
    // Long enough for every follower to see a settled id in some report.
    let settled_window = Duration::from_millis((cfg.publish_ms * 10).max(250));
    let mut last: Option<(Vec<WireModel>, Vec<u64>, Instant)> = None;
    let mut seq = 0u64;
    while ticks.next().await {
        let now = Instant::now();
        // Only a replica that follows peers holds their reports (and a follower also
        // drops a peer whose stream goes silent; this is the backstop).
        for m in gw.pools().filter(|_| cfg.enabled()) {
            for gone in m.ledger().expire_peers(now, expiry) {
                tracing::warn!(model = %m.name, replica = %gone, ?expiry, "peer replica went silent; dropping its bookings");
            }
        }
        if gw.peers.latest.receiver_count() == 0 {
            // Nobody follows this replica: build nothing, and let the next follower
            // wait for a fresh report rather than read a stale one.
            if !gw.peers.latest.borrow().is_empty() {
                gw.peers.latest.send_replace(Bytes::new());
            }
            last = None;
            continue;
        }
        let (settled, settled_below, models) = gw
            .peers
            .settled_with_loads(settled_window, || local_loads(&gw));
        let due = match &last {
            None => true,
            Some((prev, prev_settled, at)) => {
                *prev != models || *prev_settled != settled || now.duration_since(*at) >= heartbeat
            }
        };
        if !due {
            continue;
        }
        seq += 1;
        let report = WireReport {
            replica: identity.replica.clone(),
            incarnation: identity.incarnation,
            seq,
            models: models.clone(),
            settled: settled.clone(),
            settled_below,
        };
        match serde_json::to_vec(&report) {
            Ok(mut line) => {
                line.push(b'\n');
                gw.peers.latest.send_replace(Bytes::from(line));
            }
            Err(err) => tracing::warn!(%err, "cannot encode the load report"),
        }
        last = Some((models, settled, now));
    }
}
