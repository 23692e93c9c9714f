//! The hot query: for a request's block keys, how many leading blocks each worker rank
//! holds, per tier. Owns the result types; must not mutate the index beyond setting
//! the "recently matched" hint used by eviction.

use std::sync::atomic::Ordering;

use serde::Serialize;
use smallvec::SmallVec;

use super::slot_set::for_each_bit;
use super::PrefixIndex;
use crate::hashing::BlockKey;
use crate::ids::{Tier, WorkerId, WorkerRef};

/// Leading blocks of a request one worker rank holds, split by tier: the run stops at
/// the first block the rank does not hold at any tier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Overlap {
    pub at: WorkerRef,
    /// Blocks of the run on each tier, indexed by [`Tier::index`].
    pub blocks: [u32; 3],
}

impl Overlap {
    /// Length of the matched run.
    pub fn total(&self) -> u32 {
        self.blocks.iter().sum()
    }

    pub fn on(&self, tier: Tier) -> u32 {
        self.blocks[tier.index()]
    }
}

/// Overlap of one request with every worker rank that holds at least its first block.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct OverlapScores {
    pub per_ref: Vec<Overlap>,
    /// Longest run of any rank.
    pub longest: u32,
}

impl OverlapScores {
    /// The best rank of `worker` (longest run, then most device blocks).
    pub fn best_for(&self, worker: WorkerId) -> Option<Overlap> {
        self.per_ref
            .iter()
            .filter(|o| o.at.worker == worker)
            .max_by_key(|o| (o.total(), o.on(Tier::Device)))
            .copied()
    }
}

#[derive(Clone, Copy)]
struct Acc {
    slot: u16,
    run: u32,
    host: u32,
    disk: u32,
}

impl PrefixIndex {
    /// For the request's block keys (from [`crate::BlockHasher::block_keys`]), the number
    /// of leading blocks each worker rank holds, per tier. Cost: one hash lookup per
    /// matched block plus a few word operations; it stops at the first block nobody
    /// still in the run holds.
    pub fn overlaps(&self, keys: &[BlockKey]) -> OverlapScores {
        let mut scores = OverlapScores::default();
        let Some(first) = keys.first().and_then(|k| self.entry(k)) else {
            return scores;
        };
        let mut alive: SmallVec<[u64; 2]> = SmallVec::from_slice(first.any.words());
        let mut accs: SmallVec<[Acc; 16]> = SmallVec::new();
        // slot → position in `accs`.
        let mut pos: SmallVec<[u16; 64]> = SmallVec::from_elem(u16::MAX, self.slots.len());
        for (w, word) in alive.iter().enumerate() {
            for_each_bit(w, *word, |slot| {
                if let Some(p) = pos.get_mut(slot as usize) {
                    *p = accs.len() as u16;
                }
                accs.push(Acc {
                    slot,
                    run: 0,
                    host: 0,
                    disk: 0,
                });
            });
        }
        let mut depth: u32 = 0;
        for (i, key) in keys.iter().enumerate() {
            let entry = if i == 0 {
                first
            } else {
                match self.entry(key) {
                    Some(e) => e,
                    None => break,
                }
            };
            let any = entry.any.words();
            let device = entry.device.words();
            let mut still_alive = false;
            for (w, alive_word) in alive.iter_mut().enumerate() {
                if *alive_word == 0 {
                    continue;
                }
                let held = any.get(w).copied().unwrap_or(0);
                let dropped = *alive_word & !held;
                if dropped != 0 {
                    for_each_bit(w, dropped, |slot| {
                        if let Some(acc) = pos
                            .get(slot as usize)
                            .and_then(|p| accs.get_mut(*p as usize))
                        {
                            acc.run = depth;
                        }
                    });
                }
                *alive_word &= held;
                if *alive_word == 0 {
                    continue;
                }
                still_alive = true;
                let lower = *alive_word & !device.get(w).copied().unwrap_or(0);
                if lower != 0 {
                    for_each_bit(w, lower, |slot| {
                        let best = entry
                            .holders
                            .iter()
                            .filter(|h| h.slot == slot)
                            .map(|h| h.tier)
                            .min()
                            .unwrap_or(Tier::Disk);
                        if let Some(acc) = pos
                            .get(slot as usize)
                            .and_then(|p| accs.get_mut(*p as usize))
                        {
                            match best {
                                Tier::Host => acc.host += 1,
                                _ => acc.disk += 1,
                            }
                        }
                    });
                }
            }
            if !still_alive {
                break;
            }
            if !entry.hot.load(Ordering::Relaxed) {
                entry.hot.store(true, Ordering::Relaxed);
            }
            depth += 1;
        }
        for (w, word) in alive.iter().enumerate() {
            for_each_bit(w, *word, |slot| {
                if let Some(acc) = pos
                    .get(slot as usize)
                    .and_then(|p| accs.get_mut(*p as usize))
                {
                    acc.run = depth;
                }
            });
        }
        scores.per_ref.reserve(accs.len());
        for acc in accs {
            if acc.run == 0 {
                continue;
            }
            let Some(at) = self.slot_ref(acc.slot) else {
                continue;
            };
            scores.longest = scores.longest.max(acc.run);
            scores.per_ref.push(Overlap {
                at,
                blocks: [acc.run - acc.host - acc.disk, acc.host, acc.disk],
            });
        }
        scores
    }
}
