//! Prefill/decode disaggregation as vLLM's and SGLang's engines do it, simulated.
//!
//! - **vLLM** (`kv_transfer_params`, as with the NIXL connector). A *prefill* engine
//!   given `kv_transfer_params.do_remote_decode: true` runs the request as usual (the
//!   router asks for one token) and answers with `kv_transfer_params` naming the KV it
//!   now holds for a decode engine: `remote_engine_id`, `remote_block_ids` (one id per
//!   block of the prompt), `remote_host`/`remote_port` (where to pull them: this
//!   engine's HTTP address, standing in for NIXL's side channel). It holds them until a
//!   decode engine pulls them (`POST /kv_transfer/pull`) or the transfer timeout ends.
//!   A *decode* engine given `kv_transfer_params.do_remote_prefill: true` pulls the
//!   named blocks from that engine first and refuses the request (400) if the engine
//!   does not hold them.
//! - **SGLang** (bootstrap rooms). A *prefill* engine given `bootstrap_room` computes
//!   the prompt and one token, then marks the room done on its bootstrap server (its own
//!   port, `GET /bootstrap/room/{room}`). A *decode* engine given
//!   `bootstrap_host`/`bootstrap_port`/`bootstrap_room` waits on that server until the
//!   room is done (or answers 503 after the transfer timeout: a prefill that never
//!   comes).
//!
//! Either way the decode engine then waits the transfer time of the latency model and
//! submits the request with the transferred prompt tokens counted as computed: no
//! prefill work, and their blocks are stored and published as KV events like any other.
//!
//! Owns the transfer tables and the pull/bootstrap protocol. Must not schedule (the
//! simulator does) or shape OpenAI responses (server.rs, openai.rs).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::latency::LatencyModel;

/// An engine's part in disaggregated serving.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PdRole {
    Prefill,
    Decode,
}

/// The transfer protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PdMode {
    Vllm,
    Sglang,
}

/// How one engine takes part in disaggregated serving.
#[derive(Clone, Debug)]
pub struct PdConfig {
    pub role: PdRole,
    pub mode: PdMode,
    /// SGLang prefill: the bootstrap server's port (0 = ephemeral).
    pub bootstrap_port: u16,
    /// How long KV is held for a decode engine, and how long a decode engine waits.
    pub transfer_timeout: Duration,
}

/// KV held by a vLLM prefill engine for one decode engine.
struct Held {
    block_ids: Vec<u64>,
    tokens: u32,
    expires: Instant,
}

/// An SGLang room: done once its prefill computed `tokens` prompt tokens.
struct Room {
    tokens: Option<u32>,
    expires: Instant,
}

/// One engine's disaggregation state.
pub struct Disaggregation {
    pub config: PdConfig,
    engine_id: String,
    /// This engine's HTTP address (a vLLM prefill engine's `remote_host`/`remote_port`).
    http_addr: SocketAddr,
    block_size: u32,
    latency: LatencyModel,
    speedup: f64,
    next_block: AtomicU64,
    held: Mutex<FxHashMap<u64, Held>>,
    rooms: Mutex<FxHashMap<u64, Room>>,
    room_done: Notify,
    client: reqwest::Client,
}

/// Why a decode engine refuses a request.
pub type Refusal = (StatusCode, String);

impl Disaggregation {
    pub fn new(
        config: PdConfig,
        http_addr: SocketAddr,
        block_size: u32,
        latency: LatencyModel,
        speedup: f64,
    ) -> Disaggregation {
        Disaggregation {
            engine_id: format!("mock-{}-{}", http_addr.port(), rand_suffix()),
            config,
            http_addr,
            block_size: block_size.max(1),
            latency,
            speedup,
            next_block: AtomicU64::new(1),
            held: Mutex::new(FxHashMap::default()),
            rooms: Mutex::new(FxHashMap::default()),
            room_done: Notify::new(),
            client: reqwest::Client::new(),
        }
    }

    fn is(&self, role: PdRole, mode: PdMode) -> bool {
        self.config.role == role && self.config.mode == mode
    }

    /// vLLM prefill: the request asks to hold its KV for a remote decode.
    pub fn holds_for_remote_decode(&self, body: &Value) -> bool {
        self.is(PdRole::Prefill, PdMode::Vllm)
            && body
                .pointer("/kv_transfer_params/do_remote_decode")
                .and_then(Value::as_bool)
                .unwrap_or(false)
    }

    /// SGLang prefill: the room this request's prefill completes.
    pub fn prefill_room(&self, body: &Value) -> Option<u64> {
        if !self.is(PdRole::Prefill, PdMode::Sglang) {
            return None;
        }
        body.get("bootstrap_room").and_then(Value::as_u64)
    }

