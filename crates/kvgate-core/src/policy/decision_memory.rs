//! Memory of a policy's own routing decisions: which worker got which block keys, and
//! when. Owns only that memory, bounded by a TTL and a cap on entries; it knows nothing
//! about load or engines. prefix_affinity routes on it alone (kv_aware credits prompts in
//! prefill from the ledger instead, where the credit ends with its request).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use crate::hashing::BlockKey;
use crate::ids::WorkerId;

#[derive(Debug, Default)]
pub(crate) struct DecisionMemory {
    pub(crate) map: FxHashMap<BlockKey, SmallVec<[(WorkerId, Instant); 2]>>,
    queue: VecDeque<(BlockKey, WorkerId, Instant)>,
    pub(crate) entries: usize,
}

impl DecisionMemory {
    /// Leading remembered blocks per candidate (same order as `candidates`).
    pub(crate) fn runs(
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

    pub(crate) fn record<'k>(
        &mut self,
        keys: impl IntoIterator<Item = &'k BlockKey>,
        worker: WorkerId,
        now: Instant,
    ) {
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

    pub(crate) fn forget(&mut self, key: BlockKey, worker: WorkerId, stamp: Option<Instant>) {
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
    pub(crate) fn trim(&mut self, now: Instant, ttl: Duration, cap: usize) {
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

    pub(crate) fn forget_worker(&mut self, worker: WorkerId) {
        let keys: Vec<BlockKey> = self.map.keys().copied().collect();
        for key in keys {
            self.forget(key, worker, None);
        }
    }
}
