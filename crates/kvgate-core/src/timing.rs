//! The time model: a worker's predicted time to first token (TTFT) and time per output
//! token (TPOT) for one request, from its engine's batch limits and from rates learned
//! online from what the router observed on that worker. Owns the formulas, the limits'
//! defaults and the learning; the ledger holds one [`WorkerTiming`] per worker and feeds
//! it loads and observations. Pure: no clock, no I/O, no locks (times are passed in as
//! seconds), so the simulation and the tests drive it exactly.
//!
//! # The model
//!
//! For a request with `u` uncached prompt tokens on a worker that carries `n` requests
//! in flight with `q` prompt tokens still to prefill and k thousand KV blocks, under the
//! engine's limits `max_num_seqs`, B = `max_num_batched_tokens` and G =
//! `num_gpu_blocks` (when known), with L the worker's mean output length and b the KV
//! blocks a request there holds (learned: its uncached prompt and its output):
//!
//! ```text
//! S             = min(max_num_seqs, G / b)  (the sequences that fit, in slots and KV)
//! slot_steps    = (n + 1 − S) · L / S     when n ≥ S, else 0
//!                 (decode steps until a batch slot frees: S slots, each held L steps)
//! prefill_steps = max(1, ⌈(q + u) / B⌉)  (the prefill queued ahead, then this prompt's)
//! TTFT          = (step + kv_step · k) · prefill_steps + per_token · (q + u)
//!               + slot · slot_steps
//! TPOT          = decode_base + decode_per_seq · min(n + 1, S)
//! ```
//!
//! Learned per worker: `step` (seconds a prefill step costs beyond its tokens: the
//! decode of the batch beside it and the request's own overheads), `per_token` (prefill
//! seconds per uncached token) and `slot` (seconds per decode step while waiting for a
//! slot) from each first token's observed TTFT; `decode_base` and `decode_per_seq` from
//! each finished request's mean inter-token time and the batch it ran in; L and b from
//! finished requests (until one has finished, KV is not a limit). Each fit is a ridge
//! regression toward a prior on sums that decay per sample ([`WINDOW`]): a new worker
//! predicts the prior, about [`PRIOR_SAMPLES`] samples outweigh it, and the last few
//! dozen samples dominate, so a worker that slows down is seen as slower within a few
//! windows. The regression weighs relative error: each sample is divided by the larger
//! of its value and the current prediction before it is summed, so the longest waits
//! (a queue of seconds) do not set the rates for the common short ones; in seconds, a
//! mixed-priority overload's median error was 40%, now 20%. The price: old fast samples
//! weigh more than new slow ones, so a slowdown takes about three windows to follow,
//! a speedup one and a half. Once a worker has [`WARM_SAMPLES`] samples, an observation
//! more than [`OUTLIER_FACTOR`] times off the current prediction is clipped to that
//! bound before it is learned (a stalled stream or a network hiccup must not rewrite the
//! rates). The priors are an H100 running an 8B model (DESIGN.md's latency fit).
//!
//! The predictions are medians. A latency objective is judged on what nearly every like
//! request gets: each worker also tracks, online, the [`JUDGED_QUANTILE`] of observed over
//! predicted TTFT there ([`WorkerTiming::ttft_spread`]), and objectives are judged on the
//! prediction times that factor ([`crate::objective`]). Judged on the median, half of the
//! requests admitted near their objective miss it: overload goodput at rate 20 was 6.4
//! req/s so, 9.5 judged at the 90th percentile, 10.2 at the 95th (docs/BENCHMARKS.md
//! section 15).
//!
//! Accuracy (docs/BENCHMARKS.md section 15): a median error of 6-15% on the simulated
//! fleet's workloads, 20% under a mixed-priority overload; 25-31% on real vLLM on a
//! shared 2-core CPU machine, where rates fitted in hindsight to the same requests get
//! 23-26% (`scripts/ttft-floor.py`: the rest is noise these features do not see).

use serde::Serialize;

use crate::load::WorkerLoad;

