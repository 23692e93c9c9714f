//! kv_aware: one cost per candidate, the prompt's uncached prefill (from the prefix
//! index and the ledger's prefill credits) weighed against the work the worker already
//! carries (from the ledger). Owns the decision procedure below and nothing else: it
//! reads the index and the ledger and must not change either (the caller books).
//!
//! # The decision procedure, in the order it runs
//!
//! With B the block size and, for each candidate worker w:
//!
//! ```text
//! cached(w)   = device + host_credit·host + disk_credit·disk + credited(w)
//!                                                     (leading blocks held, by tier)
//! lead(w)     = cached(w) − the runner-up's cached, for the sole best holder while its
//!               engine's batch has room (requests in flight below `max_num_seqs`); else 0
//! prefill(w)  = queued_prefill_tokens(w)/B + (prompt_blocks − cached(w))
//!             − locality_weight · lead(w)
//! cost(w)     = overlap_weight · prefill(w) + decode_blocks(w)
//! ```
//!
//! 1. **Eligibility**. Warm-up (rule `warmup`): a candidate whose index holds less
//!    than `warmup_fraction` of the candidates' mean entries (an engine just added,
//!    restarted or reset) is warming up; while one is, no candidate more than [`WARMUP_SLACK`] requests in flight ahead
//!    of the least loaded warming one is eligible. The least loaded candidate (warming
//!    one) always is, so the set is never empty.
//! 2. **Cost** of every eligible candidate, as above.
//! 3. **Choice**: the lowest cost, ties broken at random. The decision names the rule
//!    that decided ([`Rule`]): `warmup` when the cheapest candidate overall was not
//!    eligible, `cached` when the chosen worker holds part of the prompt, `least_work`
//!    when nobody does.
//!
//! # Why each term (ablations in docs/BENCHMARKS.md, "kv_aware's rules, one by one")
//!
//! - **The cost** is DESIGN.md section 3's: the prefill a worker must do before this
//!   request's first token (its queue plus this prompt's uncached part) against the
//!   decode it carries. `overlap_weight` (4) counts a block of prefill as four of
//!   decode: at 1 the decode term drowns the cache savings on long prompts (Mooncake
//!   window TTFT p50 +7%, herding p90 +1%).
//! - **The locality lead** counts the sole best holder's lead `1 + locality_weight`
//!   times, so a conversation stays on the worker holding its history unless its queue
//!   is very long: moving it recomputes the history elsewhere and leaves the copy dead,
//!   which the per-request cost does not see. A prefix that two or more candidates hold
//!   gives nobody a lead, so replicated system prompts spread by load. Without it the
//!   Mooncake window's TTFT p90 is 11% worse.
//! - **The prefill credit**: a prompt still being prefilled on a worker (booked, first
//!   token not seen) counts as device-cached there beyond what the index shows, so a
//!   follow-up that arrives before the engine's events can find it. It ends at that
//!   request's first token or end, and at the latest `pending_credit_secs` after
//!   booking ([`Ledger::prefill_credits`]).
//! - **The lead ends at a full batch**: an engine runs at most `max_num_seqs`
//!   sequences a step (its limits: the time model's, [`crate::timing`]); behind a full
//!   batch a request waits for a slot whatever the engine holds, so the holder's lead
//!   stops counting and the cost alone (its queue and decode against the others'
//!   recompute) decides. Without it a burst on a prompt one worker holds goes there
//!   whole: 64:0 in simulation with 16-sequence batches (TTFT p90 2.7x), 33:1 on Ray
//!   Serve LLM with two real vLLM replicas. It replaced a load bound on requests in
//!   flight (at most 16 and 1.5x ahead of the least loaded), which spread the same burst
//!   but cost up to 16% of requests served at concurrency 48 and 3% of the Mooncake
//!   window's TTFT p90, where batches never fill.
//! - **Warm-up**: a fleet that caches its tenants keeps every request where the
//!   prefixes are (each request's cost says so), so an engine added under load would
//!   get nothing: the per-request cost cannot see that a prefix recomputed on new
//!   capacity pays for itself over the requests that follow. Without it an added
//!   engine's fleet serves 12% fewer requests, and a system prompt every request shares
//!   piles onto the first engine that cached it (herding TTFT p90 8x): warm-up is also
//!   what spreads a fleet's first requests. The rule acts only on an imbalance of cache,
//!   which a steady fleet does not have.
//!
//! Removed after their ablations (each made TTFT or requests served worse, or changed
//! nothing): cold homing and its five refinements, the softmax temperature, the
//! prefill-queue weight, and the trusts that scaled the index and the credit by how far
//! they came true (no options; they changed no workload's TTFT beyond 1.3%, the better
//! way round without them), and the load bound (replaced, above). [`REMOVED`] names
//! them, so an old configuration is refused
//! with a reason rather than silently changing meaning.
//!
//! [`Ledger::prefill_credits`]: crate::ledger::Ledger::prefill_credits

