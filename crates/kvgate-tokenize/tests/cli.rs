//! `kvgate tokenize`: body on stdin, token ids as a JSON array on stdout.

mod common;

use clap::Parser;
use kvgate_tokenize::cli::{run_with_io, TokenizeArgs};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: TokenizeArgs,
}

fn args(extra: &[&str]) -> TokenizeArgs {
    let dir = common::qwen3_dir();
    let mut argv = vec!["kvgate-tokenize", "--tokenizer", dir.to_str().unwrap()];
    argv.extend_from_slice(extra);
    Cli::try_parse_from(argv).unwrap().args
}

async fn run(extra: &[&str], stdin: &str) -> anyhow::Result<String> {
    let mut out = Vec::new();
    run_with_io(args(extra), stdin.as_bytes(), &mut out).await?;
    Ok(String::from_utf8(out).unwrap())
}

#[tokio::test]
async fn prints_chat_ids_as_json_array() {
    let out = run(
        &[],
        r#"{"messages":[{"role":"user","content":"hello there"}]}"#,
    )
    .await
    .unwrap();
    assert_eq!(
        out,
        "[151644,872,198,14990,1052,151645,198,151644,77091,198]\n"
    );
}

#[tokio::test]
async fn prints_completion_ids_and_prompt() {
    let out = run(
        &[],
        r#"{"prompt":"No special tokens","add_special_tokens":false}"#,
    )
    .await
    .unwrap();
    let ids: Vec<u32> = serde_json::from_str(&out).unwrap();
    assert_eq!(ids.len(), 3);
    let prompt = run(
        &["--print-prompt"],
        r#"{"messages":[{"role":"user","content":"hi"}]}"#,
    )
    .await
    .unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[tokio::test]
async fn errors_are_reported() {
    assert!(run(&[], "not json").await.is_err());
    let err = run(&[], r#"{"prompt":["a","b"]}"#).await.unwrap_err();
    assert!(err.to_string().contains("no routing tokens"), "{err}");
    assert!(
        Cli::try_parse_from(["x"]).is_err(),
        "needs --tokenizer or --remote"
    );
    assert!(Cli::try_parse_from(["x", "--tokenizer", "a", "--remote", "http://b"]).is_err());
}
