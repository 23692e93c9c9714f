//! OpenAI/vLLM JSON shapes: request parameters the engine honours, response bodies,
//! streaming chunks and error bodies.
//!
//! Owns the JSON vocabulary only (pure functions over `serde_json::Value`); HTTP
//! plumbing lives in `server`, tokenization in `tokenizer`.

use serde_json::{json, Value};

use crate::scheduler::FinishReason;
use crate::tokenizer::PromptKind;

/// An OpenAI-style error body: `{"error": {"message", "type", "code"}}`.
pub fn error_body(message: &str, kind: &str, code: u16) -> Value {
    json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}

/// The generation parameters of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenParams {
    pub max_tokens: u32,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub model: Option<String>,
}

/// Read and validate generation parameters (`Err` = message for a 400).
pub fn gen_params(
    kind: PromptKind,
    body: &Value,
    default_max_tokens: u32,
) -> Result<GenParams, String> {
    if !body.is_object() {
        return Err("the request body must be a JSON object".into());
    }
    let uint = |key: &str| -> Result<Option<u32>, String> {
        match body.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| format!("`{key}` must be a non-negative integer")),
        }
    };
    let boolean = |key: &str| -> Result<bool, String> {
        match body.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(_) => Err(format!("`{key}` must be a boolean")),
        }
    };
    let max_tokens = match kind {
        PromptKind::Chat => uint("max_completion_tokens")?.or(uint("max_tokens")?),
        PromptKind::Completion => uint("max_tokens")?,
    }
    .unwrap_or(default_max_tokens);
    if max_tokens == 0 {
        return Err("`max_tokens` must be at least 1".into());
    }
    if let Some(n) = uint("n")? {
        if n != 1 {
            return Err("this engine supports only n = 1".into());
        }
    }
    let stream = boolean("stream")?;
    let include_usage = body
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let model = body.get("model").and_then(Value::as_str).map(str::to_owned);
    Ok(GenParams {
        max_tokens,
        ignore_eos: boolean("ignore_eos")?,
        stream,
        include_usage,
        model,
    })
}

/// The `usage` object, with the real prefix hit in `prompt_tokens_details`.
pub fn usage(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// Identity of one response (shared by all its chunks).
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    pub kind: PromptKind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl ResponseMeta {
    fn chunk_object(&self) -> &'static str {
        match self.kind {
            PromptKind::Chat => "chat.completion.chunk",
            PromptKind::Completion => "text_completion",
        }
    }

    fn chunk(&self, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.chunk_object(),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// The first chat chunk (role only), sent with the first token like vLLM.
    pub fn role_chunk(&self) -> Value {
        self.chunk(json!([{
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": null,
            "finish_reason": null,
        }]))
    }

    /// One token's chunk; the last one carries the finish reason.
    pub fn token_chunk(&self, text: &str, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(FinishReason::as_str);
        let choice = match self.kind {
            PromptKind::Chat => json!({
                "index": 0,
                "delta": {"content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
            PromptKind::Completion => json!({
                "index": 0,
                "text": text,
                "logprobs": null,
                "finish_reason": finish,
            }),
        };
        self.chunk(json!([choice]))
    }

    /// The final usage chunk (`stream_options.include_usage`).
    pub fn usage_chunk(&self, usage: Value) -> Value {
        let mut c = self.chunk(json!([]));
        c["usage"] = usage;
        c
    }

    /// A complete, non-streaming response.
    pub fn full_response(&self, text: &str, finish: FinishReason, usage: Value) -> Value {
        let (object, choice) = match self.kind {
            PromptKind::Chat => (
                "chat.completion",
                json!({
                    "index": 0,
                    "message": {"role": "assistant", "content": text, "tool_calls": []},
                    "logprobs": null,
                    "finish_reason": finish.as_str(),
                }),
            ),
            PromptKind::Completion => (
                "text_completion",
                json!({
                    "index": 0,
                    "text": text,
                    "logprobs": null,
                    "finish_reason": finish.as_str(),
                }),
            ),
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        })
    }
}

/// One SSE event in vLLM's framing: `data: {json}\n\n`.
pub fn sse_data(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The stream terminator.
pub const SSE_DONE: &str = "data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_defaults_and_validation() {
        let p = gen_params(PromptKind::Completion, &json!({"prompt": "x"}), 16).unwrap();
        assert_eq!(p.max_tokens, 16);
        assert!(!p.stream);
        let p = gen_params(
            PromptKind::Chat,
            &json!({"max_completion_tokens": 3, "max_tokens": 9, "stream": true,
                    "stream_options": {"include_usage": true}, "ignore_eos": true}),
            16,
        )
        .unwrap();
        assert_eq!(
            (p.max_tokens, p.stream, p.include_usage, p.ignore_eos),
            (3, true, true, true)
        );
        assert!(gen_params(PromptKind::Chat, &json!({"max_tokens": -1}), 16).is_err());
        assert!(gen_params(PromptKind::Chat, &json!({"n": 2}), 16).is_err());
        assert!(gen_params(PromptKind::Chat, &json!([]), 16).is_err());
    }

    #[test]
    fn chunk_shapes() {
        let m = ResponseMeta {
            kind: PromptKind::Chat,
            id: "chatcmpl-1".into(),
            created: 5,
            model: "m".into(),
        };
        let c = m.token_chunk("hi ", Some(FinishReason::Length));
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["choices"][0]["delta"]["content"], "hi ");
        assert_eq!(c["choices"][0]["finish_reason"], "length");
        assert!(sse_data(&c).starts_with("data: {"));
        assert!(sse_data(&c).ends_with("}\n\n"));
        let u = m.usage_chunk(usage(10, 2, 8));
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
    }
}
