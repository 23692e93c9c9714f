//! From request body to a request ready to route: parse the body once (the fields
//! routing needs, and the document when the prompt is tokenized), find the model, tokenize when the policy scores on tokens
//! (locally, or through a worker's `/tokenize`), and hash block keys.
//!
//! Owns request preparation. Must not choose workers (select.rs) or send the request
//! (failover.rs).

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderMap;
use kvgate_core::{BlockKey, Objective};
use kvgate_tokenize::{
    remote_answer, remote_request, Json, RemoteRequest, RequestBody, RequestKind, RoutingTokens,
    TokenizeError,
};
use serde::Deserialize;
use serde_json::Value;

use crate::body::read_bounded;
use crate::errors::ApiError;
use crate::failover::side_call;
use crate::gateway::Gateway;
use crate::objectives::objective_of;
use crate::registry::{Endpoint, ModelState};

/// The request fields routing reads; everything else is skipped while parsing.
/// `messages` and `prompt` are measured ([`PromptSize`]) by a scan of the text, or only
/// looked for in a parsed document, whose prompt is about to be tokenized.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<f64>,
    #[serde(default)]
    max_completion_tokens: Option<f64>,
    /// vLLM's scheduling priority (lower is handled earlier).
    #[serde(default)]
    priority: Option<i64>,
    /// Present in chat requests; only its size is read.
    #[serde(default)]
    messages: Option<PromptSize>,
    /// A completion's prompt; only its size is read.
    #[serde(default)]
    prompt: Option<PromptSize>,
}

impl<'a> Head<'a> {
    /// The fields of a parsed document (each read as the scan reads it: the same values
    /// and errors), its prompt's size unmeasured (0).
    fn of_document(doc: &'a RequestBody<'_>) -> Result<Head<'a>, serde_json::Error> {
        let field = |key: &str| doc.fields().get(key).unwrap_or(&Value::Null);
        let present = |prompt: Option<&Json>| {
            prompt
                .filter(|p| !p.is_null())
                .map(|_| PromptSize::default())
        };
        Ok(Head {
            model: Option::<Cow<str>>::deserialize(field("model"))?,
            stream: Option::deserialize(field("stream"))?,
            max_tokens: Option::deserialize(field("max_tokens"))?,
            max_completion_tokens: Option::deserialize(field("max_completion_tokens"))?,
            priority: Option::deserialize(field("priority"))?,
            messages: present(doc.messages()),
            prompt: present(doc.prompt()),
        })
    }
}

/// An estimate of a prompt's length in tokens without tokenizing it, for policies that
/// route on load alone (they must still know a long prompt from a short one: the
/// ledger books its prefill). Token ids count one each; text counts one token per 4
/// bytes (about right for English with common tokenizers); inside messages, every
/// string value counts (content, tool calls) and keys do not. Read while the body is
/// scanned, without allocating.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptSize(pub u64);

impl<'de> Deserialize<'de> for PromptSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = PromptSize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a prompt")
            }
            fn visit_str<E>(self, v: &str) -> Result<PromptSize, E> {
                Ok(PromptSize((v.len() as u64).div_ceil(4)))
            }
            fn visit_u64<E>(self, _: u64) -> Result<PromptSize, E> {
                Ok(PromptSize(1))
            }
            fn visit_i64<E>(self, _: i64) -> Result<PromptSize, E> {
                Ok(PromptSize(1))
            }
            fn visit_f64<E>(self, _: f64) -> Result<PromptSize, E> {
                Ok(PromptSize(1))
            }
            fn visit_bool<E>(self, _: bool) -> Result<PromptSize, E> {
                Ok(PromptSize(0))
            }
            fn visit_unit<E>(self) -> Result<PromptSize, E> {
                Ok(PromptSize(0))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<PromptSize, A::Error> {
                let mut n = 0u64;
                while let Some(PromptSize(x)) = seq.next_element()? {
                    n = n.saturating_add(x);
                }
                Ok(PromptSize(n))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<PromptSize, A::Error> {
                let mut n = 0u64;
                while let Some((_, PromptSize(x))) =
                    map.next_entry::<serde::de::IgnoredAny, PromptSize>()?
                {
                    n = n.saturating_add(x);
                }
                Ok(PromptSize(n))
            }
        }
        d.deserialize_any(Visit)
    }
}

