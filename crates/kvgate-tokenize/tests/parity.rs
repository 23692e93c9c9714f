//! Acceptance: the local tokenizer reproduces every vLLM 0.32 `/tokenize` answer in
//! fixtures/tokenize-parity-qwen3.json exactly, plus behaviour around those semantics.

mod common;

use kvgate_tokenize::{LocalTokenizer, RequestBody, RequestKind, RoutingTokens, TokenizeError};
use serde_json::{json, Value};

fn ids(r: Result<RoutingTokens, TokenizeError>) -> Vec<u32> {
    match r {
        Ok(RoutingTokens::Tokens { ids, .. }) => ids,
        other => panic!("expected tokens, got {other:?}"),
    }
}

#[test]
fn every_vllm_parity_case_matches() {
    let text =
        std::fs::read_to_string(common::fixtures().join("tokenize-parity-qwen3.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 30);
    let tok = common::qwen3();
    let mut mismatches = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let body = &case["request"];
        let expected: Vec<u32> =
            serde_json::from_value(case["expected"]["tokens"].clone()).unwrap();
        assert_eq!(
            case["expected"]["count"].as_u64(),
            Some(expected.len() as u64)
        );
        // Parsed from its text, as the gateway reads a body (strings borrowed from it).
        let text = serde_json::to_vec(body).unwrap();
        let body = RequestBody::parse(&text).unwrap();
        let got = tok.tokenize(RequestKind::detect(&body), &body);
        match got {
            Ok(RoutingTokens::Tokens {
                ids,
                non_text_parts: 0,
            }) if ids == expected => {}
            other => {
                let first_diff = match &other {
                    Ok(RoutingTokens::Tokens { ids, .. }) => ids
                        .iter()
                        .zip(&expected)
                        .position(|(a, b)| a != b)
                        .unwrap_or(ids.len().min(expected.len())),
                    _ => 0,
                };
                mismatches.push(format!(
                    "case {i}: first difference at token {first_diff}; expected {} tokens, got {:?}",
                    expected.len(),
                    other.map(|r| match r {
                        RoutingTokens::Tokens { ids, .. } => format!("{} tokens {:?}", ids.len(), &ids[first_diff.min(ids.len())..(first_diff + 8).min(ids.len())]),
                        r => format!("{r:?}"),
                    })
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} of 30 cases differ:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}

#[test]
fn async_path_matches_sync_path_for_long_inputs() {
    let tok = common::qwen3();
    let long = "Grüße, 東京 and hello world. ".repeat(1500); // > spawn_blocking threshold
    let body = json!({"messages": [{"role": "system", "content": long}, {"role": "user", "content": "hi"}]});
    let sync = ids(tok.tokenize(RequestKind::Chat, &RequestBody::from(&body)));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let tokenizer = kvgate_tokenize::Tokenizer::Local(tok);
    let asynced =
        ids(rt.block_on(tokenizer.tokenize(RequestKind::Chat, &RequestBody::from(&body))));
    assert_eq!(sync, asynced);
    assert!(sync.len() > 5000);
}

#[test]
fn images_are_skipped_and_counted() {
    let tok = common::qwen3();
    let before = kvgate_tokenize::non_text_parts_skipped_total();
    let with_image = json!({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "what is this?"}
    ]}]});
    let text_only = json!({"messages": [{"role": "user", "content": "what is this?"}]});
    match tok
        .tokenize(RequestKind::Chat, &RequestBody::from(&with_image))
        .unwrap()
    {
        RoutingTokens::Tokens {
            ids,
            non_text_parts,
        } => {
            assert_eq!(non_text_parts, 1);
            assert_eq!(
                ids,
                self::ids(tok.tokenize(RequestKind::Chat, &RequestBody::from(&text_only)))
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(kvgate_tokenize::non_text_parts_skipped_total() > before);
}

#[test]
fn completions_and_fallbacks() {
    let tok = common::qwen3();
    assert_eq!(
        ids(tok.tokenize(
            RequestKind::Completion,
            &RequestBody::from(&json!({"prompt": [1, 2, 3]}))
        )),
        vec![1, 2, 3]
    );
    assert_eq!(
        tok.tokenize(
            RequestKind::Completion,
            &RequestBody::from(&json!({"prompt": ["a", "b"]}))
        ),
        Ok(RoutingTokens::NoRoutingTokens {
            reason: "multiple prompts"
        })
    );
    assert!(matches!(
        tok.tokenize(
            RequestKind::Chat,
            &RequestBody::from(&json!({"model": "x"}))
        ),
        Ok(RoutingTokens::NoRoutingTokens { .. })
    ));
    assert!(matches!(
        tok.tokenize(
            RequestKind::Chat,
            &RequestBody::from(&json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true}))
        ),
        Err(TokenizeError::Invalid(_))
    ));
    assert!(matches!(
        tok.tokenize(
            RequestKind::Chat,
            &RequestBody::from(&json!({"messages": "nope"}))
        ),
        Err(TokenizeError::Invalid(_))
    ));
}

#[test]
fn tools_and_kwargs_reach_the_template() {
    let tok = common::qwen3();
    let body = json!({
        "messages": [{"role": "user", "content": "weather?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "chat_template_kwargs": {"enable_thinking": false}
    });
    let prompt = tok.render_chat(&RequestBody::from(&body)).unwrap();
    assert!(prompt.contains(
        r#"<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Get weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
</tools>"#
    ), "{prompt}");
    assert!(
        prompt.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{prompt}"
    );
    let call = json!({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    ]});
    let prompt = tok.render_chat(&RequestBody::from(&call)).unwrap();
    assert!(prompt.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"), "{prompt}");
    assert!(
        prompt.contains("<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>"),
        "{prompt}"
    );
}

#[test]
fn fast_path_equals_tokenizers_crate() {
    let tok = common::qwen3();
    assert!(
        format!("{tok:?}").contains("fast_path: true"),
        "Qwen3 must take the fast path"
    );
    let text =
        std::fs::read_to_string(common::fixtures().join("tokenize-parity-qwen3.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    let mut samples: Vec<String> = fixture["cases"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["request"].get("messages").is_some())
        .map(|c| tok.render_chat(&RequestBody::from(&c["request"])).unwrap())
        .collect();
    // Whitespace runs, newlines, NFD input (NFC normalisation), added tokens, emoji.
    samples.extend(
        [
            "",
            " ",
            "  ",
            "a  b",
            "a \n b",
            "\n\n  x",
            "x  \n\n",
            "   ",
            "\t\tfoo  \t bar",
            "e\u{301}t\u{e9} cafe\u{301}",
            "1234567 3.14159",
            "it's I'LL we'd",
            "<|im_start|><|im_end|><think>",
            "trailing space ",
            "  leading",
            "😀😀 ok\r\n\r\nnext",
            "x\u{a0}\u{a0}y \u{3000}z",
            "--->  <---",
        ]
        .map(String::from),
    );
    for s in &samples {
        for special in [false, true] {
            assert_eq!(
                tok.encode(s, special).unwrap(),
                tok.encode_with_tokenizers_crate(s, special).unwrap(),
                "{s:?}"
            );
        }
    }
}

/// Text of the pieces the split pattern tells apart: letters of several scripts and
/// cases, digits, contractions, punctuation runs before newlines, whitespace runs of
/// every kind (tabs, CR, no-break and ideographic spaces) before letters, symbols and
/// ends, emoji, combining marks, special tokens.
fn pre_tokenizer_text() -> impl proptest::strategy::Strategy<Value = String> {
    use proptest::prelude::*;
    let fragment = prop_oneof![
        "[a-zA-Z]{1,10}",
        "[0-9]{1,5}",
        "[ \t\r\n]{1,4}",
        r#"[.,;:!?()\-/*#@\[\]{}<>=+_~`|\\"]{1,3}"#,
        prop::sample::select(vec![
            "'s",
            "'T",
            "'re",
            "'VE",
            "'m",
            "'ll",
            "'D",
            "'x",
            "\u{a0}",
            "\u{3000}",
            "\u{2028}",
            " \u{a0} ",
            "e\u{301}",
            "\u{e9}",
            "日本語",
            "テキスト",
            "Привет",
            "مرحبا",
            "हिन्दी",
            "😀",
            "👍🏽",
            "①",
            "½",
            "<|im_end|>",
            "<think>",
            "\u{feff}",
        ])
        .prop_map(str::to_owned),
    ];
    proptest::collection::vec(fragment, 0..60).prop_map(|f| f.concat())
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

    /// The fast path's own pre-tokenizer and piece cache give the `tokenizers` crate's
    /// ids on any text.
    #[test]
    fn fast_path_equals_tokenizers_crate_on_random_text(text in pre_tokenizer_text()) {
        let tok = common::qwen3();
        proptest::prop_assert_eq!(
            tok.encode(&text, false).unwrap(),
            tok.encode_with_tokenizers_crate(&text, false).unwrap(),
            "{:?}", text
        );
    }
}

/// With a context limit, a prompt within it gets the same ids as without one; a prompt
/// beyond it is refused as TooLong (chat and completion), and a text far beyond it is
/// refused without encoding it.
#[test]
fn prompts_beyond_the_context_limit_are_refused() {
    let plain = LocalTokenizer::from_dir(&common::qwen3_dir()).unwrap();
    let limited = LocalTokenizer::from_dir(&common::qwen3_dir())
        .unwrap()
        .with_max_prompt_tokens(Some(64));
    let short = serde_json::json!({"model": "m", "prompt": "a short prompt about caching"});
    assert_eq!(
        ids(limited.tokenize(RequestKind::Completion, &RequestBody::from(&short))),
        ids(plain.tokenize(RequestKind::Completion, &RequestBody::from(&short)))
    );
    let chat =
        serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hello"}]});
    assert_eq!(
        ids(limited.tokenize(RequestKind::Chat, &RequestBody::from(&chat))),
        ids(plain.tokenize(RequestKind::Chat, &RequestBody::from(&chat)))
    );
    // Exactly at the limit passes; one more token fails.
    let words = |n: usize| " cache".repeat(n);
    let n_at = |text: &str| {
        ids(plain.tokenize(
            RequestKind::Completion,
            &RequestBody::from(&serde_json::json!({"prompt": text})),
        ))
        .len()
    };
    assert_eq!(n_at(&words(64)), 64);
    let at = serde_json::json!({"prompt": words(64)});
    assert_eq!(
        ids(limited.tokenize(RequestKind::Completion, &RequestBody::from(&at))).len(),
        64
    );
    let over = serde_json::json!({"prompt": words(65)});
    assert!(matches!(
        limited.tokenize(RequestKind::Completion, &RequestBody::from(&over)),
        Err(TokenizeError::TooLong { limit: 64 })
    ));
    let long_chat = serde_json::json!({"messages": [{"role": "user", "content": words(100)}]});
    assert!(matches!(
        limited.tokenize(RequestKind::Chat, &RequestBody::from(&long_chat)),
        Err(TokenizeError::TooLong { limit: 64 })
    ));
    // 4 MB of text against a 64-token limit: refused at once by the length bound.
    let huge = serde_json::json!({"prompt": "x".repeat(4 << 20)});
    assert!(matches!(
        limited.tokenize(RequestKind::Completion, &RequestBody::from(&huge)),
        Err(TokenizeError::TooLong { limit: 64 })
    ));
}

/// A template that reads content as a list of parts (vLLM's "openai" format) gets the
/// text parts as `{type, text}` dicts, a tool message's parts joined into a string, and
/// `continue_final_message` cuts after the final message's last text part.
#[test]
fn openai_format_templates_see_parts() {
    let (_dir, tok) = common::qwen3_with_template(
        "{%- for m in messages -%}[{{ m.role }}]\
         {%- if m.content is string -%}{{ m.content }}\
         {%- else -%}{%- for c in m['content'] -%}<{{ c.type }}:{{ c.text }}>{%- endfor -%}{%- endif -%}\
         |{%- endfor -%}{%- if add_generation_prompt -%}[assistant]{%- endif -%}",
    );
    let body = json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b",
            {"type": "image_url", "image_url": {"url": "http://x"}}]},
        {"role": "tool", "content": [{"type": "text", "text": "c"}, {"type": "text", "text": "d"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "e"}, {"type": "text", "text": " f "}]}
    ]});
    assert_eq!(
        tok.render_chat(&RequestBody::from(&body)).unwrap(),
        "[user]<text:a><text:b>|[tool]c\nd|[assistant]<text:e><text: f >|[assistant]"
    );
    let mut cont = body.clone();
    cont["continue_final_message"] = json!(true);
    cont["add_generation_prompt"] = json!(false);
    assert_eq!(
        tok.render_chat(&RequestBody::from(&cont)).unwrap(),
        "[user]<text:a><text:b>|[tool]c\nd|[assistant]<text:e><text: f"
    );
}

/// A message is a mapping to the template whatever its fields: dumped whole, measured,
/// iterated by key and value, tested for a key, read by attribute and by item.
#[test]
fn templates_see_each_message_as_a_mapping() {
    let (_dir, tok) = common::qwen3_with_template(
        "{%- for m in messages -%}{{ m | tojson }}|{{ m | length }}|{{ 'tool_calls' in m }}|\
         {{ m.name is defined }}|{{ m['role'] }}|{%- for k, v in m.items() -%}{{ k }}={{ v is string }},{%- endfor -%}\
         |{{ m.keys() | list | join(' ') }}|{{ m.missing is undefined }};{%- endfor -%}",
    );
    let body = json!({"add_generation_prompt": false, "messages": [
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": null, "reasoning": "r", "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "1"}
    ]});
    assert_eq!(
        tok.render_chat(&RequestBody::from(&body)).unwrap(),
        "{\"role\": \"user\", \"content\": \"hi\", \"name\": \"bob\"}|3|False|True|user|\
         role=True,content=True,name=True,|role content name|True;\
         {\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"1\", \"type\": \
         \"function\", \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1}}}], \"reasoning\": \
         \"r\", \"reasoning_content\": \"r\"}|5|True|False|assistant|role=True,content=True,\
         tool_calls=False,reasoning=True,reasoning_content=True,|role content tool_calls \
         reasoning reasoning_content|True;\
         {\"role\": \"tool\", \"content\": \"ok\", \"tool_call_id\": \"1\"}|3|False|False|tool|\
         role=True,content=True,tool_call_id=True,|role content tool_call_id|True;"
    );
}
