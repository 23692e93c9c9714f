//! Index bootstrap: what a subscriber asks a peer router for before it replays an
//! engine's buffer, so a router that starts after the engines routes to what they
//! cached long ago (beyond the replay buffer) from its first request.
//!
//! Owns the types only: a worker rank's snapshot (the blocks a peer's index holds for
//! it and the last event sequence number they reflect) and the asynchronous callback
//! that fetches one. How a snapshot travels is the caller's (the gateway asks its peer
//! replicas over HTTP); what the subscriber does with it is in `subscriber.rs`.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kvgate_core::{BlockKey, HeldBlock};

/// A peer's view of one worker rank: its blocks, as of event `last_seq`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankSnapshot {
    pub blocks: Vec<HeldBlock>,
    /// For blocks after a hole (the engine removed a parent first), the keys from the
    /// root to the missing parent ([`kvgate_core::PrefixIndex::hole_paths`]); usually
    /// empty.
    pub hole_paths: Vec<Vec<BlockKey>>,
    pub last_seq: u64,
}

/// The future a [`Bootstrap`] returns: a snapshot, or `None` when no peer had one.
pub type BootstrapFuture = Pin<Box<dyn Future<Output = Option<RankSnapshot>> + Send>>;

/// Fetches a peer's snapshot of a worker rank, given the worker's name (its URL, the
/// identity routers share) and the rank.
pub type Bootstrap = Arc<dyn Fn(String, u32) -> BootstrapFuture + Send + Sync>;
