//! A faster encoder for the common byte-level BPE tokenizer shape (Qwen2/3, Llama 3,
//! GPT-style): same pipeline and same ids as the `tokenizers` crate, without its
//! `fancy-regex` pre-tokenizer.
//!
//! With the pure-Rust feature set, `tokenizers` runs the whole split pattern in
//! fancy-regex's backtracking VM because of a single `\s+(?!\S)` lookahead, which
//! makes encoding ~3 µs/token. Here the pattern runs on `regex-automata`'s DFA with
//! `\s+(?!\S)|\s+` replaced by `\s+` plus an exact fix-up (a whitespace run followed by
//! a non-space gives its last character to the next piece), then the crate's own BPE
//! model encodes each piece. A piece is searched for anchored where the last one ended
//! (one forward pass; the usual case, since these patterns match at every position)
//! and unanchored only when nothing matches there, which finds the same leftmost-first
//! match. Owns only that pipeline; it must accept a tokenizer only when every stage is
//! one it reproduces exactly (see [`FastEncoder::new`]), and the caller falls back to
//! `tokenizers` otherwise.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};

use aho_corasick::{AhoCorasick, MatchKind};
use regex_automata::dfa::{dense, Automaton as _, StartKind};
use regex_automata::{meta, Anchored, Input};

use crate::segments::{SegmentCache, SEGMENT_MIN_BYTES};
use rustc_hash::FxHashMap;
use serde_json::Value;

/// Entries kept per thread in the piece → ids cache before it is cleared.
const PIECE_CACHE_MAX: usize = 65_536;
/// Largest dense DFA built for the split pattern (Qwen3's: 1.4 MB); past it, the lazy
/// DFA searches alone.
const ANCHORED_DFA_MAX_BYTES: usize = 8 << 20;
/// Pieces longer than this (bytes of text) bypass the cache.
const PIECE_CACHE_MAX_LEN: usize = 64;

/// A piece's text (before the byte-level mapping) → BPE ids.
type PieceCache = FxHashMap<Box<[u8]>, Box<[u32]>>;

static NEXT_ENCODER_ID: AtomicU64 = AtomicU64::new(1);

thread_local! {
    /// Per-thread cache of piece → BPE ids, owned by one encoder at a time
    /// (the id of the encoder that filled it). Avoids the BPE model's per-call `Token`
    /// allocations for repeated words; no locking on the request path.
    static PIECE_CACHE: RefCell<(u64, PieceCache)> =
        RefCell::new((0, PieceCache::default()));
}

/// The lookahead tail this encoder knows how to replace.
const WS_TAIL: &str = r"|\s+(?!\S)|\s+";

pub(crate) struct FastEncoder {
    /// Identity for the thread-local piece cache.
    id: u64,
    /// Added tokens (all matched on raw text), leftmost-longest like `tokenizers`.
    added: Option<AhoCorasick>,
    added_ids: Vec<u32>,
    split: meta::Regex,
    /// The same pattern compiled whole, for the anchored search (the usual one): a
    /// dense DFA's search skips the lazy DFA's and the meta layer's per-call work.
    /// `None` when it would be larger than [`ANCHORED_DFA_MAX_BYTES`].
    split_anchored: Option<dense::DFA<Vec<u32>>>,
    /// The pattern without the whitespace tail, anchored: tells whether an
    /// all-whitespace match came from the head (e.g. `\s*[\r\n]+`) or from `\s+`.
    head: regex::Regex,
    nfc: bool,
    byte_chars: [char; 256],
    /// The post-processor adds nothing (none or ByteLevel), so ids are final even with
    /// `add_special_tokens`.
    post_processor_is_noop: bool,
}

/// The parts of `tokenizer.json` [`FastEncoder::new`] reads. Its vocabulary and merges
/// (nearly all of the file: 11 MB for Qwen3) are skipped while parsing, not built into
/// a `Value` the `tokenizers` crate has already parsed for itself.
#[derive(serde::Deserialize)]
struct TokenizerJsonHead {
    #[serde(default)]
    normalizer: Value,
    #[serde(default)]
    pre_tokenizer: Value,
    #[serde(default)]
    post_processor: Value,
    #[serde(default)]
    added_tokens: Value,
    model: ModelHead,
}

#[derive(serde::Deserialize, serde::Serialize)]
struct ModelHead {
    #[serde(default, rename = "type")]
    kind: Value,
    #[serde(default)]
    dropout: Value,
    #[serde(default)]
    continuing_subword_prefix: Value,
    #[serde(default)]
    end_of_word_suffix: Value,
    #[serde(default)]
    byte_fallback: Value,
}

