//! What travels between replicas: report lines, index snapshots, decide requests and
//! answers, and the paths and header they use. Owns the wire formats and the one rule
//! for exchanging keys ([`same_keys`]). Must not do I/O.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::{HeaderName, StatusCode};
use kvgate_core::{BlockKey, HeldBlock, Tier};
use kvgate_events::RankSnapshot;
use serde::{Deserialize, Serialize};

use crate::errors::ApiError;

/// Path of the report stream.
pub const LOADS_PATH: &str = "/peer/v1/loads";
/// Path of the index snapshot of one worker rank (`POST` with [`SnapshotRequest`]).
pub const INDEX_PATH: &str = "/peer/v1/index";
/// Path of a choice made at the leader (`POST` with [`DecideRequest`]).
pub const DECIDE_PATH: &str = "/peer/v1/decide";
/// Largest decide request read (the block keys of a prompt of about 1.5M tokens at
/// block size 16).
pub const MAX_DECIDE_BYTES: usize = 2 << 20;
/// Header with which a follower names itself, so a replica can refuse to follow
/// itself (a DNS name lists every replica, this one included).
pub const REPLICA_HEADER: HeaderName = HeaderName::from_static("x-kvgate-replica");
/// Header with the asker's incarnation (its start time): a peer answering to the same
/// name tells itself (same run) from another replica given the same `--replica-id`.
pub const INCARNATION_HEADER: HeaderName = HeaderName::from_static("x-kvgate-incarnation");
/// The `error.code` with which a replica refuses a peer that has its name but is not
/// itself.
pub const DUPLICATE_REPLICA_ID: &str = "duplicate_replica_id";