/// A request ready to be routed.
#[derive(Clone)]
pub struct Prepared {
    pub model: Arc<ModelState>,
    pub lora: Option<Arc<str>>,
    pub stream: bool,
    pub max_tokens: Option<u32>,
    /// Block keys (`Some(empty)` when the body has nothing to route on).
    pub keys: Option<Vec<BlockKey>>,
    pub prompt_tokens: u32,
    /// `prompt_tokens` is [`PromptSize`]'s estimate (the policy reads no tokens).
    pub prompt_tokens_estimated: bool,
    /// Token ids, when tokenized and asked for (`/tokenize`).
    pub token_ids: Option<Vec<u32>>,
    /// The prompt's KV cache arrives from a prefill worker (a disaggregated request's
    /// decode leg): its booking counts no prefill work.
    pub kv_transferred: bool,
    /// Its latency objectives and priority (`crate::objectives`).
    pub objective: Objective,
    /// Where preparing it took its time (`/v1/route/explain` answers it as
    /// `Server-Timing`).
    pub took: PrepareTimes,
}

/// The stages of [`prepare`], timed.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrepareTimes {
    /// Parsing the body (the routing fields, and the document when it is tokenized).
    pub parse: Duration,
    /// Tokenizing it (template and encoding, local or remote).
    pub tokenize: Duration,
    /// Hashing the tokens into block keys.
    pub hash: Duration,
}

fn to_u32(v: Option<f64>) -> Option<u32> {
    v.filter(|x| x.is_finite() && *x >= 0.0)
        .map(|x| x.min(f64::from(u32::MAX)) as u32)
}

/// What a prepared request needs its tokens for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenUse {
    /// Routing: tokenize only when the model's policy scores on tokens.
    ForPolicy,
    /// `/tokenize`: always tokenize, and keep the ids in [`Prepared::token_ids`].
    ReturnIds,
}

/// Reads the routing fields, resolves the model, and tokenizes when `tokens` asks for
/// it. The body is parsed once: into a document at once when every model will
/// tokenize it (the common fleet: one policy), otherwise by a borrowed scan of the
/// routing fields first and into a document only when this request's model tokenizes.
/// `kind` is the endpoint's request kind; `None` detects it (`messages` present means
/// chat). With [`TokenUse::ReturnIds`] and no local tokenizer nothing is tokenized: the
/// caller forwards `/tokenize` to a worker.
pub async fn prepare(
    gw: &Gateway,
    kind: Option<RequestKind>,
    headers: &HeaderMap,
    body: &[u8],
    tokens: TokenUse,
) -> Result<Prepared, ApiError> {
    // Parsing and tokenizing a large body costs several times its size in memory.
    let _large_body = gw.limiter.acquire_large_body(body.len()).await?;
    let parsing = Instant::now();
    let needs_tokens = |m: &ModelState| match tokens {
        TokenUse::ForPolicy => m.uses_tokens(),
        TokenUse::ReturnIds => m.tokenizer.is_some(),
    };
    let document: Option<RequestBody<'_>> = if gw.models().all(|m| needs_tokens(m)) {
        Some(RequestBody::parse(body).map_err(ApiError::malformed_json)?)
    } else {
        None
    };
    let head: Head<'_> = match &document {
        Some(doc) => Head::of_document(doc),
        None => serde_json::from_slice(body),
    }
    .map_err(ApiError::malformed_json)?;
    let kind = kind.unwrap_or(if head.messages.is_some() {
        RequestKind::Chat
    } else {
        RequestKind::Completion
    });
    let (model, lora) = gw.resolve(head.model.as_deref())?;
    let (model, lora) = (model.clone(), lora.cloned());
    let mut p = Prepared {
        stream: head.stream.unwrap_or(false),
        max_tokens: to_u32(head.max_completion_tokens).or(to_u32(head.max_tokens)),
        keys: None,
        prompt_tokens: 0,
        prompt_tokens_estimated: false,
        token_ids: None,
        kv_transferred: false,
        took: PrepareTimes::default(),
        objective: objective_of(&model.config, headers, head.priority)?,
        model,
        lora,
    };
    if !needs_tokens(&p.model) {
        // Load-only routing still books the prompt's prefill: estimate its length.
        let size = head.messages.or(head.prompt).unwrap_or_default();
        p.prompt_tokens = u32::try_from(size.0).unwrap_or(u32::MAX);
        p.prompt_tokens_estimated = true;
        p.took.parse = parsing.elapsed();
        return Ok(p);
    }
    let value = match document {
        Some(doc) => doc,
        None => RequestBody::parse(body).map_err(ApiError::malformed_json)?,
    };
    let value = &value;
    let tokenizing = Instant::now();
    p.took.parse = tokenizing - parsing;
    let routing = tokenize(gw, &p.model, kind, value).await?;
    let hashing = Instant::now();
    p.took.tokenize = hashing - tokenizing;
    match routing {
        RoutingTokens::Tokens { ids, .. } => {
            p.keys = Some(p.model.selection.block_keys(&ids, p.lora.as_deref()));
            p.took.hash = hashing.elapsed();
            p.prompt_tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
            if tokens == TokenUse::ReturnIds {
                p.token_ids = Some(ids);
            }
        }
        RoutingTokens::NoRoutingTokens { reason } => {
            tracing::debug!(model = %p.model.name, reason, "request has no routing tokens; routing on load only");
            p.keys = Some(Vec::new());
        }
    }
    Ok(p)
}

