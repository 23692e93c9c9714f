//! One block's record in the prefix index, laid out to fill exactly one cache line.
//!
//! Owns the representation of "who holds this block": the slot bitsets the query
//! reads, the holders (slot, tier, engine hash, store stamp) the event path updates,
//! the per-slot child counts, the parent key and the "recently matched" hint. The
//! common case (slots below 64, one holder, children held by one slot) lives inline;
//! anything wider spills into a boxed [`Wide`] part that is dropped again as soon as
//! it is empty. Must not know about other entries: the bookkeeping across blocks
//! (holes, eviction, engine-hash maps) is done by the index.

use std::sync::atomic::{AtomicBool, Ordering};

use smallvec::SmallVec;

use crate::hashing::BlockKey;
use crate::ids::Tier;

/// One (slot, tier) holding a block under the engine's hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Holder {
    pub engine_hash: u64,
    pub stamp: u32,
    pub slot: u16,
    pub tier: Tier,
}

/// How many children of a block one slot holds (only non-zero counts are kept).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ChildCount {
    slot: u16,
    children: u32,
}

/// The part of an entry that does not fit in its cache line.
#[derive(Debug, Default)]
struct Wide {
    /// Holders beyond the inline one.
    holders: Vec<Holder>,
    /// Child counts of slots other than the inline one.
    children: SmallVec<[ChildCount; 2]>,
    /// Slot bits from slot 64 on, one word per 64 slots.
    any_hi: SmallVec<[u64; 1]>,
    device_hi: SmallVec<[u64; 1]>,
}

impl Wide {
    fn is_empty(&self) -> bool {
        self.holders.is_empty()
            && self.children.is_empty()
            && self.any_hi.iter().all(|w| *w == 0)
            && self.device_hi.iter().all(|w| *w == 0)
    }
}

const HAS_PARENT: u8 = 1;
const HAS_HOLDER: u8 = 2;

/// A block key with everything the index knows about it. 64 bytes, aligned to a cache
/// line, so a lookup costs one line.
#[derive(Debug)]
#[repr(C, align(64))]
pub(super) struct BlockEntry {
    key: BlockKey,
    /// The parent block's key (chained keys determine it); meaningful with HAS_PARENT.
    parent: u64,
    /// Slots 0..64 holding the block at any tier, and on the device tier.
    any: u64,
    device: u64,
    /// The first holder; meaningful with HAS_HOLDER. Further holders are in `wide`.
    holder: Holder,
    wide: Option<Box<Wide>>,
    /// Children of the block that `child_slot` holds (0: no inline count).
    child_count: u32,
    child_slot: u16,
    flags: u8,
    /// Set by lookups that matched this block; gives it a second chance at eviction.
    hot: AtomicBool,
}

const _: () = assert!(std::mem::size_of::<BlockEntry>() == 64);

impl BlockEntry {
    pub(super) fn new(key: BlockKey, parent: Option<BlockKey>) -> Self {
        Self {
            key,
            parent: parent.map_or(0, |p| p.0),
            any: 0,
            device: 0,
            holder: Holder {
                engine_hash: 0,
                stamp: 0,
                slot: 0,
                tier: Tier::Device,
            },
            wide: None,
            child_count: 0,
            child_slot: 0,
            flags: if parent.is_some() { HAS_PARENT } else { 0 },
            hot: AtomicBool::new(false),
        }
    }

    #[inline]
    pub(super) fn key(&self) -> BlockKey {
        self.key
    }

    #[inline]
    pub(super) fn parent(&self) -> Option<BlockKey> {
        (self.flags & HAS_PARENT != 0).then_some(BlockKey(self.parent))
    }

    // ---- holders ----

    #[inline]
    pub(super) fn holders(&self) -> impl Iterator<Item = &Holder> {
        let first = (self.flags & HAS_HOLDER != 0).then_some(&self.holder);
        let rest = self.wide.as_deref().map_or(&[][..], |w| &w.holders[..]);
        first.into_iter().chain(rest)
    }

    #[inline]
    pub(super) fn holders_mut(&mut self) -> impl Iterator<Item = &mut Holder> {
        let first = (self.flags & HAS_HOLDER != 0).then_some(&mut self.holder);
        let rest = self
            .wide
            .as_deref_mut()
            .map_or(&mut [][..], |w| &mut w.holders[..]);
        first.into_iter().chain(rest)
    }

