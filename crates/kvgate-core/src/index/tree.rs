//! The prefix index's storage: a radix tree of *runs* of chained block keys, each run
//! (a [`Node`]) carrying, per (worker slot, tier), how many of its leading blocks that
//! slot holds and the engine's hash of each (a [`Cover`]).
//!
//! Owns the shape of the tree and its invariants; must not know about events, caps or
//! queries (`mod.rs`, `evict.rs` and `query.rs` use these operations):
//! - every key has at most one position; a node's first key is in `starts`, and a
//!   node's parent is the node whose last key is the parent of the node's first key;
//! - a cover holds a *prefix* of its node: blocks `0..len`. A slot holding blocks of a
//!   node that are not a prefix (a hole: the engine removed a parent first) is
//!   represented by splitting the node where its coverage starts or stops, so the
//!   general case costs nodes, not a different representation;
//! - a node with no covers and no children does not exist (it is pruned), and a leaf's
//!   keys past its longest cover are trimmed.
//!
//! A block's position ([`Pos`]) is its node and an *absolute* offset: the node's
//! `base` plus its index in the node. Splitting a node moves the smaller side to a new
//! node and keeps every absolute offset, so only the moved blocks' engine-hash entries
//! are re-pointed (a root-first removal of a long run costs O(1) map updates per block).

use std::sync::atomic::{AtomicBool, Ordering};

use rustc_hash::FxHashMap;
use smallvec::SmallVec;

use super::{PrefixIndex, QueueItem};
use crate::hashing::BlockKey;
use crate::ids::Tier;

pub(super) const NO_NODE: u32 = u32::MAX;

/// Children past this many are found through `starts` instead of a scan.
const SCAN_CHILDREN: usize = 8;

/// Appends to a run's storage; when it is full and `rest` more items (this one
/// included) are known to follow, grows it to exactly that, so runs stored in one
/// event carry no growth slack (doubling would leave a third of it empty on average).
#[inline]
pub(super) fn push_sized<T>(v: &mut Vec<T>, item: T, rest: usize) {
    if v.len() == v.capacity() && rest > 1 {
        v.reserve_exact(rest);
    }
    v.push(item);
}

/// Gives back a run's storage once trimming left it less than half used, so a run
/// that grew long and was trimmed back (eviction takes tips) holds what it holds, not
/// its peak. It keeps a quarter of room, so a run whose tip comes and goes is not
/// reallocated each time.
#[inline]
pub(super) fn shrink_trimmed<T>(v: &mut Vec<T>) {
    if v.capacity() > 2 * v.len() + 8 {
        v.shrink_to(v.len() + v.len() / 4 + 8);
    }
}

/// Where one block is: its node and absolute offset (`base + index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Pos {
    pub node: u32,
    pub abs: u32,
}

/// The leading blocks of a node one (slot, tier) holds, with the engine's hash of each.
#[derive(Debug)]
pub(super) struct Cover {
    pub engine_hashes: Vec<u64>,
    /// When the cover was last stored into (eviction order).
    pub stamp: u32,
    pub slot: u16,
    pub tier: Tier,
}

impl Cover {
    #[inline]
    pub fn len(&self) -> usize {
        self.engine_hashes.len()
    }
}

/// A run of chained keys: `keys[0]`'s parent is the parent node's last key.
#[derive(Debug, Default)]
pub(super) struct Node {
    pub keys: Vec<BlockKey>,
    pub base: u32,
    pub parent: u32,
    /// Where this node is in its parent's `children` (so pruning it is O(1) however
    /// many runs share the parent: a system prompt with thousands of conversations).
    pub at_parent: u32,
    pub children: SmallVec<[u32; 2]>,
    /// Sorted by (slot, tier).
    pub covers: SmallVec<[Cover; 1]>,
    /// Set by lookups that matched the node; gives its covers a second chance at
    /// eviction.
    pub hot: AtomicBool,
}

impl Node {
    #[inline]
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    #[inline]
    pub fn is_live(&self) -> bool {
        !self.keys.is_empty()
    }

