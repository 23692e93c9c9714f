//! The prefix index's table of block entries: a hash table keyed by the block key the
//! entry itself carries, so every bucket is one cache-line-aligned [`BlockEntry`].
//! Owns storage and lookup only; what an entry means is `entry.rs`'s and `mod.rs`'s. An
//! insert that would grow the table only because removals left deleted slots rebuilds it
//! at its size instead (`table_size.rs`), so churn at a flat live count keeps it flat.

use std::hash::BuildHasher;

use hashbrown::hash_table::{Entry, HashTable, OccupiedEntry};
use rustc_hash::FxBuildHasher;

use super::entry::BlockEntry;
use super::table_size::TableSize;
use crate::hashing::BlockKey;

#[derive(Debug, Default)]
pub(super) struct BlockTable {
    table: HashTable<BlockEntry>,
    size: TableSize,
}

#[inline]
fn hash(key: BlockKey) -> u64 {
    FxBuildHasher.hash_one(key.0)
}

impl BlockTable {
    #[inline]
    pub(super) fn get(&self, key: &BlockKey) -> Option<&BlockEntry> {
        self.table.find(hash(*key), |e| e.key() == *key)
    }

    #[inline]
    pub(super) fn get_mut(&mut self, key: &BlockKey) -> Option<&mut BlockEntry> {
        self.table.find_mut(hash(*key), |e| e.key() == *key)
    }

    #[inline]
    pub(super) fn contains_key(&self, key: &BlockKey) -> bool {
        self.get(key).is_some()
    }

    /// The entry of `key`, created with `parent` when absent.
    #[inline]
    pub(super) fn get_or_insert(
        &mut self,
        key: BlockKey,
        parent: Option<BlockKey>,
    ) -> &mut BlockEntry {
        if self
            .size
            .must_rebuild(self.table.len(), self.table.capacity())
            && !self.contains_key(&key)
        {
            self.rebuild();
        }
        match self
            .table
            .entry(hash(key), |e| e.key() == key, |e| hash(e.key()))
        {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => v.insert(BlockEntry::new(key, parent)).into_mut(),
        }
    }

    /// The entry of `key` in a form that can also remove it, with a single lookup.
    #[inline]
    pub(super) fn find_entry(&mut self, key: &BlockKey) -> Option<OccupiedEntry<'_, BlockEntry>> {
        self.table.find_entry(hash(*key), |e| e.key() == *key).ok()
    }

    #[inline]
    pub(super) fn remove(&mut self, key: &BlockKey) {
        if let Ok(o) = self.table.find_entry(hash(*key), |e| e.key() == *key) {
            o.remove();
        }
    }

    /// Moves every entry into a table of the same size, without deleted slots.
    fn rebuild(&mut self) {
        let mut fresh = HashTable::with_capacity(self.size.full());
        for entry in std::mem::take(&mut self.table) {
            fresh.insert_unique(hash(entry.key()), entry, |e| hash(e.key()));
        }
        self.table = fresh;
    }

    pub(super) fn len(&self) -> usize {
        self.table.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = &BlockEntry> {
        self.table.iter()
    }
}
