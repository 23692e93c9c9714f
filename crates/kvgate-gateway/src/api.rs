//! The client API endpoints beside chat and completions (pipeline.rs): the served
//! models, tokenization, and what routing would choose for a request. The front door
//! (front_door.rs) has authenticated them, and admitted those that take a body.
//!
//! Owns these endpoints' answers. Must not route or book (select.rs, lease.rs).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::Bytes;
use http::HeaderMap;
use kvgate_core::Tier;
use serde_json::{json, Value};

use crate::disaggregation::skips_prefill;
use crate::errors::ApiError;
use crate::failover::side_call;
use crate::front_door::Admitted;
use crate::gateway::Gateway;
use crate::peers::leader::decides_at_leader;
use crate::prepare::{prepare, Prepared, TokenUse};
use crate::proxy::prepare_response_headers;
use crate::registry::{Endpoint, ModelState};
use crate::select::{session_key, try_pick, Candidates, Pick};

/// `GET /v1/models`: every served name (models and LoRA adapters).
pub async fn models(State(gw): State<Arc<Gateway>>) -> Response {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let data: Vec<Value> = gw
        .served_names()
        .map(|(name, m, lora)| {
            json!({
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kvgate",
                "root": &*m.name,
                "parent": if lora { Some(&*m.name) } else { None },
            })
        })
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

/// `POST /tokenize`: the prompt's token ids, as the engines' own `/tokenize` gives
/// them (locally, or from a worker when the model has no local tokenizer).
pub async fn tokenize(
    gw: Arc<Gateway>,
    Admitted {
        headers,
        body: bytes,
        admission: _admission,
        ..
    }: Admitted,
) -> Response {
    let p = match prepare(&gw, None, &headers, &bytes, TokenUse::ReturnIds).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    if p.model.tokenizer.is_none() {
        return forward_tokenize(&gw, &p.model, &headers, bytes).await;
    }
    match p.token_ids {
        Some(ids) => Json(json!({"model": &*p.model.name, "count": ids.len(), "tokens": ids}))
            .into_response(),
        None => ApiError::bad_request(
            "nothing_to_tokenize",
            "the body has no single prompt or messages to tokenize",
        )
        .into_response(),
    }
}

/// `/tokenize` without a local tokenizer: ask a healthy worker (no ledger booking).
async fn forward_tokenize(
    gw: &Arc<Gateway>,
    model: &ModelState,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    match side_call(gw, model, Endpoint::Tokenize, headers, body).await {
        Ok((w, resp)) => {
            let (mut parts, incoming) = resp.into_parts();
            prepare_response_headers(&mut parts.headers, &w);
            Response::from_parts(parts, Body::new(incoming))
        }
        Err(e) => e.into_response(),
    }
}

/// `POST /v1/route/explain`: what the policy would choose for a request, and why.
/// Books nothing. Its `Server-Timing` header says how long the decision took, by stage
/// (parse, tokenize, hash, select; `total` from the body's arrival), in milliseconds.
pub async fn explain(
    gw: Arc<Gateway>,
    Admitted {
        headers,
        body: bytes,
        admission: _admission,
        ..
    }: Admitted,
) -> Response {
    let arrived = Instant::now();
    let p = match prepare(&gw, None, &headers, &bytes, TokenUse::ForPolicy).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let session = session_key(&p.model, &headers);
    let selecting = Instant::now();
    let mut answer = match explain_pool(&gw, &p, session) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let decided = Instant::now();
    answer["model"] = json!(&*p.model.name);
    answer["lora"] = json!(p.lora.as_deref());
    answer["prompt_tokens"] = json!(p.prompt_tokens);
    answer["prompt_tokens_estimated"] = json!(p.prompt_tokens_estimated);
    answer["prompt_blocks"] = json!(p.keys.as_ref().map(Vec::len));
    if let Some(prefill) = &p.model.prefill {
        // A disaggregated model: the decode choice above, the prefill choice here.
        let on_prefill = Prepared {
            model: prefill.pool.clone(),
            ..p.clone()
        };
        answer["prefill"] = match explain_pool(&gw, &on_prefill, None) {
            Ok(a) => a,
            Err(e) => return e.into_response(),
        };
        answer["skips_prefill"] = json!(skips_prefill(&gw, prefill, &p));
    }
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let timing = format!(
        "parse;dur={:.3}, tokenize;dur={:.3}, hash;dur={:.3}, select;dur={:.3}, total;dur={:.3}",
        ms(p.took.parse),
        ms(p.took.tokenize),
        ms(p.took.hash),
        ms(decided - selecting),
        ms(decided - arrived),
    );
    let mut response = Json(answer).into_response();
    if let Ok(value) = http::HeaderValue::from_str(&timing) {
        response.headers_mut().insert("server-timing", value);
    }
    response
}

/// What one pool's policy would choose for a prepared request, and why: every
/// candidate's overlap, load (own and peers') and cost. Books nothing.
fn explain_pool(gw: &Gateway, p: &Prepared, session: Option<&str>) -> Result<Value, ApiError> {
    let (decision, worker) = match try_pick(gw, p, session, &[], Candidates::AllHealthy)? {
        Pick::Chosen { decision, worker } => (decision, worker),
        _ => return Err(ApiError::no_healthy_worker(&p.model.name, 1)),
    };
    let workers = p.model.workers();
    let url_of = |id| {
        workers
            .iter()
            .find(|w| w.id == id)
            .map(|w| w.url.to_string())
    };
    let ids: Vec<_> = decision.scores.iter().map(|s| s.worker).collect();
    let timings = p.model.ledger().timings_of(&ids);
    let scores: Vec<Value> = decision
        .scores
        .iter()
        .zip(&timings)
        .map(|(s, timing)| {
            json!({
                "worker": url_of(s.worker),
                "worker_id": s.worker.0,
                "overlap_blocks": {
                    "device": s.overlap_blocks[Tier::Device.index()],
                    "host": s.overlap_blocks[Tier::Host.index()],
                    "disk": s.overlap_blocks[Tier::Disk.index()],
                },
                "in_flight": s.in_flight,
                "prefill_tokens": s.prefill_tokens,
                "decode_blocks": s.decode_blocks,
                "local": p.model.ledger().load(s.worker),
                "peer": p.model.ledger().peer_load(s.worker),
                // What the worker's engine last reported beyond every replica's bookings.
                "unseen": p.model.ledger().unseen_load(s.worker),
                "cost": s.cost,
                // The time model's predictions here, and what they rest on.
                "predicted_ttft_ms": s.predicted_ttft_secs.map(|t| t * 1e3),
                "predicted_tpot_ms": s.predicted_tpot_secs.map(|t| t * 1e3),
                // A like request's after this one: what an objective is judged on while
                // the worker has prefill queued.
                "predicted_next_ttft_ms": s.predicted_next_ttft_secs.map(|t| t * 1e3),
                "engine_limits": timing.limits(),
                "rates": timing.rates(),
            })
        })
        .collect();
    Ok(json!({
        "policy": decision.policy,
        "worker": &*worker.url,
        "worker_id": worker.id.0,
        "rule": decision.rule,
        "reason": decision.reason,
        "block_size": p.model.selection.block_size(),
        "predicted_cached_tokens": decision.predicted_cached_tokens,
        "predicted_ttft_ms": decision.predicted_ttft_secs().map(|t| t * 1e3),
        "peer_replicas": p.model.ledger().peer_replicas(),
        // The replica that chooses this replica's workers (`peers.decisions: leader`;
        // null: this one), and the choices made here for peers not yet in their reports.
        "leader": decides_at_leader(gw, &p.model)
            .then(|| gw.peers.leader().map(|(_, name)| name))
            .flatten(),
        "held_for_peers": p.model.ledger().booked_for_peers(),
        "scores": scores,
    }))
}
