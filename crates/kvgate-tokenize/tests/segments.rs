//! The segment cache gives the ids the uncached path gives: over random conversations
//! (messages of random text, special-token look-alikes, Unicode that NFC changes),
//! sent again with a turn added, with an earlier message edited, and cut short by the
//! prompt-token limit, the ids through a tokenizer with the cache equal those through
//! one without it, and a changed earlier message is never served stale ids.

mod common;

use std::sync::{Arc, OnceLock};

use kvgate_tokenize::{LocalTokenizer, RequestBody, RequestKind, RoutingTokens, TokenizeError};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The ids of `body`, parsed from its text as the gateway reads a body (strings
/// borrowed from the text); checked against the same body tokenized from its `Value`.
fn ids(tok: &LocalTokenizer, body: &Value) -> Result<Vec<u32>, TokenizeError> {
    let text = serde_json::to_vec(body).expect("serializes");
    let parsed = RequestBody::parse(&text).expect("parses");
    let tokens = tok.tokenize(RequestKind::Chat, &parsed);
    assert_eq!(
        tokens,
        tok.tokenize(RequestKind::Chat, &RequestBody::from(body))
    );
    match tokens? {
        RoutingTokens::Tokens { ids, .. } => Ok(ids),
        other => panic!("no tokens: {other:?}"),
    }
}

fn chat(messages: &[String]) -> Value {
    let messages: Vec<Value> = messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match i {
                0 => "system",
                i if i % 2 == 1 => "user",
                _ => "assistant",
            };
            json!({"role": role, "content": m})
        })
        .collect();
    json!({"model": "m", "messages": messages})
}

/// The Qwen3 tokenizer with a segment cache and without one, loaded once (the cached
/// one keeps what every case encoded).
fn tokenizers() -> (Arc<LocalTokenizer>, Arc<LocalTokenizer>) {
    static BOTH: OnceLock<(Arc<LocalTokenizer>, Arc<LocalTokenizer>)> = OnceLock::new();
    BOTH.get_or_init(|| {
        let dir = common::qwen3_dir();
        let cached = LocalTokenizer::from_dir(&dir)
            .unwrap()
            .with_segment_cache(8 << 20);
        let plain = LocalTokenizer::from_dir(&dir)
            .unwrap()
            .with_segment_cache(0);
        (Arc::new(cached), Arc::new(plain))
    })
    .clone()
}

/// Text of words, whitespace runs, digits, punctuation, non-Latin and decomposed
/// characters, and now and then a special token's text.
fn text() -> impl Strategy<Value = String> {
    let word = prop_oneof![
        "[a-zA-Z]{1,12}",
        "[0-9]{1,6}",
        " {1,4}",
        "\n{1,3}",
        "[.,;:!?'\"()\\-]{1,3}",
        Just("héllo".to_owned()),
        Just("e\u{301}".to_owned()),
        Just("日本語のテキスト".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<think>".to_owned()),
    ];
    proptest::collection::vec(word, 40..400).prop_map(|w| w.join(" "))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn cached_ids_equal_uncached_ids_as_a_conversation_grows_and_changes(
        messages in proptest::collection::vec(text(), 2..6),
        added in text(),
        edit_at in 0usize..6,
        edit in text(),
    ) {
        let (cached, plain) = tokenizers();
        let mut conversation = messages.clone();
        // The conversation, then again (its history now seen), then a turn longer.
        for _ in 0..2 {
            prop_assert_eq!(ids(&cached, &chat(&conversation))?, ids(&plain, &chat(&conversation))?);
        }
        conversation.push(added);
        prop_assert_eq!(ids(&cached, &chat(&conversation))?, ids(&plain, &chat(&conversation))?);
        // An earlier message edited: its new text is encoded, not its old ids reused.
        let at = edit_at % conversation.len();
        conversation[at] = edit;
        prop_assert_eq!(ids(&cached, &chat(&conversation))?, ids(&plain, &chat(&conversation))?);
    }
}

/// A conversation over the prompt-token limit is refused with and without the cache,
/// and a segment cut short by the limit is not kept: the same conversation under a
/// higher limit gets whole ids.
#[test]
fn the_limit_applies_with_the_cache_and_cut_segments_are_not_kept() {
    let dir = common::qwen3_dir();
    let long = "word ".repeat(2_000);
    let body = chat(&["system".to_owned(), long.clone()]);
    let limited = LocalTokenizer::from_dir(&dir)
        .unwrap()
        .with_max_prompt_tokens(Some(500));
    assert!(matches!(
        ids(&limited, &body),
        Err(TokenizeError::TooLong { limit: 500 })
    ));
    assert!(matches!(
        ids(&limited, &body),
        Err(TokenizeError::TooLong { limit: 500 })
    ));
    let stats = limited.segment_cache_stats().unwrap();
    assert_eq!(stats.bytes, 0, "a cut segment was kept: {stats:?}");
    let (cached, plain) = tokenizers();
    let hits = cached.segment_cache_stats().unwrap().hits;
    assert_eq!(ids(&cached, &body).unwrap(), ids(&plain, &body).unwrap());
    assert_eq!(ids(&cached, &body).unwrap(), ids(&plain, &body).unwrap());
    let stats = cached.segment_cache_stats().unwrap();
    assert!(stats.hits > hits && stats.bytes > 0, "{stats:?}");
}
