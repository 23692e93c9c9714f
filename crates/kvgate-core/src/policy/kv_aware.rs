//! kv_aware: overlap from the prefix index weighed against ledger load.
//!
//! Owns the cost model of DESIGN.md section 3, with B the block size:
//!
//! ```text
//! cached_blocks(w)      = device + host_credit·host + disk_credit·disk   (leading run)
//! new_prefill_blocks(w) = active_prefill_tokens(w)/B + (prompt_blocks − cached_blocks(w))
//! cost(w)               = overlap_weight · new_prefill_blocks(w) + decode_blocks(w)
//! ```
//!
//! The lowest cost wins (ties broken at random, so a cold miss does not always land
//! on the same worker), or with `temperature > 0` a worker is sampled with probability
//! ∝ exp(−normalized cost / temperature). Herding is prevented by the load terms: each
//! request booked on the prefix holder raises its cost by its prefill and decode blocks,
//! so once the holder's queue outweighs the cached prefix the others become cheaper.
//!
//! Decisions are also remembered for a few seconds (`pending_credit_secs`) and credited
//! as device-cached on the chosen worker until the engine's KV events arrive, so a
//! follow-up that arrives while its predecessor is still queued can find it. The
//! queued-prefill term can be discounted (`prefill_queue_weight` < 1) to prefer waiting
//! behind a prefix holder over recomputing the prefix elsewhere; docs/BENCHMARKS.md
//! records the trade-off that keeps the default at 1.

use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use serde::{Deserialize, Serialize};

use super::decision_memory::DecisionMemory;
use super::scoring::{argmin_random_tie, load_lines, rng, softmax_sample};
use super::{Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError};
use crate::ids::Tier;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvAwareConfig {
    /// Weight of prefill work against decode work. Default 4, from the Mooncake and
    /// herding comparisons in docs/BENCHMARKS.md: at 1 a decode block counts as much as
    /// a block of prefill, and with long prompts the decode term drowns the cache
    /// savings (TTFT p90 and hit rate improved steadily from 1 to 4, with no herding).
    pub overlap_weight: f64,
    /// Weight of the prefill already queued on a worker relative to this request's own
    /// uncached blocks (1 = DESIGN section 3). Below 1, waiting behind a prefix holder's
    /// queue is preferred to recomputing the prefix elsewhere, which costs the fleet.
    pub prefill_queue_weight: f64,
    /// How long a decision is credited as "being cached" on the chosen worker until the
    /// engine's KV events confirm it (a follow-up can arrive while the previous request's
    /// prefill is still queued, before any event). 0 disables the credit.
    pub pending_credit_secs: f64,
    /// 0 = argmin; > 0 samples with a softmax at this temperature.
    pub temperature: f64,
    /// Credit for a block held in host memory (1.0 = as good as device).
    pub host_credit: f64,
    /// Credit for a block held on disk or remote storage.
    pub disk_credit: f64,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 4.0,
            prefill_queue_weight: 1.0,
            pending_credit_secs: 10.0,
            temperature: 0.0,
            host_credit: 0.5,
            disk_credit: 0.25,
        }
    }
}

/// Cap on remembered (block, worker) decisions awaiting confirmation by events.
const PENDING_MAX_ENTRIES: usize = 1_000_000;

#[derive(Debug)]
pub struct KvAwarePolicy {
    config: KvAwareConfig,
    rng: Mutex<SmallRng>,
    pending: Mutex<DecisionMemory>,
}

impl KvAwarePolicy {
    pub fn new(config: KvAwareConfig, seed: Option<u64>) -> Self {
        Self {
            config,
            rng: rng(seed),
            pending: Mutex::new(DecisionMemory::default()),
        }
    }
}

impl RoutingPolicy for KvAwarePolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::KvAware
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        view: &FleetView<'_>,
    ) -> Result<Decision, SelectError> {
        let index = view.index.ok_or(SelectError::NoIndex)?;
        let keys = req.block_keys.ok_or(SelectError::MissingTokens)?;
        if view.candidates.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let block_size = f64::from(index.block_size());
        let prompt_blocks = f64::from(req.prompt_tokens) / block_size;
        let overlaps = index.overlaps(keys);
        let mut lines = load_lines(view);
        let c = &self.config;
        let pending_ttl =
            Duration::try_from_secs_f64(c.pending_credit_secs.max(0.0)).unwrap_or(Duration::ZERO);
        let pending_runs = if pending_ttl.is_zero() {
            vec![0; view.candidates.len()]
        } else {
            self.pending
                .lock()
                .runs(keys, view.candidates, req.now, pending_ttl)
        };
        let costs: Vec<f64> = lines
            .iter_mut()
            .zip(&pending_runs)
            .map(|(line, pending)| {
                if let Some(o) = overlaps.best_for(line.worker) {
                    line.overlap_blocks = o.blocks;
                }
                // A prefix just sent to this worker counts as device-cached until its
                // events arrive (the index then knows, including any eviction).
                if *pending > line.overlap_blocks.iter().sum::<u32>() {
                    line.overlap_blocks = [*pending, 0, 0];
                }
                let [device, host, disk] = line.overlap_blocks.map(f64::from);
                let cached = device + c.host_credit * host + c.disk_credit * disk;
                let new_prefill = c.prefill_queue_weight * line.prefill_tokens as f64 / block_size
                    + (prompt_blocks - cached).max(0.0);
                let cost = c.overlap_weight * new_prefill + line.decode_blocks;
                line.cost = Some(cost);
                cost
            })
            .collect();
        let i = {
            let mut rng = self.rng.lock();
            if c.temperature > 0.0 {
                softmax_sample(&costs, c.temperature, &mut *rng)
            } else {
                argmin_random_tie(&costs, &mut *rng)
            }
        };
        let chosen = &lines[i];
        if !pending_ttl.is_zero() {
            let mut pending = self.pending.lock();
            pending.record(keys, chosen.worker, req.now);
            pending.trim(req.now, pending_ttl, PENDING_MAX_ENTRIES);
        }
        let predicted_cached_tokens =
            chosen.overlap_blocks[Tier::Device.index()] * index.block_size();
        let reason = if chosen.overlap_blocks.iter().any(|b| *b > 0) {
            "lowest cost: cached prefix outweighs load"
        } else {
            "lowest cost: no cached prefix, least work"
        };
        Ok(Decision {
            worker: chosen.worker,
            policy: PolicyKind::KvAware,
            predicted_cached_tokens,
            reason,
            scores: lines,
        })
    }
}