use std::time::Duration;

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use serde::{Deserialize, Serialize};

use super::scoring::{argmin_random_tie, lines_and_timings, predict, rng};
use super::{
    Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError, WorkerScore,
};
use crate::ids::Tier;
use crate::timing::WorkerTiming;

/// kv_aware's knobs: four, plus the YAML-only tier credits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "KvAwareFields")]
pub struct KvAwareConfig {
    /// Weight of a block of prefill against a block of decode (module comment).
    pub overlap_weight: f64,
    /// Extra weight of the sole best holder's lead over the runner-up (0 = DESIGN
    /// section 3's cost alone).
    pub locality_weight: f64,
    /// Longest time a prompt in prefill is credited as cached on its worker; the credit
    /// ends at its first token or end in any case. 0 disables the credit.
    pub pending_credit_secs: f64,
    /// A candidate whose index holds less than this fraction of the candidates' mean
    /// entries is warming up (module comment). 0 disables the rule.
    pub warmup_fraction: f64,
    /// Credit for a block held in host memory (1.0 = as good as device). YAML only.
    pub host_credit: f64,
    /// Credit for a block held on disk or remote storage. YAML only.
    pub disk_credit: f64,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 4.0,
            locality_weight: 64.0,
            pending_credit_secs: 10.0,
            warmup_fraction: 0.5,
            host_credit: 0.5,
            disk_credit: 0.25,
        }
    }
}

/// kv_aware options that no longer exist, as YAML fields (flags are the same with
/// dashes), and why: a configuration naming one is refused ([`removed_option`]).
pub const REMOVED: &[(&str, &str)] = &[
    ("cold_homing", "cold homing is gone: a prompt cached nowhere goes to the cheapest worker (homing cost up to 30% of TTFT p90)"),
    ("home_hit_ratio_slack", "cold homing is gone, with its refinements"),
    ("home_prefers_room", "cold homing is gone, with its refinements"),
    ("home_remembers_last", "cold homing is gone, with its refinements"),
    ("home_evicts_least_wanted", "cold homing is gone, with its refinements"),
    ("home_demand_half_life_secs", "cold homing is gone, with its refinements"),
    ("home_plans_by_demand", "cold homing is gone, with its refinements"),
    ("temperature", "kv_aware picks the lowest cost; the softmax never helped"),
    ("prefill_queue_weight", "a worker's queued prefill counts as much as the prompt's own (it had no effect at its default)"),
    ("balance_abs_threshold", "the load bound is gone: a holder's lead ends while its engine's batch is full (`max_num_seqs`), which spreads a burst without the bound's cost where batches never fill"),
    ("balance_rel_threshold", "the load bound is gone: a holder's lead ends while its engine's batch is full (`max_num_seqs`)"),
];

/// Why the kv_aware option `name` (a YAML field, or a flag with or without its leading
/// dashes) was removed, or `None` for an option that is not a removed one.
pub fn removed_option(name: &str) -> Option<String> {
    let field = name.trim_start_matches('-').replace('-', "_");
    let (_, why) = REMOVED.iter().find(|(removed, _)| *removed == field)?;
    Some(format!(
        "kv_aware option `{name}` was removed: {why} (`kvgate serve --help` lists the options)"
    ))
}

/// [`KvAwareConfig`] as read from YAML: unknown fields are refused, and removed ones
/// with the reason they went.
#[derive(Deserialize)]
#[serde(default)]
struct KvAwareFields {
    overlap_weight: f64,
    locality_weight: f64,
    pending_credit_secs: f64,
    warmup_fraction: f64,
    host_credit: f64,
    disk_credit: f64,
    #[serde(flatten)]
    removed: std::collections::BTreeMap<String, serde::de::IgnoredAny>,
}

impl Default for KvAwareFields {
    fn default() -> Self {
        let d = KvAwareConfig::default();
        Self {
            overlap_weight: d.overlap_weight,
            locality_weight: d.locality_weight,
            pending_credit_secs: d.pending_credit_secs,
            warmup_fraction: d.warmup_fraction,
            host_credit: d.host_credit,
            disk_credit: d.disk_credit,
            removed: Default::default(),
        }
    }
}

