//! Snapshots of one worker rank's holdings, as replicas hand them to each other: what
//! a router exports of a rank ([`PrefixIndex::export_worker`],
//! [`PrefixIndex::hole_paths`]) and how another router's index takes it in
//! ([`SnapshotImport`], [`PrefixIndex::import_some`]).
//!
//! Owns the snapshot's block type and the order an import places blocks in; must not
//! know how snapshots travel (the gateway's peer link) or about locks: a shared
//! index's writer prepares an import before it takes the lock and places it a slice
//! at a time, letting lookups in between (kvgate-events' `import_snapshot`): a rank of
//! a quarter of a million blocks takes about 0.1 s to prepare and 0.1 s to place
//! (docs/BENCHMARKS.md section 8).

use rustc_hash::FxHashMap;

use super::tree::{Pos, NO_NODE};
use super::PrefixIndex;
use crate::hashing::BlockKey;
use crate::ids::{Tier, WorkerRef};

/// One block a worker rank holds, as an index snapshot carries it: its key and parent
/// (to rebuild the entry) and the engine's hash (to apply the engine's later events).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldBlock {
    pub key: BlockKey,
    pub parent: Option<BlockKey>,
    pub engine_hash: u64,
    pub tier: Tier,
}

/// A rank's snapshot prepared for import: its keys in the order they are placed, each
/// after its parent (depth first from the sorted roots), worked out from the snapshot
/// alone, so that the index is only needed to place them ([`PrefixIndex::import_some`],
/// any number at a time).
#[derive(Debug)]
pub struct SnapshotImport<'a> {
    blocks: &'a [HeldBlock],
    hole_paths: &'a [Vec<BlockKey>],
    /// Indices into `blocks`, key by key in placement order (a key held at several
    /// tiers has several blocks).
    order: Vec<u32>,
    steps: Vec<Step>,
    /// Whether each step was placed (a step whose parent was not is skipped).
    placed: Vec<bool>,
    /// Steps done, and blocks of `order` they covered.
    next: usize,
    next_block: usize,
    /// Where the hole paths placed so far end: pruned at the end if no block stayed.
    path_ends: Vec<Pos>,
    held: usize,
    cleared: bool,
}

/// One key to place: its blocks end at `order[end]`, its parent is `parent`.
#[derive(Clone, Copy, Debug)]
struct Step {
    end: u32,
    parent: Parent,
}

/// No key: a key's parent outside the snapshot, a key not placed.
const NONE: u32 = u32::MAX;

#[derive(Clone, Copy, Debug)]
enum Parent {
    Root,
    /// The key of an earlier step, found by the engine hash it was held with (its
    /// position moves when nodes split).
    Held {
        step: u32,
        engine_hash: u64,
    },
    /// The end of `hole_paths[i]`: the rank does not hold the parent.
    Path(u32),
}

