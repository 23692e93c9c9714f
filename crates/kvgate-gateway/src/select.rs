//! Choosing a worker for a prepared request: ask the model's selection service
//! (kvgate-selection) to choose among the healthy candidates with a free slot, and
//! take the chosen worker's lease (lease.rs books it), waiting (bounded) for a slot
//! when every candidate is full; with replicas that decide at a leader, the choice
//! comes from the leader (peers/leader.rs) and is booked here the same way. Also the
//! picker that routed requests give the attempt loop ([`Routed`]): each attempt chooses
//! again, away from the workers that failed, pins a data-parallel rank, and logs the
//! decision.
//!
//! Owns selection and the routed lease. Must not send requests (failover.rs) and
//! never holds the index lock across an `.await`.

use std::sync::Arc;
use std::time::Instant;

use http::HeaderMap;
use kvgate_core::{BlockKey, Decision, PolicyKind, SelectError, WorkerId, WorkerScore};
use kvgate_selection::SelectRequest;
use smallvec::SmallVec;

use crate::errors::ApiError;
use crate::failover::{Picked, Picker};
use crate::gateway::Gateway;
use crate::lease::{booking_spec, Lease};
use crate::limits::Admission;
use crate::metrics::RequestRecord;
use crate::peers::leader::{choose_at_leader, decides_at_leader, LeaderChoice};
use crate::prepare::Prepared;
use crate::registry::{ModelState, Worker};

/// Which healthy workers a selection may choose from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Candidates {
    /// Only workers below `--max-in-flight-per-worker` (a request about to be sent).
    WithFreeSlot,
    /// Every healthy worker (`/v1/route/explain`: nothing is booked).
    AllHealthy,
}

/// Outcome of one selection attempt.
pub enum Pick {
    Chosen {
        decision: Decision,
        worker: Arc<Worker>,
    },
    /// Healthy candidates exist but all are at their in-flight limit.
    Full,
    /// No healthy candidate (after exclusions).
    NoneHealthy,
}

/// One synchronous selection over the healthy workers not in `excluded`. Books
/// nothing: the caller takes a lease on the chosen worker.
pub fn try_pick(
    gw: &Gateway,
    p: &Prepared,
    session_key: Option<&str>,
    excluded: &[WorkerId],
    candidates_from: Candidates,
) -> Result<Pick, ApiError> {
    let model = &p.model;
    let workers = model.workers();
    let found = candidates(gw, model, &workers, excluded, candidates_from);
    if found.ids.is_empty() {
        return Ok(if found.any_healthy {
            Pick::Full
        } else {
            Pick::NoneHealthy
        });
    }
    let req = SelectRequest {
        block_keys: p.keys.as_deref(),
        prompt_tokens: p.prompt_tokens,
        session_key,
        now: Instant::now(),
        objective: p.objective,
    };
    let start = Instant::now();
    let result = model.selection.select(&req, &found.ids);
    gw.metrics
        .decision_seconds
        .with_label_values(&[&*model.name, model.kind().as_str()])
        .observe(start.elapsed().as_secs_f64());
    let decision = match result {
        Ok(d) => d,
        Err(SelectError::NoIndex) => return Err(ApiError::kv_events_not_configured(&model.name)),
        Err(SelectError::MissingTokens) => {
            return Err(ApiError::bad_request(
                "missing_tokens",
                format!(
                    "{} routing needs the prompt's token ids and this request has none",
                    model.kind()
                ),
            ))
        }
        Err(SelectError::NoCandidates) => return Ok(Pick::NoneHealthy),
        Err(SelectError::Shed { late }) => return Err(ApiError::shed(&model.name, late)),
    };
    let Some(worker) = workers.iter().find(|w| w.id == decision.worker).cloned() else {
        return Err(ApiError::internal("the policy chose an unknown worker"));
    };
    Ok(Pick::Chosen { decision, worker })
}

