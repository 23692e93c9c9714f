//! kv_aware: overlap from the prefix index weighed against ledger load.
//!
//! Owns the cost model of DESIGN.md section 3, with B the block size, extended by a
//! locality term and a load bound:
//!
//! ```text
//! cached_blocks(w)      = device + host_credit·host + disk_credit·disk   (leading run)
//! advantage(w)          = its lead over the runner-up if w caches the most, else 0
//! new_prefill_blocks(w) = prefill_queue_weight·active_prefill_tokens(w)/B
//!                         + (prompt_blocks − cached_blocks(w))
//!                         − locality_weight·advantage(w)
//! cost(w)               = overlap_weight · new_prefill_blocks(w) + decode_blocks(w)
//! ```
//!
//! The lowest cost among the candidates that are not overloaded wins (ties broken at
//! random), or with
//! `temperature > 0` one is sampled with probability ∝ exp(−normalized cost /
//! temperature). A candidate is overloaded when its requests in flight exceed the least
//! loaded candidate's by more than `balance_abs_threshold` and by more than
//! `balance_rel_threshold` times.
//!
//! Warm-up: a candidate whose index holds less than `warmup_fraction` of the
//! candidates' mean (an engine just added, restarted, purged or reset) is warming up,
//! and while it is, no candidate more than [`WARMUP_SLACK`] requests in flight ahead of
//! it is eligible. Without this, a fleet that already caches its tenants keeps every
//! request where the prefixes are (the locality term and the DESIGN cost both say so
//! per request, since one recompute costs more than a short queue), and an engine added
//! under load gets nothing: the per-request cost cannot see that a prefix recomputed on
//! new capacity pays for itself over the requests that follow. The rule fires only on
//! an imbalance of cache, which a steady fleet does not have (all its engines fill), so
//! the load bound stays loose where locality matters.
//!
//! Cold homing: a prompt that no candidate holds (not even its first block) goes to its
//! home, the eligible candidate with the highest rendezvous hash of its first block
//! key, instead of the cheapest one. When caches thrash (more tenants than the fleet
//! holds), a tenant evicted everywhere then comes back to the same worker each time, so
//! each worker sees a stable part of the tenants instead of all of them, as a router
//! that remembers its own decisions would; the load bound and warm-up still apply.
//! Different prefixes hash to different homes, so cold misses still spread. (The hash
//! is over worker ids, which are this process's: two gateway replicas may pick
//! different homes for the same prefix.)
//!
//! Homing is bounded by load, as consistent hashing with bounded loads is: the home is
//! the first candidate in the prefix's rendezvous order whose cost is within one
//! prefill of this prompt (`overlap_weight · prompt_blocks`) of the cheapest. Why that
//! bound: what homing saves is a later recompute of the same prefix on a second worker
//! (a tenant split over two workers pays its prefill once more and holds two copies),
//! so waiting behind at most one such prefill to avoid it breaks even, and waiting
//! longer does not. Without the bound, a hash that homes more of the rarely seen (so
//! mostly cold) tenants on one worker gives that worker most of the fleet's misses and
//! their prefill queue: measured in Ray Serve (docs/BENCHMARKS.md), one replica took
//! 46 of 73 misses and the TTFT p90 was 2.7x that of homing switched off. The
//! fallback is the next worker in the same order, so a prefix pushed off its home
//! still has one place to come back to.
//!
//! Homing is bounded by cache pressure too: a candidate whose engine lately served a
//! share of its prompt tokens from cache more than `home_hit_ratio_slack` below the
//! best candidate's ([`WorkerAccuracy::cache_hit_ratio`]) is no home. Why: a rendezvous
//! hash splits a handful of prefixes unevenly (with 8 tenants over 2 workers, 6 and 2
//! is common), and when the tenants homed on one worker need more cache than it has,
//! that worker evicts them in turn, each comes back cold, and homing sends it back to
//! the same thrashing cache, for good, while the other worker has room. A low cache-hit
//! ratio beside a higher one elsewhere is the engines' own report of that: the evicted
//! prefix goes to the next worker in its order whose cache works, so homes shift until
//! the hit ratios are within the slack of each other. Measured in `kvgate simulate
//! scenarios` with caches holding half the tenants: the bound lifted kv_aware's hit
//! rate on the seed that split the tenants 6:2 from 79% to 88% (prefix_affinity 90%)
//! and changes nothing where the split is even. The slack is wide (0.2) because hit
//! ratios also differ with the mix of prompts a worker gets: 0.1 cost half a point on
//! the synthetic Mooncake trace, 0.2 nothing (docs/BENCHMARKS.md).
//!
//! Homing prefers room: a candidate whose engine has not evicted a device block since
//! its cache was last cleared takes a cold prefix before one that has, whatever the
//! rendezvous order says (`home_prefers_room`). The index sees the engines' removals,
//! and an engine evicts only to make room, so "has not evicted" means "has room". Why:
//! after an engine restarts, is added or has its cache reset, the others hold the
//! tenants that lived on it as well as their own and evict in turn; a tenant they
//! evict comes back cold, and for half of them the rendezvous home is one of those
//! full caches, which takes it back at the cost of another tenant while the empty
//! engine waits for warm-up to send it load. Caching the prefix where there is room
//! evicts nothing. The rule acts only while some candidates have room and others do
//! not: a steady fleet's engines all evict (or none does), and it ends by itself once
//! the new engine has filled. (A worker that publishes no removals counts as having
//! room.) Measured in real time on the restart scenario (docs/BENCHMARKS.md).
//!
//! Homing remembers where a prefix lived: when every acceptable home is full (its
//! engine evicts), a prompt cached nowhere goes back to the worker it was last routed
//! to, if that is one of them, before the rendezvous hash is asked
//! (`home_remembers_last`). Why: the room rule and the load bound place some tenants
//! away from their hash home (at a cold start the engine that fills first sends the
//! next tenants to the other). Once every cache is full, such a tenant evicted
//! everywhere would otherwise move to its hash home when it next comes back cold:
//! a cache already holding its share takes one tenant more and the one it came from
//! one fewer, and the first thrashes until some tenant moves back. Sending it to the
//! worker it was last routed to keeps the split the fleet settled into, as a sticky
//! router's memory does. Where some home has room, the room rule decides first; where
//! none is full yet (no engine evicts, or none reports evictions), the hash does, so
//! an added worker still takes its share of the prefixes. Measured in `kvgate simulate
//! scenarios` over eight seeds (docs/BENCHMARKS.md): the weakest seed of every scenario
//! but Zipf rose (steady 87.4 to 89.2%), Zipf's mean moved 0.1 point; the whole traces
//! moved by at most 0.6 points of hit rate and about 1% of TTFT p90.
//!
//! Before that, where every acceptable home is full, homing asks which prefix each
//! home's engine would evict for this one (`home_evicts_least_wanted`). An engine
//! evicts its least recently used blocks, so its next victim is the prefix this router
//! sent it longest ago that its index still shows; each prefix's demand is its count
//! of requests, each weighing half as much per `home_demand_half_life_secs` since. The
//! prompt goes to the home whose victim is clearly less wanted than every other home's
//! (by more than two standard deviations of chance: [`DEMAND_SIGNIFICANCE`]). Why:
//! with skewed popularity (Zipf), a rarely seen tenant cached nowhere that the hash or
//! the last-home rule sends to the worker holding a hot tenant as its oldest entry
//! pushes the hot tenant out, and that one comes back cold; evicting the rarer prefix
//! keeps the fleet's cache on the prefixes that are asked for. Why only clearly less:
//! under even demand the counts differ by chance, and the split the fleet settled into
//! (the last-home rule) is worth more; a first version that acted on any ratio of 2
//! moved tenants on that noise (overload −0.4 points on sixteen seeds). Measured in
//! `kvgate simulate scenarios` over sixteen seeds (docs/BENCHMARKS.md): Zipf 61.7 to
//! 62.9% (weakest seed 56.9 to 58.0%); steady, added, restart and reset identical;
//! bypass and overload within 0.3 points; the whole traces within run noise. Where this
//! router knows of no prefix a home still holds (it sent it none, or all were evicted),
//! the rule abstains. The memory is this router's own: a gateway replica does not see
//! what its peers sent, and requests that bypass the router refresh an engine's
//! entries unseen.
//!
//! Before all of these, where no home within the load bound has room (every engine
//! evicts), homing plans by demand (`home_plans_by_demand`). The prefixes routed
//! lately (demand of at least [`PLAN_DEMAND_FLOOR`]), this one included, are dealt out
//! most wanted first: to the home with the most demand homed on it (the prefixes last
//! routed there) until the next prefix does not fit, then to the next richest home, and
//! so on. A prefix takes its last prompt's blocks; a home holds what its cache holds
//! once full, the most blocks its index has held since its engine's cache was last
//! cleared (`PrefixIndex::peak_entries_of`; an index shows fewer while prompts are
//! being prefilled). The prompt goes to the home the plan gives its prefix; a prefix
//! left out of every home goes to the home whose planned prefixes are clearly the
//! least wanted ([`clearly_less_wanted`] on the sums), and where none is, the later
//! rules decide. Why: with skewed popularity (Zipf), an engine that caches the most
//! wanted prefixes and also takes a share of the rarely wanted ones, cached nowhere,
//! evicts hot prefixes for each cold prefill; they come back cold. Gathering the most wanted prefixes on the engines that hold them
//! best and sending what does not fit to the engine with the least to lose keeps the
//! fleet's cache on what is asked for, which a rule comparing single victims cannot
//! see (a cache never holds more than it fits). An oracle that sent the five hottest
//! tenants' cold prompts to one engine and every other to the second was 2.1 points
//! above kv_aware without the plan; the plan takes half of that. It acts before the
//! hit-ratio bound because the engine that takes the overflow has the lower hit ratio
//! by design (versions acting after the bound lost 1-2 points in Zipf). Under even
//! demand the order follows noise, so the plan can move a prefix the last-home rule
//! would have kept (a prefix left out of every home it leaves to the later rules
//! unless one home's planned demand is clearly the least); measured, that costs
//! nothing on the mean. Measured in `kvgate simulate scenarios` over 32 seeds
//! (docs/BENCHMARKS.md): Zipf 63.0 to 64.0% (weakest seed 58.0 to 60.2%) with 2.4%
//! more requests served, bypass +0.8 and overload +0.4 points, the others within 0.2
//! on the mean, and no scenario's weakest seed lower; in real time it leads both peers
//! in Zipf. The ranking of the prefixes still wanted is made at most once a second
//! ([`PLAN_RANKING_MAX_AGE`]; about 0.7 ms for 10,000 prefixes, paid by the decision
//! that remakes it), and a decision walks it only as far as the cold prefix's place or
//! the last room.
//!
//! Why the locality term: with the DESIGN cost alone, a request leaves its prefix holder
//! as soon as the holder's queued prefill outweighs the cached prefix. That is the
//! earliest start for this request, but the fleet then recomputes the prefix, and a
//! conversation's turns scatter over workers, so its later turns find less. Counting
//! the sole holder's lead `1 + locality_weight` times keeps conversations together
//! (docs/BENCHMARKS.md measures it). A prefix that two or more candidates hold (a
//! popular system prompt, once replicated) gives nobody a lead, so the DESIGN cost
//! alone decides and the requests spread; replicating a hot prefix is a one-time cost
//! that serves many later requests, while moving a conversation leaves its history
//! dead. Herding on a prefix only one worker holds yet is bounded by the load bound:
//! the holder stops being eligible once it is that far ahead.
//!
//! A prompt still being prefilled on a worker (booked in the ledger, first token not
//! seen yet) is credited as device-cached there, so a follow-up that arrives while its
//! predecessor is still queued can find it ([`Ledger::prefill_credits`]). The credit
//! cannot outlive its evidence: it ends at that request's first token, when the engine
//! has stored the blocks and published their events (from then on the index alone
//! says what the worker holds, evictions included), or when the request ends, and at
//! the latest `pending_credit_secs` after booking. Nothing renews it; a new or purged
//! worker, with an empty index and nothing in prefill, competes on load at once.
//!
//! The credit is a forecast, so it is weighed by the worker's credit trust: the share
//! of tokens credited to it that the engine then reported as served from cache
//! ([`WorkerAccuracy::credit_trust`]). Scaling the credit by that share makes it an
//! unbiased estimate of what the credit will really save, given how this worker's
//! recent credits turned out: a worker whose cache is thrashing (credited prefixes
//! evicted before the request ran) stops attracting follow-ups on the strength of
//! blocks it will not have, while a worker whose credits come true keeps full credit.
//! The prior behind the trust keeps a few samples from swinging it.
//!
//! What the index shows is weighed the same way, by the worker's index trust
//! ([`WorkerAccuracy::index_trust`]): the share of the tokens its index showed cached
//! at routing time that the engine then served from cache. It is 1 while requests run
//! soon after they are routed; it falls when a worker's queue outlasts its cache's
//! turnover, so that blocks present when a request is routed are evicted before its
//! prefill. Measured in `kvgate simulate` on the whole conversation trace with four
//! engines at four times its rate, where queues last minutes: without it kv_aware
//! predicted 37% more cached tokens than the engines served, with it 3% fewer; wherever
//! the fleet keeps up it changes nothing (docs/BENCHMARKS.md).
//!
//! [`Ledger::prefill_credits`]: crate::ledger::Ledger::prefill_credits
//! [`WorkerAccuracy::credit_trust`]: crate::ledger::WorkerAccuracy::credit_trust
//! [`WorkerAccuracy::index_trust`]: crate::ledger::WorkerAccuracy::index_trust
//! [`WorkerAccuracy::cache_hit_ratio`]: crate::ledger::WorkerAccuracy::cache_hit_ratio

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rustc_hash::{FxHashMap, FxHashSet};
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use super::scoring::{argmin_random_tie, load_lines, rng, softmax_sample, too_far_ahead};
use super::{
    Decision, FleetView, PolicyKind, RouteRequest, RoutingPolicy, SelectError, WorkerScore,
};
use crate::hashing::BlockKey;
use crate::ids::{Tier, WorkerId};
use crate::index::PrefixIndex;
use crate::ledger::PrefillCredit;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvAwareConfig {
    /// Weight of prefill work against decode work. Default 4, from the Mooncake and
    /// herding comparisons in docs/BENCHMARKS.md: at 1 a decode block counts as much as
    /// a block of prefill, and with long prompts the decode term drowns the cache
    /// savings (TTFT p90 and hit rate improved steadily from 1 to 4, with no herding).
    pub overlap_weight: f64,
    /// Weight of the prefill already queued on a worker relative to this request's own
    /// uncached blocks (1 = DESIGN section 3). Below 1, waiting behind a prefix holder's
    /// queue is preferred to recomputing the prefix elsewhere, which costs the fleet.
    pub prefill_queue_weight: f64,
    /// Longest time a prompt in prefill is credited as "being cached" on its worker (a
    /// follow-up can arrive while the previous request's prefill is still queued, before
    /// any event). The credit ends earlier, at that request's first token or end, in
    /// any case. 0 disables the credit.
    pub pending_credit_secs: f64,
    /// Extra weight of the lead in cached prefix that the best-cached candidate has over
    /// the runner-up (0 = DESIGN section 3). Keeps a conversation on the worker holding its
    /// history unless the load bound or a much shorter queue elsewhere says otherwise.
    pub locality_weight: f64,
    /// Load bound: a candidate whose requests in flight exceed the least loaded one's
    /// by more than this...
    pub balance_abs_threshold: u32,
    /// ...and by more than this factor is not eligible.
    pub balance_rel_threshold: f64,
    /// Warm-up: a candidate whose index holds less than this fraction of the
    /// candidates' mean entries (an engine just added, restarted or reset) is warming
    /// up, and no candidate may be more than [`WARMUP_SLACK`] requests in flight ahead
    /// of it. 0 disables the rule.
    pub warmup_fraction: f64,
    /// A prompt cached nowhere goes to its home worker (rendezvous hash of its first
    /// block key over the eligible candidates) instead of the cheapest one, so a prefix
    /// that every cache evicted comes back to the same worker rather than scattering.
    pub cold_homing: bool,
    /// Cold homing skips a candidate whose cache hit ratio (the share of prompt tokens
    /// its engine served from cache lately) is more than this below the best eligible
    /// candidate's: a worker whose cache thrashes is no home for one more prefix. 1
    /// or more disables the bound.
    pub home_hit_ratio_slack: f64,
    /// Cold homing prefers a candidate whose engine has not evicted since its cache was
    /// last cleared (it has room) to one that would evict for the prompt.
    pub home_prefers_room: bool,
    /// Cold homing sends a prefix back to the worker it was last routed to, when every
    /// acceptable home is full (evicts) and that worker is one of them, before asking
    /// the rendezvous hash.
    pub home_remembers_last: bool,
    /// Cold homing sends a prefix, when every acceptable home is full, to the one whose
    /// engine evicts next (its least recently used prefix) a prefix clearly less in
    /// demand than the other homes' next victims, before the last worker and the hash
    /// are asked.
    pub home_evicts_least_wanted: bool,
    /// Half-life of a prefix's demand (its decayed count of requests), in seconds.
    pub home_demand_half_life_secs: f64,
    /// Cold homing plans by demand where no home within the load bound has room: the
    /// prefixes routed lately, most wanted first, are dealt to the homes up to what each
    /// cache holds, and a prompt cached nowhere goes where the plan puts its prefix (or,
    /// left out, to the home with clearly the least planned demand), before the
    /// hit-ratio bound and the other homing rules.
    pub home_plans_by_demand: bool,
    /// 0 = argmin; > 0 samples with a softmax at this temperature.
    pub temperature: f64,
    /// Credit for a block held in host memory (1.0 = as good as device).
    pub host_credit: f64,
    /// Credit for a block held on disk or remote storage.
    pub disk_credit: f64,
}