/// How many recent samples the fits remember (older ones decay by `1 - 1/WINDOW` per
/// sample).
pub const WINDOW: f64 = 64.0;
/// The prior's weight, in samples.
pub const PRIOR_SAMPLES: f64 = 4.0;
/// Samples before an outlier is clipped (until then the prior may be far off).
pub const WARM_SAMPLES: u64 = 16;
/// How far off the current prediction an observation may be before it is clipped.
pub const OUTLIER_FACTOR: f64 = 4.0;
/// The share of like requests a latency objective must hold for: a worker is judged
/// by the time within which this share of its first tokens came, relative to the
/// predictions ([`WorkerTiming::ttft_spread`]).
pub const JUDGED_QUANTILE: f64 = 0.95;
/// How far one observation moves that quantile, in natural-log units.
const QUANTILE_STEP: f64 = 0.05;

/// An engine's batch limits, as vLLM names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct EngineLimits {
    /// Sequences an engine step runs at most (`--max-num-seqs`).
    pub max_num_seqs: u32,
    /// Tokens an engine step computes at most (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// KV-cache blocks the engine holds (vLLM's `num_gpu_blocks`, in its
    /// `vllm:cache_config_info` metric); `None`: unknown, KV is not a limit.
    pub num_gpu_blocks: Option<u32>,
}

impl Default for EngineLimits {
    /// vLLM 0.32's `vllm serve` defaults on an H100 (at least 70 GiB, not an A100):
    /// 1024 sequences, 8192 tokens a step. Smaller GPUs default to 256 and 2048, CPUs to
    /// 128 and 2048: say so in the configuration.
    fn default() -> Self {
        Self {
            max_num_seqs: 1024,
            max_num_batched_tokens: 8192,
            num_gpu_blocks: None,
        }
    }
}

/// Predicted latencies of one request on one worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Prediction {
    /// Time to first token, seconds.
    pub ttft_secs: f64,
    /// Time per output token, seconds.
    pub tpot_secs: f64,
}

/// What a TTFT observation is regressed on: the request's situation at booking —
/// prefill steps, prefill tokens, decode steps waiting for a slot, and prefill steps
/// times the thousands of KV blocks in flight (a step beside more KV takes longer).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TtftFeatures([f64; 4]);

impl TtftFeatures {
    pub fn prefill_steps(&self) -> f64 {
        self.0[0]
    }

    pub fn prefill_tokens(&self) -> f64 {
        self.0[1]
    }

    pub fn slot_steps(&self) -> f64 {
        self.0[2]
    }

    /// Prefill steps times the thousands of KV blocks in flight.
    pub fn kv_block_steps(&self) -> f64 {
        self.0[3]
    }
}

/// A worker's learned rates, as explain and the metrics show them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Rates {
    /// Seconds a prefill step costs beyond its tokens.
    pub step_secs: f64,
    /// Prefill seconds per uncached token.
    pub prefill_secs_per_token: f64,
    /// Seconds per decode step while waiting for a batch slot.
    pub slot_step_secs: f64,
    /// What a thousand KV blocks in flight add to a prefill step.
    pub step_secs_per_thousand_kv_blocks: f64,
    /// Time per output token of a request decoding alone.
    pub decode_base_secs: f64,
    /// What each further sequence in the batch adds to the time per output token.
    pub decode_per_seq_secs: f64,
    /// Mean output tokens of a request.
    pub mean_output_tokens: f64,
    /// Mean KV blocks a request holds at its end (its uncached prompt and output).
    pub mean_kv_blocks: f64,
    /// Sequences that fit at once: `max_num_seqs`, or fewer where the KV cache is
    /// smaller than that many requests need.
    pub effective_max_seqs: f64,
    /// Observed over predicted TTFT at [`JUDGED_QUANTILE`]: objectives are judged on
    /// the predictions times this ([`WorkerTiming::ttft_spread`]).
    pub ttft_spread: f64,
    /// TTFT observations learned from (not decayed).
    pub ttft_samples: u64,
    /// TPOT observations learned from (not decayed).
    pub tpot_samples: u64,
}

const PRIOR_STEP_SECS: f64 = 0.020;
const PRIOR_PREFILL_SECS_PER_TOKEN: f64 = 2.0e-5;
const PRIOR_DECODE_BASE_SECS: f64 = 0.008;
const PRIOR_DECODE_PER_SEQ_SECS: f64 = 5.0e-5;
const PRIOR_OUTPUT_TOKENS: f64 = 128.0;