    /// vLLM prefill, after the request finished: hold its prompt's blocks and return
    /// the `kv_transfer_params` of the answer.
    pub fn hold(&self, prompt_tokens: u32) -> Value {
        let blocks = u64::from(prompt_tokens.div_ceil(self.block_size)).max(1);
        let first = self.next_block.fetch_add(blocks, Ordering::Relaxed);
        let block_ids: Vec<u64> = (first..first + blocks).collect();
        let now = Instant::now();
        let mut held = self.held.lock();
        held.retain(|_, h| h.expires > now);
        held.insert(
            first,
            Held {
                block_ids: block_ids.clone(),
                tokens: prompt_tokens,
                expires: now + self.config.transfer_timeout,
            },
        );
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": self.engine_id,
            "remote_block_ids": block_ids,
            "remote_host": self.http_addr.ip().to_string(),
            "remote_port": self.http_addr.port(),
            "tp_size": 1,
        })
    }

    /// `POST /kv_transfer/pull` on a vLLM prefill engine: hands over (and stops
    /// holding) the named blocks; the number of prompt tokens they hold.
    fn pull(&self, engine_id: &str, block_ids: &[u64]) -> Option<u32> {
        if engine_id != self.engine_id {
            return None;
        }
        let first = *block_ids.first()?;
        let mut held = self.held.lock();
        let h = held.get(&first)?;
        if h.block_ids != block_ids || h.expires <= Instant::now() {
            return None;
        }
        held.remove(&first).map(|h| h.tokens)
    }

    /// SGLang prefill, after the request's prefill: its room is done.
    pub fn finish_room(&self, room: u64, prompt_tokens: u32) {
        let now = Instant::now();
        let mut rooms = self.rooms.lock();
        rooms.retain(|_, r| r.expires > now);
        rooms.insert(
            room,
            Room {
                tokens: Some(prompt_tokens),
                expires: now + self.config.transfer_timeout,
            },
        );
        drop(rooms);
        self.room_done.notify_waiters();
    }

    /// `GET /bootstrap/room/{room}` on an SGLang prefill engine: waits until the room
    /// is done (its prompt tokens) or the timeout ends (`None`).
    async fn wait_room(&self, room: u64) -> Option<u32> {
        let deadline = Instant::now() + self.config.transfer_timeout;
        loop {
            let notified = self.room_done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(tokens) = self.rooms.lock().remove(&room).and_then(|r| r.tokens) {
                return Some(tokens);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
    }

    /// A decode engine receiving a request: pulls the prompt's KV its parameters name
    /// (vLLM) or waits for its room (SGLang), then waits the transfer time. The prompt
    /// tokens received (0 for a request that carries no transfer).
    pub async fn receive(&self, body: &Value, prompt_len: usize) -> Result<u32, Refusal> {
        if self.config.role != PdRole::Decode {
            return Ok(0);
        }
        let tokens = match self.config.mode {
            PdMode::Vllm => self.pull_remote(body).await?,
            PdMode::Sglang => self.wait_remote_room(body).await?,
        };
        let Some(tokens) = tokens else {
            return Ok(0);
        };
        let tokens = tokens.min(u32::try_from(prompt_len).unwrap_or(u32::MAX));
        let ms = self.latency.kv_transfer_ms(u64::from(tokens)) / self.speedup;
        if ms > 0.0 {
            tokio::time::sleep(Duration::from_secs_f64(ms / 1000.0)).await;
        }
        Ok(tokens)
    }

    async fn pull_remote(&self, body: &Value) -> Result<Option<u32>, Refusal> {
        let Some(params) = body.get("kv_transfer_params") else {
            return Ok(None);
        };
        if !params
            .get("do_remote_prefill")
            .and_then(Value::as_bool)
            .unwrap_or(false)
        {
            return Ok(None);
        }
        let bad = |what: &str| {
            (
                StatusCode::BAD_REQUEST,
                format!("kv_transfer_params: {what}"),
            )
        };
        let host = params
            .get("remote_host")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("remote_host is missing"))?;
        let port = params
            .get("remote_port")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("remote_port is missing"))?;
        let url = format!("http://{}/kv_transfer/pull", join_host_port(host, port));
        let pull = json!({
            "remote_engine_id": params.get("remote_engine_id"),
            "remote_block_ids": params.get("remote_block_ids"),
        });
        let answer = self
            .client
            .post(&url)
            .json(&pull)
            .timeout(self.config.transfer_timeout)
            .send()
            .await
            .map_err(|e| bad(&format!("cannot reach the prefill engine at {url}: {e}")))?;
        if !answer.status().is_success() {
            return Err(bad(
                "the prefill engine holds no such blocks (expired, already pulled, or never prefilled)",
            ));
        }
        let v: Value = answer
            .json()
            .await
            .map_err(|e| bad(&format!("the prefill engine's answer is unreadable: {e}")))?;
        Ok(v.get("tokens")
            .and_then(Value::as_u64)
            .map(|t| u32::try_from(t).unwrap_or(u32::MAX)))
    }

    async fn wait_remote_room(&self, body: &Value) -> Result<Option<u32>, Refusal> {
        let Some(room) = body.get("bootstrap_room").and_then(Value::as_u64) else {
            return Ok(None);
        };
        let bad = |what: &str| (StatusCode::BAD_REQUEST, what.to_string());
        let host = body
            .get("bootstrap_host")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("bootstrap_room without bootstrap_host"))?;
        let port = body
            .get("bootstrap_port")
            .and_then(Value::as_u64)
            .ok_or_else(|| bad("bootstrap_room without bootstrap_port"))?;
        let url = format!(
            "http://{}/bootstrap/room/{room}",
            join_host_port(host, port)
        );
        let gone = |why: String| (StatusCode::SERVICE_UNAVAILABLE, why);
        let answer = self
            .client
            .get(&url)
            .timeout(self.config.transfer_timeout + Duration::from_secs(1))
            .send()
            .await
            .map_err(|e| gone(format!("bootstrap server {url} failed: {e}")))?;
        if !answer.status().is_success() {
            return Err(gone(format!(
                "room {room}: no prefill finished within the transfer timeout"
            )));
        }
        let v: Value = answer
            .json()
            .await
            .map_err(|e| gone(format!("bootstrap answer unreadable: {e}")))?;
        Ok(v.get("tokens")
            .and_then(Value::as_u64)
            .map(|t| u32::try_from(t).unwrap_or(u32::MAX)))
    }
}

