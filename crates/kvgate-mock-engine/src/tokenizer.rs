//! Turning OpenAI request bodies into prompt token ids, and output tokens into text.
//!
//! Owns the engine-side tokenization contract: a deterministic cheap tokenizer (no
//! model files, no random seed, identical in every process so a router calling the
//! engine's /tokenize and the engine itself always agree), the rules for token-id
//! prompts, and the filler text of generated tokens. It must not do HTTP or scheduling.

use serde_json::Value;

/// `<|im_start|>` (Qwen-style chat marker).
pub const IM_START: u32 = 151_644;
/// `<|im_end|>`.
pub const IM_END: u32 = 151_645;
/// The newline token.
pub const NEWLINE: u32 = 198;
/// Word ids fall in `[WORD_ID_BASE, WORD_ID_BASE + WORD_ID_SPAN)`, below the specials.
pub const WORD_ID_BASE: u32 = 1_000;
pub const WORD_ID_SPAN: u32 = 150_000;

/// Words of generated output, cycled.
pub const FILLER_WORDS: [&str; 16] = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven",
    "wizards", "quietly", "hex", "every", "sphinx",
];

/// Which OpenAI endpoint a body belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    Chat,
    Completion,
}

/// A body the engine cannot tokenize (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenizeError {
    #[error("{0}")]
    Invalid(String),
    #[error("this engine serves one prompt per request; got {0}")]
    MultiplePrompts(usize),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
}

/// Something that renders a request into prompt token ids.
pub trait PromptTokenizer: Send + Sync {
    /// Token ids of a chat body (`messages`, `add_generation_prompt`, ...).
    fn chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError>;
    /// Token ids of a completion text prompt.
    fn text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError>;
}

/// Deterministic whitespace tokenizer: each word hashes (FNV-1a, fixed) to one id.
#[derive(Debug, Clone, Copy, Default)]
pub struct CheapTokenizer;

/// The id of one whitespace-separated word.
pub fn word_id(word: &str) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in word.as_bytes() {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    WORD_ID_BASE + (h % WORD_ID_SPAN as u64) as u32
}

fn push_words(out: &mut Vec<u32>, text: &str) {
    out.extend(text.split_whitespace().map(word_id));
}

/// Text of a chat message's `content` (a string, null, or a list of text parts).
fn content_text(content: &Value) -> Result<String, TokenizeError> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match part.get("text").and_then(Value::as_str) {
                    Some(t) => {
                        if !text.is_empty() {
                            text.push(' ');
                        }
                        text.push_str(t);
                    }
                    None => {
                        return Err(TokenizeError::Invalid(
                            "only text content parts are supported".into(),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(TokenizeError::Invalid(
            "message content must be a string or a list of parts".into(),
        )),
    }
}

impl PromptTokenizer for CheapTokenizer {
    fn chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        let messages = body
            .get("messages")
            .and_then(Value::as_array)
            .ok_or_else(|| TokenizeError::Invalid("`messages` must be a list".into()))?;
        if messages.is_empty() {
            return Err(TokenizeError::Invalid(
                "`messages` must not be empty".into(),
            ));
        }
        let mut out = Vec::new();
        for m in messages {
            let role = m
                .get("role")
                .and_then(Value::as_str)
                .ok_or_else(|| TokenizeError::Invalid("every message needs a `role`".into()))?;
            let text = content_text(m.get("content").unwrap_or(&Value::Null))?;
            out.push(IM_START);
            push_words(&mut out, role);
            out.push(NEWLINE);
            push_words(&mut out, &text);
            out.push(IM_END);
            out.push(NEWLINE);
        }
        let add_generation_prompt = body
            .get("add_generation_prompt")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        if add_generation_prompt {
            out.push(IM_START);
            out.push(word_id("assistant"));
            out.push(NEWLINE);
        }
        Ok(out)
    }

    fn text(&self, text: &str, _add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Vec::new();
        push_words(&mut out, text);
        Ok(out)
    }
}

/// Parse a list of JSON numbers as token ids (None if it is not such a list).
fn as_token_ids(v: &Value) -> Option<Result<Vec<u32>, TokenizeError>> {
    let arr = v.as_array()?;
    if arr.is_empty() || !arr.iter().all(Value::is_number) {
        return None;
    }
    Some(
        arr.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| TokenizeError::Invalid(format!("invalid token id {x}")))
            })
            .collect(),
    )
}