/// Ridge regression of y on K features, toward a prior, over decayed sums.
#[derive(Clone, Copy, Debug)]
struct Fit<const K: usize> {
    xtx: [[f64; K]; K],
    xty: [f64; K],
    weight: f64,
    samples: u64,
    coef: [f64; K],
}

impl<const K: usize> Fit<K> {
    fn new(prior: [f64; K]) -> Self {
        Self {
            xtx: [[0.0; K]; K],
            xty: [0.0; K],
            weight: 0.0,
            samples: 0,
            coef: prior,
        }
    }

    fn predict(&self, x: &[f64; K]) -> f64 {
        x.iter().zip(&self.coef).map(|(a, b)| a * b).sum()
    }

    /// Learns `y` at `x` (clipped once warm), then refits toward `prior`.
    fn add(&mut self, x: [f64; K], y: f64, prior: [f64; K]) {
        if !y.is_finite() || x.iter().any(|v| !v.is_finite()) {
            return;
        }
        let p = self.predict(&x).max(1e-6);
        let y = if self.samples >= WARM_SAMPLES {
            y.clamp(p / OUTLIER_FACTOR, p * OUTLIER_FACTOR)
        } else {
            y.max(0.0)
        };
        // Least squares in relative terms (module comment): the sample is divided by
        // the larger of its value and the current prediction.
        let scale = 1.0 / y.max(p);
        let (x, y) = (x.map(|v| v * scale), y * scale);
        let keep = 1.0 - 1.0 / WINDOW;
        for i in 0..K {
            for j in 0..K {
                self.xtx[i][j] = self.xtx[i][j] * keep + x[i] * x[j];
            }
            self.xty[i] = self.xty[i] * keep + x[i] * y;
        }
        self.weight = self.weight * keep + 1.0;
        self.samples += 1;
        self.refit(prior);
    }

    /// The prior's weight in samples: [`PRIOR_SAMPLES`] at first, fading as samples
    /// come (half at [`WARM_SAMPLES`]) to a quarter of one, which still settles what
    /// the samples cannot (a feature never seen, two that always moved together).
    fn prior_weight(&self) -> f64 {
        prior_weight(self.samples)
    }

    /// Solves (XᵀX + Λ)β = Xᵀy + Λ·prior, Λ_jj = the prior's weight times feature j's
    /// mean square (so the prior weighs as that many samples whatever the feature's
    /// scale); coefficients are kept non-negative.
    fn refit(&mut self, prior: [f64; K]) {
        let mut a = self.xtx;
        let mut b = self.xty;
        for j in 0..K {
            let mean_square = if self.weight > 0.0 {
                self.xtx[j][j] / self.weight
            } else {
                0.0
            };
            let lambda = self.prior_weight() * mean_square.max(1e-6);
            a[j][j] += lambda;
            b[j] += lambda * prior[j];
        }
        if let Some(beta) = solve(a, b) {
            self.coef = beta.map(|v| if v.is_finite() { v.max(0.0) } else { 0.0 });
        }
    }
}

/// The prior's weight in samples after `samples` observations: [`PRIOR_SAMPLES`] at
/// first, half that at [`WARM_SAMPLES`], never below a quarter of one.
fn prior_weight(samples: u64) -> f64 {
    let w = WARM_SAMPLES as f64;
    (PRIOR_SAMPLES * w / (w + samples as f64)).max(0.25)
}

/// Gaussian elimination with partial pivoting; `None` when singular.
fn solve<const K: usize>(mut a: [[f64; K]; K], mut b: [f64; K]) -> Option<[f64; K]> {
    for col in 0..K {
        let pivot = (col..K).max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))?;
        if a[pivot][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, pivot);
        b.swap(col, pivot);
        for row in col + 1..K {
            let f = a[row][col] / a[col][col];
            let pivot_row = a[col];
            for (x, p) in a[row][col..].iter_mut().zip(&pivot_row[col..]) {
                *x -= f * p;
            }
            b[row] -= f * b[col];
        }
    }
    let mut x = [0.0; K];
    for row in (0..K).rev() {
        let s: f64 = (row + 1..K).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    Some(x)
}

