//! Block hashing: token ids → fixed-size blocks → chained content keys.
//!
//! Owns the one hash function kvgate uses for prompt prefixes. The same function keys
//! request prompts and the `token_ids` carried by engine KV events, so the router never
//! needs to reproduce an engine's own (seeded, algorithm-dependent) block hashes.
//! It must not know about workers, tiers or engines.
//!
//! A block's key is computed in two steps. First its *content hash*
//! `c = gxhash64(tokens of the block)`, which does not depend on the parent (so the
//! CPU hashes many blocks of a prompt in parallel); then the chain step
//! `key = mix(parent key, c)`, where `mix(a, b)` is the folded 64×64→128-bit multiply
//! of wyhash/rapidhash (`lo ^ hi` of `(a ^ K0) * (b ^ K1)`), one multiply of latency per
//! block. The root seed is derived from the model-wide salt and the request's LoRA
//! adapter name and is also the parent of the first block, so a key identifies the
//! whole prefix up to and including its block. A trailing partial block is not a block
//! and gets no key.
//!
//! Why gxhash: hashing is most of a lookup (an 8,192-token prompt is 512 blocks; its
//! keys 2.0-2.4 µs of a 2.5-2.9 µs lookup, `cargo bench -p kvgate-core --bench
//! selection`, docs/BENCHMARKS.md section 10), so it is done with gxhash, a handful of
//! AES rounds per block. It needs the CPU's AES instructions at build time
//! (`.cargo/config.toml`) and at run time ([`cpu_can_hash_blocks`]). Its output is the
//! same on every platform for one version, which is pinned: replicas compare keys
//! (snapshots, decisions at a leader), so every replica of a fleet must run the same
//! scheme, and [`BlockHasher::fingerprint`] lets them check that they do.

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

/// Domain separator so an empty salt still yields a fixed, non-zero root seed. Its
/// version names the key scheme: v1 hashed block contents with xxh3, v2 with gxhash.
const ROOT_DOMAIN: &[u8] = b"kvgate/block-key/v2";

/// Whether this CPU has the instructions block hashing was built with (AES-NI on
/// x86-64; checked through CPUID, because the build's target features make the
/// standard runtime check answer yes at compile time). A binary started on a CPU
/// without them would die of an illegal instruction at the first request; `kvgate`
/// checks this first and says why instead ([`CPU_CANNOT_HASH_BLOCKS`]).
pub fn cpu_can_hash_blocks() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // CPUID leaf 1, ECX bit 25: AES-NI (SSE2, the other feature, is part of
        // x86-64).
        #[allow(unused_unsafe)]
        let leaf = unsafe { std::arch::x86_64::__cpuid(1) };
        leaf.ecx & (1 << 25) != 0
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        // aarch64 builds need the crypto extension, which the aarch64 server CPUs
        // (Graviton, Grace, Ampere) have; the standard check cannot tell (it is
        // decided at compile time), so none is made.
        true
    }
}

/// What the binary and the Python module say when [`cpu_can_hash_blocks`] is false.
pub const CPU_CANNOT_HASH_BLOCKS: &str = "kvgate: this CPU lacks the AES instructions \
    (AES-NI) kvgate's block hashing is built on; Intel Xeons have had them since 2010, AMD \
    CPUs since 2011. In a virtual machine, expose the host CPU's features (e.g. QEMU's -cpu \
    host).";

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
        BlockKey(mix(parent, content_hash(block_tokens)))
    }

    /// A number that differs between two hashers that would key the same tokens
    /// differently: the key of a fixed probe block, so it covers the key scheme, the
    /// block size and the salt. Replicas compare it before they exchange keys.
    pub fn fingerprint(&self) -> u64 {
        // On the stack for every usual block size: replicas compute it per decision.
        let probe: smallvec::SmallVec<[u32; 64]> = (0..self.block_size).collect();
        self.chain(None, &probe).0
    }

    /// Keys of every full block of `tokens`, from the start of the sequence.
    pub fn block_keys(&self, tokens: &[u32]) -> Vec<BlockKey> {
        let mut out = vec![BlockKey(0); self.full_blocks(tokens.len())];
        self.write_keys(None, tokens, &mut out);
        out
    }

    /// Writes the keys of the full blocks of `tokens`, chained after `parent`, into
    /// `out`, one block per element, as many as both have. Returns the key of the last
    /// block written (or `parent` when none was).
    pub fn write_keys(
        &self,
        parent: Option<BlockKey>,
        tokens: &[u32],
        out: &mut [BlockKey],
    ) -> Option<BlockKey> {
        if out.is_empty() || self.full_blocks(tokens.len()) == 0 {
            return parent;
        }
        let root = parent.map_or(self.root_seed, |p| p.0);
        // The usual block sizes get a loop whose block length is a constant, so the
        // content hash's length checks fold away: at 16 tokens a prompt's keys take 30%
        // less time than in the general loop (docs/BENCHMARKS.md section 10).
        let last = match self.block_size {
            16 => chain_into(root, sized_blocks::<16>(tokens), out),
            32 => chain_into(root, sized_blocks::<32>(tokens), out),
            64 => chain_into(root, sized_blocks::<64>(tokens), out),
            size => chain_into(root, tokens.chunks_exact(size as usize), out),
        };
        Some(BlockKey(last))
    }
}

