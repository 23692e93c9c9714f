//! The runner against a tiny in-process fake OpenAI SSE server on loopback: TTFT,
//! inter-token gaps, usage, worker header, errors by status, concurrency cap.

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use kvgate_bench::client::BenchClient;
use kvgate_bench::report::Report;
use kvgate_bench::request::Request;
use kvgate_bench::runner::{run, RunConfig};
use serde_json::{json, Value};

const FIRST_TOKEN_DELAY: Duration = Duration::from_millis(60);

#[derive(Default)]
struct Fake {
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

/// Prompt starting with 0 → 503; with 1 → stream with an inline error event;
/// otherwise a stream of `max_tokens` chunks then usage (half the prompt cached).
async fn completions(
    State(fake): State<Arc<Fake>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let prompt: Vec<u64> = body["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(body["stream"], true);
    assert_eq!(body["ignore_eos"], true);
    if prompt[0] == 0 {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"error":{"message":"busy","type":"overloaded","code":503}})),
        )
            .into_response();
    }
    let max_tokens = body["max_tokens"].as_u64().unwrap();
    let worker = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("w0")
        .to_string();
    let now = fake.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    fake.max_in_flight.fetch_max(now, Ordering::SeqCst);
    let inline_error = prompt[0] == 1;
    let n_prompt = prompt.len() as u64;
    let stream = async_stream(fake.clone(), max_tokens, n_prompt, inline_error);
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-kvgate-worker", worker)
        .body(Body::from_stream(stream))
        .unwrap()
}

fn async_stream(
    fake: Arc<Fake>,
    max_tokens: u64,
    n_prompt: u64,
    inline_error: bool,
) -> impl futures::Stream<Item = Result<bytes::Bytes, Infallible>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<bytes::Bytes, Infallible>>(16);
    tokio::spawn(async move {
        tokio::time::sleep(FIRST_TOKEN_DELAY).await;
        if inline_error {
            let _ = tx
                .send(Ok(bytes::Bytes::from(
                    "data: {\"error\":{\"message\":\"engine died\"}}\n\n",
                )))
                .await;
        } else {
            for i in 0..max_tokens {
                let ev =
                    json!({"choices":[{"index":0,"text":format!("t{i}"),"finish_reason":null}]});
                let _ = tx.send(Ok(format!("data: {ev}\n\n").into())).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let usage = json!({"choices":[],"usage":{"prompt_tokens":n_prompt,"completion_tokens":max_tokens,
                "prompt_tokens_details":{"cached_tokens":n_prompt/2}}});
            let _ = tx.send(Ok(format!("data: {usage}\n\n").into())).await;
        }
        let _ = tx.send(Ok(bytes::Bytes::from("data: [DONE]\n\n"))).await;
        fake.in_flight.fetch_sub(1, Ordering::SeqCst);
    });
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

async fn serve() -> (String, Arc<Fake>) {
    let fake = Arc::new(Fake::default());
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .with_state(fake.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (format!("http://{addr}"), fake)
}

fn req(id: u64, first: u32, session: &str) -> Request {
    Request {
        id,
        arrival: Duration::from_millis(id * 10),
        prompt: vec![first, 7, 8, 9],
        max_tokens: 5,
        session_id: Some(session.to_string()),
        objective: Default::default(),
    }
}

#[tokio::test]
async fn measures_ttft_usage_workers_and_errors() {
    let (url, _fake) = serve().await;
    let client = BenchClient::new(&url, "m", Duration::from_secs(20)).unwrap();
    let reqs = vec![
        req(0, 5, "a"),
        req(1, 5, "a"),
        req(2, 5, "b"),
        req(3, 0, "a"), // 503
        req(4, 1, "b"), // inline stream error
    ];
    let cfg = RunConfig {
        progress: false,
        ..RunConfig::default()
    };
    let result = run(&client, reqs, &cfg).await;
    assert_eq!(result.outcomes.len(), 5);
    let ok = &result.outcomes[0];
    assert!(ok.is_ok(), "{ok:?}");
    assert!(ok.ttft.unwrap() >= FIRST_TOKEN_DELAY);
    assert_eq!(ok.itl.len(), 4);
    assert_eq!(ok.completion_tokens, 5);
    assert_eq!(ok.cached_tokens, Some(2));
    assert_eq!(ok.worker.as_deref(), Some("a"));
    assert!(ok.e2e >= ok.ttft.unwrap());
    assert_eq!(result.outcomes[3].error.as_deref(), Some("503"));
    assert_eq!(result.outcomes[3].status, Some(503));
    assert_eq!(result.outcomes[4].error.as_deref(), Some("stream_error"));

    let report = Report::from_run("fake", &result);
    assert_eq!(report.ok, 3);
    assert_eq!(report.errors, 2);
    assert_eq!(report.errors_by_kind.get("503"), Some(&1));
    assert_eq!(report.errors_by_kind.get("stream_error"), Some(&1));
    assert!((report.prefix_hit_rate.unwrap() - 0.5).abs() < 1e-9);
    assert_eq!(report.per_worker.get("a"), Some(&2));
    assert_eq!(report.per_worker.get("b"), Some(&1));
    assert!(report.ttft_ms.p50 >= FIRST_TOKEN_DELAY.as_secs_f64() * 1000.0);
    assert_eq!(report.itl_ms.count, 12);
}

#[tokio::test]
async fn concurrency_cap_is_respected() {
    let (url, fake) = serve().await;
    let client = BenchClient::new(&url, "m", Duration::from_secs(20)).unwrap();
    let reqs: Vec<Request> = (0..12)
        .map(|i| Request {
            arrival: Duration::ZERO,
            ..req(i, 5, "a")
        })
        .collect();
    let cfg = RunConfig {
        progress: false,
        concurrency: Some(3),
        ..RunConfig::default()
    };
    let result = run(&client, reqs, &cfg).await;
    assert!(result.outcomes.iter().all(|o| o.is_ok()));
    assert!(fake.max_in_flight.load(Ordering::SeqCst) <= 3);
}

#[tokio::test]
async fn connection_refused_is_an_error_not_a_panic() {
    let port = kvgate_bench::process::free_ports(1).unwrap()[0];
    let client = BenchClient::new(
        &format!("http://127.0.0.1:{port}"),
        "m",
        Duration::from_secs(5),
    )
    .unwrap();
    let cfg = RunConfig {
        progress: false,
        ..RunConfig::default()
    };
    let result = run(&client, vec![req(0, 5, "a")], &cfg).await;
    assert_eq!(result.outcomes[0].error.as_deref(), Some("connect"));
    let report = Report::from_run("down", &result);
    assert_eq!(report.errors_by_kind.get("connect"), Some(&1));
}
