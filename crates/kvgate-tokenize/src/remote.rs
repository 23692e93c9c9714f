//! Remote tokenization: POST the request to an engine replica's `/tokenize` (vLLM
//! schema) and route on the ids it returns.
//!
//! Owns the protocol, without transport ([`remote_request`], [`remote_answer`]: the
//! gateway sends it through its own worker client), and a standalone client on top of
//! it ([`RemoteTokenizer`], for `kvgate tokenize --remote`): the request body sent
//! (vLLM's `TokenizeChatRequest` / `TokenizeCompletionRequest` fields), and the mapping
//! of engine answers onto [`TokenizeError`]: a rejection of the request (400/413/422) is `Invalid` with the
//! engine's message; timeouts, transport failures, 5xx and other statuses (404 when the
//! engine has no `/tokenize`, 401/403, 429) are `Unavailable`. Shapes that need no
//! engine (token-id prompts, several prompts, no prompt) are answered locally, with the
//! same rules as the local tokenizer. Must not render templates or pick replicas.

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::request::{self, ChatOptions, Shape};
use crate::{count_non_text_parts, RequestBody, RequestKind, RoutingTokens, TokenizeError};

/// Chat fields of vLLM's `TokenizeChatRequest` forwarded to the engine.
const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
    "mm_processor_kwargs",
    "media_io_kwargs",
];

/// Longest engine error text carried into an error message.
const MAX_ERROR_CHARS: usize = 1024;

/// A client for one engine's `POST {base}/tokenize`. Cheap to clone.
#[derive(Clone, Debug)]
pub struct RemoteTokenizer {
    client: reqwest::Client,
    url: String,
    bearer_token: Option<String>,
}

#[derive(Deserialize)]
struct TokenizeResponse {
    tokens: Vec<u32>,
}

impl RemoteTokenizer {
    /// `base_url` is the engine's root (e.g. `http://10.0.0.5:8000`); a trailing `/`
    /// is ignored. `timeout` bounds the whole exchange.
    pub fn new(base_url: &str, timeout: Duration) -> anyhow::Result<RemoteTokenizer> {
        let base = base_url.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            anyhow::bail!("remote tokenizer URL must start with http:// or https://: {base_url:?}");
        }
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .build()?;
        Ok(RemoteTokenizer {
            client,
            url: format!("{base}/tokenize"),
            bearer_token: None,
        })
    }

    /// Send `Authorization: Bearer <token>` (engines started with `--api-key`).
    pub fn with_bearer_token(mut self, token: impl Into<String>) -> RemoteTokenizer {
        self.bearer_token = Some(token.into());
        self
    }

    /// The full `/tokenize` URL this client posts to.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Tokenize one OpenAI body via the engine.
    pub async fn tokenize(
        &self,
        kind: RequestKind,
        body: &RequestBody<'_>,
    ) -> Result<RoutingTokens, TokenizeError> {
        let (payload, non_text_parts) = match remote_request(kind, body)? {
            RemoteRequest::Answered(tokens) => return Ok(tokens),
            RemoteRequest::Post {
                payload,
                non_text_parts,
            } => (payload, non_text_parts),
        };
        let mut req = self.client.post(&self.url).json(&payload);
        if let Some(token) = &self.bearer_token {
            req = req.bearer_auth(token);
        }
        let resp = req
            .send()
            .await
            .map_err(|e| transport_error(&self.url, &e))?;
        let status = resp.status().as_u16();
        let bytes = resp
            .bytes()
            .await
            .map_err(|e| transport_error(&self.url, &e))?;
        remote_answer(&self.url, status, &bytes, non_text_parts)
    }
}

/// What tokenizing a body remotely takes: nothing (the body's shape answers it), or a
/// `POST /tokenize` with this payload.
#[derive(Debug)]
pub enum RemoteRequest {
    Answered(RoutingTokens),
    Post {
        /// vLLM's `TokenizeChatRequest` / `TokenizeCompletionRequest`.
        payload: Value,
        /// Non-text content parts skipped (images, audio), for the answer.
        non_text_parts: usize,
    },
}