/// Hash of one block's tokens alone (not chained, not salted: the salt enters through
/// the chain, whose first parent is the root seed).
#[inline(always)]
fn content_hash(block_tokens: &[u32]) -> u64 {
    let bytes = bytemuck::cast_slice::<u32, u8>(block_tokens);
    if bytes.len() >= SHORT_INPUT {
        return gxhash::gxhash64(bytes, 0);
    }
    // Blocks of one to three tokens (SGLang's pages can be one token): gxhash loads a
    // whole 16-byte vector from an input this short and masks off the bytes past its
    // end, a read out of bounds that an optimized build may turn into anything (a
    // release build hashed such a block differently from a stack array than from a
    // heap one). Hash a zero-padded copy instead: the same value, read within bounds.
    let mut padded = [0u8; SHORT_INPUT];
    padded[..bytes.len()].copy_from_slice(bytes);
    gxhash::gxhash64(&padded[..bytes.len()], 0)
}

/// Inputs shorter than this are read by gxhash as one 16-byte vector, past their end.
const SHORT_INPUT: usize = 16;

/// Chains `blocks` after `last` into `out`, one key per element, as many as both have;
/// returns the last key. The content hashes do not depend on the chain, so the CPU
/// overlaps them; only the one-multiply chain step is serial (the chain is a local, kept
/// in a register: carried through memory, as a closure's captured state can be, it
/// costs a store and a load per block on that serial path).
#[inline(always)]
fn chain_into<'a>(
    mut last: u64,
    blocks: impl Iterator<Item = &'a [u32]>,
    out: &mut [BlockKey],
) -> u64 {
    for (slot, block) in out.iter_mut().zip(blocks) {
        last = mix(last, content_hash(block));
        *slot = BlockKey(last);
    }
    last
}

