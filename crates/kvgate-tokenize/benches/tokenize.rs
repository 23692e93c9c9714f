//! Local tokenization cost on the request path: chat requests of ~1k, 8k and 32k
//! tokens (Qwen3 tokenizer + chat template), split into template rendering and
//! encoding so we know which one to optimise.
//!
//! Run: `cargo bench -p kvgate-tokenize --bench tokenize -- --warm-up-time 1 --measurement-time 3`

use std::path::PathBuf;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvgate_tokenize::{LocalTokenizer, RequestBody, RequestKind, RoutingTokens};
use serde_json::{json, Value};

const PHRASES: &[&str] = &[
    "The quarterly report shows revenue growth across all regions, driven by strong demand.",
    "Please summarise the following document and list the three most important risks.",
    "fn main() { let v: Vec<u32> = (0..10).map(|x| x * 2).collect(); println!(\"{:?}\", v); }",
    "Die Lieferung wurde gestern verschickt und sollte übermorgen ankommen.",
    "東京の天気は明日晴れる予報です。週末は雨が降るかもしれません。",
    "Пожалуйста, проверьте настройки сервера и перезапустите службу.",
    "SELECT user_id, COUNT(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY user_id;",
    "In 2023, the team shipped 47 releases with a median lead time of 3.2 days.",
    "Le modèle doit répondre en français, de manière concise et précise.",
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}",
    "Users report that the cache hit rate drops sharply after each deployment.",
    "मौसम आज साफ़ है और तापमान सामान्य से थोड़ा अधिक है।",
];

/// Deterministic pseudo-random text of `n` phrases.
fn text(seed: u64, n: usize) -> String {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut out = String::new();
    for i in 0..n {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        out.push_str(PHRASES[(state >> 33) as usize % PHRASES.len()]);
        out.push(if i % 7 == 6 { '\n' } else { ' ' });
    }
    out
}

/// A chat with a long system prompt and a few turns, `n` phrases in total.
fn chat(n: usize) -> Value {
    let system = n / 4;
    let turn = (n - system) / 5;
    json!({"messages": [
        {"role": "system", "content": text(1, system)},
        {"role": "user", "content": text(2, turn)},
        {"role": "assistant", "content": text(3, turn)},
        {"role": "user", "content": text(4, turn)},
        {"role": "assistant", "content": text(5, turn)},
        {"role": "user", "content": text(6, n - system - 4 * turn)},
    ]})
}

fn token_count(tok: &LocalTokenizer, body: &Value) -> usize {
    match tok.tokenize(RequestKind::Chat, &RequestBody::from(body)) {
        Ok(RoutingTokens::Tokens { ids, .. }) => ids.len(),
        other => panic!("{other:?}"),
    }
}

/// Smallest chat with at least `target` tokens.
fn chat_with_tokens(tok: &LocalTokenizer, target: usize) -> (Value, usize) {
    let mut n = target / 20;
    loop {
        let body = chat(n);
        let count = token_count(tok, &body);
        if count >= target {
            return (body, count);
        }
        n = (n * target / count.max(1)).max(n + 1);
    }
}

fn bench(c: &mut Criterion) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3-tokenizer");
    // Without the segment cache: every iteration encodes the text as if never seen
    // (what the cache saves is measured end to end by scripts/decision-cost.py).
    let tok = LocalTokenizer::from_dir(&dir)
        .expect("fixture tokenizer")
        .with_segment_cache(0);
    let mut group = c.benchmark_group("tokenize_chat");
    group.measurement_time(Duration::from_secs(3));
    for (label, target) in [("1k", 1_000), ("8k", 8_000), ("32k", 32_000)] {
        let (body, count) = chat_with_tokens(&tok, target);
        let prompt = tok.render_chat(&RequestBody::from(&body)).expect("renders");
        group.throughput(Throughput::Elements(count as u64));
        group.bench_with_input(BenchmarkId::new("full", label), &body, |b, body| {
            b.iter(|| tok.tokenize(RequestKind::Chat, &RequestBody::from(body)))
        });
        group.bench_with_input(BenchmarkId::new("render_only", label), &body, |b, body| {
            b.iter(|| tok.render_chat(&RequestBody::from(body)))
        });
        group.bench_with_input(
            BenchmarkId::new("encode_only", label),
            &prompt,
            |b, prompt| b.iter(|| tok.encode(prompt, false)),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
