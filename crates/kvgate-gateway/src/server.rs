//! The HTTP surface: axum router, request handlers, and starting/stopping the gateway
//! in-process ([`start`] → [`RunningGateway`]).
//!
//! Owns endpoint wiring, the shutdown sequence (grace period, then every running
//! response ended with an error), and mapping failures to responses (with the request
//! counter for gateway-made answers). Every API request enters through
//! `front_door::admit` (auth, Content-Type, admission, body); routing, proxying and
//! failover live in their own modules; this file must not grow policy or streaming
//! logic.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use http::{header, HeaderMap, StatusCode};
use kvgate_core::Tier;
use kvgate_tokenize::RequestKind;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::auth::check_bearer;
use crate::config::Config;
use crate::errors::ApiError;
use crate::failover::{dispatch, side_call, Unanswered};
use crate::front_door::{admit, Admitted};
use crate::gateway::Gateway;
use crate::proxy::prepare_response_headers;
use crate::registry::{Endpoint, ModelState};
use crate::routing::{prepare, session_key, try_pick, Candidates, Pick, TokenUse};

/// Builds the router over a gateway.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/v1/route/explain", post(explain))
        .route("/health", get(health))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route(
            "/admin/workers",
            get(crate::admin::list)
                .post(crate::admin::add)
                .delete(crate::admin::remove_query),
        )
        .route("/admin/workers/{id}", delete(crate::admin::remove_id))
        .route(crate::peers::LOADS_PATH, get(crate::peers::serve_loads))
        .route(crate::peers::INDEX_PATH, post(crate::peers::serve_snapshot))
        .route(crate::peers::DECIDE_PATH, post(crate::peers::serve_decide))
        .fallback(not_found)
        .method_not_allowed_fallback(crate::front_door::method_not_allowed)
        .with_state(gw)
}

/// Records and renders a response the gateway made itself.
fn fail(gw: &Gateway, model: Option<&ModelState>, e: ApiError) -> Response {
    let (name, policy) = model
        .map(|m| (&*m.name, m.kind().as_str()))
        .unwrap_or(("", ""));
    gw.metrics
        .requests
        .with_label_values(&[name, "", policy, e.status.as_str()])
        .inc();
    e.into_response()
}

async fn chat(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    proxied(gw, req, Endpoint::Chat, RequestKind::Chat).await
}

async fn completions(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    proxied(gw, req, Endpoint::Completions, RequestKind::Completion).await
}

async fn proxied(
    gw: Arc<Gateway>,
    req: Request,
    endpoint: Endpoint,
    kind: RequestKind,
) -> Response {
    // Counts the request as 499 if the client leaves before any answer.
    let mut record = Unanswered::new(&gw);
    let grace_over = gw.grace_over.clone();
    let response = tokio::select! {
        r = route_and_forward(&gw, req, endpoint, kind, &mut record) => r,
        // Still queued or tokenizing when the shutdown grace period ends.
        () = grace_over.cancelled() => fail(&gw, None, ApiError::gateway_shutting_down()),
    };
    record.answered(response)
}

async fn route_and_forward(
    gw: &Arc<Gateway>,
    req: Request,
    endpoint: Endpoint,
    kind: RequestKind,
    record: &mut Unanswered,
) -> Response {
    let admitted = match admit(gw, req).await {
        Ok(a) => a,
        Err(e) => return fail(gw, None, e),
    };
    let p = match prepare(gw, Some(kind), &admitted.body, TokenUse::ForPolicy).await {
        Ok(p) => p,
        Err(e) => return fail(gw, None, e),
    };
    let model = p.model.clone();
    record.model = Some(model.clone());
    match dispatch(gw, endpoint, admitted, p, record).await {
        Ok(r) => r,
        Err(e) => fail(gw, Some(&model), e),
    }
}

