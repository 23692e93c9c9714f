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
//! frees the admission slot once the request's last lease is gone. What a booking holds
//! ([`booking_spec`]) is written once, for this replica's leases and for the choices a
//! leader replica holds for its peers. Must not choose workers (select.rs) or talk to
//! them (failover.rs, proxy.rs).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use kvgate_core::{BlockKey, BookingGuard, BookingSpec, Decision};

use crate::limits::Admission;
use crate::registry::{ModelState, Worker};

/// What a request's booking holds on the worker `decision` chose: its prompt (the
/// part the policy predicts cached is no prefill work) and its expected output. A
/// decode leg (`kv_transferred`) computes none of its prompt: its KV arrives from its
/// prefill worker.
pub fn booking_spec(
    decision: &Decision,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
    kv_transferred: bool,
) -> BookingSpec {
    let mut spec = decision.booking(prompt_tokens, max_tokens);
    if kv_transferred {
        spec.cached_tokens = spec.prompt_tokens;
    }
    spec
}

/// One attempt's hold: admission, and a booking on one worker.
#[derive(Debug)]
pub struct Lease {
    booking: Option<BookingGuard>,
    worker: Arc<Worker>,
    model: Arc<ModelState>,
    _admission: Arc<Admission>,
}

impl Lease {
    /// Books `spec` (prompt `keys`) on `worker` of `model` for one attempt if it has
    /// fewer than `max_in_flight` requests in flight (0 = no limit), through the
    /// model's selection service; `None` when it is full.
    pub fn try_take(
        model: &Arc<ModelState>,
        worker: &Arc<Worker>,
        spec: BookingSpec,
        keys: &[BlockKey],
        admission: &Arc<Admission>,
        max_in_flight: u32,
    ) -> Option<Lease> {
        let booking =
            model
                .selection
                .try_book_spec(worker.id, spec, keys, max_in_flight, Instant::now())?;
        Some(Lease {
            booking: Some(booking),
            worker: worker.clone(),
            model: model.clone(),
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
