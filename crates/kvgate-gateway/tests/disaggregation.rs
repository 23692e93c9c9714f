//! Prefill/decode disaggregation end to end, with simulated engines in their roles:
//! vLLM's flow (prefill with kv_transfer_params, then decode with the prefill answer's
//! parameters) and SGLang's (both at once, paired by a bootstrap room), streamed and
//! not; the prefill worker chosen by kv_aware on the prefill pool's index; a client
//! that leaves in either leg frees both bookings; a dead prefill worker before the
//! first byte is failed over (or is a clean error, never a hang); short prompts skip
//! the split.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvgate_core::PolicyKind;
use kvgate_gateway::config::{PdConfig, PdMode};
use kvgate_gateway::{start, Gateway, RunningGateway, WorkerConfig};
use kvgate_mock_engine::disaggregation::{PdConfig as EnginePd, PdMode as EngineMode, PdRole};
use kvgate_mock_engine::{spawn, EngineConfig, RunningEngine};
use serde_json::{json, Value};

struct Fleet {
    prefill: Vec<RunningEngine>,
    decode: Vec<RunningEngine>,
}

async fn engine(role: PdRole, mode: EngineMode, speedup: f64) -> RunningEngine {
    spawn(EngineConfig {
        speedup,
        pd: Some(EnginePd {
            role,
            mode,
            bootstrap_port: 0,
            transfer_timeout: Duration::from_secs(10),
        }),
        ..EngineConfig::default()
    })
    .await
    .unwrap()
}

async fn fleet(mode: PdMode, prefill: usize, decode: usize, speedup: f64) -> Fleet {
    let mode = match mode {
        PdMode::Vllm => EngineMode::Vllm,
        PdMode::Sglang => EngineMode::Sglang,
    };
    let mut f = Fleet {
        prefill: Vec::new(),
        decode: Vec::new(),
    };
    for _ in 0..prefill {
        f.prefill.push(engine(PdRole::Prefill, mode, speedup).await);
    }
    for _ in 0..decode {
        f.decode.push(engine(PdRole::Decode, mode, speedup).await);
    }
    f
}

fn worker_of_engine(e: &RunningEngine) -> WorkerConfig {
    WorkerConfig {
        kv_events: e.kv_events_endpoint.clone(),
        kv_events_replay: e.replay_endpoint.clone(),
        bootstrap_port: e.bootstrap_addr.map(|a| a.port()),
        ..WorkerConfig::new(e.base_url())
    }
}

/// A gateway config over the fleet: `policy` on the prefill pool (remote
/// tokenization), the decode pool's default policy.
fn pd_config(f: &Fleet, mode: PdMode, policy: PolicyKind) -> kvgate_gateway::Config {
    let mut cfg = config(&[], policy);
    let m = &mut cfg.models[0];
    m.remote_tokenize = true;
    m.workers = f.decode.iter().map(worker_of_engine).collect();
    m.pd = Some(PdConfig {
        mode,
        prefill_workers: f.prefill.iter().map(worker_of_engine).collect(),
        ..PdConfig::default()
    });
    cfg
}

/// The prefill pool's config of a [`pd_config`].
fn pd_of(cfg: &mut kvgate_gateway::Config) -> &mut PdConfig {
    cfg.models[0].pd.as_mut().unwrap()
}

/// A gateway started from [`pd_config`], plus `extra_prefill` URLs in the prefill pool,
/// once the pools' event streams are connected.
async fn gateway(
    f: &Fleet,
    mode: PdMode,
    policy: PolicyKind,
    extra_prefill: &[String],
) -> RunningGateway {
    let mut cfg = pd_config(f, mode, policy);
    for url in extra_prefill {
        pd_of(&mut cfg).prefill_workers.push(WorkerConfig {
            bootstrap_port: Some(1),
            ..WorkerConfig::new(url.clone())
        });
    }
    let gw = start(cfg).await.unwrap();
    let g = gw.gateway().clone();
    // Pools whose policy keeps an index follow their engines' events.
    let sources = f.decode.len()
        + if policy == PolicyKind::KvAware {
            f.prefill.len()
        } else {
            0
        };
    eventually("event streams connected", || {
        let s = g.events.snapshot();
        s.workers.len() == sources && s.workers.iter().all(|w| w.connected)
    })
    .await;
    gw
}

fn prefill_pool(gw: &Gateway) -> Arc<kvgate_gateway::registry::ModelState> {
    gw.model("m")
        .unwrap()
        .prefill
        .as_ref()
        .unwrap()
        .pool
        .clone()
}

fn in_flight(model: &kvgate_gateway::registry::ModelState) -> u64 {
    model.ledger().stats().active
}

