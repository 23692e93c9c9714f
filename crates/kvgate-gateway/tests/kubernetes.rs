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

/// A fake API server holding pods (filtered by the list's label selector, as the real
/// one does) and one InferencePool.
#[derive(Clone, Default)]
struct FakeCluster {
    pods: Arc<Mutex<Vec<serde_json::Value>>>,
    pool: Arc<Mutex<serde_json::Value>>,
    /// How often the pool was read (each refresh reads it once).
    pool_reads: Arc<std::sync::atomic::AtomicUsize>,
}

fn pod(name: &str, ip: &str, labels: &[(&str, &str)], ready: bool) -> serde_json::Value {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
        .collect();
    serde_json::json!({
        "metadata": {"name": name, "namespace": "llm", "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
        }
    })
}

fn inference_pool(labels: &[(&str, &str)], ports: &[u16]) -> serde_json::Value {
    let labels: serde_json::Map<String, serde_json::Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
        .collect();
    let ports: Vec<serde_json::Value> = ports
        .iter()
        .map(|p| serde_json::json!({"number": p}))
        .collect();
    serde_json::json!({
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": "qwen3", "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": labels},
            "targetPorts": ports,
            "endpointPickerRef": {"name": "kvgate-epp", "port": {"number": 9002}}
        }
    })
}

async fn fake_cluster(cluster: FakeCluster) -> String {
    use axum::extract::Query;
    use std::collections::HashMap;
    async fn pods(
        State(c): State<FakeCluster>,
        Query(q): Query<HashMap<String, String>>,
    ) -> axum::Json<serde_json::Value> {
        let selector: Vec<(String, String)> = q
            .get("labelSelector")
            .map(|s| {
                s.split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let items: Vec<serde_json::Value> = c
            .pods
            .lock()
            .unwrap()
            .iter()
            .filter(|p| {
                selector
                    .iter()
                    .all(|(k, v)| p["metadata"]["labels"][k].as_str() == Some(v.as_str()))
            })
            .cloned()
            .collect();
        axum::Json(serde_json::json!({
            "kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items
        }))
    }
    async fn pool(State(c): State<FakeCluster>) -> axum::Json<serde_json::Value> {
        c.pool_reads
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        axum::Json(c.pool.lock().unwrap().clone())
    }
    let app = Router::new()
        .route("/api/v1/namespaces/llm/pods", get(pods))
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools/qwen3",
            get(pool),
        )
        .with_state(cluster);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    url
}

/// Workers and their KV-event endpoints, sorted.
fn workers_with_events(gw: &kvgate_gateway::RunningGateway) -> Vec<(String, String)> {
    let mut w: Vec<(String, String)> = gw
        .gateway()
        .model("m")
        .unwrap()
        .workers()
        .iter()
        .map(|w| {
            (
                w.url.to_string(),
                w.config.kv_events.clone().unwrap_or_default(),
            )
        })
        .collect();
    w.sort();
    w
}

/// An InferencePool's pods, one endpoint per target port (KV events at 5557 + the
/// port's index), followed as pods become ready, go away or are relabelled, and as the
/// pool's own selector and ports change.
#[tokio::test]
async fn an_inference_pools_ready_pods_are_its_endpoints() {
    let cluster = FakeCluster::default();
    let vllm = [("app", "vllm"), ("model", "qwen3")];
    *cluster.pods.lock().unwrap() = vec![
        pod("a", "10.0.0.1", &vllm, true),
        pod("b", "10.0.0.2", &vllm, false),
        pod("c", "10.0.0.3", &[("app", "other")], true),
    ];
    *cluster.pool.lock().unwrap() = inference_pool(&vllm, &[8000, 8001]);
    let api_url = fake_cluster(cluster.clone()).await;
    let mut config = config(&[], PolicyKind::RoundRobin);
    config.models[0].workers_kubernetes = Some(WorkersKubernetesConfig {
        namespace: Some("llm".into()),
        inference_pool: Some("qwen3".into()),
        kv_events_port: Some(5557),
        refresh_ms: 50,
        api_url: Some(api_url),
        ..WorkersKubernetesConfig::default()
    });
    let gw = start(config).await.unwrap();
    let endpoint = |ip: &str, port: u16, events: u16| {
        (
            format!("http://{ip}:{port}"),
            format!("tcp://{ip}:{events}"),
        )
    };
    eventually("the ready pod's two ports join", || {
        workers_with_events(&gw)
            == [
                endpoint("10.0.0.1", 8000, 5557),
                endpoint("10.0.0.1", 8001, 5558),
            ]
    })
    .await;

    // b becomes ready: it joins; a goes away: it leaves.
    cluster.pods.lock().unwrap()[1] = pod("b", "10.0.0.2", &vllm, true);
    cluster.pods.lock().unwrap().remove(0);
    eventually("b replaces a", || {
        workers_with_events(&gw)
            == [
                endpoint("10.0.0.2", 8000, 5557),
                endpoint("10.0.0.2", 8001, 5558),
            ]
    })
    .await;

    // b relabelled out of the pool, c into it: c's endpoints replace b's.
    *cluster.pods.lock().unwrap() = vec![
        pod("b", "10.0.0.2", &[("app", "vllm"), ("model", "old")], true),
        pod("c", "10.0.0.3", &vllm, true),
    ];
    eventually("relabelled pods follow", || {
        workers_with_events(&gw)
            == [
                endpoint("10.0.0.3", 8000, 5557),
                endpoint("10.0.0.3", 8001, 5558),
            ]
    })
    .await;

    // The pool itself changes: another selector, one port.
    *cluster.pool.lock().unwrap() = inference_pool(&[("model", "old")], &[9000]);
    eventually("the pool's new selector and port", || {
        workers_with_events(&gw) == [endpoint("10.0.0.2", 9000, 5557)]
    })
    .await;

    // A pool the API server cannot serve removes nothing, however many refreshes read it.
    *cluster.pool.lock().unwrap() = serde_json::json!({"kind": "Status", "code": 404});
    let reads = || cluster.pool_reads.load(std::sync::atomic::Ordering::SeqCst);
    let before = reads();
    eventually("three refreshes read the broken pool", || {
        reads() >= before + 3
    })
    .await;
    assert_eq!(workers_with_events(&gw), [endpoint("10.0.0.2", 9000, 5557)]);
    gw.shutdown_within(Duration::from_secs(1)).await;
}

#[test]
fn an_inference_pool_spec_is_read_strictly() {
    use kvgate_gateway::discovery::kubernetes::pool_spec;
    let ok = serde_json::json!({"selector": {"matchLabels": {"model": "q", "app": "vllm"}}, "targetPorts": [{"number": 8000}]});
    assert_eq!(
        pool_spec(&ok).unwrap(),
        ("app=vllm,model=q".to_owned(), vec![8000])
    );
    for bad in [
        serde_json::json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}),
        serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}),
        serde_json::json!({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 70000}]}),
        serde_json::json!({"selector": {"matchLabels": {"a": "b"}}}),
    ] {
        assert!(pool_spec(&bad).is_err(), "{bad}");
    }
}
