//! Shared helpers for policies: per-candidate load lines, random tie-breaking and
//! seeded RNG construction. Owns no policy state.

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::{FleetView, WorkerScore};
use crate::load::WorkerLoad;

/// A seeded (or OS-seeded) RNG behind a lock.
pub(crate) fn rng(seed: Option<u64>) -> Mutex<SmallRng> {
    Mutex::new(match seed {
        Some(s) => SmallRng::seed_from_u64(s),
        None => SmallRng::from_os_rng(),
    })
}

/// One explanation line per candidate with its load across the fleet (this router's
/// bookings and its peers') and no overlap or cost.
pub(crate) fn load_lines(view: &FleetView<'_>) -> Vec<WorkerScore> {
    let loads = view.ledger.fleet_loads_of(view.candidates);
    view.candidates
        .iter()
        .zip(loads)
        .map(|(w, l)| line(*w, l))
        .collect()
}

pub(crate) fn line(worker: crate::ids::WorkerId, l: WorkerLoad) -> WorkerScore {
    WorkerScore {
        worker,
        overlap_blocks: [0; 3],
        in_flight: l.in_flight,
        prefill_tokens: l.prefill_tokens,
        decode_blocks: l.decode_blocks,
        cost: None,
    }
}

/// Work a worker has queued, in blocks: prefill still to do plus decode blocks.
pub(crate) fn work_blocks(s: &WorkerScore, block_size: u32) -> f64 {
    s.prefill_tokens as f64 / f64::from(block_size.max(1)) + s.decode_blocks
}

/// Whether a worker with `in_flight` requests is too far ahead of the least loaded
/// candidate's `least`: by more than `abs` requests and by more than `rel` times
/// (the balance rule of prefix_affinity and kv_aware's load bound).
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