/// One worker's time model: its engine's limits and what was learned there.
#[derive(Clone, Copy, Debug)]
pub struct WorkerTiming {
    limits: EngineLimits,
    /// TTFT = step·prefill_steps + per_token·prefill_tokens + slot·slot_steps
    /// + kv_step·prefill_steps·kv_blocks/1000.
    ttft: Fit<4>,
    /// TPOT = decode_base + decode_per_seq·batch.
    tpot: Fit<2>,
    /// Mean output tokens: decayed sum and weight.
    output_sum: f64,
    output_weight: f64,
    output_samples: u64,
    /// KV blocks a finished request held, decayed sum (weighed as the output lengths).
    kv_blocks_sum: f64,
    /// The [`JUDGED_QUANTILE`] of ln(observed / predicted TTFT), tracked online.
    ttft_log_spread: f64,
}

impl WorkerTiming {
    pub fn new(limits: EngineLimits) -> Self {
        let tpot = Fit::new([PRIOR_DECODE_BASE_SECS, PRIOR_DECODE_PER_SEQ_SECS]);
        let mut t = Self {
            limits,
            ttft: Fit::new([PRIOR_STEP_SECS, PRIOR_PREFILL_SECS_PER_TOKEN, 0.0, 0.0]),
            tpot,
            output_sum: 0.0,
            output_weight: 0.0,
            output_samples: 0,
            kv_blocks_sum: 0.0,
            ttft_log_spread: 0.0,
        };
        t.ttft.coef = t.ttft_prior();
        t
    }

    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    /// New limits (the engine said them); what was learned stays.
    pub fn set_limits(&mut self, limits: EngineLimits) {
        self.limits = limits;
    }

    /// The sequences that fit in a batch at once: `max_num_seqs`, or fewer when the
    /// engine's KV cache holds fewer of this worker's typical requests (known once one
    /// has finished there).
    fn max_seqs(&self) -> f64 {
        let seqs = f64::from(self.limits.max_num_seqs.max(1));
        match (self.limits.num_gpu_blocks, self.mean_kv_blocks()) {
            (Some(blocks), per_request) if per_request > 0.0 => {
                seqs.min((f64::from(blocks) / per_request).max(1.0))
            }
            _ => seqs,
        }
    }

    /// The KV blocks a finished request held here, on average (0 before any).
    fn mean_kv_blocks(&self) -> f64 {
        if self.output_weight > 0.0 {
            self.kv_blocks_sum / self.output_weight
        } else {
            0.0
        }
    }

    /// TTFT's prior: the step and per-token priors, and a slot step as long as a
    /// decode step of a full batch is currently predicted to be.
    fn ttft_prior(&self) -> [f64; 4] {
        [
            PRIOR_STEP_SECS,
            PRIOR_PREFILL_SECS_PER_TOKEN,
            self.tpot_at(self.max_seqs()),
            0.0,
        ]
    }

    fn tpot_at(&self, batch: f64) -> f64 {
        self.tpot.predict(&[1.0, batch])
    }

    fn mean_output_tokens(&self) -> f64 {
        let prior = prior_weight(self.output_samples);
        (self.output_sum + prior * PRIOR_OUTPUT_TOKENS) / (self.output_weight + prior)
    }

    /// The situation of a request with `uncached` prompt tokens arriving at `ahead`.
    pub fn features(&self, ahead: &WorkerLoad, uncached: u64) -> TtftFeatures {
        let s = self.max_seqs();
        let n = f64::from(ahead.in_flight);
        let tokens = (ahead.prefill_tokens + uncached) as f64;
        let budget = f64::from(self.limits.max_num_batched_tokens.max(1));
        let steps = (tokens / budget).ceil().max(1.0);
        let slot_steps = if n >= s {
            (n + 1.0 - s) * self.mean_output_tokens() / s
        } else {
            0.0
        };
        TtftFeatures([
            steps,
            tokens,
            slot_steps,
            steps * ahead.decode_blocks / 1000.0,
        ])
    }

