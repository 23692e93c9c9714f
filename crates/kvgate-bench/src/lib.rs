//! kvgate-bench: trace replay, synthetic workloads, router comparison and the demo.
//!
//! Owns the `kvgate bench`, `kvgate bench compare`, `kvgate bench scenarios`,
//! `kvgate bench chaos`, `kvgate demo` and `kvgate up` subcommands. It
//! talks to routers and engines only over HTTP and by spawning `kvgate` child
//! processes; it must not link routing or engine logic.

pub mod chaos;
pub mod cli;
pub mod client;
pub mod compare;
pub mod envoy;
pub mod fleet;
pub mod plot;
pub mod process;
pub mod report;
pub mod request;
pub mod rng;
pub mod rollout;
pub mod routers;
pub mod runner;
pub mod scenario;
pub mod sse;
pub mod trace;
pub mod up;
pub mod workload;
