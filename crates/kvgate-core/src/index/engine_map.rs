//! One worker rank's map from the engine's block hash to where the block is in the
//! tree: the index's only per-(block, worker) table, so its size is most of the index's
//! memory and its cache misses most of an event's cost.
//!
//! An open-addressing table with Robin Hood linear probing and 12-byte slots: a 24-bit
//! tag of the engine hash with the entry's distance from its home slot, and the block's
//! position. The full engine hash is not stored here (the tree's cover keeps it), so a
//! lookup confirms a tag match against the tree (`is_it`); a removal or a move names
//! the position it expects. No tombstones (a removal shifts the rest of its run back),
//! so churn at a flat size keeps the table flat. Its size is any number, not a power of
//! two (a tag is mapped to a home slot by a multiply), and it grows by an eighth when
//! 7/8 full, so it runs between 78% and 87.5% full where a general-purpose table with
//! power-of-two sizes runs between 44% and 87.5% (and a table at its peak steps up by
//! an eighth, not a doubling). Robin Hood order (entries sorted by distance from their
//! home) ends a lookup for an absent hash early; slots past the last home take the
//! runs that would wrap, so a probe never wraps. Owns only storage and lookup; what a
//! position means is `tree.rs`'s.

use super::tree::{Pos, NO_NODE};

/// One slot: `meta` is a 24-bit tag of the engine hash over the entry's distance from
/// its home slot plus one (0: empty).
#[derive(Clone, Copy, Debug)]
struct Slot {
    meta: u32,
    pos: Pos,
}

const EMPTY: Slot = Slot {
    meta: 0,
    pos: Pos {
        node: NO_NODE,
        abs: 0,
    },
};

/// Longest distance an entry may be from its home; beyond it the table grows. Slots
/// past the last home absorb runs that would wrap around, so a probe never wraps.
const MAX_DISTANCE: usize = 254;

#[derive(Debug, Default)]
pub(super) struct EngineMap {
    /// `homes` slots and room for the runs that start near the end (or none).
    slots: Vec<Slot>,
    /// Slots an entry's home can be.
    homes: usize,
    len: usize,
}

