//! The engine's msgpack encoding reproduces vLLM 0.32's captured payloads byte for byte.

use kvgate_mock_engine::wire::encode_batch;
use kvgate_mock_engine::KvEvent;
use rmpv::Value;

fn fixture(name: &str) -> Vec<u8> {
    let path = format!(
        "{}/../../fixtures/vllm-0.32/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read(path).unwrap()
}

fn field<'a>(map: &'a [(Value, Value)], key: &str) -> &'a Value {
    &map.iter().find(|(k, _)| k.as_str() == Some(key)).unwrap().1
}

fn to_event(v: &Value) -> KvEvent {
    let map = v.as_map().unwrap();
    let u64s = |v: &Value| -> Vec<u64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    match field(map, "type").as_str().unwrap() {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: u64s(field(map, "block_hashes")),
            parent_block_hash: field(map, "parent_block_hash").as_u64(),
            token_ids: u64s(field(map, "token_ids"))
                .into_iter()
                .map(|t| t as u32)
                .collect(),
            block_size: field(map, "block_size").as_u64().unwrap() as u32,
        },
        "BlockRemoved" => KvEvent::BlockRemoved {
            block_hashes: u64s(field(map, "block_hashes")),
        },
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        other => panic!("unexpected {other}"),
    }
}

fn check_frames(file: &str) -> usize {
    let data = fixture(file);
    let msgs = rmpv::decode::read_value(&mut &data[..]).unwrap();
    let mut n = 0;
    for msg in msgs.as_array().unwrap() {
        let frames = msg.as_array().unwrap();
        let payload = match &frames[frames.len() - 1] {
            Value::Binary(b) => b.clone(),
            other => panic!("payload frame {other:?}"),
        };
        let batch = rmpv::decode::read_value(&mut &payload[..]).unwrap();
        let parts = batch.as_array().unwrap();
        let ts = parts[0].as_f64().unwrap();
        let events: Vec<KvEvent> = parts[1].as_array().unwrap().iter().map(to_event).collect();
        let rank = parts[2].as_u64().unwrap() as u32;
        let ours = encode_batch(ts, &events, rank).unwrap();
        assert_eq!(ours, payload, "payload differs in {file}");
        n += 1;
    }
    n
}

#[test]
fn encoding_matches_vllm_032_captures_byte_for_byte() {
    assert_eq!(check_frames("vllm-0.32-pub-frames.msgpack"), 9);
    assert!(check_frames("vllm-0.32-pub-frames-clear.msgpack") >= 2);
}
