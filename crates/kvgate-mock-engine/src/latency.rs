//! The step latency model: how long one engine step takes, in milliseconds.
//!
//! Owns the polynomial fit (DESIGN.md section 5, Dynamo mocker's H100 fit by default)
//! and the optional step jitter's factor (the caller supplies the uniform draws). Pure
//! arithmetic: no clock, no randomness of its own, no sleeping, no scheduling decisions.

use serde::{Deserialize, Serialize};

/// Coefficients of the latency model. Step time in ms:
///
/// - prefill part `a·T² + b·T + c` when the step computes T > 0 prefill tokens
///   (tokens not found in the prefix cache, summed over the batch);
/// - decode part `max(decode_floor_ms, d·u² + e·u + f)` when at least one request
///   decodes in the step, u = KV usage fraction (0..1) after the step's allocations;
/// - a mixed step (chunked prefill next to decodes) costs the **sum** of both parts:
///   one forward pass does both kinds of work, and summing keeps prefill interference
///   with decode visible (the effect routers must avoid), at the price of counting the
///   two fixed overheads `c` and `f` once each.
///
/// The engine divides the result by its speedup before sleeping.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LatencyModel {
    pub prefill_a: f64,
    pub prefill_b: f64,
    pub prefill_c: f64,
    pub decode_d: f64,
    pub decode_e: f64,
    pub decode_f: f64,
    pub decode_floor_ms: f64,
    /// Disaggregated serving: time to move one prompt token's KV from a prefill to a
    /// decode engine (ms per token; ~2.5 µs is an 8B model's 128 KiB per token over
    /// ~50 GB/s). The decode engine waits it before the request joins its queue.
    #[serde(default = "default_kv_transfer_ms_per_token")]
    pub kv_transfer_ms_per_token: f64,
    /// Each step's duration times a log-normal factor of mean 1 and this log standard
    /// deviation (0: every step exactly as the fit says; a CPU engine sharing its host
    /// scatters by about 0.5).
    #[serde(default)]
    pub step_jitter: f64,
}

fn default_kv_transfer_ms_per_token() -> f64 {
    0.0025
}

impl Default for LatencyModel {
    fn default() -> Self {
        Self {
            prefill_a: 4.21e-7,
            prefill_b: 1.52e-2,
            prefill_c: 16.5,
            decode_d: -25.74,
            decode_e: 54.01,
            decode_f: 5.74,
            decode_floor_ms: 1.0,
            kv_transfer_ms_per_token: default_kv_transfer_ms_per_token(),
            step_jitter: 0.0,
        }
    }
}

impl LatencyModel {
    /// Prefill cost of `tokens` uncached tokens (0 when there are none).
    pub fn prefill_ms(&self, tokens: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        (self.prefill_a * t * t + self.prefill_b * t + self.prefill_c).max(0.0)
    }

    /// Decode cost of one step at KV usage fraction `usage` (clamped to 0..=1).
    pub fn decode_ms(&self, usage: f64) -> f64 {
        let u = usage.clamp(0.0, 1.0);
        (self.decode_d * u * u + self.decode_e * u + self.decode_f).max(self.decode_floor_ms)
    }

    /// The factor a step's duration is multiplied by: log-normal with mean 1 and log
    /// standard deviation `step_jitter` (Box-Muller on two uniform draws in (0, 1), taken
    /// from `draws` only when there is jitter).
    pub fn jitter_factor(&self, draws: impl FnOnce() -> (f64, f64)) -> f64 {
        let s = self.step_jitter;
        if s <= 0.0 {
            return 1.0;
        }
        let (u1, u2) = draws();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        (s * z - s * s / 2.0).exp()
    }

    /// Time to receive `tokens` prompt tokens' KV from a prefill engine.
    pub fn kv_transfer_ms(&self, tokens: u64) -> f64 {
        (tokens as f64 * self.kv_transfer_ms_per_token).max(0.0)
    }

    /// Duration of a step with `prefill_tokens` uncached tokens and, if `decoding`,
    /// at least one decode token, at KV usage `usage`.
    pub fn step_ms(&self, prefill_tokens: u64, decoding: bool, usage: f64) -> f64 {
        let decode = if decoding { self.decode_ms(usage) } else { 0.0 };
        self.prefill_ms(prefill_tokens) + decode
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_design_fit() {
        let m = LatencyModel::default();
        assert_eq!(m.prefill_ms(0), 0.0);
        let p = m.prefill_ms(1000);
        assert!((p - (4.21e-7 * 1e6 + 15.2 + 16.5)).abs() < 1e-9);
        assert!((m.decode_ms(0.0) - 5.74).abs() < 1e-9);
        assert!((m.decode_ms(0.5) - (-25.74 * 0.25 + 27.005 + 5.74)).abs() < 1e-9);
        assert!(m.prefill_ms(2000) > m.prefill_ms(1000));
    }

    #[test]
    fn decode_has_a_floor_and_mixed_steps_add_up() {
        let m = LatencyModel {
            decode_f: -100.0,
            ..LatencyModel::default()
        };
        assert_eq!(m.decode_ms(0.0), 1.0);
        let d = LatencyModel::default();
        assert!((d.step_ms(100, true, 0.2) - (d.prefill_ms(100) + d.decode_ms(0.2))).abs() < 1e-12);
        assert_eq!(d.step_ms(0, false, 0.9), 0.0);
    }
}