/// Token ids of a completions `prompt`: a string, a list of token ids (used as is),
/// or a one-element list of either.
pub fn completion_prompt(
    tok: &dyn PromptTokenizer,
    prompt: &Value,
    add_special_tokens: bool,
) -> Result<Vec<u32>, TokenizeError> {
    if let Some(s) = prompt.as_str() {
        return tok.text(s, add_special_tokens);
    }
    if let Some(ids) = as_token_ids(prompt) {
        return ids;
    }
    match prompt.as_array() {
        Some(list) if list.len() == 1 => completion_prompt(tok, &list[0], add_special_tokens),
        Some(list) if list.is_empty() => Err(TokenizeError::Invalid("`prompt` is empty".into())),
        Some(list) => Err(TokenizeError::MultiplePrompts(list.len())),
        None => Err(TokenizeError::Invalid(
            "`prompt` must be a string or a list of token ids".into(),
        )),
    }
}

/// Token ids of a request body of either kind (the /tokenize and inference paths).
pub fn body_tokens(
    tok: &dyn PromptTokenizer,
    kind: PromptKind,
    body: &Value,
) -> Result<Vec<u32>, TokenizeError> {
    match kind {
        PromptKind::Chat => tok.chat(body),
        PromptKind::Completion => {
            let prompt = body
                .get("prompt")
                .ok_or_else(|| TokenizeError::Invalid("`prompt` is required".into()))?;
            let add_special = body
                .get("add_special_tokens")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            completion_prompt(tok, prompt, add_special)
        }
    }
}

/// Token ids of the filler words (the default generated tokens).
pub fn filler_token_ids() -> Vec<u32> {
    FILLER_WORDS.iter().map(|w| word_id(w)).collect()
}

/// Text of the `index`-th generated token.
pub fn filler_text(index: u32) -> String {
    let w = FILLER_WORDS[index as usize % FILLER_WORDS.len()];
    format!("{w} ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cheap_tokenizer_is_fixed() {
        // Fixed across processes and builds: a router's remote /tokenize relies on it.
        assert_eq!(word_id("hello"), word_id("hello"));
        assert_ne!(word_id("hello"), word_id("world"));
        let t = CheapTokenizer;
        assert_eq!(t.text("a  b\nc", true).unwrap().len(), 3);
        let ids = (WORD_ID_BASE..WORD_ID_BASE + WORD_ID_SPAN).contains(&word_id("x"));
        assert!(ids);
    }

    #[test]
    fn chat_has_role_markers_and_generation_prompt() {
        let t = CheapTokenizer;
        let body = json!({"messages":[{"role":"user","content":"hi there"}]});
        let ids = t.chat(&body).unwrap();
        assert_eq!(ids[0], IM_START);
        assert_eq!(ids.len(), 1 + 1 + 1 + 2 + 2 + 3);
        let body = json!({"messages":[{"role":"user","content":[{"type":"text","text":"hi there"}]}],
                          "add_generation_prompt": false});
        assert_eq!(t.chat(&body).unwrap().len(), 7);
    }

    #[test]
    fn completion_prompts() {
        let t = CheapTokenizer;
        assert_eq!(
            completion_prompt(&t, &json!([5, 6, 7]), true).unwrap(),
            vec![5, 6, 7]
        );
        assert_eq!(
            completion_prompt(&t, &json!([[5, 6]]), true).unwrap(),
            vec![5, 6]
        );
        assert_eq!(
            completion_prompt(&t, &json!(["a b"]), true).unwrap().len(),
            2
        );
        assert!(matches!(
            completion_prompt(&t, &json!(["a", "b"]), true),
            Err(TokenizeError::MultiplePrompts(2))
        ));
        assert!(completion_prompt(&t, &json!([-1]), true).is_err());
        assert!(completion_prompt(&t, &json!(3), true).is_err());
    }
}
