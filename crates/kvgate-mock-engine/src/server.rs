//! The HTTP surface of vLLM's OpenAI server that routers and clients use.
//!
//! Owns routes, request decoding and response streaming (axum). It hands token ids to
//! the engine loop through [`EngineHandle`] and never touches the simulator directly.
//! Errors reaching a client are OpenAI-style JSON.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::disaggregation::Disaggregation;
use crate::driver::EngineHandle;
use crate::openai::{self, gen_params, ResponseMeta, SSE_DONE};
use crate::scheduler::SimRequest;
use crate::tokenizer::{self, body_tokens, PromptKind, PromptTokenizer};

/// What every handler needs.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// The served model name.
    pub model: String,
    pub max_model_len: u64,
    pub default_max_tokens: u32,
    pub created: u64,
    pub next_response: Arc<AtomicU64>,
    /// Larger request bodies are refused with a text/plain 413.
    pub max_body_bytes: usize,
    /// The KV event publisher, for the fault-injection endpoints.
    pub publisher: Option<crate::kv_publisher::KvPublisher>,
    /// Prefill/decode disaggregation (None = an ordinary engine).
    pub pd: Option<Arc<Disaggregation>>,
}

/// The router with every endpoint.
pub fn router(state: AppState) -> Router {
    let body_limit = axum::extract::DefaultBodyLimit::max(state.max_body_bytes);
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/get_load", get(get_load))
        .route("/version", get(version))
        .route("/kv_transfer/pull", post(kv_transfer_pull))
        .route("/fault/kv_events/pause", post(fault_pause_events))
        .route("/fault/kv_events/garbage", post(fault_garbage_events))
        .route("/fault/engine/hang", post(fault_hang_engine))
        .fallback(not_found)
        .layer(body_limit)
        .with_state(state)
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn error(status: StatusCode, message: &str) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::NOT_FOUND => "NotFoundError",
        StatusCode::CONFLICT => "ConflictError",
        _ => "InternalServerError",
    };
    (
        status,
        Json(openai::error_body(message, kind, status.as_u16())),
    )
        .into_response()
}

fn bad_request(message: &str) -> Response {
    error(StatusCode::BAD_REQUEST, message)
}

fn parse_body(bytes: &Bytes) -> Result<Value, String> {
    serde_json::from_slice(bytes).map_err(|e| format!("invalid JSON body: {e}"))
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "not found")
}

async fn chat(State(st): State<AppState>, body: Bytes) -> Response {
    generate(st, PromptKind::Chat, body).await
}

async fn completions(State(st): State<AppState>, body: Bytes) -> Response {
    generate(st, PromptKind::Completion, body).await
}

