//! `kvgate mock-engine`: a simulated vLLM-compatible engine for tests and benchmarks.
//!
//! The crate is split into a pure, deterministic simulation core (`cache`,
//! `scheduler`, `latency`, `events`, `virtual_time`), the wire format of KV events
//! (`wire`), tokenization (`tokenizer`), and the I/O shell (`driver`, `server`,
//! `kv_publisher`, `engine`, `cli`; `disaggregation` for prefill/decode roles). The core never does I/O; the shell never makes
//! scheduling decisions.

pub mod cache;
pub mod cli;
pub mod disaggregation;
pub mod driver;
pub mod engine;
pub mod events;
pub mod kv_publisher;
pub mod latency;
mod local_tokenizer;
pub mod metrics;
pub mod openai;
pub mod scheduler;
pub mod server;
pub mod tokenizer;
pub mod virtual_time;
pub mod wire;

pub use events::KvEvent;
pub use latency::LatencyModel;
pub use scheduler::{SimConfig, SimRequest, Simulator, StepOutput};
pub use virtual_time::{run_virtual, TimedRequest, VirtualRun};

pub use engine::{spawn, EngineConfig, RunningEngine};
pub use kv_publisher::PublisherConfig;
