//! One worker rank's map from the engine's block hash to where the block is in the
//! tree: the index's only per-(block, worker) table, so its size is most of the index's
//! memory and its cache misses most of an event's cost.
//!
//! Bucketed cuckoo hashing: each entry lives in one of two buckets chosen by a 32-bit
//! tag of the engine hash, and a bucket is one 64-byte cache line holding five entries
//! (a tag and the block's position each) and its count. A lookup, an insert of a new
//! hash and a removal each read those two lines and nothing else (no probe runs, no
//! shifting), and [`EngineMap::touch`] prefetches both, so the index keeps the lines of
//! an event's next few blocks in flight while it applies one.
//!
//! An insert that finds both buckets full moves an entry to its other bucket (both are
//! derived from the tag, so the map needs no more of the hash), and so on up to
//! `MAX_KICKS` times; an entry still without a place grows the map, or, in a map at
//! most half full (where the cause is more hashes sharing a tag than two buckets hold,
//! not a lack of room), goes to a small stash searched after the buckets. Removing an
//! entry moves its bucket's last entry into its place, so churn at a flat size keeps
//! the table flat. The bucket count is any number, not a power of two (a tag is mapped
//! to a bucket by a multiply), and it grows by an eighth when 7/8 full, so the map runs
//! between about 78% and 87.5% full: 12.8 bytes per slot, about 15.5 per entry.
//!
//! The full engine hash is not stored here (the tree's cover keeps it), so a lookup
//! confirms a tag match against the tree (`is_it`); a removal or a move names the
//! position it expects. Owns only storage and lookup; what a position means is
//! `tree.rs`'s.

use super::tree::{Pos, NO_NODE};

/// Entries per bucket: five (4-byte tag, 8-byte position) pairs and a count fill one
/// cache line.
const WAYS: usize = 5;

/// How many entries an insert may move before the map grows (or stashes) instead.
const MAX_KICKS: usize = 128;

/// Where an entry is: a bucket and an index in it, or (`STASH`, an index in the stash).
type At = (usize, usize);

const STASH: usize = usize::MAX;

#[derive(Clone, Copy, Debug)]
#[repr(C, align(64))]
struct Bucket {
    tags: [u32; WAYS],
    pos: [Pos; WAYS],
    len: u32,
}

const EMPTY: Bucket = Bucket {
    tags: [0; WAYS],
    pos: [Pos {
        node: NO_NODE,
        abs: 0,
    }; WAYS],
    len: 0,
};

#[derive(Debug, Default)]
pub(super) struct EngineMap {
    buckets: Vec<Bucket>,
    /// Entries with no place in their buckets (see the module comment): empty unless
    /// an engine sends many hashes whose tags collide.
    stash: Vec<(u32, Pos)>,
    /// Entries in the buckets and the stash.
    len: usize,
    /// State of the generator that picks which entry an insert moves (a fixed seed:
    /// the map's layout is a function of its operations).
    kicks: u32,
    /// Changes made so far (inserts, removals, re-points): a grown copy is only
    /// swapped in for the map it was copied from ([`Self::changes`]).
    changes: u64,
}

