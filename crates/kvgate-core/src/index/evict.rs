//! The memory cap of the prefix index: the eviction queue (covers, oldest stored into
//! first, a second chance for nodes lookups matched, leaves only) and its upkeep. Must
//! not evict anything while the index is under its cap, and must never make a slot
//! hold a block without the block's parent (see the eviction rule in `mod.rs`).

use std::collections::VecDeque;

use super::tree::{Pos, NO_NODE};
use super::{PrefixIndex, QueueItem};

impl PrefixIndex {
    /// Evicts entries until the cap holds. Returns how many were evicted.
    pub(super) fn enforce_cap(&mut self) -> usize {
        if self.live <= self.config.max_blocks {
            if self.tracking && self.live < self.config.max_blocks / 2 {
                self.tracking = false;
                self.queue = VecDeque::new();
            }
            return 0;
        }
        if !self.tracking {
            self.start_tracking();
        }
        let mut evicted = 0;
        while self.live > self.config.max_blocks {
            let Some(item) = self.queue.pop_front() else {
                break;
            };
            let Some(n) = self.nodes.get(item.node as usize).filter(|n| n.is_live()) else {
                continue;
            };
            let Some(cover) = n
                .cover(item.slot, item.tier)
                .filter(|c| c.stamp == item.stamp)
            else {
                continue;
            };
            let last = cover.len() - 1;
            // The slot's last entry for its tip block, with children the slot holds:
            // not a leaf. It comes back when its last held child goes.
            let only_entry = !n
                .slot_covers(item.slot)
                .iter()
                .any(|c| c.tier != item.tier && c.len() > last);
            if only_entry
                && last + 1 == n.len()
                && n.children
                    .iter()
                    .any(|&c| self.node(c).slot_present(item.slot))
            {
                continue;
            }
            if n.take_hot() {
                let stamp = self.stamp();
                if let Some(c) = self.node_mut(item.node).cover_mut(item.slot, item.tier) {
                    c.stamp = stamp;
                }
                self.queue.push_back(QueueItem { stamp, ..item });
                continue;
            }
            // The next blocks this cover will give up (the cap's excess, at most the
            // cover, and no more than a prefetch distance): their map lines load while
            // the tip is released. A cover trimmed further comes back here, and its
            // lines already in cache cost little to ask for again.
            let ahead = (self.live - self.config.max_blocks)
                .min(cover.len())
                .min(super::PIPELINE);
            self.prefetch(item.slot, &cover.engine_hashes[cover.len() - ahead..]);
            let pos = Pos {
                node: item.node,
                abs: n.base + last as u32,
            };
            let tier = item.tier;
            evicted += self.release(item.slot, pos, |c, _| c.tier == tier);
            // Trim the same cover further if the cap still needs it.
            if self
                .nodes
                .get(item.node as usize)
                .filter(|n| n.is_live())
                .and_then(|n| n.cover(item.slot, item.tier))
                .is_some_and(|c| c.stamp == item.stamp)
            {
                self.queue.push_front(item);
            }
        }
        self.stats.evicted_blocks += evicted as u64;
        self.compact_queue();
        evicted
    }

    /// `slot` no longer holds the first block of `node`: when that was the last child
    /// of the parent's tip block it held, the parent's covers reaching the tip are
    /// leaves again and go to the front of the queue.
    pub(super) fn slot_left_child(&mut self, slot: u16, node: u32) {
        let parent = self.node(node).parent;
        if parent == NO_NODE {
            return;
        }
        let p = self.node(parent);
        if p.children.iter().any(|&c| self.node(c).slot_present(slot)) {
            return;
        }
        let tip = p.len();
        let tiers: Vec<_> = p
            .slot_covers(slot)
            .iter()
            .filter(|c| c.len() == tip)
            .map(|c| c.tier)
            .collect();
        for tier in tiers {
            let stamp = self.stamp();
            if let Some(c) = self.node_mut(parent).cover_mut(slot, tier) {
                c.stamp = stamp;
            }
            self.queue.push_front(QueueItem {
                node: parent,
                stamp,
                slot,
                tier,
            });
        }
    }

    /// Builds the eviction queue from every cover, oldest store first.
    fn start_tracking(&mut self) {
        let mut items: Vec<QueueItem> = Vec::new();
        for (id, n) in self.nodes.iter().enumerate() {
            items.extend(n.covers.iter().map(|c| QueueItem {
                node: id as u32,
                stamp: c.stamp,
                slot: c.slot,
                tier: c.tier,
            }));
        }
        // Stamps wrap after 2^32 stores; order relative to the newest so a wrap only
        // perturbs the order, never loses an item.
        let newest = self.next_stamp;
        items.sort_unstable_by_key(|i| std::cmp::Reverse(newest.wrapping_sub(i.stamp)));
        self.queue = items.into();
        self.tracking = true;
    }

    /// Drops stale queue items once they outnumber live covers.
    fn compact_queue(&mut self) {
        if self.queue.len() <= 2 * self.covers + 1024 {
            return;
        }
        let nodes = &self.nodes;
        self.queue.retain(|item| {
            nodes
                .get(item.node as usize)
                .filter(|n| n.is_live())
                .and_then(|n| n.cover(item.slot, item.tier))
                .is_some_and(|c| c.stamp == item.stamp)
        });
    }
}
