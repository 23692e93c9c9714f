//! Test support: small axum fake engines with precise failure injection, and gateway
//! configs on loopback with ephemeral ports.
#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use kvgate_core::PolicyKind;
use kvgate_gateway::{Config, HealthConfig, ModelConfig, WorkerConfig};

/// The exact SSE bytes a fake engine streams, split at awkward places.
pub const SSE_CHUNKS: &[&[u8]] = &[
    b"data: {\"id\":\"c1\",\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
    b": keep-alive comment\r\n\r\ndata: {\"choices\":[{\"delta\":{\"content\":\"Hel",
    b"lo\"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\" w\\u00f6rld\"}}]}\n\n",
    b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":2,\"total_tokens\":9,\"prompt_tokens_details\":{\"cached_tokens\":0}}}\n\n",
    b"data: [DONE]\n\n",
];

pub const JSON_BODY: &[u8] = b"{\"id\":\"x\",\"object\":\"chat.completion\",\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"hi\"}}],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":1,\"total_tokens\":6,\"prompt_tokens_details\":{\"cached_tokens\":0}}}";

pub fn sse_bytes() -> Vec<u8> {
    SSE_CHUNKS.concat()
}

#[derive(Clone, Debug)]
pub struct Behavior {
    /// Status of completions responses (non-200: a JSON error, no stream).
    pub status: u16,
    /// Stream the first chunk, then fail the body.
    pub fail_after_first: bool,
    /// Delay before each chunk.
    pub chunk_delay: Duration,
    /// Repeat the middle chunks this many times (long streams).
    pub repeat: usize,
    /// Never answer completions (an engine that died behind a live HTTP server).
    pub hang: bool,
    /// Streams: send the response head, then never an event (vLLM's API server sends
    /// its head at once and its first event with the first token; its engine died in
    /// between).
    pub hang_after_head: bool,
    /// Streams: send the response head, then break the body before any event.
    pub fail_before_first: bool,
    /// Refuse bodies declared larger than this with a text/plain 413 without reading
    /// them (a web server's body limit in front of an engine).
    pub body_limit: Option<usize>,
    /// `/tokenize` answers 500.
    pub tokenize_fails: bool,
}

/// Request header that overrides a fake engine's behaviour for one request: `ok`,
/// `error-status` (a 500 before any byte), `fail-after-first` (the stream breaks after
/// its first chunk), `fail-before-first` (the stream breaks after its head, before any
/// chunk), `hang-after-head` (a head, then nothing), `slow` (a long stream, 50 ms
/// between chunks).
pub const BEHAVIOR_HEADER: &str = "x-fake-behavior";

impl Behavior {
    fn with_override(mut self, header: Option<&str>) -> Self {
        match header {
            Some("error-status") => self.status = 500,
            Some("fail-after-first") => self.fail_after_first = true,
            Some("fail-before-first") => self.fail_before_first = true,
            Some("hang-after-head") => self.hang_after_head = true,
            Some("slow") => {
                self.chunk_delay = Duration::from_millis(50);
                self.repeat = 40;
            }
            _ => {}
        }
        self
    }
}

impl Default for Behavior {
    fn default() -> Self {
        Self {
            status: 200,
            fail_after_first: false,
            chunk_delay: Duration::ZERO,
            repeat: 1,
            hang: false,
            hang_after_head: false,
            fail_before_first: false,
            body_limit: None,
            tokenize_fails: false,
        }
    }
}

#[derive(Clone)]
struct FakeState {
    name: String,
    behavior: Behavior,
    stats: Arc<Stats>,
}

#[derive(Default, Debug)]
pub struct Stats {
    pub hits: AtomicUsize,
    pub completed: AtomicUsize,
    pub aborted: AtomicUsize,
    pub health_checks: AtomicUsize,
    pub tokenize_calls: AtomicUsize,
    pub healthy: AtomicBool,
    pub last_auth: parking_lot::Mutex<Option<String>>,
    /// The `x-data-parallel-rank` of the last completions request.
    pub last_dp_rank: parking_lot::Mutex<Option<String>>,
}

pub struct Fake {
    pub url: String,
    pub stats: Arc<Stats>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Fake {
    pub fn hits(&self) -> usize {
        self.stats.hits.load(Ordering::SeqCst)
    }
}

/// Counts a stream as aborted unless it ran to the end.
struct StreamGuard {
    stats: Arc<Stats>,
    done: bool,
}

impl StreamGuard {
    fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.done {
            self.stats.completed.fetch_add(1, Ordering::SeqCst);
        } else {
            self.stats.aborted.fetch_add(1, Ordering::SeqCst);
        }
    }
}

