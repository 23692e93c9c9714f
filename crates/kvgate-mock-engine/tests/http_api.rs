//! The HTTP surface against a real in-process engine on loopback.

use std::time::Duration;

use kvgate_mock_engine::{spawn, EngineConfig, PublisherConfig, RunningEngine, SimConfig};
use serde_json::{json, Value};

async fn engine(speedup: f64) -> RunningEngine {
    spawn(EngineConfig {
        sim: SimConfig {
            block_size: 16,
            num_blocks: 256,
            ..SimConfig::default()
        },
        speedup,
        kv_events: Some(PublisherConfig::default()),
        model: "mock".into(),
        ..EngineConfig::default()
    })
    .await
    .unwrap()
}

async fn get(c: &reqwest::Client, url: String) -> reqwest::Response {
    c.get(url).send().await.unwrap()
}

async fn post(e: &RunningEngine, path: &str, body: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}{path}", e.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

#[tokio::test]
async fn repeated_prompt_reports_cached_full_blocks() {
    let e = engine(200.0).await;
    let prompt: Vec<u32> = (0..100).collect();
    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 3, "ignore_eos": true});
    let (s, first) = post(&e, "/v1/completions", body.clone()).await;
    assert_eq!(s, 200, "{first}");
    assert_eq!(first["usage"]["prompt_tokens"], 100);
    assert_eq!(first["usage"]["completion_tokens"], 3);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(first["choices"][0]["finish_reason"], "length");
    assert_eq!(first["object"], "text_completion");
    let (_, second) = post(&e, "/v1/completions", body).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        96
    );

    // Chat via the cheap tokenizer: same text, same hit.
    let chat =
        json!({"messages": [{"role": "user", "content": "word ".repeat(60)}], "max_tokens": 2});
    let (_, a) = post(&e, "/v1/chat/completions", chat.clone()).await;
    let (_, b) = post(&e, "/v1/chat/completions", chat).await;
    let prompt_tokens = a["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"][0]["message"]["role"], "assistant");
    assert_eq!(
        b["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
        (prompt_tokens - 1) / 16 * 16
    );
    e.shutdown().await;
}

#[tokio::test]
async fn streaming_uses_vllm_sse_framing() {
    let e = engine(200.0).await;
    let body = json!({"messages": [{"role": "user", "content": "hello there"}],
                      "max_tokens": 4, "stream": true, "ignore_eos": true,
                      "stream_options": {"include_usage": true}});
    let r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", e.base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let text = r.text().await.unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"));
    let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
    assert!(events.iter().all(|e| e.starts_with("data: ")));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(&e["data: ".len()..]).unwrap())
        .collect();
    // role chunk + 4 token chunks + usage chunk
    assert_eq!(chunks.len(), 6, "{text}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    for c in &chunks[..5] {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["choices"][0]["index"], 0);
        assert!(c["choices"][0]["logprobs"].is_null());
        assert_eq!(c["id"], chunks[0]["id"]);
    }
    assert!(chunks[3]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[4]["choices"][0]["finish_reason"], "length");
    assert_eq!(chunks[5]["choices"], json!([]));
    assert_eq!(chunks[5]["usage"]["completion_tokens"], 4);

    // Completions stream: text chunks, no usage unless asked.
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", e.base_url()))
        .json(&json!({"prompt": "a b c", "max_tokens": 2, "stream": true}))
        .send()
        .await
        .unwrap();
    let text = r.text().await.unwrap();
    let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
    assert_eq!(events.len(), 3, "{text}");
    let c: Value = serde_json::from_str(&events[0]["data: ".len()..]).unwrap();
    assert_eq!(c["object"], "text_completion");
    assert!(c["choices"][0]["text"].is_string());
    e.shutdown().await;
}

#[tokio::test]
async fn auxiliary_endpoints_and_errors() {
    let e = engine(200.0).await;
    let c = reqwest::Client::new();
    let base = e.base_url();
    assert_eq!(
        c.get(format!("{base}/health"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let models: Value = c
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "mock");

    let (s, t) = post(&e, "/tokenize", json!({"prompt": "one two three"})).await;
    assert_eq!(s, 200);
    assert_eq!(t["count"], 3);
    assert_eq!(t["max_model_len"], 4096);
    let (_, t2) = post(
        &e,
        "/tokenize",
        json!({"messages": [{"role": "user", "content": "one"}]}),
    )
    .await;
    assert_eq!(t2["count"], 9);

    for (path, body) in [
        ("/v1/completions", json!({"prompt": ["a", "b"]})),
        ("/v1/completions", json!({})),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": "many"}),
        ),
        ("/v1/chat/completions", json!({"messages": "nope"})),
        (
            "/v1/completions",
            json!({"prompt": (0..5000).collect::<Vec<u32>>()}),
        ),
    ] {
        let (s, err) = post(&e, path, body).await;
        assert_eq!(s, 400, "{err}");
        assert!(err["error"]["message"].is_string());
        assert_eq!(err["error"]["code"], 400);
    }
    let r = c
        .post(format!("{base}/v1/completions"))
        .body("{not json")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);

    post(
        &e,
        "/v1/completions",
        json!({"prompt": (0..40).collect::<Vec<u32>>(), "max_tokens": 1}),
    )
    .await;
    let metrics = get(&c, format!("{base}/metrics"))
        .await
        .text()
        .await
        .unwrap();
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_queries_total{",
        "vllm:prefix_cache_hits_total{",
    ] {
        assert!(metrics.contains(name), "{name} missing");
    }
    assert!(metrics.contains("model_name=\"mock\""));
    assert!(
        metrics.contains("vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"mock\"} 40.0")
    );
    let load: Value = get(&c, format!("{base}/get_load"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(load["load"], 0);
    let r = c
        .post(format!("{base}/reset_prefix_cache"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    e.shutdown().await;
}

#[tokio::test]
async fn client_disconnect_aborts_and_frees_blocks() {
    // Slow engine: a long generation is still running when the client leaves.
    let e = engine(1.0).await;
    let base = e.base_url();
    let c = reqwest::Client::new();
    let mut r = c
        .post(format!("{base}/v1/completions"))
        .json(
            &json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 2000,
                      "ignore_eos": true, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    let first = r.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    let load: Value = get(&c, format!("{base}/get_load"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(load["load"], 1);
    drop(r);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let load: Value = get(&c, format!("{base}/get_load"))
            .await
            .json()
            .await
            .unwrap();
        if load["load"] == 0 && load["kv_cache_usage_perc"] == 0.0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "request not aborted: {load}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    e.shutdown().await;
}