/// The workers a selection may choose from.
struct Found {
    ids: SmallVec<[WorkerId; 16]>,
    /// Some worker is healthy (the candidates may still be empty: all full).
    any_healthy: bool,
}

/// Healthy workers (breaker closed) not in `excluded`, and with a free slot unless
/// `from` says otherwise.
fn candidates(
    gw: &Gateway,
    model: &ModelState,
    workers: &[Arc<Worker>],
    excluded: &[WorkerId],
    from: Candidates,
) -> Found {
    let passive = gw.passive_open_ms();
    let limit = gw.config.limits.max_in_flight_per_worker;
    let mut found = Found {
        ids: SmallVec::new(),
        any_healthy: false,
    };
    for w in workers {
        if w.breaker.available(passive) && !excluded.contains(&w.id) {
            found.ids.push(w.id);
        }
    }
    found.any_healthy = !found.ids.is_empty();
    if from == Candidates::WithFreeSlot && limit > 0 {
        // One read of the ledger for every healthy worker's in-flight count.
        let loads = model.ledger().loads_of(&found.ids);
        let mut loads = loads.iter();
        found
            .ids
            .retain(|_| loads.next().is_some_and(|l| l.in_flight < limit));
    }
    found
}

/// The session key of a request, from the model's session header.
pub fn session_key<'h>(model: &ModelState, headers: &'h HeaderMap) -> Option<&'h str> {
    if model.kind() != PolicyKind::Session {
        return None;
    }
    headers
        .get(&model.session_header)
        .and_then(|v| v.to_str().ok())
}

/// The leader replica's choice among this replica's candidates (healthy, with a free
/// slot here), when replicas decide at a leader ([`crate::peers`]) and this one does
/// not lead; `None` to choose here.
async fn pick_at_leader<'g>(
    gw: &'g Gateway,
    p: &Prepared,
    session: Option<&str>,
    excluded: &[WorkerId],
) -> Option<LeaderChoice<'g>> {
    // A request with a latency objective is judged here, on the shared loads (the ask
    // to the leader carries no objective).
    if !decides_at_leader(gw, &p.model) || p.objective.is_set() {
        return None;
    }
    // Before any other work: the leader itself (and a replica without peers connected)
    // chooses here.
    let leader = gw.peers.leader()?;
    let workers = p.model.workers();
    let found = candidates(gw, &p.model, &workers, excluded, Candidates::WithFreeSlot);
    if found.ids.len() < 2 {
        // Nothing to choose (or nothing to choose from: the local path says why).
        return None;
    }
    let candidates: Vec<Arc<Worker>> = workers
        .iter()
        .filter(|w| found.ids.contains(&w.id))
        .cloned()
        .collect();
    choose_at_leader(gw, leader, p, &candidates, session).await
}

