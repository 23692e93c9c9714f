//! Local tokenization: a model's HF `tokenizer.json` and chat template, in process.
//!
//! Owns loading a tokenizer directory (`tokenizer.json`, `tokenizer_config.json`,
//! optional `chat_template.jinja` / `chat_template.json`), the chat path (render the
//! template like transformers' `apply_chat_template`, including its
//! `continue_final_message` truncation, then encode), the completion path, and the
//! decision to move long inputs to tokio's blocking pool. Request parsing lives in
//! `request`, the Jinja environment in `template`; this file must not do HTTP.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context as _;
use serde_json::{Map, Value};

use crate::fast::FastEncoder;
use crate::request::{self, ChatOptions, Conversation, Shape};
use crate::segments::{SegmentCache, SegmentCacheStats};
use crate::template::TemplateSet;
use crate::{count_non_text_parts, RequestBody, RequestKind, RoutingTokens, TokenizeError};

/// Requests with at least this many bytes of text are tokenized on tokio's blocking
/// pool instead of the async worker. Measured (docs/BENCHMARKS.md, section 11): a cold
/// 8k-token chat (~40 KiB) takes ~0.8 ms, so 16 KiB (~4k tokens) caps inline work near
/// ~0.4 ms while `spawn_blocking`'s fixed cost (~10-20 µs) stays negligible.
pub const SPAWN_BLOCKING_MIN_BYTES: usize = 16 * 1024;

/// The segment cache's bound unless set ([`LocalTokenizer::with_segment_cache`]): the ids
/// of about 32M tokens of history.
pub const DEFAULT_SEGMENT_CACHE_BYTES: u64 = 128 << 20;

/// Special-token attributes HF exposes to chat templates (`special_tokens_map`).
const SPECIAL_TOKEN_KEYS: &[&str] = &[
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// An HF tokenizer plus chat template(s), loaded once and shared (`Arc`) by requests.
pub struct LocalTokenizer {
    tokenizer: tokenizers::Tokenizer,
    /// Same ids as `tokenizer`, faster, for the byte-level BPE shape (see `fast`).
    fast: Option<FastEncoder>,
    /// The ids of long segments already encoded (fast path only; see `segments`).
    segments: Option<SegmentCache>,
    templates: Option<TemplateSet>,
    /// Template context entries from `tokenizer_config.json` (bos/eos/... tokens).
    special_tokens: Map<String, Value>,
    dir: PathBuf,
    /// Prompts longer than this many tokens are refused ([`TokenizeError::TooLong`]).
    max_prompt_tokens: Option<u32>,
    /// An upper bound on the bytes of input text one token can stand for, so a text
    /// longer than `max_prompt_tokens × max_token_bytes` is refused before encoding.
    max_token_bytes: usize,
}

impl std::fmt::Debug for LocalTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTokenizer")
            .field("dir", &self.dir)
            .field("templates", &self.templates)
            .field("fast_path", &self.fast.is_some())
            .finish_non_exhaustive()
    }
}

/// Owned, validated work for one request, ready to run on any thread.
pub(crate) enum Work {
    Done(RoutingTokens),
    Text {
        prompt: String,
        add_special_tokens: bool,
    },
    Chat(Box<ChatWork>),
}

pub(crate) struct ChatWork {
    options: ChatOptions,
    conversation: Conversation,
}

impl Work {
    fn text_bytes(&self) -> usize {
        match self {
            Work::Done(_) => 0,
            Work::Text { prompt, .. } => prompt.len(),
            Work::Chat(chat) => chat.conversation.text_bytes,
        }
    }
}

impl LocalTokenizer {
    /// Load `tokenizer.json` (required) and `tokenizer_config.json` (optional: without
    /// it only completions can be tokenized) from a model directory. The chat template
    /// comes from `chat_template.jinja` if present, else `tokenizer_config.json`'s
    /// `chat_template` (a string or a list of `{name, template}`), else
    /// `chat_template.json`.
    pub fn from_dir(dir: &Path) -> anyhow::Result<LocalTokenizer> {
        let tok_path = dir.join("tokenizer.json");
        let tok_text = std::fs::read_to_string(&tok_path)
            .with_context(|| format!("cannot read {}", tok_path.display()))?;
        let tokenizer: tokenizers::Tokenizer = tok_text
            .parse()
            .map_err(|e| anyhow::anyhow!("cannot load {}: {e}", tok_path.display()))?;
        let fast = FastEncoder::from_tokenizer_json(&tok_text);
        drop(tok_text);
        let config_path = dir.join("tokenizer_config.json");
        let config: Map<String, Value> = if config_path.exists() {
            let text = std::fs::read_to_string(&config_path)
                .with_context(|| format!("cannot read {}", config_path.display()))?;
            serde_json::from_str(&text)
                .with_context(|| format!("{} is not a JSON object", config_path.display()))?
        } else {
            Map::new()
        };
        let special_tokens = special_tokens_map(&config);
        let max_token_bytes = max_token_bytes(&tokenizer);
        let templates = load_templates(dir, &config)?;
        let templates = if templates.is_empty() {
            None
        } else {
            Some(TemplateSet::new(templates)?)
        };
        Ok(LocalTokenizer {
            tokenizer,
            fast,
            segments: SegmentCache::new(DEFAULT_SEGMENT_CACHE_BYTES),
            templates,
            special_tokens,
            dir: dir.to_owned(),
            max_prompt_tokens: None,
            max_token_bytes,
        })
    }