/// The 24-bit tag of an engine hash (which may be a small integer): the high bits of
/// a 64-bit mix of it.
#[inline]
fn tag_of(engine_hash: u64) -> u32 {
    let x = (engine_hash ^ (engine_hash >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    ((x ^ (x >> 32)) >> 40) as u32
}

#[inline]
fn meta(tag: u32, distance: usize) -> u32 {
    tag << 8 | (distance as u32 + 1)
}

impl EngineMap {
    #[inline]
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) * self.homes as u64) >> 24) as usize
    }

    /// The slot whose entry has `tag` and passes `hit`, walking the tag's run.
    #[inline]
    fn find(&self, tag: u32, mut hit: impl FnMut(Pos) -> bool) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        let home = self.home(tag);
        for d in 0..=MAX_DISTANCE {
            let s = &self.slots[home + d];
            // Robin Hood order: an entry nearer its home than we are to ours ends the
            // run we could be in (an empty slot has distance "-1").
            let theirs = (s.meta & 0xff) as usize;
            if theirs < d + 1 {
                return None;
            }
            if s.meta == meta(tag, d) && hit(s.pos) {
                return Some(home + d);
            }
        }
        None
    }

    /// Where `engine_hash` is; `is_it` confirms that a candidate position holds it.
    #[inline]
    pub fn get(&self, engine_hash: u64, is_it: impl FnMut(Pos) -> bool) -> Option<Pos> {
        self.find(tag_of(engine_hash), is_it)
            .map(|i| self.slots[i].pos)
    }

    /// Reads the slot where `engine_hash`'s run starts, without depending on it: a
    /// chunk's lines are requested together (their cache misses overlap) before the
    /// lookups that need them.
    #[inline]
    pub fn touch(&self, engine_hash: u64) -> u32 {
        if self.slots.is_empty() {
            return 0;
        }
        self.slots[self.home(tag_of(engine_hash))].meta
    }

    /// Maps `engine_hash` to `pos`; returns where it was before (an entry `is_it`
    /// confirms).
    pub fn insert(
        &mut self,
        engine_hash: u64,
        pos: Pos,
        is_it: impl FnMut(Pos) -> bool,
    ) -> Option<Pos> {
        debug_assert!(pos.node != NO_NODE);
        let tag = tag_of(engine_hash);
        if let Some(i) = self.find(tag, is_it) {
            return Some(std::mem::replace(&mut self.slots[i].pos, pos));
        }
        if (self.len + 1) * 8 > self.homes * 7 {
            self.resize(self.homes + self.homes / 8);
        }
        while !self.place(tag, pos) {
            self.resize(self.homes + self.homes / 8);
        }
        None
    }

    /// Puts an entry known to be absent into its Robin Hood place: before the first
    /// entry nearer its home than the new one would be, the rest of the run shifted one
    /// slot on. False (nothing changed) when that would put an entry further than
    /// `MAX_DISTANCE` from its home.
    fn place(&mut self, tag: u32, pos: Pos) -> bool {
        let home = self.home(tag);
        let mut at = None;
        let mut i = home;
        loop {
            let Some(s) = self.slots.get(i) else {
                return false;
            };
            if s.meta == 0 {
                break;
            }
            let theirs = (s.meta & 0xff) as usize - 1;
            if at.is_none() && theirs < i - home {
                at = Some(i);
            }
            if at.is_some() && theirs >= MAX_DISTANCE {
                return false;
            }
            i += 1;
        }
        let empty = i;
        let at = at.unwrap_or(empty);
        if at - home > MAX_DISTANCE {
            return false;
        }
        for j in (at..empty).rev() {
            let mut s = self.slots[j];
            s.meta += 1;
            self.slots[j + 1] = s;
        }
        self.slots[at] = Slot {
            meta: meta(tag, at - home),
            pos,
        };
        self.len += 1;
        true
    }

    /// Unmaps `engine_hash` if it points at `pos`; returns whether it did.
    pub fn remove_at(&mut self, engine_hash: u64, pos: Pos) -> bool {
        let Some(mut hole) = self.find(tag_of(engine_hash), |p| p == pos) else {
            return false;
        };
        self.len -= 1;
        // Shift the rest of the run back one slot (each one nearer its home).
        while hole + 1 < self.slots.len() && (self.slots[hole + 1].meta & 0xff) > 1 {
            let mut s = self.slots[hole + 1];
            s.meta -= 1;
            self.slots[hole] = s;
            hole += 1;
        }
        self.slots[hole] = EMPTY;
        if self.len * 4 < self.homes && self.homes > 64 {
            self.resize(self.len * 8 / 5 + 16);
        }
        true
    }

    /// Points `engine_hash`'s entry at `old` to node `node` instead (same offset).
    pub fn repoint(&mut self, engine_hash: u64, old: Pos, node: u32) {
        if let Some(i) = self.find(tag_of(engine_hash), |p| p == old) {
            self.slots[i].pos.node = node;
        }
    }

    /// Every position an engine hash points at (a block held at several tiers under
    /// different hashes appears once per hash).
    pub fn positions(&self) -> impl Iterator<Item = Pos> + '_ {
        self.slots.iter().filter(|s| s.meta != 0).map(|s| s.pos)
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    #[cfg(test)]
    fn homes(&self) -> usize {
        self.homes
    }

    fn resize(&mut self, homes: usize) {
        let entries: Vec<Slot> = std::mem::take(&mut self.slots)
            .into_iter()
            .filter(|s| s.meta != 0)
            .collect();
        let mut homes = homes.max(16);
        loop {
            self.slots = vec![EMPTY; homes + MAX_DISTANCE.min(homes) + 1];
            self.homes = homes;
            self.len = 0;
            if entries.iter().all(|s| self.place(s.meta >> 8, s.pos)) {
                return;
            }
            // A run too long for the distance byte: spread further.
            homes += homes / 4;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    /// Each key's position encodes the key, so a test can confirm candidates as the
    /// tree would.
    fn pos(key: u64, version: u32) -> Pos {
        Pos {
            node: key as u32,
            abs: version,
        }
    }

    proptest! {
        /// Against std's map: inserts, overwrites and removals in any order, with keys
        /// from a small range so probe runs collide and wrap.
        #[test]
        fn behaves_like_a_map(ops in prop::collection::vec((0u64..300, 0u32..1000, prop::bool::weighted(0.45)), 1..3000)) {
            let mut ours = EngineMap::default();
            let mut reference: HashMap<u64, Pos> = HashMap::new();
            for (key, version, remove) in ops {
                let is_key = |p: Pos| u64::from(p.node) == key;
                if remove {
                    let expected = reference.remove(&key);
                    let at = expected.unwrap_or(pos(key, 0));
                    prop_assert_eq!(ours.remove_at(key, at), expected.is_some());
                } else {
                    prop_assert_eq!(ours.insert(key, pos(key, version), is_key), reference.insert(key, pos(key, version)));
                }
                prop_assert_eq!(ours.len(), reference.len());
            }
            for (k, v) in &reference {
                prop_assert_eq!(ours.get(*k, |p| u64::from(p.node) == *k), Some(*v));
            }
            prop_assert_eq!(ours.positions().count(), reference.len());
        }
    }

    #[test]
    fn stays_between_77_and_88_percent_full_while_growing() {
        let mut m = EngineMap::default();
        for k in 0..100_000u64 {
            m.insert(k, pos(k, 0), |p| u64::from(p.node) == k);
            if m.len() > 1000 {
                let load = m.len() as f64 / m.homes() as f64;
                assert!((0.77..=0.875).contains(&load), "load {load} at {}", m.len());
            }
        }
    }
}