async fn tokenize(
    gw: &Gateway,
    model: &ModelState,
    kind: RequestKind,
    value: &RequestBody<'_>,
) -> Result<RoutingTokens, ApiError> {
    let start = Instant::now();
    let result = if let Some(t) = &model.tokenizer {
        t.tokenize(kind, value).await.map_err(tokenize_error)
    } else if model.config.remote_tokenize {
        tokenize_remotely(gw, model, kind, value).await
    } else {
        return Ok(RoutingTokens::NoRoutingTokens {
            reason: "no tokenizer configured",
        });
    };
    gw.metrics
        .tokenize_seconds
        .with_label_values(&[&*model.name])
        .observe(start.elapsed().as_secs_f64());
    result
}

fn tokenize_error(e: TokenizeError) -> ApiError {
    match e {
        TokenizeError::Invalid(msg) => ApiError::untokenizable(msg),
        TokenizeError::TooLong { limit } => ApiError::context_length_exceeded(limit),
        TokenizeError::Unavailable(msg) => ApiError::tokenizer_unavailable(msg),
    }
}

/// Remote tokenization through the gateway's worker client ([`side_call`]: failover
/// and breaker accounting as for any call to a worker); kvgate-tokenize supplies the
/// `/tokenize` protocol.
async fn tokenize_remotely(
    gw: &Gateway,
    model: &ModelState,
    kind: RequestKind,
    value: &RequestBody<'_>,
) -> Result<RoutingTokens, ApiError> {
    let (payload, non_text_parts) = match remote_request(kind, value).map_err(tokenize_error)? {
        RemoteRequest::Answered(tokens) => return Ok(tokens),
        RemoteRequest::Post {
            payload,
            non_text_parts,
        } => (payload, non_text_parts),
    };
    let body = serde_json::to_vec(&payload)
        .map_err(|e| ApiError::internal(format!("cannot encode a /tokenize request: {e}")))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    let (worker, resp) = side_call(gw, model, Endpoint::Tokenize, &headers, body.into())
        .await
        .map_err(|e| ApiError::tokenizer_unavailable(e.message))?;
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let bytes = read_bounded(
        &mut body,
        REMOTE_TOKENIZE_MAX_BYTES,
        Some(REMOTE_TOKENIZE_READ_TIMEOUT),
    )
    .await
    .map_err(|e| ApiError::tokenizer_unavailable(format!("{}: {e}", worker.url)))?;
    remote_answer(&worker.url, status, &bytes, non_text_parts).map_err(tokenize_error)
}

/// Largest `/tokenize` answer read (ids of a prompt at any context length fit).
const REMOTE_TOKENIZE_MAX_BYTES: usize = 64 << 20;
/// How long the body of a `/tokenize` answer may take once its head arrived.
const REMOTE_TOKENIZE_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
