//! The paged KV cache with prefix caching: blocks, reference counts, the engine's
//! opaque block hashes, and LRU eviction of unreferenced cached blocks.
//!
//! Owns block bookkeeping only. It knows nothing about requests, scheduling, time or
//! I/O; the scheduler decides which blocks a request needs and the cache reports every
//! eviction as a [`KvEvent`]. All operations are O(1) per block (intrusive LRU list,
//! hash map), with no allocation proportional to the cache size after construction.

use rustc_hash::FxHashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::events::KvEvent;

/// Index of a physical block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockId(pub u32);

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Block {
    /// Engine hash while the block is registered in the prefix cache.
    hash: Option<u64>,
    ref_cnt: u32,
    prev: u32,
    next: u32,
    in_lru: bool,
}

/// Hashes full blocks into opaque, seeded engine hashes (like vLLM's per-process
/// seeded hashes: a router cannot reproduce them without the seed).
#[derive(Debug, Clone)]
pub struct EngineHasher {
    seed: u64,
    scratch: Vec<u8>,
}

impl EngineHasher {
    /// A hasher whose outputs depend on `seed` (derived from `--seed`).
    pub fn new(seed: u64) -> Self {
        // Scramble the user seed so that seed 0 is not xxh3's default.
        let mixed = splitmix64(seed ^ 0x6b76_6761_7465_6d6b);
        Self {
            seed: mixed,
            scratch: Vec::new(),
        }
    }

    /// Chained hash of one full block: depends on the parent's hash and the tokens.
    pub fn block_hash(&mut self, parent: Option<u64>, tokens: &[u32]) -> u64 {
        self.scratch.clear();
        match parent {
            Some(p) => {
                self.scratch.push(1);
                self.scratch.extend_from_slice(&p.to_le_bytes());
            }
            None => self.scratch.push(0),
        }
        for t in tokens {
            self.scratch.extend_from_slice(&t.to_le_bytes());
        }
        xxh3_64_with_seed(&self.scratch, self.seed)
    }
}

