//! # kvgate-sim: `kvgate simulate`
//!
//! A deterministic virtual-time simulation of a routed fleet, for tuning policies and
//! planning capacity. It runs the real routing code (the gateway's selection service,
//! built from `kvgate serve`'s own flags: `kvgate-core`'s policies, prefix index,
//! ledger and decision credit; `kvgate-events`' ingest of KV events) against N
//! instances of the mock engine's simulation core (`kvgate-mock-engine`'s scheduler,
//! cache and latency model), and reports through `kvgate bench`'s report, table and
//! plots. Nothing is copied: a change to a policy changes the simulation.
//!
//! Modules: [`simulation`] (the discrete-event loop of one row), [`agenda`] (the
//! virtual clock's ordering), [`change`] (fleet changes on a schedule), [`rows`]
//! (row specs → model configs), [`report`] (records → the bench's report), [`plan`]
//! (the smallest fleet for a TTFT target), [`cli`] (flags and output).
//!
//! It must not contain routing, engine or statistics logic of its own, open sockets,
//! sleep, or read the wall clock into results.

mod agenda;
pub mod change;
pub mod cli;
pub mod plan;
pub mod report;
pub mod rows;
pub mod simulation;

pub use change::{ChangeKind, FleetChange};
pub use rows::{parse_rows, SimRow};
pub use simulation::{simulate, ClosedLoop, FleetConfig, Load, RequestRecord, SimRun, Target};
