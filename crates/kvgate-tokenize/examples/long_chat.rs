//! Where the time of tokenizing a long conversation goes: render vs encode, cold and
//! with its history seen. `cargo run --release -p kvgate-tokenize --example long_chat`.
use std::time::Instant;

use kvgate_tokenize::{LocalTokenizer, RequestBody, RequestKind};
use serde_json::{json, Value};

fn words(seed: usize, n: usize) -> String {
    (0..n)
        .map(|i| format!("w{}x{}", (seed * 7919 + i * 104729) % 5000, i % 13))
        .collect::<Vec<_>>()
        .join(" ")
}

fn conversation(turns: usize) -> Value {
    let mut messages = vec![json!({"role": "system", "content": words(0, 2000)})];
    for t in 0..turns {
        let role = if t % 2 == 0 { "user" } else { "assistant" };
        messages.push(json!({"role": role, "content": words(t + 1, 300)}));
    }
    json!({"model": "m", "messages": messages})
}

fn main() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3-tokenizer");
    let tok = LocalTokenizer::from_dir(&dir).expect("tokenizer");
    for turns in [8, 64, 256, 512] {
        let body = conversation(turns);
        let text = serde_json::to_vec(&body).unwrap();
        let mut times = Vec::new();
        let mut n = 0;
        for _ in 0..5 {
            let t0 = Instant::now();
            let v: Value = serde_json::from_slice(&text).unwrap();
            let t1 = Instant::now();
            let prompt = tok.render_chat(&RequestBody::from(&v)).unwrap();
            let t2 = Instant::now();
            let r = tok
                .tokenize(RequestKind::Chat, &RequestBody::from(&v))
                .unwrap();
            let t3 = Instant::now();
            if let kvgate_tokenize::RoutingTokens::Tokens { ids, .. } = r {
                n = ids.len();
            }
            times.push((t1 - t0, t2 - t1, t3 - t2, prompt.len()));
        }
        let (p, r, t, _) = times[4];
        println!("turns {turns:4} body {:7} B tokens {n:7}: parse {p:?} render {r:?} tokenize(render+encode) {t:?} (first: {:?})", text.len(), times[0].2);
    }
}