impl Default for KvAwareConfig {
    fn default() -> Self {
        Self {
            overlap_weight: 4.0,
            prefill_queue_weight: 1.0,
            pending_credit_secs: 10.0,
            locality_weight: 64.0,
            balance_abs_threshold: 16,
            balance_rel_threshold: 1.5,
            warmup_fraction: 0.5,
            cold_homing: true,
            home_hit_ratio_slack: 0.2,
            home_prefers_room: true,
            home_remembers_last: true,
            home_evicts_least_wanted: true,
            home_demand_half_life_secs: 60.0,
            home_plans_by_demand: true,
            temperature: 0.0,
            host_credit: 0.5,
            disk_credit: 0.25,
        }
    }
}

/// How many requests in flight a candidate may be ahead of a warming-up one.
pub const WARMUP_SLACK: u32 = 1;

/// How many prefixes [`LastSent`] keeps in each of its two generations.
const LAST_SENT_PER_GENERATION: usize = 1 << 16;

/// What kv_aware remembers of a prefix (its first block key) it routed.
#[derive(Clone, Copy, Debug, PartialEq)]
struct PrefixSent {
    /// The worker it was last routed to.
    worker: WorkerId,
    /// Its recent demand: requests with it, each weighing half as much per half-life
    /// that has passed since (`home_demand_half_life_secs`), as of `at`.
    demand: f64,
    /// When it was last routed.
    at: Instant,
    /// Its last prompt's length in blocks: what caching it takes.
    blocks: f64,
}

