//! End-to-end behaviour of the gateway against loopback fake engines.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use futures::StreamExt;
use kvgate_core::PolicyKind;
use kvgate_gateway::start;
use serde_json::{json, Value};

#[tokio::test]
async fn streaming_and_json_pass_through_byte_for_byte() {
    let a = fake("a", Behavior::default()).await;
    let gw = start(config(&[&a.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    let c = client();
    let resp = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(worker_of(&resp), a.url);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    // Chunks arrive as the engine flushes them; the concatenation is identical.
    let mut got = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        got.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(got, sse_bytes());

    let resp = c
        .post(format!("{}/v1/completions", gw.url()))
        .json(&json!({"model": "m", "prompt": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(worker_of(&resp), a.url);
    assert_eq!(resp.bytes().await.unwrap().as_ref(), JSON_BODY);
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;

    // Usage seen in the stream and in the JSON body feeds the accuracy metrics.
    let metrics = metrics_text(&c, &gw.url()).await;
    assert!(
        metrics.contains("kvgate_reported_prompt_tokens_total{model=\"m\"} 12"),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvgate_requests_total{model=\"m\",policy=\"round_robin\",status=\"200\""),
        "{metrics}"
    );
    assert!(
        metrics.contains("kvgate_response_ends_total{model=\"m\",outcome=\"complete\"} 2"),
        "{metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn slow_stream_is_flushed_event_by_event() {
    let a = fake(
        "a",
        Behavior {
            chunk_delay: Duration::from_millis(300),
            ..Behavior::default()
        },
    )
    .await;
    let gw = start(config(&[&a.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    let resp = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    let mut stream = resp.bytes_stream();
    // The first event arrives on its own, long before the stream ends.
    let first = tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.as_ref(), SSE_CHUNKS[0]);
    assert_eq!(
        a.stats.completed.load(Ordering::SeqCst),
        0,
        "the engine is still streaming"
    );
    drop(stream);
    gw.shutdown().await;
}

#[tokio::test]
async fn round_robin_random_and_session_policies() {
    let a = fake("a", Behavior::default()).await;
    let b = fake("b", Behavior::default()).await;
    let c = client();
    // round_robin alternates.
    let gw = start(config(&[&a.url, &b.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..4 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        seen.push(worker_of(&r));
    }
    assert_ne!(seen[0], seen[1]);
    assert_eq!(seen[0], seen[2]);
    assert_eq!(seen[1], seen[3]);
    gw.shutdown().await;

    // random reaches both.
    let gw = start(config(&[&a.url, &b.url], PolicyKind::Random))
        .await
        .unwrap();
    let mut set = std::collections::HashSet::new();
    for _ in 0..30 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        set.insert(worker_of(&r));
    }
    assert_eq!(set.len(), 2);
    gw.shutdown().await;

    // session: one session id sticks to one worker; different sessions spread. The
    // ring is keyed by worker URL (ephemeral ports here), so spreading is checked over
    // 64 sessions: all on one worker has probability 2^-63 whatever the ports.
    let gw = start(config(&[&a.url, &b.url], PolicyKind::Session))
        .await
        .unwrap();
    let mut per_session = std::collections::HashMap::new();
    for i in 0..192 {
        let sid = format!("s{}", i % 64);
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .header("x-session-id", &sid)
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        let w = worker_of(&r);
        let prev = per_session.entry(sid).or_insert_with(|| w.clone());
        assert_eq!(*prev, w, "a session moved");
    }
    let distinct: std::collections::HashSet<_> = per_session.values().collect();
    assert_eq!(distinct.len(), 2, "64 sessions all on one worker");
    gw.shutdown().await;
}

#[tokio::test]
async fn least_loaded_avoids_the_busy_worker() {
    let slow = Behavior {
        chunk_delay: Duration::from_millis(200),
        repeat: 20,
        ..Behavior::default()
    };
    let a = fake("a", slow.clone()).await;
    let b = fake("b", slow).await;
    let gw = start(config(&[&a.url, &b.url], PolicyKind::LeastLoaded))
        .await
        .unwrap();
    let c = client();
    let first = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    let busy = worker_of(&first);
    for _ in 0..3 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        assert_ne!(
            worker_of(&r),
            busy,
            "least_loaded sent work to the worker holding a stream"
        );
    }
    drop(first);
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    gw.shutdown().await;
}

#[tokio::test]
async fn prefix_affinity_repeats_a_prompt_on_the_same_worker() {
    let a = fake("a", Behavior::default()).await;
    let b = fake("b", Behavior::default()).await;
    let mut cfg = config(&[&a.url, &b.url], PolicyKind::PrefixAffinity);
    cfg.models[0].tokenizer = Some(fixtures().join("qwen3-tokenizer"));
    let gw = start(cfg).await.unwrap();
    let c = client();
    let long: String = (0..200).map(|i| format!("word{i} ")).collect();
    let mut first = None;
    for i in 0..6 {
        let body = json!({"model": "m", "prompt": format!("{long} question {i}")});
        let r = c
            .post(format!("{}/v1/completions", gw.url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let w = worker_of(&r);
        assert_eq!(*first.get_or_insert(w.clone()), w);
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn failover_before_the_first_byte() {
    // A dead port and a 500-answering engine, then a good one.
    let dead = dead_url().await;
    let bad = fake(
        "bad",
        Behavior {
            status: 500,
            ..Behavior::default()
        },
    )
    .await;
    let good = fake("good", Behavior::default()).await;
    for first in [dead.clone(), bad.url.clone()] {
        let gw = start(config(&[&first, &good.url], PolicyKind::RoundRobin))
            .await
            .unwrap();
        for _ in 0..4 {
            let r = client()
                .post(format!("{}/v1/chat/completions", gw.url()))
                .json(&chat_body(true))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            assert_eq!(worker_of(&r), good.url);
            assert_eq!(r.bytes().await.unwrap().as_ref(), sse_bytes().as_slice());
        }
        eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
        gw.shutdown().await;
    }
    assert!(bad.hits() >= 1);

    // Nobody left: the last error is reported, not a hang.
    let gw = start(config(&[&dead, &bad.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    let r = client()
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_server_error(), "{}", r.status());
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string());
    gw.shutdown().await;
}

/// `kvgate_requests_total` counts each request exactly once, with the status the
/// client got and the worker that gave it: a retried request is not counted per
/// attempt (retry then success: one 200 from the good worker; retry then failure: one
/// 502 from the gateway), a stream the client leaves after its first event counts as answered (200), a
/// request refused at the front door counts as refused, and one whose client leaves
/// before any answer counts once as 499 (the worker it waited on).
#[tokio::test]
async fn each_request_is_counted_once_however_it_ends() {
    let bad = fake(
        "bad",
        Behavior {
            status: 500,
            ..Behavior::default()
        },
    )
    .await;
    let good = fake("good", Behavior::default()).await;
    let hung = fake(
        "hung",
        Behavior {
            hang: true,
            ..Behavior::default()
        },
    )
    .await;
    let mut cfg = config(&[&bad.url, &good.url], PolicyKind::RoundRobin);
    cfg.health.failure_threshold = 1_000_000;
    cfg.api_key = Some("k".into());
    let gw = start(cfg).await.unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let send = |behavior: &'static str, stream: bool| {
        c.post(&url)
            .bearer_auth("k")
            .header(BEHAVIOR_HEADER, behavior)
            .json(&chat_body(stream))
            .send()
    };
    // Retry then success, twice (round robin starts once on each worker).
    for _ in 0..2 {
        let r = send("ok", false).await.unwrap();
        assert_eq!(
            (r.status().as_u16(), worker_of(&r)),
            (200, good.url.clone())
        );
        r.bytes().await.unwrap();
    }
    // Retry then failure: both workers fail this one. No worker is left after two
    // failed attempts: the last failure, from the gateway.
    let r = send("error-status", false).await.unwrap();
    assert_eq!(r.status(), 502);
    r.bytes().await.unwrap();
    // A slow stream the client leaves after its first event.
    let mut body = send("slow", true).await.unwrap().bytes_stream();
    body.next().await.unwrap().unwrap();
    drop(body);
    // Refused at the front door.
    let r = c.post(&url).json(&chat_body(false)).send().await.unwrap();
    assert_eq!(r.status(), 401);
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    let counted = requests_counted(&metrics_text(&c, &gw.url()).await);
    let line = |worker: &str, status: u16| {
        format!("{{model=\"m\",policy=\"round_robin\",status=\"{status}\",worker=\"{worker}\"}}")
    };
    let want = std::collections::BTreeMap::from([
        (line(&good.url, 200), 3.0),
        (line("", 502), 1.0),
        (
            "{model=\"\",policy=\"\",status=\"401\",worker=\"\"}".to_owned(),
            1.0,
        ),
    ]);
    assert_eq!(counted, want);
    gw.shutdown().await;

    // A client that leaves while its request waits on a hung engine: one 499.
    let gw = start(config(&[&hung.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let r = impatient
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(false))
        .send()
        .await;
    assert!(r.is_err(), "the hung engine answered");
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    let counted = requests_counted(&metrics_text(&c, &gw.url()).await);
    assert_eq!(
        counted,
        std::collections::BTreeMap::from([(line(&hung.url, 499), 1.0)])
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn no_retry_after_the_first_byte() {
    // The delay makes the engine flush its first event before it fails.
    let broken = fake(
        "broken",
        Behavior {
            fail_after_first: true,
            chunk_delay: Duration::from_millis(100),
            ..Behavior::default()
        },
    )
    .await;
    let good = fake("good", Behavior::default()).await;
    let gw = start(config(&[&broken.url, &good.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    let mut to_good = 0;
    for _ in 0..2 {
        let r = client()
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        if worker_of(&r) == good.url {
            to_good += 1;
            continue;
        }
        assert_eq!(worker_of(&r), broken.url);
        let got = r.bytes().await.expect("a broken stream still ends cleanly");
        let (head, tail) = got.split_at(SSE_CHUNKS[0].len());
        assert_eq!(head, SSE_CHUNKS[0]);
        assert_error_event(tail, "upstream_stream_broken");
    }
    assert_eq!(broken.hits(), 1);
    assert_eq!(good.hits(), to_good, "retried after bytes were sent");
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    gw.shutdown().await;
}

/// A stream is committed to its worker at its first event, not at its head: vLLM's API
/// server sends the head of a streamed answer at once and the first event with the
/// first token, so an engine that fails in between (before any byte of the answer
/// reached the client) fails over like one that sent no head at all.
#[tokio::test]
async fn a_stream_that_breaks_before_its_first_event_fails_over() {
    let broken = fake(
        "broken",
        Behavior {
            fail_before_first: true,
            ..Behavior::default()
        },
    )
    .await;
    let good = fake("good", Behavior::default()).await;
    let gw = start(config(&[&broken.url, &good.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    let c = client();
    for _ in 0..4 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_eq!(worker_of(&r), good.url);
        assert_eq!(r.bytes().await.unwrap().as_ref(), sse_bytes().as_slice());
    }
    assert!(broken.hits() >= 1, "round robin tried the broken engine");
    assert_eq!(good.hits(), 4);
    let metrics = metrics_text(&c, &gw.url()).await;
    let ok = format!(
        "kvgate_requests_total{{model=\"m\",policy=\"round_robin\",status=\"200\",worker=\"{}\"}} 4",
        good.url
    );
    assert!(metrics.contains(&ok), "{ok} missing from {metrics}");
    let none = format!("status=\"200\",worker=\"{}\"}} 0", broken.url);
    assert!(
        metrics.contains(&none),
        "an attempt that failed over is not an answered request: {metrics}"
    );
    assert!(
        metrics.contains("kvgate_retries_total{model=\"m\",reason=\"transport\"}"),
        "{metrics}"
    );
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    gw.shutdown().await;
}

/// A stream whose head arrived but whose engine died before the first token (the
/// restart scenario's hung engine): once health checks declare the worker dead, the
/// request moves to a healthy worker and the client gets a whole answer, not an error
/// event. The first-byte timeout counts to the first event too.
#[tokio::test]
async fn a_stream_waiting_for_its_first_event_on_a_dead_engine_fails_over() {
    let (hung, good, gw) = gateway_over_a_hung_engine(Behavior {
        hang_after_head: true,
        ..Behavior::default()
    })
    .await;
    let c = client();
    requests_on_a_hung_engine_move_when_it_is_declared_dead(&gw, &hung, &good, true).await;
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    gw.shutdown().await;

    // The first-byte timeout ends the wait for the first event as it ends the wait
    // for a head.
    let silent = fake(
        "silent",
        Behavior {
            hang_after_head: true,
            ..Behavior::default()
        },
    )
    .await;
    let mut cfg = config(&[&silent.url, &good.url], PolicyKind::RoundRobin);
    cfg.timeouts.first_byte_ms = 300;
    cfg.health.interval_ms = 0;
    let gw = start(cfg).await.unwrap();
    for _ in 0..2 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(true))
            .send()
            .await
            .unwrap();
        assert_eq!(worker_of(&r), good.url);
        assert_eq!(r.bytes().await.unwrap().as_ref(), sse_bytes().as_slice());
    }
    assert!(silent.hits() >= 1, "round robin tried the silent engine");
    let metrics = metrics_text(&c, &gw.url()).await;
    assert!(
        metrics.contains("kvgate_retries_total{model=\"m\",reason=\"first_byte_timeout\"}"),
        "{metrics}"
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn overload_is_429_with_retry_after() {
    let slow = fake(
        "slow",
        Behavior {
            chunk_delay: Duration::from_millis(200),
            repeat: 20,
            ..Behavior::default()
        },
    )
    .await;
    let mut cfg = config(&[&slow.url], PolicyKind::RoundRobin);
    cfg.limits.max_in_flight_per_worker = 1;
    cfg.limits.queue_timeout_ms = 200;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let held = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(held.status(), 200);
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "overloaded");
    // Freeing the slot admits queued requests.
    drop(held);
    eventually("slot freed", || gw.ledger_in_flight("m") == Some(0)).await;
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.shutdown().await;

    // The global limit with a zero-length queue rejects at once.
    let mut cfg = config(&[&slow.url], PolicyKind::RoundRobin);
    cfg.limits.max_in_flight = 1;
    cfg.limits.max_queue = 0;
    let gw = start(cfg).await.unwrap();
    let held = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert!(r.headers().contains_key("retry-after"));
    drop(held);
    gw.shutdown().await;
}

async fn error_of(r: reqwest::Response) -> (u16, Value) {
    let s = r.status().as_u16();
    (s, r.json().await.unwrap())
}

#[tokio::test]
async fn error_cases_are_openai_shaped() {
    let a = fake("a", Behavior::default()).await;
    let c = client();
    let mut cfg = config(&[&a.url], PolicyKind::RoundRobin);
    cfg.limits.max_body_bytes = 4096;
    let gw = start(cfg).await.unwrap();
    let url = format!("{}/v1/chat/completions", gw.url());

    let (s, v) = error_of(c.post(&url).body("{not json").send().await.unwrap()).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("invalid_json"))
    );
    assert_eq!(v["error"]["type"], "invalid_request_error");

    let (s, v) = error_of(
        c.post(&url)
            .json(&json!({"model": "nope", "messages": []}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );

    let (s, v) = error_of(c.post(&url).body(vec![b' '; 10_000]).send().await.unwrap()).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (413, Some("request_too_large"))
    );

    let (s, _) = error_of(c.get(format!("{}/nope", gw.url())).send().await.unwrap()).await;
    assert_eq!(s, 404);
    gw.shutdown().await;

    // Untokenizable body with a token policy: 400.
    let mut cfg = config(&[&a.url], PolicyKind::PrefixAffinity);
    cfg.models[0].tokenizer = Some(fixtures().join("qwen3-tokenizer"));
    let gw = start(cfg).await.unwrap();
    let (s, v) = error_of(
        c.post(format!("{}/v1/chat/completions", gw.url()))
            .json(&json!({"model": "m", "messages": 5}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("invalid_prompt")),
        "{v}"
    );
    // The routing fields of a body parsed for tokenizing are read as the scan of a
    // body that is not tokenized reads them: a wrong type is bad JSON for the request.
    let messages = json!([{"role": "user", "content": "hi"}]);
    let chat = format!("{}/v1/chat/completions", gw.url());
    for bad in [
        json!({"model": 5, "messages": messages}),
        json!({"model": "m", "messages": messages, "stream": "yes"}),
        json!({"model": "m", "messages": messages, "max_tokens": "9"}),
    ] {
        let (s, v) = error_of(c.post(&chat).json(&bad).send().await.unwrap()).await;
        assert_eq!(
            (s, v["error"]["code"].as_str()),
            (400, Some("invalid_json")),
            "{bad}: {v}"
        );
    }
    let not_an_object = json!([messages]);
    let (s, v) = error_of(c.post(&chat).json(&not_an_object).send().await.unwrap()).await;
    assert_eq!(s, 400, "{v}");
    gw.shutdown().await;

    // kv_aware without an event source: 503 naming the fix; with --kv-fallback: routed.
    let mut cfg = config(&[&a.url], PolicyKind::KvAware);
    cfg.models[0].tokenizer = Some(fixtures().join("qwen3-tokenizer"));
    let gw = start(cfg.clone()).await.unwrap();
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    let (s, v) = error_of(r).await;
    assert_eq!(s, 503);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--kv-events"),
        "{v}"
    );
    assert_eq!(gw.ledger_in_flight("m"), Some(0));
    gw.shutdown().await;
    cfg.models[0].kv_fallback = Some(PolicyKind::LeastLoaded);
    let gw = start(cfg).await.unwrap();
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    gw.shutdown().await;

    // All workers down: 503 with Retry-After, and /ready says so.
    let mut cfg = config(&[&dead_url().await], PolicyKind::RoundRobin);
    cfg.health.interval_ms = 50;
    cfg.health.failure_threshold = 1;
    let gw = start(cfg).await.unwrap();
    eventually("worker marked down", || {
        gw.gateway().model("m").unwrap().workers()[0]
            .breaker
            .is_open()
    })
    .await;
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert!(r.headers().contains_key("retry-after"));
    let (s, v) = error_of(r).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (503, Some("no_healthy_worker"))
    );
    let ready = c.get(format!("{}/ready", gw.url())).send().await.unwrap();
    assert_eq!(ready.status(), 503);
    gw.shutdown().await;
}

#[tokio::test]
async fn api_key_is_required_and_not_forwarded() {
    let a = fake("a", Behavior::default()).await;
    let mut cfg = config(&[&a.url], PolicyKind::RoundRobin);
    cfg.api_key = Some("sekret".into());
    cfg.worker_api_key = Some("engine-key".into());
    let gw = start(cfg).await.unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let (s, v) = error_of(c.post(&url).json(&chat_body(false)).send().await.unwrap()).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    let r = c
        .post(&url)
        .bearer_auth("wrong")
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(&url)
        .bearer_auth("sekret")
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        a.stats.last_auth.lock().as_deref(),
        Some("Bearer engine-key")
    );
    // Liveness and metrics stay open; the admin API is off without a token.
    assert_eq!(
        c.get(format!("{}/health", gw.url()))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        c.get(format!("{}/admin/workers", gw.url()))
            .send()
            .await
            .unwrap()
            .status(),
        404
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn ledger_is_empty_after_a_burst_with_disconnects() {
    let slow = fake(
        "slow",
        Behavior {
            chunk_delay: Duration::from_millis(20),
            repeat: 10,
            ..Behavior::default()
        },
    )
    .await;
    let b = fake(
        "b",
        Behavior {
            chunk_delay: Duration::from_millis(20),
            repeat: 10,
            ..Behavior::default()
        },
    )
    .await;
    let gw = start(config(&[&slow.url, &b.url], PolicyKind::LeastLoaded))
        .await
        .unwrap();
    let c = client();
    let mut tasks = Vec::new();
    for i in 0..24 {
        let c = c.clone();
        let url = format!("{}/v1/chat/completions", gw.url());
        tasks.push(tokio::spawn(async move {
            let r = c.post(url).json(&chat_body(true)).send().await.unwrap();
            let mut s = r.bytes_stream();
            if i % 2 == 0 {
                // Disconnect after the first chunk.
                let _ = s.next().await;
                return;
            }
            while s.next().await.is_some() {}
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    let m = gw.gateway().model("m").unwrap();
    for w in m.workers().iter() {
        assert_eq!(m.ledger().load(w.id), kvgate_core::WorkerLoad::default());
    }
    // Client disconnects aborted the upstream requests.
    eventually("engines saw aborts", || {
        slow.stats.aborted.load(Ordering::SeqCst) + b.stats.aborted.load(Ordering::SeqCst) == 12
    })
    .await;
    gw.shutdown().await;
}

/// Every route the gateway serves, from its route table: each one that needs a token
/// refuses a request with none, a wrong one, or another group's (401); only the
/// liveness and readiness probes are open. A route added to the table is tested here
/// as it is added. Without an admin token, the admin API and the peer endpoints (which
/// accept phantom bookings and give away the index) are off for everyone (404).
#[tokio::test]
async fn every_route_refuses_a_missing_or_wrong_token() {
    use kvgate_gateway::front_door::Access;
    use kvgate_gateway::server::ROUTES;
    let a = fake("a", Behavior::default()).await;
    let c = client();
    let send = |url: String, method: &http::Method, token: Option<&str>| {
        let mut r = c.request(method.clone(), url);
        if *method != http::Method::GET {
            r = r.json(&json!({}));
        }
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        r.send()
    };
    let token_of = |access: Access| match access {
        Access::Public => None,
        Access::ApiKey => Some("api"),
        Access::MetricsToken => Some("met"),
        Access::Admin | Access::Peer => Some("adm"),
    };
    let mut cfg = config(&[&a.url], PolicyKind::RoundRobin);
    cfg.api_key = Some("api".into());
    cfg.metrics_token = Some("met".into());
    cfg.admin_token = Some("adm".into());
    let gw = start(cfg).await.unwrap();
    let mut open = Vec::new();
    for route in ROUTES {
        let (method, path) = (&route.method, route.path.replace("{id}", "1"));
        let url = format!("{}{path}", gw.url());
        let Some(right) = token_of(route.access) else {
            open.push(route.path);
            continue;
        };
        for token in [None, Some("wrong"), Some("api"), Some("met"), Some("adm")] {
            if token == Some(right) {
                continue;
            }
            let r = send(url.clone(), method, token).await.unwrap();
            let (status, v) = error_of(r).await;
            assert_eq!(status, 401, "{method} {path} with {token:?}: {v}");
        }
        let r = send(url.clone(), method, Some(right)).await.unwrap();
        assert_ne!(r.status(), 401, "{method} {path} refused the right token");
    }
    assert_eq!(open, ["/health", "/ready"], "routes open to anyone");
    gw.shutdown().await;

    let no_admin = start(config(&[&a.url], PolicyKind::RoundRobin))
        .await
        .unwrap();
    for route in ROUTES
        .iter()
        .filter(|r| matches!(r.access, Access::Admin | Access::Peer))
    {
        let path = route.path.replace("{id}", "1");
        for token in [None, Some("anything")] {
            let r = send(format!("{}{path}", no_admin.url()), &route.method, token)
                .await
                .unwrap();
            let (status, v) = error_of(r).await;
            assert_eq!(
                status, 404,
                "{} {path} without a configured token: {v}",
                route.method
            );
            assert!(v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("--admin-token"));
        }
    }
    no_admin.shutdown().await;
}

/// Two replicas under one `--replica-id` would each take the other's reports for their
/// own and ignore them: the second is refused at start, naming the flag, while the
/// first keeps serving; a replica of another name starts beside it.
#[tokio::test]
async fn a_replica_whose_name_a_peer_has_is_refused_at_start() {
    let a = fake("a", Behavior::default()).await;
    let replica = |id: &str, peers: Vec<String>| {
        let mut cfg = config(&[&a.url], PolicyKind::LeastLoaded);
        cfg.admin_token = Some("adm".into());
        cfg.peers.replica_id = Some(id.into());
        cfg.peers.urls = peers;
        cfg
    };
    let first = start(replica("same", Vec::new())).await.unwrap();
    let err = start(replica("same", vec![first.url()]))
        .await
        .expect_err("a second replica of the same name started");
    let msg = format!("{err:#}");
    assert!(
        msg.contains("--replica-id") && msg.contains(&first.url()),
        "{msg}"
    );
    let other = start(replica("other", vec![first.url()])).await.unwrap();
    let r = client()
        .post(format!("{}/v1/chat/completions", first.url()))
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    other.shutdown().await;
    first.shutdown().await;
}

#[tokio::test]
async fn workers_are_added_and_removed_at_run_time() {
    let a = fake("a", Behavior::default()).await;
    let b = fake("b", Behavior::default()).await;
    let mut cfg = config(&[&a.url], PolicyKind::RoundRobin);
    cfg.admin_token = Some("adm".into());
    let gw = start(cfg).await.unwrap();
    let c = client();
    let admin = format!("{}/admin/workers", gw.url());
    assert_eq!(c.get(&admin).send().await.unwrap().status(), 401);
    let r = c
        .post(&admin)
        .bearer_auth("adm")
        .json(&json!({"model": "m", "url": b.url}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let added: Value = r.json().await.unwrap();
    let dup = c
        .post(&admin)
        .bearer_auth("adm")
        .json(&json!({"model": "m", "url": b.url}))
        .send()
        .await
        .unwrap();
    assert_eq!(dup.status(), 409);
    // Bad settings are a 400 before anything is started (a huge dp_size would mean a
    // billion event subscribers; a port past 65535 used to overflow).
    for bad in [
        json!({"model": "m", "url": "http://127.0.0.1:9", "kv_events": "tcp://127.0.0.1:5557", "dp_size": 4_294_967_295u64}),
        json!({"model": "m", "url": "http://127.0.0.1:9", "kv_events": "tcp://127.0.0.1:65535", "dp_size": 2}),
        json!({"model": "m", "url": "http://127.0.0.1:9", "dp_size": 0}),
    ] {
        let r = c
            .post(&admin)
            .bearer_auth("adm")
            .json(&bad)
            .send()
            .await
            .unwrap();
        let (s, v) = error_of(r).await;
        assert_eq!(
            (s, v["error"]["code"].as_str()),
            (400, Some("invalid_worker")),
            "{bad} {v}"
        );
    }
    let mut set = std::collections::HashSet::new();
    for _ in 0..4 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        set.insert(worker_of(&r));
    }
    assert_eq!(set.len(), 2);
    let list: Value = c
        .get(&admin)
        .bearer_auth("adm")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["workers"].as_array().unwrap().len(), 2);

    let r = c
        .delete(format!("{admin}/{}", added["id"]))
        .bearer_auth("adm")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for _ in 0..4 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        assert_eq!(worker_of(&r), a.url);
    }
    // Remove by URL; re-adding gets a fresh id.
    let r = c
        .delete(&admin)
        .query(&[("url", a.url.as_str())])
        .bearer_auth("adm")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(false))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let r = c
        .post(&admin)
        .bearer_auth("adm")
        .json(&json!({"url": b.url}))
        .send()
        .await
        .unwrap();
    let again: Value = r.json().await.unwrap();
    assert_ne!(again["id"], added["id"], "worker ids are never reused");
    gw.shutdown().await;
}

/// `tail` is exactly one OpenAI-style SSE error event with `code`.
fn assert_error_event(tail: &[u8], code: &str) {
    let text = std::str::from_utf8(tail).unwrap();
    let json = text
        .strip_prefix("data: ")
        .and_then(|t| t.strip_suffix("\n\n"))
        .unwrap_or_else(|| panic!("not one SSE event: {text:?}"));
    let v: Value = serde_json::from_str(json).unwrap();
    assert_eq!(v["error"]["code"], code, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
    assert!(v["error"]["type"].as_str().is_some_and(|t| !t.is_empty()));
}

/// A fake engine that behaves as `hung` does and a good one, behind a round-robin
/// gateway whose health checks declare a worker dead after two failed probes 100 ms
/// apart.
async fn gateway_over_a_hung_engine(
    hung: Behavior,
) -> (Fake, Fake, kvgate_gateway::RunningGateway) {
    let hung = fake("hung", hung).await;
    let good = fake("good", Behavior::default()).await;
    let mut cfg = config(&[&hung.url, &good.url], PolicyKind::RoundRobin);
    cfg.health.interval_ms = 100;
    cfg.health.failure_threshold = 2;
    let gw = start(cfg).await.unwrap();
    (hung, good, gw)
}

/// Sends two requests through `gw` (round robin over `hung` and `good`), lets one wait
/// on `hung`, then fails `hung`'s health checks: both end on `good` with a whole
/// answer, within seconds rather than at a timeout.
async fn requests_on_a_hung_engine_move_when_it_is_declared_dead(
    gw: &kvgate_gateway::RunningGateway,
    hung: &Fake,
    good: &Fake,
    stream: bool,
) {
    let hits_before = hung.hits();
    let waiting: Vec<_> = (0..2)
        .map(|_| {
            let (c, url) = (client(), gw.url());
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let r = c
                    .post(format!("{url}/v1/chat/completions"))
                    .json(&chat_body(stream))
                    .send()
                    .await
                    .unwrap();
                let worker = worker_of(&r);
                let status = r.status().as_u16();
                let body = r.bytes().await.unwrap();
                (worker, status, body, started.elapsed())
            })
        })
        .collect();
    eventually("a request waits on the hung engine", || {
        hung.hits() > hits_before
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    hung.stats.healthy.store(false, Ordering::SeqCst);
    let whole: &[u8] = if stream { &sse_bytes() } else { JSON_BODY };
    for w in waiting {
        let (worker, status, body, took) = w.await.unwrap();
        assert_eq!((worker.as_str(), status), (good.url.as_str(), 200));
        assert_eq!(body.as_ref(), whole);
        assert!(
            took < Duration::from_secs(5),
            "waited {took:?} on a dead engine"
        );
    }
}

/// An engine that stops answering behind a live HTTP server (vLLM's API server after
/// its engine died) holds requests until the first-byte timeout (600 s by default).
/// Once health checks declare its worker dead, a request waiting on it fails over to
/// a healthy worker at once, and a client that gave up earlier is counted (499).
#[tokio::test]
async fn requests_waiting_on_a_dead_engine_fail_over_when_health_declares_it_dead() {
    let (hung, good, gw) = gateway_over_a_hung_engine(Behavior {
        hang: true,
        ..Behavior::default()
    })
    .await;
    let c = client();
    // A client that gives up while its request waits on the hung engine.
    let impatient = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let mut gave_up = 0;
    for _ in 0..2 {
        let r = impatient
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await;
        if r.is_err() {
            gave_up += 1;
        }
    }
    assert_eq!(gave_up, 1, "round robin sent one of two to the hung engine");
    let metrics = metrics_text(&c, &gw.url()).await;
    let line = format!(
        "kvgate_requests_total{{model=\"m\",policy=\"round_robin\",status=\"499\",worker=\"{}\"}} 1",
        hung.url
    );
    assert!(metrics.contains(&line), "{line} missing from {metrics}");
    // Now requests wait on it until health checks see it dead.
    requests_on_a_hung_engine_move_when_it_is_declared_dead(&gw, &hung, &good, false).await;
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    gw.shutdown().await;
}

#[tokio::test]
async fn health_checks_take_workers_out_and_back_without_touching_load() {
    // Slow streams on both, so a stream held on either keeps its booking.
    let a = fake(
        "a",
        Behavior {
            chunk_delay: Duration::from_millis(100),
            repeat: 30,
            ..Behavior::default()
        },
    )
    .await;
    let b = fake(
        "b",
        Behavior {
            chunk_delay: Duration::from_millis(100),
            repeat: 30,
            ..Behavior::default()
        },
    )
    .await;
    let mut cfg = config(&[&a.url, &b.url], PolicyKind::RoundRobin);
    cfg.health.interval_ms = 50;
    cfg.health.failure_threshold = 2;
    let gw = start(cfg).await.unwrap();
    let c = client();
    // Hold a stream on b so its ledger has load.
    let mut held = None;
    for _ in 0..2 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(true))
            .send()
            .await
            .unwrap();
        if worker_of(&r) == b.url {
            held = Some(r);
        }
    }
    let held = held.unwrap();
    let m = gw.gateway().model("m").unwrap().clone();
    let bw = m.worker_by_url(&b.url).unwrap();
    // A stream on a's side keeps load there while b goes down.
    let on_a = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    assert_eq!(worker_of(&on_a), a.url);
    b.stats.healthy.store(false, Ordering::SeqCst);
    eventually("b out", || bw.breaker.is_open()).await;
    // The stream held on b (its first event already passed on) is cut off with an
    // error event as its last, not left waiting.
    let body = held.bytes().await.expect("the cut-off stream ends cleanly");
    let last = memchr::memmem::rfind(&body, b"data: {\"error\"").expect("an error event");
    assert!(
        body.starts_with(SSE_CHUNKS[0]),
        "the stream's own events come first"
    );
    assert_error_event(&body[last..], "worker_down");
    for _ in 0..4 {
        let r = c
            .post(format!("{}/v1/chat/completions", gw.url()))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        assert_eq!(worker_of(&r), a.url);
    }
    eventually("b's booking freed by its guard", || {
        m.ledger().load(bw.id).in_flight == 0
    })
    .await;
    let aw = m.worker_by_url(&a.url).unwrap();
    assert_eq!(
        m.ledger().load(aw.id).in_flight,
        1,
        "health must not reset another worker's load"
    );
    b.stats.healthy.store(true, Ordering::SeqCst);
    eventually("b back", || !bw.breaker.is_open()).await;
    drop(on_a);
    eventually("ledger drained", || gw.ledger_in_flight("m") == Some(0)).await;
    gw.shutdown().await;
}

/// A policy that reads no tokens still books a prompt's size: the gateway estimates it
/// from the body without tokenizing (token ids one each, text one per 4 bytes), so a
/// long prompt in flight weighs on its worker's load.
#[tokio::test]
async fn load_only_policies_book_an_estimate_of_the_prompt() {
    let a = fake(
        "a",
        Behavior {
            chunk_delay: Duration::from_millis(50),
            repeat: 40,
            ..Behavior::default()
        },
    )
    .await;
    let gw = start(config(&[&a.url], PolicyKind::LeastLoaded))
        .await
        .unwrap();
    let c = client();
    let url = gw.url();
    let explained = async |body: Value| explain(&c, &url, &body).await;
    let ids: Vec<u32> = (0..300).collect();
    let ex = explained(json!({"model": "m", "prompt": ids})).await;
    assert_eq!(ex["prompt_tokens"], 300, "{ex}");
    assert_eq!(ex["prompt_tokens_estimated"], true);
    let ex = explained(json!({"model": "m", "prompt": "x".repeat(4000)})).await;
    assert_eq!(ex["prompt_tokens"], 1000, "{ex}");
    let ex = explained(json!({"model": "m", "messages": [
        {"role": "system", "content": "y".repeat(800)},
        {"role": "user", "content": [{"type": "text", "text": "z".repeat(400)}]}
    ]}))
    .await;
    // 200 + 100 for the contents, 2 + 1 + 1 for "system", "user" and "text".
    assert_eq!(ex["prompt_tokens"], 304, "{ex}");

    // A long prompt in flight: its worker's booked decode blocks count the prompt.
    let held = c
        .post(format!("{}/v1/completions", gw.url()))
        .json(&json!({"model": "m", "prompt": "w".repeat(64_000), "stream": true}))
        .send()
        .await
        .unwrap();
    let ex = explained(json!({"model": "m", "prompt": "short"})).await;
    let blocks = ex["scores"][0]["decode_blocks"].as_f64().unwrap();
    assert!(blocks >= 16_000.0 / 16.0, "{ex}");
    drop(held);
    gw.shutdown().await;
}

/// Every routed answer carries its receipt (`x-kvgate-predicted-ttft-ms`, the TTFT
/// predicted at booking), each first token teaches the worker's time model (an engine
/// 40 ms to its first token is soon predicted at least that slow, far above the prior),
/// explain shows each worker's prediction and rates, and the metric counts every
/// receipt.
#[tokio::test]
async fn answers_carry_their_ttft_receipt_and_the_time_model_learns() {
    let a = fake(
        "a",
        Behavior {
            chunk_delay: Duration::from_millis(40),
            ..Behavior::default()
        },
    )
    .await;
    let gw = start(config(&[&a.url], PolicyKind::LeastLoaded))
        .await
        .unwrap();
    let c = client();
    let url = gw.url();
    let requests = 24;
    for _ in 0..requests {
        let r = c
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat_body(true))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let predicted: f64 = r
            .headers()
            .get("x-kvgate-predicted-ttft-ms")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok())
            .expect("a predicted TTFT header");
        assert!(predicted > 0.0);
        let _ = r.bytes().await.unwrap();
    }
    let ex = explain(&c, &url, &chat_body(true)).await;
    let line = &ex["scores"][0];
    let predicted = line["predicted_ttft_ms"].as_f64().unwrap();
    assert!(predicted >= 30.0, "learned from 40 ms first tokens: {ex}");
    assert!(line["predicted_tpot_ms"].as_f64().unwrap() > 0.0, "{ex}");
    assert!(
        line["predicted_next_ttft_ms"].as_f64().unwrap() >= predicted,
        "{ex}"
    );
    assert_eq!(line["rates"]["ttft_samples"], requests, "{ex}");
    assert!(line["rates"]["ttft_spread"].as_f64().unwrap() > 0.0, "{ex}");
    assert_eq!(line["engine_limits"]["max_num_seqs"], 1024, "{ex}");
    assert_eq!(ex["predicted_ttft_ms"], line["predicted_ttft_ms"], "{ex}");
    let m = metrics_text(&c, &url).await;
    let counted = gauge_value(&m, "kvgate_ttft_prediction_error_count{model=\"m\"}");
    assert_eq!(counted, Some(requests as f64), "{m}");
    gw.shutdown().await;
}

/// A sheddable request (`x-priority` below 0) whose TTFT objective no worker is
/// predicted to meet gets 429 with Retry-After at once, in OpenAI's shape, and never
/// reaches an engine; the same request without the priority is served (the closest
/// miss); a malformed objective is a 400.
#[tokio::test]
async fn a_sheddable_request_no_worker_can_serve_in_time_is_refused_at_once() {
    let a = fake("a", Behavior::default()).await;
    let gw = start(config(&[&a.url], PolicyKind::LeastLoaded))
        .await
        .unwrap();
    let c = client();
    let url = gw.url();
    let send = |headers: &'static [(&'static str, &'static str)]| {
        let mut r = c
            .post(format!("{url}/v1/chat/completions"))
            .json(&chat_body(false));
        for (k, v) in headers {
            r = r.header(*k, *v);
        }
        r.send()
    };
    let shed = send(&[("x-slo-ttft-ms", "0.01"), ("x-priority", "-1")])
        .await
        .unwrap();
    assert_eq!(shed.status(), 429);
    assert!(shed.headers().get("retry-after").is_some());
    let (_, body) = error_of(shed).await;
    assert_eq!(body["error"]["code"], "objective_unmet", "{body}");
    assert_eq!(a.hits(), 0, "a shed request reaches no engine");
    let served = send(&[("x-llm-d-slo-ttft-ms", "0.01")]).await.unwrap();
    assert_eq!(served.status(), 200);
    let bad = send(&[("x-slo-ttft-ms", "soon")]).await.unwrap();
    let (status, body) = error_of(bad).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (400, &json!("invalid_objective"))
    );
    gw.shutdown().await;
}

#[tokio::test]
async fn models_tokenize_explain_and_graceful_shutdown() {
    let a = fake(
        "a",
        Behavior {
            chunk_delay: Duration::from_millis(50),
            ..Behavior::default()
        },
    )
    .await;
    let mut cfg = config(&[&a.url], PolicyKind::PrefixAffinity);
    cfg.models[0].tokenizer = Some(fixtures().join("qwen3-tokenizer"));
    cfg.models[0].lora_adapters = vec!["m-sql".into()];
    let gw = start(cfg).await.unwrap();
    let c = client();
    let models: Value = c
        .get(format!("{}/v1/models", gw.url()))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["m", "m-sql"]);
    let tok: Value = c
        .post(format!("{}/tokenize", gw.url()))
        .json(&json!({"model": "m", "prompt": "hello world"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(tok["count"].as_u64().unwrap() >= 2, "{tok}");
    let ex = explain(
        &c,
        &gw.url(),
        &json!({"model": "m-sql", "prompt": "hello world"}),
    )
    .await;
    assert_eq!(ex["worker"], a.url.as_str(), "{ex}");
    assert_eq!(ex["lora"], "m-sql");
    assert_eq!(ex["scores"].as_array().unwrap().len(), 1);
    assert_eq!(a.hits(), 0, "explain must not forward");
    // The decision's cost by stage, in milliseconds, tokenizing included.
    let timed = c
        .post(format!("{}/v1/route/explain", gw.url()))
        .json(&json!({"model": "m", "prompt": "hello world"}))
        .send()
        .await
        .unwrap();
    let timing = timed.headers()["server-timing"]
        .to_str()
        .unwrap()
        .to_owned();
    let stages: Vec<(&str, f64)> = timing
        .split(", ")
        .map(|s| {
            let (name, dur) = s.split_once(";dur=").unwrap();
            (name, dur.parse().unwrap())
        })
        .collect();
    let names: Vec<&str> = stages.iter().map(|s| s.0).collect();
    assert_eq!(
        names,
        ["parse", "tokenize", "hash", "select", "total"],
        "{timing}"
    );
    let total = stages[4].1;
    assert!(stages[1].1 > 0.0 && total > 0.0, "{timing}");
    assert!(
        stages[..4].iter().map(|s| s.1).sum::<f64>() <= total + 0.01,
        "{timing}"
    );

    // Shutdown lets an in-flight stream finish.
    let r = c
        .post(format!("{}/v1/chat/completions", gw.url()))
        .json(&chat_body(true))
        .send()
        .await
        .unwrap();
    let reader = tokio::spawn(async move { r.bytes().await.map(|b| b.len()) });
    tokio::time::sleep(Duration::from_millis(60)).await;
    gw.shutdown_within(Duration::from_secs(5)).await;
    assert_eq!(reader.await.unwrap().unwrap(), sse_bytes().len());
}

/// The small front-door rules: the auth scheme is case-insensitive (RFC 7235), a body
/// that is not JSON by its Content-Type is 415, a wrong method is a JSON 405, a body
/// that is not a JSON object says so, and `/metrics` can require its own token.
#[tokio::test]
async fn front_door_rules_answer_in_openai_json() {
    let a = fake("a", Behavior::default()).await;
    let mut cfg = config(&[&a.url], PolicyKind::RoundRobin);
    cfg.api_key = Some("sekret".into());
    cfg.metrics_token = Some("scrape".into());
    let gw = start(cfg).await.unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());

    for scheme in ["BEARER", "bearer", "Bearer", "bEaReR"] {
        let r = c
            .post(&url)
            .header("authorization", format!("{scheme} sekret"))
            .json(&chat_body(false))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "scheme {scheme}");
    }

    let r = c
        .post(&url)
        .bearer_auth("sekret")
        .header("content-type", "application/x-www-form-urlencoded")
        .body(serde_json::to_vec(&chat_body(false)).unwrap())
        .send()
        .await
        .unwrap();
    let (s, v) = error_of(r).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (415, Some("unsupported_media_type")),
        "{v}"
    );
    // No Content-Type at all (curl without -H) and JSON with parameters are accepted.
    for ct in [None, Some("application/json; charset=utf-8")] {
        let mut req = c
            .post(&url)
            .bearer_auth("sekret")
            .body(serde_json::to_vec(&chat_body(false)).unwrap());
        if let Some(ct) = ct {
            req = req.header("content-type", ct);
        }
        assert_eq!(req.send().await.unwrap().status(), 200, "{ct:?}");
    }

    let r = c.get(&url).bearer_auth("sekret").send().await.unwrap();
    assert_eq!(r.headers()["content-type"], "application/json");
    let (s, v) = error_of(r).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (405, Some("method_not_allowed")),
        "{v}"
    );

    let r = c
        .post(&url)
        .bearer_auth("sekret")
        .json(&json!([{"model": "m"}]))
        .send()
        .await
        .unwrap();
    let (s, v) = error_of(r).await;
    assert_eq!(s, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("must be a JSON object"),
        "{v}"
    );

    let metrics = format!("{}/metrics", gw.url());
    let (s, v) = error_of(c.get(&metrics).send().await.unwrap()).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (401, Some("invalid_api_key"))
    );
    let r = c.get(&metrics).bearer_auth("scrape").send().await.unwrap();
    assert_eq!(r.status(), 200);
    gw.shutdown().await;
}

/// Admission comes before any per-request work: with the gateway full, a request is
/// refused with 429 before its body is read or parsed (an unparseable body gets 429,
/// not 400), and a prompt beyond `max_model_len` is refused with 400
/// `context_length_exceeded` without reaching an engine.
#[tokio::test]
async fn admission_comes_before_parsing_and_tokenization() {
    let slow = fake(
        "slow",
        Behavior {
            chunk_delay: Duration::from_millis(200),
            repeat: 20,
            ..Behavior::default()
        },
    )
    .await;
    let mut cfg = config(&[&slow.url], PolicyKind::PrefixAffinity);
    cfg.models[0].tokenizer = Some(fixtures().join("qwen3-tokenizer"));
    cfg.models[0].max_model_len = Some(256);
    cfg.limits.max_in_flight = 1;
    cfg.limits.max_queue = 0;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());

    let long =
        json!({"model": "m", "messages": [{"role": "user", "content": " cache".repeat(5000)}]});
    let (s, v) = error_of(c.post(&url).json(&long).send().await.unwrap()).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("context_length_exceeded")),
        "{v}"
    );
    assert_eq!(slow.hits(), 0);

    let held = c.post(&url).json(&chat_body(true)).send().await.unwrap();
    assert_eq!(held.status(), 200);
    let r = c.post(&url).body("{not json").send().await.unwrap();
    assert!(r.headers().contains_key("retry-after"));
    let (s, v) = error_of(r).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (429, Some("overloaded")),
        "{v}"
    );
    drop(held);
    eventually("slot freed", || gw.ledger_in_flight("m") == Some(0)).await;
    let (s, v) = error_of(c.post(&url).body("{not json").send().await.unwrap()).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (400, Some("invalid_json")),
        "{v}"
    );
    gw.shutdown().await;
}

/// When the shutdown grace period ends with requests still running, a streaming client
/// gets an error event (`gateway_shutting_down`) as its last event and a clean end of
/// stream, a client still waiting for its worker gets a JSON 503, and the ledger is
/// left empty.
#[tokio::test]
async fn the_end_of_the_grace_period_ends_every_response_cleanly() {
    let slow = fake(
        "slow",
        Behavior {
            chunk_delay: Duration::from_millis(100),
            repeat: 200,
            ..Behavior::default()
        },
    )
    .await;
    let hung = fake(
        "hung",
        Behavior {
            hang: true,
            ..Behavior::default()
        },
    )
    .await;
    let mut cfg = config(&[&slow.url, &hung.url], PolicyKind::RoundRobin);
    cfg.health.interval_ms = 0;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    // Round robin: the first request streams from `slow`, the second waits on `hung`.
    let streaming = c.post(&url).json(&chat_body(true)).send().await.unwrap();
    assert_eq!(worker_of(&streaming), slow.url);
    let waiting = tokio::spawn({
        let (c, url) = (c.clone(), url.clone());
        async move { c.post(&url).json(&chat_body(false)).send().await }
    });
    eventually("request waiting on the hung engine", || hung.hits() == 1).await;
    let model = gw.gateway().model("m").unwrap().clone();
    gw.shutdown_within(Duration::from_millis(300)).await;

    let body = streaming.bytes().await.expect("a clean end of stream");
    let tail_start = body
        .windows(7)
        .rposition(|w| w == b"data: {")
        .expect("an event");
    assert_error_event(&body[tail_start..], "gateway_shutting_down");
    let r = waiting.await.unwrap().expect("an answer");
    assert!(r.headers().contains_key("retry-after"));
    let (s, v) = error_of(r).await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (503, Some("gateway_shutting_down"))
    );
    assert_eq!(model.ledger().in_flight(), 0);
}

/// A body the engine refuses while it is still being sent is the client's problem,
/// not the worker's: the client gets the engine's status as OpenAI-style JSON, the
/// worker's breaker is not charged and the request is not retried elsewhere. Any
/// other non-JSON engine error is wrapped the same way.
#[tokio::test]
async fn a_refused_body_does_not_charge_the_breaker_and_engine_errors_are_json() {
    let limited = |name: &'static str| {
        fake(
            name,
            Behavior {
                body_limit: Some(1 << 20),
                ..Behavior::default()
            },
        )
    };
    let (a, b) = (limited("a").await, limited("b").await);
    let mut cfg = config(&[&a.url, &b.url], PolicyKind::RoundRobin);
    cfg.health.failure_threshold = 1;
    cfg.health.interval_ms = 0;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let big = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(4 << 20)}]});
    for _ in 0..4 {
        let r = c.post(&url).json(&big).send().await.unwrap();
        assert_eq!(r.headers()["content-type"], "application/json");
        let (s, v) = error_of(r).await;
        // Either the engine's 413 arrives (wrapped), or the engine's hang-up reaches
        // hyper first (a race inside every HTTP client): both are the body's fault.
        let engine_413 = s == 413
            && v["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("length limit exceeded"));
        let hung_up = s == 502 && v["error"]["code"] == "upstream_refused_body";
        assert!(engine_413 || hung_up, "{s} {v}");
    }
    assert_eq!(a.hits() + b.hits(), 4, "no retries");
    for w in gw.gateway().model("m").unwrap().workers().iter() {
        assert!(!w.breaker.is_open(), "{} was charged", w.url);
    }
    // The fleet still serves.
    let r = c.post(&url).json(&chat_body(false)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    gw.shutdown().await;
}

/// An engine (or the proxy in front of it) that closes the connection while the body
/// is still being sent: the gateway answers 502 `upstream_refused_body` without
/// charging the worker's breaker or sending the body to another worker.
#[tokio::test]
async fn a_connection_closed_mid_body_does_not_charge_the_breaker() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    let closer = tokio::spawn(async move {
        use tokio::io::AsyncReadExt;
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let mut head = Vec::new();
            let mut buf = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match sock.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => head.extend_from_slice(&buf[..n]),
                }
            }
            if !head.starts_with(b"GET /health") {
                count.fetch_add(1, Ordering::SeqCst);
            }
            if head.starts_with(b"GET /health") {
                use tokio::io::AsyncWriteExt;
                let _ = sock
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    .await;
                continue;
            }
            drop(sock); // unread body: the peer sees a reset
        }
    });
    let b = fake("b", Behavior::default()).await;
    let mut cfg = config(&[&url, &b.url], PolicyKind::RoundRobin);
    cfg.health.failure_threshold = 1;
    cfg.health.interval_ms = 0;
    let gw = start(cfg).await.unwrap();
    let c = client();
    let big = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(8 << 20)}]});
    let (s, v) = error_of(
        c.post(format!("{}/v1/chat/completions", gw.url()))
            .json(&big)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (s, v["error"]["code"].as_str()),
        (502, Some("upstream_refused_body")),
        "{v}"
    );
    assert_eq!(b.hits(), 0, "the body was not sent elsewhere");
    for w in gw.gateway().model("m").unwrap().workers().iter() {
        assert!(!w.breaker.is_open(), "{} was charged", w.url);
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    closer.abort();
    gw.shutdown().await;
}