/// Selects a worker and takes a lease on it (admission plus booking, in one step on
/// the worker's in-flight count), waiting (bounded) when every healthy worker is full.
pub async fn pick(
    gw: &Gateway,
    p: &Prepared,
    headers: &HeaderMap,
    excluded: &[WorkerId],
    admission: &Arc<Admission>,
) -> Result<(Decision, Lease), ApiError> {
    let session = session_key(&p.model, headers);
    let limit = gw.config.limits.max_in_flight_per_worker;
    if let Some(choice) = pick_at_leader(gw, p, session, excluded).await {
        let (worker, decision) = (&choice.worker, &choice.decision);
        let lease = choice
            .ask
            .settle(|| take_lease(p, worker, decision, admission, limit));
        if let Some(lease) = lease {
            return Ok((choice.decision, lease));
        }
        // The worker filled up meanwhile: choose here.
    }
    // `None`: every candidate is full (or the chosen one filled up meanwhile): wait.
    let attempt = || {
        // Choice and booking under the model's lock: requests arriving together each
        // see the bookings of those chosen before them.
        let _choosing = p.model.choosing.lock();
        match try_pick(gw, p, session, excluded, Candidates::WithFreeSlot) {
            Err(e) => Some(Err(e)),
            Ok(Pick::Chosen { decision, worker }) => {
                let lease = take_lease(p, &worker, &decision, admission, limit)?;
                // Counted once the choice is booked: a choice whose worker filled up
                // meanwhile is made again.
                gw.metrics
                    .routing_decisions
                    .with_label_values(&[&*p.model.name, p.model.kind().as_str(), decision.rule])
                    .inc();
                Some(Ok((decision, lease)))
            }
            Ok(Pick::Full) => None,
            Ok(Pick::NoneHealthy) => Some(Err(ApiError::no_healthy_worker(
                &p.model.name,
                gw.config.health.open_ms.div_ceil(1000),
            ))),
        }
    };
    if let Some(r) = attempt() {
        return r;
    }
    let deadline = tokio::time::Instant::now() + gw.limiter.timeout();
    let waited =
        crate::limits::wait_for_slot(&p.model, gw.config.limits.max_queue, deadline, attempt).await;
    waited.unwrap_or_else(|| {
        Err(ApiError::overloaded(
            format!(
                "every healthy worker of model {:?} is at its in-flight limit and stayed so for the queue timeout; retry later",
                &*p.model.name
            ),
            gw.limiter.retry_after(),
        ))
    })
}

/// Books `worker` (the one `decision` chose) for one attempt of request `p`; `None`
/// when it is full.
fn take_lease(
    p: &Prepared,
    worker: &Arc<Worker>,
    decision: &Decision,
    admission: &Arc<Admission>,
    max_in_flight: u32,
) -> Option<Lease> {
    let spec = booking_spec(decision, p.prompt_tokens, p.max_tokens, p.kv_transferred);
    let keys = p.keys.as_deref().unwrap_or_default();
    Lease::try_take(&p.model, worker, spec, keys, admission, max_in_flight)
}

/// The attempt loop's picker for a routed request: each attempt chooses and leases a
/// worker ([`pick`]) away from those that failed, pins the data-parallel rank that
/// holds most of the prompt, names the worker to the request's record, and logs the
/// decision.
pub struct Routed<'a> {
    pub p: &'a Prepared,
    pub headers: &'a HeaderMap,
    pub admission: &'a Arc<Admission>,
    pub record: &'a RequestRecord,
}

impl Picker for Routed<'_> {
    fn model(&self) -> &ModelState {
        &self.p.model
    }

    fn max_attempts(&self, configured: usize) -> usize {
        configured
    }

    async fn pick(&mut self, gw: &Gateway, excluded: &[WorkerId]) -> Result<Picked, ApiError> {
        let p = self.p;
        let (decision, lease) = pick(gw, p, self.headers, excluded, self.admission).await?;
        let worker = lease.worker().clone();
        self.record.worker(&worker.url);
        log_decision(
            &p.model.name,
            &worker.url,
            &decision,
            p.model.selection.block_size(),
            p.keys.as_deref().and_then(|k| k.first()).copied(),
        );
        Ok(Picked {
            rank: data_parallel_rank(p, &worker),
            worker,
            held: Some((decision, lease)),
        })
    }
}

/// The rank a routed request is pinned to on a worker with several data-parallel ranks:
/// the one whose cache holds most of its prompt (`None`: one rank, no prompt keys, or
/// no rank holds it, and the engine balances itself).
fn data_parallel_rank(p: &Prepared, worker: &Worker) -> Option<u32> {
    if worker.config.dp_size <= 1 {
        return None;
    }
    // SGLang's disaggregated legs find their rank by bootstrap room (the prefill's
    // room is chosen for its rank, disaggregation.rs); a header could contradict it.
    let sglang_decode = p
        .model
        .prefill
        .as_ref()
        .is_some_and(|pd| pd.mode == crate::config::PdMode::Sglang);
    if sglang_decode {
        return None;
    }
    p.model
        .selection
        .best_rank(worker.id, p.keys.as_deref().unwrap_or_default())
}