    /// Refuses prompts longer than `limit` tokens (the model's context length) with
    /// [`TokenizeError::TooLong`], stopping the encoding as soon as the limit is passed
    /// (or before it, when the text is too long for any tokenization to fit).
    pub fn with_max_prompt_tokens(mut self, limit: Option<u32>) -> Self {
        self.max_prompt_tokens = limit;
        self
    }

    /// Keeps the ids of up to `max_bytes` of segments already encoded (0: none), so a
    /// conversation's history is not encoded again at every turn. Only the byte-level
    /// BPE fast path uses it (where it is exact; see `segments`).
    pub fn with_segment_cache(mut self, max_bytes: u64) -> Self {
        self.segments = SegmentCache::new(max_bytes);
        self
    }

    /// The segment cache's counters (`None` without one, or off this tokenizer's path).
    pub fn segment_cache_stats(&self) -> Option<SegmentCacheStats> {
        self.fast.as_ref()?;
        self.segments.as_ref().map(SegmentCache::stats)
    }

    /// Whether a chat template was found (without one, chat requests are rejected).
    pub fn has_chat_template(&self) -> bool {
        self.templates.is_some()
    }

    /// Tokenize one OpenAI body on the calling thread.
    pub fn tokenize(
        &self,
        kind: RequestKind,
        body: &RequestBody<'_>,
    ) -> Result<RoutingTokens, TokenizeError> {
        let work = self.prepare(kind, body)?;
        self.run(work)
    }

    /// Render a chat body to the prompt text the engine would tokenize (for debugging
    /// parity: `kvgate tokenize --print-prompt`).
    pub fn render_chat(&self, body: &RequestBody<'_>) -> Result<String, TokenizeError> {
        if !body.is_object() {
            return Err(request::invalid("request body must be a JSON object"));
        }
        let options = ChatOptions::parse(body.fields())?;
        let conversation = request::conversation(body, self.content_format(&options)?)?;
        self.render(&options, &conversation)
    }

