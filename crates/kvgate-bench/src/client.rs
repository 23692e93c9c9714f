//! One streaming completion request against an OpenAI-compatible endpoint, measured.
//!
//! Owns the wire format of the bench's requests (`POST /v1/completions`, token-id
//! prompt, `stream`, `include_usage`, `ignore_eos`) and the per-request measurements:
//! TTFT, inter-chunk gaps, end-to-end time, usage (`cached_tokens`), the serving worker
//! (`x-kvgate-worker` header) and the error class. It must not schedule requests or
//! aggregate results.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use serde::Serialize;
use serde_json::Value;

use crate::request::{Request, RequestObjective};
use crate::sse::SseParser;

/// Response header naming the worker that served a request (set by kvgate).
pub const WORKER_HEADER: &str = "x-kvgate-worker";
/// Response header: kvgate's predicted time to first token for the request, ms.
pub const PREDICTED_TTFT_HEADER: &str = "x-kvgate-predicted-ttft-ms";
/// Request header carrying the session id (used by the session policy).
pub const SESSION_HEADER: &str = "x-session-id";

/// What happened to one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Outcome {
    /// The request's id.
    pub id: u64,
    /// HTTP status, when a response arrived.
    pub status: Option<u16>,
    /// Error class when the request failed: the HTTP status (e.g. `"503"`), `"connect"`,
    /// `"timeout"`, `"transport"`, `"stream_error"` (an error event inside the stream)
    /// or `"no_tokens"` (a 2xx stream that produced no content).
    pub error: Option<String>,
    /// Error detail for logs (truncated body or transport message).
    pub error_detail: Option<String>,
    /// Delay between the scheduled send time and the actual send (queueing in the bench).
    pub dispatch_delay: Duration,
    /// When it was sent, from the start of the replay.
    pub sent_at: Duration,
    /// Time to the first content chunk.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<Duration>,
    /// Send to end of stream.
    pub e2e: Duration,
    /// Prompt tokens (usage, or the request's length when the server sent no usage).
    pub prompt_tokens: u64,
    /// Completion tokens (usage, or the number of content chunks).
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`, when reported.
    pub cached_tokens: Option<u64>,
    /// Value of the `x-kvgate-worker` response header.
    pub worker: Option<String>,
    /// The answer's `id` (its first event's), which names the engine behind routers
    /// that add no header (the mock engine's ids carry its process id).
    pub response_id: Option<String>,
    /// The router's predicted time to first token (kvgate's `x-kvgate-predicted-ttft-ms`).
    pub predicted_ttft: Option<Duration>,
    /// The request's latency objective and priority.
    #[serde(skip)]
    pub objective: RequestObjective,
}

impl Outcome {
    /// True when the request completed without error.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }
}

/// How the prompt is put in the request body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptFormat {
    /// `"prompt": [token ids]` — no tokenizer needed anywhere (default).
    #[default]
    Tokens,
    /// `"prompt": "w101 w2043 ..."` — one whitespace-separated word per token id, for
    /// routers that only accept text prompts; the mock engine's word tokenizer maps each
    /// word to one token, so lengths and shared prefixes are preserved.
    Text,
}

/// Render token ids as one word per token (`PromptFormat::Text`).
pub fn tokens_as_text(ids: &[u32]) -> String {
    let mut s = String::with_capacity(ids.len() * 7);
    for (i, id) in ids.iter().enumerate() {
        if i > 0 {
            s.push(' ');
        }
        s.push('w');
        s.push_str(&id.to_string());
    }
    s
}

/// Which of a client's targets take requests now: all of them, unless a rolling
/// update has taken one out (as a load balancer does with a pod that is not ready).
#[derive(Debug, Clone)]
pub struct Rotation(Arc<[AtomicBool]>);

impl Rotation {
    fn all(n: usize) -> Self {
        Self((0..n).map(|_| AtomicBool::new(true)).collect())
    }

    /// Puts target `i` in the rotation or takes it out.
    pub fn set(&self, i: usize, serving: bool) {
        if let Some(t) = self.0.get(i) {
            t.store(serving, Ordering::Relaxed);
        }
    }

    fn serving(&self, i: usize) -> bool {
        self.0.get(i).is_some_and(|t| t.load(Ordering::Relaxed))
    }
}

/// A client for one target endpoint.
#[derive(Debug, Clone)]
pub struct BenchClient {
    http: reqwest::Client,
    url: String,
    /// Completions URLs requests are spread over round-robin (just `url` unless
    /// [`BenchClient::spread_over`] gave several), and the next one's turn.
    targets: Arc<[String]>,
    turn: Arc<AtomicUsize>,
    /// Which targets take requests now.
    rotation: Rotation,
    model: String,
    timeout: Duration,
    format: PromptFormat,
}

impl BenchClient {
    /// A client for `target` (base URL such as `http://127.0.0.1:8000`; a trailing
    /// `/v1/completions` is accepted too), sending `model` in every body.
    pub fn new(target: &str, model: &str, timeout: Duration) -> anyhow::Result<Self> {
        let base = target.trim_end_matches('/');
        let url = if base.ends_with("/v1/completions") {
            base.to_string()
        } else {
            format!("{base}/v1/completions")
        };
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(1024)
            .tcp_nodelay(true)
            .build()?;
        Ok(Self {
            http,
            targets: vec![url.clone()].into(),
            turn: Default::default(),
            rotation: Rotation::all(1),
            url,
            model: model.to_string(),
            timeout,
            format: PromptFormat::Tokens,
        })
    }

    /// Send prompts in this format.
    pub fn with_prompt_format(mut self, format: PromptFormat) -> Self {
        self.format = format;
        self
    }

    /// Spreads requests round-robin over these base URLs (router replicas) instead of
    /// the one given to [`BenchClient::new`].
    pub fn spread_over(mut self, bases: &[String]) -> Self {
        if !bases.is_empty() {
            self.targets = bases
                .iter()
                .map(|b| format!("{}/v1/completions", b.trim_end_matches('/')))
                .collect();
            self.rotation = Rotation::all(bases.len());
        }
        self
    }

    /// Which of the spread targets take requests (shared: changes apply at once).
    pub fn rotation(&self) -> Rotation {
        self.rotation.clone()
    }

    /// The completions URL this client posts to (the first, when spread).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The JSON body sent for a request.
    pub fn body(&self, req: &Request) -> Value {
        let prompt = match self.format {
            PromptFormat::Tokens => serde_json::json!(req.prompt),
            PromptFormat::Text => Value::String(tokens_as_text(&req.prompt)),
        };
        serde_json::json!({
            "model": self.model,
            "prompt": prompt,
            "max_tokens": req.max_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
            "ignore_eos": true,
        })
    }

    /// Send one request and measure it. Never fails: every failure is an `Outcome` error.
    pub async fn send(&self, req: &Request) -> Outcome {
        let start = Instant::now();
        let mut out = Outcome {
            id: req.id,
            objective: req.objective,
            prompt_tokens: req.prompt_len() as u64,
            ..Outcome::default()
        };
        match tokio::time::timeout(self.timeout, self.exchange(req, start, &mut out)).await {
            Ok(()) => {}
            Err(_) => {
                out.error = Some("timeout".into());
                out.error_detail = Some(format!("no end of stream within {:?}", self.timeout));
            }
        }
        out.e2e = start.elapsed();
        out
    }

    async fn exchange(&self, req: &Request, start: Instant, out: &mut Outcome) {
        // The next target in the rotation (the next one at all when none is).
        let n = self.targets.len();
        let mut turn = self.turn.fetch_add(1, Ordering::Relaxed);
        for _ in 1..n {
            if self.rotation.serving(turn % n) {
                break;
            }
            turn = self.turn.fetch_add(1, Ordering::Relaxed);
        }
        let url = &self.targets[turn % n];
        let mut builder = self.http.post(url).json(&self.body(req));
        if let Some(session) = &req.session_id {
            builder = builder.header(SESSION_HEADER, session);
        }
        let objective = req.objective;
        if let Some(ms) = objective.ttft_ms.filter(|_| !objective.hidden) {
            builder = builder.header("x-slo-ttft-ms", ms);
        }
        if objective.priority != 0 && !objective.hidden {
            builder = builder.header("x-priority", objective.priority);
        }
        let resp = match builder.send().await {
            Ok(r) => r,
            Err(e) => {
                out.error = Some(
                    if e.is_connect() {
                        "connect"
                    } else {
                        "transport"
                    }
                    .into(),
                );
                out.error_detail = Some(e.to_string());
                return;
            }
        };
        let status = resp.status();
        out.status = Some(status.as_u16());
        out.worker = resp
            .headers()
            .get(WORKER_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        out.predicted_ttft = resp
            .headers()
            .get(PREDICTED_TTFT_HEADER)
            .and_then(|v| v.to_str().ok()?.parse::<f64>().ok())
            .and_then(|ms| Duration::try_from_secs_f64(ms / 1e3).ok());
        if !status.is_success() {
            out.error = Some(status.as_u16().to_string());
            let body = resp.text().await.unwrap_or_default();
            out.error_detail = Some(body.chars().take(300).collect());
            return;
        }
        let mut stream = resp.bytes_stream();
        let mut parser = SseParser::new();
        let mut state = StreamState::default();
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(bytes) => {
                    let now = Instant::now();
                    for ev in parser.push(&bytes) {
                        state.event(&ev, now.duration_since(start), out);
                    }
                }
                Err(e) => {
                    out.error = Some("transport".into());
                    out.error_detail = Some(format!("stream broke: {e}"));
                    return;
                }
            }
        }
        let end = start.elapsed();
        for ev in parser.finish() {
            state.event(&ev, end, out);
        }
        if out.completion_tokens == 0 {
            out.completion_tokens = state.content_chunks;
        }
        if out.error.is_none() && out.ttft.is_none() {
            out.error = Some("no_tokens".into());
            out.error_detail = Some("stream ended without a content chunk".into());
        }
    }
}

