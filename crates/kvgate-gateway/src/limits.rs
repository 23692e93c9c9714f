//! Backpressure: the global in-flight limit with a bounded wait queue, and waiting
//! for a per-worker slot.
//!
//! Owns admission. A request first takes a global slot ([`Admission`], waiting in a
//! bounded queue for at most the queue timeout) at the front door, before its body is
//! read; a body of 16 KiB or more also takes one of a few large-body slots while it is
//! parsed and tokenized (one per core by default), which bounds the memory tokenization
//! can take at once; after routing it takes a slot on its worker with its lease
//! (`lease.rs`); when every healthy candidate is full it waits
//! for a slot to free ([`wait_for_slot`]), bounded by the same timeout. Beyond either bound the answer
//! is 429 with `Retry-After`, never a hang. Must not choose workers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, SemaphorePermit};
use tokio::time::Instant;

use crate::config::LimitsConfig;
use crate::errors::ApiError;
use crate::registry::ModelState;

/// Bodies of at least this many bytes take a large-body slot while they are parsed
/// and tokenized (the size from which tokenization moves to the blocking pool).
pub const LARGE_BODY_BYTES: usize = kvgate_tokenize::local::SPAWN_BLOCKING_MIN_BYTES;

/// A request's admission: its gateway-wide in-flight slot (none when unlimited), freed
/// when dropped. Shared (`Arc`) by the request's leases, so the slot lasts until the
/// request's last attempt ends.
#[derive(Debug)]
pub struct Admission(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// The gateway-wide in-flight limit, and the limit on large bodies in preparation.
#[derive(Debug)]
pub struct GlobalLimiter {
    sem: Option<Arc<Semaphore>>,
    max_in_flight: usize,
    large_bodies: Semaphore,
    waiting: AtomicUsize,
    max_queue: usize,
    timeout: Duration,
    retry_after: u64,
}

impl GlobalLimiter {
    pub fn new(cfg: &LimitsConfig) -> Self {
        Self {
            sem: (cfg.max_in_flight > 0).then(|| Arc::new(Semaphore::new(cfg.max_in_flight))),
            max_in_flight: cfg.max_in_flight,
            large_bodies: Semaphore::new(match cfg.large_body_concurrency {
                0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
                n => n,
            }),
            waiting: AtomicUsize::new(0),
            max_queue: cfg.max_queue,
            timeout: cfg.queue_timeout(),
            retry_after: cfg.retry_after_secs(),
        }
    }

    /// Admits a request: takes a global slot (none when unlimited), waiting in the
    /// bounded queue.
    pub async fn acquire(&self) -> Result<Admission, ApiError> {
        self.acquire_slot().await.map(Admission)
    }

    async fn acquire_slot(&self) -> Result<Option<OwnedSemaphorePermit>, ApiError> {
        let Some(sem) = &self.sem else {
            return Ok(None);
        };
        if let Ok(p) = sem.clone().try_acquire_owned() {
            return Ok(Some(p));
        }
        let _ticket = QueueTicket::take(&self.waiting, self.max_queue).ok_or_else(|| {
            ApiError::overloaded(
                "the gateway is at its in-flight limit and its wait queue is full; retry later",
                self.retry_after,
            )
        })?;
        match tokio::time::timeout(self.timeout, sem.clone().acquire_owned()).await {
            Ok(Ok(p)) => Ok(Some(p)),
            Ok(Err(_)) => Err(ApiError::internal("the gateway is shutting down")),
            Err(_) => Err(ApiError::overloaded(
                "the gateway stayed at its in-flight limit for the whole queue timeout; retry later",
                self.retry_after,
            )),
        }
    }

    /// Takes a large-body slot for a body of `len` bytes (`None` below
    /// [`LARGE_BODY_BYTES`]), waiting in the bounded queue; hold it while the body is
    /// parsed and tokenized.
    pub async fn acquire_large_body(
        &self,
        len: usize,
    ) -> Result<Option<SemaphorePermit<'_>>, ApiError> {
        if len < LARGE_BODY_BYTES {
            return Ok(None);
        }
        if let Ok(p) = self.large_bodies.try_acquire() {
            return Ok(Some(p));
        }
        let _ticket = QueueTicket::take(&self.waiting, self.max_queue).ok_or_else(|| {
            ApiError::overloaded(
                "the gateway is preparing as many large requests as it has cores and its wait queue is full; retry later",
                self.retry_after,
            )
        })?;
        match tokio::time::timeout(self.timeout, self.large_bodies.acquire()).await {
            Ok(Ok(p)) => Ok(Some(p)),
            Ok(Err(_)) => Err(ApiError::internal("the gateway is shutting down")),
            Err(_) => Err(ApiError::overloaded(
                "the gateway stayed busy preparing large requests for the whole queue timeout; retry later",
                self.retry_after,
            )),
        }
    }

    pub fn retry_after(&self) -> u64 {
        self.retry_after
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Global slots taken (0 when unlimited).
    pub fn in_use(&self) -> usize {
        self.sem
            .as_ref()
            .map_or(0, |s| self.max_in_flight - s.available_permits())
    }

    /// Requests waiting for a global slot.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }
}

/// A place in a bounded queue; leaving frees it.
struct QueueTicket<'a>(&'a AtomicUsize);

