//! Routing policies behind one small trait.
//!
//! Owns worker selection: given a request's block keys and the current candidates
//! (healthy workers), each policy returns a [`Decision`] with an explanation the gateway
//! can expose (per-worker overlap, load and cost). Policies read the prefix index and
//! the ledger; they must not book requests (the gateway books the chosen worker) nor do
//! I/O. Internal state (round-robin cursor, RNG, session ring, affinity memory,
//! kv_aware's memory of where it sent each prefix) sits behind interior mutability so
//! one policy instance serves concurrent requests.

mod decision_memory;
mod kv_aware;
mod least_loaded;
mod prefix_affinity;
mod random;
mod round_robin;
mod scoring;
mod session;

use std::str::FromStr;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::hashing::BlockKey;
use crate::ids::WorkerId;
use crate::index::PrefixIndex;
use crate::ledger::{BookingSpec, Ledger};

pub use kv_aware::{removed_option, KvAwareConfig, KvAwarePolicy, Rule as KvAwareRule};
pub use least_loaded::LeastLoadedPolicy;
pub use prefix_affinity::{PrefixAffinityConfig, PrefixAffinityPolicy};
pub use random::RandomPolicy;
pub use round_robin::RoundRobinPolicy;
pub use session::{SessionConfig, SessionPolicy};

/// The policies kvgate offers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    #[default]
    RoundRobin,
    Random,
    LeastLoaded,
    Session,
    PrefixAffinity,
    KvAware,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 6] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastLoaded,
        PolicyKind::Session,
        PolicyKind::PrefixAffinity,
        PolicyKind::KvAware,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastLoaded => "least_loaded",
            PolicyKind::Session => "session",
            PolicyKind::PrefixAffinity => "prefix_affinity",
            PolicyKind::KvAware => "kv_aware",
        }
    }

    /// Whether the policy scores on the request's block keys.
    pub fn uses_tokens(self) -> bool {
        matches!(self, PolicyKind::PrefixAffinity | PolicyKind::KvAware)
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Error for an unknown policy name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownPolicy(pub String);

impl std::fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = PolicyKind::ALL.iter().map(|k| k.as_str()).collect();
        write!(
            f,
            "unknown policy {:?} (expected one of: {})",
            self.0,
            names.join(", ")
        )
    }
}

impl std::error::Error for UnknownPolicy {}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let norm = s.trim().to_ascii_lowercase().replace('-', "_");
        PolicyKind::ALL
            .into_iter()
            .find(|k| k.as_str() == norm)
            .ok_or_else(|| UnknownPolicy(s.to_string()))
    }
}

/// Everything needed to build a policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyConfig {
    pub kind: PolicyKind,
    /// Seed for the policy's random choices; `None` seeds from the OS.
    pub seed: Option<u64>,
    pub kv_aware: KvAwareConfig,
    pub prefix_affinity: PrefixAffinityConfig,
    pub session: SessionConfig,
}

impl PolicyConfig {
    pub fn of(kind: PolicyKind) -> Self {
        Self {
            kind,
            ..Self::default()
        }
    }
}

/// Builds the configured policy.
pub fn build_policy(config: &PolicyConfig) -> Box<dyn RoutingPolicy> {
    let seed = config.seed;
    match config.kind {
        PolicyKind::RoundRobin => Box::new(RoundRobinPolicy::new()),
        PolicyKind::Random => Box::new(RandomPolicy::new(seed)),
        PolicyKind::LeastLoaded => Box::new(LeastLoadedPolicy::new(seed)),
        PolicyKind::Session => Box::new(SessionPolicy::new(config.session.clone(), seed)),
        PolicyKind::PrefixAffinity => Box::new(PrefixAffinityPolicy::new(
            config.prefix_affinity.clone(),
            seed,
        )),
        PolicyKind::KvAware => Box::new(KvAwarePolicy::new(config.kv_aware.clone(), seed)),
    }
}

/// What a policy knows about one request.
#[derive(Clone, Copy, Debug)]
pub struct RouteRequest<'a> {
    /// Block keys of the prompt as the engine will prefill it (`None`: no routing tokens).
    pub block_keys: Option<&'a [BlockKey]>,
    pub prompt_tokens: u32,
    /// Session key for session affinity (from a configurable header).
    pub session_key: Option<&'a str>,
    pub now: Instant,
}

impl<'a> RouteRequest<'a> {
    /// A request without tokens or session, for token-less policies and tests.
    pub fn tokenless(now: Instant) -> Self {
        Self {
            block_keys: None,
            prompt_tokens: 0,
            session_key: None,
            now,
        }
    }
}

/// The state a policy decides over.
#[derive(Clone, Copy)]
pub struct FleetView<'a> {
    /// Workers the request may go to (healthy, not excluded by the caller). Never empty
    /// when a decision is expected; an empty set yields [`SelectError::NoCandidates`].
    pub candidates: &'a [WorkerId],
    pub ledger: &'a Ledger,
    /// The model's prefix index, when KV events feed one.
    pub index: Option<&'a PrefixIndex>,
}

