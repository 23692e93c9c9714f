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

impl WorkerLoad {
    /// This load with one more request booked: `uncached` prompt tokens to prefill and
    /// `kv_blocks` KV blocks (its prompt's, before any output).
    pub fn plus_request(self, uncached: u64, kv_blocks: f64) -> Self {
        Self {
            in_flight: self.in_flight + 1,
            prefill_tokens: self.prefill_tokens + uncached,
            decode_blocks: self.decode_blocks + kv_blocks,
        }
    }
}
