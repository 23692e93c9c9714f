//! What travels between replicas: report lines, index snapshots, decide requests and
//! answers, and the paths and header they use. Owns the wire formats and the one rule
//! for exchanging keys ([`same_keys`]). Must not do I/O.

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

/// What a replica asks the leader to choose.
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
    /// The prompt's block keys; absent when the request has no routing tokens.
    #[serde(default)]
    pub keys: Option<Vec<u64>>,
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
