//! Property tests: the decoder never panics, whatever it is fed.

mod common;

use kvgate_core::{BlockHasher, IndexConfig, PrefixIndex, WorkerId, WorkerRef};
use kvgate_events::{apply_batch, decode_batch};
use proptest::prelude::*;
use rmpv::Value;

fn arb_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Boolean),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::F64),
        "[a-zA-Z_]{0,20}".prop_map(Value::from),
        prop_oneof![
            Just("BlockStored"),
            Just("BlockRemoved"),
            Just("AllBlocksCleared"),
            Just("type"),
            Just("block_hashes"),
            Just("token_ids"),
            Just("block_size"),
            Just("extra_keys"),
        ]
        .prop_map(Value::from),
        proptest::collection::vec(any::<u8>(), 0..16).prop_map(Value::Binary),
    ];
    leaf.prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            proptest::collection::vec((inner.clone(), inner), 0..6).prop_map(Value::Map),
        ]
    })
}

/// Events shaped like the real ones, with arbitrary field values.
fn arb_eventish() -> impl Strategy<Value = Value> {
    let tag = prop_oneof![
        Just("BlockStored"),
        Just("BlockRemoved"),
        Just("AllBlocksCleared")
    ];
    (tag, proptest::collection::vec(arb_value(), 0..12)).prop_map(|(t, mut fields)| {
        fields.insert(0, Value::from(t));
        Value::Array(fields)
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 400, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn arbitrary_msgpack_values_never_panic(v in arb_value()) {
        let _ = decode_batch(&common::encode(&v));
    }

    #[test]
    fn event_shaped_batches_never_panic_even_when_applied(
        events in proptest::collection::vec(arb_eventish(), 0..6),
        rank in proptest::option::of(any::<u32>()),
    ) {
        let payload = common::batch(events, rank);
        if let Ok(b) = decode_batch(&payload) {
            let mut idx = PrefixIndex::new(BlockHasher::new(4).unwrap(), IndexConfig::default());
            let _ = apply_batch(&mut idx, WorkerRef::new(WorkerId(0), 0), &b);
        }
        // Every truncation of a valid-looking payload is handled too.
        for cut in 0..payload.len().min(64) {
            let _ = decode_batch(&payload[..cut]);
        }
    }
}