    /// Predicted TTFT and TPOT of a request with `uncached` prompt tokens on this worker
    /// while it carries `ahead`.
    pub fn predict(&self, ahead: &WorkerLoad, uncached: u64) -> Prediction {
        let f = self.features(ahead, uncached);
        let batch = (f64::from(ahead.in_flight) + 1.0).min(self.max_seqs());
        Prediction {
            ttft_secs: self.ttft.predict(&f.0),
            tpot_secs: self.tpot_at(batch),
        }
    }

    /// A first token came `ttft_secs` after booking, for a request booked with features
    /// `f`.
    pub fn observe_ttft(&mut self, f: TtftFeatures, ttft_secs: f64) {
        let predicted = self.ttft.predict(&f.0);
        if predicted > 0.0 && ttft_secs > 0.0 && ttft_secs.is_finite() {
            let below = (ttft_secs / predicted).ln() < self.ttft_log_spread;
            self.ttft_log_spread +=
                QUANTILE_STEP * (JUDGED_QUANTILE - if below { 1.0 } else { 0.0 });
        }
        let prior = self.ttft_prior();
        self.ttft.add(f.0, ttft_secs, prior);
    }

    /// A request produced `output_tokens` at `tpot_secs` each (its mean inter-token
    /// time), its worker carrying `in_flight` requests (itself included) when its
    /// first token came; it held `kv_blocks` KV blocks at its end.
    pub fn observe_decode(
        &mut self,
        in_flight: u32,
        output_tokens: u32,
        tpot_secs: f64,
        kv_blocks: f64,
    ) {
        let keep = 1.0 - 1.0 / WINDOW;
        if kv_blocks.is_finite() {
            self.kv_blocks_sum = self.kv_blocks_sum * keep + kv_blocks.max(0.0);
        }
        self.output_sum = self.output_sum * keep + f64::from(output_tokens);
        self.output_weight = self.output_weight * keep + 1.0;
        self.output_samples += 1;
        if output_tokens >= 2 {
            let batch = f64::from(in_flight.max(1)).min(self.max_seqs());
            self.tpot.add(
                [1.0, batch],
                tpot_secs,
                [PRIOR_DECODE_BASE_SECS, PRIOR_DECODE_PER_SEQ_SECS],
            );
        }
    }

    /// Observed over predicted TTFT at [`JUDGED_QUANTILE`] here: the factor by which a
    /// prediction is scaled when an objective is judged (1 until learned).
    pub fn ttft_spread(&self) -> f64 {
        self.ttft_log_spread.exp()
    }

    /// What was learned.
    pub fn rates(&self) -> Rates {
        let [step, per_token, slot, kv_step] = self.ttft.coef;
        let [base, per_seq] = self.tpot.coef;
        Rates {
            step_secs: step,
            prefill_secs_per_token: per_token,
            slot_step_secs: slot,
            step_secs_per_thousand_kv_blocks: kv_step,
            decode_base_secs: base,
            decode_per_seq_secs: per_seq,
            mean_output_tokens: self.mean_output_tokens(),
            mean_kv_blocks: self.mean_kv_blocks(),
            effective_max_seqs: self.max_seqs(),
            ttft_spread: self.ttft_spread(),
            ttft_samples: self.ttft.samples,
            tpot_samples: self.tpot.samples,
        }
    }
}