impl PrefixSent {
    /// Its demand decayed to `now`.
    fn demand_at(&self, now: Instant, half_life_secs: f64) -> f64 {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        if half_life_secs > 0.0 {
            self.demand * (-elapsed / half_life_secs).exp2()
        } else {
            0.0
        }
    }
}

/// Each prefix's [`PrefixSent`], for cold homing. Bounded: two generations of at most
/// [`LAST_SENT_PER_GENERATION`] entries; when the current one fills it becomes the
/// previous one and the oldest generation is dropped, so a prefix routed within the
/// last 65,536 distinct prefixes is remembered. The prefixes whose demand reached
/// [`PLAN_DEMAND_FLOOR`] are listed apart too (`wanted`), so the demand plan walks those
/// and not every prefix remembered; a prefix leaves the list once its demand decays
/// below the floor.
#[derive(Debug, Default)]
struct LastSent {
    current: FxHashMap<BlockKey, PrefixSent>,
    previous: FxHashMap<BlockKey, PrefixSent>,
    wanted: FxHashSet<BlockKey>,
}

impl LastSent {
    fn get(&self, key: BlockKey) -> Option<PrefixSent> {
        self.current
            .get(&key)
            .or_else(|| self.previous.get(&key))
            .copied()
    }

    fn record(
        &mut self,
        key: BlockKey,
        worker: WorkerId,
        blocks: f64,
        now: Instant,
        half_life_secs: f64,
    ) {
        let demand = self
            .get(key)
            .map_or(0.0, |p| p.demand_at(now, half_life_secs))
            + 1.0;
        if self.current.len() >= LAST_SENT_PER_GENERATION && !self.current.contains_key(&key) {
            self.previous = std::mem::take(&mut self.current);
        }
        let sent = PrefixSent {
            worker,
            demand,
            at: now,
            blocks,
        };
        self.current.insert(key, sent);
        if demand >= PLAN_DEMAND_FLOOR {
            self.wanted.insert(key);
        }
    }