async fn generate(st: AppState, kind: PromptKind, raw: Bytes) -> Response {
    let body = match parse_body(&raw) {
        Ok(b) => b,
        Err(msg) => return bad_request(&msg),
    };
    let mut params = match gen_params(kind, &body, st.default_max_tokens) {
        Ok(p) => p,
        Err(msg) => return bad_request(&msg),
    };
    let prompt = match body_tokens(st.tokenizer.as_ref(), kind, &body) {
        Ok(p) => p,
        Err(e) => return bad_request(&e.to_string()),
    };
    let prompt_len = prompt.len() as u32;
    // Disaggregated serving: what this request's prefill owes a decode engine, or
    // the prompt KV a decode engine receives first.
    let pd = st.pd.clone();
    let holds_kv = pd
        .as_ref()
        .is_some_and(|d| d.holds_for_remote_decode(&body));
    let room = pd.as_ref().and_then(|d| d.prefill_room(&body));
    if room.is_some() {
        params.max_tokens = 1; // an SGLang prefill engine computes the first token only
    }
    let transferred_tokens = match &pd {
        Some(d) => match d.receive(&body, prompt.len()).await {
            Ok(n) => n,
            Err((status, msg)) => return error(status, &msg),
        },
        None => 0,
    };
    let on_finish = move || -> Option<Value> {
        let d = pd.as_ref()?;
        if let Some(room) = room {
            d.finish_room(room, prompt_len);
        }
        holds_kv.then(|| d.hold(prompt_len))
    };
    let sim_req = SimRequest {
        prompt,
        max_tokens: params.max_tokens,
        ignore_eos: params.ignore_eos,
        transferred_tokens,
    };
    let (guard, mut rx) = match st.engine.submit(sim_req).await {
        Ok(Ok(x)) => x,
        Ok(Err(e)) => return bad_request(&e.to_string()),
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    };
    let n = st.next_response.fetch_add(1, Ordering::Relaxed);
    let prefix = match kind {
        PromptKind::Chat => "chatcmpl",
        PromptKind::Completion => "cmpl",
    };
    let meta = ResponseMeta {
        kind,
        // The process id tells a fleet's engines (and an engine's restarts) apart in a
        // client's record of who answered, behind routers that add no header of their own.
        id: format!(
            "{prefix}-mock{:x}-{:x}-{:06x}",
            st.created,
            std::process::id(),
            n
        ),
        created: unix_now(),
        model: params.model.clone().unwrap_or_else(|| st.model.clone()),
    };

    if !params.stream {
        let mut guard = guard;
        let mut text = String::new();
        while let Some(o) = rx.recv().await {
            text.push_str(&tokenizer::filler_text(o.index));
            if let Some(reason) = o.finished {
                guard.disarm();
                let usage = openai::usage(prompt_len, o.index + 1, o.cached_tokens);
                let mut answer = meta.full_response(&text, reason, usage);
                if let Some(params) = on_finish() {
                    answer["kv_transfer_params"] = params;
                }
                return Json(answer).into_response();
            }
        }
        return error(StatusCode::SERVICE_UNAVAILABLE, "the request was aborted");
    }

    let include_usage = params.include_usage;
    let on_finish: Box<dyn FnOnce() + Send> = Box::new(move || {
        on_finish();
    });
    let stream = async_stream(meta, guard, rx, prompt_len, include_usage, on_finish);
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream; charset=utf-8")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "response build failed"))
}

/// The SSE body: role chunk with the first token (chat), one chunk per token, the
/// usage chunk if asked, `[DONE]`. Dropping the stream (client gone) aborts the
/// request through the guard it owns.
fn async_stream(
    meta: ResponseMeta,
    guard: crate::driver::AbortOnDrop,
    rx: tokio::sync::mpsc::UnboundedReceiver<crate::scheduler::TokenOutput>,
    prompt_len: u32,
    include_usage: bool,
    on_finish: Box<dyn FnOnce() + Send>,
) -> impl futures::Stream<Item = Result<Bytes, Infallible>> + Send {
    struct S {
        meta: ResponseMeta,
        guard: crate::driver::AbortOnDrop,
        rx: tokio::sync::mpsc::UnboundedReceiver<crate::scheduler::TokenOutput>,
        prompt_len: u32,
        include_usage: bool,
        done: bool,
        on_finish: Option<Box<dyn FnOnce() + Send>>,
    }
    let init = S {
        meta,
        guard,
        rx,
        prompt_len,
        include_usage,
        done: false,
        on_finish: Some(on_finish),
    };
    futures::stream::unfold(init, |mut s| async move {
        if s.done {
            return None;
        }
        let Some(o) = s.rx.recv().await else {
            // Engine went away mid-stream: end the body (guard aborts on drop).
            return None;
        };
        let mut out = String::new();
        if o.index == 0 && s.meta.kind == PromptKind::Chat {
            out.push_str(&openai::sse_data(&s.meta.role_chunk()));
        }
        out.push_str(&openai::sse_data(
            &s.meta
                .token_chunk(&tokenizer::filler_text(o.index), o.finished),
        ));
        if o.finished.is_some() {
            s.guard.disarm();
            if let Some(f) = s.on_finish.take() {
                f();
            }
            if s.include_usage {
                let usage = openai::usage(s.prompt_len, o.index + 1, o.cached_tokens);
                out.push_str(&openai::sse_data(&s.meta.usage_chunk(usage)));
            }
            out.push_str(SSE_DONE);
            s.done = true;
        }
        Some((Ok(Bytes::from(out)), s))
    })
}