impl<'a> QueueTicket<'a> {
    fn take(counter: &'a AtomicUsize, max: usize) -> Option<Self> {
        counter
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| QueueTicket(counter))
    }
}

impl Drop for QueueTicket<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Waits until `attempt` yields `Some` (re-trying each time a worker slot of `model`
/// frees or the fleet changes) or `deadline` passes (`None`). At most `max_queue`
/// requests wait per model; beyond that `None` at once.
pub async fn wait_for_slot<T, F>(
    model: &ModelState,
    max_queue: usize,
    deadline: Instant,
    mut attempt: F,
) -> Option<T>
where
    F: FnMut() -> Option<T>,
{
    let _ticket = QueueTicket::take(&model.waiting, max_queue.max(1))?;
    loop {
        let notified = model.capacity.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        if let Some(v) = attempt() {
            return Some(v);
        }
        // Wake periodically too: health changes do not signal `capacity`.
        let tick = Instant::now() + Duration::from_millis(50);
        let wake = tick.min(deadline);
        if tokio::time::timeout_at(wake, notified).await.is_err() && Instant::now() >= deadline {
            return attempt();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn full_queue_is_429_at_once() {
        let cfg = LimitsConfig {
            max_in_flight: 1,
            max_queue: 0,
            queue_timeout_ms: 10_000,
            ..LimitsConfig::default()
        };
        let lim = GlobalLimiter::new(&cfg);
        let held = lim.acquire().await.unwrap();
        assert!(held.0.is_some());
        let err = lim.acquire().await.unwrap_err();
        assert_eq!(err.status, http::StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(err.retry_after, Some(10));
    }

    #[tokio::test(start_paused = true)]
    async fn queue_timeout_is_429_and_release_admits() {
        let cfg = LimitsConfig {
            max_in_flight: 1,
            max_queue: 4,
            queue_timeout_ms: 100,
            ..LimitsConfig::default()
        };
        let lim = Arc::new(GlobalLimiter::new(&cfg));
        let held = lim.acquire().await.unwrap();
        let err = lim.acquire().await.unwrap_err();
        assert_eq!(err.status, http::StatusCode::TOO_MANY_REQUESTS);
        let l2 = lim.clone();
        let waiter = tokio::spawn(async move { l2.acquire().await.map(|p| p.0.is_some()) });
        tokio::task::yield_now().await;
        drop(held);
        assert_eq!(waiter.await.unwrap(), Ok(true));
        assert_eq!(lim.waiting(), 0);
    }

    #[test]
    fn unlimited_has_no_semaphore() {
        let lim = GlobalLimiter::new(&LimitsConfig::default());
        let p = futures_lite_block_on(lim.acquire());
        assert!(matches!(p, Ok(Admission(None))));
    }

    fn futures_lite_block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    }
}
