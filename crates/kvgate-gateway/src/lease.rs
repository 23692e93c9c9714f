//! The request lease: everything one attempt holds on the fleet, taken in one place and
//! given back in one place.
//!
//! A [`Lease`] holds the request's admission (its gateway-wide in-flight slot, shared by
//! the request's attempts through an `Arc`) and, on one worker, the ledger booking. The
//! booking *is* the worker's in-flight count: [`Lease::try_take`] checks the per-worker
//! limit and books in one step on the ledger's counter, so no request can be chosen
//! without being counted and there is no second count to drift. The only way to end a
//! lease is to drop it (the response finished, failed, or the client left; a retry takes
//! a new lease): that frees the booking, wakes requests waiting for a worker slot, and
//! frees the admission slot once the request's last lease is gone. Must not choose
//! workers (routing.rs) or talk to them (failover.rs, proxy.rs).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvgate_core::{BookingGuard, Decision};

use crate::limits::Admission;
use crate::registry::{ModelState, Worker};
use crate::routing::Prepared;

/// One attempt's hold: admission, and a booking on one worker.
#[derive(Debug)]
pub struct Lease {
    booking: Option<BookingGuard>,
    worker: Arc<Worker>,
    model: Arc<ModelState>,
    _admission: Arc<Admission>,
}

impl Lease {
    /// Books `worker` (the one `decision` chose) for one attempt of request `p` if it
    /// has fewer than `max_in_flight` requests in flight (0 = no limit), through the
    /// model's selection service; `None` when it is full.
    pub(crate) fn try_take(
        p: &Prepared,
        worker: &Arc<Worker>,
        decision: &Decision,
        admission: &Arc<Admission>,
        max_in_flight: u32,
    ) -> Option<Lease> {
        let mut spec = decision.booking(p.prompt_tokens, p.max_tokens);
        if p.kv_transferred {
            // A decode leg: the prompt's KV arrives from its prefill worker, nothing of
            // it is computed here.
            spec.cached_tokens = spec.prompt_tokens;
        }
        let booking = p.model.selection.try_book_spec(
            decision.worker,
            spec,
            p.keys.as_deref().unwrap_or_default(),
            max_in_flight,
            Instant::now(),
        )?;
        Some(Lease {
            booking: Some(booking),
            worker: worker.clone(),
            model: p.model.clone(),
            _admission: admission.clone(),
        })
    }

    pub fn worker(&self) -> &Arc<Worker> {
        &self.worker
    }

    pub fn model(&self) -> &Arc<ModelState> {
        &self.model
    }

    /// The ledger booking, to report the request's progress (first token, output
    /// tokens, the engine's cached-token count).
    pub fn booking(&self) -> Option<&BookingGuard> {
        self.booking.as_ref()
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Free the booking first, then wake whoever waits for a slot on this model.
        self.booking = None;
        if self.model.waiting.load(Ordering::Acquire) > 0 {
            self.model.capacity.notify_waiters();
        }
    }
}