    /// Encode text with the tokenizer (`add_special_tokens` applies its post-processor).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        match &self.fast {
            Some(fast) if fast.supports(add_special_tokens) => fast
                .encode(
                    self.tokenizer.get_model(),
                    text,
                    usize::MAX,
                    self.segments.as_ref(),
                )
                .map_err(|e| TokenizeError::Invalid(format!("tokenizer error: {e}"))),
            _ => self.encode_with_tokenizers_crate(text, add_special_tokens),
        }
    }

    /// [`LocalTokenizer::encode`] within the prompt-token limit.
    fn encode_within_limit(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let Some(limit) = self.max_prompt_tokens else {
            return self.encode(text, add_special_tokens);
        };
        let too_long = TokenizeError::TooLong { limit };
        if text.len() / self.max_token_bytes.max(1) > limit as usize {
            return Err(too_long);
        }
        let ids = match &self.fast {
            Some(fast) if fast.supports(add_special_tokens) => fast
                .encode(
                    self.tokenizer.get_model(),
                    text,
                    limit as usize,
                    self.segments.as_ref(),
                )
                .map_err(|e| TokenizeError::Invalid(format!("tokenizer error: {e}")))?,
            _ => self.encode_with_tokenizers_crate(text, add_special_tokens)?,
        };
        if ids.len() > limit as usize {
            return Err(too_long);
        }
        Ok(ids)
    }

    /// Encode with the `tokenizers` crate's own pipeline, bypassing the fast path (the
    /// reference the fast path is tested against).
    #[doc(hidden)]
    pub fn encode_with_tokenizers_crate(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizeError::Invalid(format!("tokenizer error: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub(crate) fn prepare(
        &self,
        kind: RequestKind,
        body: &RequestBody<'_>,
    ) -> Result<Work, TokenizeError> {
        match request::classify(kind, body)? {
            Shape::NoTokens(reason) => Ok(Work::Done(RoutingTokens::NoRoutingTokens { reason })),
            Shape::Ids(ids) => Ok(Work::Done(RoutingTokens::Tokens {
                ids,
                non_text_parts: 0,
            })),
            Shape::Text {
                prompt,
                add_special_tokens,
            } => Ok(Work::Text {
                prompt: prompt.to_owned(),
                add_special_tokens,
            }),
            Shape::Chat(body) => {
                let options = ChatOptions::parse(body.fields())?;
                let conversation = request::conversation(body, self.content_format(&options)?)?;
                count_non_text_parts(conversation.non_text_parts);
                Ok(Work::Chat(Box::new(ChatWork {
                    options,
                    conversation,
                })))
            }
        }
    }

    pub(crate) fn run(&self, work: Work) -> Result<RoutingTokens, TokenizeError> {
        match work {
            Work::Done(done) => Ok(done),
            Work::Text {
                prompt,
                add_special_tokens,
            } => Ok(RoutingTokens::Tokens {
                ids: self.encode_within_limit(&prompt, add_special_tokens)?,
                non_text_parts: 0,
            }),
            Work::Chat(chat) => {
                let ChatWork {
                    options,
                    conversation,
                } = *chat;
                let prompt = self.render(&options, &conversation)?;
                Ok(RoutingTokens::Tokens {
                    ids: self.encode_within_limit(&prompt, options.add_special_tokens)?,
                    non_text_parts: conversation.non_text_parts,
                })
            }
        }
    }

    fn template_set(&self) -> Result<&TemplateSet, TokenizeError> {
        self.templates.as_ref().ok_or_else(|| {
            TokenizeError::Invalid(
                "As of transformers v4.44, default chat template is no longer allowed, so you \
                 must provide a chat template if the tokenizer does not define one."
                    .into(),
            )
        })
    }

    fn content_format(
        &self,
        options: &ChatOptions,
    ) -> Result<request::ContentFormat, TokenizeError> {
        Ok(self.template_set()?.select(options.tools.is_some())?.format)
    }

    /// transformers' `apply_chat_template(tokenize=False)`.
    fn render(
        &self,
        options: &ChatOptions,
        conversation: &Conversation,
    ) -> Result<String, TokenizeError> {
        let set = self.template_set()?;
        let entry = set.select(options.tools.is_some())?;
        let ctx = template_context(&self.special_tokens, options, &conversation.messages);
        let rendered = set.render(entry, ctx)?;
        if options.continue_final_message {
            continue_final_message(rendered, &conversation.messages)
        } else {
            Ok(rendered)
        }
    }
}

/// What a chat template sees, as HF builds it: `{**special_tokens_map, **kwargs}`, then
/// the named arguments (later ones win). The messages are the conversation's own values
/// (shared, not copied: at 256k tokens a copy was a megabyte).
fn template_context(
    special_tokens: &Map<String, Value>,
    options: &ChatOptions,
    messages: &[minijinja::Value],
) -> minijinja::Value {
    use minijinja::Value as Jinja;
    const NAMED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];
    let o = options;
    let mut ctx: Vec<(&str, Jinja)> = Vec::new();
    for (k, v) in special_tokens {
        if !o.kwargs.contains_key(k) && !NAMED.contains(&k.as_str()) {
            ctx.push((k, Jinja::from_serialize(v)));
        }
    }
    for (k, v) in &o.kwargs {
        if !NAMED.contains(&k.as_str()) {
            ctx.push((k, Jinja::from_serialize(v)));
        }
    }
    let optional = |v: &Option<Value>| Jinja::from_serialize(v.as_ref().unwrap_or(&Value::Null));
    ctx.push(("messages", Jinja::from(messages.to_vec())));
    ctx.push(("tools", optional(&o.tools)));
    ctx.push(("documents", optional(&o.documents)));
    ctx.push((
        "add_generation_prompt",
        Jinja::from(o.add_generation_prompt),
    ));
    Jinja::from_iter(ctx)
}