impl FastEncoder {
    /// Build from the text of `tokenizer.json`; `None` when it does not parse or any
    /// stage differs from the shape reproduced here.
    pub(crate) fn from_tokenizer_json(text: &str) -> Option<FastEncoder> {
        let head: TokenizerJsonHead = serde_json::from_str(text).ok()?;
        FastEncoder::new(&serde_json::json!({
            "normalizer": head.normalizer,
            "pre_tokenizer": head.pre_tokenizer,
            "post_processor": head.post_processor,
            "added_tokens": head.added_tokens,
            "model": head.model,
        }))
    }

    /// Build from the parsed `tokenizer.json`; `None` when any stage differs from the
    /// shape reproduced here (the caller then uses the `tokenizers` crate).
    pub(crate) fn new(json: &Value) -> Option<FastEncoder> {
        let nfc = match json.get("normalizer") {
            None | Some(Value::Null) => false,
            Some(n) if n.get("type")? == "NFC" => true,
            _ => return None,
        };
        let pattern = split_pattern(json.get("pre_tokenizer")?)?;
        let head = pattern.strip_suffix(WS_TAIL)?;
        let unsupported = ["(?=", "(?!", "(?<", "\\b", "\\B", "\\A", "\\z", "$"];
        if unsupported.iter().any(|u| head.contains(u)) {
            return None;
        }
        let split_pattern = format!(r"{head}|\s+");
        let split = meta::Regex::new(&split_pattern).ok()?;
        let split_anchored = dense::Builder::new()
            .configure(
                dense::Config::new()
                    .start_kind(StartKind::Anchored)
                    .dfa_size_limit(Some(ANCHORED_DFA_MAX_BYTES)),
            )
            .build(&split_pattern)
            .ok();
        let head = regex::Regex::new(&format!(r"\A(?:{head})")).ok()?;
        let model = json.get("model")?;
        let unset = |k: &str| model.get(k).is_none_or(|v| v.is_null() || v == "");
        let plain_bpe = model.get("type")? == "BPE"
            && model.get("dropout").is_none_or(Value::is_null)
            && unset("continuing_subword_prefix")
            && unset("end_of_word_suffix")
            && !model
                .get("byte_fallback")
                .and_then(Value::as_bool)
                .unwrap_or(false);
        if !plain_bpe {
            return None;
        }
        let post_processor_is_noop = match json.get("post_processor") {
            None | Some(Value::Null) => true,
            Some(p) => p.get("type").and_then(Value::as_str) == Some("ByteLevel"),
        };
        let mut patterns = Vec::new();
        let mut added_ids = Vec::new();
        for t in json.get("added_tokens")?.as_array()? {
            let flag = |k: &str| t.get(k).and_then(Value::as_bool).unwrap_or(false);
            if flag("normalized") || flag("lstrip") || flag("rstrip") || flag("single_word") {
                return None;
            }
            patterns.push(t.get("content")?.as_str()?.to_owned());
            added_ids.push(u32::try_from(t.get("id")?.as_u64()?).ok()?);
        }
        let added = if patterns.is_empty() {
            None
        } else {
            Some(
                AhoCorasick::builder()
                    .match_kind(MatchKind::LeftmostLongest)
                    .build(&patterns)
                    .ok()?,
            )
        };
        Some(FastEncoder {
            id: NEXT_ENCODER_ID.fetch_add(1, Ordering::Relaxed),
            added,
            added_ids,
            split,
            split_anchored,
            head,
            nfc,
            byte_chars: bytes_to_unicode(),
            post_processor_is_noop,
        })
    }

    /// Whether this encoder gives final ids for this `add_special_tokens` value.
    pub(crate) fn supports(&self, add_special_tokens: bool) -> bool {
        self.post_processor_is_noop || !add_special_tokens
    }