#[derive(Default)]
struct StreamState {
    last_content: Option<Duration>,
    content_chunks: u64,
}

impl StreamState {
    fn event(&mut self, data: &str, at: Duration, out: &mut Outcome) {
        let data = data.trim();
        if data.is_empty() || data == "[DONE]" {
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if out.response_id.is_none() {
            out.response_id = v.get("id").and_then(Value::as_str).map(str::to_string);
        }
        if let Some(err) = v.get("error") {
            out.error = Some("stream_error".into());
            out.error_detail = Some(err.to_string().chars().take(300).collect());
            return;
        }
        if let Some(usage) = v.get("usage").filter(|u| u.is_object()) {
            if let Some(p) = usage.get("prompt_tokens").and_then(Value::as_u64) {
                out.prompt_tokens = p;
            }
            if let Some(c) = usage.get("completion_tokens").and_then(Value::as_u64) {
                out.completion_tokens = c;
            }
            if let Some(c) = usage
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .and_then(Value::as_u64)
            {
                out.cached_tokens = Some(c);
            }
        }
        if is_content_chunk(&v) {
            self.content_chunks += 1;
            match self.last_content {
                None => out.ttft = Some(at),
                Some(prev) => out.itl.push(at.saturating_sub(prev)),
            }
            self.last_content = Some(at);
        }
    }
}

/// A chunk carries generated content when it has a choice with text, or a choice that
/// is not just the closing `finish_reason` marker.
fn is_content_chunk(v: &Value) -> bool {
    let Some(choices) = v.get("choices").and_then(Value::as_array) else {
        return false;
    };
    choices.iter().any(|c| {
        let text_nonempty = c
            .get("text")
            .and_then(Value::as_str)
            .is_some_and(|t| !t.is_empty())
            || c.get("delta")
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str)
                .is_some_and(|t| !t.is_empty());
        let finished = c.get("finish_reason").is_some_and(|f| !f.is_null());
        text_nonempty || !finished
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_chunk_rules() {
        assert!(is_content_chunk(
            &serde_json::json!({"choices":[{"text":"a","finish_reason":null}]})
        ));
        assert!(is_content_chunk(
            &serde_json::json!({"choices":[{"text":"","finish_reason":null}]})
        ));
        assert!(!is_content_chunk(
            &serde_json::json!({"choices":[{"text":"","finish_reason":"length"}]})
        ));
        assert!(!is_content_chunk(
            &serde_json::json!({"choices":[],"usage":{"prompt_tokens":3}})
        ));
    }

    #[test]
    fn usage_and_errors_are_read() {
        let mut st = StreamState::default();
        let mut out = Outcome::default();
        st.event(
            r#"{"choices":[{"text":"x"}]}"#,
            Duration::from_millis(5),
            &mut out,
        );
        st.event(
            r#"{"choices":[{"text":"y"}]}"#,
            Duration::from_millis(8),
            &mut out,
        );
        st.event(
            r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":6}}}"#,
            Duration::from_millis(9),
            &mut out,
        );
        assert_eq!(out.ttft, Some(Duration::from_millis(5)));
        assert_eq!(out.itl, vec![Duration::from_millis(3)]);
        assert_eq!(out.cached_tokens, Some(6));
        assert_eq!(out.prompt_tokens, 10);
        assert!(out.is_ok());
        st.event(
            r#"{"error":{"message":"boom"}}"#,
            Duration::from_millis(10),
            &mut out,
        );
        assert_eq!(out.error.as_deref(), Some("stream_error"));
    }

    #[test]
    fn the_answer_id_is_the_first_events() {
        let mut st = StreamState::default();
        let mut out = Outcome::default();
        st.event(
            r#"{"id":"cmpl-a","choices":[{"text":"x"}]}"#,
            Duration::from_millis(5),
            &mut out,
        );
        st.event(
            r#"{"id":"cmpl-b","choices":[{"text":"y"}]}"#,
            Duration::from_millis(6),
            &mut out,
        );
        assert_eq!(out.response_id.as_deref(), Some("cmpl-a"));
    }

    #[test]
    fn url_and_body() {
        let c = BenchClient::new("http://h:1/", "m", Duration::from_secs(1)).unwrap();
        assert_eq!(c.url(), "http://h:1/v1/completions");
        let req = Request {
            id: 0,
            arrival: Duration::ZERO,
            prompt: vec![1, 2],
            max_tokens: 3,
            session_id: None,
            objective: Default::default(),
        };
        let b = c.body(&req);
        assert_eq!(b["prompt"], serde_json::json!([1, 2]));
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["ignore_eos"], true);
        assert_eq!(b["max_tokens"], 3);
        let t = c.with_prompt_format(PromptFormat::Text).body(&req);
        assert_eq!(t["prompt"], "w1 w2");
    }
}
