//! Words of worker-slot bits: the index keeps "who holds this block" as one bit per
//! slot, 64 slots per word, so a prompt's blocks are intersected across all slots
//! with a few word operations. Owns only the bit iteration.

/// Calls `f` for every slot whose bit is set in `word` (word index `w`).
#[inline]
pub(crate) fn for_each_bit(w: usize, mut word: u64, mut f: impl FnMut(u16)) {
    while word != 0 {
        let b = word.trailing_zeros() as usize;
        f((w * 64 + b) as u16);
        word &= word - 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visits_every_set_bit_with_its_slot_number() {
        let mut seen = Vec::new();
        for_each_bit(2, (1 << 3) | (1 << 63), |s| seen.push(s));
        assert_eq!(seen, [131, 191]);
    }
}