async fn models(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Err(e) = check_bearer(&headers, gw.config.api_key.as_deref(), "API key") {
        return e.into_response();
    }
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

async fn tokenize(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let Admitted {
        headers,
        body: bytes,
        admission: _admission,
    } = match admit(&gw, req).await {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let p = match prepare(&gw, None, &bytes, TokenUse::ReturnIds).await {
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

async fn explain(State(gw): State<Arc<Gateway>>, req: Request) -> Response {
    let Admitted {
        headers,
        body: bytes,
        admission: _admission,
    } = match admit(&gw, req).await {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let p = match prepare(&gw, None, &bytes, TokenUse::ForPolicy).await {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let session = session_key(&p.model, &headers);
    let mut answer = match explain_pool(&gw, &p, session) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    answer["model"] = json!(&*p.model.name);
    answer["lora"] = json!(p.lora.as_deref());
    answer["prompt_tokens"] = json!(p.prompt_tokens);
    answer["prompt_tokens_estimated"] = json!(p.prompt_tokens_estimated);
    answer["prompt_blocks"] = json!(p.keys.as_ref().map(Vec::len));
    if let Some(prefill) = &p.model.prefill {
        // A disaggregated model: the decode choice above, the prefill choice here.
        let on_prefill = crate::routing::Prepared {
            model: prefill.pool.clone(),
            ..p.clone()
        };
        answer["prefill"] = match explain_pool(&gw, &on_prefill, None) {
            Ok(a) => a,
            Err(e) => return e.into_response(),
        };
        answer["skips_prefill"] = json!(crate::disaggregation::skips_prefill(&gw, prefill, &p));
    }
    Json(answer).into_response()
}

/// What one pool's policy would choose for a prepared request, and why: every
/// candidate's overlap, load (own and peers') and cost. Books nothing.
fn explain_pool(
    gw: &Gateway,
    p: &crate::routing::Prepared,
    session: Option<&str>,
) -> Result<Value, ApiError> {
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
    let scores: Vec<Value> = decision
        .scores
        .iter()
        .map(|s| {
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
        "peer_replicas": p.model.ledger().peer_replicas(),
        // The replica that chooses this replica's workers (`peers.decisions: leader`;
        // null: this one), and the choices made here for peers not yet in their reports.
        "leader": crate::peers::decides_at_leader(gw, &p.model)
            .then(|| gw.peers.leader().map(|(_, name)| name))
            .flatten(),
        "held_for_peers": p.model.ledger().booked_for_peers(),
        "scores": scores,
    }))
}

async fn health() -> Response {
    Json(json!({"status": "ok"})).into_response()
}

async fn ready(State(gw): State<Arc<Gateway>>) -> Response {
    let passive = gw.passive_open_ms();
    let mut all = true;
    let models: Vec<Value> = gw
        .models()
        .map(|m| {
            let mut entry = json!({"model": &*m.name});
            // Every pool needs a healthy worker (a disaggregated model's prefill pool
            // too): `workers`/`healthy`, then `prefill_workers`/`prefill_healthy`.
            for (pool, name) in m.pools() {
                let workers = pool.workers();
                let healthy = workers
                    .iter()
                    .filter(|w| w.breaker.available(passive))
                    .count();
                all &= healthy > 0;
                let key = |what: &str| match name {
                    "" => what.to_string(),
                    _ => format!("{name}_{what}"),
                };
                entry[key("workers")] = json!(workers.len());
                entry[key("healthy")] = json!(healthy);
            }
            entry
        })
        .collect();
    let status = if all {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(json!({"ready": all, "models": models}))).into_response()
}

async fn metrics(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Err(e) = check_bearer(
        &headers,
        gw.config.metrics_token.as_deref(),
        "metrics token",
    ) {
        return e.into_response();
    }
    let events = gw.events.snapshot();
    let text = gw.metrics.render(
        |g| {
            for m in gw.pools() {
                let workers = m.workers();
                for w in workers.iter() {
                    g.worker(
                        &m.name,
                        &w.url,
                        &m.ledger().load(w.id),
                        !w.breaker.is_open(),
                        m.ledger().unseen_load(w.id).in_flight,
                    );
                    g.accuracy(&m.name, &w.url, &m.ledger().accuracy(w.id));
                }
                g.ledger(&m.name, &m.ledger().stats());
                g.peers(&m.name, &m.ledger().peer_stats());
                if let Some(index) = m.index() {
                    g.index_entries(&m.name, index.read().len());
                }
            }
        },
        &events,
        |id| gw.worker_url(id),
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn not_found(req: Request) -> Response {
    ApiError::not_found(format!(
        "no route for {} {}",
        req.method(),
        req.uri().path()
    ))
    .into_response()
}

/// After the grace period, how long responses get to send their closing error before
/// the server is aborted (which cuts whatever is left without one). Usually done in
/// milliseconds; the margin is for a starved machine: a CI run with other test binaries
/// competing for both cores once needed more than 2 s, and a stream was cut silently.
const GRACE_OVER_FLUSH: Duration = Duration::from_secs(5);

/// A gateway running in this process.
pub struct RunningGateway {
    pub addr: SocketAddr,
    gateway: Arc<Gateway>,
    server: JoinHandle<()>,
    tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for RunningGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunningGateway")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

/// Starts a gateway on the current tokio runtime (port 0 = ephemeral) and returns once
/// it is listening.
pub async fn start(config: Config) -> anyhow::Result<RunningGateway> {
    config.check_peer_token()?;
    let shutdown = CancellationToken::new();
    let bind = (config.host.clone(), config.port);
    let gw = Gateway::build(config, shutdown.clone())?;
    let listener = tokio::net::TcpListener::bind((bind.0.as_str(), bind.1))
        .await
        .with_context(|| format!("cannot listen on {}:{}", bind.0, bind.1))?;
    let addr = listener.local_addr()?;
    let identity = gw
        .peers
        .init_identity(gw.config.peers.replica_id.as_deref(), addr);
    if gw.config.peers.enabled() {
        tracing::info!(replica = %identity.replica, peers = ?gw.config.peers.urls, dns = ?gw.config.peers.dns, "sharing load with peer replicas");
    }
    let tasks = vec![
        tokio::spawn(crate::health::run_health_checks(gw.clone())),
        tokio::spawn(crate::health::run_ledger_sweep(gw.clone())),
        tokio::spawn(crate::stall::run_stall_watch(gw.clone())),
        tokio::spawn(crate::engine_load::run_engine_queue_reads(gw.clone())),
        tokio::spawn(crate::peers::run_publisher(gw.clone())),
        tokio::spawn(crate::peers::run_followers(gw.clone())),
        tokio::spawn(crate::discovery::run_worker_discovery(gw.clone())),
    ];
    let app = router(gw.clone());
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        let _ = tcp.set_nodelay(true);
    });
    let stop = shutdown.clone();
    let server = tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
        if let Err(err) = result {
            tracing::error!(%err, "gateway HTTP server failed");
        }
    });
    tracing::info!(%addr, "kvgate gateway listening");
    Ok(RunningGateway {
        addr,
        gateway: gw,
        server,
        tasks,
    })
}

impl RunningGateway {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn gateway(&self) -> &Arc<Gateway> {
        &self.gateway
    }

    /// Bookings the model's ledger holds (requests routed and not yet ended).
    pub fn ledger_in_flight(&self, model: &str) -> Option<u64> {
        self.gateway.model(model).map(|m| m.ledger().in_flight())
    }

    /// Admission slots taken (requests admitted and not yet ended), and requests
    /// waiting for one.
    pub fn admitted(&self) -> (usize, usize) {
        (
            self.gateway.limiter.in_use(),
            self.gateway.limiter.waiting(),
        )
    }

    /// Prefix-index entries of a model (kv_aware only).
    pub fn index_len(&self, model: &str) -> Option<usize> {
        self.gateway
            .model(model)
            .and_then(|m| m.index().map(|i| i.read().len()))
    }

    /// Resolves when a shutdown was requested (e.g. by [`RunningGateway::trigger_shutdown`]).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.gateway.shutdown.clone()
    }

    /// Asks the gateway to stop accepting; in-flight requests keep running.
    pub fn trigger_shutdown(&self) {
        self.gateway.shutdown.cancel();
    }

    /// Stops accepting, lets in-flight requests finish for up to the configured grace
    /// period, then stops everything.
    pub async fn shutdown(self) {
        let grace = Duration::from_secs(self.gateway.config.shutdown_grace_secs);
        self.shutdown_within(grace).await;
    }

    /// As [`RunningGateway::shutdown`] with an explicit grace period.
    pub async fn shutdown_within(mut self, grace: Duration) {
        self.gateway.shutdown.cancel();
        if tokio::time::timeout(grace, &mut self.server).await.is_err() {
            tracing::warn!(
                ?grace,
                "in-flight requests did not finish within the grace period; ending them with an error"
            );
            // Every response still running ends with an error event or a JSON 503;
            // give them a moment to reach their clients before closing the sockets.
            self.gateway.grace_over.cancel();
            for m in self.gateway.pools() {
                for w in m.workers().iter() {
                    w.cut_off_in_flight();
                }
            }
            if tokio::time::timeout(GRACE_OVER_FLUSH, &mut self.server)
                .await
                .is_err()
            {
                self.server.abort();
            }
        }
        for t in self.tasks.drain(..) {
            t.abort();
        }
        for m in self.gateway.pools() {
            m.selection.shutdown();
        }
    }
}
