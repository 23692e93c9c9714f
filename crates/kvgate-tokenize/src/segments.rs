//! The ids of text already encoded, by segment: what makes tokenizing a growing
//! conversation cost what is new in it, not its whole history.
//!
//! Why it is exact: the byte-level BPE pipeline ([`crate::fast`]) splits its input at
//! added (special) tokens before anything else runs, then normalizes, pre-tokenizes
//! and encodes each segment between them on its own: no state crosses a special token.
//! A chat template puts special tokens around every message, so a message's text
//! encodes to the same ids wherever it stands, and a segment's ids depend on its text
//! alone. The cache is keyed by that text (a 128-bit hash of it, and its length) and
//! used only on that path; any other tokenizer shape encodes whole, as before.
//!
//! Owns the bounded, shared cache and its counters. Bounded by bytes (ids plus a fixed
//! overhead per entry); what is used least goes first (`quick_cache`'s CLOCK-Pro); a
//! bound of 0 turns it off. Must not encode (fast.rs does).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use quick_cache::sync::Cache;
use quick_cache::Weighter;

/// Segments shorter than this (bytes) are encoded every time: their ids cost less than
/// a lookup's hashing and copying would save (a short turn, a role header).
pub const SEGMENT_MIN_BYTES: usize = 256;

/// What one entry costs beyond its ids: key, `Arc` header, the cache's own slot.
const ENTRY_OVERHEAD_BYTES: u64 = 96;

/// A segment's identity: a 128-bit hash of its text and its length.
type Key = (u128, usize);

#[derive(Clone)]
struct IdBytes;

impl Weighter<Key, Arc<[u32]>> for IdBytes {
    fn weight(&self, _key: &Key, ids: &Arc<[u32]>) -> u64 {
        ids.len() as u64 * 4 + ENTRY_OVERHEAD_BYTES
    }
}

/// Counters of a [`SegmentCache`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SegmentCacheStats {
    /// Segments whose ids came from the cache.
    pub hits: u64,
    /// Segments encoded (and kept, unless larger than the whole bound).
    pub misses: u64,
    /// Bytes the cache holds now (at most its bound).
    pub bytes: u64,
    /// The bound.
    pub max_bytes: u64,
}

/// Segment text → ids, shared by every request of one tokenizer.
pub struct SegmentCache {
    cache: Cache<Key, Arc<[u32]>, IdBytes>,
    max_bytes: u64,
    hits: AtomicU64,
    misses: AtomicU64,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("stats", &self.stats())
            .finish()
    }
}

impl SegmentCache {
    /// A cache of at most `max_bytes` (`None` for 0: no cache).
    pub fn new(max_bytes: u64) -> Option<SegmentCache> {
        if max_bytes == 0 {
            return None;
        }
        // A conversation turn is a few hundred to a few thousand ids.
        let estimated_items = (max_bytes / 4096).clamp(16, 1 << 20) as usize;
        Some(SegmentCache {
            cache: Cache::with_weighter(estimated_items, max_bytes, IdBytes),
            max_bytes,
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        })
    }

    fn key(segment: &str) -> Key {
        (
            xxhash_rust::xxh3::xxh3_128(segment.as_bytes()),
            segment.len(),
        )
    }

    /// The ids of `segment`, if seen.
    pub(crate) fn get(&self, segment: &str) -> Option<Arc<[u32]>> {
        let hit = self.cache.get(&Self::key(segment));
        let counter = if hit.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        hit
    }

    /// Keeps the ids of `segment` (complete ones only).
    pub(crate) fn insert(&self, segment: &str, ids: &[u32]) {
        self.cache.insert(Self::key(segment), Arc::from(ids));
    }

    pub fn stats(&self) -> SegmentCacheStats {
        SegmentCacheStats {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes: self.cache.weight(),
            max_bytes: self.max_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// However much is inserted, the cache holds at most its bound; a bound of 0 is no
    /// cache.
    #[test]
    fn the_cache_stays_under_its_bound() {
        assert!(SegmentCache::new(0).is_none());
        let bound = 64 * 1024;
        let cache = SegmentCache::new(bound).unwrap();
        let ids: Vec<u32> = (0..500).collect();
        for i in 0..2_000 {
            let text = format!("segment {i} {}", "x".repeat(300));
            cache.insert(&text, &ids);
            assert!(cache.stats().bytes <= bound, "{:?}", cache.stats());
        }
        let s = cache.stats();
        assert!(s.bytes > bound / 2, "{s:?}");
        // The latest is kept; no more entries than the bound pays for are held.
        let key = |i: usize| format!("segment {i} {}", "x".repeat(300));
        assert!(cache.get(&key(1999)).is_some());
        let held = (0..2_000).filter(|&i| cache.get(&key(i)).is_some()).count() as u64;
        assert!(
            held <= bound / (500 * 4 + ENTRY_OVERHEAD_BYTES),
            "{held} held"
        );
        assert_eq!(cache.stats().hits + cache.stats().misses, 2_001);
    }
}
