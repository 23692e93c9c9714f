//! Parent/child bookkeeping of the prefix index: per (block, slot) the number of held
//! children, and per slot the "orphans" (blocks a slot no longer holds although it
//! still holds children of them). These decide whether a slot's overlap can be found by
//! binary search and which entries eviction may take. Must not change which blocks a
//! slot holds; it only follows the membership changes made in `mod.rs`.

use std::collections::hash_map::Entry;
use std::collections::VecDeque;

use super::entry::BlockEntry;
use super::{PrefixIndex, QueueItem, SlotState};
use crate::hashing::BlockKey;

impl PrefixIndex {
    /// `slot` started holding a child of `parent`.
    pub(super) fn child_added(&mut self, slot: u16, parent: BlockKey) {
        if let Some(p) = self.blocks.get_mut(&parent) {
            if p.holds(slot) {
                p.add_children(slot, 1);
                return;
            }
        }
        if let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) {
            *state.orphans.entry(parent).or_insert(0) += 1;
        }
    }

    /// `slot` stopped holding a child of `parent`. When that was the parent's last
    /// held child and the eviction queue is kept, the parent (now a leaf for the slot)
    /// goes back to the front of the queue.
    pub(super) fn child_removed(&mut self, slot: u16, parent: BlockKey) {
        let held = if self.last_left == Some((slot, parent)) {
            None
        } else {
            self.blocks.get_mut(&parent)
        };
        if let Some(p) = held {
            if p.holds(slot) {
                let queue = self.tracking.then_some(&mut self.queue);
                held_block_lost_child(p, parent, slot, &mut self.next_stamp, queue);
                return;
            }
        }
        if let Some(state) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) {
            orphan_child_left(state, parent);
        }
    }
}

/// A slot stopped holding a child of `parent`, a block it holds (`p`). When that was
/// its last held child and the eviction `queue` is kept, `parent` is now a leaf for the
/// slot and goes back to the front of the queue.
pub(super) fn held_block_lost_child(
    p: &mut BlockEntry,
    parent: BlockKey,
    slot: u16,
    next_stamp: &mut u32,
    queue: Option<&mut VecDeque<QueueItem>>,
) {
    if p.sub_child(slot) > 0 {
        return;
    }
    let Some(queue) = queue else {
        return;
    };
    *next_stamp = next_stamp.wrapping_add(1);
    let stamp = *next_stamp;
    for h in p.holders_mut().filter(|h| h.slot == slot) {
        h.stamp = stamp;
        queue.push_front(QueueItem {
            key: parent,
            stamp,
            slot,
            tier: h.tier,
        });
    }
}

/// A slot stopped holding a child of `parent`, a block it does not hold: one orphan
/// fewer under `parent`.
pub(super) fn orphan_child_left(state: &mut SlotState, parent: BlockKey) {
    if let Entry::Occupied(mut o) = state.orphans.entry(parent) {
        *o.get_mut() -= 1;
        if *o.get() == 0 {
            o.remove();
        }
    }
}
