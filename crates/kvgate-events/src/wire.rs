//! The KV-event wire schema: one ZeroMQ payload (MessagePack) → [`EventBatch`].
//!
//! Owns the mapping from vLLM's and SGLang's encodings to plain Rust values, and
//! nothing else: it must not touch the index, sockets or metrics. Accepted shapes:
//!
//! * batch: `[ts, events]`, `[ts, events, dp_rank]` (extra trailing items ignored), or a
//!   map `{"ts", "events", "data_parallel_rank" | "attn_dp_rank"}`;
//! * event: a map tagged by `"type"` (vLLM ≥ mid-2026; keys in any order, unknown keys
//!   ignored) or an array whose first item is the tag (older vLLM, SGLang; msgspec
//!   `array_like`), fields in declaration order, trailing fields optional;
//! * block hashes: unsigned (any u64), signed (cast `as u64`), or bytes/str (xxh3-64 of
//!   the bytes, the same mapping for `BlockStored` and `BlockRemoved`).
//!
//! Unknown event types are skipped and counted in [`EventBatch::unknown_events`].
//! Optional fields of an unexpected type are treated as absent; required fields of the
//! wrong type make the whole payload an error. Never panics on any input.

use xxhash_rust::xxh3::xxh3_64;

use crate::msgpack::{Int, Kind, ReadError, ReadErrorKind, ReadResult, Reader};

/// One decoded payload.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EventBatch {
    /// Engine wall-clock timestamp (seconds).
    pub ts: f64,
    /// Known events, in order.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank that published the batch, when the engine says.
    pub dp_rank: Option<u32>,
    /// Events of a type this decoder does not know (skipped).
    pub unknown_events: u32,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    BlockStored(BlockStored),
    BlockRemoved(BlockRemoved),
    AllBlocksCleared,
}