/// The 32-bit tag of an engine hash (which may be a small integer): the high half of
/// the hash, folded, times an odd constant (Fibonacci hashing).
#[inline]
fn tag_of(engine_hash: u64) -> u32 {
    ((engine_hash ^ (engine_hash >> 32)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as u32
}

/// A second mix of a tag, for its second bucket: the product's high bits depend on
/// all of the tag's, so tags that share a first bucket are spread over second ones.
#[inline]
fn remix(tag: u32) -> u32 {
    tag.wrapping_mul(0x85eb_ca6b)
}

impl EngineMap {
    /// The two buckets a tag's entry may be in (distinct: a map has at least four).
    #[inline]
    fn buckets_of(&self, tag: u32) -> (usize, usize) {
        let m = self.buckets.len();
        let first = ((u64::from(tag) * m as u64) >> 32) as usize;
        // Another mix of the tag picks an offset in 1..m, so the second bucket differs
        // from the first and is independent of it.
        let mixed = u64::from(remix(tag));
        let second = first + 1 + ((mixed * (m as u64 - 1)) >> 32) as usize;
        (first, if second >= m { second - m } else { second })
    }

    /// Where the entry is that has `tag` and passes `hit`.
    #[inline]
    fn find(&self, tag: u32, mut hit: impl FnMut(Pos) -> bool) -> Option<At> {
        if self.len == 0 {
            return None;
        }
        let (a, b) = self.buckets_of(tag);
        self.find_in(tag, a, b, &mut hit)
    }

    /// [`Self::find`] given the tag's buckets `a` and `b`.
    #[inline]
    fn find_in(
        &self,
        tag: u32,
        a: usize,
        b: usize,
        hit: &mut impl FnMut(Pos) -> bool,
    ) -> Option<At> {
        for at in [a, b] {
            let bucket = &self.buckets[at];
            // All five tags compared at once (the loop compiles to a vector compare),
            // so the only branch per bucket is whether any matched.
            let mut matches = 0u32;
            for (i, t) in bucket.tags.iter().enumerate() {
                matches |= u32::from(*t == tag) << i;
            }
            matches &= (1u32 << bucket.len) - 1;
            while matches != 0 {
                let i = matches.trailing_zeros() as usize;
                if hit(bucket.pos[i]) {
                    return Some((at, i));
                }
                matches &= matches - 1;
            }
        }
        if self.stash.is_empty() {
            return None;
        }
        self.stash
            .iter()
            .position(|(t, p)| *t == tag && hit(*p))
            .map(|i| (STASH, i))
    }

    #[inline]
    fn pos_mut(&mut self, (b, i): At) -> &mut Pos {
        if b == STASH {
            &mut self.stash[i].1
        } else {
            &mut self.buckets[b].pos[i]
        }
    }

    #[inline]
    fn pos_at(&self, (b, i): At) -> Pos {
        if b == STASH {
            self.stash[i].1
        } else {
            self.buckets[b].pos[i]
        }
    }

    /// Where `engine_hash` is; `is_it` confirms that a candidate position holds it.
    #[inline]
    pub fn get(&self, engine_hash: u64, is_it: impl FnMut(Pos) -> bool) -> Option<Pos> {
        self.find(tag_of(engine_hash), is_it)
            .map(|at| self.pos_at(at))
    }

    /// Starts loading the two lines `engine_hash`'s entry can be in, without waiting
    /// for them: the index requests a block's lines a few blocks before it applies it,
    /// so their cache misses overlap with the work in between.
    #[inline]
    pub fn touch(&self, engine_hash: u64) {
        if self.buckets.is_empty() {
            return;
        }
        let (a, b) = self.buckets_of(tag_of(engine_hash));
        prefetch(&self.buckets[a]);
        prefetch(&self.buckets[b]);
    }

    /// Maps `engine_hash` to `pos`; returns where it was before (an entry `is_it`
    /// confirms).
    pub fn insert(
        &mut self,
        engine_hash: u64,
        pos: Pos,
        mut is_it: impl FnMut(Pos) -> bool,
    ) -> Option<Pos> {
        debug_assert!(pos.node != NO_NODE);
        self.changes += 1;
        let tag = tag_of(engine_hash);
        if self.buckets.is_empty() {
            self.resize(4);
        }
        let (mut a, mut b) = self.buckets_of(tag);
        if let Some(at) = self.find_in(tag, a, b, &mut is_it) {
            return Some(std::mem::replace(self.pos_mut(at), pos));
        }
        if (self.len + 1) * 8 > self.buckets.len() * WAYS * 7 {
            self.resize(self.grown());
            (a, b) = self.buckets_of(tag);
        }
        let emptier = if self.buckets[a].len <= self.buckets[b].len {
            a
        } else {
            b
        };
        if !self.push(emptier, tag, pos) {
            self.place_moving(tag, pos, emptier);
        }
        None
    }

    /// Places an entry whose buckets are both full (`at` is one of them): moves
    /// entries to make room, grows the map while that fails, and stashes what still has
    /// no place in a map at most half full (growing it further would not help).
    #[cold]
    fn place_moving(&mut self, tag: u32, pos: Pos, at: usize) {
        let mut left = self.move_into(at, tag, pos);
        while let Some((tag, pos)) = left {
            if self.len * 2 <= self.slots() {
                self.stash.push((tag, pos));
                self.len += 1;
                return;
            }
            self.resize(self.grown());
            left = self.place(tag, pos);
        }
    }

    fn grown(&self) -> usize {
        self.buckets.len() + self.buckets.len() / 8 + 1
    }

    /// Whether inserting `more` new entries would grow the map.
    pub fn would_grow(&self, more: usize) -> bool {
        (self.len + more) * 8 > self.buckets.len() * WAYS * 7
    }

    /// A copy of the map, grown as inserting `more` new entries would grow it (by at
    /// least an eighth, to hold them all under 7/8 full), built without changing this
    /// one: a shared index's writer builds it while lookups read the index and then
    /// swaps it in, so they never wait for a rehash.
    pub fn grown_copy(&self, more: usize) -> EngineMap {
        let needed = ((self.len + more) * 8).div_ceil(WAYS * 7);
        self.rebuilt(needed.max(self.grown()))
    }

    /// How many changes the map has had (a copy carries its original's count).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Every entry, as (tag, position).
    fn entries(&self) -> impl Iterator<Item = (u32, Pos)> + '_ {
        self.buckets
            .iter()
            .flat_map(|b| (0..b.len as usize).map(move |i| (b.tags[i], b.pos[i])))
            .chain(self.stash.iter().copied())
    }

    /// Puts an entry known to be absent into the emptier of its buckets, or, both being
    /// full, moves entries to make room (`move_into`). Returns the entry left without a
    /// place, if any.
    fn place(&mut self, tag: u32, pos: Pos) -> Option<(u32, Pos)> {
        let (a, b) = self.buckets_of(tag);
        let at = if self.buckets[a].len <= self.buckets[b].len {
            a
        } else {
            b
        };
        if self.push(at, tag, pos) {
            return None;
        }
        self.move_into(at, tag, pos)
    }

    /// Puts an entry into the full bucket `at` in place of one that moves to its other
    /// bucket, and so on; returns the entry left without a place after `MAX_KICKS`
    /// moves (the map then holds every other entry).
    fn move_into(&mut self, at: usize, tag: u32, pos: Pos) -> Option<(u32, Pos)> {
        let mut carried = (tag, pos);
        let mut at = at;
        for _ in 0..MAX_KICKS {
            // xorshift32 (from a non-zero seed): which of the full bucket's entries
            // moves on.
            if self.kicks == 0 {
                self.kicks = 0x9e37_79b9;
            }
            self.kicks ^= self.kicks << 13;
            self.kicks ^= self.kicks >> 17;
            self.kicks ^= self.kicks << 5;
            let victim = self.kicks as usize % WAYS;
            let bucket = &mut self.buckets[at];
            let moved = (bucket.tags[victim], bucket.pos[victim]);
            bucket.tags[victim] = carried.0;
            bucket.pos[victim] = carried.1;
            carried = moved;
            let (x, y) = self.buckets_of(carried.0);
            at = if at == x { y } else { x };
            if self.push(at, carried.0, carried.1) {
                return None;
            }
        }
        Some(carried)
    }

    /// Appends an entry to bucket `at` if it has room.
    #[inline]
    fn push(&mut self, at: usize, tag: u32, pos: Pos) -> bool {
        let bucket = &mut self.buckets[at];
        let i = bucket.len as usize;
        if i == WAYS {
            return false;
        }
        bucket.tags[i] = tag;
        bucket.pos[i] = pos;
        bucket.len += 1;
        self.len += 1;
        true
    }

    /// Unmaps `engine_hash` if it points at `pos`; returns whether it did.
    pub fn remove_at(&mut self, engine_hash: u64, pos: Pos) -> bool {
        self.changes += 1;
        let Some((b, i)) = self.find(tag_of(engine_hash), |p| p == pos) else {
            return false;
        };
        if b == STASH {
            self.stash.swap_remove(i);
        } else {
            let bucket = &mut self.buckets[b];
            let last = bucket.len as usize - 1;
            bucket.tags[i] = bucket.tags[last];
            bucket.pos[i] = bucket.pos[last];
            bucket.len -= 1;
        }
        self.len -= 1;
        if self.len * 4 < self.slots() && self.buckets.len() > 16 {
            // Back to about 62% full.
            self.resize(self.len * 8 / (5 * WAYS) + 4);
        }
        true
    }

    /// Points `engine_hash`'s entry at `old` to node `node` instead (same offset).
    pub fn repoint(&mut self, engine_hash: u64, old: Pos, node: u32) {
        self.changes += 1;
        if let Some(at) = self.find(tag_of(engine_hash), |p| p == old) {
            self.pos_mut(at).node = node;
        }
    }

    /// Every position an engine hash points at (a block held at several tiers under
    /// different hashes appears once per hash).
    pub fn positions(&self) -> impl Iterator<Item = Pos> + '_ {
        self.buckets
            .iter()
            .flat_map(|b| b.pos[..b.len as usize].iter().copied())
            .chain(self.stash.iter().map(|(_, p)| *p))
    }

    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.len
    }

    fn slots(&self) -> usize {
        self.buckets.len() * WAYS
    }

    /// Rebuilds the map with `buckets` buckets; an entry that finds no place (which
    /// takes a tag shared by more entries than two buckets hold) goes to the stash.
    fn resize(&mut self, buckets: usize) {
        *self = self.rebuilt(buckets);
    }

    /// This map's entries in a new map of `buckets` buckets (carrying the move
    /// generator's state and the change count on).
    fn rebuilt(&self, buckets: usize) -> EngineMap {
        let mut map = EngineMap {
            buckets: vec![EMPTY; buckets.max(4)],
            stash: Vec::new(),
            len: 0,
            kicks: self.kicks,
            changes: self.changes,
        };
        for (tag, pos) in self.entries() {
            if let Some(left) = map.place(tag, pos) {
                map.stash.push(left);
                map.len += 1;
            }
        }
        map
    }
}