async fn tokenize(State(st): State<AppState>, raw: Bytes) -> Response {
    let body = match parse_body(&raw) {
        Ok(b) => b,
        Err(msg) => return bad_request(&msg),
    };
    let kind = if body.get("messages").is_some() {
        PromptKind::Chat
    } else {
        PromptKind::Completion
    };
    match body_tokens(st.tokenizer.as_ref(), kind, &body) {
        Ok(tokens) => Json(json!({
            "count": tokens.len(),
            "max_model_len": st.max_model_len,
            "tokens": tokens,
            "token_strs": null,
        }))
        .into_response(),
        Err(e) => bad_request(&e.to_string()),
    }
}

async fn models(State(st): State<AppState>) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": st.model,
            "object": "model",
            "created": st.created,
            "owned_by": "vllm",
            "root": st.model,
            "parent": null,
            "max_model_len": st.max_model_len,
            "permission": [],
        }],
    }))
    .into_response()
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn version() -> Response {
    Json(json!({"version": concat!("kvgate-mock-engine-", env!("CARGO_PKG_VERSION"))}))
        .into_response()
}

async fn metrics(State(st): State<AppState>) -> Response {
    let text = crate::metrics::render(&st.model, &st.engine.snapshot());
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

/// Query of `POST /reset_prefix_cache`, as vLLM's.
#[derive(Deserialize, Default)]
struct ResetQuery {
    #[serde(default)]
    reset_running_requests: bool,
}

async fn reset_prefix_cache(State(st): State<AppState>, Query(q): Query<ResetQuery>) -> Response {
    match st.engine.reset_prefix_cache(q.reset_running_requests).await {
        Ok(true) => StatusCode::OK.into_response(),
        Ok(false) => error(
            StatusCode::CONFLICT,
            "cannot reset the prefix cache while requests are running (pass reset_running_requests=true to preempt them)",
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, &e.to_string()),
    }
}

#[derive(Deserialize)]
struct PauseQuery {
    ms: u64,
}

/// Fault injection (not a vLLM endpoint): the KV event socket sends nothing for `ms`.
async fn fault_pause_events(State(st): State<AppState>, Query(q): Query<PauseQuery>) -> Response {
    match &st.publisher {
        Some(p) => {
            p.pause(std::time::Duration::from_millis(q.ms));
            StatusCode::OK.into_response()
        }
        None => error(StatusCode::NOT_FOUND, "KV events are off"),
    }
}

/// Fault injection (not a vLLM endpoint): the engine loop hangs for `ms` while this
/// server keeps answering (`/health` included), as a vLLM engine core stopped behind
/// its API server.
async fn fault_hang_engine(State(st): State<AppState>, Query(q): Query<PauseQuery>) -> Response {
    match st.engine.hang(std::time::Duration::from_millis(q.ms)) {
        Ok(()) => StatusCode::OK.into_response(),
        Err(_) => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the engine is shutting down",
        ),
    }
}

#[derive(Deserialize)]
struct GarbageQuery {
    #[serde(default = "one")]
    count: u32,
}

fn one() -> u32 {
    1
}

/// Fault injection (not a vLLM endpoint): `count` malformed KV event messages.
async fn fault_garbage_events(
    State(st): State<AppState>,
    Query(q): Query<GarbageQuery>,
) -> Response {
    match &st.publisher {
        Some(p) => {
            p.send_garbage(q.count.min(10_000));
            StatusCode::OK.into_response()
        }
        None => error(StatusCode::NOT_FOUND, "KV events are off"),
    }
}

/// A vLLM prefill engine's transfer side channel (stands in for NIXL's).
async fn kv_transfer_pull(State(st): State<AppState>, raw: Bytes) -> Response {
    crate::disaggregation::pull_handler(st.pd.clone(), raw).await
}

async fn get_load(State(st): State<AppState>) -> Response {
    let s = st.engine.snapshot();
    Json(json!({
        "load": s.running + s.waiting,
        "num_requests_running": s.running,
        "num_requests_waiting": s.waiting,
        "kv_cache_usage_perc": s.kv_usage,
    }))
    .into_response()
}