    /// Calls `each` with every remembered prefix whose demand at `now` is at least
    /// [`PLAN_DEMAND_FLOOR`], with that demand; drops the others from the list.
    fn for_each_wanted(
        &mut self,
        now: Instant,
        half_life_secs: f64,
        mut each: impl FnMut(BlockKey, &PrefixSent, f64),
    ) {
        let Self {
            current,
            previous,
            wanted,
        } = self;
        wanted.retain(|key| {
            let Some(sent) = current.get(key).or_else(|| previous.get(key)) else {
                return false;
            };
            let demand = sent.demand_at(now, half_life_secs);
            if demand < PLAN_DEMAND_FLOOR {
                return false;
            }
            each(*key, sent, demand);
            true
        });
    }
}

/// The least demand a prefix needs to be in the demand plan: half a request, so a
/// prefix asked for once drops out one half-life later. Measured with floors of 0.25,
/// 0.5, 1, 2 and 4 (docs/BENCHMARKS.md): 0.25-1 plan alike; higher floors leave more
/// of the fleet's content out of the plan and serve fewer requests in Zipf.
const PLAN_DEMAND_FLOOR: f64 = 0.5;

/// Cold homing's least-wanted rule acts only when one home's next eviction is wanted
/// less than another's by more than this many standard deviations of chance: demands
/// are counts of requests, and two equally wanted prefixes' counts differ by about the
/// square root of their sum (Poisson), so under even demand the rule would act on noise
/// and move tenants the split the fleet settled into (the last-home rule) keeps put.
const DEMAND_SIGNIFICANCE: f64 = 2.0;

/// Whether demand `least` is clearly below demand `next` ([`DEMAND_SIGNIFICANCE`]).
/// Two victims with no demand left (forgotten, decayed to nothing, or a half-life of 0)
/// pass too: neither is wanted, and the one sent longest ago goes first, as a single
/// LRU cache over the fleet would choose.
fn clearly_less_wanted(least: f64, next: f64) -> bool {
    next - least >= DEMAND_SIGNIFICANCE * (least + next).sqrt()
}

/// What the demand plan gives a prefix cached nowhere.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Planned {
    /// Home `homes[i]`: the plan has room for the prefix there.
    In(usize),
    /// Left out (the more wanted prefixes fill every home): home `homes[i]`, whose
    /// planned prefixes are clearly the least wanted.
    Overflow(usize),
}

/// How long a ranking of the prefixes still wanted serves the demand plan before it is
/// made again: ranking them sorts every one (about 0.7 ms for 10,000), while demand
/// moves over a half-life of a minute. A decision between rankings reads the cold
/// prefix's own demand afresh.
const PLAN_RANKING_MAX_AGE: Duration = Duration::from_secs(1);

/// The prefixes still wanted ([`LastSent::for_each_wanted`]), most wanted first, as of
/// `at`, with the demand last routed to each worker.
#[derive(Debug)]
struct DemandRanking {
    at: Instant,
    /// (demand, blocks, prefix), most wanted first.
    ranked: Vec<(f64, f64, BlockKey)>,
    /// Per worker, the demand of the prefixes last routed to it.
    homed: FxHashMap<WorkerId, f64>,
}

/// The demand plan ([`KvAwareConfig::home_plans_by_demand`]) for a prefix cached
/// nowhere with demand and length `own` (blocks): `ranked` gives the other prefixes
/// still wanted, most wanted first, each with its demand and blocks (wherever it was
/// last routed: every prefix wanted takes room in the plan); `homed` the demand last
/// routed to each home; `room` what each home's cache holds, in blocks. The prefixes,
/// most wanted first (of equal demand, the cold one last), fill the home with the most
/// demand homed on it until the next one does not fit, then the next richest home, and
/// so on.
/// Returns the cold prefix's home in the plan, or, where it is left out, the home whose
/// planned demand is clearly below every other's ([`clearly_less_wanted`]), or `None`.
/// Walks `ranked` only as far as the cold prefix's place or the last room.
fn plan_by_demand(
    ranked: impl IntoIterator<Item = (f64, f64)>,
    own: (f64, f64),
    homed: &[f64],
    mut room: Vec<f64>,
) -> Option<Planned> {
    let mut richest_first: Vec<usize> = (0..room.len()).collect();
    richest_first.sort_by(|&a, &b| homed[b].total_cmp(&homed[a]));
    let mut filling = richest_first.into_iter().peekable();
    let mut planned = vec![0.0; room.len()];
    let mut place = |(demand, blocks): (f64, f64)| {
        while filling.peek().is_some_and(|&h| room[h] < blocks) {
            filling.next();
        }
        let &h = filling.peek()?;
        room[h] -= blocks;
        planned[h] += demand;
        Some(h)
    };
    // The prefixes wanted at least as much as the cold one take their places first; if
    // one of them is left out, so is the cold one.
    let room_left = ranked
        .into_iter()
        .take_while(|&(demand, _)| demand >= own.0)
        .all(|prefix| place(prefix).is_some());
    if let Some(h) = room_left.then(|| place(own)).flatten() {
        return Some(Planned::In(h));
    }
    let mut least_first: Vec<usize> = (0..planned.len()).collect();
    least_first.sort_by(|&a, &b| planned[a].total_cmp(&planned[b]));
    match least_first.as_slice() {
        [least, next, ..]
            if planned[*next] > planned[*least]
                && clearly_less_wanted(planned[*least], planned[*next]) =>
        {
            Some(Planned::Overflow(*least))
        }
        _ => None,
    }
}

/// How many prefixes [`PrefixRecency`] remembers per worker.
const RECENCY_PER_WORKER: usize = 1 << 16;

/// When this router last sent each prefix (its first block key) to each worker, oldest
/// first per worker, to tell which prefix a full worker's engine evicts next: engines
/// evict the least recently used blocks, and a prefix's blocks were last used when a
/// request with it last ran there. Bounded: at most [`RECENCY_PER_WORKER`] prefixes per
/// worker (the oldest are forgotten first), and the order is compacted when stale
/// entries (prefixes sent again since) outnumber the live ones.
#[derive(Debug, Default)]
struct PrefixRecency {
    workers: FxHashMap<WorkerId, WorkerRecency>,
}

