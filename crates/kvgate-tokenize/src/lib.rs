//! Pre-routing tokenization for kvgate: turn an OpenAI request body into the exact
//! token ids the engine will prefill, so KV-aware routing can score replicas.
//!
//! This file owns the public interface shared by both implementations ([`Tokenizer`],
//! [`RequestKind`], [`RoutingTokens`], [`TokenizeError`]). The local implementation
//! (HF `tokenizer.json` + chat template) lives in [`local`], the remote one (an engine's
//! `POST /tokenize`) in [`remote`]. It must not contain routing, HTTP serving or
//! metrics-registry code: the gateway owns those and maps [`TokenizeError`] to HTTP.
//!
//! Semantics follow vLLM 0.32's `/tokenize` and generation path: chat requests render
//! the model's chat template (`add_generation_prompt` default true,
//! `continue_final_message` default false, `add_special_tokens` default false);
//! completions encode a single string prompt (`add_special_tokens` default true) or
//! use a single list of token ids as is. Bodies the router cannot route on (several
//! prompts, no prompt and no messages) yield [`RoutingTokens::NoRoutingTokens`].

mod body;
pub mod cli;
mod fast;
pub mod local;
mod pyjson;
pub mod remote;
mod request;
pub mod segments;
mod template;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub use body::{Json, RequestBody};
pub use local::LocalTokenizer;
pub use remote::{remote_answer, remote_request, RemoteRequest, RemoteTokenizer};
pub use segments::SegmentCacheStats;

/// Which OpenAI endpoint a body was sent to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// `/v1/chat/completions`: a `messages` array rendered with the chat template.
    Chat,
    /// `/v1/completions`: a `prompt` (string or token ids).
    Completion,
}

impl RequestKind {
    /// Guess the kind from the body alone: `messages` present means chat.
    /// Used by `kvgate tokenize`; the gateway knows the endpoint and should not need it.
    pub fn detect(body: &RequestBody<'_>) -> RequestKind {
        if body.messages().is_some() {
            RequestKind::Chat
        } else {
            RequestKind::Completion
        }
    }
}

/// What the router can route on for one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RoutingTokens {
    /// The token ids the engine will prefill.
    Tokens {
        /// Prompt token ids, exactly as the engine computes them (text parts only).
        ids: Vec<u32>,
        /// Non-text content parts (images, audio, video, embeddings) that were skipped:
        /// `ids` covers the text only, so a non-zero value means the engine's prompt is
        /// longer than `ids` (placeholders expanded by its multimodal processor).
        non_text_parts: usize,
    },
    /// The body is valid but has no single prompt to route on (e.g. a list of several
    /// prompts, or neither `prompt` nor `messages`): route without tokens.
    NoRoutingTokens {
        /// Short, static explanation (for logs and metrics labels).
        reason: &'static str,
    },
}

/// Why a body could not be tokenized.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TokenizeError {
    /// The request itself is bad (shape, template rejection, engine 4xx). The gateway
    /// answers HTTP 400 with this message in an OpenAI-style error body.
    #[error("{0}")]
    Invalid(String),
    /// The tokenizer could not be reached or failed on its side (transport error,
    /// timeout, engine 5xx). Retryable; not the client's fault.
    #[error("tokenizer unavailable: {0}")]
    Unavailable(String),
    /// The prompt is longer than the model's context (`limit` tokens); found before or
    /// while encoding, without encoding the rest. The gateway answers HTTP 400.
    #[error("the prompt has more than {limit} tokens, the model's context length")]
    TooLong { limit: u32 },
}

static NON_TEXT_PARTS_SKIPPED: AtomicU64 = AtomicU64::new(0);

/// Total number of non-text content parts (images, audio, ...) skipped by this process
/// while tokenizing for routing. Monotonic; the gateway can export it as a counter.
pub fn non_text_parts_skipped_total() -> u64 {
    NON_TEXT_PARTS_SKIPPED.load(Ordering::Relaxed)
}

pub(crate) fn count_non_text_parts(n: usize) {
    if n > 0 {
        NON_TEXT_PARTS_SKIPPED.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// One tokenization interface with two implementations. Cheap to clone.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    /// In-process HF tokenizer and chat template.
    Local(Arc<LocalTokenizer>),
    /// An engine replica's `POST /tokenize`.
    Remote(RemoteTokenizer),
}

impl Tokenizer {
    /// Tokenize one OpenAI request body for routing.
    ///
    /// Local work above a size threshold runs on tokio's blocking pool so long prompts
    /// do not stall the async workers; small requests are tokenized inline.
    pub async fn tokenize(
        &self,
        kind: RequestKind,
        body: &RequestBody<'_>,
    ) -> Result<RoutingTokens, TokenizeError> {
        match self {
            Tokenizer::Local(local) => local::tokenize_async(local, kind, body).await,
            Tokenizer::Remote(remote) => remote.tokenize(kind, body).await,
        }
    }
}
