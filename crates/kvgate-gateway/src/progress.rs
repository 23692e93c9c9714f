//! The progress clock of a worker's engine: when it last showed it was working on
//! routed requests (a byte of an answer, a KV event), and whether it is out of rotation
//! as stalled.
//!
//! Owns the clock only: the attempt loop (failover.rs) and the response body
//! (observe.rs) touch it, the stall watcher (stall.rs) reads it and judges.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// When a worker's engine last showed it was working on routed requests, and whether
/// it is out of rotation as stalled.
#[derive(Debug)]
pub struct Progress {
    pub(crate) epoch: Instant,
    /// Milliseconds after `epoch` of the last sign of progress.
    last_ms: AtomicU64,
    stalled: AtomicBool,
}

impl Default for Progress {
    fn default() -> Self {
        Self {
            epoch: Instant::now(),
            last_ms: AtomicU64::new(0),
            stalled: AtomicBool::new(false),
        }
    }
}

impl Progress {
    /// The engine showed progress now (a byte of an answer, a KV event).
    #[inline]
    pub fn touch(&self) {
        self.touch_at(Instant::now());
    }

    pub(crate) fn touch_at(&self, at: Instant) {
        let ms = at.saturating_duration_since(self.epoch).as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// When the engine last showed progress (the clock's start if never).
    pub fn last(&self) -> Instant {
        self.epoch + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }

    /// Whether the worker is out of rotation as stalled (until a generation probe
    /// answers).
    pub fn is_stalled(&self) -> bool {
        self.stalled.load(Ordering::Acquire)
    }

    /// Marks the worker stalled or not; returns whether it was.
    pub(crate) fn set_stalled(&self, stalled: bool) -> bool {
        self.stalled.swap(stalled, Ordering::AcqRel)
    }
}