impl<'a> SnapshotImport<'a> {
    /// Prepares `blocks` (from [`PrefixIndex::export_worker`]) and `hole_paths` (from
    /// [`PrefixIndex::hole_paths`]) for import. A block whose parent is neither in the
    /// snapshot nor at the end of a hole path is left out, with what follows it.
    pub fn new(blocks: &'a [HeldBlock], hole_paths: &'a [Vec<BlockKey>]) -> Self {
        // The blocks grouped by key (a key held at several tiers has several), each
        // key numbered in key order: its group is `by_key[starts[g]..starts[g + 1]]`.
        // Working by number keeps to one hash table, looked up once per key: an import
        // is mostly cache misses (0.33-0.43 s for 250k blocks with a table per relation).
        let mut sorted: Vec<(BlockKey, u32)> = blocks
            .iter()
            .enumerate()
            .map(|(i, b)| (b.key, i as u32))
            .collect();
        sorted.sort_unstable();
        let mut number: FxHashMap<BlockKey, u32> = FxHashMap::default();
        let mut starts: Vec<u32> = Vec::new();
        for (at, &(key, _)) in sorted.iter().enumerate() {
            if at == 0 || sorted[at - 1].0 != key {
                number.insert(key, starts.len() as u32);
                starts.push(at as u32);
            }
        }
        starts.push(sorted.len() as u32);
        let by_key: Vec<u32> = sorted.into_iter().map(|(_, i)| i).collect();
        let keys = starts.len() - 1;
        let group = |g: u32| &by_key[starts[g as usize] as usize..starts[g as usize + 1] as usize];
        let first = |g: u32| &blocks[group(g)[0] as usize];
        // Each key's parent among the snapshot's keys, and each key's children (one
        // array, each key's run of it from `child_starts`).
        let parent_of: Vec<u32> = (0..keys as u32)
            .map(|g| {
                first(g)
                    .parent
                    .and_then(|p| number.get(&p).copied())
                    .unwrap_or(NONE)
            })
            .collect();
        let mut child_starts = vec![0u32; keys + 1];
        for &p in parent_of.iter().filter(|&&p| p != NONE) {
            child_starts[p as usize + 1] += 1;
        }
        for g in 0..keys {
            child_starts[g + 1] += child_starts[g];
        }
        let mut children = vec![0u32; child_starts[keys] as usize];
        let mut filled = child_starts.clone();
        for (g, &p) in parent_of.iter().enumerate().filter(|(_, &p)| p != NONE) {
            children[filled[p as usize] as usize] = g as u32;
            filled[p as usize] += 1;
        }
        let path_of: FxHashMap<BlockKey, u32> = hole_paths
            .iter()
            .enumerate()
            .filter_map(|(i, p)| Some((*p.last()?, i as u32)))
            .collect();
        // Depth first from the roots (keys whose parent is not in the snapshot).
        let mut step_of = vec![NONE; keys];
        let mut order = Vec::with_capacity(blocks.len());
        let mut steps = Vec::with_capacity(keys);
        let mut stack: Vec<u32> = (0..keys as u32)
            .filter(|&g| parent_of[g as usize] == NONE)
            .collect();
        while let Some(g) = stack.pop() {
            let parent = match (first(g).parent, parent_of[g as usize]) {
                (None, _) => Parent::Root,
                (Some(p), NONE) => match path_of.get(&p) {
                    Some(&i) => Parent::Path(i),
                    None => continue,
                },
                (Some(_), pg) => Parent::Held {
                    step: step_of[pg as usize],
                    engine_hash: first(pg).engine_hash,
                },
            };
            step_of[g as usize] = steps.len() as u32;
            order.extend_from_slice(group(g));
            steps.push(Step {
                end: order.len() as u32,
                parent,
            });
            let (from, to) = (child_starts[g as usize], child_starts[g as usize + 1]);
            stack.extend_from_slice(&children[from as usize..to as usize]);
        }
        let placed = vec![false; steps.len()];
        Self {
            blocks,
            hole_paths,
            order,
            steps,
            placed,
            next: 0,
            next_block: 0,
            path_ends: Vec::new(),
            held: 0,
            cleared: false,
        }
    }

    /// Blocks not placed yet.
    pub fn remaining(&self) -> usize {
        self.order.len() - self.next_block
    }

    /// Blocks the import has held so far.
    pub fn held(&self) -> usize {
        self.held
    }

    fn is_done(&self) -> bool {
        self.next == self.steps.len() && self.cleared
    }
}

impl PrefixIndex {
    /// Every block one worker rank holds, for an index snapshot another router loads
    /// ([`SnapshotImport`]): key, parent and engine hash per tier held, node by node.
    /// Not sorted: it is read under the index's lock, and the import orders the blocks
    /// itself (sorting a quarter of a million took two thirds of the export's time).
    pub fn export_worker(&self, at: WorkerRef) -> Vec<HeldBlock> {
        let Some(&slot) = self.slot_of.get(&at) else {
            return Vec::new();
        };
        let Some(state) = self.slot(slot) else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(state.entries);
        for id in self.nodes_holding(&state.engine_map) {
            let n = self.node(id);
            // The key before the node's first block: its parent node's last.
            let before = (n.parent != NO_NODE).then(|| {
                let p = self.node(n.parent);
                p.keys[p.len() - 1]
            });
            // A cover holds a prefix of its node: its i-th block is the node's i-th.
            for c in n.slot_covers(slot) {
                out.extend(
                    c.engine_hashes
                        .iter()
                        .enumerate()
                        .map(|(i, &engine_hash)| HeldBlock {
                            key: n.keys[i],
                            parent: i.checked_sub(1).map(|j| n.keys[j]).or(before),
                            engine_hash,
                            tier: c.tier,
                        }),
                );
            }
        }
        out
    }

