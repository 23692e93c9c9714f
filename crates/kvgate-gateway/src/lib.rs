//! # kvgate-gateway: `kvgate serve`, the OpenAI-compatible routing gateway
//!
//! Wires the core policies, prefix index and ledger (kvgate-core), KV-event ingestion
//! (kvgate-events) and pre-routing tokenization (kvgate-tokenize) into one HTTP
//! process. Request path: `server` (endpoints) → `front_door` (auth, Content-Type,
//! admission, body limit) → `routing` (parse, model, tokenize, select) → `failover`
//! (an attempt's `lease`: admission plus booking; forward, retry before the first
//! byte) → `proxy` (upstream HTTP) → `observe` (pass bytes through, drive the
//! booking, end the lease). A disaggregated model's request runs a prefill and a
//! decode leg (`disaggregation`), each through `failover`'s attempt loop.
//! Background: `health` (checks, ledger sweep), `peers` (load reports and index
//! snapshots exchanged with other kvgate replicas), `discovery` (engines found through
//! DNS). State: `gateway`, `registry`,
//! `breaker`, `limits`. Must not contain policy scoring (kvgate-core) or event
//! decoding (kvgate-events).

pub mod admin;
pub mod auth;
pub mod breaker;
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
pub mod observe;
pub mod peers;
pub mod proxy;
pub mod registry;
pub mod routing;
pub mod server;
pub mod stall;

pub use config::{
    Config, DiscoveredPorts, FailoverConfig, HealthConfig, LimitsConfig, ModelConfig, PeersConfig,
    TimeoutsConfig, WorkerConfig, WorkersDnsConfig, WorkersKubernetesConfig,
};
pub use errors::ApiError;
pub use gateway::Gateway;
pub use server::{router, start, RunningGateway};
