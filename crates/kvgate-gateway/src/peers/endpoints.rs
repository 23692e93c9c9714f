//! The `/peer/v1` endpoints: the report stream, an index snapshot of one worker rank,
//! and a choice made here for a peer. The admin token is checked at the front door
//! (front_door.rs); these check that this replica knows its name and that the asker is
//! not itself. Must not hold peer state (hub.rs) or choose (leader.rs does).

use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http::{header, HeaderMap, StatusCode};

use crate::errors::ApiError;
use crate::gateway::Gateway;

use super::leader::decide_for_peer;
use crate::peer_link::wire::{
    decode_decide, keys_refused, same_keys, SnapshotRequest, WireSnapshot, DECIDE_CONTENT_TYPE,
    DUPLICATE_REPLICA_ID, INCARNATION_HEADER, MAX_DECIDE_BYTES, REPLICA_HEADER,
};

/// `GET /peer/v1/loads`: this replica's reports as a stream of JSON lines, the
/// latest at once and then each new one, until shutdown. Guarded by the admin token.
pub async fn serve_loads(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Err(e) = admit_peer(&gw, &headers) {
        return e.into_response();
    }
    let mut rx = gw.peers.latest.subscribe();
    rx.mark_changed();
    let stop = gw.shutdown.clone();
    let subscribers = gw.metrics.peer_subscribers.clone();
    let sent = gw.metrics.peer_reports.with_label_values(&["out"]);
    subscribers.inc();
    // Decrements the subscriber gauge when the stream is dropped, however it ends.
    let guard = OnDrop(move || subscribers.dec());
    let stream = futures::stream::unfold((rx, stop, guard), move |(mut rx, stop, guard)| {
        let sent = sent.clone();
        async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    changed = rx.changed() => changed.ok()?,
                }
                let line = rx.borrow_and_update().clone();
                if !line.is_empty() {
                    sent.inc();
                    return Some((Ok::<_, std::convert::Infallible>(line), (rx, stop, guard)));
                }
            }
        }
    });
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// What every peer endpoint checks after the front door (which checks the admin token:
/// without one the peer endpoints are off, as they would let anyone book phantom load
/// or read the index): that this replica knows its name, and that the asker is not
/// this replica itself (a DNS name lists every replica; 409 `peer_is_self` tells the
/// asker to skip the address).
fn admit_peer(gw: &Gateway, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(identity) = gw.peers.identity() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "starting",
            "this replica is starting",
        )
        .with_retry_after(1));
    };
    let asker = headers.get(&REPLICA_HEADER).and_then(|v| v.to_str().ok());
    if asker != Some(identity.replica.as_str()) {
        return Ok(());
    }
    let run = headers
        .get(&INCARNATION_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if run.is_some_and(|run| run != identity.incarnation) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            DUPLICATE_REPLICA_ID,
            format!(
                "replica {:?} is already running here: every replica needs its own --replica-id",
                identity.replica
            ),
        ));
    }
    Err(ApiError::new(
        StatusCode::CONFLICT,
        "invalid_request_error",
        "peer_is_self",
        "this is the replica asking: a replica does not follow or bootstrap from itself",
    ))
}

/// Runs a closure when dropped.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// `POST /peer/v1/index`: this replica's index entries of one worker rank, for a peer
/// that is starting. 404 when the model or worker is unknown here or this replica has
/// applied none of that rank's events (a snapshot must say where events continue).
pub async fn serve_snapshot(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(e) = admit_peer(&gw, &headers) {
        return e.into_response();
    }
    let req: SnapshotRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::malformed_json(e).into_response(),
    };
    let Some(model) = gw.model(&req.model) else {
        return ApiError::not_found(format!("unknown model {:?}", req.model)).into_response();
    };
    // The worker may be in the model's prefill pool.
    let found = model
        .pools()
        .find_map(|(pool, _)| Some((pool.clone(), pool.worker_by_url(&req.worker)?)));
    let Some((model, worker)) = found else {
        return ApiError::not_found(format!("unknown worker {:?}", req.worker)).into_response();
    };
    let fingerprint = model.selection.hasher().fingerprint();
    if let Err(why) = same_keys(fingerprint, req.key_fingerprint) {
        return keys_refused(format!("no snapshot: {why}")).into_response();
    }
    let id = worker.id;
    // Exporting a large index takes a while: off the async workers.
    let snapshot =
        tokio::task::spawn_blocking(move || model.selection.snapshot_rank(id, req.rank)).await;
    match snapshot {
        Ok(Some(s)) => Json(WireSnapshot::from_rank(&s, fingerprint)).into_response(),
        Ok(None) => ApiError::not_found(format!(
            "no KV events of {} rank {} applied here yet",
            worker.url, req.rank
        ))
        .into_response(),
        Err(e) => ApiError::internal(format!("snapshot failed: {e}")).into_response(),
    }
}

/// `POST /peer/v1/decide`: chooses a worker for a peer replica's request, among the
/// candidates it named that are healthy here too, and holds the choice as that
/// replica's booking until its reports settle it. 409 when this replica does not
/// follow the asker (it would never learn the choice was booked) or no candidate is
/// healthy here; the asker then chooses itself.
pub async fn serve_decide(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(e) = admit_peer(&gw, &headers) {
        return e.into_response();
    }
    let Some(asker) = headers
        .get(&REPLICA_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return ApiError::bad_request(
            "missing_replica",
            format!("a decide request names its replica in {REPLICA_HEADER}"),
        )
        .into_response();
    };
    if body.len() > MAX_DECIDE_BYTES {
        return ApiError::body_too_large(MAX_DECIDE_BYTES).into_response();
    }
    let binary = headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes() == DECIDE_CONTENT_TYPE.as_bytes());
    if !binary {
        // A kvgate from before the binary encoding: it chooses itself for a while.
        return ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            format!("a decide request is sent as {DECIDE_CONTENT_TYPE}"),
        )
        .into_response();
    }
    let (req, keys) = match decode_decide(&body) {
        Ok(r) => r,
        Err(why) => {
            return ApiError::bad_request("invalid_decide_request", why).into_response();
        }
    };
    match decide_for_peer(&gw, &asker, &req, keys.as_deref()) {
        Ok(answer) => {
            gw.metrics
                .peer_decisions
                .with_label_values(&[req.model.as_str(), "served"])
                .inc();
            Json(answer).into_response()
        }
        Err(e) => e.into_response(),
    }
}