/// transformers' `continue_final_message`: cut the rendered chat right after the final
/// message's text, dropping the end-of-turn the template appended.
fn continue_final_message(
    rendered: String,
    messages: &[minijinja::Value],
) -> Result<String, TokenizeError> {
    let last = messages.last().ok_or_else(|| {
        request::invalid("continue_final_message is set but there are no messages")
    })?;
    use minijinja::value::ValueKind;
    let content = last.get_attr("content").unwrap_or_default();
    let final_message: String = match content.kind() {
        ValueKind::String => content.as_str().unwrap_or_default().to_owned(),
        ValueKind::Seq => content
            .try_iter()
            .into_iter()
            .flatten()
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .find_map(|p| p.get_attr("text").ok()?.as_str().map(str::to_owned))
            .ok_or_else(|| {
                request::invalid(
                    "continue_final_message is set but we could not find any text to continue \
                     in the final message!",
                )
            })?,
        _ => String::new(),
    };
    let stripped = final_message.trim();
    let Some(loc) = rendered.rfind(stripped) else {
        return Err(request::invalid(
            "continue_final_message is set but the final message does not appear in the chat \
             after applying the chat template! This can happen if the chat template deletes \
             portions of the final message. Please verify the chat template and final message \
             in your chat to ensure they are compatible.",
        ));
    };
    let lstripped_len = final_message.trim_start().len();
    let end = if rendered.get(loc..loc + lstripped_len) == Some(final_message.as_str()) {
        loc + lstripped_len
    } else {
        loc + stripped.len()
    };
    let mut rendered = rendered;
    rendered.truncate(end);
    Ok(rendered)
}

fn token_content(v: &Value) -> Option<Value> {
    match v {
        Value::String(s) => Some(Value::String(s.clone())),
        Value::Object(o) => o.get("content").filter(|c| c.is_string()).cloned(),
        _ => None,
    }
}

fn special_tokens_map(config: &Map<String, Value>) -> Map<String, Value> {
    let mut map = Map::new();
    for key in SPECIAL_TOKEN_KEYS {
        if let Some(tok) = config.get(*key).and_then(token_content) {
            map.insert((*key).to_owned(), tok);
        }
    }
    if let Some(Value::Array(extra)) = config.get("additional_special_tokens") {
        let extra: Vec<Value> = extra.iter().filter_map(token_content).collect();
        if !extra.is_empty() {
            map.insert("additional_special_tokens".into(), Value::Array(extra));
        }
    }
    map
}

fn load_templates(
    dir: &Path,
    config: &Map<String, Value>,
) -> anyhow::Result<Vec<(String, String)>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        let text = std::fs::read_to_string(&jinja)
            .with_context(|| format!("cannot read {}", jinja.display()))?;
        return Ok(vec![("default".into(), text)]);
    }
    match config.get("chat_template") {
        Some(Value::String(s)) => return Ok(vec![("default".into(), s.clone())]),
        Some(Value::Array(list)) => {
            let mut out = Vec::with_capacity(list.len());
            for item in list {
                let name = item.get("name").and_then(Value::as_str);
                let tmpl = item.get("template").and_then(Value::as_str);
                match (name, tmpl) {
                    (Some(n), Some(t)) => out.push((n.to_owned(), t.to_owned())),
                    _ => anyhow::bail!(
                        "tokenizer_config.json: chat_template list entries need 'name' and 'template'"
                    ),
                }
            }
            return Ok(out);
        }
        Some(Value::Null) | None => {}
        Some(_) => anyhow::bail!("tokenizer_config.json: chat_template must be a string or a list"),
    }
    let json = dir.join("chat_template.json");
    if json.exists() {
        let text = std::fs::read_to_string(&json)
            .with_context(|| format!("cannot read {}", json.display()))?;
        let v: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", json.display()))?;
        if let Some(t) = v.get("chat_template").and_then(Value::as_str) {
            return Ok(vec![("default".into(), t.to_owned())]);
        }
    }
    Ok(Vec::new())
}

/// An upper bound on the input bytes one token stands for: the longest vocabulary or
/// added token in UTF-8 (byte-level and SentencePiece vocabularies spell each input byte
/// with at least one byte), times 3 when a normalizer may compose characters (NFC
/// composes at most 3 input bytes per output byte, e.g. Hangul jamo).
fn max_token_bytes(tokenizer: &tokenizers::Tokenizer) -> usize {
    let longest = tokenizer
        .get_vocab(true)
        .keys()
        .map(String::len)
        .max()
        .unwrap_or(1);
    if tokenizer.get_normalizer().is_some() {
        longest.saturating_mul(3)
    } else {
        longest
    }
}

/// The async path: small inputs inline, long ones on the blocking pool.
pub(crate) async fn tokenize_async(
    local: &Arc<LocalTokenizer>,
    kind: RequestKind,
    body: &RequestBody<'_>,
) -> Result<RoutingTokens, TokenizeError> {
    let work = local.prepare(kind, body)?;
    if work.text_bytes() < SPAWN_BLOCKING_MIN_BYTES {
        return local.run(work);
    }
    let local = Arc::clone(local);
    tokio::task::spawn_blocking(move || local.run(work))
        .await
        .map_err(|e| TokenizeError::Unavailable(format!("tokenizer task failed: {e}")))?
}
