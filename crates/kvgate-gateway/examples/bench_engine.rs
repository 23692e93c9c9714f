//! A fast fake OpenAI engine for load benchmarks of the gateway's own overhead:
//! answers `/v1/chat/completions` and `/v1/completions` at once with a fixed JSON body
//! (or a short SSE stream when `"stream": true`), plus `/health` and `/v1/models`.
//!
//! Usage: `cargo run --release -p kvgate-gateway --example bench_engine -- PORT [MODEL]`

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use memchr::memmem;

const JSON: &str = r#"{"id":"cmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":0}}}"#;
const SSE: &str = "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"o\"}}]}\n\ndata: {\"id\":\"c\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"k\"},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n";

async fn complete(body: Bytes) -> Response {
    if memmem::find(&body, b"\"stream\":true").is_some()
        || memmem::find(&body, b"\"stream\": true").is_some()
    {
        ([("content-type", "text/event-stream")], SSE).into_response()
    } else {
        ([("content-type", "application/json")], JSON).into_response()
    }
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let port: u16 = args.next().unwrap_or_else(|| "8101".into()).parse()?;
    let model = args.next().unwrap_or_else(|| "m".into());
    let models = format!(
        r#"{{"object":"list","data":[{{"id":"{model}","object":"model","owned_by":"bench"}}]}}"#
    );
    let threads: usize = std::env::var("BENCH_ENGINE_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let app = Router::new()
            .route("/v1/chat/completions", post(complete))
            .route("/v1/completions", post(complete))
            .route("/health", get(|| async { "ok" }))
            .route(
                "/v1/models",
                get(move || async move { ([("content-type", "application/json")], models) }),
            );
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
        axum::serve(listener, app).await?;
        Ok(())
    })
}