fn join_host_port(host: &str, port: u64) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn rand_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{nanos:08x}")
}

#[derive(Deserialize)]
struct PullRequest {
    #[serde(default)]
    remote_engine_id: Option<String>,
    #[serde(default)]
    remote_block_ids: Option<Vec<u64>>,
}

/// `POST /kv_transfer/pull` (a vLLM prefill engine's transfer side channel).
pub async fn pull_handler(
    pd: Option<std::sync::Arc<Disaggregation>>,
    body: axum::body::Bytes,
) -> Response {
    let not_held = || {
        (
            StatusCode::NOT_FOUND,
            Json(crate::openai::error_body(
                "no such blocks are held",
                "NotFoundError",
                404,
            )),
        )
            .into_response()
    };
    let Some(pd) = pd else {
        return not_held();
    };
    let Ok(req) = serde_json::from_slice::<PullRequest>(&body) else {
        return not_held();
    };
    match pd.pull(
        req.remote_engine_id.as_deref().unwrap_or(""),
        req.remote_block_ids.as_deref().unwrap_or(&[]),
    ) {
        Some(tokens) => Json(json!({"tokens": tokens})).into_response(),
        None => not_held(),
    }
}

/// The bootstrap server of an SGLang prefill engine.
pub fn bootstrap_router(pd: std::sync::Arc<Disaggregation>) -> Router {
    Router::new()
        .route("/bootstrap/room/{room}", get(room_handler))
        .with_state(pd)
}

async fn room_handler(
    State(pd): State<std::sync::Arc<Disaggregation>>,
    Path(room): Path<u64>,
) -> Response {
    match pd.wait_room(room).await {
        Some(tokens) => Json(json!({"tokens": tokens})).into_response(),
        None => (
            StatusCode::GATEWAY_TIMEOUT,
            Json(crate::openai::error_body(
                "no prefill finished this room in time",
                "TimeoutError",
                504,
            )),
        )
            .into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pd(role: PdRole, mode: PdMode) -> Disaggregation {
        Disaggregation::new(
            PdConfig {
                role,
                mode,
                bootstrap_port: 0,
                transfer_timeout: Duration::from_millis(200),
            },
            "127.0.0.1:9".parse().unwrap(),
            16,
            LatencyModel::default(),
            1.0,
        )
    }

    #[test]
    fn held_blocks_are_pulled_once_and_only_as_named() {
        let p = pd(PdRole::Prefill, PdMode::Vllm);
        let params = p.hold(40);
        let ids: Vec<u64> = serde_json::from_value(params["remote_block_ids"].clone()).unwrap();
        assert_eq!(ids.len(), 3, "40 tokens are 3 blocks of 16");
        let engine = params["remote_engine_id"].as_str().unwrap();
        assert_eq!(params["do_remote_prefill"], true);
        assert_eq!(params["remote_port"], 9);
        assert_eq!(p.pull("someone-else", &ids), None);
        assert_eq!(p.pull(engine, &ids[..2]), None);
        assert_eq!(p.pull(engine, &ids), Some(40));
        assert_eq!(p.pull(engine, &ids), None, "pulled already");
    }

    #[tokio::test]
    async fn a_room_waits_for_its_prefill_and_times_out_without_one() {
        let p = std::sync::Arc::new(pd(PdRole::Prefill, PdMode::Sglang));
        let waiter = {
            let p = p.clone();
            tokio::spawn(async move { p.wait_room(7).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        p.finish_room(7, 123);
        assert_eq!(waiter.await.unwrap(), Some(123));
        assert_eq!(p.wait_room(8).await, None);
    }

    #[test]
    fn only_the_right_role_reads_the_transfer_fields() {
        let body = json!({"kv_transfer_params": {"do_remote_decode": true}, "bootstrap_room": 5});
        assert!(pd(PdRole::Prefill, PdMode::Vllm).holds_for_remote_decode(&body));
        assert!(!pd(PdRole::Decode, PdMode::Vllm).holds_for_remote_decode(&body));
        assert_eq!(
            pd(PdRole::Prefill, PdMode::Sglang).prefill_room(&body),
            Some(5)
        );
        assert_eq!(pd(PdRole::Prefill, PdMode::Vllm).prefill_room(&body), None);
    }
}
