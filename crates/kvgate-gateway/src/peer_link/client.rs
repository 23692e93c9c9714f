//! Asking a peer: the request every peer call carries (this replica's name, the admin
//! token), the peers' addresses now, one bounded exchange, and the index bootstrap a
//! new replica's KV-event subscribers use. Sits below the gateway (which hands the
//! bootstrap to its models' selection services). Must not serve requests.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::stream::{FuturesUnordered, StreamExt};
use http::{header, HeaderValue, Request, StatusCode};
use http_body_util::Full;
use kvgate_events::{Bootstrap, RankSnapshot};

use crate::body::read_bounded;
use crate::config::PeersConfig;
use crate::proxy::HttpClient;

use super::hub::PeerHub;
use super::wire::{
    same_keys, SnapshotRequest, WireSnapshot, DUPLICATE_REPLICA_ID, INCARNATION_HEADER, INDEX_PATH,
    LOADS_PATH, REPLICA_HEADER,
};

/// Largest snapshot accepted from a peer.
const MAX_SNAPSHOT_BYTES: usize = 1 << 30;
/// How long a bootstrap waits for its peers' snapshots, all of them asked at once. The
/// subscriber waits for it before replaying and applying live events (which queue
/// meanwhile), so hung peers must not hold it long; a snapshot of a million blocks is a
/// few seconds' transfer.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(10);

/// What a request to a peer carries: this replica's name (so a peer that is this
/// replica refuses it) and the admin token, when one is set.
pub(crate) fn peer_request(
    method: http::Method,
    url: String,
    body: Bytes,
    hub: &PeerHub,
    admin_token: Option<&str>,
) -> Result<Request<Full<Bytes>>, String> {
    let mut req = Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(body))
        .map_err(|e| format!("bad peer URL: {e}"))?;
    if let Some(identity) = hub.identity() {
        if let Ok(v) = HeaderValue::from_str(&identity.replica) {
            req.headers_mut().insert(REPLICA_HEADER, v);
        }
        req.headers_mut()
            .insert(INCARNATION_HEADER, HeaderValue::from(identity.incarnation));
    }
    if let Some(v) = admin_token.and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
        req.headers_mut().insert(header::AUTHORIZATION, v);
    }
    Ok(req)
}

/// The peers' base URLs now: the configured ones, then the DNS name's addresses.
pub(crate) async fn peer_urls(cfg: &PeersConfig) -> std::io::Result<Vec<String>> {
    let mut urls = cfg.urls.clone();
    if let Some(name) = &cfg.dns {
        urls.extend(
            tokio::net::lookup_host(name.as_str())
                .await?
                .map(|a| format!("http://{a}")),
        );
    }
    Ok(urls)
}

/// How long the start-up check waits for each peer.
const UNIQUE_ID_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// Refuses to start a replica whose name a running peer already has: asks every peer
/// (configured URLs and the DNS name's addresses, at once, each for at most two
/// seconds) for its report stream, and fails when one answers that it is another
/// replica of this name. Two replicas of one name would each take the other's reports
/// for their own and ignore them, so their bookings would never be seen. A peer that
/// does not answer is no evidence either way (it is followed once it does).
pub async fn check_unique_name(
    client: &HttpClient,
    hub: &PeerHub,
    cfg: &PeersConfig,
    admin_token: Option<&str>,
) -> anyhow::Result<()> {
    let Some(own) = hub.identity() else {
        return Ok(());
    };
    let urls = peer_urls(cfg).await.unwrap_or_else(|_| cfg.urls.clone());
    let asks = urls.into_iter().map(|url| async move {
        let req = peer_request(
            http::Method::GET,
            format!("{url}{LOADS_PATH}"),
            Bytes::new(),
            hub,
            admin_token,
        )
        .ok()?;
        let answer = async {
            let resp = client.request(req).await.ok()?;
            // Anything else (the stream, a refusal of another kind) is dropped.
            has_this_name(resp).await.then_some(url)
        };
        tokio::time::timeout(UNIQUE_ID_CHECK_TIMEOUT, answer)
            .await
            .ok()
            .flatten()
    });
    if let Some(url) = futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .next()
    {
        anyhow::bail!(
            "the peer at {url} already runs as replica {:?}: give every replica its own \
             --replica-id (env KVGATE_REPLICA_ID, YAML peers.replica_id), or leave it unset \
             (the host name and port)",
            own.replica
        );
    }
    Ok(())
}

/// Whether a peer's answer to a request of this replica's says that the peer is another
/// replica under this replica's name (409 `duplicate_replica_id`; a 409 `peer_is_self`
/// is this replica itself). Reads a refusal's body (bounded), nothing else.
pub(crate) async fn has_this_name(resp: http::Response<hyper::body::Incoming>) -> bool {
    if resp.status() != StatusCode::CONFLICT {
        return false;
    }
    let mut body = resp.into_body();
    let body = read_bounded(&mut body, 64 << 10, None).await;
    body.is_ok_and(|b| error_code(&b).as_deref() == Some(DUPLICATE_REPLICA_ID))
}