/// Thousands of requests through a random mix of endings: success (streamed or JSON),
/// an engine error before the first byte (retried elsewhere), a stream that breaks
/// after its first chunk, a client that leaves after its first chunk, and a stream
/// longer than the total timeout. Afterwards every counter is back where it started:
/// admission slots and waiters, the ledger's bookings and every worker's load, the
/// per-model slot waiters, and the breakers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_counter_returns_to_its_start_after_a_random_mix_of_endings() {
    let a = fake("a", Behavior::default()).await;
    let b = fake("b", Behavior::default()).await;
    let mut cfg = config(&[&a.url, &b.url], PolicyKind::LeastLoaded);
    cfg.limits.max_in_flight = 24;
    cfg.limits.max_in_flight_per_worker = 8;
    cfg.limits.max_queue = 4096;
    cfg.limits.queue_timeout_ms = 30_000;
    cfg.timeouts.total_ms = 400;
    cfg.health.failure_threshold = 1_000_000;
    let gw = start(cfg).await.unwrap();
    let model = gw.gateway().model("m").unwrap().clone();
    let start_loads: Vec<_> = model
        .workers()
        .iter()
        .map(|w| model.ledger().load(w.id))
        .collect();
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let n: u64 = 2000;
    let next = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let endings = std::sync::Arc::new(parking_lot::Mutex::new(std::collections::BTreeMap::<
        &'static str,
        u64,
    >::new()));
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let (c, url, next, endings) = (c.clone(), url.clone(), next.clone(), endings.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= n {
                    return;
                }
                // A fixed pseudo-random mix (splitmix of k).
                let mut z = k.wrapping_add(0x9E37_79B9_7F4A_7C15);
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                let (behavior, stream, cancel, name) = match (z ^ (z >> 31)) % 20 {
                    0..=6 => ("ok", true, false, "ok stream"),
                    7..=9 => ("ok", false, false, "ok json"),
                    10..=12 => ("error-status", true, false, "error before first byte"),
                    13..=14 => ("fail-after-first", true, false, "broken after first byte"),
                    15..=17 => ("slow", true, true, "client cancel"),
                    _ => ("slow", true, false, "total timeout"),
                };
                let r = c
                    .post(&url)
                    .header(BEHAVIOR_HEADER, behavior)
                    .json(&chat_body(stream))
                    .send()
                    .await
                    .unwrap();
                let mut body = r.bytes_stream();
                if cancel {
                    let _ = body.next().await;
                    drop(body);
                } else {
                    while let Some(chunk) = body.next().await {
                        if chunk.is_err() {
                            break;
                        }
                    }
                }
                *endings.lock().entry(name).or_default() += 1;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let endings = endings.lock().clone();
    assert_eq!(endings.values().sum::<u64>(), n, "{endings:?}");
    assert_eq!(endings.len(), 6, "{endings:?}");
    eventually("every lease ended", || {
        model.ledger().in_flight() == 0 && gw.admitted() == (0, 0)
    })
    .await;
    for (w, start) in model.workers().iter().zip(&start_loads) {
        assert_eq!(model.ledger().load(w.id), *start, "{}", w.url);
        assert!(!w.breaker.is_open(), "{}", w.url);
    }
    assert_eq!(model.waiting_for_slot(), 0);
    let stats = model.ledger().stats();
    assert_eq!(stats.active, 0);
    assert_eq!(stats.booked, stats.freed);
    assert_eq!(stats.swept, 0, "a booking leaked until the TTL sweep");
    gw.shutdown().await;
}

