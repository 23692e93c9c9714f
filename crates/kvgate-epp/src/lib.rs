//! # kvgate-epp: kvgate as the Endpoint Picker of the Gateway API Inference Extension
//!
//! The cluster's gateway (Envoy Gateway, Istio, kgateway, GKE, or a plain Envoy) opens
//! one Envoy ext_proc stream per HTTP request to an `InferencePool`, and kvgate answers
//! which endpoint serves it; the gateway proxies. A second front door over kvgate-gateway's
//! request path (the same admission, preparation, selection, booking and response watch
//! as `kvgate serve`, which runs beside it for `/metrics`, the admin API and
//! `/v1/route/explain`), not a second copy. The protocol: upstream
//! docs/proposals/004-endpoint-picker-protocol; docs/operations.md, "kvgate as an
//! Endpoint Picker", has the gateway configuration.
//!
//! - `wire`: the protocol's messages (headers, subset hint, served endpoint, the pick,
//!   body chunks, immediate responses);
//! - `stream`: one request's stream, in order;
//! - `server`: the gRPC servers (ext_proc with gRPC health on the ext_proc port, health
//!   alone on the health port; TLS by default), started beside the HTTP gateway;
//! - `metrics`: the picker's own counters;
//! - `cli`: `kvgate epp`.
//!
//! Must not score, book or tokenize (kvgate-gateway and the crates below it do).

pub mod cli;
pub mod metrics;
pub mod server;
pub mod stream;
pub mod wire;

pub use server::{start, EppConfig, RunningEpp};
pub use stream::PickerOptions;