/// SplitMix64 finaliser: a cheap, well-mixed deterministic u64 -> u64 map.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A uniform draw in the open interval (0, 1) from `splitmix64(key)`: never 0 or 1, so
/// its logarithm is finite.
pub fn unit_draw(key: u64) -> f64 {
    ((splitmix64(key) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Counters the cache keeps about itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub evictions: u64,
    pub stored: u64,
    pub duplicates: u64,
}

/// A fixed pool of blocks with a hash → block prefix-cache map.
///
/// Free blocks live in two places: `empty` (never cached, or dropped from the cache)
/// and the LRU list (cached, unreferenced, reusable on a prefix hit). A new block comes
/// from `empty` first; only when it is exhausted is the least-recently-used cached
/// block evicted (one `BlockRemoved` event each).
#[derive(Debug, Clone)]
pub struct KvCache {
    block_size: u32,
    blocks: Vec<Block>,
    empty: Vec<u32>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    map: FxHashMap<u64, u32>,
    stats: CacheStats,
}

impl KvCache {
    /// A cache of `num_blocks` blocks of `block_size` tokens each.
    pub fn new(num_blocks: u32, block_size: u32) -> Self {
        let blocks = vec![
            Block {
                hash: None,
                ref_cnt: 0,
                prev: NIL,
                next: NIL,
                in_lru: false,
            };
            num_blocks as usize
        ];
        // Pop order: block 0 first.
        let empty = (0..num_blocks).rev().collect();
        Self {
            block_size,
            blocks,
            empty,
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            map: FxHashMap::with_capacity_and_hasher(num_blocks as usize, Default::default()),
            stats: CacheStats::default(),
        }
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Blocks that can be handed out now (empty + evictable cached).
    pub fn num_free(&self) -> usize {
        self.empty.len() + self.lru_len
    }

    /// Blocks referenced by at least one request.
    pub fn num_used(&self) -> usize {
        self.blocks.len() - self.num_free()
    }

    /// Blocks registered in the prefix cache (referenced or not).
    pub fn num_cached(&self) -> usize {
        self.map.len()
    }

    /// KV usage fraction like vLLM's `kv_cache_usage_perc` (0..1).
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        self.num_used() as f64 / self.blocks.len() as f64
    }

    pub fn stats(&self) -> CacheStats {
        self.stats
    }

    /// The cached block holding `hash`, if any.
    pub fn lookup(&self, hash: u64) -> Option<BlockId> {
        self.map.get(&hash).map(|&b| BlockId(b))
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// Whether `block` is currently unreferenced (so acquiring it uses up a free block).
    pub fn is_free(&self, block: BlockId) -> bool {
        self.blocks[block.0 as usize].ref_cnt == 0
    }

    /// Take a reference on a cached block found by a prefix hit (removes it from the
    /// LRU list if it was unreferenced).
    pub fn acquire(&mut self, block: BlockId) {
        let idx = block.0;
        if self.blocks[idx as usize].in_lru {
            self.lru_unlink(idx);
        }
        self.blocks[idx as usize].ref_cnt += 1;
    }

    /// Hand out a fresh block (ref count 1), evicting the LRU cached block if no empty
    /// block is left. Returns None when every block is referenced.
    pub fn allocate(&mut self, events: &mut Vec<KvEvent>) -> Option<BlockId> {
        let idx = match self.empty.pop() {
            Some(idx) => idx,
            None => {
                let idx = self.lru_head;
                if idx == NIL {
                    return None;
                }
                self.lru_unlink(idx);
                if let Some(hash) = self.blocks[idx as usize].hash.take() {
                    self.map.remove(&hash);
                    self.stats.evictions += 1;
                    events.push(KvEvent::BlockRemoved {
                        block_hashes: vec![hash],
                    });
                }
                idx
            }
        };
        let block = &mut self.blocks[idx as usize];
        debug_assert_eq!(block.ref_cnt, 0);
        block.ref_cnt = 1;
        Some(BlockId(idx))
    }

    /// Register a freshly computed full block under `hash`. Returns false (and leaves
    /// the block uncached) when another block already holds that content.
    pub fn register(&mut self, block: BlockId, hash: u64) -> bool {
        if self.map.contains_key(&hash) {
            self.stats.duplicates += 1;
            return false;
        }
        let b = &mut self.blocks[block.0 as usize];
        debug_assert!(b.hash.is_none());
        b.hash = Some(hash);
        self.map.insert(hash, block.0);
        self.stats.stored += 1;
        true
    }

    /// Drop one reference. An unreferenced cached block goes to the LRU tail (most
    /// recently used); an unreferenced uncached block becomes empty.
    pub fn release(&mut self, block: BlockId) {
        let idx = block.0;
        let b = &mut self.blocks[idx as usize];
        debug_assert!(b.ref_cnt > 0);
        b.ref_cnt = b.ref_cnt.saturating_sub(1);
        if b.ref_cnt == 0 {
            if b.hash.is_some() {
                self.lru_push_back(idx);
            } else {
                self.empty.push(idx);
            }
        }
    }

    /// Drop the whole prefix cache, like vLLM's `reset_prefix_cache`: refused (false)
    /// while any block is referenced. On success emits one `AllBlocksCleared`.
    pub fn reset(&mut self, events: &mut Vec<KvEvent>) -> bool {
        if self.num_used() > 0 {
            return false;
        }
        while self.lru_head != NIL {
            let idx = self.lru_head;
            self.lru_unlink(idx);
            self.blocks[idx as usize].hash = None;
            self.empty.push(idx);
        }
        self.map.clear();
        events.push(KvEvent::AllBlocksCleared);
        true
    }

    /// Every cached engine hash (for accuracy checks and tests; O(cached blocks)).
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.map.keys().copied().collect()
    }

    fn lru_unlink(&mut self, idx: u32) {
        let (prev, next) = {
            let b = &self.blocks[idx as usize];
            (b.prev, b.next)
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[idx as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_lru = false;
        self.lru_len -= 1;
    }

    fn lru_push_back(&mut self, idx: u32) {
        let tail = self.lru_tail;
        {
            let b = &mut self.blocks[idx as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_lru = true;
        }
        if tail == NIL {
            self.lru_head = idx;
        } else {
            self.blocks[tail as usize].next = idx;
        }
        self.lru_tail = idx;
        self.lru_len += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_seeded_and_chained() {
        let mut a = EngineHasher::new(1);
        let mut b = EngineHasher::new(2);
        let t = [1u32, 2, 3, 4];
        assert_ne!(a.block_hash(None, &t), b.block_hash(None, &t));
        let root = a.block_hash(None, &t);
        assert_ne!(a.block_hash(Some(root), &t), root);
        assert_eq!(
            a.block_hash(None, &t),
            EngineHasher::new(1).block_hash(None, &t)
        );
    }

    #[test]
    fn empty_blocks_are_used_before_evicting() {
        let mut c = KvCache::new(3, 4);
        let mut ev = Vec::new();
        let b0 = c.allocate(&mut ev).unwrap();
        assert!(c.register(b0, 10));
        c.release(b0);
        assert_eq!(c.num_free(), 3);
        let b1 = c.allocate(&mut ev).unwrap();
        let b2 = c.allocate(&mut ev).unwrap();
        assert!(ev.is_empty());
        assert!(c.contains(10));
        let b3 = c.allocate(&mut ev).unwrap();
        assert_eq!(b3, b0);
        assert_eq!(
            ev,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![10]
            }]
        );
        assert!(!c.contains(10));
        assert!(c.allocate(&mut ev).is_none());
        for b in [b1, b2, b3] {
            c.release(b);
        }
        assert_eq!(c.num_used(), 0);
    }

    #[test]
    fn lru_order_and_touch_on_hit() {
        let mut c = KvCache::new(3, 4);
        let mut ev = Vec::new();
        let ids: Vec<_> = (0..3).map(|_| c.allocate(&mut ev).unwrap()).collect();
        for (i, b) in ids.iter().enumerate() {
            assert!(c.register(*b, 100 + i as u64));
        }
        for b in &ids {
            c.release(*b);
        }
        // Hit on 100 then release: it becomes most recently used.
        let hit = c.lookup(100).unwrap();
        c.acquire(hit);
        c.release(hit);
        c.allocate(&mut ev).unwrap();
        c.allocate(&mut ev).unwrap();
        assert_eq!(
            ev,
            vec![
                KvEvent::BlockRemoved {
                    block_hashes: vec![101]
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![102]
                }
            ]
        );
        assert!(c.contains(100));
    }

    #[test]
    fn duplicates_stay_uncached_and_reset_needs_idle_cache() {
        let mut c = KvCache::new(4, 4);
        let mut ev = Vec::new();
        let a = c.allocate(&mut ev).unwrap();
        let b = c.allocate(&mut ev).unwrap();
        assert!(c.register(a, 7));
        assert!(!c.register(b, 7));
        assert!(!c.reset(&mut ev));
        c.release(a);
        c.release(b);
        assert_eq!(c.num_cached(), 1);
        assert!(c.reset(&mut ev));
        assert_eq!(ev, vec![KvEvent::AllBlocksCleared]);
        assert_eq!(c.num_cached(), 0);
        assert_eq!(c.num_free(), 4);
    }
}
