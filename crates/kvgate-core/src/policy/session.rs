//! session: consistent hashing of a session key onto a ring of virtual nodes.
//!
//! Owns the ring. Each worker gets `virtual_nodes` points, placed by hashing its stable
//! name (URL), so every router replica with the same workers builds the same ring and
//! sends a session to the same worker. A session maps to the first point clockwise of
//! its key's hash whose worker is a candidate: an unhealthy worker's sessions move to
//! the next worker and come back when it recovers; adding a worker moves only about
//! 1/N of the sessions, all of them to the new worker. Requests without a session key
//! fall back to power of two choices.

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use super::least_loaded::LeastLoadedPolicy;
use super::scoring::load_lines;
use super::{Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError};
use crate::ids::WorkerId;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SessionConfig {
    /// Points per worker on the ring; more points spread sessions more evenly.
    pub virtual_nodes: u32,
}

impl Default for SessionConfig {
    fn default() -> Self {
        Self { virtual_nodes: 160 }
    }
}

#[derive(Debug, Default)]
struct Ring {
    /// (point, worker), sorted by point.
    points: Vec<(u64, WorkerId)>,
    names: Vec<(WorkerId, String)>,
}

impl Ring {
    fn build(workers: &[(WorkerId, String)], virtual_nodes: u32) -> Ring {
        let mut points = Vec::with_capacity(workers.len() * virtual_nodes as usize);
        for (id, name) in workers {
            let base = xxh3_64(name.as_bytes());
            for v in 0..virtual_nodes {
                points.push((xxh3_64_with_seed(&v.to_le_bytes(), base), *id));
            }
        }
        points.sort_unstable();
        Ring {
            points,
            names: workers.to_vec(),
        }
    }

    fn contains(&self, w: WorkerId) -> bool {
        self.names.iter().any(|(id, _)| *id == w)
    }

    fn lookup(&self, key_hash: u64, candidates: &[WorkerId]) -> Option<WorkerId> {
        if self.points.is_empty() {
            return None;
        }
        let start = self.points.partition_point(|(p, _)| *p < key_hash);
        let n = self.points.len();
        (0..n)
            .map(|i| self.points[(start + i) % n].1)
            .find(|w| candidates.contains(w))
    }
}

#[derive(Debug)]
pub struct SessionPolicy {
    config: SessionConfig,
    ring: RwLock<Ring>,
    fallback: LeastLoadedPolicy,
}

impl SessionPolicy {
    pub fn new(config: SessionConfig, seed: Option<u64>) -> Self {
        Self {
            config,
            ring: RwLock::new(Ring::default()),
            fallback: LeastLoadedPolicy::new(seed),
        }
    }

    /// Adds candidates the ring has not been told about (named by id).
    fn ensure_known(&self, candidates: &[WorkerId]) {
        let missing: Vec<WorkerId> = {
            let ring = self.ring.read();
            candidates
                .iter()
                .copied()
                .filter(|w| !ring.contains(*w))
                .collect()
        };
        if missing.is_empty() {
            return;
        }
        let mut ring = self.ring.write();
        let mut names = ring.names.clone();
        for w in missing {
            if !names.iter().any(|(id, _)| *id == w) {
                names.push((w, w.to_string()));
            }
        }
        *ring = Ring::build(&names, self.config.virtual_nodes);
    }
}

impl RoutingPolicy for SessionPolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::Session
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
        let chosen = match req.session_key {
            Some(key) => {
                self.ensure_known(view.candidates);
                self.ring
                    .read()
                    .lookup(xxh3_64(key.as_bytes()), view.candidates)
                    .map(|w| (w, "session", "session key on the consistent-hash ring"))
            }
            None => None,
        };
        let (worker, rule, reason) = match chosen {
            Some(c) => c,
            None => (
                view.candidates[self.fallback.pick(&lines, view.ledger.block_size())],
                "two_choices",
                "no session key: less loaded of two random candidates",
            ),
        };
        Ok(Decision {
            worker,
            policy: PolicyKind::Session,
            predicted_cached_tokens: 0,
            indexed_cached_tokens: 0,
            credited_tokens: 0,
            rule,
            reason,
            scores: lines,
        })
    }

    fn workers_changed(&self, workers: &[(WorkerId, &str)]) {
        let named: Vec<(WorkerId, String)> = workers
            .iter()
            .map(|(id, name)| (*id, (*name).to_string()))
            .collect();
        *self.ring.write() = Ring::build(&named, self.config.virtual_nodes);
    }
}