/// Remote tokenization calls workers the way every other request does: through the
/// gateway's worker client, failing over to another worker, with the failure counted
/// against the worker's breaker (it had its own client, a fixed three tries and no
/// breaker accounting).
#[tokio::test]
async fn remote_tokenization_fails_over_and_charges_the_breaker() {
    let broken = fake(
        "broken",
        Behavior {
            tokenize_fails: true,
            ..Behavior::default()
        },
    )
    .await;
    let good = fake("good", Behavior::default()).await;
    let mut cfg = config(&[&broken.url, &good.url], PolicyKind::PrefixAffinity);
    cfg.models[0].remote_tokenize = true;
    cfg.health.failure_threshold = 2;
    let gw = start(cfg).await.unwrap();
    let c = client();
    for _ in 0..6 {
        let r = c
            .post(format!("{}/v1/completions", gw.url()))
            .json(&json!({"model": "m", "prompt": "hello there"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let model = gw.gateway().model("m").unwrap().clone();
    let broken_worker = model.worker_by_url(&broken.url).unwrap();
    assert!(
        broken_worker.breaker.is_open(),
        "the failing tokenizer was not charged ({} calls)",
        broken.stats.tokenize_calls.load(Ordering::SeqCst)
    );
    assert!(good.stats.tokenize_calls.load(Ordering::SeqCst) >= 6);
    gw.shutdown().await;
}

/// A worker out of rotation is probed at the unhealthy interval, not the regular one:
/// an engine that comes back (a restart) rejoins within a fraction of a second although
/// the regular checks are 30 s apart. Healthy workers keep the regular cadence.
#[tokio::test]
async fn a_worker_out_of_rotation_is_probed_often_and_rejoins_soon() {
    let down = fake("down", Behavior::default()).await;
    let up = fake("up", Behavior::default()).await;
    down.stats.healthy.store(false, Ordering::SeqCst);
    let mut cfg = config(&[&down.url, &up.url], PolicyKind::RoundRobin);
    cfg.health.interval_ms = 30_000;
    cfg.health.unhealthy_interval_ms = 50;
    cfg.health.failure_threshold = 1;
    let gw = start(cfg).await.unwrap();
    let breaker_open = |i: usize| {
        gw.gateway().model("m").unwrap().workers()[i]
            .breaker
            .is_open()
    };
    eventually("the failing worker is out of rotation", || breaker_open(0)).await;
    assert!(!breaker_open(1));
    // Many probes of the worker out of rotation, none of the healthy one after the
    // first round.
    let checks = |f: &Fake| f.stats.health_checks.load(Ordering::SeqCst);
    let (down_checks, up_checks) = (checks(&down), checks(&up));
    // Three more probes take 150 ms at the 50 ms interval; waited for, not timed, so a
    // busy machine only makes it slower. Meanwhile the healthy worker is not probed.
    eventually("three more probes of the worker out of rotation", || {
        checks(&down) >= down_checks + 3
    })
    .await;
    assert_eq!(checks(&up), up_checks);
    down.stats.healthy.store(true, Ordering::SeqCst);
    eventually("the recovered worker is back in rotation", || {
        !breaker_open(0)
    })
    .await;
    gw.shutdown().await;
}
