//! The hot query: for a request's block keys, how many leading blocks each worker rank
//! holds, per tier. Owns the result types; must not mutate the index beyond setting
//! the "recently matched" hint used by eviction.

use serde::Serialize;
use smallvec::SmallVec;

use super::tree::NO_NODE;
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
    /// The slot holds every block so far (its run may go on into the next node).
    alive: bool,
    run: u32,
    host: u32,
    disk: u32,
}

impl PrefixIndex {
    /// For the request's block keys (from [`crate::BlockHasher::block_keys`], from the
    /// first block), the number of leading blocks each worker rank holds, per tier.
    /// Walks the tree along the keys: per node, one key comparison finds how far the
    /// request follows it (keys are chained, so equal keys at an offset mean equal
    /// prefixes), and each slot's covers say how many of those blocks it holds at which
    /// tier. Marks the matched nodes as recently used.
    pub fn overlaps(&self, keys: &[BlockKey]) -> OverlapScores {
        let mut scores = OverlapScores::default();
        let Some(mut id) = keys
            .first()
            .and_then(|k| self.starts.get(k))
            .copied()
            .filter(|&id| self.node(id).parent == NO_NODE)
        else {
            return scores;
        };
        let mut accs: SmallVec<[Acc; 16]> = SmallVec::new();
        let mut pos = 0usize;
        let mut first = true;
        loop {
            let n = self.node(id);
            let len = n.len();
            let window = len.min(keys.len() - pos);
            let matched = if n.keys[window - 1] == keys[pos + window - 1] {
                window
            } else {
                // keys[pos] matched (it found this node); the last did not.
                let (mut lo, mut hi) = (1usize, window);
                while hi - lo > 1 {
                    let mid = lo + (hi - lo) / 2;
                    if n.keys[mid - 1] == keys[pos + mid - 1] {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                lo
            };
            n.touch();
            let mut any_alive = false;
            // Covers are sorted by slot, and so are the accumulators (made from the
            // first node's covers): one merge pass pairs them.
            let mut a = 0;
            let mut c = 0;
            while c < n.covers.len() {
                let slot = n.covers[c].slot;
                let mut on = [0usize; 3];
                while c < n.covers.len() && n.covers[c].slot == slot {
                    on[n.covers[c].tier.index()] = n.covers[c].len();
                    c += 1;
                }
                let acc = if first {
                    accs.push(Acc {
                        slot,
                        alive: true,
                        run: 0,
                        host: 0,
                        disk: 0,
                    });
                    accs.last_mut()
                } else {
                    // Accumulators this node has no cover for end their run here.
                    while a < accs.len() && accs[a].slot < slot {
                        accs[a].alive = false;
                        a += 1;
                    }
                    match accs.get_mut(a) {
                        Some(acc) if acc.slot == slot && acc.alive => {
                            a += 1;
                            Some(acc)
                        }
                        _ => None,
                    }
                };
                let Some(acc) = acc else {
                    continue;
                };
                let [device, host, disk] = on;
                let held = device.max(host).max(disk).min(matched);
                let on_device = device.min(held);
                let on_host = host.min(held).max(on_device) - on_device;
                acc.run += held as u32;
                acc.host += on_host as u32;
                acc.disk += (held - on_device - on_host) as u32;
                if held == len {
                    any_alive = true;
                } else {
                    acc.alive = false;
                }
            }
            if !first {
                for acc in &mut accs[a..] {
                    acc.alive = false;
                }
            }
            first = false;
            pos += len;
            if !any_alive || matched < len || pos >= keys.len() {
                break;
            }
            match self.child_of(id, keys[pos]) {
                Some(next) => id = next,
                None => break,
            }
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