#[derive(Debug, Default)]
struct WorkerRecency {
    last_sent: FxHashMap<BlockKey, Instant>,
    /// (time sent, prefix), in the order recorded; an entry is stale when the prefix was
    /// sent again later (its `last_sent` differs).
    order: VecDeque<(Instant, BlockKey)>,
}

/// Whether a queued (time sent, prefix) entry is the prefix's latest send, given each
/// prefix's last send time.
fn is_latest_send(
    last_sent: &FxHashMap<BlockKey, Instant>,
    (at, key): (Instant, BlockKey),
) -> bool {
    last_sent.get(&key) == Some(&at)
}

impl WorkerRecency {
    fn is_live(&self, entry: (Instant, BlockKey)) -> bool {
        is_latest_send(&self.last_sent, entry)
    }

    fn drop_stale_front(&mut self) {
        while let Some(&front) = self.order.front() {
            if self.is_live(front) {
                break;
            }
            self.order.pop_front();
        }
    }
}

impl PrefixRecency {
    fn record(&mut self, worker: WorkerId, key: BlockKey, now: Instant) {
        let w = self.workers.entry(worker).or_default();
        w.last_sent.insert(key, now);
        w.order.push_back((now, key));
        w.drop_stale_front();
        if w.last_sent.len() > RECENCY_PER_WORKER {
            if let Some((_, oldest)) = w.order.pop_front() {
                w.last_sent.remove(&oldest);
            }
            w.drop_stale_front();
        }
        if w.order.len() > 2 * w.last_sent.len() + 64 {
            let last_sent = &w.last_sent;
            w.order.retain(|&entry| is_latest_send(last_sent, entry));
        }
    }

    /// The least recently sent prefix the worker still holds, and when it was sent
    /// (`holds` says whether its engine still caches a prefix; those it does not are
    /// forgotten), or `None` if this router knows of no prefix it holds.
    fn oldest_held(
        &mut self,
        worker: WorkerId,
        mut holds: impl FnMut(BlockKey) -> bool,
    ) -> Option<(Instant, BlockKey)> {
        let w = self.workers.get_mut(&worker)?;
        loop {
            w.drop_stale_front();
            let &(at, key) = w.order.front()?;
            if holds(key) {
                return Some((at, key));
            }
            w.order.pop_front();
            w.last_sent.remove(&key);
        }
    }

    /// Forgets workers not in `known`.
    fn retain(&mut self, known: &[WorkerId]) {
        self.workers.retain(|w, _| known.contains(w));
    }
}

#[derive(Debug)]
pub struct KvAwarePolicy {
    config: KvAwareConfig,
    rng: Mutex<SmallRng>,
    last_sent: Mutex<LastSent>,
    recency: Mutex<PrefixRecency>,
    /// The demand plan's ranking of the prefixes still wanted, made at most
    /// [`PLAN_RANKING_MAX_AGE`] ago.
    demand_ranking: Mutex<Option<DemandRanking>>,
}

impl KvAwarePolicy {
    pub fn new(config: KvAwareConfig, seed: Option<u64>) -> Self {
        Self {
            config,
            rng: rng(seed),
            last_sent: Mutex::new(LastSent::default()),
            recency: Mutex::new(PrefixRecency::default()),
            demand_ranking: Mutex::new(None),
        }
    }

    /// Indices of the eligible candidates: within the load bound and, while some
    /// candidate is warming up, at most [`WARMUP_SLACK`] requests ahead of the least
    /// loaded warming one. Never empty: the least loaded candidate (or warming
    /// candidate) always is eligible. Also says whether warm-up excluded anyone.
    fn eligible(&self, lines: &[WorkerScore], entries: &[usize]) -> (Vec<usize>, bool) {
        let min = lines.iter().map(|l| l.in_flight).min().unwrap_or(0);
        let c = &self.config;
        let mean = entries.iter().sum::<usize>() as f64 / entries.len().max(1) as f64;
        let warming = |i: usize| {
            c.warmup_fraction > 0.0 && mean > 0.0 && (entries[i] as f64) < c.warmup_fraction * mean
        };
        let warm_min = (0..lines.len())
            .filter(|&i| warming(i))
            .map(|i| lines[i].in_flight)
            .min();
        let mut warmup_excluded = false;
        let eligible = (0..lines.len())
            .filter(|&i| {
                let in_flight = lines[i].in_flight;
                if too_far_ahead(
                    in_flight,
                    min,
                    c.balance_abs_threshold,
                    c.balance_rel_threshold,
                ) {
                    return false;
                }
                let behind_warm_up = warm_min.is_some_and(|w| in_flight > w + WARMUP_SLACK);
                warmup_excluded |= behind_warm_up;
                !behind_warm_up
            })
            .collect();
        (eligible, warmup_excluded)
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
        let mut lines = load_lines(view);
        let credits = self.prefill_credits(req, view, keys);
        let cached = self.cached_blocks(&mut lines, &index.overlaps(keys), &credits);
        let block_size = f64::from(index.block_size());
        let prompt_blocks = f64::from(req.prompt_tokens) / block_size;
        let costs = self.costs(&mut lines, &cached.blocks, prompt_blocks, block_size);
        let entries = index.entries_of(view.candidates);
        let evicting = index.evicting_of(view.candidates);
        let choice = self.choose(
            &lines,
            &cached.blocks,
            &costs,
            keys,
            &entries,
            &evicting,
            &credits,
            prompt_blocks,
            index,
            req.now,
        );
        let i = choice.index;
        if let Some(first) = keys.first() {
            let c = &self.config;
            let worker = lines[i].worker;
            if c.home_remembers_last || c.home_evicts_least_wanted || c.home_plans_by_demand {
                let half_life = c.home_demand_half_life_secs;
                self.last_sent
                    .lock()
                    .record(*first, worker, prompt_blocks, req.now, half_life);
            }
            if c.home_evicts_least_wanted {
                self.recency.lock().record(worker, *first, req.now);
            }
        }
        let bs = index.block_size();
        let indexed_cached_tokens = cached.indexed_device[i] * bs;
        let credited_tokens = cached.credited[i] * bs;
        let trusted_credit = (credits[i].trust * f64::from(credited_tokens)).round() as u32;
        let trusted_indexed =
            (credits[i].index_trust * f64::from(indexed_cached_tokens)).round() as u32;
        let best_cost = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let reason = if choice.home {
            "cold miss: the prefix's home worker (cached nowhere)"
        } else if costs[i] > best_cost && choice.warmup_excluded {
            "warm-up: a worker with little cached is further behind on load"
        } else if costs[i] > best_cost {
            "load bound: the cheapest workers are overloaded"
        } else if lines[i].overlap_blocks.iter().any(|b| *b > 0) {
            "lowest cost: cached prefix outweighs load"
        } else {
            "lowest cost: no cached prefix, least work"
        };
        Ok(Decision {
            worker: lines[i].worker,
            policy: PolicyKind::KvAware,
            predicted_cached_tokens: trusted_indexed + trusted_credit,
            indexed_cached_tokens,
            credited_tokens,
            reason,
            scores: lines,
        })
    }

