//! Property tests: the decoder never panics, whatever it is fed, and the generators
//! reach its decoding paths (a share of the generated batches decodes and applies).

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

/// Well-formed events (map shape, as vLLM's msgspec sends them) with arbitrary sizes and
/// values: stores of 0-3 blocks, some with a parent, removals, clears.
fn arb_valid_event() -> impl Strategy<Value = Value> {
    prop_oneof![
        (
            proptest::collection::vec(any::<u64>(), 0..4),
            proptest::option::of(any::<u64>()),
            any::<u64>(),
        )
            .prop_map(|(hashes, parent, seed)| {
                let toks: Vec<u32> = (0..hashes.len() as u64)
                    .flat_map(|i| common::block_tokens(seed ^ i, 4))
                    .collect();
                common::stored_map(&hashes, parent, &toks, 4)
            }),
        proptest::collection::vec(any::<u64>(), 0..4).prop_map(|h| common::removed_map(&h)),
        Just(Value::Map(vec![(
            common::s("type"),
            common::s("AllBlocksCleared")
        )])),
    ]
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
        events in proptest::collection::vec(prop_oneof![arb_eventish(), arb_valid_event()], 0..6),
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

/// The generators must not be all noise: run them with a fixed seed and check that
/// batches of well-formed events decode and change the index, and that some of the
/// arbitrary event-shaped ones are rejected (so both paths are exercised).
#[test]
fn generated_batches_reach_the_decoder_and_the_index() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(
        Config::default(),
        TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]),
    );
    let (mut decoded, mut applied, n) = (0, 0, 400);
    for _ in 0..n {
        let events = proptest::collection::vec(arb_valid_event(), 1..6)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        if let Ok(b) = decode_batch(&common::batch(events, Some(0))) {
            decoded += 1;
            let mut idx = PrefixIndex::new(BlockHasher::new(4).unwrap(), IndexConfig::default());
            let out = apply_batch(&mut idx, WorkerRef::new(WorkerId(0), 0), &b);
            if out.events_applied > 0 {
                applied += 1;
            }
        }
    }
    assert!(
        decoded * 10 >= n * 9,
        "only {decoded} of {n} well-formed batches decoded"
    );
    assert!(
        applied * 2 >= n,
        "only {applied} of {n} batches changed the index"
    );
    let (mut rejected, mut accepted) = (0, 0);
    for _ in 0..n {
        let events = proptest::collection::vec(arb_eventish(), 1..4)
            .new_tree(&mut runner)
            .unwrap()
            .current();
        match decode_batch(&common::batch(events, Some(0))) {
            Ok(_) => accepted += 1,
            Err(_) => rejected += 1,
        }
    }
    assert!(rejected > 0, "no arbitrary batch was rejected");
    assert!(accepted + rejected == n);
}
