//! Block hashing: token ids → fixed-size blocks → chained content keys.
//!
//! Owns the one hash function kvgate uses for prompt prefixes. The same function keys
//! request prompts and the `token_ids` carried by engine KV events, so the router never
//! needs to reproduce an engine's own (seeded, algorithm-dependent) block hashes.
//! It must not know about workers, tiers or engines.
//!
//! A block's key is computed in two steps. First its *content hash*
//! `c = xxh3_64(tokens of the block, seed = root)`, which does not depend on the parent
//! (so the CPU hashes many blocks of a prompt in parallel); then the chain step
//! `key = mix(parent key, c)`, where `mix(a, b)` is the folded 64×64→128-bit multiply
//! of wyhash/rapidhash (`lo ^ hi` of `(a ^ K0) * (b ^ K1)`), one multiply of latency per
//! block. The root seed is derived from the model-wide salt and the request's LoRA
//! adapter name and is also the parent of the first block, so a key identifies the
//! whole prefix up to and including its block. A trailing partial block is not a block
//! and gets no key.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

/// Content key of one full block, chained with every block before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BlockKey(pub u64);

/// Error for a block size of zero (configuration must reject it before hashing).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZeroBlockSize;

impl std::fmt::Display for ZeroBlockSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("block size must be at least 1 token")
    }
}
impl std::error::Error for ZeroBlockSize {}

/// Domain separator so an empty salt still yields a fixed, non-zero root seed.
const ROOT_DOMAIN: &[u8] = b"kvgate/block-key/v1";

/// Chain step: the folded multiply of wyhash/rapidhash over the parent key and the
/// block's content hash. The constants are the first digits of pi (as in rapidhash's
/// secret), so neither input can be zero by accident of a zero key.
#[inline(always)]
fn mix(parent: u64, content: u64) -> u64 {
    const K0: u64 = 0x243f_6a88_85a3_08d3;
    const K1: u64 = 0x1319_8a2e_0370_7344;
    let r = u128::from(parent ^ K0) * u128::from(content ^ K1);
    (r as u64) ^ ((r >> 64) as u64)
}

/// Hashes token sequences into chained block keys for one block size and salt.
///
/// Cheap to copy; derive a per-request hasher with [`BlockHasher::for_lora`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockHasher {
    block_size: u32,
    root_seed: u64,
}

impl BlockHasher {
    /// A hasher for `block_size`-token blocks with no salt.
    pub fn new(block_size: u32) -> Result<Self, ZeroBlockSize> {
        Self::with_salt(block_size, &[])
    }

    /// A hasher whose keys are additionally salted (e.g. a deployment-wide cache salt).
    /// Different salts give unrelated keys for the same tokens.
    pub fn with_salt(block_size: u32, salt: &[u8]) -> Result<Self, ZeroBlockSize> {
        if block_size == 0 {
            return Err(ZeroBlockSize);
        }
        let mut buf = Vec::with_capacity(ROOT_DOMAIN.len() + salt.len());
        buf.extend_from_slice(ROOT_DOMAIN);
        buf.extend_from_slice(salt);
        Ok(Self {
            block_size,
            root_seed: xxh3_64(&buf),
        })
    }

    /// The same hasher with the LoRA adapter name folded into the root seed: requests
    /// (and engine events) for different adapters never share keys. `None` or an empty
    /// name is the base model and returns `self` unchanged.
    pub fn for_lora(&self, lora_name: Option<&str>) -> Self {
        match lora_name {
            None | Some("") => *self,
            Some(name) => Self {
                block_size: self.block_size,
                root_seed: xxh3_64_with_seed(name.as_bytes(), self.root_seed ^ 0x4c6f_5241),
            },
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Number of full blocks in `token_count` tokens.
    pub fn full_blocks(&self, token_count: usize) -> usize {
        token_count / self.block_size as usize
    }

    /// Key of one block given its parent's key (`None` for the first block).
    #[inline]
    pub fn chain(&self, parent: Option<BlockKey>, block_tokens: &[u32]) -> BlockKey {
        let parent = match parent {
            Some(p) => p.0,
            None => self.root_seed,
        };
        BlockKey(mix(parent, self.content_hash(block_tokens)))
    }

    /// Hash of one block's tokens alone (salted by the root seed, not chained).
    #[inline]
    fn content_hash(&self, block_tokens: &[u32]) -> u64 {
        xxh3_64_with_seed(
            bytemuck::cast_slice::<u32, u8>(block_tokens),
            self.root_seed,
        )
    }

    /// Keys of every full block of `tokens`, from the start of the sequence.
    pub fn block_keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(self.full_blocks(tokens.len()));
        self.extend_keys(None, tokens, &mut out);
        out
    }

    /// Appends to `out` the keys of the full blocks of `tokens`, chained after `parent`.
    /// Returns the key of the last block appended (or `parent` when none was).
    pub fn extend_keys(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
        out: &mut Vec<BlockKey>,
    ) -> Option<BlockKey> {
        // The content hashes do not depend on the chain, so the CPU overlaps them; only
        // the one-multiply chain step in `chain` is serial.
        out.reserve(self.full_blocks(tokens.len()));
        let mut last = parent;
        for block in tokens.chunks_exact(self.block_size as usize) {
            let key = self.chain(last, block);
            out.push(key);
            last = Some(key);
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_block_size_is_rejected() {
        assert_eq!(BlockHasher::new(0), Err(ZeroBlockSize));
    }

    #[test]
    fn partial_trailing_block_has_no_key() {
        let h = BlockHasher::new(4).unwrap();
        assert_eq!(h.block_keys(&[1, 2, 3]).len(), 0);
        assert_eq!(h.block_keys(&[1, 2, 3, 4, 5, 6, 7]).len(), 1);
        assert_eq!(h.block_keys(&[1, 2, 3, 4, 5, 6, 7, 8]).len(), 2);
    }

    #[test]
    fn key_depends_on_parent() {
        let h = BlockHasher::new(2).unwrap();
        let a = h.block_keys(&[1, 2, 3, 4]);
        let b = h.block_keys(&[9, 9, 3, 4]);
        assert_ne!(
            a[1], b[1],
            "same block after different prefixes must differ"
        );
    }

    #[test]
    fn lora_and_salt_change_keys() {
        let h = BlockHasher::new(2).unwrap();
        let t = [1, 2, 3, 4];
        let base = h.block_keys(&t);
        assert_eq!(h.for_lora(None).block_keys(&t), base);
        assert_eq!(h.for_lora(Some("")).block_keys(&t), base);
        assert_ne!(h.for_lora(Some("sql-adapter")).block_keys(&t), base);
        assert_ne!(
            h.for_lora(Some("a")).block_keys(&t),
            h.for_lora(Some("b")).block_keys(&t)
        );
        let salted = BlockHasher::with_salt(2, b"tenant-7").unwrap();
        assert_ne!(salted.block_keys(&t), base);
    }

    #[test]
    fn extend_keys_continues_a_chain() {
        let h = BlockHasher::new(2).unwrap();
        let whole = h.block_keys(&[1, 2, 3, 4, 5, 6]);
        let mut split = Vec::new();
        let last = h.extend_keys(None, &[1, 2], &mut split);
        h.extend_keys(last, &[3, 4, 5, 6], &mut split);
        assert_eq!(whole, split);
    }
}