/// One debug line per routing decision (target `kvgate::decision`): what the policy
/// chose, why, and the chosen worker's overlap and load beside those of the best-cached
/// candidate, so a fleet's routing can be audited from logs
/// (`--log info,kvgate::decision=debug`). `prefix` is the prompt's first block key,
/// so the requests of one shared prefix (a tenant's system prompt) can be followed.
fn log_decision(
    model: &str,
    worker_url: &str,
    decision: &Decision,
    block_size: u32,
    prefix: Option<BlockKey>,
) {
    if !tracing::enabled!(target: "kvgate::decision", tracing::Level::DEBUG) {
        return;
    }
    let device = |s: &WorkerScore| s.overlap_blocks[0];
    let Some(chosen) = decision.chosen() else {
        return;
    };
    let best = decision
        .scores
        .iter()
        .max_by_key(|s| (device(s), s.worker == decision.worker))
        .unwrap_or(chosen);
    let least_in_flight = decision
        .scores
        .iter()
        .map(|s| s.in_flight)
        .min()
        .unwrap_or(0);
    tracing::debug!(
        target: "kvgate::decision",
        model,
        worker = worker_url,
        policy = decision.policy.as_str(),
        rule = decision.rule,
        reason = decision.reason,
        prefix = prefix.map(|k| format!("{:016x}", k.0)),
        predicted_cached_tokens = decision.predicted_cached_tokens,
        chosen_cached_tokens = device(chosen) * block_size,
        chosen_in_flight = chosen.in_flight,
        chosen_prefill_tokens = chosen.prefill_tokens,
        chosen_decode_blocks = chosen.decode_blocks,
        chosen_cost = chosen.cost,
        best_cached_tokens = device(best) * block_size,
        best_in_flight = best.in_flight,
        best_prefill_tokens = best.prefill_tokens,
        best_decode_blocks = best.decode_blocks,
        best_cost = best.cost,
        least_in_flight,
        "routed"
    );
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use super::*;

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buffer").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    fn score(worker: u32, device_blocks: u32, in_flight: u32) -> WorkerScore {
        WorkerScore {
            worker: WorkerId(worker),
            overlap_blocks: [device_blocks, 0, 0],
            in_flight,
            prefill_tokens: u64::from(in_flight) * 1000,
            decode_blocks: 0.0,
            cost: Some(1.0),
            predicted_ttft_secs: None,
            predicted_tpot_secs: None,
            predicted_next_ttft_secs: None,
            ttft_spread: None,
        }
    }

    /// The decision line names the chosen worker's cached tokens and load beside the
    /// best-cached worker's, so a decision that left the holder shows in the log.
    #[test]
    fn decision_log_compares_the_choice_with_the_best_cached_worker() {
        let decision = Decision {
            worker: WorkerId(1),
            policy: PolicyKind::KvAware,
            predicted_cached_tokens: 32,
            indexed_cached_tokens: 32,
            credited_tokens: 0,
            rule: "warmup",
            reason: "warm-up: a worker with little cached is further behind on load",
            scores: vec![score(0, 128, 30), score(1, 2, 3), score(2, 0, 2)],
        };
        let out = Captured::default();
        let writer = out.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_env_filter("kvgate::decision=debug")
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            log_decision("m", "http://w1", &decision, 16, Some(BlockKey(0xab)))
        });
        let text = String::from_utf8(out.0.lock().expect("buffer").clone()).expect("utf-8");
        for field in [
            "worker=\"http://w1\"",
            "chosen_cached_tokens=32",
            "chosen_in_flight=3",
            "best_cached_tokens=2048",
            "best_in_flight=30",
            "least_in_flight=2",
            "prefix=\"00000000000000ab\"",
            "rule=\"warmup\"",
        ] {
            assert!(text.contains(field), "{field} missing from {text}");
        }
    }
}
