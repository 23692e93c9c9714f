//! Shared helpers for policies: per-candidate load lines, random tie-breaking and
//! seeded RNG construction. Owns no policy state.

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{FleetView, WorkerScore};
use crate::load::WorkerLoad;
use crate::timing::WorkerTiming;

/// A seeded (or OS-seeded) RNG behind a lock.
pub(crate) fn rng(seed: Option<u64>) -> Mutex<SmallRng> {
    Mutex::new(match seed {
        Some(s) => SmallRng::seed_from_u64(s),
        None => SmallRng::from_os_rng(),
    })
}

/// One explanation line per candidate with its load across the fleet (this router's
/// bookings, its peers' and the engine's unseen load) and no overlap, cost or
/// prediction; and each candidate's time model, to predict with what is cached there.
pub(crate) fn lines_and_timings(view: &FleetView<'_>) -> (Vec<WorkerScore>, Vec<WorkerTiming>) {
    view.ledger
        .fleet_loads_and_timings_of(view.candidates)
        .into_iter()
        .zip(view.candidates)
        .map(|((l, timing), w)| (line(*w, l), timing))
        .unzip()
}

/// [`lines_and_timings`]' lines with the request's predictions as if nothing of its
/// `prompt_tokens` were cached: for the policies that read no cache.
pub(crate) fn load_lines(view: &FleetView<'_>, prompt_tokens: u32) -> Vec<WorkerScore> {
    let (mut lines, timings) = lines_and_timings(view);
    let kv_blocks = prompt_tokens.div_ceil(view.ledger.block_size());
    predict(&mut lines, &timings, kv_blocks, |_| {
        u64::from(prompt_tokens)
    });
    lines
}

/// Fills each line's predicted TTFT and TPOT for a request of `kv_blocks` prompt
/// blocks with `uncached(i)` prompt tokens to prefill on candidate i, and the TTFT of a
/// like request booked after it there.
pub(crate) fn predict(
    lines: &mut [WorkerScore],
    timings: &[WorkerTiming],
    kv_blocks: u32,
    uncached: impl Fn(usize) -> u64,
) {
    for (i, (line, timing)) in lines.iter_mut().zip(timings).enumerate() {
        let (load, uncached) = (line.load(), uncached(i));
        let p = timing.predict(&load, uncached);
        let after = load.plus_request(uncached, f64::from(kv_blocks));
        line.predicted_ttft_secs = Some(p.ttft_secs);
        line.predicted_tpot_secs = Some(p.tpot_secs);
        line.predicted_next_ttft_secs = Some(timing.predict(&after, uncached).ttft_secs);
        line.ttft_spread = Some(timing.ttft_spread());
    }
}

pub(crate) fn line(worker: crate::ids::WorkerId, l: WorkerLoad) -> WorkerScore {
    WorkerScore {
        worker,
        overlap_blocks: [0; 3],
        in_flight: l.in_flight,
        prefill_tokens: l.prefill_tokens,
        decode_blocks: l.decode_blocks,
        cost: None,
        predicted_ttft_secs: None,
        predicted_tpot_secs: None,
        predicted_next_ttft_secs: None,
        ttft_spread: None,
    }
}

/// Work a worker has queued, in blocks: prefill still to do plus decode blocks.
pub(crate) fn work_blocks(s: &WorkerScore, block_size: u32) -> f64 {
    s.prefill_tokens as f64 / f64::from(block_size.max(1)) + s.decode_blocks
}

/// Whether a worker with `in_flight` requests is too far ahead of the least loaded
/// candidate's `least`: by more than `abs` requests and by more than `rel` times
/// (prefix_affinity's balance rule).
pub(crate) fn too_far_ahead(in_flight: u32, least: u32, abs: u32, rel: f64) -> bool {
    in_flight.saturating_sub(least) > abs && f64::from(in_flight) > rel * f64::from(least)
}

/// Index of the minimum of `values`, ties (within a relative epsilon) broken uniformly
/// at random. `values` must not be empty.
pub(crate) fn argmin_random_tie(values: &[f64], rng: &mut impl Rng) -> usize {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let eps = 1e-9 * min.abs().max(1.0);
    let mut chosen = 0;
    let mut seen = 0u32;
    for (i, v) in values.iter().enumerate() {
        if *v <= min + eps {
            // Reservoir sampling over the tied minima.
            seen += 1;
            if rng.random_range(0..seen) == 0 {
                chosen = i;
            }
        }
    }
    chosen
}
