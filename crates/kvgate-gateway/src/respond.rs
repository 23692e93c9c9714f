//! The client's response from an accepted routed attempt: the worker's head (cleaned,
//! naming the worker) and its body observed until it ends (observe.rs: the lease ends
//! with it), or an engine's non-JSON error page re-made as OpenAI-style JSON.
//!
//! Owns turning an accepted attempt into the client's response. Must not retry
//! (failover.rs) or parse the body (observe.rs).

use std::sync::Arc;

use axum::body::Body;
use axum::http::HeaderValue;
use axum::response::{IntoResponse, Response};

use crate::errors::ApiError;
use crate::failover::{engine_error, Accepted, Forwarded};
use crate::gateway::Gateway;
use crate::observe::{Lifecycle, ObservedBody};
use crate::proxy::{is_event_stream, is_json, prepare_response_headers, PREDICTED_TTFT_HEADER};

/// The client's response from an accepted routed attempt: an engine's non-JSON error
/// page re-made as OpenAI-style JSON, anything else passed through with its body
/// observed until it ends (the lease ends with it).
pub async fn answer(
    gw: &Arc<Gateway>,
    request: &Forwarded,
    accepted: Accepted,
) -> Result<Response, ApiError> {
    let Accepted {
        worker,
        resp,
        held,
        cut_off,
    } = accepted;
    let Some((decision, lease)) = held else {
        return Err(ApiError::internal(
            "a routed request was answered without a lease",
        ));
    };
    let status = resp.status();
    if (status.is_client_error() || status.is_server_error()) && !is_json(resp.headers()) {
        // A web server's or proxy's text page: OpenAI-style JSON instead.
        let mut out = engine_error(resp, &worker).await.into_response();
        prepare_response_headers(out.headers_mut(), &worker);
        return Ok(out);
    }
    let (mut parts, incoming) = resp.into_parts();
    prepare_response_headers(&mut parts.headers, &worker);
    if let Some(ttft) = decision.predicted_ttft_secs() {
        if let Ok(v) = HeaderValue::from_str(&format!("{:.1}", ttft * 1e3)) {
            parts.headers.insert(PREDICTED_TTFT_HEADER, v);
        }
    }
    let sse = is_event_stream(&parts.headers);
    let life = Lifecycle {
        lease: Some(lease),
        gw: gw.clone(),
        predicted_cached: decision.predicted_cached_tokens,
    };
    let deadline = gw
        .config
        .timeouts
        .total()
        .map(|d| Box::pin(tokio::time::sleep_until(request.started + d)));
    let body = ObservedBody::new(incoming, life, sse, deadline, cut_off);
    Ok(Response::from_parts(parts, Body::new(body)))
}
