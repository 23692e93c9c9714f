//! The hot query: for a request's block keys, how many leading blocks each worker rank
//! holds, per tier. Owns the result types; must not mutate the index beyond setting
//! the "recently matched" hint used by eviction.

use serde::Serialize;
use smallvec::SmallVec;

use super::tree::{Cover, NO_NODE};
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

/// One slot's run so far.
#[derive(Clone, Copy)]
struct Acc {
    slot: u16,
    /// The slot holds every block so far (its run may go on into the next node).
    alive: bool,
    run: u32,
    host: u32,
    disk: u32,
}

/// Of a node's first `matched` blocks, how many one slot's covers (its group of `covers`,
/// one per tier) hold in a row, and how many of those only on host and only on disk.
#[inline]
fn held(group: &[Cover], matched: usize) -> (usize, usize, usize) {
    let (mut device, mut host, mut disk) = (0, 0, 0);
    for c in group {
        match c.tier {
            Tier::Device => device = c.len(),
            Tier::Host => host = c.len(),
            Tier::Disk => disk = c.len(),
        }
    }
    let held = device.max(host).max(disk).min(matched);
    let on_device = device.min(held);
    let on_host = host.min(held).max(on_device) - on_device;
    (held, on_host, held - on_device - on_host)
}

/// The covers of one node, a group per slot (they are sorted by slot).
#[inline]
fn by_slot(covers: &[Cover]) -> impl Iterator<Item = &[Cover]> {
    covers.chunk_by(|a, b| a.slot == b.slot)
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
        // The first node's slots are the only ones that can have a run: one
        // accumulator each, in slot order like every node's covers.
        let mut accs: SmallVec<[Acc; 16]> = SmallVec::new();
        let mut pos = 0usize;
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
            let covers: &[Cover] = &n.covers;
            let any_alive = if pos == 0 {
                accs.reserve_exact(covers.len());
                for group in by_slot(covers) {
                    let (held, host, disk) = held(group, matched);
                    accs.push(Acc {
                        slot: group[0].slot,
                        alive: held == len,
                        run: held as u32,
                        host: host as u32,
                        disk: disk as u32,
                    });
                }
                accs.iter().any(|acc| acc.alive)
            } else {
                extend_runs(&mut accs, covers, matched, len)
            };
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

/// Extends the runs still alive in `accs` by what each slot holds of a later node's first
/// `matched` blocks (of `len`); ends those that do not hold all of it. Returns whether
/// any run is still alive. Covers and accumulators are both sorted by slot: one merge.
fn extend_runs(accs: &mut [Acc], covers: &[Cover], matched: usize, len: usize) -> bool {
    let mut any_alive = false;
    let mut groups = by_slot(covers).peekable();
    for acc in accs.iter_mut().filter(|acc| acc.alive) {
        while groups.next_if(|g| g[0].slot < acc.slot).is_some() {}
        let Some(group) = groups.next_if(|g| g[0].slot == acc.slot) else {
            acc.alive = false;
            continue;
        };
        let (held, host, disk) = held(group, matched);
        acc.run += held as u32;
        acc.host += host as u32;
        acc.disk += disk as u32;
        acc.alive = held == len;
        any_alive |= acc.alive;
    }
    any_alive
}
