//! kv_aware end to end with simulated vLLM engines: KV events reach the index, a
//! repeated prompt goes to the worker holding its prefix, and the engine confirms the
//! cache hit and the per-worker prediction ratio stays honest; removing the worker
//! purges its index entries.

mod common;

use std::time::Duration;

use common::*;
use kvgate_core::{PolicyKind, WorkerRef};
use kvgate_gateway::{start, WorkerConfig};
use kvgate_mock_engine::{spawn, EngineConfig, RunningEngine};
use serde_json::{json, Value};

/// Two simulated engines with KV events (and replay) and a kv_aware config in front
/// of them (remote tokenization, block size 16).
async fn two_engines_with_events() -> (Vec<RunningEngine>, kvgate_gateway::Config) {
    let mut engines = Vec::new();
    for _ in 0..2 {
        engines.push(
            spawn(EngineConfig {
                speedup: 20.0,
                ..EngineConfig::default()
            })
            .await
            .unwrap(),
        );
    }
    let mut cfg = config(&[], PolicyKind::KvAware);
    cfg.models[0].remote_tokenize = true;
    cfg.models[0].block_size = 16;
    cfg.models[0].workers = engines
        .iter()
        .map(|e| WorkerConfig {
            kv_events: e.kv_events_endpoint.clone(),
            kv_events_replay: e.replay_endpoint.clone(),
            ..WorkerConfig::new(e.base_url())
        })
        .collect();
    (engines, cfg)
}

/// Waits until the gateway's subscribers hold a live connection to both engines.
async fn until_events_connected(gw: &kvgate_gateway::RunningGateway) {
    let g = gw.gateway().clone();
    eventually("event streams connected", || {
        let s = g.events.snapshot();
        s.workers.len() == 2 && s.workers.iter().all(|w| w.connected)
    })
    .await;
}

