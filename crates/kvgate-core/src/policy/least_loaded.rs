//! least_loaded: power of two choices over the ledger's load. Owns only its RNG.
//!
//! Two distinct random candidates are compared and the one with less queued work
//! (prefill blocks + decode blocks, then fewer requests in flight) wins. Sampling two
//! rather than scanning all avoids every router replica piling onto the same idle
//! worker when their views lag.

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::Rng;

use super::scoring::{load_lines, rng, work_blocks};
use super::{
    Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError, WorkerScore,
};

#[derive(Debug)]
pub struct LeastLoadedPolicy {
    rng: Mutex<SmallRng>,
}

impl LeastLoadedPolicy {
    pub fn new(seed: Option<u64>) -> Self {
        Self { rng: rng(seed) }
    }

    /// Picks by power of two choices among `lines`; returns the index into `lines`.
    pub(crate) fn pick(&self, lines: &[WorkerScore], block_size: u32) -> usize {
        let n = lines.len();
        if n <= 1 {
            return 0;
        }
        let mut rng = self.rng.lock();
        let a = rng.random_range(0..n);
        let mut b = rng.random_range(0..n - 1);
        if b >= a {
            b += 1;
        }
        let key = |s: &WorkerScore| (work_blocks(s, block_size), s.in_flight);
        let (ka, kb) = (key(&lines[a]), key(&lines[b]));
        if ka.partial_cmp(&kb) == Some(std::cmp::Ordering::Greater) {
            b
        } else {
            a
        }
    }
}

impl RoutingPolicy for LeastLoadedPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::LeastLoaded
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        view: &FleetView<'_>,
    ) -> Result<Decision, SelectError> {
        if view.candidates.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let lines = load_lines(view, req.prompt_tokens);
        let block_size = view.ledger.block_size();
        let i = self.pick(&lines, block_size);
        Ok(Decision {
            worker: view.candidates[i],
            policy: PolicyKind::LeastLoaded,
            predicted_cached_tokens: 0,
            indexed_cached_tokens: 0,
            credited_tokens: 0,
            rule: "two_choices",
            reason: "less loaded of two random candidates",
            scores: lines,
        })
    }
}
