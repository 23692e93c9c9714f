//! round_robin: cycles through the candidates. Owns only its cursor.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::scoring::load_lines;
use super::{Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError};

#[derive(Debug, Default)]
pub struct RoundRobinPolicy {
    cursor: AtomicUsize,
}

impl RoundRobinPolicy {
    pub fn new() -> Self {
        Self::default()
    }
}

impl RoutingPolicy for RoundRobinPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::RoundRobin
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        view: &FleetView<'_>,
    ) -> Result<Decision, SelectError> {
        if view.candidates.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let i = self.cursor.fetch_add(1, Ordering::Relaxed) % view.candidates.len();
        Ok(Decision {
            worker: view.candidates[i],
            policy: PolicyKind::RoundRobin,
            predicted_cached_tokens: 0,
            indexed_cached_tokens: 0,
            credited_tokens: 0,
            rule: "rotation",
            reason: "next in rotation",
            scores: load_lines(view, req.prompt_tokens),
        })
    }
}