fn prompt(tag: &str, words: usize) -> String {
    (0..words).map(|i| format!("{tag}{i} ")).collect()
}

fn chat(content: &str, stream: bool, max_tokens: u32) -> Value {
    json!({"model": "m", "stream": stream, "max_tokens": max_tokens,
           "stream_options": {"include_usage": true},
           "messages": [{"role": "user", "content": content}]})
}

fn header(resp: &reqwest::Response, name: &str) -> String {
    resp.headers()
        .get(name)
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default()
}

/// A counter of an engine's /metrics, summed over its series.
async fn engine_counter(c: &reqwest::Client, e: &RunningEngine, name: &str) -> f64 {
    let text = c
        .get(format!("{}/metrics", e.base_url()))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .filter(|l| l.starts_with(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Both flows, streamed and not: the answer comes from a decode worker, names its
/// prefill worker, and the decode engines computed none of the prompt (they received
/// it) while the prefill engines computed it.
async fn split_requests_are_answered_by_decode_with_the_prefill_kv(mode: PdMode) {
    let f = fleet(mode, 2, 2, 20.0).await;
    let gw = gateway(&f, mode, PolicyKind::KvAware, &[]).await;
    let c = client();
    let prefill_urls: Vec<String> = f.prefill.iter().map(|e| e.base_url()).collect();
    let decode_urls: Vec<String> = f.decode.iter().map(|e| e.base_url()).collect();
    for (i, stream) in [false, true, false, true].into_iter().enumerate() {
        let resp = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat(&prompt(&format!("r{i}w"), 80), stream, 6))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{mode}: {:?}", resp.text().await);
        assert!(decode_urls.contains(&worker_of(&resp)), "{mode}");
        assert!(
            prefill_urls.contains(&header(&resp, "x-kvgate-prefill-worker")),
            "{mode}"
        );
        let text = resp.text().await.unwrap();
        if stream {
            assert!(text.trim_end().ends_with("data: [DONE]"), "{mode}: {text}");
            assert!(text.contains("\"usage\""), "{mode}: {text}");
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["usage"]["completion_tokens"], 6, "{mode}: {text}");
            assert!(v.get("kv_transfer_params").is_none(), "{mode}: {text}");
        }
    }
    let mut computed_on_decode = 0.0;
    let mut transferred = 0.0;
    for e in &f.decode {
        computed_on_decode += engine_counter(&c, e, "kvgate_mock:prompt_tokens_computed").await;
        transferred += engine_counter(&c, e, "kvgate_mock:prompt_tokens_transferred").await;
    }
    let mut computed_on_prefill = 0.0;
    for e in &f.prefill {
        computed_on_prefill += engine_counter(&c, e, "kvgate_mock:prompt_tokens_computed").await;
    }
    assert!(
        transferred > 300.0,
        "{mode}: {transferred} tokens transferred"
    );
    assert!(computed_on_prefill >= transferred, "{mode}");
    // One token per request at most is computed where the prompt was received.
    assert!(
        computed_on_decode <= 4.0,
        "{mode}: decode computed {computed_on_decode}"
    );
    // Every booking ended with its leg.
    let g = gw.gateway().clone();
    eventually("bookings freed", || {
        in_flight(&prefill_pool(&g)) == 0 && in_flight(g.model("m").unwrap()) == 0
    })
    .await;
    // Each request counted once (not once per leg), as answered by its decode worker.
    let counted = requests_counted(&metrics_text(&c, &gw.url()).await);
    assert_eq!(counted.values().sum::<f64>(), 4.0, "{mode}: {counted:?}");
    for labels in counted.keys() {
        assert!(labels.contains("status=\"200\""), "{mode}: {labels}");
        assert!(
            decode_urls
                .iter()
                .any(|u| labels.contains(&format!("worker=\"{u}\""))),
            "{mode}: {labels}"
        );
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn vllm_split_requests_are_answered_by_decode_with_the_prefill_kv() {
    split_requests_are_answered_by_decode_with_the_prefill_kv(PdMode::Vllm).await;
}

#[tokio::test]
async fn sglang_split_requests_are_answered_by_decode_with_the_prefill_kv() {
    split_requests_are_answered_by_decode_with_the_prefill_kv(PdMode::Sglang).await;
}

/// kv_aware on the prefill pool's index: a repeated prompt's prefill goes back to the
/// prefill worker that holds it, and that engine serves it from its cache.
#[tokio::test]
async fn repeated_prompts_prefill_where_their_kv_is() {
    let f = fleet(PdMode::Vllm, 2, 2, 20.0).await;
    let gw = gateway(&f, PdMode::Vllm, PolicyKind::KvAware, &[]).await;
    let c = client();
    let g = gw.gateway().clone();
    for tag in ["alpha", "beta", "gamma"] {
        let body = chat(&prompt(tag, 200), false, 2);
        let first = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(first.status(), 200);
        let holder = header(&first, "x-kvgate-prefill-worker");
        // The holder's blocks reach the prefill pool's index.
        let pool = prefill_pool(&g);
        let id = pool.worker_by_url(&holder).unwrap().id;
        eventually("prefill blocks indexed", || {
            pool.selection
                .snapshot_rank(id, 0)
                .is_some_and(|s| !s.blocks.is_empty())
        })
        .await;
        let again = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(header(&again, "x-kvgate-prefill-worker"), holder, "{tag}");
        // /v1/route/explain shows both choices, the prefill one with its overlap.
        let ex = explain(&c, &gw.url(), &body).await;
        assert_eq!(ex["prefill"]["worker"], holder.as_str(), "{tag}: {ex}");
        assert!(
            ex["prefill"]["predicted_cached_tokens"].as_u64().unwrap() > 0,
            "{ex}"
        );
        assert_eq!(ex["skips_prefill"], false, "{ex}");
        assert!(ex["worker"].is_string(), "{ex}");
    }
    let hits: f64 = {
        let mut h = 0.0;
        for e in &f.prefill {
            h += engine_counter(&c, e, "vllm:prefix_cache_hits").await;
        }
        h
    };
    assert!(hits > 0.0, "the prefill engines served repeats from cache");
    gw.shutdown().await;
}

/// A client that leaves during the prefill leg ends it: the prefill booking is freed
/// and no decode leg starts.
#[tokio::test]
async fn a_client_leaving_during_prefill_frees_everything() {
    for mode in [PdMode::Vllm, PdMode::Sglang] {
        // Slow engines: a long prompt's prefill takes a while.
        let f = fleet(mode, 1, 1, 0.05).await;
        let gw = gateway(&f, mode, PolicyKind::RoundRobin, &[]).await;
        let g = gw.gateway().clone();
        let url = format!("{}/v1/chat/completions", gw.url());
        let body = chat(&prompt("slow", 3000), false, 4);
        let request = tokio::spawn(async move { client().post(url).json(&body).send().await });
        let pool = prefill_pool(&g);
        eventually("prefill leg booked", || in_flight(&pool) == 1).await;
        request.abort();
        eventually("prefill booking freed", || in_flight(&pool) == 0).await;
        eventually("decode never booked, or freed", || {
            in_flight(g.model("m").unwrap()) == 0
        })
        .await;
        gw.shutdown().await;
    }
}

/// A client that leaves during the decode leg's stream frees the decode booking (and
/// the engine stops generating).
#[tokio::test]
async fn a_client_leaving_during_decode_frees_everything() {
    for mode in [PdMode::Vllm, PdMode::Sglang] {
        let f = fleet(mode, 1, 1, 1.0).await;
        let gw = gateway(&f, mode, PolicyKind::RoundRobin, &[]).await;
        let g = gw.gateway().clone();
        let mut resp = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat(&prompt("long", 40), true, 5000))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{mode}");
        assert!(
            resp.chunk().await.unwrap().is_some(),
            "{mode}: a first chunk"
        );
        assert_eq!(in_flight(g.model("m").unwrap()), 1, "{mode}: decode booked");
        drop(resp);
        eventually("decode booking freed", || {
            in_flight(g.model("m").unwrap()) == 0 && in_flight(&prefill_pool(&g)) == 0
        })
        .await;
        let decode = &f.decode[0];
        let c = client();
        let mut running = 1.0;
        for _ in 0..200 {
            running = engine_counter(&c, decode, "vllm:num_requests_running").await;
            if running == 0.0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(running, 0.0, "{mode}: the decode engine stopped generating");
        gw.shutdown().await;
    }
}

/// A dead prefill worker before the first byte: its requests go to another prefill
/// worker (vLLM: the prefill leg fails over; SGLang: the pair is tried again with a new
/// room). With no prefill worker alive, a clean JSON error comes quickly.
#[tokio::test]
async fn a_dead_prefill_worker_is_failed_over_or_a_clean_error() {
    for mode in [PdMode::Vllm, PdMode::Sglang] {
        let f = fleet(mode, 1, 1, 20.0).await;
        let dead = dead_url().await;
        let gw = gateway(
            &f,
            mode,
            PolicyKind::RoundRobin,
            std::slice::from_ref(&dead),
        )
        .await;
        let c = client();
        for i in 0..4 {
            let resp = c
                .post(format!("{}/v1/chat/completions", gw.url()))
                .json(&chat(&prompt(&format!("d{i}x"), 20), i % 2 == 1, 3))
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 200, "{mode}: {:?}", resp.text().await);
            assert_eq!(
                header(&resp, "x-kvgate-prefill-worker"),
                f.prefill[0].base_url(),
                "{mode}"
            );
            resp.text().await.unwrap();
        }
        gw.shutdown().await;

        // Only dead prefill workers: an error, fast, in OpenAI's shape.
        let decode_only = fleet(mode, 0, 1, 20.0).await;
        let gw = gateway(
            &decode_only,
            mode,
            PolicyKind::RoundRobin,
            &[dead.clone(), dead_url().await],
        )
        .await;
        let started = std::time::Instant::now();
        let resp = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat("nobody prefills this", true, 3))
            .send()
            .await
            .unwrap();
        assert!(
            resp.status() == 502 || resp.status() == 503,
            "{mode}: {}",
            resp.status()
        );
        let v: Value = resp.json().await.unwrap();
        assert!(v["error"]["message"].is_string(), "{mode}: {v}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{mode}: answered in {:?}",
            started.elapsed()
        );
        assert_eq!(in_flight(gw.gateway().model("m").unwrap()), 0, "{mode}");
        gw.shutdown().await;
    }
}

/// With a threshold, short prompts skip the split (no prefill worker named) and long
/// ones take it.
#[tokio::test]
async fn short_prompts_skip_the_split() {
    let f = fleet(PdMode::Vllm, 1, 1, 20.0).await;
    let mut cfg = pd_config(&f, PdMode::Vllm, PolicyKind::RoundRobin);
    pd_of(&mut cfg).uncached_token_threshold = 100;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let short = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat("a short question", false, 2))
        .send()
        .await
        .unwrap();
    assert_eq!(short.status(), 200);
    assert_eq!(header(&short, "x-kvgate-prefill-worker"), "");
    assert_eq!(worker_of(&short), f.decode[0].base_url());
    let long = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat(&prompt("long", 600), false, 2))
        .send()
        .await
        .unwrap();
    assert_eq!(long.status(), 200);
    assert_eq!(
        header(&long, "x-kvgate-prefill-worker"),
        f.prefill[0].base_url()
    );
    // /ready counts both pools.
    let ready: Value = c
        .get(format!("{}/ready", gw.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let m = &ready["models"][0];
    assert_eq!(
        (
            &m["workers"],
            &m["healthy"],
            &m["prefill_workers"],
            &m["prefill_healthy"]
        ),
        (&json!(1), &json!(1), &json!(1), &json!(1)),
        "{ready}"
    );
    let metrics = metrics_text(&c, &gw.url()).await;
    for series in [
        "kvgate_disaggregated_requests_total{model=\"m\",route=\"whole\"} 1",
        "kvgate_disaggregated_requests_total{model=\"m\",route=\"split\"} 1",
        "kvgate_disaggregated_requests_total{model=\"m\",route=\"handover_failed\"} 0",
    ] {
        assert!(metrics.contains(series), "{series} missing:\n{metrics}");
    }
    gw.shutdown().await;
}

/// The decode engine refuses parameters that name KV no prefill engine holds (the
/// mock keeps the real engines' contract, so a router that forwards the wrong
/// parameters fails its tests).
#[tokio::test]
async fn the_decode_engine_refuses_kv_it_cannot_pull() {
    let f = fleet(PdMode::Vllm, 1, 1, 20.0).await;
    let c = client();
    let mut body = chat("hello there", false, 2);
    body["kv_transfer_params"] = json!({"do_remote_prefill": true, "remote_engine_id": "nobody",
        "remote_block_ids": [1], "remote_host": "127.0.0.1",
        "remote_port": f.prefill[0].http_addr.port()});
    let resp = c
        .post(format!("{}/v1/chat/completions", f.decode[0].base_url()))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
}

/// Replicas that agree share a disaggregated model's prefill pool too: a prefill leg
/// booked on one replica shows as peer load on the other's prefill worker.
#[tokio::test]
async fn replicas_share_the_prefill_pools_load() {
    let f = fleet(PdMode::Vllm, 1, 1, 0.05).await;
    // Peers authenticate to each other with the admin token.
    let mut cfg = pd_config(&f, PdMode::Vllm, PolicyKind::RoundRobin);
    cfg.admin_token = Some("peers".into());
    let a = start(cfg.clone()).await.unwrap();
    cfg.peers.replica_id = Some("b".into());
    cfg.peers.urls = vec![a.url()];
    let b = start(cfg).await.unwrap();
    let url = format!("{}/v1/chat/completions", a.url());
    let body = chat(&prompt("shared", 3000), false, 2);
    let request = tokio::spawn(async move { client().post(url).json(&body).send().await });
    let (ga, gb) = (a.gateway().clone(), b.gateway().clone());
    eventually("the prefill leg booked on replica a", || {
        in_flight(&prefill_pool(&ga)) == 1
    })
    .await;
    let pool = prefill_pool(&gb);
    let worker = pool.workers()[0].id;
    eventually("replica b sees it on its prefill worker", || {
        pool.ledger().peer_load(worker).in_flight == 1
    })
    .await;
    assert_eq!(in_flight(&pool), 0, "not booked by b itself");
    request.abort();
    eventually("and sees it end", || {
        pool.ledger().peer_load(worker).in_flight == 0
    })
    .await;
    b.shutdown().await;
    a.shutdown().await;
}

/// A prefill pool found through DNS (a headless Service of prefill pods): its engine
/// joins the prefill pool, not the decode pool, and takes the prefill legs.
#[tokio::test]
async fn prefill_workers_found_through_dns_join_the_prefill_pool() {
    let f = fleet(PdMode::Vllm, 1, 1, 20.0).await;
    let prefill = &f.prefill[0];
    let kv_port = |ep: &Option<String>| {
        ep.as_deref()
            .and_then(|e| e.rsplit(':').next())
            .and_then(|p| p.parse::<u16>().ok())
    };
    let mut cfg = pd_config(&f, PdMode::Vllm, PolicyKind::RoundRobin);
    let pd = pd_of(&mut cfg);
    // No prefill worker named: the one engine is found through DNS.
    pd.prefill_workers.clear();
    pd.prefill_workers_dns = Some(kvgate_gateway::WorkersDnsConfig {
        name: format!("localhost:{}", prefill.http_addr.port()),
        kv_events_port: kv_port(&prefill.kv_events_endpoint),
        refresh_ms: 50,
        ..Default::default()
    });
    let gw = start(cfg).await.unwrap();
    let g = gw.gateway().clone();
    eventually("the prefill engine discovered", || {
        prefill_pool(&g).workers().len() == 1
    })
    .await;
    assert_eq!(
        g.model("m").unwrap().workers().len(),
        1,
        "decode pool unchanged"
    );
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat(&prompt("dns", 40), false, 2))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        header(&resp, "x-kvgate-prefill-worker"),
        format!("http://127.0.0.1:{}", prefill.http_addr.port())
    );
    gw.shutdown().await;
}

