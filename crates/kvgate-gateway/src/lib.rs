//! # kvgate-gateway: `kvgate serve`, the OpenAI-compatible routing gateway
//!
//! Wires the core policies, prefix index and ledger (kvgate-core, through
//! kvgate-selection), KV-event ingestion (kvgate-events) and pre-routing tokenization
//! (kvgate-tokenize) into one HTTP process. Its modules are layers whose imports only
//! point down (a test, `module_layers`, fails on a circle); docs/DESIGN.md has the
//! table of which file owns which concern. From the bottom:
//!
//! - **types and records**: `errors`, `config`, `metrics` (which owns every label and
//!   counts each request once), `auth`, `body` (the one bounded body read), `breaker`,
//!   `progress`, `objectives` (a request's latency objectives and priority);
//! - **fleet state**: `registry` (workers, model pools), `limits` (admission), `lease`
//!   (one attempt's booking), `proxy` (the upstream HTTP client), `peer_link` (what
//!   travels between replicas, this replica's side, asking a peer), then `gateway` (the
//!   process's shared state);
//! - **calling workers**: `health` (what a failure counts), `failover` (the one
//!   attempt loop), `observe` (the proxied body);
//! - **the request path**: `prepare` → `select` → `respond`, `disaggregation`, and
//!   `pipeline`, the request's life in one function;
//! - **the edges**: `front_door` (count, token, admission: one service per route), `api`,
//!   `admin`, `peers::{endpoints, leader, publish, follow}`, the background tasks
//!   (`checks`, `stall`, `engine_load`, `discovery`), and `server` (the route table
//!   and start/stop), `cli`.
//!
//! Must not contain policy scoring (kvgate-core) or event decoding (kvgate-events).

pub mod admin;
pub mod api;
pub mod auth;
pub mod body;
pub mod breaker;
pub mod checks;
pub mod cli;
pub mod config;
pub mod disaggregation;
pub mod discovery;
pub mod engine_load;
pub mod errors;
pub mod failover;
pub mod front_door;
pub mod gateway;
pub mod health;
pub mod lease;
pub mod limits;
pub mod metrics;
pub mod objectives;
pub mod observe;
pub mod peer_link;
pub mod peers;
pub mod picking;
pub mod pipeline;
pub mod prepare;
pub mod progress;
pub mod proxy;
pub mod registry;
pub mod respond;
pub mod select;
pub mod server;
pub mod stall;

pub use config::{
    Config, DiscoveredPorts, FailoverConfig, HealthConfig, LimitsConfig, ModelConfig, PeersConfig,
    TimeoutsConfig, WorkerConfig, WorkersDnsConfig, WorkersKubernetesConfig,
};
pub use errors::ApiError;
pub use gateway::Gateway;
pub use server::{router, start, RunningGateway};
