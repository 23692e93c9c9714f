//! Engines found through the Kubernetes API (`--features kubernetes`), against a fake
//! API server on loopback that lists and watches pods and InferencePools as the real
//! one does (a list at a resource version, then a change stream from it; objects that
//! stop matching a watch's label selector are sent as deleted), with pods in the API's
//! own format (`tests/fixtures/kubernetes/pods-*.json`: a running ready pod, another
//! one, a pod not ready, one being deleted, one pending). The gateway watches the pods
//! by label selector, adds the running ready ones as workers, routes to them, and
//! removes a pod that goes away; an API server that fails removes nothing.
#![cfg(feature = "kubernetes")]

mod common;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Query;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use common::*;
use kvgate_core::PolicyKind;
use kvgate_gateway::{start, WorkersKubernetesConfig};
use serde_json::{json, Value};

/// One change to the fake cluster's objects, at a resource version.
struct Change {
    version: u64,
    pod: bool,
    before: Option<Value>,
    after: Option<Value>,
}

#[derive(Default)]
struct Store {
    version: u64,
    changes: Vec<Change>,
    pods: BTreeMap<String, Value>,
    pool: Option<Value>,
    /// While set, every request is answered 500 and open watches end.
    broken: bool,
    failed: usize,
    /// Lists served (pods, pools): a watch that works lists once per selector.
    pod_lists: usize,
    pool_lists: usize,
    queries: Vec<String>,
}

/// A fake API server holding pods and one InferencePool (`llm/qwen3`).
#[derive(Clone)]
struct FakeCluster {
    store: Arc<Mutex<Store>>,
    changed: Arc<tokio::sync::watch::Sender<u64>>,
}

impl FakeCluster {
    fn new() -> Self {
        Self {
            store: Default::default(),
            changed: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    fn change(&self, pod: bool, name: &str, after: Option<Value>) {
        let mut s = self.store.lock().unwrap();
        s.version += 1;
        let version = s.version;
        let after = after.map(|mut obj| {
            obj["metadata"]["resourceVersion"] = json!(version.to_string());
            obj
        });
        let before = if pod {
            match &after {
                Some(obj) => s.pods.insert(name.to_owned(), obj.clone()),
                None => s.pods.remove(name),
            }
        } else {
            std::mem::replace(&mut s.pool, after.clone())
        };
        s.changes.push(Change {
            version,
            pod,
            before,
            after,
        });
        drop(s);
        self.changed.send_replace(version);
    }

    fn set_pod(&self, pod: Value) {
        let name = pod["metadata"]["name"].as_str().unwrap().to_owned();
        self.change(true, &name, Some(pod));
    }

    fn remove_pod(&self, name: &str) {
        self.change(true, name, None);
    }

    /// The pods become those of a PodList fixture.
    fn set_pods_from(&self, fixture_name: &str) {
        let list: Value = serde_json::from_str(&fixture(fixture_name)).unwrap();
        let items = list["items"].as_array().unwrap().clone();
        let names: Vec<String> = items
            .iter()
            .map(|p| p["metadata"]["name"].as_str().unwrap().to_owned())
            .collect();
        let gone: Vec<String> = self
            .store
            .lock()
            .unwrap()
            .pods
            .keys()
            .filter(|n| !names.contains(n))
            .cloned()
            .collect();
        for pod in items {
            self.set_pod(pod);
        }
        for name in gone {
            self.remove_pod(&name);
        }
    }

    fn set_pool(&self, pool: Value) {
        self.change(false, "qwen3", Some(pool));
    }

    fn set_broken(&self, broken: bool) {
        self.store.lock().unwrap().broken = broken;
        self.changed.send_modify(|_| {});
    }

    fn read<T>(&self, f: impl FnOnce(&Store) -> T) -> T {
        f(&self.store.lock().unwrap())
    }
}

fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/kubernetes")
        .join(name);
    std::fs::read_to_string(path).unwrap()
}

/// Whether `obj` has every label of `selector` (`k=v,...`; empty: all).
fn selected(obj: &Value, selector: &str) -> bool {
    selector
        .split(',')
        .filter(|kv| !kv.is_empty())
        .filter_map(|kv| kv.split_once('='))
        .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v))
}