    fn workers_changed(&self, workers: &[(WorkerId, &str)]) {
        let known: Vec<WorkerId> = workers.iter().map(|(w, _)| *w).collect();
        self.recency.lock().retain(&known);
    }
}

/// Each candidate's cached prefix as kv_aware counts it.
struct Cached {
    /// Device blocks plus tier-credited host/disk blocks plus trusted prefill credit.
    blocks: Vec<f64>,
    /// Device blocks the index shows.
    indexed_device: Vec<u32>,
    /// Blocks credited for prompts in prefill there, beyond the index.
    credited: Vec<u32>,
}

/// The candidate chosen, and why it may not be the cheapest.
struct Choice {
    index: usize,
    /// Cold homing chose it (the prompt is cached nowhere).
    home: bool,
    /// The warm-up rule made some candidates ineligible.
    warmup_excluded: bool,
}

impl KvAwarePolicy {
    /// Credits for prompts in prefill (none when the credit is off) and the trusts,
    /// per candidate.
    fn prefill_credits(
        &self,
        req: &RouteRequest<'_>,
        view: &FleetView<'_>,
        keys: &[crate::BlockKey],
    ) -> Vec<PrefillCredit> {
        let c = &self.config;
        let ttl =
            Duration::try_from_secs_f64(c.pending_credit_secs.max(0.0)).unwrap_or(Duration::ZERO);
        view.ledger
            .prefill_credits(keys, view.candidates, req.now, ttl)
    }

    /// Each candidate's cached prefix (index overlap by tier, plus the prefill credit
    /// beyond it), recorded in its score line too.
    fn cached_blocks(
        &self,
        lines: &mut [WorkerScore],
        overlaps: &crate::index::OverlapScores,
        credits: &[PrefillCredit],
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
                // A prompt being prefilled on this worker counts as device-cached beyond
                // what the index shows, as far as this worker's credits come true.
                credited[i] = credit
                    .blocks
                    .saturating_sub(line.overlap_blocks.iter().sum::<u32>());
                if credited[i] > 0 {
                    line.overlap_blocks[Tier::Device.index()] += credited[i];
                }
                credit.index_trust * indexed + credit.trust * f64::from(credited[i])
            })
            .collect();
        Cached {
            blocks,
            indexed_device,
            credited,
        }
    }

    /// The cost of each candidate (module comment), recorded in its score line too.
    fn costs(
        &self,
        lines: &mut [WorkerScore],
        cached: &[f64],
        prompt_blocks: f64,
        block_size: f64,
    ) -> Vec<f64> {
        let c = &self.config;
        // Only a unique leader has an advantage: its lead over the runner-up.
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
            .map(|(line, cached)| {
                let advantage = if *cached >= first && second.is_finite() {
                    cached - second
                } else {
                    0.0
                };
                let new_prefill = c.prefill_queue_weight * line.prefill_tokens as f64 / block_size
                    + (prompt_blocks - cached).max(0.0)
                    - c.locality_weight * advantage;
                let cost = c.overlap_weight * new_prefill + line.decode_blocks;
                line.cost = Some(cost);
                cost
            })
            .collect()
    }

    /// The candidate to route to: among the eligible ones (load bound, warm-up), the
    /// prompt's home when it is cached nowhere (cold homing), else the cheapest (or a
    /// softmax sample at a temperature), ties broken at random.
    #[allow(clippy::too_many_arguments)]
    fn choose(
        &self,
        lines: &[WorkerScore],
        cached: &[f64],
        costs: &[f64],
        keys: &[crate::BlockKey],
        entries: &[usize],
        evicting: &[bool],
        credits: &[PrefillCredit],
        prompt_blocks: f64,
        index: &PrefixIndex,
        now: Instant,
    ) -> Choice {
        let c = &self.config;
        let (eligible, warmup_excluded) = self.eligible(lines, entries);
        let cold = keys.first().filter(|_| cached.iter().all(|x| *x <= 0.0));
        let home = cold.filter(|_| c.cold_homing).and_then(|first| {
            // The home may be busier than the least loaded candidate by at most this
            // prompt's own prefill (the module comment says why).
            let cheapest = eligible
                .iter()
                .map(|&i| costs[i])
                .fold(f64::INFINITY, f64::min);
            let slack = c.overlap_weight * prompt_blocks;
            let within_load: Vec<usize> = eligible
                .iter()
                .copied()
                .filter(|&i| costs[i] <= cheapest + slack)
                .collect();
            // A candidate with room (no eviction since its cache was cleared) takes the
            // prefix before one that would evict for it (the module comment says why).
            let with_room: Vec<usize> = within_load
                .iter()
                .copied()
                .filter(|&i| !evicting[i])
                .collect();
            // Where no home within the load bound has room, the demand plan decides
            // first, before the hit-ratio bound (the module comment says why).
            if c.home_plans_by_demand && with_room.is_empty() && within_load.len() > 1 {
                if let Some(planned) =
                    self.planned_home(lines, &within_load, *first, prompt_blocks, index, now)
                {
                    return Some(planned);
                }
            }
            let prefer_room =
                c.home_prefers_room && !with_room.is_empty() && with_room.len() < within_load.len();
            let homes = if prefer_room {
                with_room
            } else {
                let best_hit_ratio = eligible
                    .iter()
                    .map(|&i| credits[i].cache_hit_ratio)
                    .fold(0.0, f64::max);
                within_load
                    .into_iter()
                    .filter(|&i| {
                        credits[i].cache_hit_ratio >= best_hit_ratio - c.home_hit_ratio_slack
                    })
                    .collect()
            };
            // Where every acceptable home is full, the one whose engine evicts next a
            // prefix clearly less wanted than the others' would; else the worker the
            // prefix was last routed to, if it is one of them: the rendezvous hash
            // alone would move a tenant that the room rule or the load bound once
            // placed elsewhere (the module comment says why not).
            let all_full = homes.iter().all(|&i| evicting[i]);
            let least_wanted = (c.home_evicts_least_wanted && all_full && homes.len() > 1)
                .then(|| self.evicts_least_wanted(lines, &homes, index, now))
                .flatten();
            if least_wanted.is_some() {
                return least_wanted;
            }
            let last = (c.home_remembers_last && all_full)
                .then(|| self.last_sent.lock().get(*first))
                .flatten()
                .map(|sent| sent.worker)
                .and_then(|w| homes.iter().copied().find(|&i| lines[i].worker == w));
            last.or_else(|| {
                homes.into_iter().max_by_key(|&i| {
                    xxh3_64_with_seed(&first.0.to_le_bytes(), u64::from(lines[i].worker.0))
                })
            })
        });
        let index = if let Some(home) = home {
            home
        } else {
            let mut rng = self.rng.lock();
            let eligible_costs: Vec<f64> = eligible.iter().map(|&i| costs[i]).collect();
            let pick = if c.temperature > 0.0 {
                softmax_sample(&eligible_costs, c.temperature, &mut *rng)
            } else {
                argmin_random_tie(&eligible_costs, &mut *rng)
            };
            eligible[pick]
        };
        Choice {
            index,
            home: home.is_some(),
            warmup_excluded,
        }
    }

    /// Of `homes` (all full), where the demand plan ([`plan_by_demand`]) sends the
    /// prefix `first`, `prompt_blocks` long, cached nowhere; `None` where it does not
    /// say. A home holds what its cache holds once full: the most entries its index has
    /// held since its engine's cache was last cleared. The ranking of the prefixes still
    /// wanted is made again when it is older than [`PLAN_RANKING_MAX_AGE`].
    fn planned_home(
        &self,
        lines: &[WorkerScore],
        homes: &[usize],
        first: BlockKey,
        prompt_blocks: f64,
        index: &PrefixIndex,
        now: Instant,
    ) -> Option<usize> {
        let half_life = self.config.home_demand_half_life_secs;
        let own = self.last_sent.lock().get(first);
        let own_demand = own.map_or(0.0, |sent| sent.demand_at(now, half_life));
        let mut ranking = self.demand_ranking.lock();
        let stale = ranking
            .as_ref()
            .is_none_or(|r| now.saturating_duration_since(r.at) >= PLAN_RANKING_MAX_AGE);
        if stale {
            *ranking = Some(self.rank_demand(now));
        }
        let ranking = ranking.as_ref()?;
        let mut homed: Vec<f64> = homes
            .iter()
            .map(|&i| ranking.homed.get(&lines[i].worker).copied().unwrap_or(0.0))
            .collect();
        // The cold prefix's own demand is not its home's.
        if let Some(sent) = own {
            if let Some(h) = homes.iter().position(|&i| lines[i].worker == sent.worker) {
                homed[h] = (homed[h] - own_demand).max(0.0);
            }
        }
        let others = ranking
            .ranked
            .iter()
            .filter(|r| r.2 != first)
            .map(|&(demand, blocks, _)| (demand, blocks));
        let workers: Vec<WorkerId> = homes.iter().map(|&i| lines[i].worker).collect();
        let room = index
            .peak_entries_of(&workers)
            .into_iter()
            .map(|blocks| blocks as f64)
            .collect();
        match plan_by_demand(others, (own_demand, prompt_blocks), &homed, room)? {
            Planned::In(h) | Planned::Overflow(h) => Some(homes[h]),
        }
    }

    /// The prefixes still wanted at `now`, most wanted first.
    fn rank_demand(&self, now: Instant) -> DemandRanking {
        let half_life = self.config.home_demand_half_life_secs;
        let mut ranked = Vec::new();
        let mut homed: FxHashMap<WorkerId, f64> = FxHashMap::default();
        self.last_sent
            .lock()
            .for_each_wanted(now, half_life, |key, sent, demand| {
                ranked.push((demand, sent.blocks, key));
                *homed.entry(sent.worker).or_insert(0.0) += demand;
            });
        ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
        DemandRanking {
            at: now,
            ranked,
            homed,
        }
    }

    /// Of `homes` (all full), the one whose engine evicts next the prefix least in
    /// demand: each engine evicts its least recently used prefix, the one this router
    /// sent it longest ago that it still holds, and a cold prefix should displace the
    /// one the fleet will miss least. Only a victim clearly less wanted than every other
    /// home's ([`clearly_less_wanted`]; of equally unwanted ones, the one sent longest
    /// ago) decides; `None` otherwise, and when this router knows of no prefix some
    /// home still holds.
    fn evicts_least_wanted(
        &self,
        lines: &[WorkerScore],
        homes: &[usize],
        index: &PrefixIndex,
        now: Instant,
    ) -> Option<usize> {
        let half_life = self.config.home_demand_half_life_secs;
        let mut victims = Vec::with_capacity(homes.len());
        {
            let mut recency = self.recency.lock();
            for &i in homes {
                let worker = lines[i].worker;
                let victim = recency.oldest_held(worker, |key| {
                    index
                        .overlaps(&[key])
                        .best_for(worker)
                        .is_some_and(|o| o.on(Tier::Device) > 0)
                })?;
                victims.push((i, victim));
            }
        }
        let last_sent = self.last_sent.lock();
        let demand = |key: BlockKey| {
            last_sent
                .get(key)
                .map_or(0.0, |p| p.demand_at(now, half_life))
        };
        let mut ranked: Vec<(f64, Instant, usize)> = victims
            .into_iter()
            .map(|(i, (at, key))| (demand(key), at, i))
            .collect();
        ranked.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        match ranked.as_slice() {
            [least, next, ..] if clearly_less_wanted(least.0, next.0) => Some(least.2),
            _ => None,
        }
    }
}