    #[inline]
    pub fn index(&self, abs: u32) -> usize {
        (abs - self.base) as usize
    }

    #[inline]
    pub fn cover(&self, slot: u16, tier: Tier) -> Option<&Cover> {
        self.slot_covers(slot).iter().find(|c| c.tier == tier)
    }

    #[inline]
    pub fn cover_mut(&mut self, slot: u16, tier: Tier) -> Option<&mut Cover> {
        let range = self.slot_range(slot);
        self.covers[range].iter_mut().find(|c| c.tier == tier)
    }

    /// Where `slot`'s covers are in `covers` (sorted by slot: a binary search, so a
    /// node many slots share costs a few comparisons, not one per slot).
    #[inline]
    pub fn slot_range(&self, slot: u16) -> std::ops::Range<usize> {
        let start = self.covers.partition_point(|c| c.slot < slot);
        let len = self.covers[start..]
            .iter()
            .take_while(|c| c.slot == slot)
            .count();
        start..start + len
    }

    /// `slot`'s covers (one per tier it holds the node's first block on).
    #[inline]
    pub fn slot_covers(&self, slot: u16) -> &[Cover] {
        &self.covers[self.slot_range(slot)]
    }

    /// Inserts a cover keeping the (slot, tier) order.
    pub fn add_cover(&mut self, cover: Cover) {
        let at = self
            .covers
            .iter()
            .position(|c| (c.slot, c.tier) > (cover.slot, cover.tier))
            .unwrap_or(self.covers.len());
        self.covers.insert(at, cover);
    }

    /// Whether `slot` holds block `i` of this node at some tier.
    #[inline]
    pub fn slot_holds(&self, slot: u16, i: usize) -> bool {
        self.slot_covers(slot).iter().any(|c| c.len() > i)
    }

    /// Whether `slot` holds the first block of the node at some tier.
    #[inline]
    pub fn slot_present(&self, slot: u16) -> bool {
        !self.slot_range(slot).is_empty()
    }

    pub fn touch(&self) {
        if !self.hot.load(Ordering::Relaxed) {
            self.hot.store(true, Ordering::Relaxed);
        }
    }

    pub fn take_hot(&self) -> bool {
        self.hot.swap(false, Ordering::Relaxed)
    }
}

impl PrefixIndex {
    #[inline]
    pub(super) fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    #[inline]
    pub(super) fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    #[inline]
    pub(super) fn key_at(&self, p: Pos) -> BlockKey {
        let n = self.node(p.node);
        n.keys[n.index(p.abs)]
    }

    /// The position of the block before `pos`, if `pos` is not a root block.
    pub(super) fn parent_pos(&self, pos: Pos) -> Option<Pos> {
        let n = self.node(pos.node);
        if n.index(pos.abs) > 0 {
            return Some(Pos {
                node: pos.node,
                abs: pos.abs - 1,
            });
        }
        (n.parent != NO_NODE).then(|| {
            let p = self.node(n.parent);
            Pos {
                node: n.parent,
                abs: p.base + p.len() as u32 - 1,
            }
        })
    }

    /// The child node of `parent` whose first key is `key`.
    #[inline]
    pub(super) fn child_of(&self, parent: u32, key: BlockKey) -> Option<u32> {
        let children = &self.node(parent).children;
        if children.len() <= SCAN_CHILDREN {
            children
                .iter()
                .copied()
                .find(|&c| self.node(c).keys[0] == key)
        } else {
            self.starts
                .get(&key)
                .copied()
                .filter(|&c| self.node(c).parent == parent)
        }
    }

