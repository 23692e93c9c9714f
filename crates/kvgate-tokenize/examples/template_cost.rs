//! What a chat template costs per message, apart from encoding: Qwen3's template over a
//! long conversation (821 messages of 1.7 KB), beside three templates that each do one
//! of the things it does (output every content; the `'<|im_start|>' + role + ... + '\n'`
//! concatenations; the reverse scan for the last user query).
//! `cargo run --release -p kvgate-tokenize --example template_cost`.
use std::time::Instant;

use minijinja::{Environment, Value};

fn main() {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/qwen3-tokenizer");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("tokenizer_config.json")).expect("config"),
    )
    .expect("json");
    let qwen3 = config["chat_template"]
        .as_str()
        .expect("template")
        .to_owned();
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    let templates = [
        ("qwen3", qwen3.as_str()),
        ("output", "{% for m in messages %}{{ m.content }}{% endfor %}"),
        ("concatenate", "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}{% endfor %}"),
        ("reverse scan", "{% set ns = namespace(a=true, b=messages|length - 1) %}{% for m in messages[::-1] %}{% set index = (messages|length - 1) - loop.index0 %}{% if ns.a and m.role == 'user' %}{% set ns.a = false %}{% endif %}{% endfor %}"),
    ];
    for (name, source) in templates {
        env.add_template_owned(name, source.to_owned())
            .expect("compiles");
    }
    let words = "alpha beta gamma delta ".repeat(75);
    let messages: Vec<Value> = (0..821)
        .map(|i| {
            let role = match i {
                0 => "system",
                i if i % 2 == 1 => "user",
                _ => "assistant",
            };
            Value::from_iter([
                ("role", Value::from(role)),
                ("content", Value::from(words.as_str())),
            ])
        })
        .collect();
    let ctx = Value::from_iter([
        ("messages", Value::from(messages)),
        ("add_generation_prompt", Value::from(true)),
    ]);
    for (name, _) in templates {
        let template = env.get_template(name).expect("added");
        let start = Instant::now();
        for _ in 0..200 {
            std::hint::black_box(template.render(&ctx).expect("renders"));
        }
        println!("{name:>12}: {:?} per render", start.elapsed() / 200);
    }
}
