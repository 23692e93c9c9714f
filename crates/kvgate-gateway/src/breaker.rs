//! Per-worker circuit breaker.
//!
//! Owns one worker's consecutive-failure count and open/closed state. Failures come
//! from proxied requests (connect errors, 5xx before the first byte, first-byte
//! timeouts) and from active health checks; `failure_threshold` consecutive ones open
//! the breaker and take the worker out of every policy's candidate set (a stalled
//! engine trips it at once). The half-open probe is the next active health check (or,
//! with active checks off, the next request after `open_ms`): its success closes the
//! breaker, its failure re-arms it.
//! It must not touch the ledger or the index (health never resets load).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Instant;

#[derive(Debug)]
pub struct Breaker {
    epoch: Instant,
    failures: AtomicU32,
    open: AtomicBool,
    opened_at_ms: AtomicU64,
}

impl Default for Breaker {
    fn default() -> Self {
        Self::new()
    }
}

impl Breaker {
    pub fn new() -> Self {
        Self {
            epoch: Instant::now(),
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            opened_at_ms: AtomicU64::new(0),
        }
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Whether the worker may receive requests. `passive_open_ms` is `Some` when no
    /// active health checks run: an open breaker then half-opens after that long.
    #[inline]
    pub fn available(&self, passive_open_ms: Option<u64>) -> bool {
        if !self.open.load(Ordering::Acquire) {
            return true;
        }
        match passive_open_ms {
            Some(open_ms) => {
                self.now_ms()
                    .saturating_sub(self.opened_at_ms.load(Ordering::Relaxed))
                    >= open_ms
            }
            None => false,
        }
    }

    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Acquire)
    }

    pub fn consecutive_failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }

    /// A success closes the breaker. Returns true when it was open.
    #[inline]
    pub fn record_success(&self) -> bool {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        self.open.load(Ordering::Relaxed) && self.open.swap(false, Ordering::AcqRel)
    }

    /// Opens the breaker now, whatever the failure count (a stalled engine). Returns
    /// true when it was closed.
    pub fn trip(&self) -> bool {
        self.opened_at_ms.store(self.now_ms(), Ordering::Relaxed);
        !self.open.swap(true, Ordering::AcqRel)
    }

    /// Records a failure. Returns true when this failure opened the breaker.
    pub fn record_failure(&self, threshold: u32) -> bool {
        let n = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        if self.open.load(Ordering::Acquire) {
            // Half-open probe failed (or a straggler): keep it out for another period.
            self.opened_at_ms.store(self.now_ms(), Ordering::Relaxed);
            return false;
        }
        if n >= threshold {
            return self.trip();
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_closes_on_success() {
        let b = Breaker::new();
        assert!(!b.record_failure(3));
        assert!(!b.record_failure(3));
        assert!(b.available(None));
        assert!(b.record_failure(3));
        assert!(!b.available(None));
        assert!(!b.record_failure(3), "already open");
        assert!(b.record_success());
        assert!(b.available(None));
        assert!(!b.record_success());
    }

    #[test]
    fn success_resets_the_count() {
        let b = Breaker::new();
        b.record_failure(2);
        b.record_success();
        assert!(!b.record_failure(2));
    }

    #[test]
    fn passive_half_open_after_cooldown() {
        let b = Breaker::new();
        b.record_failure(1);
        assert!(!b.available(Some(60_000)));
        assert!(b.available(Some(0)));
    }
}