/// A report as it travels: one JSON object per line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireReport {
    pub replica: String,
    pub incarnation: u64,
    pub seq: u64,
    pub models: Vec<WireModel>,
    /// Ids of choices a leader made for this replica that it has booked (or given up)
    /// recently: the leader stops counting them as its own hold on them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settled: Vec<u64>,
    /// Every choice id below this one is settled (absent from older replicas): the
    /// leader ends those holds even when their ids have aged out of `settled`.
    #[serde(default)]
    pub settled_below: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireModel {
    pub model: String,
    /// The model's pool: absent for its own workers, `prefill` for a disaggregated
    /// model's prefill pool.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
    pub workers: Vec<WireLoad>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireLoad {
    /// The worker's URL, as configured (normalized).
    pub url: String,
    pub in_flight: u32,
    pub prefill_tokens: u64,
    pub decode_blocks: f64,
    /// Prompts in prefill on this worker: per booking, its prompt's checkpoint keys
    /// (for kv_aware's prefill credit at the peers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefilling: Vec<Vec<u64>>,
}

/// What a replica asks a peer for: its index entries of one worker rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    pub model: String,
    /// The worker's URL, as configured.
    pub worker: String,
    #[serde(default)]
    pub rank: u32,
    /// The asker's [`BlockHasher::fingerprint`](kvgate_core::BlockHasher::fingerprint)
    /// (absent from replicas before key scheme v2): a snapshot is keyed by the
    /// serving replica's hasher, useless to one that keys prompts otherwise.
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

/// Whether a peer keys prompts as this replica does (`theirs`: the fingerprint it sent;
/// none from a replica older than key scheme v2). Keys of another scheme, block size
/// or salt match nothing here, and a snapshot or decision made with them would look
/// valid while routing blind, so they are refused with a reason.
pub fn same_keys(ours: u64, theirs: Option<u64>) -> Result<(), String> {
    match theirs {
        Some(t) if t == ours => Ok(()),
        Some(t) => Err(format!(
            "block keys differ (fingerprint {t:016x} there, {ours:016x} here): another kvgate \
             version, block size or hash salt"
        )),
        None => Err("block keys of an older kvgate (no key fingerprint)".to_owned()),
    }
}

/// A worker rank's index entries as they travel: `[key, parent or null, engine hash,
/// tier (0 device, 1 host, 2 disk)]` per block held, and the last event sequence
/// number they reflect.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSnapshot {
    pub last_seq: u64,
    pub blocks: Vec<(u64, Option<u64>, u64, u8)>,
    /// Root-to-parent key paths of blocks after a hole (absent from older replicas).
    #[serde(default)]
    pub hole_paths: Vec<Vec<u64>>,
    /// The serving replica's key fingerprint (see [`SnapshotRequest`]).
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

impl WireSnapshot {
    pub(crate) fn from_rank(s: &RankSnapshot, key_fingerprint: u64) -> Self {
        Self {
            last_seq: s.last_seq,
            blocks: s
                .blocks
                .iter()
                .map(|b| {
                    (
                        b.key.0,
                        b.parent.map(|p| p.0),
                        b.engine_hash,
                        b.tier.index() as u8,
                    )
                })
                .collect(),
            hole_paths: s
                .hole_paths
                .iter()
                .map(|p| p.iter().map(|k| k.0).collect())
                .collect(),
            key_fingerprint: Some(key_fingerprint),
        }
    }

    /// The snapshot, or `None` when a block names a tier that does not exist.
    pub(crate) fn into_rank(self) -> Option<RankSnapshot> {
        let blocks = self
            .blocks
            .into_iter()
            .map(|(key, parent, engine_hash, tier)| {
                Some(HeldBlock {
                    key: BlockKey(key),
                    parent: parent.map(BlockKey),
                    engine_hash,
                    tier: *Tier::ALL.get(usize::from(tier))?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(RankSnapshot {
            blocks,
            hole_paths: self
                .hole_paths
                .into_iter()
                .map(|p| p.into_iter().map(BlockKey).collect())
                .collect(),
            last_seq: self.last_seq,
        })
    }
}

/// The 409 a replica answers a peer whose keys are not its own ([`same_keys`]).
pub(crate) fn keys_refused(why: String) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "invalid_request_error",
        "key_scheme_mismatch",
        why,
    )
}

/// The content type of a decide request ([`encode_decide`]).
pub const DECIDE_CONTENT_TYPE: &str = "application/vnd.kvgate.decide";

/// What a replica asks the leader to choose (the prompt's block keys travel beside it:
/// [`encode_decide`]).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecideRequest {
    pub model: String,
    /// The model's pool: absent for its own workers, `prefill` for its prefill pool.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
    /// The asker's run (its reports' incarnation).
    pub incarnation: u64,
    /// The choice's id, named again in the asker's reports once it is booked there.
    pub id: u64,
    /// The workers the asker may send to (healthy there, with a free slot), by URL.
    pub candidates: Vec<String>,
    pub prompt_tokens: u32,
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    #[serde(default)]
    pub session_key: Option<String>,
    /// A decode leg whose prompt's KV arrives from its prefill worker: booked as
    /// cached.
    #[serde(default)]
    pub kv_transferred: bool,
    /// The asker's key fingerprint (see [`SnapshotRequest`]); the leader refuses
    /// `keys` made by another hasher (409 `key_scheme_mismatch`).
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

/// A decide request as it travels: its head as JSON, then the prompt's block keys as
/// fixed-width integers (a 32k-token prompt's 2,048 keys are 16 KiB, not 40 KiB of
/// decimal text to print and parse):
/// `[head length: u32 LE][head: JSON][1 when keys follow, else 0][keys: u64 LE each]`.
/// `keys` is `None` when the request has no routing tokens.
pub fn encode_decide(head: &DecideRequest, keys: Option<&[BlockKey]>) -> Bytes {
    let json = serde_json::to_vec(head).unwrap_or_default();
    let n = keys.map_or(0, <[BlockKey]>::len);
    let mut out = BytesMut::with_capacity(4 + json.len() + 1 + 8 * n);
    out.put_u32_le(json.len() as u32);
    out.put_slice(&json);
    out.put_u8(u8::from(keys.is_some()));
    for k in keys.unwrap_or_default() {
        out.put_u64_le(k.0);
    }
    out.freeze()
}

/// Reads [`encode_decide`]'s bytes back, or says what is wrong with them.
pub fn decode_decide(mut body: &[u8]) -> Result<(DecideRequest, Option<Vec<BlockKey>>), String> {
    if body.remaining() < 4 {
        return Err("a decide request starts with its head's length".into());
    }
    let head_len = body.get_u32_le() as usize;
    if body.remaining() < head_len + 1 {
        return Err(format!(
            "a decide request's head of {head_len} bytes is cut short"
        ));
    }
    let head: DecideRequest =
        serde_json::from_slice(&body[..head_len]).map_err(|e| format!("its head: {e}"))?;
    body.advance(head_len);
    let has_keys = body.get_u8();
    if !body.remaining().is_multiple_of(8) || (has_keys == 0 && body.has_remaining()) {
        return Err(format!("{} bytes of block keys", body.remaining()));
    }
    let keys = (has_keys != 0).then(|| {
        let mut keys = Vec::with_capacity(body.remaining() / 8);
        while body.has_remaining() {
            keys.push(BlockKey(body.get_u64_le()));
        }
        keys
    });
    Ok((head, keys))
}

/// The leader's choice: the worker and what the asker's booking of it should predict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecideAnswer {
    pub worker: String,
    pub predicted_cached_tokens: u32,
    pub indexed_cached_tokens: u32,
    pub credited_tokens: u32,
    /// The leader's key fingerprint (absent from a leader older than key scheme v2,
    /// which would have read the keys as its own).
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decide_head() -> DecideRequest {
        DecideRequest {
            model: "m".into(),
            pool: String::new(),
            incarnation: 3,
            id: 9,
            candidates: vec!["http://w1".into(), "http://w2".into()],
            prompt_tokens: 40,
            expected_output_tokens: Some(8),
            session_key: None,
            kv_transferred: false,
            key_fingerprint: Some(5),
        }
    }

    /// A decide request travels whole, with its keys, without them, or with none; a
    /// cut or padded one is refused, not misread.
    #[test]
    fn a_decide_request_travels_whole_and_a_damaged_one_is_refused() {
        let head = decide_head();
        let keys = [BlockKey(1), BlockKey(u64::MAX), BlockKey(0)];
        for k in [Some(&keys[..]), Some(&[][..]), None] {
            let body = encode_decide(&head, k);
            let (back, back_keys) = decode_decide(&body).unwrap();
            assert_eq!(back, head);
            assert_eq!(back_keys.as_deref(), k);
        }
        let body = encode_decide(&head, Some(&keys));
        assert_eq!(body.len(), 4 + (body.len() - 4 - 1 - 24) + 1 + 24);
        for cut in [0, 3, 10, body.len() - 1] {
            assert!(decode_decide(&body[..cut]).is_err(), "cut at {cut}");
        }
        let mut padded = body.to_vec();
        padded.push(0);
        assert!(decode_decide(&padded).is_err());
        let no_keys = encode_decide(&head, None);
        let mut extra = no_keys.to_vec();
        extra.extend([0u8; 8]);
        assert!(decode_decide(&extra).is_err());
        // JSON, as a kvgate before the binary encoding sent it.
        assert!(decode_decide(br#"{"model":"m"}"#).is_err());
    }

    /// A worker rank's snapshot travels whole; an older replica's snapshot (no hole
    /// paths, and an `evicting` flag this version no longer reads) loads.
    #[test]
    fn a_snapshot_travels_whole_and_an_older_one_loads() {
        let rank = RankSnapshot {
            blocks: vec![HeldBlock {
                key: BlockKey(7),
                parent: None,
                engine_hash: 70,
                tier: Tier::Device,
            }],
            hole_paths: vec![vec![BlockKey(1), BlockKey(2)]],
            last_seq: 9,
        };
        let json = serde_json::to_string(&WireSnapshot::from_rank(&rank, 5)).unwrap();
        let back: WireSnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back.into_rank(), Some(rank));
        let older: WireSnapshot = serde_json::from_str(
            r#"{"last_seq": 3, "blocks": [[7, null, 70, 0]], "evicting": true}"#,
        )
        .unwrap();
        let older = older.into_rank().unwrap();
        assert_eq!(older.blocks.len(), 1);
    }

    /// Keys are exchanged only between replicas that key prompts alike: a snapshot or
    /// decision request from an older kvgate (no fingerprint) or another hasher is
    /// refused, and so is such an answer.
    #[test]
    fn keys_travel_only_between_replicas_that_key_alike() {
        let ours = kvgate_core::BlockHasher::new(16).unwrap().fingerprint();
        let salted = kvgate_core::BlockHasher::with_salt(16, b"tenant")
            .unwrap()
            .fingerprint();
        assert_eq!(same_keys(ours, Some(ours)), Ok(()));
        assert!(same_keys(ours, Some(salted)).is_err());
        assert!(same_keys(ours, None).is_err());
        // What an older replica sends parses, without a fingerprint.
        let older: SnapshotRequest =
            serde_json::from_str(r#"{"model": "m", "worker": "http://w"}"#).unwrap();
        assert_eq!(older.key_fingerprint, None);
        let older: DecideAnswer = serde_json::from_str(
            r#"{"worker": "http://w", "predicted_cached_tokens": 1, "indexed_cached_tokens": 1, "credited_tokens": 0}"#,
        )
        .unwrap();
        assert_eq!(older.key_fingerprint, None);
        let older: WireSnapshot = serde_json::from_str(r#"{"last_seq": 3, "blocks": []}"#).unwrap();
        assert_eq!(older.key_fingerprint, None);
    }
}