/// The index bootstrap a model's KV-event subscribers use: asks every peer (the
/// configured URLs and the DNS name's addresses) at once for its snapshot of the worker
/// rank, and returns the first one given whose keys are keyed as this pool's
/// (`key_fingerprint`, [`same_keys`]); gives up after [`SNAPSHOT_TIMEOUT`] in all,
/// however many peers hang. While one runs, this replica is not ready
/// ([`PeerHub::bootstrapping`]).
pub fn bootstrap(
    client: HttpClient,
    hub: Arc<PeerHub>,
    cfg: PeersConfig,
    admin_token: Option<String>,
    model: String,
    key_fingerprint: u64,
) -> Bootstrap {
    Arc::new(move |worker: String, rank: u32| {
        let (client, hub, cfg, token, model) = (
            client.clone(),
            hub.clone(),
            cfg.clone(),
            admin_token.clone(),
            model.clone(),
        );
        Box::pin(async move {
            let _running = hub.bootstrap_started();
            let request = SnapshotRequest {
                model,
                worker,
                rank,
                key_fingerprint: Some(key_fingerprint),
            };
            let asked = async {
                // A failed lookup leaves the configured URLs.
                let candidates = peer_urls(&cfg).await.unwrap_or_else(|_| cfg.urls.clone());
                let mut asks: FuturesUnordered<_> = candidates
                    .into_iter()
                    .map(|peer| {
                        let (client, hub, token, request) = (&client, &hub, &token, &request);
                        async move {
                            let got =
                                fetch_snapshot(client, hub, token.as_deref(), &peer, request).await;
                            (peer, got)
                        }
                    })
                    .collect();
                while let Some((peer, got)) = asks.next().await {
                    match got {
                        Ok(s) => return Some(s),
                        Err(SnapshotRefused::OtherKeys(why)) => {
                            tracing::warn!(%peer, worker = %request.worker, rank, %why, "not loading this peer's index snapshot: its block keys are not ours (every replica must run the same kvgate version, block size and hash salt)")
                        }
                        Err(SnapshotRefused::Failed(why)) => {
                            tracing::debug!(%peer, worker = %request.worker, rank, %why, "no index snapshot from this peer")
                        }
                    }
                }
                None
            };
            let got = tokio::time::timeout(SNAPSHOT_TIMEOUT, asked).await;
            if got.is_err() {
                tracing::warn!(worker = %request.worker, rank, timeout = ?SNAPSHOT_TIMEOUT, "no peer gave an index snapshot in time; replaying the engine's buffer instead");
            }
            got.ok().flatten()
        })
    })
}

/// Why a peer gave no snapshot.
enum SnapshotRefused {
    /// Its keys are not this replica's ([`same_keys`]): worth a warning.
    OtherKeys(String),
    /// No snapshot (none applied there, unreachable, malformed).
    Failed(String),
}

async fn fetch_snapshot(
    client: &HttpClient,
    hub: &PeerHub,
    token: Option<&str>,
    peer: &str,
    request: &SnapshotRequest,
) -> Result<RankSnapshot, SnapshotRefused> {
    let failed = |e: &dyn std::fmt::Display| SnapshotRefused::Failed(e.to_string());
    let ours = request.key_fingerprint.unwrap_or_default();
    let url = format!("{peer}{INDEX_PATH}");
    let answer = exchange(client, hub, token, url, request, MAX_SNAPSHOT_BYTES);
    let (status, body) = answer.await.map_err(SnapshotRefused::Failed)?;
    if status != StatusCode::OK {
        let why = answered(status, &body);
        return Err(
            if error_code(&body).as_deref() == Some("key_scheme_mismatch") {
                SnapshotRefused::OtherKeys(why)
            } else {
                SnapshotRefused::Failed(why)
            },
        );
    }
    let wire: WireSnapshot = serde_json::from_slice(&body).map_err(|e| failed(&e))?;
    same_keys(ours, wire.key_fingerprint).map_err(SnapshotRefused::OtherKeys)?;
    wire.into_rank()
        .ok_or_else(|| failed(&"a block names an unknown tier"))
}

/// One `POST` of `request` as JSON to a peer's `url`, its answer read whole (at most
/// `max` bytes): the status and the body, or why there is none.
pub(crate) async fn exchange(
    client: &HttpClient,
    hub: &PeerHub,
    token: Option<&str>,
    url: String,
    request: &impl serde::Serialize,
    max: usize,
) -> Result<(StatusCode, Bytes), String> {
    let body = serde_json::to_vec(request).map_err(|e| e.to_string())?;
    let body = (Bytes::from(body), "application/json");
    exchange_bytes(client, hub, token, url, body, max).await
}

/// One `POST` of `body` (its bytes and content type) to a peer's `url`, its answer read
/// whole (at most `max` bytes): the status and the body, or why there is none.
pub(crate) async fn exchange_bytes(
    client: &HttpClient,
    hub: &PeerHub,
    token: Option<&str>,
    url: String,
    (body, content_type): (Bytes, &'static str),
    max: usize,
) -> Result<(StatusCode, Bytes), String> {
    let mut req = peer_request(http::Method::POST, url, body, hub, token)?;
    req.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let mut body = resp.into_body();
    let body = read_bounded(&mut body, max, None)
        .await
        .map_err(|e| e.to_string())?;
    Ok((status, body))
}

/// A peer's answer other than 200, for logs: its status and the start of its body.
pub(crate) fn answered(status: StatusCode, body: &[u8]) -> String {
    format!(
        "answered {status}: {}",
        String::from_utf8_lossy(&body[..body.len().min(200)])
    )
}

/// The `error.code` of an OpenAI-style error body.
pub(crate) fn error_code(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
}
