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
