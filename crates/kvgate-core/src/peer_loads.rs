//! Load that other router replicas have booked on the workers this router shares with
//! them, as each replica last reported it.
//!
//! Owns the per-replica reports and their per-worker sums, and the rules that keep
//! them honest: a report replaces the replica's previous one whole (reports are
//! totals, not deltas, so a lost or repeated message cannot leave drift behind); a
//! replica that restarts under the same name (a newer incarnation) replaces its old
//! bookings rather than adding to them; a report older than the one held is ignored;
//! a replica that went silent is dropped by [`PeerLoads::expire`]. It must not do I/O
//! or know how reports travel (the gateway's peers module does), and it never holds
//! this router's own bookings (the ledger does).
//!
//! Reports also carry the replica's prompts in prefill (their checkpoint keys, per
//! worker), so kv_aware's prefill credit sees a prompt another replica is prefilling as
//! it sees its own ([`PeerLoads::prefilling_on`]).
//!
//! Decisions made for a peer: when replicas delegate their choices to one leader
//! replica (so that requests arriving at several replicas at once are decided in one
//! place, in order), the leader holds each choice it made for a peer as that peer's
//! booking ([`PeerLoads::delegate`]) until the peer's report says it has booked it
//! (the report's `settled` ids: from then on its totals include it) or the peer went
//! away; a choice never settled expires with the replica's silence bound.
//!
//! Reports name workers by [`WorkerId`]: the caller resolves the peer's worker URLs
//! to this process's ids before applying, and drops workers it does not serve.

use std::time::{Duration, Instant};

use rustc_hash::FxHashMap;
use serde::Serialize;
use smallvec::SmallVec;

use crate::hashing::BlockKey;
use crate::ids::WorkerId;
use crate::load::WorkerLoad;

/// One replica's report of the load it has booked, per worker.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerReport {
    /// The replica's name (stable across its restarts, e.g. a pod name).
    pub replica: String,
    /// Which run of that replica: a larger value is a later run (the gateway uses its
    /// start time), so a restarted replica's reports replace its old ones.
    pub incarnation: u64,
    /// Increases with every report of one incarnation.
    pub seq: u64,
    pub loads: Vec<(WorkerId, WorkerLoad)>,
    /// The prompts the replica booked that are still in prefill: per booking, its
    /// worker and its prompt's checkpoint keys (see the ledger's prefill credit).
    pub prefilling: Vec<(WorkerId, Vec<BlockKey>)>,
    /// Ids of decisions this router made for the replica ([`PeerLoads::delegate`])
    /// that the replica has since booked (its loads include them) or given up.
    pub settled: Vec<u64>,
    /// Every decision id below this one is settled too (0 from a replica that does not
    /// say): a report that arrives late, or after others were skipped, still ends the
    /// holds of choices whose ids have aged out of `settled`.
    pub settled_below: u64,
}

/// A choice this router made for a peer replica that its reports do not show yet.
#[derive(Clone, Debug)]
struct Delegated {
    id: u64,
    worker: WorkerId,
    load: WorkerLoad,
    prefilling: Vec<BlockKey>,
    at: Instant,
}

/// What applying a report did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerApplied {
    /// First report heard from this replica.
    New,
    /// A newer report of the same run replaced the previous one.
    Updated,
    /// A later run of the replica replaced the earlier run's bookings.
    Restarted,
    /// Older than (or the same as) what is held: ignored.
    Stale,
}

/// Totals over every peer replica held.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct PeerStats {
    /// Replicas whose reports are held.
    pub replicas: usize,
    /// Their requests in flight, summed over workers.
    pub in_flight: u64,
}

#[derive(Debug)]
struct Held {
    incarnation: u64,
    seq: u64,
    heard_at: Instant,
    loads: Vec<(WorkerId, WorkerLoad)>,
    prefilling: Vec<(WorkerId, Vec<BlockKey>)>,
    /// Choices made here for this replica and not yet settled by its reports.
    delegated: Vec<Delegated>,
}

