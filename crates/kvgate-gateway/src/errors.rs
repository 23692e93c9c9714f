//! OpenAI-style error responses: `{"error":{"message","type","code"}}` with the right
//! HTTP status (and `Retry-After` where waiting helps).
//!
//! Owns the mapping from gateway failure kinds to status codes and bodies. It must not
//! decide *when* a request fails; routing, limits and proxying do that.

use axum::response::{IntoResponse, Response};
use http::{header, HeaderValue, StatusCode};
use serde::Serialize;

/// A failure the gateway reports to its client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI `type`, e.g. `invalid_request_error`.
    pub kind: &'static str,
    /// Machine-readable code, e.g. `model_not_found`.
    pub code: &'static str,
    /// Seconds a client should wait before retrying (sent as `Retry-After`).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code,
            retry_after: None,
        }
    }

    pub fn with_retry_after(mut self, secs: u64) -> Self {
        self.retry_after = Some(secs.max(1));
        self
    }

    /// 400: the body is not valid JSON or not a JSON object.
    pub fn malformed_json(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_json",
            format!("request body is not valid JSON: {detail}"),
        )
    }

    /// 400: a request the router cannot accept.
    pub fn bad_request(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            code,
            message,
        )
    }

    /// 413: the body is larger than `limits.max_body_bytes`.
    pub fn body_too_large(max: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            format!("request body exceeds the limit of {max} bytes"),
        )
    }

    /// 415: the body is declared as something other than JSON.
    pub fn unsupported_media_type(content_type: &str) -> Self {
        Self::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            "unsupported_media_type",
            format!(
                "Content-Type {content_type:?} is not accepted: send the body as application/json"
            ),
        )
    }

    /// 404: the requested model is not served by this gateway.
    pub fn unknown_model(model: &str, known: &[&str]) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!(
                "the model {model:?} does not exist on this gateway (served: {})",
                known.join(", ")
            ),
        )
    }

    /// 503: no healthy worker can take the request.
    pub fn no_healthy_worker(model: &str, retry_after: u64) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "no_healthy_worker",
            format!("no healthy worker is available for model {model:?}"),
        )
        .with_retry_after(retry_after)
    }

    /// 429: limits and wait queue are full.
    pub fn overloaded(message: impl Into<String>, retry_after: u64) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "overloaded",
            message,
        )
        .with_retry_after(retry_after)
    }

    /// 429: a sheddable request that no worker is predicted to serve within its
    /// latency objective (the closest `late` after it); retry after about that long.
    pub fn shed(model: &str, late: std::time::Duration) -> Self {
        Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "objective_unmet",
            format!(
                "no worker of model {model:?} is predicted to meet this request's latency objective \
                 (the closest by {} ms) and its priority is below 0 (sheddable); retry later",
                late.as_millis()
            ),
        )
        .with_retry_after(late.as_secs_f64().ceil().max(1.0) as u64)
    }

    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid_api_key",
            message,
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message,
        )
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal_error",
            "internal_error",
            message,
        )
    }

    /// 405: a known path with another method.
    pub fn method_not_allowed(method: &http::Method, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method_not_allowed",
            format!("{method} is not allowed on {path}"),
        )
    }

    /// 409: the admin API cannot add this worker (e.g. it is already registered).
    pub fn worker_conflict(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "invalid_worker",
            detail.to_string(),
        )
    }

    /// 400: the prompt is longer than the model's context.
    pub fn context_length_exceeded(limit: u32) -> Self {
        Self::bad_request(
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {limit} tokens. However, your prompt is longer; shorten it"
            ),
        )
    }

    /// 400: the request cannot be tokenized (its shape, or the chat template refused it).
    pub fn untokenizable(detail: impl std::fmt::Display) -> Self {
        Self::bad_request(
            "invalid_prompt",
            format!("the request cannot be tokenized: {detail}"),
        )
    }

    /// 503: the tokenizer (a worker's `/tokenize`) could not be reached.
    pub fn tokenizer_unavailable(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "tokenizer_unavailable",
            format!("cannot tokenize the request for routing: {detail}"),
        )
        .with_retry_after(1)
    }

    /// 503: kv_aware routing without any KV event source, and no fallback.
    pub fn kv_events_not_configured(model: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "kv_events_not_configured",
            format!(
                "model {model:?} uses kv_aware routing but no worker has a KV event source: start the gateway with --kv-events WORKER_URL=tcp://HOST:PORT for its workers (and run the engines with KV events on: vLLM and SGLang --kv-events-config, kvgate mock-engine --kv-events-port and --replay-port), or pass --kv-fallback POLICY to route without the index"
            ),
        )
    }

    /// 502: the worker answered an error status (and every retry did too).
    pub fn upstream_status(worker: &str, status: StatusCode) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_error",
            format!("worker {worker} answered {status}"),
        )
    }

    /// 502: no connection to the worker, or it broke before the response head.
    pub fn upstream_unreachable(worker: &str, detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_unreachable",
            format!("worker {worker} failed: {detail}"),
        )
    }

    /// 504: the worker sent no response head within the first-byte timeout.
    pub fn upstream_first_byte_timeout(worker: &str) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "upstream_timeout",
            format!("worker {worker} sent no response within the first-byte timeout"),
        )
    }

    /// 502: the worker was declared dead (health checks) or stalled while the request
    /// was on it.
    pub fn worker_gone(worker: &str) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "worker_down",
            format!(
                "worker {worker} was taken out of rotation (its engine died or stalled) while serving this request"
            ),
        )
    }

    /// 502: a disaggregated request's prefill leg answered but its answer cannot be
    /// handed to a decode worker (no `kv_transfer_params`, unreadable body).
    pub fn prefill_handover_failed(worker: &str, detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "prefill_handover_failed",
            format!("prefill worker {worker}: {detail}"),
        )
    }

    /// 503: the gateway's shutdown grace period ended before the response did.
    pub fn gateway_shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "gateway_shutting_down",
            "the gateway shut down before this response finished; retry on another gateway replica",
        )
        .with_retry_after(1)
    }

    /// 502: the worker closed the connection while the request body was being sent.
    pub fn upstream_refused_body(worker: &str) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_refused_body",
            format!(
                "worker {worker} closed the connection while the request body was being sent (often a body size limit in front of the engine); the request was not retried"
            ),
        )
    }

    /// The engine's own error answer that is not JSON (a proxy's or web server's text
    /// page), as OpenAI-style JSON with the engine's status.
    pub fn engine_error_text(status: StatusCode, worker: &str, text: &str) -> Self {
        let (kind, code) = if status.is_client_error() {
            ("invalid_request_error", "engine_rejected_request")
        } else {
            ("upstream_error", "upstream_error")
        };
        let text = text.trim();
        Self::new(
            status,
            kind,
            code,
            format!("worker {worker} answered {status}: {text}"),
        )
    }

    /// 504: the worker stopped sending within the total request timeout.
    pub fn upstream_total_timeout() -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "upstream_error",
            "upstream_timeout",
            "the request exceeded the gateway's total upstream timeout",
        )
    }

    /// 502: the worker's stream broke after its first byte.
    pub fn upstream_broken(detail: impl std::fmt::Display) -> Self {
        Self::new(
            StatusCode::BAD_GATEWAY,
            "upstream_error",
            "upstream_stream_broken",
            format!("the worker's response broke off: {detail}"),
        )
    }

    /// The error as one server-sent event (`data: {"error":{...}}` and a blank line),
    /// the last thing a streaming client receives when its stream cannot finish.
    pub fn sse_event(&self) -> bytes::Bytes {
        let mut out = b"data: ".to_vec();
        out.extend_from_slice(&self.json_body());
        out.extend_from_slice(b"\n\n");
        out.into()
    }

    /// The OpenAI-style JSON body: `{"error":{"message","type","code"}}`.
    pub fn json_body(&self) -> Vec<u8> {
        let body = Body {
            error: Inner {
                message: &self.message,
                kind: self.kind,
                code: self.code,
            },
        };
        serde_json::to_vec(&body).unwrap_or_else(|_| b"{}".to_vec())
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}): {}", self.status, self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

#[derive(Serialize)]
struct Body<'a> {
    error: Inner<'a>,
}

#[derive(Serialize)]
struct Inner<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    code: &'a str,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let bytes = self.json_body();
        let mut resp = (self.status, bytes).into_response();
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(secs) = self.retry_after {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn body_is_openai_shaped_with_retry_after() {
        let resp = ApiError::overloaded("busy", 0).into_response();
        assert_eq!(resp.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "overloaded");
        assert_eq!(v["error"]["type"], "rate_limit_error");
        assert_eq!(v["error"]["message"], "busy");
    }
}
