//! The memory cap of the prefix index: the eviction queue (oldest stored first, a
//! second chance for blocks lookups matched, leaves only) and its upkeep. Must not
//! evict anything while the index is under its cap, and must never make a slot hold a
//! block without the block's parent (see the eviction rule in `mod.rs`).

use std::collections::VecDeque;

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
            let Some(entry) = self.blocks.get(&item.key) else {
                continue;
            };
            let mut current = false;
            let mut slot_holders = 0;
            for h in entry.holders().filter(|h| h.slot == item.slot) {
                slot_holders += 1;
                current |= h.tier == item.tier && h.stamp == item.stamp;
            }
            if !current {
                continue;
            }
            if slot_holders == 1 && entry.children_of(item.slot) > 0 {
                // Not a leaf for this slot: evicting it would leave a hole. It comes
                // back to the front of the queue when its last held child goes.
                continue;
            }
            if entry.take_hot() {
                let stamp = self.stamp();
                if let Some(entry) = self.blocks.get_mut(&item.key) {
                    for h in entry.holders_mut() {
                        if h.slot == item.slot && h.tier == item.tier {
                            h.stamp = stamp;
                        }
                    }
                }
                self.queue.push_back(QueueItem { stamp, ..item });
                continue;
            }
            evicted += self.remove_holders(item.slot, item.key, |h| h.tier == item.tier);
        }
        self.stats.evicted_blocks += evicted as u64;
        self.compact_queue();
        evicted
    }

    /// Builds the eviction queue from every holder, oldest store first.
    fn start_tracking(&mut self) {
        let mut items: Vec<QueueItem> = Vec::with_capacity(self.live);
        for entry in self.blocks.iter() {
            items.extend(entry.holders().map(|h| QueueItem {
                key: entry.key(),
                stamp: h.stamp,
                slot: h.slot,
                tier: h.tier,
            }));
        }
        // Stamps wrap after 2^32 stores; order relative to the newest so a wrap only
        // perturbs the order, never loses an item.
        let newest = self.next_stamp;
        items.sort_unstable_by_key(|i| std::cmp::Reverse(newest.wrapping_sub(i.stamp)));
        self.queue = items.into();
        self.tracking = true;
    }

    /// Drops stale queue items once they outnumber live entries.
    fn compact_queue(&mut self) {
        if self.queue.len() <= 2 * self.live + 1024 {
            return;
        }
        let blocks = &self.blocks;
        self.queue.retain(|item| {
            blocks.get(&item.key).is_some_and(|e| {
                e.holders()
                    .any(|h| h.slot == item.slot && h.tier == item.tier && h.stamp == item.stamp)
            })
        });
    }
}