#[cfg(test)]
mod memory_tests {
    use super::*;

    /// The memory keeps the last two generations of prefixes and no more: a prefix
    /// routed within the last [`LAST_SENT_PER_GENERATION`] distinct ones is remembered,
    /// one routed more than two generations ago is not, and re-routing a prefix moves it
    /// to its new worker.
    #[test]
    fn last_sent_is_bounded_to_two_generations() {
        let mut sent = LastSent::default();
        let now = Instant::now();
        let n = LAST_SENT_PER_GENERATION as u64;
        for k in 0..(2 * n + 10) {
            sent.record(BlockKey(k), WorkerId((k % 3) as u32), 1.0, now, 60.0);
        }
        assert!(sent.current.len() + sent.previous.len() <= 2 * LAST_SENT_PER_GENERATION);
        let worker = |sent: &LastSent, k| sent.get(BlockKey(k)).map(|p| p.worker);
        assert_eq!(worker(&sent, 0), None, "two generations ago");
        let recent = 2 * n + 9;
        assert_eq!(worker(&sent, recent), Some(WorkerId((recent % 3) as u32)));
        assert_eq!(worker(&sent, n + 5), Some(WorkerId(((n + 5) % 3) as u32)));
        sent.record(BlockKey(recent), WorkerId(9), 1.0, now, 60.0);
        assert_eq!(worker(&sent, recent), Some(WorkerId(9)));
    }

    /// A prefix's demand halves every half-life and counts each request as one.
    #[test]
    fn demand_decays_by_the_half_life() {
        let mut sent = LastSent::default();
        let t0 = Instant::now();
        let key = BlockKey(7);
        sent.record(key, WorkerId(0), 1.0, t0, 10.0);
        sent.record(key, WorkerId(0), 1.0, t0, 10.0);
        let p = sent.get(key).unwrap();
        assert_eq!(p.demand_at(t0, 10.0), 2.0);
        let later = t0 + Duration::from_secs(20);
        assert!((p.demand_at(later, 10.0) - 0.5).abs() < 1e-9);
        sent.record(key, WorkerId(1), 1.0, later, 10.0);
        assert!((sent.get(key).unwrap().demand_at(later, 10.0) - 1.5).abs() < 1e-9);
    }