/// The peer replicas' reports and their sum per worker.
#[derive(Debug, Default)]
pub struct PeerLoads {
    replicas: FxHashMap<String, Held>,
    totals: FxHashMap<WorkerId, WorkerLoad>,
    /// Checkpoint key → workers on which a peer's booking is prefilling a prompt with
    /// that key.
    prefilling: FxHashMap<BlockKey, SmallVec<[WorkerId; 2]>>,
}

impl PeerLoads {
    /// Applies a report heard at `now`. A report of the same run that is not newer is
    /// ignored, but still counts as hearing from the replica.
    pub fn apply(&mut self, report: PeerReport, now: Instant) -> PeerApplied {
        let mut delegated = Vec::new();
        let applied = match self.replicas.get_mut(&report.replica) {
            None => PeerApplied::New,
            Some(held) => {
                if report.incarnation < held.incarnation
                    || (report.incarnation == held.incarnation && report.seq <= held.seq)
                {
                    if report.incarnation == held.incarnation {
                        held.heard_at = now;
                    }
                    return PeerApplied::Stale;
                }
                if report.incarnation > held.incarnation {
                    PeerApplied::Restarted
                } else {
                    // Choices the replica has not settled yet stay counted.
                    delegated = std::mem::take(&mut held.delegated);
                    delegated.retain(|d| {
                        d.id >= report.settled_below && !report.settled.contains(&d.id)
                    });
                    PeerApplied::Updated
                }
            }
        };
        self.replicas.insert(
            report.replica,
            Held {
                incarnation: report.incarnation,
                seq: report.seq,
                heard_at: now,
                loads: report.loads,
                prefilling: report.prefilling,
                delegated,
            },
        );
        self.recompute();
        applied
    }

    /// Holds a choice this router made for `replica` (run `incarnation`) as that
    /// replica's booking of `load` on `worker`, with its prompt's checkpoint keys in
    /// prefill, until a report of the replica settles `id`. False (nothing held) when
    /// no report of that run is held: a replica this router does not follow would
    /// never settle it.
    #[allow(clippy::too_many_arguments)]
    pub fn delegate(
        &mut self,
        replica: &str,
        incarnation: u64,
        id: u64,
        worker: WorkerId,
        load: WorkerLoad,
        prefilling: Vec<BlockKey>,
        now: Instant,
    ) -> bool {
        let Some(held) = self.replicas.get_mut(replica) else {
            return false;
        };
        if held.incarnation != incarnation {
            return false;
        }
        // Added in place (a decision is made per request; a rebuild is per report).
        let t = self.totals.entry(worker).or_default();
        t.in_flight += load.in_flight;
        t.prefill_tokens += load.prefill_tokens;
        t.decode_blocks += load.decode_blocks;
        for key in &prefilling {
            let on = self.prefilling.entry(*key).or_default();
            if !on.contains(&worker) {
                on.push(worker);
            }
        }
        held.delegated.push(Delegated {
            id,
            worker,
            load,
            prefilling,
            at: now,
        });
        true
    }

    /// Choices made here for peers and not yet settled, over all replicas.
    pub fn delegated(&self) -> usize {
        self.replicas.values().map(|h| h.delegated.len()).sum()
    }

    /// Drops a replica's bookings when the stream of its run `incarnation` ended.
    /// True when they were held; a later run's bookings (the replica restarted and
    /// reports on another stream) are kept.
    pub fn remove(&mut self, replica: &str, incarnation: u64) -> bool {
        let held = self
            .replicas
            .get(replica)
            .is_some_and(|h| h.incarnation == incarnation);
        if held {
            self.replicas.remove(replica);
            self.recompute();
        }
        held
    }

    /// Drops every replica not heard from for longer than `silence`, and choices made
    /// for a replica that its reports have not settled within `silence`; returns the
    /// names of the replicas dropped.
    pub fn expire(&mut self, now: Instant, silence: Duration) -> Vec<String> {
        let mut stale_choices = false;
        for held in self.replicas.values_mut() {
            let before = held.delegated.len();
            held.delegated
                .retain(|d| now.saturating_duration_since(d.at) <= silence);
            stale_choices |= held.delegated.len() != before;
        }
        if stale_choices {
            self.recompute();
        }
        let gone: Vec<String> = self
            .replicas
            .iter()
            .filter(|(_, h)| now.saturating_duration_since(h.heard_at) > silence)
            .map(|(name, _)| name.clone())
            .collect();
        if !gone.is_empty() {
            for name in &gone {
                self.replicas.remove(name);
            }
            self.recompute();
        }
        gone
    }