/// `BlockStored`: a run of consecutive blocks now cached.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockStored {
    pub block_hashes: Vec<u64>,
    pub parent_block_hash: Option<u64>,
    /// All tokens of the blocks, concatenated.
    pub token_ids: Vec<u32>,
    pub block_size: u32,
    pub lora_id: Option<i64>,
    pub medium: Option<String>,
    pub lora_name: Option<String>,
    /// Per-block extra hash keys (multimodal ids, LoRA name, cache salt, ...). Empty
    /// when the event carried none or only nulls; otherwise one entry per block.
    pub extra_keys: Vec<Option<Vec<ExtraKeyItem>>>,
    pub group_idx: Option<u32>,
    pub kv_cache_spec_kind: Option<String>,
    /// SGLang's `BlockStoredWithMetadata.metadata.cache_salt`.
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`: blocks evicted from a medium.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockRemoved {
    pub block_hashes: Vec<u64>,
    pub medium: Option<String>,
    pub group_idx: Option<u32>,
}

/// One item of a block's extra keys, reduced to what routing needs to know.
#[derive(Clone, Debug, PartialEq)]
pub enum ExtraKeyItem {
    Str(String),
    Int(i64),
    /// Bytes, floats, nested values: opaque to the router.
    Other,
}

impl BlockStored {
    /// Whether any block carries an extra key other than this event's LoRA name
    /// (multimodal content, a cache salt, prompt embeddings): such blocks' token ids
    /// alone do not identify their content, so text-token routing must not index them.
    pub fn has_foreign_extra_keys(&self) -> bool {
        let lora = self.lora_name.as_deref();
        self.extra_keys.iter().flatten().any(|items| {
            items
                .iter()
                .any(|item| !matches!(item, ExtraKeyItem::Str(s) if Some(s.as_str()) == lora))
        })
    }
}

/// Why a payload was rejected.
pub type DecodeError = ReadError;

/// Maps an engine block hash given as bytes (or a string) to the u64 the index uses.
pub fn hash_bytes(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Decodes one payload.
pub fn decode_batch(payload: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut r = Reader::new(payload);
    let batch = match r.peek_kind()? {
        Kind::Array => decode_array_batch(&mut r)?,
        Kind::Map => decode_map_batch(&mut r)?,
        other => {
            return Err(r.error(ReadErrorKind::UnexpectedType {
                expected: "event batch (array or map)",
                found: other.name(),
            }))
        }
    };
    Ok(batch)
}

fn decode_array_batch(r: &mut Reader<'_>) -> ReadResult<EventBatch> {
    let len = r.array_len()?;
    if len < 2 {
        return Err(r.error(ReadErrorKind::Schema("event batch needs [ts, events]")));
    }
    let mut batch = EventBatch {
        ts: r.f64()?,
        ..EventBatch::default()
    };
    decode_events(r, &mut batch)?;
    if len >= 3 {
        batch.dp_rank = opt_u32(r)?;
    }
    for _ in 3..len {
        r.skip()?;
    }
    Ok(batch)
}

fn decode_map_batch(r: &mut Reader<'_>) -> ReadResult<EventBatch> {
    let len = r.map_len()?;
    let mut batch = EventBatch::default();
    let (mut seen_ts, mut seen_events) = (false, false);
    for _ in 0..len {
        match key(r)? {
            Some(b"ts") => {
                batch.ts = r.f64()?;
                seen_ts = true;
            }
            Some(b"events") => {
                decode_events(r, &mut batch)?;
                seen_events = true;
            }
            Some(b"data_parallel_rank" | b"attn_dp_rank" | b"dp_rank") => {
                batch.dp_rank = opt_u32(r)?
            }
            _ => r.skip()?,
        }
    }
    if !(seen_ts && seen_events) {
        return Err(r.error(ReadErrorKind::Schema("event batch map without ts/events")));
    }
    Ok(batch)
}

/// Reads a map key; non-string keys yield `None` (and must be skipped by the caller's
/// value skip: the key itself is consumed here).
fn key<'a>(r: &mut Reader<'a>) -> ReadResult<Option<&'a [u8]>> {
    match r.peek_kind()? {
        Kind::Str | Kind::Bin => Ok(Some(r.str_or_bin()?)),
        _ => {
            r.skip()?;
            Ok(None)
        }
    }
}

fn decode_events(r: &mut Reader<'_>, batch: &mut EventBatch) -> ReadResult<()> {
    let n = r.array_len()?;
    batch.events.reserve(r.capacity_hint(n));
    for _ in 0..n {
        match decode_event(r)? {
            Some(e) => batch.events.push(e),
            None => batch.unknown_events += 1,
        }
    }
    Ok(())
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
    Unknown,
}

fn tag_of(name: &[u8]) -> Tag {
    match name {
        b"BlockStored" => Tag::Stored,
        b"BlockRemoved" => Tag::Removed,
        b"AllBlocksCleared" => Tag::Cleared,
        _ => Tag::Unknown,
    }
}

/// Decodes one event; `None` for an unknown type (already skipped).
fn decode_event(r: &mut Reader<'_>) -> ReadResult<Option<KvEvent>> {
    match r.peek_kind()? {
        Kind::Array => decode_array_event(r),
        Kind::Map => decode_map_event(r),
        other => Err(r.error(ReadErrorKind::UnexpectedType {
            expected: "event (array or map)",
            found: other.name(),
        })),
    }
}

fn decode_array_event(r: &mut Reader<'_>) -> ReadResult<Option<KvEvent>> {
    let len = r.array_len()?;
    if len == 0 {
        return Err(r.error(ReadErrorKind::Schema("empty event array")));
    }
    let tag = tag_of(r.str_or_bin()?);
    let fields = len - 1;
    let event = match tag {
        Tag::Stored => {
            // block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
            // lora_name (SGLang: metadata), extra_keys, group_idx, kv_cache_spec_kind, ...
            if fields < 4 {
                return Err(r.error(ReadErrorKind::Schema("BlockStored needs 4 fields")));
            }
            let mut e = BlockStored {
                block_hashes: hashes(r)?,
                parent_block_hash: opt_hash(r)?,
                token_ids: tokens(r)?,
                block_size: r.u32()?,
                ..BlockStored::default()
            };
            for i in 4..fields {
                match i {
                    4 => e.lora_id = lenient_i64(r)?,
                    5 => e.medium = lenient_string(r)?,
                    6 => match r.peek_kind()? {
                        Kind::Array | Kind::Map => e.cache_salt = metadata_salt(r)?,
                        _ => e.lora_name = lenient_string(r)?,
                    },
                    7 => e.extra_keys = extra_keys(r)?,
                    8 => e.group_idx = lenient_u32(r)?,
                    9 => e.kv_cache_spec_kind = lenient_string(r)?,
                    _ => r.skip()?,
                }
            }
            KvEvent::BlockStored(e)
        }
        Tag::Removed => {
            if fields < 1 {
                return Err(r.error(ReadErrorKind::Schema("BlockRemoved needs block_hashes")));
            }
            let mut e = BlockRemoved {
                block_hashes: hashes(r)?,
                ..BlockRemoved::default()
            };
            for i in 1..fields {
                match i {
                    1 => e.medium = lenient_string(r)?,
                    2 => e.group_idx = lenient_u32(r)?,
                    _ => r.skip()?,
                }
            }
            KvEvent::BlockRemoved(e)
        }
        Tag::Cleared | Tag::Unknown => {
            for _ in 0..fields {
                r.skip()?;
            }
            if tag == Tag::Unknown {
                return Ok(None);
            }
            KvEvent::AllBlocksCleared
        }
    };
    Ok(Some(event))
}

fn decode_map_event(r: &mut Reader<'_>) -> ReadResult<Option<KvEvent>> {
    let len = r.map_len()?;
    let mut tag = None;
    let mut s = BlockStored::default();
    let (mut has_hashes, mut has_tokens, mut has_size) = (false, false, false);
    for _ in 0..len {
        match key(r)? {
            Some(b"type") => tag = Some(tag_of(r.str_or_bin()?)),
            Some(b"block_hashes") => {
                s.block_hashes = hashes(r)?;
                has_hashes = true;
            }
            Some(b"parent_block_hash") => s.parent_block_hash = opt_hash(r)?,
            Some(b"token_ids") => {
                s.token_ids = tokens(r)?;
                has_tokens = true;
            }
            Some(b"block_size") => {
                s.block_size = r.u32()?;
                has_size = true;
            }
            Some(b"lora_id") => s.lora_id = lenient_i64(r)?,
            Some(b"medium") => s.medium = lenient_string(r)?,
            Some(b"lora_name") => s.lora_name = lenient_string(r)?,
            Some(b"extra_keys") => s.extra_keys = extra_keys(r)?,
            Some(b"group_idx") => s.group_idx = lenient_u32(r)?,
            Some(b"kv_cache_spec_kind") => s.kv_cache_spec_kind = lenient_string(r)?,
            Some(b"metadata") => s.cache_salt = metadata_salt(r)?,
            _ => r.skip()?,
        }
    }
    let schema = |what| Err(r.error(ReadErrorKind::Schema(what)));
    Ok(Some(match tag {
        None => return schema("event map without \"type\""),
        Some(Tag::Unknown) => return Ok(None),
        Some(Tag::Cleared) => KvEvent::AllBlocksCleared,
        Some(Tag::Removed) => {
            if !has_hashes {
                return schema("BlockRemoved without block_hashes");
            }
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: s.block_hashes,
                medium: s.medium,
                group_idx: s.group_idx,
            })
        }
        Some(Tag::Stored) => {
            if !(has_hashes && has_tokens && has_size) {
                return schema("BlockStored without block_hashes/token_ids/block_size");
            }
            KvEvent::BlockStored(s)
        }
    }))
}

/// One engine block hash.
#[inline]
fn hash(r: &mut Reader<'_>) -> ReadResult<u64> {
    if let Some(v) = r.try_u64() {
        return Ok(v);
    }
    match r.peek_kind()? {
        Kind::UInt | Kind::NegInt => Ok(match r.int()? {
            Int::U(v) => v,
            Int::I(v) => v as u64,
        }),
        Kind::Str | Kind::Bin => Ok(hash_bytes(r.str_or_bin()?)),
        other => Err(r.error(ReadErrorKind::UnexpectedType {
            expected: "block hash (integer or bytes)",
            found: other.name(),
        })),
    }
}

fn opt_hash(r: &mut Reader<'_>) -> ReadResult<Option<u64>> {
    if r.try_nil() {
        Ok(None)
    } else {
        hash(r).map(Some)
    }
}

fn hashes(r: &mut Reader<'_>) -> ReadResult<Vec<u64>> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(r.capacity_hint(n));
    for _ in 0..n {
        out.push(hash(r)?);
    }
    Ok(out)
}

fn tokens(r: &mut Reader<'_>) -> ReadResult<Vec<u32>> {
    let n = r.array_len()?;
    let mut out = Vec::with_capacity(r.capacity_hint(n));
    for _ in 0..n {
        out.push(r.u32()?);
    }
    Ok(out)
}

fn opt_u32(r: &mut Reader<'_>) -> ReadResult<Option<u32>> {
    if r.try_nil() {
        Ok(None)
    } else {
        r.u32().map(Some)
    }
}

fn lenient_u32(r: &mut Reader<'_>) -> ReadResult<Option<u32>> {
    Ok(match lenient_i64(r)? {
        Some(v) => u32::try_from(v).ok(),
        None => None,
    })
}

fn lenient_i64(r: &mut Reader<'_>) -> ReadResult<Option<i64>> {
    match r.peek_kind()? {
        Kind::UInt | Kind::NegInt => Ok(match r.int()? {
            Int::U(v) => i64::try_from(v).ok(),
            Int::I(v) => Some(v),
        }),
        _ => {
            r.skip()?;
            Ok(None)
        }
    }
}

fn lenient_string(r: &mut Reader<'_>) -> ReadResult<Option<String>> {
    match r.peek_kind()? {
        Kind::Str => Ok(Some(r.str()?.to_owned())),
        _ => {
            r.skip()?;
            Ok(None)
        }
    }
}

/// SGLang's metadata struct: `[cache_salt]` (array_like) or `{"cache_salt": ..}`.
fn metadata_salt(r: &mut Reader<'_>) -> ReadResult<Option<String>> {
    let mut salt = None;
    match r.peek_kind()? {
        Kind::Array => {
            let n = r.array_len()?;
            for i in 0..n {
                if i == 0 {
                    salt = lenient_string(r)?;
                } else {
                    r.skip()?;
                }
            }
        }
        Kind::Map => {
            let n = r.map_len()?;
            for _ in 0..n {
                match key(r)? {
                    Some(b"cache_salt") => salt = lenient_string(r)?,
                    _ => r.skip()?,
                }
            }
        }
        _ => r.skip()?,
    }
    Ok(salt.filter(|s| !s.is_empty()))
}

/// `extra_keys`: nil, or one entry per block, each nil or a tuple of items.
fn extra_keys(r: &mut Reader<'_>) -> ReadResult<Vec<Option<Vec<ExtraKeyItem>>>> {
    if r.peek_kind()? != Kind::Array {
        r.skip()?;
        return Ok(Vec::new());
    }
    let n = r.array_len()?;
    let mut out: Vec<Option<Vec<ExtraKeyItem>>> = Vec::new();
    for i in 0..n {
        if r.try_nil() {
            continue;
        }
        let items = extra_key_items(r)?;
        if items.is_empty() {
            continue;
        }
        // Entries before `i` were nil; `out.len() <= i` holds here.
        out.resize(i, None);
        out.push(Some(items));
    }
    if !out.is_empty() {
        // All `n` entries were read, so `n` is bounded by the payload size.
        out.resize(n, None);
    }
    Ok(out)
}

fn extra_key_items(r: &mut Reader<'_>) -> ReadResult<Vec<ExtraKeyItem>> {
    let item = |r: &mut Reader<'_>| -> ReadResult<ExtraKeyItem> {
        Ok(match r.peek_kind()? {
            Kind::Str => ExtraKeyItem::Str(r.str()?.to_owned()),
            Kind::UInt | Kind::NegInt => match r.int()? {
                Int::I(v) => ExtraKeyItem::Int(v),
                Int::U(v) => i64::try_from(v).map_or(ExtraKeyItem::Other, ExtraKeyItem::Int),
            },
            _ => {
                r.skip()?;
                ExtraKeyItem::Other
            }
        })
    };
    if r.peek_kind()? == Kind::Array {
        let n = r.array_len()?;
        let mut out = Vec::with_capacity(r.capacity_hint(n));
        for _ in 0..n {
            out.push(item(r)?);
        }
        Ok(out)
    } else {
        Ok(vec![item(r)?])
    }
}
