//! `--tokenizer DIR`: the gateway's local tokenizer (kvgate-tokenize), so engine and
//! router produce the same prompt ids from the same model files.
//!
//! Owns the adapter from kvgate-tokenize's [`LocalTokenizer`] to the engine's
//! [`PromptTokenizer`] only.

use std::path::Path;
use std::sync::Arc;

use kvgate_tokenize::{LocalTokenizer, RequestBody, RequestKind, RoutingTokens};
use serde_json::Value;

use crate::tokenizer::{PromptTokenizer, TokenizeError};

struct Local(LocalTokenizer);

impl PromptTokenizer for Local {
    fn chat(&self, body: &Value) -> Result<Vec<u32>, TokenizeError> {
        match self.0.tokenize(RequestKind::Chat, &RequestBody::from(body)) {
            Ok(RoutingTokens::Tokens { ids, .. }) => Ok(ids),
            Ok(RoutingTokens::NoRoutingTokens { reason }) => {
                Err(TokenizeError::Invalid(reason.to_string()))
            }
            Err(e) => Err(TokenizeError::Tokenizer(e.to_string())),
        }
    }

    fn text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizeError> {
        self.0
            .encode(text, add_special_tokens)
            .map_err(|e| TokenizeError::Tokenizer(e.to_string()))
    }
}

/// Load the tokenizer in `dir` (`tokenizer.json` + `tokenizer_config.json`).
pub fn load(dir: &Path) -> anyhow::Result<Arc<dyn PromptTokenizer>> {
    let tok = LocalTokenizer::from_dir(dir)?;
    Ok(Arc::new(Local(tok)))
}