    /// Forgets a worker this router no longer serves.
    pub fn forget_worker(&mut self, worker: WorkerId) {
        for held in self.replicas.values_mut() {
            held.loads.retain(|(w, _)| *w != worker);
            held.prefilling.retain(|(w, _)| *w != worker);
            held.delegated.retain(|d| d.worker != worker);
        }
        self.recompute();
    }

    /// The workers on which a peer's booking is prefilling a prompt that has this
    /// checkpoint key.
    pub fn prefilling_on(&self, key: &BlockKey) -> &[WorkerId] {
        self.prefilling.get(key).map_or(&[], |w| w.as_slice())
    }

    /// Whether any peer reported a prompt in prefill.
    pub fn has_prefilling(&self) -> bool {
        !self.prefilling.is_empty()
    }

    /// The peers' summed load on one worker (zero when none is held).
    pub fn load(&self, worker: WorkerId) -> WorkerLoad {
        self.totals.get(&worker).copied().unwrap_or_default()
    }

    pub fn stats(&self) -> PeerStats {
        PeerStats {
            replicas: self.replicas.len(),
            in_flight: self.totals.values().map(|l| u64::from(l.in_flight)).sum(),
        }
    }

    /// Names of the replicas held, sorted.
    pub fn replicas(&self) -> Vec<String> {
        let mut names: Vec<String> = self.replicas.keys().cloned().collect();
        names.sort();
        names
    }

    /// Rebuilt from the held reports rather than adjusted, so no float drift or lost
    /// subtraction can survive a change (replicas × workers is small).
    fn recompute(&mut self) {
        self.totals.clear();
        self.prefilling.clear();
        for held in self.replicas.values() {
            let delegated_prefills = held.delegated.iter().map(|d| (&d.worker, &d.prefilling));
            for (worker, keys) in held
                .prefilling
                .iter()
                .map(|(w, k)| (w, k))
                .chain(delegated_prefills)
            {
                for key in keys {
                    let on = self.prefilling.entry(*key).or_default();
                    if !on.contains(worker) {
                        on.push(*worker);
                    }
                }
            }
            let delegated_loads = held.delegated.iter().map(|d| (&d.worker, &d.load));
            for (worker, l) in held
                .loads
                .iter()
                .map(|(w, l)| (w, l))
                .chain(delegated_loads)
            {
                let t = self.totals.entry(*worker).or_default();
                t.in_flight += l.in_flight;
                t.prefill_tokens += l.prefill_tokens;
                t.decode_blocks += l.decode_blocks;
            }
        }
    }
}

