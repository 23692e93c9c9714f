//! Remote mode against an in-process loopback server that answers `/tokenize` like
//! vLLM 0.32 (success body, 400 error body, 5xx, slow answers, closed port).

mod common;

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use kvgate_tokenize::{
    RemoteTokenizer, RequestBody, RequestKind, RoutingTokens, TokenizeError, Tokenizer,
};
use serde_json::{json, Value};

#[derive(Clone, Copy)]
enum Mode {
    Vllm,
    ServerError,
    Slow,
}

async fn tokenize(State(mode): State<Mode>, Json(body): Json<Value>) -> Response {
    match mode {
        Mode::ServerError => {
            return (StatusCode::INTERNAL_SERVER_ERROR, "engine dead").into_response()
        }
        Mode::Slow => tokio::time::sleep(Duration::from_secs(5)).await,
        Mode::Vllm => {}
    }
    // vLLM's /tokenize only accepts a string prompt; the client must never send ids.
    assert!(body.get("prompt").is_none_or(Value::is_string), "{body}");
    let body = RequestBody::from(&body);
    let kind = RequestKind::detect(&body);
    match common::qwen3().tokenize(kind, &body) {
        Ok(RoutingTokens::Tokens { ids, .. }) => Json(json!({
            "count": ids.len(), "max_model_len": 40960, "tokens": ids, "token_strs": null
        }))
        .into_response(),
        Ok(RoutingTokens::NoRoutingTokens { reason }) => panic!("sent a body without tokens: {reason}"),
        Err(e) => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": e.to_string(), "type": "BadRequestError", "param": null, "code": 400}})),
        )
            .into_response(),
    }
}

async fn serve(mode: Mode) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = Router::new()
        .route("/tokenize", post(tokenize))
        .with_state(mode);
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}")
}

fn remote(url: &str, timeout_ms: u64) -> Tokenizer {
    Tokenizer::Remote(RemoteTokenizer::new(url, Duration::from_millis(timeout_ms)).unwrap())
}

#[tokio::test]
async fn remote_equals_local_on_parity_cases() {
    let url = serve(Mode::Vllm).await;
    let remote = remote(&url, 10_000);
    let local = Tokenizer::Local(common::qwen3());
    let text =
        std::fs::read_to_string(common::fixtures().join("tokenize-parity-qwen3.json")).unwrap();
    let fixture: Value = serde_json::from_str(&text).unwrap();
    for case in fixture["cases"].as_array().unwrap().iter().take(10) {
        let body = RequestBody::from(&case["request"]);
        let kind = RequestKind::detect(&body);
        assert_eq!(
            remote.tokenize(kind, &body).await,
            local.tokenize(kind, &body).await
        );
    }
}

#[tokio::test]
async fn shapes_without_engine_round_trip() {
    // A closed port: these must not need the engine at all.
    let remote = remote("http://127.0.0.1:9", 500);
    assert_eq!(
        remote
            .tokenize(
                RequestKind::Completion,
                &RequestBody::from(&json!({"prompt": [5, 6]}))
            )
            .await,
        Ok(RoutingTokens::Tokens {
            ids: vec![5, 6],
            non_text_parts: 0
        })
    );
    assert!(matches!(
        remote
            .tokenize(
                RequestKind::Completion,
                &RequestBody::from(&json!({"prompt": ["a", "b"]}))
            )
            .await,
        Ok(RoutingTokens::NoRoutingTokens { .. })
    ));
}

#[tokio::test]
async fn engine_400_is_invalid_with_engine_message() {
    let url = serve(Mode::Vllm).await;
    let remote = remote(&url, 10_000);
    // Passes the router's shape checks, rejected after rendering on the engine: the
    // template moves text before </think> out of the content, so the final message
    // cannot be continued.
    let body = json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "plan</think>answer"}],
                      "add_generation_prompt": false, "continue_final_message": true});
    let local = common::qwen3().tokenize(RequestKind::Chat, &RequestBody::from(&body));
    let Err(TokenizeError::Invalid(local_msg)) = local else {
        panic!("{local:?}")
    };
    assert_eq!(
        remote
            .tokenize(RequestKind::Chat, &RequestBody::from(&body))
            .await,
        Err(TokenizeError::Invalid(local_msg))
    );
}

#[tokio::test]
async fn transport_failures_are_unavailable() {
    // Closed port: bind, learn the port, drop the listener.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    drop(listener);
    let body = json!({"prompt": "hello"});
    let closed = remote(&format!("http://127.0.0.1:{port}"), 2_000);
    assert!(matches!(
        closed
            .tokenize(RequestKind::Completion, &RequestBody::from(&body))
            .await,
        Err(TokenizeError::Unavailable(_))
    ));

    let failing = remote(&serve(Mode::ServerError).await, 2_000);
    match failing
        .tokenize(RequestKind::Completion, &RequestBody::from(&body))
        .await
    {
        Err(TokenizeError::Unavailable(m)) => {
            assert!(m.contains("500") && m.contains("engine dead"), "{m}")
        }
        other => panic!("{other:?}"),
    }

    let slow = remote(&serve(Mode::Slow).await, 200);
    match slow
        .tokenize(RequestKind::Completion, &RequestBody::from(&body))
        .await
    {
        Err(TokenizeError::Unavailable(m)) => assert!(m.contains("timed out"), "{m}"),
        other => panic!("{other:?}"),
    }
}