    #[inline]
    pub(super) fn has_holders(&self) -> bool {
        self.flags & HAS_HOLDER != 0
    }

    pub(super) fn push_holder(&mut self, h: Holder) {
        if self.flags & HAS_HOLDER == 0 {
            self.holder = h;
            self.flags |= HAS_HOLDER;
        } else {
            self.wide_mut().holders.push(h);
        }
    }

    /// Drops the holders `drop` selects, calling `gone` with each; holder order is not
    /// kept.
    pub(super) fn remove_holders(
        &mut self,
        mut drop: impl FnMut(&Holder) -> bool,
        mut gone: impl FnMut(&Holder),
    ) {
        if let Some(w) = self.wide.as_deref_mut() {
            w.holders.retain(|h| {
                let d = drop(h);
                if d {
                    gone(h);
                }
                !d
            });
        }
        if self.flags & HAS_HOLDER != 0 && drop(&self.holder) {
            gone(&self.holder);
            match self.wide.as_deref_mut().and_then(|w| w.holders.pop()) {
                Some(h) => self.holder = h,
                None => self.flags &= !HAS_HOLDER,
            }
        }
        self.shrink();
    }

    // ---- slot bits ----

    /// Word `w` of the set of slots holding the block at any tier.
    #[inline]
    pub(super) fn any_word(&self, w: usize) -> u64 {
        self.word(false, w)
    }

    /// Word `w` of the set of slots holding the block on the device tier.
    #[inline]
    pub(super) fn device_word(&self, w: usize) -> u64 {
        self.word(true, w)
    }

    /// Word `w` of the device set or of the any-tier set (as in `set_bit`).
    #[inline]
    fn word(&self, device: bool, w: usize) -> u64 {
        if w == 0 {
            return if device { self.device } else { self.any };
        }
        self.wide
            .as_deref()
            .and_then(|x| {
                if device { &x.device_hi } else { &x.any_hi }
                    .get(w - 1)
                    .copied()
            })
            .unwrap_or(0)
    }

    /// Number of words of the slot sets (at least 1).
    #[inline]
    pub(super) fn words(&self) -> usize {
        1 + self.wide.as_deref().map_or(0, |w| w.any_hi.len())
    }

    #[inline]
    pub(super) fn holds(&self, slot: u16) -> bool {
        self.any_word(slot as usize / 64) & (1 << (slot % 64)) != 0
    }

    #[inline]
    pub(super) fn holds_on_device(&self, slot: u16) -> bool {
        self.device_word(slot as usize / 64) & (1 << (slot % 64)) != 0
    }

    fn set_bit(&mut self, device: bool, slot: u16, on: bool) {
        let (w, bit) = (slot as usize / 64, 1u64 << (slot % 64));
        let word = if w == 0 {
            if device {
                &mut self.device
            } else {
                &mut self.any
            }
        } else {
            if !on && self.wide.is_none() {
                return;
            }
            let wide = self.wide_mut();
            let words = if device {
                &mut wide.device_hi
            } else {
                &mut wide.any_hi
            };
            if words.len() < w {
                if !on {
                    return;
                }
                words.resize(w, 0);
            }
            &mut words[w - 1]
        };
        if on {
            *word |= bit;
        } else {
            *word &= !bit;
        }
    }

    /// Marks the slot as holding the block (on the device tier too when `device`).
    #[inline]
    pub(super) fn mark(&mut self, slot: u16, device: bool) {
        self.set_bit(false, slot, true);
        if device {
            self.set_bit(true, slot, true);
        }
    }

    /// Recomputes the slot's membership bits from its holders; returns (any, device).
    pub(super) fn refresh_membership(&mut self, slot: u16) -> (bool, bool) {
        let mut any = false;
        let mut device = false;
        for h in self.holders().filter(|h| h.slot == slot) {
            any = true;
            device |= h.tier == Tier::Device;
        }
        self.set_bit(false, slot, any);
        self.set_bit(true, slot, device);
        self.shrink();
        (any, device)
    }

    // ---- child counts ----

    pub(super) fn children_of(&self, slot: u16) -> u32 {
        if self.child_count > 0 && self.child_slot == slot {
            return self.child_count;
        }
        self.wide
            .as_deref()
            .and_then(|w| w.children.iter().find(|c| c.slot == slot))
            .map_or(0, |c| c.children)
    }

