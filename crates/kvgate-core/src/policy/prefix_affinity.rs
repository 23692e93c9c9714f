//! prefix_affinity: approximate prefix routing without engine events.
//!
//! Owns a memory of its own decisions: for each block key it routed, which worker got
//! it and when. A request goes to the candidate that got the longest matching prefix,
//! unless load is imbalanced beyond thresholds (then the least loaded candidate wins),
//! or nothing matches (least loaded again). Memory is bounded: entries expire after a
//! TTL and the oldest are dropped beyond a cap. Like SGLang's cache_aware router but on
//! token blocks instead of text, so it sees exactly the prefixes the engine caches.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use super::scoring::{argmin_random_tie, load_lines, rng};
use super::{
    Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError, WorkerScore,
    DEFAULT_AFFINITY_TTL,
};
use crate::hashing::BlockKey;
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

#[derive(Debug, Default)]
struct Memory {
    map: FxHashMap<BlockKey, SmallVec<[(WorkerId, Instant); 2]>>,
    queue: VecDeque<(BlockKey, WorkerId, Instant)>,
    entries: usize,
}

impl Memory {
    /// Leading remembered blocks per candidate (same order as `candidates`).
    fn runs(
        &self,
        keys: &[BlockKey],
        candidates: &[WorkerId],
        now: Instant,
        ttl: Duration,
    ) -> Vec<u32> {
        let mut runs = vec![0u32; candidates.len()];
        let mut alive: Vec<bool> = vec![true; candidates.len()];
        for key in keys {
            let Some(holders) = self.map.get(key) else {
                break;
            };
            let mut any = false;
            for (i, w) in candidates.iter().enumerate() {
                if !alive[i] {
                    continue;
                }
                let fresh = holders
                    .iter()
                    .any(|(h, t)| h == w && now.saturating_duration_since(*t) <= ttl);
                if fresh {
                    runs[i] += 1;
                    any = true;
                } else {
                    alive[i] = false;
                }
            }
            if !any {
                break;
            }
        }
        runs
    }

    fn record(&mut self, keys: &[BlockKey], worker: WorkerId, now: Instant) {
        for key in keys {
            let holders = self.map.entry(*key).or_default();
            match holders.iter_mut().find(|(w, _)| *w == worker) {
                Some(h) => h.1 = now,
                None => {
                    holders.push((worker, now));
                    self.entries += 1;
                }
            }
            self.queue.push_back((*key, worker, now));
        }
    }

    fn forget(&mut self, key: BlockKey, worker: WorkerId, stamp: Option<Instant>) {
        if let Some(holders) = self.map.get_mut(&key) {
            let before = holders.len();
            holders.retain(|(w, t)| !(*w == worker && stamp.is_none_or(|s| *t == s)));
            self.entries -= before - holders.len();
            if holders.is_empty() {
                self.map.remove(&key);
            }
        }
    }

    /// Drops expired entries and the oldest beyond `cap`, then compacts the queue once
    /// stale items (superseded by a later record of the same block and worker)
    /// outnumber live entries, so neither structure only grows.
    fn trim(&mut self, now: Instant, ttl: Duration, cap: usize) {
        while let Some(&(key, worker, t)) = self.queue.front() {
            let expired = now.saturating_duration_since(t) > ttl;
            if !expired && self.entries <= cap {
                break;
            }
            self.queue.pop_front();
            // A no-op for a stale item: only the current stamp removes the entry.
            self.forget(key, worker, Some(t));
        }
        if self.queue.len() > 2 * self.entries + 1024 {
            let map = &self.map;
            self.queue.retain(|(k, w, t)| {
                map.get(k)
                    .is_some_and(|h| h.iter().any(|(hw, ht)| hw == w && ht == t))
            });
        }
    }

    fn forget_worker(&mut self, worker: WorkerId) {
        let keys: Vec<BlockKey> = self.map.keys().copied().collect();
        for key in keys {
            self.forget(key, worker, None);
        }
    }
}

#[derive(Debug)]
pub struct PrefixAffinityPolicy {
    config: PrefixAffinityConfig,
    memory: Mutex<Memory>,
    rng: Mutex<SmallRng>,
}

impl PrefixAffinityPolicy {
    pub fn new(config: PrefixAffinityConfig, seed: Option<u64>) -> Self {
        Self {
            config,
            memory: Mutex::new(Memory::default()),
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
        max - min > self.config.balance_abs_threshold
            && f64::from(max) > self.config.balance_rel_threshold * f64::from(min)
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
        let mut lines = load_lines(view);
        let Some(keys) = req.block_keys else {
            let i = self.least_in_flight(&lines, None);
            return Ok(Decision {
                worker: view.candidates[i],
                policy: PolicyKind::PrefixAffinity,
                predicted_cached_tokens: 0,
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
        let (i, reason) = if self.imbalanced(&lines) {
            (
                self.least_in_flight(&lines, None),
                "load imbalanced: least loaded",
            )
        } else if best > 0 && ratio >= self.config.min_match_ratio {
            let mask: Vec<bool> = runs.iter().map(|r| *r == best).collect();
            (
                self.least_in_flight(&lines, Some(&mask)),
                "longest remembered prefix",
            )
        } else {
            (
                self.least_in_flight(&lines, None),
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