    /// The position of block `key` whose parent block is at `parent` (`None`: a root
    /// block), if the tree has it.
    #[inline]
    pub(super) fn find_child(&self, parent: Option<Pos>, key: BlockKey) -> Option<Pos> {
        match parent {
            None => self
                .starts
                .get(&key)
                .copied()
                .filter(|&c| self.node(c).parent == NO_NODE)
                .map(|c| Pos {
                    node: c,
                    abs: self.node(c).base,
                }),
            Some(p) => {
                let n = self.node(p.node);
                let i = n.index(p.abs) + 1;
                if i < n.len() {
                    return (n.keys[i] == key).then_some(Pos {
                        node: p.node,
                        abs: p.abs + 1,
                    });
                }
                self.child_of(p.node, key).map(|c| Pos {
                    node: c,
                    abs: self.node(c).base,
                })
            }
        }
    }

    /// The position of block `key` under `parent`, created when the tree lacks it: the
    /// parent's run is extended when the parent ends a leaf run, otherwise a new run
    /// starts (splitting the parent's run first when the parent is inside it). `rest`:
    /// keys of the run still to come, this one included (see [`push_sized`]).
    pub(super) fn ensure_child(&mut self, parent: Option<Pos>, key: BlockKey, rest: usize) -> Pos {
        if let Some(p) = self.find_child(parent, key) {
            return p;
        }
        let Some(p) = parent else {
            let id = self.new_node(key, NO_NODE);
            return Pos { node: id, abs: 0 };
        };
        let mut owner = p.node;
        let i = self.node(owner).index(p.abs);
        if i + 1 < self.node(owner).len() {
            owner = self.split(owner, i + 1).0;
        }
        let n = self.node(owner);
        if n.children.is_empty() && (n.base as usize + n.len()) < u32::MAX as usize {
            let abs = n.base + n.len() as u32;
            push_sized(&mut self.node_mut(owner).keys, key, rest);
            return Pos { node: owner, abs };
        }
        let id = self.new_node(key, owner);
        self.adopt(owner, id);
        Pos { node: id, abs: 0 }
    }

    fn new_node(&mut self, key: BlockKey, parent: u32) -> u32 {
        let node = Node {
            keys: vec![key],
            base: 0,
            parent,
            at_parent: 0,
            children: SmallVec::new(),
            covers: SmallVec::new(),
            hot: AtomicBool::new(false),
        };
        let id = self.alloc_node(node);
        self.insert_start(key, id);
        id
    }

    /// Appends `child` to `parent`'s children.
    fn adopt(&mut self, parent: u32, child: u32) {
        let at = self.node(parent).children.len() as u32;
        self.node_mut(parent).children.push(child);
        self.node_mut(child).at_parent = at;
    }

