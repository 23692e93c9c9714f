//! What one worker's load is made of, in the terms every load source shares: this
//! router's bookings (`ledger`), its peer replicas' reports (`peer_loads`) and the
//! load an engine reported beyond them. Owns the figures only; no bookkeeping.

use serde::Serialize;

/// Load one worker carries (from one source: bookings, a peer's report, or the
/// engine's own count).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct WorkerLoad {
    pub in_flight: u32,
    /// Uncached prompt tokens of requests whose first token has not arrived.
    pub prefill_tokens: u64,
    /// Weighted KV blocks of requests in flight.
    pub decode_blocks: f64,
}