/// One worker's line in a decision's explanation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WorkerScore {
    pub worker: WorkerId,
    /// Leading blocks of the prompt the worker holds, per tier (device, host, disk).
    pub overlap_blocks: [u32; 3],
    pub in_flight: u32,
    pub prefill_tokens: u64,
    pub decode_blocks: f64,
    /// The policy's cost (lower is better), for cost-based policies.
    pub cost: Option<f64>,
    /// The request's predicted time to first token here, seconds (the time model:
    /// [`crate::timing`]; kv_aware counts what is cached here, the others nothing).
    pub predicted_ttft_secs: Option<f64>,
    /// Its predicted time per output token here, seconds.
    pub predicted_tpot_secs: Option<f64>,
    /// The predicted TTFT of a like request booked here right after this one, seconds:
    /// the headroom this choice leaves for later requests, on which latency objectives
    /// are judged ([`crate::objective`]).
    pub predicted_next_ttft_secs: Option<f64>,
    /// Observed over predicted TTFT at the time model's judged quantile here
    /// ([`crate::timing::JUDGED_QUANTILE`]): objectives are judged on the predictions
    /// times this.
    pub ttft_spread: Option<f64>,
}

impl WorkerScore {
    /// The load this line shows.
    pub fn load(&self) -> crate::load::WorkerLoad {
        crate::load::WorkerLoad {
            in_flight: self.in_flight,
            prefill_tokens: self.prefill_tokens,
            decode_blocks: self.decode_blocks,
        }
    }
}

/// A policy's choice and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Decision {
    pub worker: WorkerId,
    pub policy: PolicyKind,
    /// Prompt tokens the policy expects the chosen worker to serve from its cache.
    pub predicted_cached_tokens: u32,
    /// Of the prediction, the tokens the prefix index shows cached on the chosen worker
    /// (for policies without an index, the whole prediction).
    pub indexed_cached_tokens: u32,
    /// Tokens credited on the chosen worker beyond the index because a booking there is
    /// prefilling them (raw, before the worker's credit trust); 0 without a credit.
    pub credited_tokens: u32,
    /// The rule that decided, a short name that metrics count and logs show
    /// (kv_aware: [`kv_aware::Rule`]; other policies: one name each).
    pub rule: &'static str,
    /// The same, in words.
    pub reason: &'static str,
    pub scores: Vec<WorkerScore>,
}

impl Decision {
    /// The chosen worker's score line.
    pub fn chosen(&self) -> Option<&WorkerScore> {
        self.scores.iter().find(|s| s.worker == self.worker)
    }

    /// The request's predicted time to first token on the chosen worker, seconds.
    pub fn predicted_ttft_secs(&self) -> Option<f64> {
        self.chosen().and_then(|s| s.predicted_ttft_secs)
    }

    /// The ledger booking for this decision.
    pub fn booking(&self, prompt_tokens: u32, expected_output_tokens: Option<u32>) -> BookingSpec {
        BookingSpec {
            prompt_tokens,
            cached_tokens: self.predicted_cached_tokens,
            indexed_tokens: self.indexed_cached_tokens,
            credited_tokens: self.credited_tokens,
            expected_output_tokens,
        }
    }
}

/// Why no worker was chosen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SelectError {
    /// No healthy candidate.
    NoCandidates,
    /// A token-scoring policy got a request without routing tokens.
    MissingTokens,
    /// kv_aware without a prefix index (no event source configured).
    NoIndex,
    /// A sheddable request (priority below 0) that no candidate is predicted to serve
    /// within its latency objective; the best is predicted `late` after it.
    Shed { late: Duration },
}

impl std::fmt::Display for SelectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SelectError::NoCandidates => f.write_str("no healthy worker is available"),
            SelectError::MissingTokens => f.write_str(
                "kv_aware routing needs the prompt's token ids, and this request has none",
            ),
            SelectError::NoIndex => f.write_str(
                "kv_aware routing has no KV event source: configure --kv-events for the workers",
            ),
            SelectError::Shed { late } => write!(
                f,
                "no worker is predicted to meet this request's latency objective (the closest \
                 by {} ms) and its priority makes it sheddable",
                late.as_millis()
            ),
        }
    }
}

impl std::error::Error for SelectError {}

/// A routing policy. Implementations are cheap to call concurrently.
pub trait RoutingPolicy: Send + Sync {
    fn kind(&self) -> PolicyKind;

    /// Chooses one of `view.candidates`.
    fn select(&self, req: &RouteRequest<'_>, view: &FleetView<'_>)
        -> Result<Decision, SelectError>;

    /// The fleet changed: `workers` is every known worker (id, stable name such as its URL),
    /// healthy or not. Policies with per-worker state update it here.
    fn workers_changed(&self, _workers: &[(WorkerId, &str)]) {}
}

/// Default time after which the affinity memory of prefix_affinity forgets a decision.
pub const DEFAULT_AFFINITY_TTL: Duration = Duration::from_secs(600);

#[cfg(test)]
mod tests;
