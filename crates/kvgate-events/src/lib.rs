//! # kvgate-events: engine KV events → the prefix index
//!
//! Owns everything between an engine's ZeroMQ KV-event publisher and
//! [`kvgate_core::PrefixIndex`]: decoding vLLM/SGLang payloads ([`wire`], on top of a
//! bounds-checked MessagePack reader in [`msgpack`]), translating events into index
//! calls ([`apply`]), loading a peer router's snapshot of a worker ([`bootstrap`]), subscribing with sequence tracking, replay and reconnects
//! ([`subscriber`], [`replay`], [`link`]; [`EventFeed`] is the same ingest fed in
//! process, for the simulation), per-worker counters ([`metrics`]), and how the index
//! is shared between ingestion and routing decisions ([`shared`]: writers take turns,
//! and let waiting lookups in between slices of a batch).
//! It must not route requests or keep load.

pub mod apply;
pub mod bootstrap;
pub mod link;
pub mod metrics;
pub mod msgpack;
pub mod replay;
pub mod sequence;
pub mod shared;
pub mod subscriber;
pub mod wire;

pub use apply::{apply_batch, import_snapshot, ApplyOutcome, IndexWriter};
pub use bootstrap::{Bootstrap, BootstrapFuture, RankSnapshot};
pub use metrics::{
    DropReason, EventMetrics, EventMetricsSnapshot, WorkerCounters, WorkerEventStats,
};
pub use shared::{IndexLock, IndexWriteGuard, SharedIndex};
pub use subscriber::{
    purge_worker, spawn_subscriber, spawn_subscriber_with, EventFeed, EventSource,
    SubscriberConfig, SubscriberHandle,
};
pub use wire::{decode_batch, BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent};
