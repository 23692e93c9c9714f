//! Sequence tracking of one engine event stream (one publisher = one worker rank).
//!
//! Owns the decision of what to do with the next sequence number: apply it, drop it as
//! already applied, treat it as an engine restart, or recover a gap. Pure and
//! synchronous so the rules are unit-tested without sockets; it must not decode,
//! lock or talk to the network.
//!
//! vLLM numbers batches per publisher socket, and each data-parallel rank has its own
//! socket (port + rank), so one cursor per subscribed endpoint is the cursor of that
//! (worker, dp_rank) stream.

/// What to do with a live message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Next in order (or the first message seen): apply it.
    Apply,
    /// First message of a stream that began before we joined (`seq > 0`): warm up by
    /// replaying from 0 when possible, then apply it.
    Join,
    /// Already applied (replay overlap or a duplicate): drop it.
    Stale,
    /// The sequence went backwards: the engine restarted. Purge, then apply it.
    Restart,
    /// Messages `from..seq` were missed: replay them, or purge if that fails.
    Gap { from: u64 },
}

/// Cursor of one stream.
#[derive(Clone, Debug, Default)]
pub struct Cursor {
    /// Last applied sequence number.
    last: Option<u64>,
    /// Live messages up to this seq were already applied through a replay.
    replayed_through: Option<u64>,
}

impl Cursor {
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Classifies live message `seq`.
    pub fn classify(&mut self, seq: u64) -> Verdict {
        if let Some(hi) = self.replayed_through {
            if seq <= hi {
                return Verdict::Stale;
            }
            self.replayed_through = None;
        }
        match self.last {
            None if seq == 0 => Verdict::Apply,
            None => Verdict::Join,
            Some(last) if seq == last.wrapping_add(1) => Verdict::Apply,
            Some(last) if seq == last => Verdict::Stale,
            Some(last) if at_or_before(seq, last) => Verdict::Restart,
            Some(last) => Verdict::Gap {
                from: last.wrapping_add(1),
            },
        }
    }

    /// Whether `seq` is at or before the last applied message, counting in the
    /// wrapping sequence space (seq 0 right after `u64::MAX` is new, not stale).
    pub fn already_applied(&self, seq: u64) -> bool {
        self.last.is_some_and(|last| at_or_before(seq, last))
    }

    /// Records that `seq` was applied (or consumed: undecodable batches advance too).
    pub fn advance(&mut self, seq: u64) {
        self.last = Some(seq);
    }

    /// Records that a replay applied everything up to `seq`, so live copies of those
    /// batches still in flight must be dropped.
    pub fn replayed(&mut self, seq: u64) {
        self.last = Some(seq);
        self.replayed_through = Some(seq);
    }

    /// Forgets the stream (reconnect, purge): the next message starts it afresh.
    pub fn reset(&mut self) {
        *self = Cursor::default();
    }
}

/// `a` is `b` or comes before it, in a wrapping u64 sequence (within half its range).
fn at_or_before(a: u64, b: u64) -> bool {
    b.wrapping_sub(a) < 1 << 63
}

/// Whether sorted replayed sequence numbers cover the gap `from..until` without holes.
/// `seqs` may extend past `until` and may start before `from` (those are ignored).
pub fn covers(seqs: &[u64], from: u64, until: u64) -> bool {
    let mut expect = from;
    for &s in seqs.iter().filter(|&&s| s >= from) {
        if expect >= until {
            return true;
        }
        if s != expect {
            return false;
        }
        expect += 1;
    }
    expect >= until
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_stream_applies() {
        let mut c = Cursor::default();
        assert_eq!(c.classify(0), Verdict::Apply);
        c.advance(0);
        assert_eq!(c.classify(1), Verdict::Apply);
        c.advance(1);
        assert_eq!(c.classify(1), Verdict::Stale);
        assert_eq!(c.classify(3), Verdict::Gap { from: 2 });
        assert_eq!(c.classify(0), Verdict::Restart);
    }

    #[test]
    fn joining_late_asks_for_warm_up() {
        let mut c = Cursor::default();
        assert_eq!(c.classify(42), Verdict::Join);
    }

    #[test]
    fn live_copies_of_replayed_batches_are_stale() {
        let mut c = Cursor::default();
        c.advance(4);
        assert_eq!(c.classify(7), Verdict::Gap { from: 5 });
        c.replayed(9);
        assert_eq!(c.classify(7), Verdict::Stale);
        assert_eq!(c.classify(9), Verdict::Stale);
        assert_eq!(c.classify(10), Verdict::Apply);
        c.advance(10);
        // Once past the replayed range, going back is a restart again.
        assert_eq!(c.classify(2), Verdict::Restart);
    }

    /// vLLM's sequence number is a u64 that wraps; seq 0 right after u64::MAX is the
    /// next message, not a stale one or a restart.
    #[test]
    fn the_sequence_wraps_around() {
        let mut c = Cursor::default();
        c.advance(u64::MAX - 1);
        assert_eq!(c.classify(u64::MAX), Verdict::Apply);
        c.advance(u64::MAX);
        assert!(!c.already_applied(0));
        assert_eq!(c.classify(0), Verdict::Apply);
        c.advance(0);
        assert!(c.already_applied(u64::MAX));
        assert!(c.already_applied(0));
        assert!(!c.already_applied(1));
        assert_eq!(c.classify(1), Verdict::Apply);
        assert_eq!(c.classify(3), Verdict::Gap { from: 1 });
    }

    #[test]
    fn coverage() {
        assert!(covers(&[5, 6], 5, 7));
        assert!(covers(&[5, 6, 7, 8], 5, 7));
        assert!(covers(&[3, 4, 5, 6], 5, 7));
        assert!(!covers(&[6, 7], 5, 7));
        assert!(!covers(&[5, 7], 5, 7));
        assert!(!covers(&[], 5, 7));
        assert!(covers(&[], 5, 5));
    }
}
