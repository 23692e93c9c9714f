//! The hot query: for a request's block keys, how many leading blocks each worker rank
//! holds, per tier. Owns the result types; must not mutate the index beyond setting
//! the "recently matched" hint used by eviction.

use serde::Serialize;
use smallvec::SmallVec;

use super::slot_bits::for_each_bit;
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

/// A node of the shared binary search: every slot of `set` (bits of one word) holds
/// the request's block `lo` and none holds block `hi` (`hi == len`: past the end).
#[derive(Clone, Copy)]
struct Node {
    lo: u32,
    hi: u32,
    set: u64,
}

impl PrefixIndex {
    /// For the request's block keys (from [`crate::BlockHasher::block_keys`], or any
    /// contiguous window of such a chain), the number of leading blocks each worker
    /// rank holds, per tier. Ranks that hold closed prefix sets on the device tier
    /// (the normal case, see the module doc) are answered by one binary search shared
    /// by all of them: about `log2(keys)` hash lookups per distinct run length. Other
    /// ranks are answered by a walk that stops at the first block none of them holds.
    pub fn overlaps(&self, keys: &[BlockKey]) -> OverlapScores {
        let mut scores = OverlapScores::default();
        let Some(first) = keys.first().and_then(|k| self.entry(k)) else {
            return scores;
        };
        first.touch();
        let mut accs: SmallVec<[Acc; 16]> = SmallVec::new();
        let mut walk: SmallVec<[u64; 2]> = SmallVec::new();
        for w in 0..first.words() {
            let word = first.any_word(w);
            let mut search = 0u64;
            for_each_bit(w, word, |slot| {
                if self.slot(slot).is_some_and(|s| s.searchable()) {
                    search |= 1 << (slot % 64);
                }
            });
            walk.push(word & !search);
            if search != 0 {
                self.search_runs(keys, w, search, &mut accs);
            }
        }
        if walk.iter().any(|w| *w != 0) {
            self.walk_runs(keys, walk, &mut accs);
        }
        accs.sort_unstable_by_key(|a| a.slot);
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

    /// Run lengths of the slots in `set` (word `w`), which hold closed prefix sets on
    /// the device tier only, by a binary search shared by all of them. The search goes
    /// level by level so the lookups of one level are independent (the CPU overlaps
    /// their cache misses). Marks the probed blocks that matched as recently used; the
    /// last block of every run is among them.
    fn search_runs(&self, keys: &[BlockKey], w: usize, set: u64, accs: &mut SmallVec<[Acc; 16]>) {
        let len = keys.len() as u32;
        let mut level: SmallVec<[Node; 16]> = SmallVec::new();
        let mut next: SmallVec<[Node; 16]> = SmallVec::new();
        level.push(Node {
            lo: 0,
            hi: len,
            set,
        });
        while !level.is_empty() {
            for node in level.drain(..) {
                if node.hi - node.lo <= 1 {
                    for_each_bit(w, node.set, |slot| {
                        accs.push(Acc {
                            slot,
                            run: node.lo + 1,
                            host: 0,
                            disk: 0,
                        })
                    });
                    continue;
                }
                let mid = node.lo + (node.hi - node.lo) / 2;
                let held = match self.entry(&keys[mid as usize]) {
                    Some(e) => {
                        let held = e.any_word(w) & node.set;
                        if held != 0 {
                            e.touch();
                        }
                        held
                    }
                    None => 0,
                };
                if held != 0 {
                    next.push(Node {
                        lo: mid,
                        hi: node.hi,
                        set: held,
                    });
                }
                if node.set & !held != 0 {
                    next.push(Node {
                        lo: node.lo,
                        hi: mid,
                        set: node.set & !held,
                    });
                }
            }
            std::mem::swap(&mut level, &mut next);
        }
    }

    /// Exact per-tier runs of the slots in `alive` (which all hold the first block):
    /// walks the keys until none of them holds a block, marking matched blocks as
    /// recently used.
    fn walk_runs(
        &self,
        keys: &[BlockKey],
        mut alive: SmallVec<[u64; 2]>,
        out: &mut SmallVec<[Acc; 16]>,
    ) {
        let base = out.len();
        // slot → position in `out`.
        let mut pos: SmallVec<[u16; 64]> = SmallVec::from_elem(u16::MAX, self.slots.len());
        for (w, word) in alive.iter().enumerate() {
            for_each_bit(w, *word, |slot| {
                if let Some(p) = pos.get_mut(slot as usize) {
                    *p = (out.len() - base) as u16;
                }
                out.push(Acc {
                    slot,
                    run: 0,
                    host: 0,
                    disk: 0,
                });
            });
        }
        let accs = &mut out[base..];
        let mut depth: u32 = 0;
        for key in keys {
            let Some(entry) = self.entry(key) else {
                break;
            };
            let mut still_alive = false;
            for (w, alive_word) in alive.iter_mut().enumerate() {
                if *alive_word == 0 {
                    continue;
                }
                let held = entry.any_word(w);
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
                let lower = *alive_word & !entry.device_word(w);
                if lower != 0 {
                    for_each_bit(w, lower, |slot| {
                        let best = entry
                            .holders()
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
            entry.touch();
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
    }
}
