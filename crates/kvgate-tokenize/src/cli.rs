//! `kvgate tokenize`: read one OpenAI request body on stdin, print the token ids the
//! engine would prefill as a JSON array, for operators checking parity with an engine.
//!
//! Owns the subcommand's arguments and I/O only; tokenization is the library's. Must
//! not start servers or touch routing.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;

use crate::{LocalTokenizer, RemoteTokenizer, RequestBody, RequestKind, RoutingTokens, Tokenizer};

/// Which endpoint the body is for.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KindArg {
    /// Chat if the body has `messages`, else completion.
    #[default]
    Auto,
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completion,
}

/// Arguments of `kvgate tokenize`.
#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("source").required(true).args(["tokenizer", "remote"])))]
pub struct TokenizeArgs {
    /// Model directory with tokenizer.json and tokenizer_config.json (local mode).
    #[arg(long, value_name = "DIR")]
    pub tokenizer: Option<PathBuf>,
    /// Engine base URL whose POST /tokenize to use instead (remote mode).
    #[arg(long, value_name = "URL")]
    pub remote: Option<String>,
    /// Bearer token for the remote engine.
    #[arg(long, env = "KVGATE_ENGINE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Remote request timeout in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub timeout_ms: u64,
    /// Request kind; `auto` detects chat by the presence of `messages`.
    #[arg(long, value_enum, default_value_t = KindArg::Auto)]
    pub kind: KindArg,
    /// Print the rendered chat prompt text instead of token ids (local mode, chat only).
    #[arg(long)]
    pub print_prompt: bool,
}

/// Entry point called by the `kvgate` binary: stdin → stdout.
pub async fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    run_with_io(args, std::io::stdin().lock(), stdout.lock()).await
}

/// The command with explicit input and output (used by tests).
pub async fn run_with_io(
    args: TokenizeArgs,
    mut input: impl Read,
    mut output: impl Write,
) -> anyhow::Result<()> {
    let mut raw = String::new();
    input
        .read_to_string(&mut raw)
        .context("cannot read the request body from stdin")?;
    let body = RequestBody::parse(raw.as_bytes()).context("stdin is not a JSON request body")?;
    let kind = match args.kind {
        KindArg::Auto => RequestKind::detect(&body),
        KindArg::Chat => RequestKind::Chat,
        KindArg::Completion => RequestKind::Completion,
    };
    let tokenizer = match (&args.tokenizer, &args.remote) {
        (Some(dir), None) => {
            let local = LocalTokenizer::from_dir(dir)
                .with_context(|| format!("cannot load the tokenizer from {}", dir.display()))?;
            if args.print_prompt {
                anyhow::ensure!(
                    kind == RequestKind::Chat,
                    "--print-prompt needs a chat body"
                );
                let prompt = local.render_chat(&body)?;
                output.write_all(prompt.as_bytes())?;
                output.flush()?;
                return Ok(());
            }
            Tokenizer::Local(Arc::new(local))
        }
        (None, Some(url)) => {
            anyhow::ensure!(!args.print_prompt, "--print-prompt needs --tokenizer");
            let mut remote = RemoteTokenizer::new(url, Duration::from_millis(args.timeout_ms))?;
            if let Some(key) = &args.api_key {
                remote = remote.with_bearer_token(key.clone());
            }
            Tokenizer::Remote(remote)
        }
        _ => anyhow::bail!("give exactly one of --tokenizer DIR or --remote URL"),
    };
    match tokenizer.tokenize(kind, &body).await? {
        RoutingTokens::Tokens {
            ids,
            non_text_parts,
        } => {
            if non_text_parts > 0 {
                tracing::warn!(
                    non_text_parts,
                    "non-text content parts were skipped: the ids cover the text only"
                );
            }
            serde_json::to_writer(&mut output, &ids)?;
            writeln!(output)?;
            output.flush()?;
            Ok(())
        }
        RoutingTokens::NoRoutingTokens { reason } => {
            anyhow::bail!("this body has no routing tokens ({reason})")
        }
    }
}
