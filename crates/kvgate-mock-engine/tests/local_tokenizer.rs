//! `--tokenizer DIR`: the engine's /tokenize matches vLLM 0.32 on the parity cases,
//! and inference uses the same ids (usage.prompt_tokens).

use kvgate_mock_engine::{spawn, EngineConfig, SimConfig};
use serde_json::Value;

#[tokio::test]
async fn local_tokenizer_matches_vllm_parity_cases() {
    let fixtures = format!("{}/../../fixtures", env!("CARGO_MANIFEST_DIR"));
    let e = spawn(EngineConfig {
        sim: SimConfig {
            num_blocks: 4096,
            ..SimConfig::default()
        },
        speedup: 1000.0,
        kv_events: None,
        tokenizer: Some(format!("{fixtures}/qwen3-tokenizer").into()),
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let cases: Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{fixtures}/tokenize-parity-qwen3.json")).unwrap(),
    )
    .unwrap();
    let client = reqwest::Client::new();
    let mut checked = 0;
    for case in cases["cases"].as_array().unwrap() {
        let r = client
            .post(format!("{}/tokenize", e.base_url()))
            .json(&case["request"])
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{}", case["request"]);
        let got: Value = r.json().await.unwrap();
        assert_eq!(
            got["tokens"], case["expected"]["tokens"],
            "{}",
            case["request"]
        );
        checked += 1;
    }
    assert!(checked >= 10);
    // Inference prefills the same ids.
    let first = &cases["cases"][0];
    let mut body = first["request"].clone();
    body["max_tokens"] = 1.into();
    let path = if body.get("messages").is_some() {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let r: Value = client
        .post(format!("{}{path}", e.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(r["usage"]["prompt_tokens"], first["expected"]["count"]);
    e.shutdown().await;
}
