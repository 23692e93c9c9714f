//! The HTTP surface: the route table, the router built from it (each route behind its
//! front door), the operational endpoints (`/health`, `/ready`, `/metrics`), and
//! starting/stopping the gateway in-process ([`start`] → [`RunningGateway`]).
//!
//! Owns endpoint wiring, the background tasks' start, and the shutdown sequence (grace
//! period, then every running response ended with an error). Every route is declared
//! once, in [`ROUTES`], with the token it needs and the front door it passes
//! (front_door.rs); the router is built from that table alone, so a route cannot be
//! served without its guard. Must not grow policy, proxying or streaming logic.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, post_service, MethodRouter};
use axum::{Json, Router};
use http::{header, Method, StatusCode};
use kvgate_tokenize::Tokenizer;
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::errors::ApiError;
use crate::front_door::{self, Access, Door, FrontDoor};
use crate::gateway::Gateway;
use crate::peer_link::wire::{DECIDE_PATH, INDEX_PATH, LOADS_PATH};
use crate::{admin, api, checks, discovery, engine_load, peer_link, peers, pipeline, stall};

/// One route: its method and path, the token it needs, its front door, its handler.
pub struct Route {
    pub method: Method,
    pub path: &'static str,
    pub access: Access,
    pub door: Door,
    /// The route's service behind its front door: a route that takes a body is served
    /// by it (`FrontDoor::admitted`), any other wears it as a layer.
    handler: fn(FrontDoor) -> MethodRouter<Arc<Gateway>>,
}

/// Every route the gateway serves.
#[rustfmt::skip]
pub const ROUTES: &[Route] = &[
    route(Method::POST, "/v1/chat/completions", Access::ApiKey, Door::Counted, |d| post_service(d.admitted(pipeline::chat))),
    route(Method::POST, "/v1/completions", Access::ApiKey, Door::Counted, |d| post_service(d.admitted(pipeline::completions))),
    route(Method::GET, "/v1/models", Access::ApiKey, Door::Token, |d| get(api::models).layer(d)),
    route(Method::POST, "/tokenize", Access::ApiKey, Door::Admitted, |d| post_service(d.admitted(api::tokenize))),
    route(Method::POST, "/v1/route/explain", Access::ApiKey, Door::Admitted, |d| post_service(d.admitted(api::explain))),
    route(Method::GET, "/health", Access::Public, Door::Token, |d| get(health).layer(d)),
    route(Method::GET, "/ready", Access::Public, Door::Token, |d| get(ready).layer(d)),
    route(Method::GET, "/metrics", Access::MetricsToken, Door::Token, |d| get(metrics).layer(d)),
    route(Method::GET, "/admin/workers", Access::Admin, Door::Token, |d| get(admin::list).layer(d)),
    route(Method::POST, "/admin/workers", Access::Admin, Door::Token, |d| post(admin::add).layer(d)),
    route(Method::DELETE, "/admin/workers", Access::Admin, Door::Token, |d| delete(admin::remove_query).layer(d)),
    route(Method::DELETE, "/admin/workers/{id}", Access::Admin, Door::Token, |d| delete(admin::remove_id).layer(d)),
    route(Method::GET, LOADS_PATH, Access::Peer, Door::Token, |d| get(peers::endpoints::serve_loads).layer(d)),
    route(Method::POST, INDEX_PATH, Access::Peer, Door::Token, |d| post(peers::endpoints::serve_snapshot).layer(d)),
    route(Method::POST, DECIDE_PATH, Access::Peer, Door::Token, |d| post(peers::endpoints::serve_decide).layer(d)),
];

const fn route(
    method: Method,
    path: &'static str,
    access: Access,
    door: Door,
    handler: fn(FrontDoor) -> MethodRouter<Arc<Gateway>>,
) -> Route {
    Route {
        method,
        path,
        access,
        door,
        handler,
    }
}

/// Builds the router over a gateway from [`ROUTES`]: each route behind its front door
/// (its token, and its admission and request count where its door says).
pub fn router(gw: Arc<Gateway>) -> Router {
    let mut router = Router::new();
    for r in ROUTES {
        let door = FrontDoor::new(gw.clone(), r.access, r.door);
        router = router.route(r.path, (r.handler)(door));
    }
    router
        .fallback(not_found)
        .method_not_allowed_fallback(front_door::method_not_allowed)
        .with_state(gw)
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
    // A new replica asking its peers for the workers' index snapshots would route blind.
    let bootstrapping = gw.index_bootstraps();
    all &= bootstrapping == 0;
    let status = if all {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({"ready": all, "models": models, "index_bootstraps": bootstrapping});
    (status, Json(body)).into_response()
}

async fn metrics(State(gw): State<Arc<Gateway>>) -> Response {
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
                    g.index(&m.name, index.read().len(), index.read_waits());
                }
            }
            // Every model, zero without a local tokenizer (a prefill pool has none).
            for m in gw.models() {
                let stats = match &m.tokenizer {
                    Some(Tokenizer::Local(t)) => t.segment_cache_stats().unwrap_or_default(),
                    _ => Default::default(),
                };
                g.tokenize_cache(&m.name, &stats);
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
        let unique = peer_link::client::check_unique_name(
            &gw.client,
            &gw.peers,
            &gw.config.peers,
            gw.config.admin_token.as_deref(),
        )
        .await;
        if let Err(e) = unique {
            for m in gw.pools() {
                m.selection.shutdown();
            }
            return Err(e);
        }
        tracing::info!(replica = %identity.replica, peers = ?gw.config.peers.urls, dns = ?gw.config.peers.dns, "sharing load with peer replicas");
    }
    let tasks = vec![
        tokio::spawn(checks::run_health_checks(gw.clone())),
        tokio::spawn(checks::run_ledger_sweep(gw.clone())),
        tokio::spawn(stall::run_stall_watch(gw.clone())),
        tokio::spawn(engine_load::run_engine_queue_reads(gw.clone())),
        tokio::spawn(peers::publish::run_publisher(gw.clone())),
        tokio::spawn(peers::follow::run_followers(gw.clone())),
        tokio::spawn(discovery::run_worker_discovery(gw.clone())),
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