    /// The least recently sent prefix a worker still holds: prefixes sent again since
    /// are found by their latest time, those the engine no longer holds are forgotten,
    /// and the per-worker order stays bounded under a stream of re-sent prefixes.
    #[test]
    fn recency_finds_the_least_recently_sent_prefix_still_held() {
        let mut recency = PrefixRecency::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let w = WorkerId(0);
        recency.record(w, BlockKey(1), at(1));
        recency.record(w, BlockKey(2), at(2));
        recency.record(w, BlockKey(3), at(3));
        recency.record(w, BlockKey(1), at(4));
        assert_eq!(recency.oldest_held(w, |_| true), Some((at(2), BlockKey(2))));
        // Prefix 2 was evicted: forgotten, and prefix 3 is next.
        assert_eq!(
            recency.oldest_held(w, |k| k != BlockKey(2)),
            Some((at(3), BlockKey(3)))
        );
        assert_eq!(recency.oldest_held(w, |_| true), Some((at(3), BlockKey(3))));
        assert_eq!(recency.oldest_held(w, |_| false), None);
        assert_eq!(recency.oldest_held(WorkerId(9), |_| true), None);
        // One prefix that is never re-sent holds the front; the others' stale entries
        // are compacted away.
        recency.record(w, BlockKey(100), at(5));
        for s in 0..10_000u64 {
            recency.record(w, BlockKey(200 + s % 4), at(6 + s));
        }
        let order = &recency.workers[&w].order;
        assert!(order.len() <= 2 * 5 + 64, "{}", order.len());
        assert_eq!(
            recency.oldest_held(w, |_| true),
            Some((at(5), BlockKey(100)))
        );
        recency.retain(&[WorkerId(1)]);
        assert_eq!(recency.oldest_held(w, |_| true), None);
    }

    /// The demand plan deals the most wanted prefixes to the home with the most demand
    /// homed on it until it is full, then to the next: a cold prefix wanted more than
    /// what fills the richest home's room goes there, one wanted less to the next home
    /// with room, and one left out of every home to the home whose planned prefixes are
    /// clearly the least wanted. Under even demand a prefix left out gets no home.
    #[test]
    fn the_demand_plan_fills_the_richest_home_first_and_sends_the_rest_to_the_poorest() {
        // The plan over `others` (demand, blocks, home) for a cold prefix `own`
        // (demand, blocks) and two homes' `room`.
        let plan = |others: &[(f64, f64, Option<usize>)], own, room: [f64; 2]| {
            let mut homed = [0.0; 2];
            for &(demand, _, home) in others {
                if let Some(h) = home {
                    homed[h] += demand;
                }
            }
            let mut ranked: Vec<(f64, f64)> = others.iter().map(|&(d, b, _)| (d, b)).collect();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
            plan_by_demand(ranked, own, &homed, room.to_vec())
        };
        // Home 1 has the two hottest prefixes (10, 8), home 0 the next two (6, 1); each
        // home holds two prefixes of 4 blocks.
        let fleet = [
            (10.0, 4.0, Some(1)),
            (6.0, 4.0, Some(0)),
            (8.0, 4.0, Some(1)),
            (1.0, 4.0, Some(0)),
        ];
        // Wanted more than the second hottest: the richest home (1).
        assert_eq!(plan(&fleet, (9.0, 4.0), [8.0, 8.0]), Some(Planned::In(1)));
        // Wanted less: home 1 is full with 10 and 8, so home 0 (behind the 6).
        assert_eq!(plan(&fleet, (7.0, 4.0), [8.0, 8.0]), Some(Planned::In(0)));
        // Wanted least: every home is full; home 0's planned demand (6 + 1) is clearly
        // below home 1's (10 + 8).
        assert_eq!(
            plan(&fleet, (0.5, 4.0), [8.0, 8.0]),
            Some(Planned::Overflow(0))
        );
        // A larger cache takes it in.
        assert_eq!(plan(&fleet, (0.5, 4.0), [8.0, 12.0]), Some(Planned::In(0)));
        // A prompt too long for what is left of the richest home goes to the next.
        assert_eq!(
            plan(&fleet, (9.0, 10.0), [12.0, 12.0]),
            Some(Planned::In(0))
        );
        // Even demand: the prefix left out has no home in the plan.
        let even = [
            (5.0, 4.0, Some(0)),
            (5.0, 4.0, Some(1)),
            (5.0, 4.0, Some(0)),
            (5.0, 4.0, Some(1)),
        ];
        assert_eq!(plan(&even, (4.0, 4.0), [8.0, 8.0]), None);
        // Of equal demand, the prefixes already remembered come first.
        let tie = [(5.0, 4.0, Some(0))];
        assert_eq!(plan(&tie, (5.0, 4.0), [4.0, 4.0]), Some(Planned::In(1)));
        // The walk stops at the cold prefix's place: what follows is never read.
        let stops = plan_by_demand(
            [(10.0, 4.0), (f64::NAN, f64::NAN)],
            (20.0, 4.0),
            &[10.0, 0.0],
            vec![8.0, 8.0],
        );
        assert_eq!(stops, Some(Planned::In(0)));
    }

    /// The prefixes in the demand plan are those whose demand is at least
    /// [`PLAN_DEMAND_FLOOR`]; one asked for once drops out after a half-life.
    #[test]
    fn the_plan_walks_the_prefixes_still_wanted() {
        let mut sent = LastSent::default();
        let t0 = Instant::now();
        sent.record(BlockKey(1), WorkerId(0), 4.0, t0, 10.0);
        sent.record(BlockKey(2), WorkerId(1), 4.0, t0, 10.0);
        sent.record(BlockKey(2), WorkerId(1), 4.0, t0, 10.0);
        let wanted_at = |sent: &mut LastSent, t| {
            let mut keys = Vec::new();
            sent.for_each_wanted(t, 10.0, |k, _, _| keys.push(k.0));
            keys.sort_unstable();
            keys
        };
        assert_eq!(wanted_at(&mut sent, t0), vec![1, 2]);
        // One half-life and a bit: prefix 1's demand is below 0.5, prefix 2's is not.
        let later = t0 + Duration::from_secs(11);
        assert_eq!(wanted_at(&mut sent, later), vec![2]);
        assert_eq!(sent.wanted.len(), 1, "dropped from the list");
    }

    /// At most [`RECENCY_PER_WORKER`] prefixes per worker: the oldest are forgotten.
    #[test]
    fn recency_is_bounded_per_worker() {
        let mut recency = PrefixRecency::default();
        let t0 = Instant::now();
        let w = WorkerId(0);
        let n = RECENCY_PER_WORKER as u64 + 10;
        for k in 0..n {
            recency.record(w, BlockKey(k), t0 + Duration::from_millis(k));
        }
        assert_eq!(recency.workers[&w].last_sent.len(), RECENCY_PER_WORKER);
        let oldest = recency.oldest_held(w, |_| true).unwrap().1;
        assert_eq!(oldest, BlockKey(10));
    }
}
