//! Virtual-time runs of the simulation core: feed requests with arrival times, step
//! until done, and record every event batch and every request's timings.
//!
//! Owns the virtual-time driver only (no sleeping, no I/O). Given the same config and
//! the same timed requests it returns identical results, which is what makes
//! benchmark results reproducible.

use serde::{Deserialize, Serialize};

use crate::events::KvEvent;
use crate::scheduler::{
    ConfigError, FinishReason, RequestId, SimConfig, SimRequest, Simulator, SubmitError,
};

/// A request arriving at `arrival_ms` of virtual time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TimedRequest {
    pub arrival_ms: u64,
    pub request: SimRequest,
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RequestTiming {
    pub id: RequestId,
    pub arrival_ms: f64,
    pub first_token_ms: f64,
    pub finish_ms: f64,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub output_tokens: u32,
    pub finish_reason: FinishReason,
}

/// One step's events, stamped with the virtual time the step ended.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimedBatch {
    pub ts_ms: f64,
    pub events: Vec<KvEvent>,
}

/// The full record of a virtual-time run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VirtualRun {
    /// In submission order.
    pub requests: Vec<RequestTiming>,
    pub batches: Vec<TimedBatch>,
    pub steps: u64,
    pub end_ms: f64,
}

/// Why a virtual run could not complete.
#[derive(Debug, thiserror::Error)]
pub enum VirtualRunError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("request {index}: {source}")]
    Submit { index: usize, source: SubmitError },
}

/// Run `requests` (sorted by arrival here, stable) through a fresh simulator.
pub fn run_virtual(
    cfg: SimConfig,
    mut requests: Vec<TimedRequest>,
) -> Result<VirtualRun, VirtualRunError> {
    requests.sort_by_key(|r| r.arrival_ms);
    let mut sim = Simulator::new(cfg)?;
    let mut timings: Vec<Option<RequestTiming>> = Vec::with_capacity(requests.len());
    let mut batches = Vec::new();
    let mut next = 0;
    let mut steps = 0;
    loop {
        while next < requests.len() && requests[next].arrival_ms as f64 <= sim.clock_ms() {
            let r = &requests[next];
            let id = sim
                .submit(r.request.clone())
                .map_err(|source| VirtualRunError::Submit {
                    index: next,
                    source,
                })?;
            debug_assert_eq!(id as usize, timings.len());
            timings.push(Some(RequestTiming {
                id,
                arrival_ms: r.arrival_ms as f64,
                first_token_ms: f64::NAN,
                finish_ms: f64::NAN,
                prompt_tokens: r.request.prompt.len() as u32,
                cached_tokens: 0,
                output_tokens: 0,
                finish_reason: FinishReason::Length,
            }));
            next += 1;
        }
        match sim.step() {
            Some(out) => {
                steps += 1;
                let end = out.start_ms + out.duration_ms;
                if !out.events.is_empty() {
                    batches.push(TimedBatch {
                        ts_ms: end,
                        events: out.events,
                    });
                }
                for o in out.outputs {
                    if let Some(Some(t)) = timings.get_mut(o.id as usize) {
                        if o.index == 0 {
                            t.first_token_ms = end;
                            t.cached_tokens = o.cached_tokens;
                        }
                        t.output_tokens = o.index + 1;
                        if let Some(reason) = o.finished {
                            t.finish_ms = end;
                            t.finish_reason = reason;
                        }
                    }
                }
            }
            None => {
                if next >= requests.len() {
                    break;
                }
                sim.advance_to(requests[next].arrival_ms as f64);
            }
        }
    }
    Ok(VirtualRun {
        requests: timings.into_iter().flatten().collect(),
        batches,
        steps,
        end_ms: sim.clock_ms(),
    })
}
