//! Load nobody booked: requests that reach an engine without kvgate (a client calling
//! it directly) show in the engine's metrics, and kvgate counts them as that worker's
//! load, so least_loaded sends its own requests elsewhere; without the reads it cannot
//! tell the busy engine from the idle one.

mod common;

use std::time::Duration;

use common::*;
use kvgate_core::PolicyKind;
use kvgate_gateway::{start, WorkerConfig};
use kvgate_mock_engine::{spawn, EngineConfig, RunningEngine};
use serde_json::json;

/// Waits (up to 10 s) until the gateway's `series` gauge reads `value`.
async fn gauge_reaches(c: &reqwest::Client, gateway: &str, series: &str, value: f64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let text = metrics_text(c, gateway).await;
        if gauge_value(&text, series) == Some(value) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} never read {value}:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Where `n` short requests sent one after the other through the gateway went.
async fn route_some(c: &reqwest::Client, gateway: &str, n: usize) -> Vec<String> {
    let mut served = Vec::new();
    for i in 0..n {
        let body = json!({"model": "m", "prompt": format!("routed {i}"), "max_tokens": 1});
        let r = c
            .post(format!("{gateway}/v1/completions"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        served.push(worker_of(&r));
        let _ = r.bytes().await;
    }
    served
}

async fn engines() -> Vec<RunningEngine> {
    let mut out = Vec::new();
    for _ in 0..2 {
        out.push(spawn(EngineConfig::default()).await.unwrap());
    }
    out
}

#[tokio::test]
async fn requests_sent_to_an_engine_directly_count_as_its_load() {
    let engines = engines().await;
    let urls: Vec<String> = engines.iter().map(|e| e.base_url()).collect();
    let start_gateway = |interval_ms: u64| {
        let mut cfg = config(&[], PolicyKind::LeastLoaded);
        cfg.models[0].seed = Some(7);
        cfg.models[0].engine_metrics_interval_ms = interval_ms;
        cfg.models[0].workers = urls.iter().map(WorkerConfig::new).collect();
        start(cfg)
    };
    let gw = start_gateway(100).await.unwrap();
    let blind = start_gateway(0).await.unwrap();
    let c = client();
    // Six long requests straight to engine 0, streamed so they stay in flight.
    let direct = reqwest::Client::new();
    let mut held = Vec::new();
    for i in 0..6 {
        let body = json!({"model": "m", "prompt": format!("direct {i}"), "max_tokens": 4000, "stream": true});
        let r = direct
            .post(format!("{}/v1/completions", urls[0]))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        held.push(r);
    }
    let series = format!(
        "kvgate_worker_unseen_requests{{model=\"m\",worker=\"{}\"}}",
        urls[0]
    );
    gauge_reaches(&c, &gw.url(), &series, 6.0).await;
    let served = route_some(&c, &gw.url(), 8).await;
    assert!(served.iter().all(|w| *w == urls[1]), "{served:?}");
    // /v1/route/explain shows that load apart from the bookings.
    let explained = explain(
        &c,
        &gw.url(),
        &json!({"model": "m", "prompt": "why", "max_tokens": 1}),
    )
    .await;
    let busy = explained["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["worker"] == urls[0].as_str())
        .unwrap();
    assert_eq!(busy["unseen"]["in_flight"], 6, "{explained}");
    assert_eq!(busy["local"]["in_flight"], 0, "{explained}");
    assert_eq!(busy["in_flight"], 6, "{explained}");
    // The same fleet through a gateway that does not read the engines' queues: it
    // cannot see the load and splits its requests.
    let served = route_some(&c, &blind.url(), 8).await;
    assert!(served.iter().any(|w| *w == urls[0]), "{served:?}");
    // Once the direct requests end, engine 0 is idle again and gets traffic.
    drop(held);
    gauge_reaches(&c, &gw.url(), &series, 0.0).await;
    let served = route_some(&c, &gw.url(), 8).await;
    assert!(served.iter().any(|w| *w == urls[0]), "{served:?}");
}

/// The time model's explanation of one worker (its score line in explain).
async fn limits_of(c: &reqwest::Client, gateway: &str, worker: &str) -> serde_json::Value {
    let body = json!({"model": "m", "prompt": "why", "max_tokens": 1});
    let explained = explain(c, gateway, &body).await;
    explained["scores"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["worker"] == worker)
        .unwrap_or_else(|| panic!("{worker} in {explained}"))["engine_limits"]
        .clone()
}

/// Each engine's KV-cache size, as vLLM's metrics say it (`vllm:cache_config_info`'s
/// `num_gpu_blocks`), reaches that worker's time model; a size the model's
/// configuration names wins over what the engines say.
#[tokio::test]
async fn each_engines_kv_cache_size_comes_from_its_metrics() {
    let mut engines = Vec::new();
    for num_blocks in [300, 700] {
        let mut cfg = EngineConfig::default();
        cfg.sim.num_blocks = num_blocks;
        engines.push(spawn(cfg).await.unwrap());
    }
    let urls: Vec<String> = engines.iter().map(|e| e.base_url()).collect();
    let start_gateway = |configured: Option<u32>| {
        let mut cfg = config(&[], PolicyKind::LeastLoaded);
        cfg.models[0].engine_metrics_interval_ms = 50;
        cfg.models[0].num_gpu_blocks = configured;
        cfg.models[0].workers = urls.iter().map(WorkerConfig::new).collect();
        start(cfg)
    };
    let (read, told) = (
        start_gateway(None).await.unwrap(),
        start_gateway(Some(5000)).await.unwrap(),
    );
    let c = client();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    for (url, blocks) in urls.iter().zip([300, 700]) {
        loop {
            let limits = limits_of(&c, &read.url(), url).await;
            if limits["num_gpu_blocks"] == blocks {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "{url}: {limits}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            limits_of(&c, &told.url(), url).await["num_gpu_blocks"],
            5000
        );
    }
    // Over ten of its read intervals, the configured gateway keeps its own size (a
    // gateway that took the engines' would show 300 or 700 within one).
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while tokio::time::Instant::now() < until {
        for url in &urls {
            assert_eq!(
                limits_of(&c, &told.url(), url).await["num_gpu_blocks"],
                5000
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
