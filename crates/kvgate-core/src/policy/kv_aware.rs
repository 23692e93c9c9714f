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

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use serde::{Deserialize, Serialize};

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
            temperature: 0.0,
            host_credit: 0.5,
            disk_credit: 0.25,
        }
    }
}

#[derive(Debug)]
pub struct KvAwarePolicy {
    config: KvAwareConfig,
    rng: Mutex<SmallRng>,
}

impl KvAwarePolicy {
    pub fn new(config: KvAwareConfig, seed: Option<u64>) -> Self {
        Self {
            config,
            rng: rng(seed),
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
        let costs: Vec<f64> = lines
            .iter_mut()
            .map(|line| {
                if let Some(o) = overlaps.best_for(line.worker) {
                    line.overlap_blocks = o.blocks;
                }
                let [device, host, disk] = line.overlap_blocks.map(f64::from);
                let cached = device + c.host_credit * host + c.disk_credit * disk;
                let new_prefill =
                    line.prefill_tokens as f64 / block_size + (prompt_blocks - cached).max(0.0);
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
