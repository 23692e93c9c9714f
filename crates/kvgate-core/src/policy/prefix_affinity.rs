//! prefix_affinity: approximate prefix routing without engine events.
//!
//! Owns a memory of its own decisions: for each block key it routed, which worker got
//! it and when. A request goes to the candidate that got the longest matching prefix,
//! unless load is imbalanced beyond thresholds (then the least loaded candidate wins),
//! or nothing matches (least loaded again). Memory is bounded: entries expire after a
//! TTL and the oldest are dropped beyond a cap. Like SGLang's cache_aware router but on
//! token blocks instead of text, so it sees exactly the prefixes the engine caches.

use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use serde::{Deserialize, Serialize};

use super::decision_memory::DecisionMemory;
use super::scoring::{argmin_random_tie, load_lines, rng, too_far_ahead};
use super::{
    Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError, WorkerScore,
    DEFAULT_AFFINITY_TTL,
};
use crate::ids::WorkerId;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PrefixAffinityConfig {
    /// How long a routing decision is remembered.
    #[serde(with = "secs")]
    pub ttl: Duration,
    /// Cap on remembered (block, worker) entries.
    pub max_entries: usize,
    /// Load is imbalanced when max − min requests in flight exceeds this...
    pub balance_abs_threshold: u32,
    /// ...and max exceeds this multiple of min.
    pub balance_rel_threshold: f64,
    /// Minimum fraction of the prompt's blocks that must match to follow affinity.
    pub min_match_ratio: f64,
}

impl Default for PrefixAffinityConfig {
    fn default() -> Self {
        Self {
            ttl: DEFAULT_AFFINITY_TTL,
            max_entries: 2_000_000,
            balance_abs_threshold: 16,
            balance_rel_threshold: 1.5,
            min_match_ratio: 0.0,
        }
    }
}

mod secs {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let v = f64::deserialize(d)?;
        Duration::try_from_secs_f64(v).map_err(serde::de::Error::custom)
    }
}

#[derive(Debug)]
pub struct PrefixAffinityPolicy {
    config: PrefixAffinityConfig,
    memory: Mutex<DecisionMemory>,
    rng: Mutex<SmallRng>,
}

impl PrefixAffinityPolicy {
    pub fn new(config: PrefixAffinityConfig, seed: Option<u64>) -> Self {
        Self {
            config,
            memory: Mutex::new(DecisionMemory::default()),
            rng: rng(seed),
        }
    }

    /// Index of the candidate with the fewest requests in flight (random tie-break),
    /// restricted to `among` when given.
    fn least_in_flight(&self, lines: &[WorkerScore], among: Option<&[bool]>) -> usize {
        let values: Vec<f64> = lines
            .iter()
            .enumerate()
            .map(|(i, s)| match among {
                Some(mask) if !mask[i] => f64::INFINITY,
                _ => f64::from(s.in_flight),
            })
            .collect();
        argmin_random_tie(&values, &mut *self.rng.lock())
    }

    fn imbalanced(&self, lines: &[WorkerScore]) -> bool {
        let max = lines.iter().map(|s| s.in_flight).max().unwrap_or(0);
        let min = lines.iter().map(|s| s.in_flight).min().unwrap_or(0);
        too_far_ahead(
            max,
            min,
            self.config.balance_abs_threshold,
            self.config.balance_rel_threshold,
        )
    }

    /// Number of remembered (block, worker) entries.
    pub fn remembered_entries(&self) -> usize {
        self.memory.lock().entries
    }
}

impl RoutingPolicy for PrefixAffinityPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::PrefixAffinity
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        view: &FleetView<'_>,
    ) -> Result<Decision, SelectError> {
        if view.candidates.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let mut lines = load_lines(view, req.prompt_tokens);
        let Some(keys) = req.block_keys else {
            let i = self.least_in_flight(&lines, None);
            return Ok(Decision {
                worker: view.candidates[i],
                policy: PolicyKind::PrefixAffinity,
                predicted_cached_tokens: 0,
                indexed_cached_tokens: 0,
                credited_tokens: 0,
                rule: "least_loaded",
                reason: "no routing tokens: least loaded",
                scores: lines,
            });
        };
        let mut memory = self.memory.lock();
        let runs = memory.runs(keys, view.candidates, req.now, self.config.ttl);
        for (line, run) in lines.iter_mut().zip(&runs) {
            line.overlap_blocks[0] = *run;
        }
        let best = runs.iter().copied().max().unwrap_or(0);
        let ratio = if keys.is_empty() {
            0.0
        } else {
            f64::from(best) / keys.len() as f64
        };
        let (i, rule, reason) = if self.imbalanced(&lines) {
            (
                self.least_in_flight(&lines, None),
                "load_bound",
                "load imbalanced: least loaded",
            )
        } else if best > 0 && ratio >= self.config.min_match_ratio {
            let mask: Vec<bool> = runs.iter().map(|r| *r == best).collect();
            (
                self.least_in_flight(&lines, Some(&mask)),
                "prefix",
                "longest remembered prefix",
            )
        } else {
            (
                self.least_in_flight(&lines, None),
                "least_loaded",
                "no remembered prefix: least loaded",
            )
        };
        let worker = view.candidates[i];
        memory.record(keys, worker, req.now);
        memory.trim(req.now, self.config.ttl, self.config.max_entries);
        let block_size = view.ledger.block_size();
        Ok(Decision {
            worker,
            policy: PolicyKind::PrefixAffinity,
            predicted_cached_tokens: runs[i] * block_size,
            indexed_cached_tokens: runs[i] * block_size,
            credited_tokens: 0,
            rule,
            reason,
            scores: lines,
        })
    }

    fn workers_changed(&self, workers: &[(WorkerId, &str)]) {
        let mut memory = self.memory.lock();
        let known: Vec<WorkerId> = workers.iter().map(|(w, _)| *w).collect();
        let stale: Vec<WorkerId> = {
            let mut all: Vec<WorkerId> = memory
                .map
                .values()
                .flat_map(|h| h.iter().map(|(w, _)| *w))
                .collect();
            all.sort();
            all.dedup();
            all.into_iter().filter(|w| !known.contains(w)).collect()
        };
        for w in stale {
            memory.forget_worker(w);
        }
    }
}