async fn completions(State(s): State<FakeState>, req: Request) -> Response {
    s.stats.hits.fetch_add(1, Ordering::SeqCst);
    let override_header = req
        .headers()
        .get(BEHAVIOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let declared = req
        .headers()
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if let (Some(limit), Some(len)) = (s.behavior.body_limit, declared) {
        if len > limit {
            return (
                http::StatusCode::PAYLOAD_TOO_LARGE,
                [("content-type", "text/plain; charset=utf-8")],
                "length limit exceeded",
            )
                .into_response();
        }
    }
    *s.stats.last_auth.lock() = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    *s.stats.last_dp_rank.lock() = req
        .headers()
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = axum::body::to_bytes(req.into_body(), 1 << 24)
        .await
        .unwrap_or_default();
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let b = s.behavior.clone().with_override(override_header.as_deref());
    if b.hang {
        let _guard = StreamGuard {
            stats: s.stats.clone(),
            done: false,
        };
        std::future::pending::<()>().await;
    }
    if b.status != 200 {
        let status = http::StatusCode::from_u16(b.status).unwrap();
        return (
            status,
            [("content-type", "application/json")],
            format!("{{\"error\":{{\"message\":\"{} failed\"}}}}", s.name),
        )
            .into_response();
    }
    if v.get("stream").and_then(|x| x.as_bool()) != Some(true) {
        return ([("content-type", "application/json")], JSON_BODY).into_response();
    }
    let mut chunks: Vec<&'static [u8]> = vec![SSE_CHUNKS[0]];
    for _ in 0..b.repeat {
        chunks.extend_from_slice(&SSE_CHUNKS[1..3]);
    }
    chunks.extend_from_slice(&SSE_CHUNKS[3..]);
    let guard = StreamGuard {
        stats: s.stats.clone(),
        done: false,
    };
    let stream = futures::stream::unfold((0usize, guard), move |(i, mut guard)| {
        let chunks = chunks.clone();
        let b = b.clone();
        async move {
            if i >= chunks.len() {
                guard.finish();
                return None;
            }
            if !b.chunk_delay.is_zero() {
                tokio::time::sleep(b.chunk_delay).await;
            }
            if b.hang_after_head {
                std::future::pending::<()>().await;
            }
            if b.fail_before_first && i == 0 {
                guard.finish();
                return Some((
                    Err(std::io::Error::other(
                        "engine crashed before its first token",
                    )),
                    (chunks.len(), guard),
                ));
            }
            if b.fail_after_first && i == 1 {
                guard.finish();
                return Some((
                    Err(std::io::Error::other("engine crashed mid-stream")),
                    (i + 1, guard),
                ));
            }
            Some((
                Ok::<_, std::io::Error>(Bytes::from_static(chunks[i])),
                (i + 1, guard),
            ))
        }
    });
    (
        [("content-type", "text/event-stream")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn health(State(s): State<FakeState>) -> Response {
    s.stats.health_checks.fetch_add(1, Ordering::SeqCst);
    if s.stats.healthy.load(Ordering::SeqCst) {
        "ok".into_response()
    } else {
        (http::StatusCode::SERVICE_UNAVAILABLE, "down").into_response()
    }
}

async fn tokenize_stub(State(s): State<FakeState>) -> Response {
    s.stats.tokenize_calls.fetch_add(1, Ordering::SeqCst);
    if s.behavior.tokenize_fails {
        return (
            http::StatusCode::INTERNAL_SERVER_ERROR,
            [("content-type", "application/json")],
            "{\"error\":{\"message\":\"tokenizer crashed\",\"type\":\"InternalServerError\",\"code\":500}}",
        )
            .into_response();
    }
    (
        [("content-type", "application/json")],
        "{\"count\":3,\"tokens\":[1,2,3]}",
    )
        .into_response()
}

/// Starts a fake engine on an ephemeral loopback port.
pub async fn fake(name: &str, behavior: Behavior) -> Fake {
    let stats = Arc::new(Stats::default());
    stats.healthy.store(true, Ordering::SeqCst);
    let state = FakeState {
        name: name.to_string(),
        behavior,
        stats: stats.clone(),
    };
    let app = Router::new()
        .route("/v1/chat/completions", post(completions))
        .route("/v1/completions", post(completions))
        .route("/tokenize", post(tokenize_stub))
        .route("/health", get(health))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Fake { url, stats, task }
}

/// A loopback URL nobody listens on.
pub async fn dead_url() -> String {
    // Bound but never listening: a connection is refused, and the port stays taken for
    // the rest of the test process (the socket is leaked on purpose), so the gateway or
    // an engine started next cannot be given it, as a port merely freed could be.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}", socket.local_addr().unwrap());
    std::mem::forget(socket);
    url
}

/// A one-model gateway config on an ephemeral port, no active health checks.
pub fn config(urls: &[&str], policy: PolicyKind) -> Config {
    Config {
        host: "127.0.0.1".into(),
        port: 0,
        models: vec![ModelConfig {
            name: "m".into(),
            workers: urls.iter().map(|u| WorkerConfig::new(*u)).collect(),
            policy,
            seed: Some(7),
            // The fakes serve no /metrics, and some count every request they get;
            // tests/engine_load.rs reads real (mock) engines' queues.
            engine_metrics_interval_ms: 0,
            ..ModelConfig::default()
        }],
        health: HealthConfig {
            interval_ms: 0,
            ..HealthConfig::default()
        },
        shutdown_grace_secs: 2,
        ..Config::default()
    }
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap()
}

/// The gateway's Prometheus text.
pub async fn metrics_text(c: &reqwest::Client, gateway_url: &str) -> String {
    c.get(format!("{gateway_url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of the sample whose name and labels are exactly `series`.
pub fn gauge_value(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let rest = l.strip_prefix(series)?;
        rest.trim().parse().ok()
    })
}

/// Every `kvgate_requests_total` sample of a Prometheus text: labels → count (the
/// series created at zero left out).
pub fn requests_counted(metrics: &str) -> std::collections::BTreeMap<String, f64> {
    metrics
        .lines()
        .filter_map(|l| l.strip_prefix("kvgate_requests_total"))
        .filter_map(|rest| {
            let (labels, value) = rest.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            (value > 0.0).then(|| (labels.to_owned(), value))
        })
        .collect()
}

/// The gateway's `/v1/route/explain` answer for a request body.
pub async fn explain(
    c: &reqwest::Client,
    gateway_url: &str,
    body: &serde_json::Value,
) -> serde_json::Value {
    c.post(format!("{gateway_url}/v1/route/explain"))
        .json(body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

/// Polls `cond` every 10 ms for up to 10 s.
pub async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for: {what}");
}

pub fn worker_of(resp: &reqwest::Response) -> String {
    resp.headers()
        .get("x-kvgate-worker")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
}

pub fn chat_body(stream: bool) -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": stream, "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}]})
}
