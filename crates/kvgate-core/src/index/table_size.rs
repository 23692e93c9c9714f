//! Keeps the index's hash tables at their size under insert/remove churn.
//!
//! hashbrown marks most removed slots as deleted rather than empty, and an insert into a
//! table whose free room is used up by deleted slots rehashes it in place only while at
//! most half of it is live; above that it doubles. An index at its cap under prefix
//! churn (unique blocks arriving and being evicted, live count flat) therefore doubled
//! its hash tables every few tens of millions of events' worth of deleted slots, until
//! the next power of two left them half empty: memory stepped up by 70-90% with nothing
//! more held. (The engine-hash maps, the largest tables, have no deleted slots at all:
//! `engine_map.rs`; this keeps the table of run starts flat.) Before an insert that would make such a
//! table grow, [`TableSize::must_rebuild`] says whether at least an eighth of it is
//! deleted slots; the owner then rebuilds it at the same size, which takes the deleted
//! slots out. Each rebuild frees an eighth of the table or more, so its cost is at most
//! eight moves per slot it frees. Owns only that decision; the tables are the index's.

/// The size a table reached, to tell deleted slots from real growth.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct TableSize {
    /// Items the table holds at its current size with no deleted slots (hashbrown's
    /// `capacity()` right after it was allocated or rehashed).
    full: usize,
}

impl TableSize {
    /// Whether a table with `len` items and room for `capacity` (items plus the inserts
    /// it takes before it must grow or rehash) should be rebuilt at its size before the
    /// next insert of a new item.
    #[inline]
    pub(super) fn must_rebuild(&mut self, len: usize, capacity: usize) -> bool {
        // Only a resize or a rehash raises `capacity` (items plus growth left); deleted
        // slots lower it.
        self.full = self.full.max(capacity);
        len == capacity && len < self.full - self.full / 8
    }

    /// Items the table holds at its size with no deleted slots.
    pub(super) fn full(&self) -> usize {
        self.full
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebuilds_only_a_table_whose_room_went_to_deleted_slots() {
        let mut size = TableSize::default();
        // A fresh table with room for 896 items.
        assert!(!size.must_rebuild(0, 896));
        assert!(!size.must_rebuild(500, 896));
        // Full of live items: real growth, left to the table.
        assert!(!size.must_rebuild(896, 896));
        // Room used up by deleted slots with 600 live: rebuild.
        assert!(size.must_rebuild(600, 600));
        // Deleted slots but fewer than an eighth: let it grow.
        assert!(!size.must_rebuild(800, 800));
        // After the table doubled, its new size counts.
        assert!(!size.must_rebuild(900, 1792));
        assert_eq!(size.full(), 1792);
    }
}
