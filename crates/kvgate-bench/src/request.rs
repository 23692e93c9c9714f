//! The unit of load: one completion request with its arrival time and token ids.
//!
//! Owns only the `Request` value shared by traces, synthetic workloads and the runner.
//! It must not know how requests are produced or sent.

use std::time::Duration;

/// One request to replay: sent as an OpenAI `/v1/completions` body whose `prompt`
/// is a single list of token ids, so no tokenizer is needed on either side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Position of the request in the replay (0-based, unique within a run).
    pub id: u64,
    /// Offset from the start of the replay at which the request is sent (before speedup).
    pub arrival: Duration,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// `max_tokens` for the request (sent with `ignore_eos` so the engine produces exactly this many).
    pub max_tokens: u32,
    /// Optional session id, sent as the `x-session-id` header (for the session policy).
    pub session_id: Option<String>,
    /// Its latency objective and priority, sent as `x-slo-ttft-ms` and `x-priority`.
    pub objective: RequestObjective,
}

/// A request's latency objective and priority (the default: none, priority 0).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestObjective {
    /// Time to first token it should get, ms.
    pub ttft_ms: Option<u32>,
    /// Below 0: sheddable (a router may refuse it at once with 429 when it predicts the
    /// objective cannot be met).
    pub priority: i32,
    /// Scored against, but not sent: what a router that ignores objectives sees.
    pub hidden: bool,
}

impl RequestObjective {
    /// Whether a request with this objective that got its first token after `ttft`
    /// met it (`None` without an objective).
    pub fn met(&self, ttft: Duration) -> Option<bool> {
        self.ttft_ms
            .map(|ms| ttft <= Duration::from_millis(u64::from(ms)))
    }
}

impl Request {
    /// Number of prompt tokens.
    pub fn prompt_len(&self) -> usize {
        self.prompt.len()
    }
}

/// Totals of a request list, for logging what is about to be replayed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestSetSummary {
    /// Number of requests.
    pub requests: usize,
    /// Sum of prompt tokens.
    pub prompt_tokens: u64,
    /// Sum of `max_tokens`.
    pub output_tokens: u64,
    /// Arrival offset of the last request.
    pub span: Duration,
}

/// Summarise a request list.
pub fn summarize(requests: &[Request]) -> RequestSetSummary {
    RequestSetSummary {
        requests: requests.len(),
        prompt_tokens: requests.iter().map(|r| r.prompt.len() as u64).sum(),
        output_tokens: requests.iter().map(|r| u64::from(r.max_tokens)).sum(),
        span: requests.iter().map(|r| r.arrival).max().unwrap_or_default(),
    }
}