impl TryFrom<KvAwareFields> for KvAwareConfig {
    type Error = String;

    fn try_from(f: KvAwareFields) -> Result<Self, String> {
        if let Some(name) = f.removed.keys().next() {
            return Err(removed_option(name).unwrap_or_else(|| {
                let known = "overlap_weight, locality_weight, pending_credit_secs, warmup_fraction, host_credit, disk_credit";
                format!("unknown kv_aware field `{name}`, expected one of {known}")
            }));
        }
        Ok(Self {
            overlap_weight: f.overlap_weight,
            locality_weight: f.locality_weight,
            pending_credit_secs: f.pending_credit_secs,
            warmup_fraction: f.warmup_fraction,
            host_credit: f.host_credit,
            disk_credit: f.disk_credit,
        })
    }
}

/// How many requests in flight a candidate may be ahead of a warming-up one. One: a
/// warming worker is kept exactly as busy as the busiest other, no more (a slack of 0
/// would starve the others whenever the warming one is idle for an instant).
pub const WARMUP_SLACK: u32 = 1;

/// The rule that decided a kv_aware request, as `/v1/route/explain`, the decision log
/// and `kvgate_routing_decisions_total{rule}` name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The cheapest worker holds part of the prompt.
    Cached,
    /// Nobody holds any of the prompt: the least work.
    LeastWork,
    /// The cheapest worker overall was passed over for a warming-up one.
    Warmup,
}

impl Rule {
    pub const ALL: [Rule; 3] = [Rule::Cached, Rule::LeastWork, Rule::Warmup];

    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Cached => "cached",
            Rule::LeastWork => "least_work",
            Rule::Warmup => "warmup",
        }
    }

    fn reason(self) -> &'static str {
        match self {
            Rule::Cached => "lowest cost: cached prefix outweighs load",
            Rule::LeastWork => "lowest cost: no cached prefix, least work",
            Rule::Warmup => "warm-up: a worker with little cached is further behind on load",
        }
    }
}

#[derive(Debug)]
pub struct KvAwarePolicy {
    config: KvAwareConfig,
    rng: Mutex<SmallRng>,
}

/// Each candidate's cached prefix as kv_aware counts it.
struct Cached {
    /// Device blocks plus tier-credited host/disk blocks plus credited blocks.
    blocks: Vec<f64>,
    /// Device blocks the index shows.
    indexed_device: Vec<u32>,
    /// Blocks credited for prompts in prefill there, beyond the index.
    credited: Vec<u32>,
}

impl KvAwarePolicy {
    pub fn new(config: KvAwareConfig, seed: Option<u64>) -> Self {
        Self {
            config,
            rng: rng(seed),
        }
    }

    /// Step 1: whether each candidate is eligible (module comment).
    fn eligible(&self, lines: &[WorkerScore], entries: &[usize]) -> Vec<bool> {
        let c = &self.config;
        let mean = entries.iter().sum::<usize>() as f64 / entries.len().max(1) as f64;
        let warming =
            |i: usize| c.warmup_fraction > 0.0 && (entries[i] as f64) < c.warmup_fraction * mean;
        let warm_min = (0..lines.len())
            .filter(|&i| warming(i))
            .map(|i| lines[i].in_flight)
            .min();
        let behind_warm_up = |n: u32| warm_min.is_some_and(|w| n > w + WARMUP_SLACK);
        lines.iter().map(|l| !behind_warm_up(l.in_flight)).collect()
    }

    /// Each candidate's cached prefix (index overlap by tier, plus the prefill credit
    /// beyond it), recorded in its score line.
    fn cached_blocks(
        &self,
        lines: &mut [WorkerScore],
        overlaps: &crate::index::OverlapScores,
        credits: &[u32],
    ) -> Cached {
        let c = &self.config;
        let mut indexed_device = vec![0u32; lines.len()];
        let mut credited = vec![0u32; lines.len()];
        let blocks = lines
            .iter_mut()
            .zip(credits)
            .enumerate()
            .map(|(i, (line, credit))| {
                if let Some(o) = overlaps.best_for(line.worker) {
                    line.overlap_blocks = o.blocks;
                }
                indexed_device[i] = line.overlap_blocks[Tier::Device.index()];
                let [device, host, disk] = line.overlap_blocks.map(f64::from);
                let indexed = device + c.host_credit * host + c.disk_credit * disk;
                credited[i] = credit.saturating_sub(line.overlap_blocks.iter().sum::<u32>());
                line.overlap_blocks[Tier::Device.index()] += credited[i];
                indexed + f64::from(credited[i])
            })
            .collect();
        Cached {
            blocks,
            indexed_device,
            credited,
        }
    }

