//! The virtual clock's agenda: what happens next, in one deterministic order.
//!
//! Owns ordering only: entries come out by time, then by [`Phase`] (so that, at one
//! instant, events published earlier are applied before a request is routed, and a
//! request arriving at the instant an engine step ends joins the next step, as the
//! mock engine's loop drains its queue before stepping), then in insertion order. It
//! must not know what an entry means.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// Order of entries that fall on the same virtual instant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    /// A scheduled fleet change (add, remove, restart, reset) or an engine coming back.
    Change,
    /// KV events reaching the router.
    Deliver,
    /// An engine step ending: its tokens reach the clients.
    StepDone,
    /// A client sending a request.
    Send,
    /// An engine starting its next step.
    Kick,
}

struct Entry<T> {
    at_ms: f64,
    phase: Phase,
    seq: u64,
    what: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl<T> Eq for Entry<T> {}

impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Entry<T> {
    /// Reversed: the binary heap pops its greatest entry, the agenda its earliest.
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .at_ms
            .total_cmp(&self.at_ms)
            .then(other.phase.cmp(&self.phase))
            .then(other.seq.cmp(&self.seq))
    }
}

/// Entries by virtual time (ms), phase, and insertion order.
pub(crate) struct Agenda<T> {
    heap: BinaryHeap<Entry<T>>,
    seq: u64,
}

impl<T> Agenda<T> {
    pub(crate) fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }

    pub(crate) fn push(&mut self, at_ms: f64, phase: Phase, what: T) {
        self.seq += 1;
        self.heap.push(Entry {
            at_ms,
            phase,
            seq: self.seq,
            what,
        });
    }

    /// Whether nothing is left to happen.
    pub(crate) fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }

    /// The earliest entry and its time.
    pub(crate) fn pop(&mut self) -> Option<(f64, T)> {
        self.heap.pop().map(|e| (e.at_ms, e.what))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_come_out_by_time_then_phase_then_insertion() {
        let mut a = Agenda::new();
        a.push(5.0, Phase::Kick, "kick@5");
        a.push(5.0, Phase::Send, "send@5");
        a.push(1.0, Phase::Kick, "kick@1");
        a.push(5.0, Phase::Deliver, "deliver@5");
        a.push(5.0, Phase::Send, "send@5 second");
        let order: Vec<_> = std::iter::from_fn(|| a.pop().map(|(_, w)| w)).collect();
        assert_eq!(
            order,
            ["kick@1", "deliver@5", "send@5", "send@5 second", "kick@5"]
        );
    }
}