#[tokio::test]
async fn repeated_prompt_follows_its_cached_prefix() {
    let (engines, cfg) = two_engines_with_events().await;
    let gw = start(cfg).await.unwrap();
    let g = gw.gateway().clone();
    until_events_connected(&gw).await;

    let c = client();
    let prompt: String = (0..300).map(|i| format!("w{} ", i * 7 % 101)).collect();
    let body = json!({"model": "m", "prompt": prompt, "max_tokens": 2});
    let r = c
        .post(format!("{}/v1/completions", gw.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = worker_of(&r);
    let _: Value = r.json().await.unwrap();
    eventually("events reached the index", || {
        gw.index_len("m").unwrap_or(0) > 0
    })
    .await;

    for _ in 0..3 {
        let ex = explain(&c, &gw.url(), &body).await;
        assert_eq!(ex["worker"], first.as_str(), "{ex}");
        assert_eq!(
            ex["rule"], "cached",
            "explain names the rule that decided: {ex}"
        );
        assert!(
            ex["predicted_cached_tokens"].as_u64().unwrap() >= 16 * 10,
            "{ex}"
        );
        let r = c
            .post(format!("{}/v1/completions", gw.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(
            worker_of(&r),
            first,
            "the repeated prompt left its cached prefix"
        );
        let v: Value = r.json().await.unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        assert!(
            cached >= 16 * 10,
            "engine reported {cached} cached tokens: {v}"
        );
    }
    let metrics = metrics_text(&c, &gw.url()).await;
    assert!(
        metrics.contains("kvgate_reported_cached_tokens_total{model=\"m\"}"),
        "{metrics}"
    );
    // Each routed request is counted under the rule that decided it (explain is not a
    // routed request): the three repeats found their prefix.
    let by_rule = |rule: &str| {
        gauge_value(
            &metrics,
            &format!(
                "kvgate_routing_decisions_total{{model=\"m\",policy=\"kv_aware\",rule=\"{rule}\"}}"
            ),
        )
        .unwrap_or_else(|| panic!("no {rule} series: {metrics}"))
    };
    assert_eq!(by_rule("cached"), 3.0, "{metrics}");
    assert_eq!(
        by_rule("cached") + by_rule("least_work") + by_rule("warmup"),
        4.0
    );
    assert!(
        metrics.contains("kvgate_kv_events_blocks_stored_total"),
        "{metrics}"
    );
    // Prediction honesty per worker: predicted over reported cached tokens, and the
    // credit trust, for the worker that served the repeats.
    let ratio = gauge_value(
        &metrics,
        &format!("kvgate_worker_cached_tokens_prediction_ratio{{model=\"m\",worker=\"{first}\"}}"),
    )
    .unwrap_or_else(|| panic!("no prediction ratio for {first}: {metrics}"));
    assert!((0.8..=1.25).contains(&ratio), "prediction ratio {ratio}");
    let trust = gauge_value(
        &metrics,
        &format!("kvgate_worker_credit_trust{{model=\"m\",worker=\"{first}\"}}"),
    )
    .unwrap_or_else(|| panic!("no credit trust for {first}: {metrics}"));
    assert!(
        (0.0..=1.0).contains(&trust) && trust > 0.5,
        "credit trust {trust}"
    );

    // Removing the worker purges what the index says it holds.
    let m = g.model("m").unwrap().clone();
    let w = m.worker_by_url(&first).unwrap();
    assert!(
        m.index()
            .unwrap()
            .read()
            .worker_len(WorkerRef::new(w.id, 0))
            > 0
    );
    g.remove_worker("m", w.id).unwrap();
    assert_eq!(
        m.index()
            .unwrap()
            .read()
            .worker_len(WorkerRef::new(w.id, 0)),
        0
    );
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        m.index()
            .unwrap()
            .read()
            .worker_len(WorkerRef::new(w.id, 0)),
        0,
        "a stopped subscriber must not refill the index"
    );
    let r = c
        .post(format!("{}/v1/completions", gw.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_ne!(worker_of(&r), first);
    gw.shutdown().await;
    for e in engines {
        e.shutdown().await;
    }
}

/// Two consecutive free loopback ports (a worker's rank 0 and rank 1 event sockets).
fn consecutive_free_ports() -> u16 {
    for _ in 0..100 {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = a.local_addr().unwrap().port();
        if port < u16::MAX && std::net::TcpListener::bind(("127.0.0.1", port + 1)).is_ok() {
            return port;
        }
    }
    panic!("no two consecutive free ports");
}

/// A worker with two data-parallel ranks: a prompt that rank 1 holds is sent with
/// `x-data-parallel-rank: 1` (what vLLM's and SGLang's API servers read); a prompt no
/// rank holds goes without one, and the engine balances it.
#[tokio::test]
async fn requests_are_pinned_to_the_rank_holding_their_prompt() {
    let base = consecutive_free_ports();
    let tokenizer = fixtures().join("qwen3-tokenizer");
    let mut ranks = Vec::new();
    for r in 0..2u16 {
        ranks.push(
            spawn(EngineConfig {
                speedup: 20.0,
                tokenizer: Some(tokenizer.clone()),
                kv_events: Some(kvgate_mock_engine::PublisherConfig {
                    port: base + r,
                    replay_port: None,
                    dp_rank: u32::from(r),
                    ..Default::default()
                }),
                ..EngineConfig::default()
            })
            .await
            .unwrap(),
        );
    }
    // The worker's HTTP front records the rank header it is sent.
    let front = fake("dp", Behavior::default()).await;
    let mut cfg = config(&[], PolicyKind::KvAware);
    cfg.models[0].tokenizer = Some(tokenizer);
    cfg.models[0].workers = vec![WorkerConfig {
        kv_events: Some(format!("tcp://127.0.0.1:{base}")),
        dp_size: 2,
        ..WorkerConfig::new(front.url.clone())
    }];
    let gw = start(cfg).await.unwrap();
    let g = gw.gateway().clone();
    eventually("the worker's event streams connected", || {
        let s = g.events.snapshot();
        s.workers.len() == 1 && s.workers.iter().all(|w| w.connected)
    })
    .await;
    let c = client();
    // Rank 1 caches a prompt (again with a new one until its events reach the index:
    // a SUB socket misses what is published before it is connected).
    let mut body = json!({});
    for attempt in 0..100 {
        let prompt: String = (0..200).map(|i| format!("w{attempt}x{i} ")).collect();
        body = json!({"model": "m", "prompt": prompt, "max_tokens": 2});
        let direct = c
            .post(format!("{}/v1/completions", ranks[1].base_url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(direct.status(), 200);
        tokio::time::sleep(Duration::from_millis(100)).await;
        if gw.index_len("m").unwrap_or(0) > 0 {
            break;
        }
    }
    assert!(
        gw.index_len("m").unwrap_or(0) > 0,
        "rank 1's blocks indexed"
    );
    let routed = c
        .post(format!("{}/v1/completions", gw.url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(routed.status(), 200);
    assert_eq!(front.stats.last_dp_rank.lock().as_deref(), Some("1"));
    let cold: String = (0..200).map(|i| format!("z{i} ")).collect();
    let routed = c
        .post(format!("{}/v1/completions", gw.url()))
        .json(&json!({"model": "m", "prompt": cold, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(routed.status(), 200);
    assert_eq!(front.stats.last_dp_rank.lock().as_deref(), None);
    gw.shutdown().await;
}

/// An engine core that hangs behind an API server that still answers (vLLM's
/// `/health` says 200 while its engine process is stopped): once it has held requests
/// for `health.stall_ms` without an answer byte or a KV event, kvgate takes it out of
/// rotation and cuts its requests off, so those waiting for their first event finish
/// on the other worker instead of waiting out the hang (the first-byte timeout is 600
/// s); while it hangs a one-token probe keeps it out, and once it generates again it is
/// back in rotation.
#[tokio::test]
async fn a_stalled_engine_is_cut_off_and_rejoins_once_it_generates() {
    let (engines, mut cfg) = two_engines_with_events().await;
    cfg.health.interval_ms = 200;
    cfg.health.timeout_ms = 500;
    cfg.health.stall_ms = 1_000;
    let gw = start(cfg).await.unwrap();
    let g = gw.gateway().clone();
    until_events_connected(&gw).await;
    let c = client();
    let url = gw.url();
    let send = |prompt: String, stream: bool| {
        let c = c.clone();
        let url = url.clone();
        async move {
            let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": stream});
            let r = c
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let status = r.status();
            let worker = worker_of(&r);
            let text = r.text().await.unwrap();
            (status, worker, text)
        }
    };
    // Both engines serve and publish KV events (a SUB socket misses what is published
    // before it connects, so until each engine's events were seen).
    for i in 0.. {
        send(format!("warm {i} {}", "x ".repeat(64)), false).await;
        let s = g.events.snapshot();
        if s.workers.iter().all(|w| w.batches > 0) {
            break;
        }
        assert!(i < 200, "events never arrived: {s:?}");
    }
    let hung = engines[0].base_url();
    let healthy = engines[1].base_url();
    let raw = reqwest::Client::new();
    let r = raw
        .post(format!("{hung}/fault/engine/hang?ms=6000"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let health = raw.get(format!("{hung}/health")).send().await.unwrap();
    assert_eq!(health.status(), 200, "the API server still answers");
    // Streams sent during the hang, two of them to the hung engine (their prompts'
    // homes), all end whole on the other engine, before the hang is over.
    let mut prompts = Vec::new();
    for i in 0..200 {
        let prompt = format!("during {i}");
        let body = json!({"model": "m", "prompt": prompt, "max_tokens": 4});
        if explain(&c, &url, &body).await["worker"] == hung.as_str() {
            prompts.push(prompt);
        }
        if prompts.len() == 2 {
            break;
        }
    }
    assert_eq!(prompts.len(), 2);
    prompts.extend(["other 1".to_string(), "other 2".to_string()]);
    let counted_before: f64 = requests_counted(&metrics_text(&c, &url).await)
        .values()
        .sum();
    let started = std::time::Instant::now();
    let outcomes = futures::future::join_all(prompts.into_iter().map(|p| send(p, true))).await;
    for (status, worker, text) in &outcomes {
        assert_eq!(*status, 200, "{text}");
        assert_eq!(worker, &healthy, "{text}");
        assert!(text.contains("[DONE]"), "{text}");
    }
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "they waited for the hang to end: {:?}",
        started.elapsed()
    );
    let metrics = metrics_text(&c, &url).await;
    // Each counted once, as answered by the healthy worker (the attempts the stall cut
    // off are not counted).
    let counted: f64 = requests_counted(&metrics).values().sum();
    assert_eq!(counted - counted_before, 4.0);
    let stalls = format!("kvgate_worker_stalls_total{{model=\"m\",worker=\"{hung}\"}}");
    assert_eq!(gauge_value(&metrics, &stalls), Some(1.0), "{metrics}");
    // While it hangs it stays out (its health check says 200; the generation probe
    // gets nothing).
    for i in 0..4 {
        let (status, worker, _) = send(format!("still {i}"), false).await;
        assert_eq!((status.as_u16(), worker), (200, healthy.clone()));
    }
    // Once its engine generates again it is back in rotation.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, worker, _) = send("after".into(), false).await;
        assert_eq!(status, 200);
        if worker == hung {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the engine never came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    gw.shutdown().await;
}
