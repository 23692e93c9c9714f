//! A growable bitset of worker slots, inline for up to 64 slots.
//!
//! Owns nothing but bits; the prefix index uses it to intersect "who holds this
//! block" across a prompt's blocks with a few word operations per block.

use smallvec::SmallVec;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct SlotSet {
    words: SmallVec<[u64; 1]>,
}

impl SlotSet {
    #[inline]
    pub(crate) fn insert(&mut self, slot: u16) {
        let (w, b) = (slot as usize / 64, slot as usize % 64);
        if self.words.len() <= w {
            self.words.resize(w + 1, 0);
        }
        self.words[w] |= 1 << b;
    }

    #[inline]
    pub(crate) fn remove(&mut self, slot: u16) {
        let (w, b) = (slot as usize / 64, slot as usize % 64);
        if let Some(word) = self.words.get_mut(w) {
            *word &= !(1 << b);
        }
        while self.words.last() == Some(&0) {
            self.words.pop();
        }
    }

    #[inline]
    pub(crate) fn contains(&self, slot: u16) -> bool {
        let (w, b) = (slot as usize / 64, slot as usize % 64);
        self.words.get(w).is_some_and(|word| word & (1 << b) != 0)
    }

    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    #[inline]
    pub(crate) fn words(&self) -> &[u64] {
        &self.words
    }
}

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
    fn insert_remove_contains_beyond_one_word() {
        let mut s = SlotSet::default();
        s.insert(3);
        s.insert(130);
        assert!(s.contains(3) && s.contains(130) && !s.contains(4));
        s.remove(130);
        assert_eq!(s.words().len(), 1, "trailing empty words are dropped");
        s.remove(3);
        assert!(s.is_empty());
    }
}