    /// Step 2: the cost of each candidate (module comment), recorded in its score line.
    fn costs(
        &self,
        lines: &mut [WorkerScore],
        cached: &[f64],
        timings: &[WorkerTiming],
        prompt_blocks: f64,
        bs: f64,
    ) -> Vec<f64> {
        let c = &self.config;
        let (mut first, mut second) = (f64::NEG_INFINITY, f64::NEG_INFINITY);
        for &x in cached {
            if x > first {
                second = first;
                first = x;
            } else if x > second {
                second = x;
            }
        }
        lines
            .iter_mut()
            .zip(cached)
            .zip(timings)
            .map(|((line, &cached), timing)| {
                // Only a sole best holder has a lead (a tie leaves second == first), and
                // only while its engine's batch has room: behind a full batch the request
                // waits for a slot whatever it holds.
                let batch_full = line.in_flight >= timing.limits().max_num_seqs;
                let lead = if cached >= first && second.is_finite() && !batch_full {
                    cached - second
                } else {
                    0.0
                };
                let prefill = line.prefill_tokens as f64 / bs + (prompt_blocks - cached).max(0.0)
                    - c.locality_weight * lead;
                let cost = c.overlap_weight * prefill + line.decode_blocks;
                line.cost = Some(cost);
                cost
            })
            .collect()
    }

    /// Step 3: the cheapest eligible candidate (ties at random) and the rule that
    /// decided.
    fn choose(&self, costs: &[f64], eligible: Vec<bool>, cached: &[f64]) -> (usize, Rule) {
        let among: Vec<usize> = (0..costs.len()).filter(|&i| eligible[i]).collect();
        let among_costs: Vec<f64> = among.iter().map(|&i| costs[i]).collect();
        let i = among[argmin_random_tie(&among_costs, &mut *self.rng.lock())];
        let cheapest = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let rule = if costs[i] > cheapest {
            Rule::Warmup
        } else if cached[i] > 0.0 {
            Rule::Cached
        } else {
            Rule::LeastWork
        };
        (i, rule)
    }
}

impl RoutingPolicy for KvAwarePolicy {
    fn kind(&self) -> PolicyKind {
        PolicyKind::KvAware
    }

    fn select(
        &self,
        req: &RouteRequest<'_>,
        view: &FleetView<'_>,
    ) -> Result<Decision, SelectError> {
        let index = view.index.ok_or(SelectError::NoIndex)?;
        let keys = req.block_keys.ok_or(SelectError::MissingTokens)?;
        if view.candidates.is_empty() {
            return Err(SelectError::NoCandidates);
        }
        let (mut lines, timings) = lines_and_timings(view);
        let ttl = Duration::try_from_secs_f64(self.config.pending_credit_secs.max(0.0))
            .unwrap_or(Duration::ZERO);
        let credits = view
            .ledger
            .prefill_credits(keys, view.candidates, req.now, ttl);
        let cached = self.cached_blocks(&mut lines, &index.overlaps(keys), &credits);
        let bs = index.block_size();
        let prompt_blocks = f64::from(req.prompt_tokens) / f64::from(bs);
        predict(&mut lines, &timings, req.prompt_tokens.div_ceil(bs), |i| {
            let cached_tokens = (cached.blocks[i] * f64::from(bs)).round() as u64;
            u64::from(req.prompt_tokens).saturating_sub(cached_tokens)
        });
        let costs = self.costs(
            &mut lines,
            &cached.blocks,
            &timings,
            prompt_blocks,
            f64::from(bs),
        );
        let eligible = self.eligible(&lines, &index.entries_of(view.candidates));
        let (i, rule) = self.choose(&costs, eligible, &cached.blocks);
        let indexed_cached_tokens = cached.indexed_device[i] * bs;
        let credited_tokens = cached.credited[i] * bs;
        Ok(Decision {
            worker: lines[i].worker,
            policy: PolicyKind::KvAware,
            predicted_cached_tokens: indexed_cached_tokens + credited_tokens,
            indexed_cached_tokens,
            credited_tokens,
            rule: rule.as_str(),
            reason: rule.reason(),
            scores: lines,
        })
    }
}
