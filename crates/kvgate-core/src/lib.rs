//! # kvgate-core: the pure heart of kvgate
//!
//! Owns the routing logic and nothing else: how prompts become block keys
//! ([`hashing`]), which worker holds which blocks ([`index`]), how much work each
//! worker has that this router booked ([`ledger`]) and that its peer replicas
//! reported ([`peer_loads`]), in the figures both share ([`load`]), how long a request
//! would take on each ([`timing`]), how a worker is chosen ([`policy`]), and whether
//! a choice meets the request's latency objective ([`objective`]). It must not do I/O, spawn threads, read clocks behind the caller's
//! back in ways tests cannot control, or depend on an async runtime: every input
//! arrives as an argument so the crate can be tested and benchmarked exactly.
//!
//! The gateway wraps these types in locks and feeds them; event ingestion translates
//! engine events into [`index::PrefixIndex`] calls.

pub mod hashing;
pub mod ids;
pub mod index;
pub mod ledger;
pub mod load;
pub mod objective;
pub mod peer_loads;
pub mod policy;
pub mod timing;

pub use hashing::{cpu_can_hash_blocks, BlockHasher, BlockKey, CPU_CANNOT_HASH_BLOCKS};
pub use ids::{Tier, WorkerId, WorkerRef};
pub use index::{
    GrownEngineMap, HeldBlock, IndexConfig, IndexStats, Overlap, OverlapScores, PrefixIndex,
    RemoveOutcome, SnapshotImport, StoreError, StoreOutcome, StoredBlocks, WRITE_SLICE_BLOCKS,
};

pub use ledger::{
    BookingGuard, BookingSpec, EngineQueue, Ledger, LedgerStats, WorkerAccuracy, PROGRESS_EVERY,
};
pub use load::WorkerLoad;
pub use objective::{judge, Judgement, Objective};
pub use peer_loads::{PeerApplied, PeerReport, PeerStats};
pub use policy::{
    build_policy, removed_option as removed_kv_aware_option, Decision, FleetView, KvAwareConfig,
    KvAwareRule, PolicyConfig, PolicyKind, PrefixAffinityConfig, RouteRequest, RoutingPolicy,
    SelectError, SessionConfig, WorkerScore,
};
pub use timing::{EngineLimits, Prediction, Rates, WorkerTiming};