    /// Encodes `text`, stopping as soon as more than `max_ids` ids are produced (the
    /// result is then longer than `max_ids` and incomplete: the caller rejects it).
    /// Segments between added tokens long enough to be worth it are looked up in
    /// `segments` first, and kept there once encoded whole (see `segments` for why
    /// that is exact).
    pub(crate) fn encode(
        &self,
        model: &impl tokenizers::Model,
        text: &str,
        max_ids: usize,
        segments: Option<&SegmentCache>,
    ) -> tokenizers::Result<Vec<u32>> {
        let mut ids = Vec::with_capacity((text.len() / 3).min(max_ids.saturating_add(1)));
        let mut scratch = Scratch {
            piece: String::new(),
            search: None,
        };
        let mut start = 0;
        if let Some(added) = &self.added {
            for m in added.find_iter(text) {
                let segment = &text[start..m.start()];
                self.encode_cached(model, segment, &mut scratch, &mut ids, max_ids, segments)?;
                ids.push(self.added_ids[m.pattern().as_usize()]);
                if ids.len() > max_ids {
                    return Ok(ids);
                }
                start = m.end();
            }
        }
        let segment = &text[start..];
        self.encode_cached(model, segment, &mut scratch, &mut ids, max_ids, segments)?;
        Ok(ids)
    }

    /// One segment between added tokens, through the segment cache when it is long
    /// enough.
    fn encode_cached(
        &self,
        model: &impl tokenizers::Model,
        segment: &str,
        scratch: &mut Scratch,
        ids: &mut Vec<u32>,
        max_ids: usize,
        segments: Option<&SegmentCache>,
    ) -> tokenizers::Result<()> {
        let Some(cache) = segments.filter(|_| segment.len() >= SEGMENT_MIN_BYTES) else {
            return self.encode_segment(model, segment, scratch, ids, max_ids);
        };
        if let Some(hit) = cache.get(segment) {
            ids.extend_from_slice(&hit);
            return Ok(());
        }
        let start = ids.len();
        self.encode_segment(model, segment, scratch, ids, max_ids)?;
        // Within the limit, the segment was encoded whole.
        if ids.len() <= max_ids {
            cache.insert(segment, &ids[start..]);
        }
        Ok(())
    }

    fn encode_segment(
        &self,
        model: &impl tokenizers::Model,
        segment: &str,
        scratch: &mut Scratch,
        ids: &mut Vec<u32>,
        max_ids: usize,
    ) -> tokenizers::Result<()> {
        if segment.is_empty() {
            return Ok(());
        }
        let normalized;
        // ASCII is NFC already (and checked far faster than `is_nfc` checks it).
        let segment = if self.nfc
            && !segment.is_ascii()
            && !unicode_normalization_alignments::is_nfc(segment)
        {
            use unicode_normalization_alignments::UnicodeNormalization as _;
            normalized = segment.chars().nfc().map(|(c, _)| c).collect::<String>();
            normalized.as_str()
        } else {
            segment
        };
        let mut pos = 0;
        while pos < segment.len() && ids.len() <= max_ids {
            let Some(m) = self.next_match(segment, pos, &mut scratch.search) else {
                // Unmatched tail (Isolated behaviour keeps it as its own piece).
                self.encode_piece(model, &segment[pos..], &mut scratch.piece, ids)?;
                break;
            };
            if m.start > pos {
                self.encode_piece(model, &segment[pos..m.start], &mut scratch.piece, ids)?;
            }
            let mut end = m.end;
            let matched = &segment[m.clone()];
            // `\s+(?!\S)`: a whitespace run matched by the tail and followed by a
            // non-space leaves its last char to the next piece (a one-char run is taken
            // whole by the plain `\s+`).
            if end < segment.len()
                && matched.chars().nth(1).is_some()
                && matched.chars().all(char::is_whitespace)
                && !self.head.is_match(&segment[m.start..])
            {
                if let Some((last_start, _)) = matched.char_indices().next_back() {
                    end = m.start + last_start;
                }
            }
            self.encode_piece(model, &segment[m.start..end], &mut scratch.piece, ids)?;
            pos = end;
        }
        Ok(())
    }

    /// The split pattern's leftmost-first match from `pos` on: the one starting at
    /// `pos` when there is one, found by an anchored search.
    fn next_match(
        &self,
        segment: &str,
        pos: usize,
        search: &mut Option<meta::Cache>,
    ) -> Option<std::ops::Range<usize>> {
        let from = Input::new(segment).range(pos..);
        let anchored = from.clone().anchored(Anchored::Yes);
        let mut meta_search = |input: &Input| {
            let cache = search.get_or_insert_with(|| self.split.create_cache());
            self.split.search_with(cache, input).map(|m| m.range())
        };
        let at_pos = match &self.split_anchored {
            Some(dfa) => dfa
                .try_search_fwd(&anchored)
                .ok()
                .flatten()
                .map(|m| pos..m.offset()),
            None => meta_search(&anchored),
        };
        at_pos.or_else(|| meta_search(&from))
    }

