//! KV events over ZeroMQ: PUB frames `[topic, seq, payload]` with consecutive seqs,
//! decodable by kvgate-events, and the ROUTER replay answering like vLLM.

use std::time::Duration;

use bytes::Bytes;
use kvgate_mock_engine::{spawn, EngineConfig, PublisherConfig, RunningEngine, SimConfig};
use serde_json::json;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

async fn complete(e: &RunningEngine, first_token: u32) {
    let prompt: Vec<u32> = (first_token..first_token + 40).collect();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", e.base_url()))
        .json(&json!({"prompt": prompt, "max_tokens": 2, "ignore_eos": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

fn seq_of(frame: &Bytes) -> u64 {
    u64::from_be_bytes(<[u8; 8]>::try_from(frame.as_ref()).unwrap())
}

#[tokio::test]
async fn pub_and_replay_follow_the_vllm_protocol() {
    let e = spawn(EngineConfig {
        sim: SimConfig {
            block_size: 16,
            num_blocks: 64,
            ..SimConfig::default()
        },
        speedup: 200.0,
        kv_events: Some(PublisherConfig {
            dp_rank: 2,
            ..PublisherConfig::default()
        }),
        ..EngineConfig::default()
    })
    .await
    .unwrap();
    let mut sub = zeromq::SubSocket::new();
    sub.connect(e.kv_events_endpoint.as_deref().unwrap())
        .await
        .unwrap();
    sub.subscribe("kv").await.unwrap();

    // Until the subscription has propagated, messages may be dropped (ZeroMQ's slow
    // joiner): keep publishing until one arrives.
    let mut received = Vec::new();
    let mut next_prompt = 0u32;
    for _ in 0..100 {
        complete(&e, next_prompt).await;
        next_prompt += 1000;
        if let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
            received.push(m.into_vec());
            break;
        }
    }
    assert!(!received.is_empty(), "no KV event received");
    for _ in 0..3 {
        complete(&e, next_prompt).await;
        next_prompt += 1000;
        let m = tokio::time::timeout(Duration::from_secs(5), sub.recv())
            .await
            .unwrap()
            .unwrap();
        received.push(m.into_vec());
    }
    let first_seq = seq_of(&received[0][1]);
    for (i, frames) in received.iter().enumerate() {
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0].as_ref(), b"kv");
        assert_eq!(seq_of(&frames[1]), first_seq + i as u64);
        let batch = kvgate_events::decode_batch(&frames[2]).unwrap();
        assert_eq!(batch.dp_rank, Some(2));
        assert!(!batch.events.is_empty());
        assert_eq!(batch.unknown_events, 0);
    }
    let last_seq = seq_of(&received.last().unwrap()[1]);

    // Replay from seq 1: every batch from 1 to the last, then the end marker.
    let mut dealer = zeromq::DealerSocket::new();
    dealer
        .connect(e.replay_endpoint.as_deref().unwrap())
        .await
        .unwrap();
    let req = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&1u64.to_be_bytes()),
    ])
    .unwrap();
    dealer.send(req).await.unwrap();
    let mut expect = 1u64;
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), dealer.recv())
            .await
            .unwrap()
            .unwrap()
            .into_vec();
        assert_eq!(m.len(), 4, "{m:?}");
        assert!(m[0].is_empty());
        if m[2].as_ref() == [0xFF; 8] {
            assert!(m[1].is_empty() && m[3].is_empty());
            break;
        }
        assert_eq!(m[1].as_ref(), b"kv");
        assert_eq!(seq_of(&m[2]), expect);
        kvgate_events::decode_batch(&m[3]).unwrap();
        if let Some(r) = received.iter().find(|r| seq_of(&r[1]) == expect) {
            assert_eq!(
                r[2], m[3],
                "replayed payload differs from the published one"
            );
        }
        expect += 1;
    }
    assert_eq!(expect, last_seq + 1);
    e.shutdown().await;
}