/// The `/tokenize` request for one OpenAI body (or its answer, when the body's shape
/// needs no engine). The protocol half of remote tokenization, without transport: the
/// gateway sends it through its own worker client.
pub fn remote_request(
    kind: RequestKind,
    body: &RequestBody<'_>,
) -> Result<RemoteRequest, TokenizeError> {
    match request::classify(kind, body)? {
        Shape::NoTokens(reason) => Ok(RemoteRequest::Answered(RoutingTokens::NoRoutingTokens {
            reason,
        })),
        Shape::Ids(ids) => Ok(RemoteRequest::Answered(RoutingTokens::Tokens {
            ids,
            non_text_parts: 0,
        })),
        Shape::Text {
            prompt,
            add_special_tokens,
        } => {
            let mut p = Map::new();
            if let Some(model) = body.fields().get("model") {
                p.insert("model".into(), model.clone());
            }
            p.insert("prompt".into(), Value::String(prompt.to_owned()));
            p.insert("add_special_tokens".into(), Value::Bool(add_special_tokens));
            Ok(RemoteRequest::Post {
                payload: Value::Object(p),
                non_text_parts: 0,
            })
        }
        Shape::Chat(body) => {
            // Same validation as local mode, so both modes reject the same bodies.
            ChatOptions::parse(body.fields())?;
            let non_text = request::count_non_text(body)?;
            count_non_text_parts(non_text);
            let p: Map<String, Value> = CHAT_FIELDS
                .iter()
                .filter_map(|k| body.value_of(k).map(|v| ((*k).to_owned(), v)))
                .collect();
            Ok(RemoteRequest::Post {
                payload: Value::Object(p),
                non_text_parts: non_text,
            })
        }
    }
}

/// The engine's answer to a `/tokenize` request (`source` names it in errors): the
/// ids on success; the engine's message as `Invalid` when it rejected the request
/// (400/413/422); `Unavailable` for any other status or a malformed answer.
pub fn remote_answer(
    source: &str,
    status: u16,
    body: &[u8],
    non_text_parts: usize,
) -> Result<RoutingTokens, TokenizeError> {
    if (200..300).contains(&status) {
        let parsed: TokenizeResponse = serde_json::from_slice(body).map_err(|e| {
            TokenizeError::Unavailable(format!("{source}: malformed /tokenize response: {e}"))
        })?;
        return Ok(RoutingTokens::Tokens {
            ids: parsed.tokens,
            non_text_parts,
        });
    }
    let message = error_message(body);
    match status {
        400 | 413 | 422 => Err(TokenizeError::Invalid(message)),
        code => Err(TokenizeError::Unavailable(format!(
            "{source} answered HTTP {code}: {message}"
        ))),
    }
}

fn transport_error(url: &str, e: &reqwest::Error) -> TokenizeError {
    let what = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    TokenizeError::Unavailable(format!("{url}: {what}: {e}"))
}

/// The human message of an engine error body: vLLM's `{"error": {"message": ...}}`,
/// older vLLM's flat `{"message": ...}`, FastAPI's `{"detail": ...}`, or the raw text.
fn error_message(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let from_json = serde_json::from_slice::<Value>(bytes).ok().and_then(|v| {
        let msg = v
            .pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))?;
        Some(match msg {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    });
    let mut msg = from_json.unwrap_or_else(|| text.trim().to_owned());
    if msg.is_empty() {
        msg = "empty error body".into();
    }
    if msg.chars().count() > MAX_ERROR_CHARS {
        msg = msg.chars().take(MAX_ERROR_CHARS).collect::<String>() + "…";
    }
    msg
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies() {
        assert_eq!(
            error_message(
                br#"{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}"#
            ),
            "bad"
        );
        assert_eq!(
            error_message(br#"{"object":"error","message":"old","code":400}"#),
            "old"
        );
        assert_eq!(error_message(b"plain text\n"), "plain text");
        assert_eq!(error_message(b""), "empty error body");
    }

    #[test]
    fn rejects_non_http_urls() {
        assert!(RemoteTokenizer::new("localhost:8000", Duration::from_secs(1)).is_err());
        let r = RemoteTokenizer::new("http://127.0.0.1:1/", Duration::from_secs(1)).unwrap();
        assert_eq!(r.url(), "http://127.0.0.1:1/tokenize");
    }
}