/// Adds two loads (this router's and the peers', or those and the unseen).
pub fn sum(a: WorkerLoad, b: WorkerLoad) -> WorkerLoad {
    WorkerLoad {
        in_flight: a.in_flight + b.in_flight,
        prefill_tokens: a.prefill_tokens + b.prefill_tokens,
        decode_blocks: a.decode_blocks + b.decode_blocks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(in_flight: u32) -> WorkerLoad {
        WorkerLoad {
            in_flight,
            prefill_tokens: u64::from(in_flight) * 100,
            decode_blocks: f64::from(in_flight) * 2.0,
        }
    }

    fn report(replica: &str, incarnation: u64, seq: u64, loads: &[(u32, u32)]) -> PeerReport {
        PeerReport {
            replica: replica.into(),
            incarnation,
            seq,
            loads: loads
                .iter()
                .map(|(w, n)| (WorkerId(*w), load(*n)))
                .collect(),
            prefilling: Vec::new(),
            settled: Vec::new(),
            settled_below: 0,
        }
    }

    #[test]
    fn replicas_add_up_per_worker_and_a_report_replaces_the_previous_one_whole() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        assert_eq!(
            p.apply(report("a", 1, 1, &[(0, 2), (1, 1)]), t),
            PeerApplied::New
        );
        assert_eq!(p.apply(report("b", 7, 1, &[(0, 3)]), t), PeerApplied::New);
        assert_eq!(p.load(WorkerId(0)), load(5));
        assert_eq!(p.load(WorkerId(1)), load(1));
        // a's next report no longer names worker 1: its bookings there ended.
        assert_eq!(
            p.apply(report("a", 1, 2, &[(0, 1)]), t),
            PeerApplied::Updated
        );
        assert_eq!(p.load(WorkerId(0)), load(4));
        assert_eq!(p.load(WorkerId(1)), WorkerLoad::default());
        assert_eq!(
            p.stats(),
            PeerStats {
                replicas: 2,
                in_flight: 4
            }
        );
    }

    #[test]
    fn a_restarted_replica_replaces_its_old_bookings_and_old_reports_are_ignored() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        p.apply(report("a", 10, 5, &[(0, 4)]), t);
        // Same name, later run: its old run's 4 requests are gone with it.
        assert_eq!(
            p.apply(report("a", 20, 1, &[(0, 1)]), t),
            PeerApplied::Restarted
        );
        assert_eq!(p.load(WorkerId(0)), load(1));
        // A late report of the old run, or a repeat, changes nothing.
        assert_eq!(
            p.apply(report("a", 10, 6, &[(0, 9)]), t),
            PeerApplied::Stale
        );
        assert_eq!(
            p.apply(report("a", 20, 1, &[(0, 9)]), t),
            PeerApplied::Stale
        );
        assert_eq!(p.load(WorkerId(0)), load(1));
        assert_eq!(p.stats().replicas, 1);
        // The old run's stream ending does not take the new run's bookings with it.
        assert!(!p.remove("a", 10));
        assert_eq!(p.load(WorkerId(0)), load(1));
        assert!(p.remove("a", 20));
    }

    #[test]
    fn a_silent_replica_expires_and_a_closed_one_is_removed() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        p.apply(report("a", 1, 1, &[(0, 2)]), t);
        p.apply(
            report("b", 1, 1, &[(0, 3)]),
            t + Duration::from_millis(1500),
        );
        let gone = p.expire(t + Duration::from_millis(2500), Duration::from_secs(2));
        assert_eq!(gone, vec!["a".to_owned()]);
        assert_eq!(p.load(WorkerId(0)), load(3));
        // A repeated report still counts as hearing from b.
        p.apply(
            report("b", 1, 1, &[(0, 3)]),
            t + Duration::from_millis(3000),
        );
        assert!(p
            .expire(t + Duration::from_millis(4500), Duration::from_secs(2))
            .is_empty());
        assert!(p.remove("b", 1));
        assert!(!p.remove("b", 1));
        assert_eq!(p.load(WorkerId(0)), WorkerLoad::default());
        assert_eq!(p.stats(), PeerStats::default());
    }

    #[test]
    fn prompts_in_prefill_are_held_per_replica_and_replaced_with_its_reports() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        let mut r = report("a", 1, 1, &[(0, 1)]);
        r.prefilling = vec![(WorkerId(0), vec![BlockKey(7), BlockKey(9)])];
        p.apply(r, t);
        let mut r = report("b", 1, 1, &[(1, 1)]);
        r.prefilling = vec![(WorkerId(1), vec![BlockKey(7)])];
        p.apply(r, t);
        assert_eq!(
            p.prefilling_on(&BlockKey(7)),
            &[WorkerId(0), WorkerId(1)][..]
        );
        assert_eq!(p.prefilling_on(&BlockKey(9)), &[WorkerId(0)][..]);
        // a's prefill ended (first token): its next report has none.
        p.apply(report("a", 1, 2, &[(0, 1)]), t);
        assert_eq!(p.prefilling_on(&BlockKey(7)), &[WorkerId(1)][..]);
        assert!(p.prefilling_on(&BlockKey(9)).is_empty());
        p.forget_worker(WorkerId(1));
        assert!(!p.has_prefilling());
    }

    #[test]
    fn a_forgotten_worker_loses_its_peer_load() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        p.apply(report("a", 1, 1, &[(0, 2), (1, 1)]), t);
        p.forget_worker(WorkerId(0));
        assert_eq!(p.load(WorkerId(0)), WorkerLoad::default());
        p.apply(report("b", 1, 1, &[(1, 1)]), t);
        assert_eq!(p.load(WorkerId(0)), WorkerLoad::default());
        assert_eq!(p.load(WorkerId(1)), load(2));
    }

    #[test]
    fn a_choice_made_for_a_peer_counts_until_its_report_settles_it() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        // Only a replica whose reports are held can be decided for.
        assert!(!p.delegate("a", 1, 7, WorkerId(0), load(1), vec![BlockKey(3)], t));
        p.apply(report("a", 1, 1, &[(0, 1)]), t);
        assert!(!p.delegate("a", 2, 7, WorkerId(0), load(1), Vec::new(), t));
        assert!(p.delegate("a", 1, 7, WorkerId(0), load(1), vec![BlockKey(3)], t));
        assert!(p.delegate("a", 1, 8, WorkerId(1), load(1), Vec::new(), t));
        assert_eq!(p.load(WorkerId(0)), load(2));
        assert_eq!(p.prefilling_on(&BlockKey(3)), &[WorkerId(0)][..]);
        assert_eq!(p.delegated(), 2);
        // A report that settles nothing keeps both choices beside its own totals.
        p.apply(report("a", 1, 2, &[(0, 1)]), t);
        assert_eq!(p.load(WorkerId(0)), load(2));
        assert_eq!(p.load(WorkerId(1)), load(1));
        // The replica booked choice 7: its report counts it and the choice goes.
        let mut r = report("a", 1, 3, &[(0, 2)]);
        r.settled = vec![7];
        p.apply(r, t);
        assert_eq!(p.load(WorkerId(0)), load(2));
        assert_eq!(p.load(WorkerId(1)), load(1));
        assert!(p.prefilling_on(&BlockKey(3)).is_empty());
        assert_eq!(p.delegated(), 1);
        // A choice never settled expires with the silence bound, the replica stays.
        let later = t + Duration::from_millis(2500);
        p.apply(report("a", 1, 4, &[(0, 2)]), later);
        assert!(p.expire(later, Duration::from_secs(2)).is_empty());
        assert_eq!(p.load(WorkerId(1)), WorkerLoad::default());
        assert_eq!(p.delegated(), 0);
    }

    /// A follower whose reports reach this router late, or skip some, still ends the
    /// holds of the choices it settled once their ids have aged out of its reports'
    /// lists: every id below its reports' `settled_below` is settled.
    #[test]
    fn a_late_report_settles_every_choice_below_its_watermark() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        p.apply(report("a", 1, 1, &[]), t);
        for id in [7, 8, 9] {
            assert!(p.delegate("a", 1, id, WorkerId(0), load(1), Vec::new(), t));
        }
        // 7 and 8 were booked and their ids have left the list; 9 is still asked.
        let mut r = report("a", 1, 5, &[(0, 2)]);
        r.settled_below = 9;
        p.apply(r, t);
        assert_eq!(p.delegated(), 1);
        assert_eq!(p.load(WorkerId(0)), load(3));
        // A report from a replica that does not say (0) settles nothing by it.
        let mut r = report("a", 1, 6, &[(0, 2)]);
        r.settled_below = 0;
        p.apply(r, t);
        assert_eq!(p.delegated(), 1);
    }

    #[test]
    fn choices_made_for_a_peer_go_with_its_run() {
        let mut p = PeerLoads::default();
        let t = Instant::now();
        p.apply(report("a", 1, 1, &[]), t);
        assert!(p.delegate("a", 1, 7, WorkerId(0), load(1), Vec::new(), t));
        // A restart replaces the old run's bookings, choices made for it included.
        p.apply(report("a", 2, 1, &[]), t);
        assert_eq!(p.load(WorkerId(0)), WorkerLoad::default());
        assert!(p.delegate("a", 2, 8, WorkerId(0), load(1), Vec::new(), t));
        assert!(p.remove("a", 2));
        assert_eq!(p.load(WorkerId(0)), WorkerLoad::default());
        assert_eq!(p.delegated(), 0);
    }
}
