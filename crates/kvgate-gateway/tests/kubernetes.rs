//! Engines found through the Kubernetes API (`--features kubernetes`), against a fake
//! API server on loopback that answers pod lists in the API's own format
//! (`tests/fixtures/kubernetes/pods-*.json`: a running ready pod, another one, a pod
//! not ready, one being deleted, one pending). The gateway lists the pods by label
//! selector, adds the running ready ones as workers, routes to them, and removes a pod
//! that goes away.
#![cfg(feature = "kubernetes")]

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{RawQuery, State};
use axum::routing::get;
use axum::Router;
use common::*;
use kvgate_core::PolicyKind;
use kvgate_gateway::{start, WorkersKubernetesConfig};

#[derive(Clone, Default)]
struct FakeApi {
    pods: Arc<Mutex<String>>,
    queries: Arc<Mutex<Vec<String>>>,
}

async fn list_pods(State(api): State<FakeApi>, RawQuery(q): RawQuery) -> axum::response::Response {
    api.queries.lock().unwrap().push(q.unwrap_or_default());
    let body = api.pods.lock().unwrap().clone();
    axum::response::Response::builder()
        .header("content-type", "application/json")
        .body(axum::body::Body::from(body))
        .unwrap()
}

fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kubernetes")
        .join(name);
    std::fs::read_to_string(path).unwrap()
}

async fn fake_api(api: FakeApi) -> String {
    let app = Router::new()
        .route("/api/v1/namespaces/llm/pods", get(list_pods))
        .with_state(api);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

fn worker_urls(gw: &kvgate_gateway::RunningGateway) -> Vec<String> {
    let mut urls: Vec<String> = gw
        .gateway()
        .model("m")
        .unwrap()
        .workers()
        .iter()
        .map(|w| w.url.to_string())
        .collect();
    urls.sort();
    urls
}

#[tokio::test]
async fn ready_pods_become_workers_and_a_deleted_pod_leaves() {
    let engine = fake("e", Behavior::default()).await;
    let port: u16 = engine.url.rsplit(':').next().unwrap().parse().unwrap();
    let api = FakeApi::default();
    *api.pods.lock().unwrap() = fixture("pods-before.json");
    let api_url = fake_api(api.clone()).await;

    let mut config = config(&[], PolicyKind::RoundRobin);
    config.models[0].workers_kubernetes = Some(WorkersKubernetesConfig {
        namespace: Some("llm".into()),
        label_selector: "app=vllm,model=qwen3-8b".into(),
        port,
        refresh_ms: 100,
        api_url: Some(api_url),
        ..WorkersKubernetesConfig::default()
    });
    let gw = start(config).await.unwrap();
    let ready = vec![
        format!("http://127.0.0.1:{port}"),
        format!("http://127.0.0.2:{port}"),
    ];
    eventually("the two running, ready pods join", || {
        worker_urls(&gw) == ready
    })
    .await;
    let q = api.queries.lock().unwrap()[0].clone();
    assert!(
        q.contains("labelSelector=app%3Dvllm%2Cmodel%3Dqwen3-8b"),
        "the pods are listed by the configured selector: {q}"
    );

    // The pod at 127.0.0.1 is the engine: requests reach it (the other address
    // refuses connections and its requests fail over).
    let c = client();
    for _ in 0..4 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(worker_of(&r), ready[0]);
    }

    // The second pod is being deleted: it leaves; the first stays.
    *api.pods.lock().unwrap() = fixture("pods-after.json");
    eventually("the deleted pod leaves", || worker_urls(&gw) == ready[..1]).await;
    // An API server that stops answering removes nothing.
    *api.pods.lock().unwrap() = "not json".into();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(worker_urls(&gw), ready[..1]);
    gw.shutdown_within(Duration::from_secs(1)).await;
}