/// The admin API adds an engine to the prefill pool (`"pool":"prefill"`), lists it
/// there, refuses one engine in both pools, and removes it.
#[tokio::test]
async fn the_admin_api_manages_the_prefill_pool() {
    let f = fleet(PdMode::Vllm, 2, 1, 20.0).await;
    let mut cfg = pd_config(&f, PdMode::Vllm, PolicyKind::RoundRobin);
    cfg.admin_token = Some("t".into());
    // The second prefill engine joins through the admin API.
    pd_of(&mut cfg).prefill_workers.truncate(1);
    let gw = start(cfg).await.unwrap();
    let c = client();
    let admin = format!("{}/admin/workers", gw.url());
    let added = c
        .post(&admin)
        .bearer_auth("t")
        .json(&json!({"model": "m", "url": f.prefill[1].base_url(), "pool": "prefill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(added.status(), 201);
    let listed: Value = c
        .get(&admin)
        .bearer_auth("t")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let in_prefill = listed["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["pool"] == "prefill")
        .count();
    assert_eq!(in_prefill, 2, "{listed}");
    let both = c
        .post(&admin)
        .bearer_auth("t")
        .json(&json!({"model": "m", "url": f.decode[0].base_url(), "pool": "prefill"}))
        .send()
        .await
        .unwrap();
    assert_eq!(both.status(), 409);
    // Round robin over the prefill pool: the added engine takes prefill legs.
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..4 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat(&prompt(&format!("a{i}x"), 20), false, 2))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        seen.insert(header(&r, "x-kvgate-prefill-worker"));
    }
    assert!(seen.contains(&f.prefill[1].base_url()), "{seen:?}");
    let removed = c
        .delete(format!("{admin}?model=m&url={}", f.prefill[1].base_url()))
        .bearer_auth("t")
        .send()
        .await
        .unwrap();
    assert_eq!(removed.status(), 200);
    assert_eq!(prefill_pool(gw.gateway()).workers().len(), 1);
    gw.shutdown().await;
}
