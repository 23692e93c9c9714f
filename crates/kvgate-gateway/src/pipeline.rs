//! The life of one chat or completion request past the front door, in order: prepare
//! it (parse once, find the model, tokenize, hash block keys: prepare.rs), route it
//! (a disaggregated model's prefill and decode legs: disaggregation.rs; any other
//! request: the attempt loop, failover.rs, each attempt choosing and leasing a worker,
//! select.rs), and answer with the accepted worker's response, observed until it ends
//! (respond.rs, observe.rs). The front door (front_door.rs) has already counted,
//! authenticated and admitted it.
//!
//! Owns the order of those steps and nothing else. Must not grow any of them.

use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use kvgate_tokenize::RequestKind;

use crate::disaggregation::{self, skips_prefill};
use crate::errors::ApiError;
use crate::failover::{call_workers, Forwarded};
use crate::front_door::Admitted;
use crate::gateway::Gateway;
use crate::prepare::{prepare, TokenUse};
use crate::registry::Endpoint;
use crate::respond::answer;
use crate::select::Routed;

/// `POST /v1/chat/completions`.
pub async fn chat(gw: Arc<Gateway>, admitted: Admitted) -> Response {
    let request = (Endpoint::Chat, RequestKind::Chat);
    serve(&gw, request, admitted)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`.
pub async fn completions(gw: Arc<Gateway>, admitted: Admitted) -> Response {
    let request = (Endpoint::Completions, RequestKind::Completion);
    serve(&gw, request, admitted)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// One request's life: prepare, route, call workers, answer.
async fn serve(
    gw: &Arc<Gateway>,
    (endpoint, kind): (Endpoint, RequestKind),
    Admitted {
        headers,
        body,
        admission,
        record,
    }: Admitted,
) -> Result<Response, ApiError> {
    let record =
        &record.ok_or_else(|| ApiError::internal("a proxied route that is not counted"))?;
    let p = prepare(gw, Some(kind), &headers, &body, TokenUse::ForPolicy).await?;
    record.model(&p.model.name, p.model.kind().as_str());
    let request = Forwarded {
        endpoint,
        headers,
        body,
        started: tokio::time::Instant::now(),
    };
    if let Some(prefill) = &p.model.prefill {
        if !skips_prefill(gw, prefill, &p) {
            return disaggregation::serve(gw, prefill, request, &p, &admission, record).await;
        }
        disaggregation::count(gw, &p.model.name, "whole");
    }
    let mut routed = Routed {
        p: &p,
        headers: &request.headers,
        admission: &admission,
        record,
    };
    let accepted = call_workers(gw, &request, &mut routed).await?;
    answer(gw, &request, accepted).await
}