/// What a watch from `from` (filtered by `selector`) sends for the changes after it:
/// an object that starts or stops matching is added or deleted.
fn watch_events(changes: &[Change], pod: bool, selector: &str, from: u64) -> Vec<Value> {
    changes
        .iter()
        .filter(|c| c.version > from && c.pod == pod)
        .filter_map(|c| {
            let was = c.before.as_ref().is_some_and(|o| selected(o, selector));
            let is = c.after.as_ref().is_some_and(|o| selected(o, selector));
            let kind = match (was, is) {
                (false, true) => "ADDED",
                (true, true) => "MODIFIED",
                (true, false) => "DELETED",
                (false, false) => return None,
            };
            let mut obj = c.after.clone().or_else(|| c.before.clone())?;
            obj["metadata"]["resourceVersion"] = json!(c.version.to_string());
            Some(json!({"type": kind, "object": obj}))
        })
        .collect()
}

async fn serve(cluster: FakeCluster, pod: bool, q: HashMap<String, String>) -> Response {
    let selector = q.get("labelSelector").cloned().unwrap_or_default();
    {
        let mut s = cluster.store.lock().unwrap();
        s.queries.push(
            q.iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join("&"),
        );
        if s.broken {
            s.failed += 1;
            let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": "etcd is down", "reason": "InternalError", "code": 500});
            return (
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                axum::Json(status),
            )
                .into_response();
        }
        if q.get("watch").map(String::as_str) != Some("true") {
            let items: Vec<Value> = if pod {
                s.pod_lists += 1;
                s.pods
                    .values()
                    .filter(|p| selected(p, &selector))
                    .cloned()
                    .collect()
            } else {
                s.pool_lists += 1;
                s.pool.iter().cloned().collect()
            };
            return axum::Json(json!({
                "kind": if pod { "PodList" } else { "InferencePoolList" },
                "apiVersion": "v1",
                "metadata": {"resourceVersion": s.version.to_string()},
                "items": items,
            }))
            .into_response();
        }
    }
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let rx = cluster.changed.subscribe();
    let state = (cluster, rx, from, VecDeque::<Value>::new());
    let events = futures::stream::unfold(state, move |(cluster, mut rx, mut from, mut queue)| {
        let selector = selector.clone();
        async move {
            loop {
                if let Some(event) = queue.pop_front() {
                    let line = format!("{event}\n");
                    return Some((
                        Ok::<_, std::convert::Infallible>(line),
                        (cluster, rx, from, queue),
                    ));
                }
                {
                    let s = cluster.store.lock().unwrap();
                    if s.broken {
                        return None;
                    }
                    queue.extend(watch_events(&s.changes, pod, &selector, from));
                    from = s.version;
                }
                if queue.is_empty() && rx.changed().await.is_err() {
                    return None;
                }
            }
        }
    });
    axum::body::Body::from_stream(events).into_response()
}

async fn fake_cluster(cluster: FakeCluster) -> String {
    let (pods, pools) = (cluster.clone(), cluster);
    let app = Router::new()
        .route(
            "/api/v1/namespaces/llm/pods",
            get(move |Query(q)| serve(pods.clone(), true, q)),
        )
        .route(
            "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools",
            get(move |Query(q)| serve(pools.clone(), false, q)),
        );
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

/// An API server that fails (500s, its watches cut) for a while: every request of the
/// discovery meanwhile fails, and the workers stay as they were.
async fn an_outage_removes_nothing(
    cluster: &FakeCluster,
    workers: impl Fn() -> Vec<(String, String)>,
) {
    let before = workers();
    let failed = cluster.read(|s| s.failed);
    cluster.set_broken(true);
    eventually(
        "the discovery retries against the failing API server",
        || cluster.read(|s| s.failed) >= failed + 2,
    )
    .await;
    assert_eq!(workers(), before, "an outage removes nothing");
    cluster.set_broken(false);
}

#[tokio::test]
async fn ready_pods_become_workers_and_a_deleted_pod_leaves() {
    let engine = fake("e", Behavior::default()).await;
    let port: u16 = engine.url.rsplit(':').next().unwrap().parse().unwrap();
    let cluster = FakeCluster::new();
    cluster.set_pods_from("pods-before.json");
    let api_url = fake_cluster(cluster.clone()).await;

    let mut config = config(&[], PolicyKind::RoundRobin);
    config.models[0].workers_kubernetes = Some(WorkersKubernetesConfig {
        namespace: Some("llm".into()),
        label_selector: "app=vllm,model=qwen3-8b".into(),
        port,
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
    let q = cluster.read(|s| s.queries[0].clone());
    assert!(
        q.contains("labelSelector=app=vllm,model=qwen3-8b"),
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

    // The second pod is being deleted: it leaves (told by the watch: no second list);
    // the first stays.
    cluster.set_pods_from("pods-after.json");
    eventually("the deleted pod leaves", || worker_urls(&gw) == ready[..1]).await;
    assert_eq!(
        cluster.read(|s| s.pod_lists),
        1,
        "watched, not listed again"
    );
    // An API server that fails removes nothing; once back, the watch goes on.
    let urls = || {
        worker_urls(&gw)
            .into_iter()
            .map(|u| (u, String::new()))
            .collect()
    };
    an_outage_removes_nothing(&cluster, urls).await;
    cluster.set_pods_from("pods-before.json");
    eventually("the pod is back after the outage", || {
        worker_urls(&gw) == ready
    })
    .await;
    gw.shutdown_within(Duration::from_secs(1)).await;
}

fn pod(name: &str, ip: &str, labels: &[(&str, &str)], ready: bool) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(*v)))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "labels": labels},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]
        }
    })
}

