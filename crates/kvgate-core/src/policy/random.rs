//! random: a uniformly random candidate. Owns only its RNG.

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::Rng;

use super::scoring::{load_lines, rng};
use super::{Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError};

#[derive(Debug)]
pub struct RandomPolicy {
    rng: Mutex<SmallRng>,
}

impl RandomPolicy {
    pub fn new(seed: Option<u64>) -> Self {
        Self { rng: rng(seed) }
    }
}

impl RoutingPolicy for RandomPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Random
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        view: &FleetView<'_>,
    ) -> Result<Decision, SelectError> {
        if view.candidates.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let i = self.rng.lock().random_range(0..view.candidates.len());
        Ok(Decision {
            worker: view.candidates[i],
            policy: PolicyKind::Random,
            predicted_cached_tokens: 0,
            indexed_cached_tokens: 0,
            credited_tokens: 0,
            rule: "random",
            reason: "uniform random",
            scores: load_lines(view, req.prompt_tokens),
        })
    }
}
