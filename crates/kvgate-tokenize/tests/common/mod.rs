//! Shared test helpers: the repo's fixtures, loaded once per test binary.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kvgate_tokenize::LocalTokenizer;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures")
}

pub fn qwen3_dir() -> PathBuf {
    fixtures().join("qwen3-tokenizer")
}

/// The Qwen3 tokenizer (11 MB tokenizer.json): loaded once per test binary.
#[allow(dead_code)] // not every test binary uses it
pub fn qwen3() -> Arc<LocalTokenizer> {
    static TOK: OnceLock<Arc<LocalTokenizer>> = OnceLock::new();
    TOK.get_or_init(|| Arc::new(LocalTokenizer::from_dir(&qwen3_dir()).unwrap()))
        .clone()
}

/// Qwen3's vocabulary with `template` as its chat template (`chat_template.jinja` in a
/// directory of its own, kept while the returned guard lives).
#[allow(dead_code)] // not every test binary uses it
pub fn qwen3_with_template(template: &str) -> (tempfile::TempDir, LocalTokenizer) {
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        qwen3_dir().join("tokenizer.json"),
        dir.path().join("tokenizer.json"),
    )
    .unwrap();
    std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
    let tok = LocalTokenizer::from_dir(dir.path()).unwrap();
    (dir, tok)
}