impl Default for WorkerTiming {
    fn default() -> Self {
        Self::new(EngineLimits::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(in_flight: u32, prefill_tokens: u64) -> WorkerLoad {
        WorkerLoad {
            in_flight,
            prefill_tokens,
            decode_blocks: 0.0,
        }
    }

    /// A worker with no samples predicts the prior: one step plus its tokens.
    #[test]
    fn an_unobserved_worker_predicts_the_prior() {
        let t = WorkerTiming::default();
        let p = t.predict(&load(0, 0), 1000);
        let want = PRIOR_STEP_SECS + 1000.0 * PRIOR_PREFILL_SECS_PER_TOKEN;
        assert!((p.ttft_secs - want).abs() < 1e-12, "{p:?}");
        assert!((p.tpot_secs - (PRIOR_DECODE_BASE_SECS + PRIOR_DECODE_PER_SEQ_SECS)).abs() < 1e-12);
    }

    /// The queue ahead counts: its prefill adds tokens and steps, a full batch adds the
    /// wait for a slot, which grows with every request beyond the limit.
    #[test]
    fn the_queue_and_a_full_batch_add_time() {
        let t = WorkerTiming::new(EngineLimits {
            max_num_seqs: 4,
            max_num_batched_tokens: 1024,
            num_gpu_blocks: None,
        });
        let idle = t.predict(&load(0, 0), 512).ttft_secs;
        let queued = t.predict(&load(2, 2048), 512).ttft_secs;
        assert!(queued > idle + 2048.0 * PRIOR_PREFILL_SECS_PER_TOKEN);
        let below = t.predict(&load(3, 0), 512).ttft_secs;
        let full = t.predict(&load(4, 0), 512).ttft_secs;
        let fuller = t.predict(&load(8, 0), 512).ttft_secs;
        assert_eq!(below, idle, "below the limit nobody waits for a slot");
        assert!(full > below && fuller - full > 3.0 * (full - below) * 0.99);
    }

    /// Learning from an engine four times slower than the prior (and with a different
    /// per-step cost) predicts it within a few percent after a window of samples, on
    /// situations it saw and on ones between them.
    #[test]
    fn rates_are_learned_from_observations() {
        let mut t = WorkerTiming::new(EngineLimits {
            max_num_seqs: 8,
            max_num_batched_tokens: 2048,
            num_gpu_blocks: None,
        });
        let truth = |f: TtftFeatures| 0.05 * f.prefill_steps() + 8e-5 * f.prefill_tokens();
        for i in 0..200u64 {
            let f = t.features(&load((i % 5) as u32, (i % 7) * 300), 100 + (i % 11) * 150);
            t.observe_ttft(f, truth(f));
        }
        for (n, q, u) in [(0, 0, 700), (3, 1200, 400), (1, 0, 2000)] {
            let f = t.features(&load(n, q), u);
            let p = t.predict(&load(n, q), u).ttft_secs;
            let want = truth(f);
            assert!(
                (p - want).abs() / want < 0.05,
                "n={n} q={q} u={u}: {p} vs {want}"
            );
        }
        assert!(t.rates().ttft_samples == 200);
    }

    /// The fit weighs relative error, not seconds: when no rates fit both a common short
    /// wait and a rare long one (here a tenth of the samples, twenty times the work,
    /// eight times the wait), the common one is predicted close. A fit in seconds let
    /// the long waits set the rates and put the common one 59% low; under a
    /// mixed-priority overload its median error was 40% (docs/BENCHMARKS.md section 15).
    #[test]
    fn the_fit_keeps_the_common_wait_close_not_the_longest() {
        let mut t = WorkerTiming::new(EngineLimits {
            max_num_seqs: 64,
            max_num_batched_tokens: 1000,
            num_gpu_blocks: None,
        });
        let short = t.features(&load(0, 0), 1000);
        let long = t.features(&load(1, 19_000), 1000);
        for _ in 0..30 {
            for _ in 0..9 {
                t.observe_ttft(short, 0.1);
            }
            t.observe_ttft(long, 0.8);
        }
        let p = t.predict(&load(0, 0), 1000).ttft_secs;
        assert!((p - 0.1).abs() / 0.1 < 0.1, "{p}");
    }

    /// The judged quantile is learned: on a worker whose first tokens scatter around the
    /// prediction (15% of them twice as late, the rest on time), the spread settles
    /// near 2, where the 95th percentile lies; back near 1 once all are on time; 1
    /// before any observation.
    #[test]
    fn the_spread_is_the_judged_quantile_of_observed_over_predicted() {
        let mut t = WorkerTiming::default();
        assert_eq!(t.ttft_spread(), 1.0);
        let f = t.features(&load(0, 0), 1000);
        for _ in 0..40 {
            t.observe_ttft(f, 0.1);
        }
        for i in 0..2000 {
            let p = t.predict(&load(0, 0), 1000).ttft_secs;
            // 15% of them twice as late: the 95th percentile is the late ones'.
            t.observe_ttft(f, if i % 20 < 3 { 2.0 * p } else { p });
        }
        let spread = t.ttft_spread();
        assert!((1.5..=2.2).contains(&spread), "{spread}");
        for _ in 0..2000 {
            let p = t.predict(&load(0, 0), 1000).ttft_secs;
            t.observe_ttft(f, p);
        }
        let spread = t.ttft_spread();
        assert!((0.9..=1.1).contains(&spread), "{spread}");
    }

    /// One wild observation once warm moves the prediction by little; a worker that
    /// slows down for good is followed within a few windows (module comment).
    #[test]
    fn outliers_are_bounded_and_change_is_followed() {
        let mut t = WorkerTiming::default();
        let f = t.features(&load(0, 0), 1000);
        for _ in 0..40 {
            t.observe_ttft(f, 0.1);
        }
        let before = t.predict(&load(0, 0), 1000).ttft_secs;
        assert!((before - 0.1).abs() < 0.01, "{before}");
        t.observe_ttft(f, 1000.0);
        let after = t.predict(&load(0, 0), 1000).ttft_secs;
        assert!(after < 0.1 * 1.2, "one outlier moved it to {after}");
        for _ in 0..250 {
            t.observe_ttft(f, 0.3);
        }
        let slow = t.predict(&load(0, 0), 1000).ttft_secs;
        assert!((slow - 0.3).abs() / 0.3 < 0.1, "{slow}");
    }

    /// An engine whose KV cache holds fewer requests than its batch limit: once a
    /// finished request shows what one holds, a request beyond what fits waits for a
    /// slot as behind a full batch; with the cache's size unknown, nothing changes.
    #[test]
    fn a_small_kv_cache_makes_the_batch_smaller() {
        let limits = EngineLimits {
            num_gpu_blocks: Some(1000),
            ..EngineLimits::default()
        };
        let (mut small, mut unknown) = (
            WorkerTiming::new(limits),
            WorkerTiming::new(EngineLimits::default()),
        );
        let idle = small.predict(&load(0, 0), 100).ttft_secs;
        assert_eq!(
            small.predict(&load(20, 0), 100).ttft_secs,
            idle,
            "nothing known yet"
        );
        for t in [&mut small, &mut unknown] {
            t.observe_decode(1, 64, 0.01, 100.0); // a request held 100 blocks
        }
        assert!((small.rates().effective_max_seqs - 10.0).abs() < 1e-9);
        assert_eq!(unknown.rates().effective_max_seqs, 1024.0);
        let idle = small.predict(&load(0, 0), 100).ttft_secs;
        assert_eq!(small.predict(&load(9, 0), 100).ttft_secs, idle, "ten fit");
        assert!(small.predict(&load(20, 0), 100).ttft_secs > idle);
        let unknown_idle = unknown.predict(&load(0, 0), 100).ttft_secs;
        assert_eq!(unknown.predict(&load(20, 0), 100).ttft_secs, unknown_idle);
    }

    /// Decode: the time per output token grows with the batch as observed, and the
    /// mean output length (which prices the wait for a slot) is learned.
    #[test]
    fn decode_rates_and_output_length_are_learned() {
        let mut t = WorkerTiming::new(EngineLimits {
            max_num_seqs: 32,
            max_num_batched_tokens: 2048,
            num_gpu_blocks: None,
        });
        for i in 0..300u32 {
            let batch = 1 + i % 32;
            t.observe_decode(batch, 64, 0.01 + 0.001 * f64::from(batch), 0.0);
        }
        let r = t.rates();
        assert!((r.decode_base_secs - 0.01).abs() < 0.002, "{r:?}");
        assert!((r.decode_per_seq_secs - 0.001).abs() < 0.0002, "{r:?}");
        assert!((r.mean_output_tokens - 64.0).abs() < 1.0, "{r:?}");
        let p = t.predict(&load(15, 0), 10);
        assert!((p.tpot_secs - 0.026).abs() < 0.003, "{p:?}");
    }

    #[test]
    fn solve_handles_a_small_system() {
        let x = solve([[2.0, 1.0], [1.0, 3.0]], [3.0, 5.0]).unwrap();
        assert!((x[0] - 0.8).abs() < 1e-12 && (x[1] - 1.4).abs() < 1e-12);
        assert!(solve([[0.0, 0.0], [0.0, 0.0]], [1.0, 1.0]).is_none());
    }
}