    /// Removes and returns the slot's child count.
    pub(super) fn take_children(&mut self, slot: u16) -> u32 {
        if self.child_count > 0 && self.child_slot == slot {
            return std::mem::take(&mut self.child_count);
        }
        let Some(w) = self.wide.as_deref_mut() else {
            return 0;
        };
        let n = match w.children.iter().position(|c| c.slot == slot) {
            Some(i) => w.children.swap_remove(i).children,
            None => 0,
        };
        self.shrink();
        n
    }

    pub(super) fn add_children(&mut self, slot: u16, n: u32) {
        if n == 0 {
            return;
        }
        if self.child_count > 0 && self.child_slot == slot {
            self.child_count += n;
            return;
        }
        if let Some(c) = self
            .wide
            .as_deref_mut()
            .and_then(|w| w.children.iter_mut().find(|c| c.slot == slot))
        {
            c.children += n;
            return;
        }
        if self.child_count == 0 {
            self.child_slot = slot;
            self.child_count = n;
        } else {
            self.wide_mut()
                .children
                .push(ChildCount { slot, children: n });
        }
    }

    /// Decrements the slot's child count; returns the count left.
    pub(super) fn sub_child(&mut self, slot: u16) -> u32 {
        if self.child_count > 0 && self.child_slot == slot {
            self.child_count -= 1;
            return self.child_count;
        }
        let Some(w) = self.wide.as_deref_mut() else {
            return 0;
        };
        let left = match w.children.iter().position(|c| c.slot == slot) {
            Some(i) => {
                let c = &mut w.children[i];
                c.children = c.children.saturating_sub(1);
                let left = c.children;
                if left == 0 {
                    w.children.swap_remove(i);
                }
                left
            }
            None => 0,
        };
        self.shrink();
        left
    }

    // ---- eviction hint ----

    /// Marks the block as matched by a lookup (cheap when it already is).
    #[inline]
    pub(super) fn touch(&self) {
        if !self.hot.load(Ordering::Relaxed) {
            self.hot.store(true, Ordering::Relaxed);
        }
    }

    /// Clears the hint; returns whether it was set.
    pub(super) fn take_hot(&self) -> bool {
        self.hot.swap(false, Ordering::Relaxed)
    }

    fn wide_mut(&mut self) -> &mut Wide {
        self.wide.get_or_insert_with(Box::default)
    }

    /// Frees the wide part once nothing is in it.
    fn shrink(&mut self) {
        if self.wide.as_deref().is_some_and(Wide::is_empty) {
            self.wide = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(slot: u16, tier: Tier, engine_hash: u64) -> Holder {
        Holder {
            engine_hash,
            stamp: 0,
            slot,
            tier,
        }
    }

    #[test]
    fn holders_spill_and_come_back_inline() {
        let mut e = BlockEntry::new(BlockKey(1), None);
        e.push_holder(holder(3, Tier::Device, 30));
        e.push_holder(holder(70, Tier::Host, 700));
        e.mark(3, true);
        e.mark(70, false);
        assert!(e.holds(3) && e.holds_on_device(3));
        assert!(e.holds(70) && !e.holds_on_device(70));
        assert_eq!(e.words(), 2);
        let mut gone = Vec::new();
        e.remove_holders(|h| h.slot == 3, |h| gone.push(h.engine_hash));
        assert_eq!(gone, [30]);
        assert_eq!(e.refresh_membership(3), (false, false));
        assert_eq!(e.holders().count(), 1);
        e.remove_holders(|h| h.slot == 70, |_| {});
        e.refresh_membership(70);
        assert!(!e.has_holders());
        assert!(e.wide.is_none(), "an empty wide part is freed");
    }

    #[test]
    fn child_counts_per_slot() {
        let mut e = BlockEntry::new(BlockKey(1), Some(BlockKey(0)));
        e.add_children(1, 2);
        e.add_children(2, 1);
        e.add_children(1, 1);
        assert_eq!((e.children_of(1), e.children_of(2)), (3, 1));
        assert_eq!(e.sub_child(2), 0);
        assert_eq!(e.take_children(1), 3);
        assert_eq!(e.children_of(1), 0);
        assert!(e.wide.is_none());
    }
}
