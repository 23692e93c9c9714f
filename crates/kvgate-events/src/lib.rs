//! # kvgate-events: engine KV events → the prefix index
//!
//! Owns everything between an engine's ZeroMQ KV-event publisher and
//! [`kvgate_core::PrefixIndex`]: decoding vLLM/SGLang payloads ([`wire`], on top of a
//! bounds-checked MessagePack reader in [`msgpack`]), translating events into index
//! calls ([`apply`]), loading a peer router's snapshot of a worker ([`bootstrap`]), subscribing with sequence tracking, replay and reconnects
//! ([`subscriber`], [`replay`], [`link`]; [`EventFeed`] is the same ingest fed in
//! process, for the simulation), and per-worker counters ([`metrics`]).
//! It must not route requests, keep load, or own the index's locking policy beyond
//! taking the write lock once per batch.

pub mod apply;
pub mod bootstrap;
pub mod link;
pub mod metrics;
pub mod msgpack;
pub mod replay;
pub mod sequence;
pub mod subscriber;
pub mod wire;

pub use apply::{apply_batch, ApplyOutcome};
pub use bootstrap::{Bootstrap, BootstrapFuture, RankSnapshot};
pub use metrics::{
    DropReason, EventMetrics, EventMetricsSnapshot, WorkerCounters, WorkerEventStats,
};
pub use subscriber::{
    purge_worker, spawn_subscriber, spawn_subscriber_with, EventFeed, EventSource, SharedIndex,
    SubscriberConfig, SubscriberHandle,
};
pub use wire::{decode_batch, BlockRemoved, BlockStored, DecodeError, EventBatch, KvEvent};