fn inference_pool(labels: &[(&str, &str)], ports: &[u16]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), Value::from(*v)))
        .collect();
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
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

/// The workers' ids by URL: a worker removed and added again gets a new id.
fn worker_ids(gw: &kvgate_gateway::RunningGateway) -> BTreeMap<String, String> {
    gw.gateway()
        .model("m")
        .unwrap()
        .workers()
        .iter()
        .map(|w| (w.url.to_string(), format!("{:?}", w.id)))
        .collect()
}

/// An InferencePool's pods, one endpoint per target port (KV events at 5557 + the
/// port's index), followed through the API's watches as pods become ready, go away or
/// are relabelled, and as the pool's own selector and ports change; a pool spec that
/// does not read, and an API server outage, remove nothing.
#[tokio::test]
async fn an_inference_pools_ready_pods_are_its_endpoints() {
    let cluster = FakeCluster::new();
    let vllm = [("app", "vllm"), ("model", "qwen3")];
    cluster.set_pod(pod("a", "10.0.0.1", &vllm, true));
    cluster.set_pod(pod("b", "10.0.0.2", &vllm, false));
    cluster.set_pod(pod("c", "10.0.0.3", &[("app", "other")], true));
    cluster.set_pool(inference_pool(&vllm, &[8000, 8001]));
    let api_url = fake_cluster(cluster.clone()).await;
    let mut config = config(&[], PolicyKind::RoundRobin);
    config.models[0].workers_kubernetes = Some(WorkersKubernetesConfig {
        namespace: Some("llm".into()),
        inference_pool: Some("qwen3".into()),
        kv_events_port: Some(5557),
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
    // A pod's two endpoints at target ports `first` and `first + 1`.
    let both_ports =
        |ip: &str, first: u16| [endpoint(ip, first, 5557), endpoint(ip, first + 1, 5558)];
    eventually("the ready pod's two ports join", || {
        workers_with_events(&gw) == both_ports("10.0.0.1", 8000)
    })
    .await;

    // b becomes ready: it joins; a goes away: it leaves.
    cluster.set_pod(pod("b", "10.0.0.2", &vllm, true));
    cluster.remove_pod("a");
    eventually("b replaces a", || {
        workers_with_events(&gw) == both_ports("10.0.0.2", 8000)
    })
    .await;

    // b relabelled out of the pool, c into it: c's endpoints replace b's.
    cluster.set_pod(pod(
        "b",
        "10.0.0.2",
        &[("app", "vllm"), ("model", "old")],
        true,
    ));
    cluster.set_pod(pod("c", "10.0.0.3", &vllm, true));
    eventually("relabelled pods follow", || {
        workers_with_events(&gw) == both_ports("10.0.0.3", 8000)
    })
    .await;
    assert_eq!(
        cluster.read(|s| (s.pod_lists, s.pool_lists)),
        (1, 1),
        "every change came through the watches"
    );

    // The pool itself changes: another selector, one port.
    cluster.set_pool(inference_pool(&[("model", "old")], &[9000]));
    eventually("the pool's new selector and port", || {
        workers_with_events(&gw) == [endpoint("10.0.0.2", 9000, 5557)]
    })
    .await;

    // A pool spec that does not read changes nothing: the pool's next good spec (a
    // port added) finds the endpoint it had, never removed meanwhile.
    let ids = worker_ids(&gw);
    cluster.set_pool(json!({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "qwen3", "namespace": "llm"}, "spec": {"selector": {}}}));
    cluster.set_pool(inference_pool(&[("model", "old")], &[9000, 9001]));
    eventually("the pool's next good spec", || {
        workers_with_events(&gw) == both_ports("10.0.0.2", 9000)
    })
    .await;
    let first = "http://10.0.0.2:9000";
    assert_eq!(
        worker_ids(&gw)[first],
        ids[first],
        "kept through the bad spec"
    );

    an_outage_removes_nothing(&cluster, || workers_with_events(&gw)).await;
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