    /// Puts a node in a free slot of the slab (or a new one); returns its id.
    fn alloc_node(&mut self, node: Node) -> u32 {
        match self.free_nodes.pop() {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn insert_start(&mut self, key: BlockKey, id: u32) {
        if self
            .starts_size
            .must_rebuild(self.starts.len(), self.starts.capacity())
            && !self.starts.contains_key(&key)
        {
            let mut fresh =
                FxHashMap::with_capacity_and_hasher(self.starts_size.full(), Default::default());
            fresh.extend(std::mem::take(&mut self.starts));
            self.starts = fresh;
        }
        self.starts.insert(key, id);
    }

    /// Splits node `id` before index `at` (0 < at < len) into a head (blocks `..at`)
    /// and a tail (`at..`), moving the smaller side to a new node. Returns (head, tail).
    pub(super) fn split(&mut self, id: u32, at: usize) -> (u32, u32) {
        let len = self.node(id).len();
        debug_assert!(at > 0 && at < len);
        let move_head = at < len - at;
        let n = self.node_mut(id);
        let base = n.base;
        let hot = n.hot.load(Ordering::Relaxed);
        let mut covers = 0;
        // The moved side's keys and covers.
        let mut moved = Node {
            hot: AtomicBool::new(hot),
            ..Node::default()
        };
        if move_head {
            moved.keys = n.keys.drain(..at).collect();
            moved.base = base;
            n.base = base + at as u32;
            let mut kept: SmallVec<[Cover; 1]> = SmallVec::new();
            for mut c in std::mem::take(&mut n.covers) {
                if c.len() > at {
                    covers += 1;
                    let head: Vec<u64> = c.engine_hashes.drain(..at).collect();
                    moved.covers.push(Cover {
                        engine_hashes: head,
                        stamp: c.stamp,
                        slot: c.slot,
                        tier: c.tier,
                    });
                    kept.push(c);
                } else {
                    moved.covers.push(c);
                }
            }
            n.covers = kept;
            moved.parent = n.parent;
        } else {
            moved.keys = n.keys.split_off(at);
            moved.base = base + at as u32;
            let mut taken: SmallVec<[Cover; 1]> = SmallVec::new();
            for c in n.covers.iter_mut() {
                if c.len() > at {
                    covers += 1;
                    taken.push(Cover {
                        engine_hashes: c.engine_hashes.split_off(at),
                        stamp: c.stamp,
                        slot: c.slot,
                        tier: c.tier,
                    });
                }
            }
            moved.covers = taken;
            moved.children = std::mem::take(&mut n.children);
            moved.parent = id;
        }
        let first = moved.keys[0];
        self.covers += covers;
        let new_id = self.alloc_node(moved);
        // Links.
        if move_head {
            let parent = self.node(new_id).parent;
            let at = self.node(id).at_parent;
            if parent != NO_NODE {
                self.node_mut(parent).children[at as usize] = new_id;
            }
            self.node_mut(new_id).at_parent = at;
            self.adopt(new_id, id);
            self.node_mut(id).parent = new_id;
            // `id` now starts later; the head took its first key.
            let tail_first = self.node(id).keys[0];
            self.starts.insert(first, new_id);
            self.insert_start(tail_first, id);
        } else {
            self.adopt(id, new_id);
            let children = self.node(new_id).children.clone();
            for c in children {
                self.node_mut(c).parent = new_id;
            }
            self.insert_start(first, new_id);
        }
        // The moved blocks' engine-hash entries name the new node.
        let moved_covers: SmallVec<[(u16, Tier, u32); 4]> = self
            .node(new_id)
            .covers
            .iter()
            .map(|c| (c.slot, c.tier, c.stamp))
            .collect();
        let moved_base = self.node(new_id).base;
        for ci in 0..self.node(new_id).covers.len() {
            let slot = self.node(new_id).covers[ci].slot;
            let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
                continue;
            };
            for (i, eh) in self.nodes[new_id as usize].covers[ci]
                .engine_hashes
                .iter()
                .enumerate()
            {
                let old = Pos {
                    node: id,
                    abs: moved_base + i as u32,
                };
                state.engine_map.repoint(*eh, old, new_id);
            }
        }
        if self.tracking {
            for (slot, tier, stamp) in moved_covers {
                self.queue.push_back(QueueItem {
                    node: new_id,
                    stamp,
                    slot,
                    tier,
                });
            }
        }
        if move_head {
            (new_id, id)
        } else {
            (id, new_id)
        }
    }

    /// Removes node `id` and then its ancestors while they have no covers and no
    /// children; trims a leaf's keys past its longest cover.
    pub(super) fn prune(&mut self, mut id: u32) {
        loop {
            let n = self.node(id);
            if !n.is_live() {
                return;
            }
            if !n.children.is_empty() {
                return;
            }
            let longest = n.covers.iter().map(Cover::len).max().unwrap_or(0);
            if longest > 0 {
                if longest < n.len() {
                    let n = self.node_mut(id);
                    n.keys.truncate(longest);
                    shrink_trimmed(&mut n.keys);
                }
                return;
            }
            let parent = n.parent;
            let at = n.at_parent as usize;
            let first = n.keys[0];
            if self.starts.get(&first) == Some(&id) {
                self.starts.remove(&first);
            }
            self.nodes[id as usize] = Node::default();
            self.free_nodes.push(id);
            if parent == NO_NODE {
                return;
            }
            let p = self.node_mut(parent);
            debug_assert_eq!(p.children.get(at), Some(&id));
            p.children.swap_remove(at);
            if let Some(&moved) = p.children.get(at) {
                self.node_mut(moved).at_parent = at as u32;
            }
            id = parent;
        }
    }
}
