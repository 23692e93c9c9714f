//! Following peers: each peer's report stream (static URLs, or the addresses of a DNS
//! name re-resolved periodically), handed to the models' ledgers; a stream that ends
//! drops what that peer reported. Must not publish (publish.rs).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use http::StatusCode;
use http_body_util::BodyExt;
use kvgate_core::{BlockKey, PeerApplied, PeerReport, WorkerLoad};
use tokio_util::sync::CancellationToken;

use crate::gateway::Gateway;

use crate::peer_link::client::{has_this_name, peer_request, peer_urls};
use crate::peer_link::hub::Identity;
use crate::peer_link::wire::{WireReport, LOADS_PATH};

/// A report line longer than this ends the stream (a peer gone wrong).
const MAX_REPORT_BYTES: usize = 4 << 20;
/// Wait before following a peer again after its stream ended or failed.
const BACKOFF_INITIAL: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Follows every configured peer until shutdown: the static URLs, and the addresses
/// of the DNS name, re-resolved every `dns_refresh_ms` (a peer whose address leaves
/// the name stops being followed, and its bookings drop).
pub async fn run_followers(gw: Arc<Gateway>) {
    let cfg = gw.config.peers.clone();
    if !cfg.enabled() {
        return;
    }
    let mut following: BTreeMap<String, CancellationToken> = BTreeMap::new();
    let mut refresh = gw.ticks(Duration::from_millis(cfg.dns_refresh_ms));
    while refresh.next().await {
        let mut wanted = match peer_urls(&cfg).await {
            Ok(urls) => urls,
            Err(err) => {
                // Keep following the last known addresses rather than drop them all on
                // a resolver hiccup.
                tracing::warn!(dns = ?cfg.dns, %err, "cannot resolve the peers' DNS name; keeping the last addresses");
                let mut urls = cfg.urls.clone();
                urls.extend(following.keys().cloned());
                urls
            }
        };
        wanted.sort();
        wanted.dedup();
        following.retain(|url, stop| {
            let keep = wanted.contains(url);
            if !keep {
                tracing::info!(peer = %url, "peer address gone from DNS; no longer following it");
                stop.cancel();
            }
            keep
        });
        for url in wanted {
            if following.contains_key(&url) {
                continue;
            }
            let stop = gw.shutdown.child_token();
            following.insert(url.clone(), stop.clone());
            tokio::spawn(follow(gw.clone(), url, stop));
        }
    }
    for stop in following.values() {
        stop.cancel();
    }
}

/// How one stream from a peer ended.
#[derive(Debug)]
enum StreamEnd {
    /// The address is this replica: never follow it.
    IsSelf,
    /// Told to stop (shutdown, or the address left DNS).
    Stopped,
    /// Ended or failed: follow again after a backoff.
    Retry(String),
}

