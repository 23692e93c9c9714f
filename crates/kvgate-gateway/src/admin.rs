//! The admin API: list, add and remove workers at run time.
//!
//! `GET /admin/workers`, `POST /admin/workers` (`{"model","url","kv_events"?,
//! "kv_events_replay"?,"dp_size"?,"pool"?,"bootstrap_port"?}`; `"pool":"prefill"` adds
//! to a disaggregated model's prefill pool), `DELETE /admin/workers/{id}` or
//! `DELETE /admin/workers?model=M&url=U` (either pool). Off (404) unless an admin token is
//! configured; every call must carry it as a bearer token (checked at the front door).
//! Owns request/response shapes only; the gateway does the work.

use std::sync::Arc;

use axum::extract::{Path, Query, Request, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use kvgate_core::WorkerId;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::body::read_bounded;
use crate::config::WorkerConfig;
use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::registry::{ModelState, Worker};

pub fn worker_json(model: &ModelState, pool: &str, w: &Worker) -> Value {
    let load = model.ledger().load(w.id);
    json!({
        "id": w.id.0,
        "model": &*model.name,
        "pool": if pool.is_empty() { None } else { Some(pool) },
        "bootstrap_port": w.config.bootstrap_port,
        "url": &*w.url,
        "healthy": !w.breaker.is_open(),
        "consecutive_failures": w.breaker.consecutive_failures(),
        "in_flight": load.in_flight,
        "ledger": load,
        "kv_events": w.config.kv_events,
        "kv_events_replay": w.config.kv_events_replay,
        "dp_size": w.config.dp_size,
    })
}

pub async fn list(State(gw): State<Arc<Gateway>>) -> Response {
    let workers: Vec<Value> = gw
        .pools_named()
        .flat_map(|(m, pool)| {
            m.workers()
                .iter()
                .map(|w| worker_json(m, pool, w))
                .collect::<Vec<_>>()
        })
        .collect();
    Json(json!({ "workers": workers })).into_response()
}

/// Largest `POST /admin/workers` body read.
const ADD_WORKER_MAX_BYTES: usize = 1 << 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddWorker {
    model: Option<String>,
    url: String,
    #[serde(default)]
    kv_events: Option<String>,
    #[serde(default)]
    kv_events_replay: Option<String>,
    #[serde(default)]
    dp_size: Option<u32>,
    /// `prefill`: a disaggregated model's prefill pool (default: the model's workers).
    #[serde(default)]
    pool: Option<String>,
    #[serde(default)]
    bootstrap_port: Option<u16>,
}

pub async fn add(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let body = match read_bounded(&mut req.into_body(), ADD_WORKER_MAX_BYTES, None).await {
        Ok(b) => b,
        Err(e) => return ApiError::bad_request("invalid_body", e.to_string()).into_response(),
    };
    let add: AddWorker = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => return ApiError::malformed_json(e).into_response(),
    };
    let model = match gw.resolve(add.model.as_deref()) {
        Ok((m, _)) => m.clone(),
        Err(e) => return e.into_response(),
    };
    let pool_name = match add.pool.as_deref() {
        None | Some("") => "",
        Some(crate::registry::PREFILL_POOL) => crate::registry::PREFILL_POOL,
        Some(other) => {
            return ApiError::bad_request(
                "invalid_worker",
                format!("pool {other:?}: leave it out for the model's workers, or \"prefill\""),
            )
            .into_response()
        }
    };
    let Some(pool) = gw.pool(&model.name, pool_name) else {
        return ApiError::bad_request(
            "invalid_worker",
            format!(
                "model {:?} has no prefill pool (it is not disaggregated)",
                &*model.name
            ),
        )
        .into_response();
    };
    let sglang_prefill = pool_name == crate::registry::PREFILL_POOL
        && model
            .prefill
            .as_ref()
            .is_some_and(|p| p.mode == crate::config::PdMode::Sglang);
    if sglang_prefill && add.bootstrap_port.is_none() {
        return ApiError::bad_request(
            "invalid_worker",
            "an SGLang prefill worker needs its bootstrap_port",
        )
        .into_response();
    }
    let config = WorkerConfig {
        url: add.url,
        kv_events: add.kv_events,
        kv_events_replay: add.kv_events_replay,
        dp_size: add.dp_size.unwrap_or(1),
        bootstrap_port: add.bootstrap_port,
    };
    if let Err(e) = config.validate() {
        return ApiError::bad_request("invalid_worker", format!("{e:#}")).into_response();
    }
    // One engine is in one pool of a model.
    let in_other_pool = gw.pools_named().any(|(m, p)| {
        *m.name == *model.name && p != pool_name && m.worker_by_url(&config.url).is_some()
    });
    if in_other_pool {
        return ApiError::worker_conflict(format!(
            "worker {} is already in the other pool of model {:?}",
            config.url, &*model.name
        ))
        .into_response();
    }
    match gw.add_worker_to(&pool, config) {
        Ok(w) => (StatusCode::CREATED, Json(worker_json(&pool, pool_name, &w))).into_response(),
        Err(e) => ApiError::worker_conflict(format!("{e:#}")).into_response(),
    }
}

#[derive(Deserialize)]
pub struct RemoveQuery {
    model: Option<String>,
    url: Option<String>,
}

fn remove_by(gw: &Gateway, pred: impl Fn(&ModelState, &Worker) -> bool) -> Response {
    let found: Vec<(Arc<ModelState>, WorkerId)> = gw
        .pools()
        .flat_map(|m| {
            m.workers()
                .iter()
                .filter(|w| pred(m, w))
                .map(|w| (m.clone(), w.id))
                .collect::<Vec<_>>()
        })
        .collect();
    if found.is_empty() {
        return ApiError::not_found("no such worker").into_response();
    }
    let mut removed = Vec::new();
    for (m, id) in found {
        if let Some(w) = gw.remove_worker_from(&m, id) {
            removed.push(json!({"id": id.0, "model": &*m.name, "url": &*w.url}));
        }
    }
    Json(json!({ "removed": removed })).into_response()
}

pub async fn remove_id(State(gw): State<Arc<Gateway>>, Path(id): Path<u32>) -> Response {
    remove_by(&gw, |_, w| w.id == WorkerId(id))
}

pub async fn remove_query(
    State(gw): State<Arc<Gateway>>,
    Query(q): Query<RemoveQuery>,
) -> Response {
    let Some(url) = q.url.map(|u| crate::config::normalize_url(&u)) else {
        return ApiError::bad_request(
            "missing_url",
            "pass ?url=WORKER_URL (and optionally &model=NAME), or DELETE /admin/workers/{id}",
        )
        .into_response();
    };
    remove_by(&gw, |m, w| {
        *w.url == *url && q.model.as_deref().is_none_or(|name| *m.name == *name)
    })
}