/// Asks the CPU to start loading `bucket`'s line.
#[inline]
fn prefetch(bucket: &Bucket) {
    // SAFETY: a prefetch is a hint that never faults, and SSE is part of every x86-64
    // CPU (the instruction's only requirement).
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (bucket as *const Bucket).cast::<i8>(),
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    std::hint::black_box(bucket.len);
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
                let load = m.len() as f64 / m.slots() as f64;
                assert!((0.77..=0.875).contains(&load), "load {load} at {}", m.len());
            }
        }
    }

    /// A grown copy holds every entry of its original, which it leaves as it was, and
    /// takes the entries it was grown for without growing again.
    #[test]
    fn a_grown_copy_takes_what_it_was_grown_for() {
        let is = |k: u64| move |p: Pos| u64::from(p.node) == k;
        let mut m = EngineMap::default();
        for k in 0..10_000u64 {
            m.insert(k, pos(k, 0), is(k));
        }
        let more = 5_000;
        assert!(m.would_grow(more));
        let buckets = m.buckets.len();
        let mut g = m.grown_copy(more);
        assert_eq!((m.buckets.len(), m.len()), (buckets, 10_000));
        assert_eq!(g.len(), 10_000);
        assert!(!g.would_grow(more));
        let grown_to = g.buckets.len();
        for k in 0..10_000u64 {
            assert_eq!(g.get(k, is(k)), Some(pos(k, 0)));
        }
        for k in 10_000..10_000 + more as u64 {
            g.insert(k, pos(k, 0), is(k));
        }
        assert_eq!(g.buckets.len(), grown_to);
        assert_eq!(g.len(), 15_000);
    }

    /// Hashes whose tags collide (an engine could send them) fit in neither of their
    /// two buckets beyond ten; the rest is stashed, and the map neither grows without
    /// bound nor loses one.
    #[test]
    fn hashes_sharing_a_tag_are_stashed_not_grown_for() {
        // tag_of is (fold(h) * C) >> 32 with fold an involution: invert it for 60 hashes
        // whose products share their high half.
        let inverse = {
            let c = 0x9e37_79b9_7f4a_7c15u64;
            let mut x = c;
            for _ in 0..5 {
                x = x.wrapping_mul(2u64.wrapping_sub(c.wrapping_mul(x)));
            }
            x
        };
        let hashes: Vec<u64> = (0..60u64)
            .map(|i| {
                let folded = ((0x1234_5678u64 << 32) | i).wrapping_mul(inverse);
                folded ^ (folded >> 32)
            })
            .collect();
        assert!(hashes.iter().all(|h| tag_of(*h) == 0x1234_5678));
        let mut m = EngineMap::default();
        for (n, h) in hashes.iter().enumerate() {
            let is = |p: Pos| u64::from(p.abs) == *h & 0xffff_ffff;
            assert_eq!(m.insert(*h, pos(n as u64, *h as u32), is), None);
        }
        assert_eq!(m.len(), 60);
        assert!(m.slots() < 200, "grew to {} slots", m.slots());
        for (n, h) in hashes.iter().enumerate() {
            let is = |p: Pos| u64::from(p.abs) == *h & 0xffff_ffff;
            assert_eq!(m.get(*h, is), Some(pos(n as u64, *h as u32)));
        }
        assert_eq!(m.positions().count(), 60);
        for (n, h) in hashes.iter().enumerate() {
            assert!(m.remove_at(*h, pos(n as u64, *h as u32)));
        }
        assert_eq!(m.len(), 0);
    }

    /// Churn at a flat size (each new hash replacing an old one) keeps the map at the
    /// size it had: no deleted slots to accumulate, no growth.
    #[test]
    fn churn_at_a_flat_size_keeps_the_size() {
        let mut m = EngineMap::default();
        for k in 0..50_000u64 {
            m.insert(k, pos(k, 0), |p| u64::from(p.node) == k);
        }
        let slots = m.slots();
        for k in 50_000..1_000_000u64 {
            m.insert(k, pos(k, 0), |p| u64::from(p.node) == k);
            let old = k - 50_000;
            assert!(m.remove_at(old, pos(old, 0)));
        }
        assert_eq!(m.len(), 50_000);
        assert_eq!(m.slots(), slots);
    }
}