/// Follows one peer address until `stop`: streams its reports into the ledgers, and
/// when the stream ends drops the bookings it reported and follows it again.
async fn follow(gw: Arc<Gateway>, url: String, stop: CancellationToken) {
    let mut backoff = BACKOFF_INITIAL;
    let mut last_error = String::new();
    loop {
        let started = Instant::now();
        match follow_once(&gw, &url, &stop).await {
            StreamEnd::IsSelf => {
                tracing::debug!(peer = %url, "peer address is this replica; skipping it");
                return;
            }
            StreamEnd::Stopped => return,
            StreamEnd::Retry(error) => {
                if error != last_error {
                    tracing::warn!(peer = %url, %error, "peer report stream ended; following it again");
                    last_error = error;
                }
            }
        }
        if started.elapsed() > BACKOFF_MAX {
            backoff = BACKOFF_INITIAL;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// One stream from a peer; whatever the peer reported is dropped when it ends.
async fn follow_once(gw: &Gateway, url: &str, stop: &CancellationToken) -> StreamEnd {
    if gw.peers.identity().is_none() {
        return StreamEnd::Stopped;
    }
    let expiry = Duration::from_millis(gw.config.peers.expiry_ms);
    let req = match peer_request(
        http::Method::GET,
        format!("{url}{LOADS_PATH}"),
        Bytes::new(),
        &gw.peers,
        gw.config.admin_token.as_deref(),
    ) {
        Ok(r) => r,
        Err(e) => return StreamEnd::Retry(e),
    };
    let resp = tokio::select! {
        _ = stop.cancelled() => return StreamEnd::Stopped,
        r = tokio::time::timeout(expiry, gw.client.request(req)) => match r {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => return StreamEnd::Retry(format!("cannot connect: {e}")),
            Err(_) => return StreamEnd::Retry("no answer".into()),
        },
    };
    match resp.status() {
        StatusCode::OK => {}
        StatusCode::CONFLICT => {
            let duplicate = tokio::time::timeout(expiry, has_this_name(resp)).await;
            if duplicate != Ok(true) {
                return StreamEnd::IsSelf;
            }
            // Started together (each passed the other's start-up check): neither
            // sees the other's bookings until one is renamed.
            tracing::error!(peer = %url, "this peer runs under this replica's name: give every replica its own --replica-id");
            return StreamEnd::Retry("the peer has this replica's name".into());
        }
        status => return StreamEnd::Retry(format!("answered {status}")),
    }
    let connected = gw.metrics.peers_connected.clone();
    connected.inc();
    let mut heard: Option<(String, u64)> = None;
    let end = read_reports(gw, url, resp.into_body(), expiry, stop, &mut heard).await;
    gw.peers.followed.lock().remove(url);
    connected.dec();
    if let Some((replica, incarnation)) = heard {
        for m in gw.pools() {
            if m.ledger().remove_peer(&replica, incarnation) {
                tracing::info!(model = %m.name, %replica, peer = %url, "peer replica's stream ended; dropped its bookings");
            }
        }
    }
    end
}

/// Reads report lines until the stream ends, goes silent for `expiry`, or `stop`.
async fn read_reports(
    gw: &Gateway,
    url: &str,
    mut body: hyper::body::Incoming,
    expiry: Duration,
    stop: &CancellationToken,
    heard: &mut Option<(String, u64)>,
) -> StreamEnd {
    let received = gw.metrics.peer_reports.with_label_values(&["in"]);
    let own = gw.peers.identity().map(|i| i.replica.clone());
    let mut buf = BytesMut::new();
    loop {
        let frame = tokio::select! {
            _ = stop.cancelled() => return StreamEnd::Stopped,
            f = tokio::time::timeout(expiry, body.frame()) => f,
        };
        let data = match frame {
            Err(_) => return StreamEnd::Retry(format!("silent for {expiry:?}")),
            Ok(None) => return StreamEnd::Retry("the peer closed the stream".into()),
            Ok(Some(Err(e))) => return StreamEnd::Retry(format!("stream failed: {e}")),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
        };
        buf.extend_from_slice(&data);
        while let Some(nl) = memchr::memchr(b'\n', &buf) {
            let line = buf.split_to(nl + 1);
            let report: WireReport = match serde_json::from_slice(&line[..nl]) {
                Ok(r) => r,
                Err(e) => return StreamEnd::Retry(format!("bad report: {e}")),
            };
            if own.as_deref() == Some(report.replica.as_str()) {
                return StreamEnd::IsSelf;
            }
            received.inc();
            let run = (report.replica.clone(), report.incarnation);
            if heard.as_ref().is_some_and(|h| *h != run) {
                return StreamEnd::Retry("the peer changed its name or run mid-stream".into());
            }
            if heard.is_none() {
                let peer = Identity {
                    replica: report.replica.clone(),
                    incarnation: report.incarnation,
                };
                gw.peers.followed.lock().insert(url.to_owned(), peer);
            }
            *heard = Some(run);
            apply(gw, report);
        }
        if buf.len() > MAX_REPORT_BYTES {
            return StreamEnd::Retry("report line too long".into());
        }
    }
}

/// Hands a report to each model's ledger, with worker URLs resolved to this
/// replica's ids (workers this replica does not serve are left out).
fn apply(gw: &Gateway, report: WireReport) {
    let now = Instant::now();
    for (m, pool) in gw.pools_named() {
        let wire = report
            .models
            .iter()
            .find(|w| *w.model == *m.name && w.pool == pool);
        let workers = m.workers();
        let resolve = |url: &str| {
            let url = crate::config::normalize_url(url);
            workers.iter().find(|w| *w.url == *url).map(|w| w.id)
        };
        let prefilling = wire
            .map(|w| {
                w.workers
                    .iter()
                    .filter_map(|l| Some((resolve(&l.url)?, &l.prefilling)))
                    .flat_map(|(id, bookings)| {
                        bookings
                            .iter()
                            .map(move |keys| (id, keys.iter().map(|k| BlockKey(*k)).collect()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let loads = wire
            .map(|w| {
                w.workers
                    .iter()
                    .filter_map(|l| {
                        Some((
                            resolve(&l.url)?,
                            WorkerLoad {
                                in_flight: l.in_flight,
                                prefill_tokens: l.prefill_tokens,
                                decode_blocks: if l.decode_blocks.is_finite() {
                                    l.decode_blocks.max(0.0)
                                } else {
                                    0.0
                                },
                            },
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let applied = m.ledger().apply_peer_report(
            PeerReport {
                replica: report.replica.clone(),
                incarnation: report.incarnation,
                seq: report.seq,
                loads,
                prefilling,
                settled: report.settled.clone(),
                settled_below: report.settled_below,
            },
            now,
        );
        match applied {
            PeerApplied::New => {
                tracing::info!(model = %m.name, replica = %report.replica, "following a peer replica's bookings")
            }
            PeerApplied::Restarted => {
                tracing::info!(model = %m.name, replica = %report.replica, "peer replica restarted; its old bookings are replaced")
            }
            PeerApplied::Updated | PeerApplied::Stale => {}
        }
    }
}