    /// For each block of the rank whose parent the rank does not hold (a hole), the
    /// keys from the root to that parent: what an import needs to put the block where
    /// it belongs in an index that has never seen its ancestors. Empty unless the
    /// engine removed a parent before its child.
    pub fn hole_paths(&self, at: WorkerRef) -> Vec<Vec<BlockKey>> {
        let Some(&slot) = self.slot_of.get(&at) else {
            return Vec::new();
        };
        let Some(state) = self.slot(slot) else {
            return Vec::new();
        };
        // A cover holds a prefix of its node, so inside a node every held block's parent
        // is held too: only a node's first block can follow a hole.
        let mut parents: Vec<Pos> = Vec::new();
        for id in self.nodes_holding(&state.engine_map) {
            let first = Pos {
                node: id,
                abs: self.node(id).base,
            };
            if let Some(parent) = self.parent_pos(first) {
                let n = self.node(parent.node);
                if !n.slot_holds(slot, n.index(parent.abs)) {
                    parents.push(parent);
                }
            }
        }
        parents.sort_by_key(|p| (p.node, p.abs));
        parents.dedup();
        parents.into_iter().map(|p| self.path_to(p)).collect()
    }

    /// The keys from the root to `pos`, inclusive.
    fn path_to(&self, pos: Pos) -> Vec<BlockKey> {
        let mut segments: Vec<&[BlockKey]> = Vec::new();
        let n = self.node(pos.node);
        segments.push(&n.keys[..=n.index(pos.abs)]);
        let mut id = n.parent;
        while id != NO_NODE {
            let n = self.node(id);
            segments.push(&n.keys);
            id = n.parent;
        }
        segments
            .iter()
            .rev()
            .flat_map(|s| s.iter().copied())
            .collect()
    }

    /// Replaces what one worker rank holds with a snapshot of it (usually another
    /// router's), a part per call (`usize::MAX` blocks: all of it): the first call
    /// clears the rank's entries; each call then holds the next keys' blocks (at least
    /// one key, stopping once `max_blocks` blocks were placed) as if their `BlockStored`
    /// had been applied, so the engine's later events (removals by engine hash, stores
    /// naming a parent) apply as they would have. Returns true once every block is
    /// placed; the last call prunes hole paths no block stayed under and enforces the
    /// cap. Between calls the index is whole: the rank holds a prefix-closed part of its
    /// snapshot.
    pub fn import_some(
        &mut self,
        at: WorkerRef,
        import: &mut SnapshotImport<'_>,
        max_blocks: usize,
    ) -> bool {
        if import.is_done() {
            return true;
        }
        if !import.cleared {
            self.clear(at);
            import.cleared = true;
        }
        // Without a slot (more ranks than the index numbers) nothing can be placed.
        if let Some(slot) = self.slot_for(at) {
            let mut placed_blocks = 0;
            while import.next < import.steps.len() && placed_blocks < max_blocks.max(1) {
                placed_blocks += self.place_next(slot, import);
            }
            if import.next < import.steps.len() {
                return false;
            }
        }
        import.next = import.steps.len();
        // Path nodes no block was attached to go again.
        for end in std::mem::take(&mut import.path_ends) {
            if self.node(end.node).is_live() {
                self.prune(end.node);
            }
        }
        self.stats.stored_blocks += import.held as u64;
        self.enforce_cap();
        true
    }

    /// Holds the import's next key's blocks for `slot`, under its parent (skipped when
    /// the parent was not placed); returns how many blocks the key has.
    fn place_next(&mut self, slot: u16, import: &mut SnapshotImport<'_>) -> usize {
        let step = import.steps[import.next];
        let blocks = &import.order[import.next_block..step.end as usize];
        import.next_block = step.end as usize;
        let parent = match step.parent {
            Parent::Root => Some(None),
            Parent::Held { step, engine_hash } => import.placed[step as usize]
                .then(|| self.lookup(slot, engine_hash).map(Some))
                .flatten(),
            Parent::Path(i) => {
                let end = self.ensure_path(&import.hole_paths[i as usize]);
                import.path_ends.extend(end);
                end.map(Some)
            }
        };
        if let Some(parent) = parent {
            let key = import.blocks[blocks[0] as usize].key;
            let mut pos = self.ensure_child(parent, key, 0);
            for &i in blocks {
                let b = &import.blocks[i as usize];
                let (new, at_pos) = self.hold(slot, b.tier, pos, b.engine_hash, 0);
                pos = at_pos;
                import.held += usize::from(new);
            }
            import.placed[import.next] = true;
        }
        import.next += 1;
        blocks.len()
    }

    /// The position of the last key of `path` (from the root), creating the missing
    /// nodes; `None` for an empty path.
    fn ensure_path(&mut self, path: &[BlockKey]) -> Option<Pos> {
        let mut pos = None;
        for key in path {
            pos = Some(self.ensure_child(pos, *key, 0));
        }
        pos
    }
}