    fn encode_piece(
        &self,
        model: &impl tokenizers::Model,
        text: &str,
        piece: &mut String,
        ids: &mut Vec<u32>,
    ) -> tokenizers::Result<()> {
        let byte_level = |piece: &mut String| {
            piece.clear();
            piece.extend(text.bytes().map(|b| self.byte_chars[b as usize]));
        };
        if text.len() > PIECE_CACHE_MAX_LEN {
            byte_level(piece);
            ids.extend(model.tokenize(piece)?.into_iter().map(|t| t.id));
            return Ok(());
        }
        PIECE_CACHE.with(|cell| {
            let mut cache = cell.borrow_mut();
            if cache.0 != self.id || cache.1.len() >= PIECE_CACHE_MAX {
                cache.0 = self.id;
                cache.1.clear();
            }
            if let Some(hit) = cache.1.get(text.as_bytes()) {
                ids.extend_from_slice(hit);
                return Ok(());
            }
            byte_level(piece);
            let encoded: Box<[u32]> = model.tokenize(piece)?.into_iter().map(|t| t.id).collect();
            ids.extend_from_slice(&encoded);
            cache.1.insert(text.as_bytes().into(), encoded);
            Ok(())
        })
    }
}

/// What one [`FastEncoder::encode`] call reuses from piece to piece.
struct Scratch {
    /// The piece being encoded, byte-level mapped.
    piece: String,
    /// The lazy DFA's search state, made when first needed and kept for the whole
    /// text (the regex's own pool of them is a mutex away on all threads but one).
    search: Option<meta::Cache>,
}

/// The single `Split` regex of a `Sequence[Split(Isolated), ByteLevel(no regex)]`
/// pre-tokenizer.
fn split_pattern(pre: &Value) -> Option<String> {
    if pre.get("type")? != "Sequence" {
        return None;
    }
    let steps = pre.get("pretokenizers")?.as_array()?;
    let [split, byte_level] = steps.as_slice() else {
        return None;
    };
    let split_ok = split.get("type")? == "Split"
        && split.get("behavior")? == "Isolated"
        && !split
            .get("invert")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    let byte_level_ok = byte_level.get("type")? == "ByteLevel"
        && !byte_level
            .get("add_prefix_space")
            .and_then(Value::as_bool)
            .unwrap_or(true)
        && !byte_level
            .get("use_regex")
            .and_then(Value::as_bool)
            .unwrap_or(true);
    if !(split_ok && byte_level_ok) {
        return None;
    }
    split
        .get("pattern")?
        .get("Regex")?
        .as_str()
        .map(str::to_owned)
}

/// GPT-2's byte-to-unicode table used by the ByteLevel pre-tokenizer.
fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen3's `tokenizer.json` without its vocabulary and merges.
    fn qwen3_head() -> Value {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/qwen3-tokenizer/tokenizer.json");
        let mut json: Value =
            serde_json::from_str(&std::fs::read_to_string(dir).expect("fixture")).expect("json");
        let model = json["model"].as_object_mut().expect("model");
        model.insert("vocab".into(), serde_json::json!({"a": 0}));
        model.insert("merges".into(), serde_json::json!([]));
        json
    }

    #[test]
    fn the_text_is_accepted_as_its_parsed_value_is() {
        let qwen3 = qwen3_head();
        let change = |name: &str, j: &mut Value| match name {
            "byte fallback" => j["model"]["byte_fallback"] = true.into(),
            "another model" => j["model"]["type"] = "WordPiece".into(),
            "a suffix" => j["model"]["end_of_word_suffix"] = "</w>".into(),
            "another normalizer" => j["normalizer"] = serde_json::json!({"type": "Lowercase"}),
            "no pre-tokenizer" => j["pre_tokenizer"] = Value::Null,
            "no model" => {
                j.as_object_mut().map(|o| o.remove("model"));
            }
            _ => {}
        };
        for name in [
            "as is",
            "byte fallback",
            "another model",
            "a suffix",
            "another normalizer",
            "no pre-tokenizer",
            "no model",
        ] {
            let mut json = qwen3.clone();
            change(name, &mut json);
            let text = serde_json::to_string(&json).expect("text");
            let from_text = FastEncoder::from_tokenizer_json(&text).is_some();
            assert_eq!(from_text, FastEncoder::new(&json).is_some(), "{name}");
            assert_eq!(from_text, name == "as is", "{name}");
        }
    }
}
