//! The command lines users copy must parse: every `kvgate` (or `cargo run -- `) command
//! in the code blocks of README.md, docs/BENCHMARKS.md and docs/operations.md, and every example flag a
//! `--help` text gives (`e.g. --engine-arg=--max-num-seqs=64`), is run through the real
//! binary's parser (`<command> --help`: clap checks every flag and value before it
//! sees `--help`, and nothing starts). Also: each value-taking flag of `kvgate serve`
//! shows its default in `--help`, unless it has none by nature (listed below).

use std::path::{Path, PathBuf};
use std::process::Command;

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvgate"))
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Splits a shell command line into words: quotes group, `\` escapes; enough for the
/// commands in the docs (no expansions are evaluated, `$VAR` stays a word).
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quote: Option<char> = None;
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                in_word = true;
            }
            (None, '\\') => {
                if let Some(n) = chars.next() {
                    word.push(n);
                    in_word = true;
                }
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// The kvgate arguments of every command in a markdown file's code blocks.
fn documented_commands(markdown: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for (i, block) in markdown.split("```").enumerate() {
        if i % 2 == 0 {
            continue; // outside a code block
        }
        let body = block.split_once('\n').map_or("", |(_, b)| b);
        for line in body.replace("\\\n", " ").lines() {
            let line = line.split(" #").next().unwrap_or(line);
            for part in line.split("&&").flat_map(|p| p.split(" | ")) {
                let words = shell_words(part);
                let start = words.iter().position(|w| {
                    w == "kvgate" || w.ends_with("/kvgate") || w == "--" && words[0] == "cargo"
                });
                // Only the commands that start kvgate (not `cargo test -- ...`, not the
                // word in prose or a path).
                let Some(start) = start else { continue };
                if words[0] == "cargo" && words.get(1).map(String::as_str) != Some("run") {
                    continue;
                }
                if words[0] != "cargo"
                    && start != 0
                    && !words[..start].iter().all(|w| w.contains('='))
                {
                    continue;
                }
                let args: Vec<String> = words[start + 1..].to_vec();
                if !args.is_empty() {
                    out.push(args);
                }
            }
        }
    }
    out
}

fn parses(args: &[String]) -> Result<(), String> {
    let out = Command::new(bin())
        .args(args)
        .arg("--help")
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

#[test]
fn documented_command_lines_parse() {
    let mut checked = 0;
    for doc in ["README.md", "docs/BENCHMARKS.md", "docs/operations.md"] {
        let text = std::fs::read_to_string(repo().join(doc)).unwrap();
        for args in documented_commands(&text) {
            if let Err(e) = parses(&args) {
                panic!("{doc}: `kvgate {}` does not parse:\n{e}", args.join(" "));
            }
            checked += 1;
        }
    }
    assert!(checked >= 10, "only {checked} commands found");
}

const SUBCOMMANDS: &[&[&str]] = &[
    &["serve"],
    &["mock-engine"],
    &["up"],
    &["demo"],
    &["bench"],
    &["bench", "compare"],
    &["bench", "scenarios"],
    &["bench", "chaos"],
    &["tokenize"],
];

fn help_of(sub: &[&str]) -> String {
    let out = Command::new(bin())
        .args(sub)
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success(), "{sub:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// `e.g. --engine-arg=--flag=value` and `e.g. --kvgate-arg=--flag=value` in a help text
/// name a flag of `mock-engine` or `serve`: it must exist there.
#[test]
fn help_examples_parse() {
    let mut checked = 0;
    for sub in SUBCOMMANDS {
        let help = help_of(sub);
        for (prefix, target) in [("--engine-arg=", "mock-engine"), ("--kvgate-arg=", "serve")] {
            for (i, _) in help.match_indices(prefix) {
                let example = help[i + prefix.len()..]
                    .split(|c: char| c.is_whitespace() || c == ')' || c == ',')
                    .next()
                    .unwrap_or("");
                if example.starts_with('-') {
                    let args = vec![target.to_string(), example.to_string()];
                    if let Err(e) = parses(&args) {
                        panic!("`kvgate {sub:?} --help` gives {prefix}{example}: {e}");
                    }
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 1);
}

/// Value-taking flags of `kvgate serve` that have no default by nature: unset means
/// "not configured" (a file, names, secrets, an optional limit or seed).
const SERVE_FLAGS_WITHOUT_DEFAULT: &[&str] = &[
    "--config",
    "--model",
    "--worker",
    "--tokenizer",
    "--max-model-len",
    "--slo-ttft-ms",
    "--slo-tpot-ms",
    "--num-gpu-blocks",
    "--kv-events",
    "--kv-events-replay",
    "--kv-fallback",
    "--lora-adapter",
    "--hash-salt",
    "--seed",
    "--api-key",
    "--admin-token",
    "--worker-api-key",
    "--metrics-token",
    "--peer",
    "--peers-dns",
    "--workers-dns",
    "--workers-dns-kv-events-port",
    "--workers-dns-replay-port",
    "--pd-mode",
    "--prefill-worker",
    "--bootstrap-port",
    "--decode-policy",
];

#[test]
fn serve_help_shows_every_default() {
    let help = help_of(&["serve"]);
    let mut flags = 0;
    // Each option starts a line with `--name <VALUE>`; its text runs to the next one.
    let starts: Vec<usize> = help
        .match_indices("\n      --")
        .map(|(i, _)| i + 7)
        .collect();
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).copied().unwrap_or(help.len());
        let entry = &help[start..end];
        let name = entry.split_whitespace().next().unwrap_or("");
        let takes_value = entry
            .split_whitespace()
            .nth(1)
            .is_some_and(|w| w.starts_with('<'));
        if !takes_value || SERVE_FLAGS_WITHOUT_DEFAULT.contains(&name) {
            continue;
        }
        assert!(
            entry.contains("[default: "),
            "`kvgate serve --help` shows no default for {name}:\n{entry}"
        );
        flags += 1;
    }
    assert!(flags >= 30, "{flags} flags with defaults in:\n{help}");
}