/// The full blocks of `tokens` as slices whose length, `N`, the compiler knows.
#[inline(always)]
fn sized_blocks<const N: usize>(tokens: &[u32]) -> impl Iterator<Item = &[u32]>
where
    [u32; N]: bytemuck::Pod,
{
    let full = tokens.len() / N * N;
    bytemuck::cast_slice::<u32, [u32; N]>(&tokens[..full])
        .iter()
        .map(|block| block.as_slice())
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_1234: u64 = 0x236a_c7c6_5ea3_ad5d;
    const KEY_TWO_BLOCKS: u64 = 0x7068_104c_9db7_85bd;

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

    /// Replicas and releases must agree on keys: a dependency update or a platform
    /// whose keys differ fails here, not silently in a mixed fleet.
    #[test]
    fn keys_are_the_same_in_every_build() {
        let h = BlockHasher::new(4).unwrap();
        let keys = h.block_keys(&[1, 2, 3, 4, 151_643, 0, 7, u32::MAX]);
        assert_eq!(
            keys,
            vec![BlockKey(KEY_1234), BlockKey(KEY_TWO_BLOCKS)],
            "block keys changed: {keys:x?}"
        );
    }

    #[test]
    fn distinct_blocks_get_distinct_keys() {
        let h = BlockHasher::new(16).unwrap();
        let mut seen = std::collections::HashSet::new();
        // Blocks that differ in one token, anywhere, by one.
        for i in 0..50_000u32 {
            let mut block = [1_000_000u32; 16];
            block[(i % 16) as usize] = i / 16;
            assert!(seen.insert(h.block_keys(&block)[0]), "collision at {i}");
        }
    }

    #[test]
    fn fingerprint_tells_schemes_apart() {
        let h = BlockHasher::new(16).unwrap();
        assert_eq!(h.fingerprint(), BlockHasher::new(16).unwrap().fingerprint());
        assert_ne!(h.fingerprint(), BlockHasher::new(32).unwrap().fingerprint());
        assert_ne!(
            h.fingerprint(),
            BlockHasher::with_salt(16, b"x").unwrap().fingerprint()
        );
    }

    #[test]
    fn this_cpu_can_hash_blocks() {
        assert!(cpu_can_hash_blocks());
    }

    /// Blocks under 16 bytes are hashed from a padded copy (gxhash would read past
    /// them): the keys are the ones gxhash gives such a block in place, pinned here, and
    /// a block hashes alike from a stack array and from the heap (an optimized build
    /// hashed the last block of a stack array wrongly before; see
    /// `write_keys_continues_a_chain`, which `scripts/test.sh` also runs optimized).
    #[test]
    fn short_blocks_keep_their_keys() {
        let pinned: [(u32, [u64; 3]); 3] = [
            (
                1,
                [0xde33b24408617b29, 0xf6abf24fa49dcbdd, 0x2ce4f23d8c638d76],
            ),
            (
                2,
                [0x211a1e00838ccb95, 0xd8582ecc5f52b2b0, 0xfc54512a5b2ebf26],
            ),
            (
                3,
                [0x39073e8143b97d1f, 0x3268b9494440c693, 0x1bdaa9d20a462800],
            ),
        ];
        let stack: [u32; 9] = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        for (block_size, keys) in pinned {
            let h = BlockHasher::new(block_size).unwrap();
            let tokens = &stack[..3 * block_size as usize];
            let expected: Vec<BlockKey> = keys.into_iter().map(BlockKey).collect();
            assert_eq!(h.block_keys(tokens), expected, "block size {block_size}");
            let heap: Vec<u32> = tokens.to_vec();
            assert_eq!(h.block_keys(&heap), expected);
        }
    }

    #[test]
    fn write_keys_continues_a_chain() {
        let h = BlockHasher::new(2).unwrap();
        let whole = h.block_keys(&[1, 2, 3, 4, 5, 6]);
        let mut split = [BlockKey(0); 3];
        let last = h.write_keys(None, &[1, 2], &mut split[..1]);
        assert_eq!(last, Some(whole[0]));
        h.write_keys(last, &[3, 4, 5, 6], &mut split[1..]);
        assert_eq!(whole, split);
        // As many keys as both have: a shorter `out` takes the first blocks.
        let mut first = [BlockKey(0); 1];
        assert_eq!(
            h.write_keys(None, &[1, 2, 3, 4], &mut first),
            Some(whole[0])
        );
    }

    /// The loops specialised for the usual block sizes key blocks exactly as `chain`
    /// does, one block at a time, after a parent or from the root, a trailing partial
    /// block left out.
    #[test]
    fn every_block_size_keys_blocks_as_chain_does() {
        let tokens: Vec<u32> = (0..700u32).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        for size in [1, 3, 15, 16, 17, 31, 32, 33, 64, 65, 128] {
            let h = BlockHasher::with_salt(size, b"s").unwrap();
            for parent in [None, Some(BlockKey(42))] {
                let mut expected = Vec::new();
                let mut last = parent;
                for block in tokens.chunks_exact(size as usize) {
                    let key = h.chain(last, block);
                    expected.push(key);
                    last = Some(key);
                }
                let mut out = vec![BlockKey(7); expected.len() + 1];
                let returned = h.write_keys(parent, &tokens, &mut out);
                assert_eq!(
                    out[..expected.len()],
                    expected[..],
                    "size {size}, {parent:?}"
                );
                assert_eq!(
                    out[expected.len()],
                    BlockKey(7),
                    "size {size}: one key a block"
                );
                assert_eq!(returned, last, "size {size}, parent {parent:?}");
                if parent.is_none() {
                    assert_eq!(h.block_keys(&tokens), expected, "size {size}");
                }
            }
            let mut out = [BlockKey(7)];
            assert_eq!(
                h.write_keys(Some(BlockKey(9)), &[], &mut out),
                Some(BlockKey(9))
            );
            assert_eq!(out, [BlockKey(7)]);
        }
    }
}
