//! One router row through a virtual-time fleet: the discrete-event loop.
//!
//! Owns the virtual clock and the wiring between the real pieces: requests arrive at
//! their trace times (or when a closed-loop client's previous request ends); the
//! gateway's selection service, built from the same flags as `kvgate serve`, picks
//! among the engines in rotation and books the choice; each engine is the mock
//! engine's simulation core ([`kvgate_mock_engine::Simulator`]), stepping with
//! continuous batching and its latency model; every step's KV events are encoded as
//! vLLM 0.32 publishes them and handed to the service's [`EventFeed`] after the
//! configured delay, so the prefix index learns exactly what a subscriber would; first
//! token, progress, the engine's reported cached tokens and the end drive the
//! booking as the gateway's response observer does. No sockets, no sleeping, no wall
//! clock: the same inputs give the same records.
//!
//! It must not score workers, keep load, hash blocks or schedule engine work itself:
//! those are the real crates' jobs, called here exactly as the gateway and the mock
//! engine call them. The gateway's HTTP concerns (admission, retries, breakers) are not
//! simulated; a dead engine is taken out of rotation at once.

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvgate_bench::request::{Request, RequestObjective};
use kvgate_core::{
    BookingGuard, EngineLimits, EngineQueue, Objective, PolicyKind, SelectError, WorkerId,
    PROGRESS_EVERY,
};
use kvgate_events::{EventFeed, EventMetrics};
use kvgate_gateway::config::ModelConfig;
use kvgate_mock_engine::scheduler::{RequestId, StepOutput};
use kvgate_mock_engine::{SimConfig as EngineSimConfig, SimRequest, Simulator};
use kvgate_selection::{SelectRequest, SelectionService};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::agenda::{Agenda, Phase};
use crate::change::{ChangeKind, FleetChange};

/// The fleet: its engines, how their events travel, and what changes when.
#[derive(Clone, Debug)]
pub struct FleetConfig {
    /// Engines at the start.
    pub engines: usize,
    /// Each engine's simulation core (engine i is seeded `seed + i`, as `kvgate bench`
    /// seeds its fleet).
    pub engine: EngineSimConfig,
    /// From the end of the step that produced a KV event batch to the router applying
    /// it (ZeroMQ, the subscriber's decode and apply).
    pub event_delay_ms: f64,
    /// How long a restarted engine is gone before it serves again.
    pub restart_downtime_ms: f64,
    pub changes: Vec<FleetChange>,
}

/// Where a request is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// Through the router.
    Router,
    /// Straight to engine i, bypassing the router (only its KV events tell).
    Engine(usize),
}

/// Clients that each send their next request as soon as the previous one ends, until
/// `until_ms`; request `k` comes from `source(k)`, `k` counting up from `first_id`.
#[derive(Clone)]
pub struct ClosedLoop {
    pub target: Target,
    pub clients: usize,
    pub until_ms: f64,
    pub first_id: u64,
    pub source: Arc<dyn Fn(u64) -> Request + Send + Sync>,
}

/// What is sent: requests at their arrival times (open loop) and closed-loop clients.
#[derive(Clone, Default)]
pub struct Load {
    pub open: Vec<(Request, Target)>,
    pub closed: Vec<ClosedLoop>,
}

impl Load {
    /// Requests at their arrival times, all through the router.
    pub fn open(requests: &[Request]) -> Self {
        Self::from_requests(requests.to_vec())
    }

    /// As [`Load::open`], taking the requests (a whole trace is large).
    pub fn from_requests(requests: Vec<Request>) -> Self {
        Self {
            open: requests.into_iter().map(|r| (r, Target::Router)).collect(),
            closed: Vec::new(),
        }
    }
}

/// Why a request produced no answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestError {
    /// No engine in rotation (503).
    NoWorkers,
    /// The engine refused it (400: too long for its context).
    Rejected,
    /// The engine died with the request in flight.
    EngineDied,
    /// Shed: sheddable, and no engine was predicted to meet its objective (429).
    Shed,
}

impl RequestError {
    /// The error class the bench reports (as `kvgate bench` names them).
    pub fn class(self) -> &'static str {
        match self {
            RequestError::NoWorkers => "503",
            RequestError::Rejected => "400",
            RequestError::EngineDied => "engine_died",
            RequestError::Shed => "429",
        }
    }
}

/// What happened to one request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    pub id: u64,
    pub target: Target,
    pub sent_ms: f64,
    /// The engine that served it.
    pub engine: Option<usize>,
    pub first_token_ms: Option<f64>,
    pub done_ms: Option<f64>,
    /// Gaps between consecutive tokens.
    pub itl_ms: Vec<f64>,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    /// What the engine served from its prefix cache.
    pub cached_tokens: Option<u32>,
    /// What the router predicted it would (routed requests).
    pub predicted_cached_tokens: Option<u32>,
    /// The time to first token the router predicted when it booked the request
    /// (routed requests with a first token).
    #[serde(default)]
    pub predicted_ttft_ms: Option<f64>,
    /// Its latency objective and priority, as sent.
    #[serde(skip)]
    pub objective: RequestObjective,
    pub error: Option<RequestError>,
    /// The engine it was first sent to, when that engine died before its first token
    /// and the router sent it on to `engine` (as the gateway fails over a request
    /// whose answer has not begun).
    #[serde(default)]
    pub failed_over_from: Option<usize>,
}

/// A whole run of one row.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimRun {
    /// Every request, in the order it was sent.
    pub records: Vec<RequestRecord>,
    /// Engine names by index (`engine-0`, ...), including engines added later.
    pub engine_names: Vec<String>,
    /// Fleet changes as done, with their times (a restart when the engine is back).
    pub changes: Vec<FleetChange>,
    /// Engine steps run, over all engines.
    pub steps: u64,
    /// When the last request ended.
    pub end_ms: f64,
}

/// What the agenda holds.
enum Happening {
    SendOpen(usize),
    SendClosed(usize),
    Kick {
        engine: usize,
        generation: u32,
    },
    StepDone {
        engine: usize,
        generation: u32,
    },
    Deliver {
        engine: usize,
        seq: u64,
        payload: Vec<u8>,
    },
    Change(usize),
    /// The router reads every engine's queue.
    ReadQueues,
    BackUp {
        engine: usize,
        generation: u32,
    },
}

struct Flight {
    record: usize,
    booking: Option<BookingGuard>,
    /// A routed request, kept until its first token: if its engine dies before then,
    /// the router sends it to another engine.
    unanswered: Option<Request>,
}

struct SimEngine {
    worker: WorkerId,
    sim: Simulator,
    feed: Option<EventFeed>,
    /// Sequence number of the next event batch (starts over when the engine restarts).
    next_seq: u64,
    /// Bumped when the engine restarts: agenda entries of the old process are ignored.
    generation: u32,
    /// The step in progress: computed at its start, delivered at its end.
    pending: Option<StepOutput>,
    flights: FxHashMap<RequestId, Flight>,
    /// Candidates for routing (up and part of the fleet).
    in_rotation: bool,
    /// Dead, waiting to come back after a restart.
    down: bool,
    /// Removed from the fleet (it finishes what it holds).
    removed: bool,
}

struct ClosedState {
    spec: ClosedLoop,
    next_id: u64,
}

/// The simulation of one row.
struct Simulation<'a> {
    fleet: &'a FleetConfig,
    service: SelectionService,
    kind: PolicyKind,
    engines: Vec<SimEngine>,
    agenda: Agenda<Happening>,
    open: &'a [(Request, Target)],
    closed: Vec<ClosedState>,
    records: Vec<RequestRecord>,
    /// Which closed-loop client group a record belongs to.
    record_group: Vec<Option<usize>>,
    changes_done: Vec<FleetChange>,
    steps: u64,
    /// The virtual clock's origin as an `Instant`, for the service's `now`.
    origin: Instant,
    /// How often the router reads the engines' queues.
    metrics_interval_ms: f64,
    now_ms: f64,
    end_ms: f64,
}

/// Runs `load` through a fleet routed by `model`'s policy (its workers are ignored:
/// the fleet supplies them). Deterministic for the same inputs: the model must have a
/// policy seed.
pub fn simulate(model: &ModelConfig, fleet: &FleetConfig, load: &Load) -> anyhow::Result<SimRun> {
    if model.seed.is_none() {
        bail!("a simulation needs a policy seed to be deterministic");
    }
    fleet
        .engine
        .validate()
        .context("invalid engine configuration")?;
    // The router is told the engines' limits, as a user passes the engines' own
    // `--max-num-seqs` and `--max-num-batched-tokens` to `kvgate serve` and as vLLM's
    // metrics say its KV cache's size; a row that sets any keeps what it says (what a
    // router told wrong does).
    let mut selection = model.selection_config(Duration::from_secs(3600));
    if selection.engine_limits == EngineLimits::default() {
        selection.engine_limits = EngineLimits {
            max_num_seqs: fleet.engine.max_num_seqs,
            max_num_batched_tokens: fleet.engine.max_batched_tokens,
            num_gpu_blocks: Some(fleet.engine.num_blocks),
        };
    }
    let service = SelectionService::new(
        selection,
        Arc::new(EventMetrics::default()),
        Arc::new(AtomicU32::new(0)),
    )?;
    let kind = service.kind();
    let mut s = Simulation {
        fleet,
        service,
        kind,
        engines: Vec::new(),
        agenda: Agenda::new(),
        open: &load.open,
        closed: load
            .closed
            .iter()
            .map(|c| ClosedState {
                spec: c.clone(),
                next_id: c.first_id,
            })
            .collect(),
        records: Vec::new(),
        record_group: Vec::new(),
        changes_done: Vec::new(),
        steps: 0,
        origin: Instant::now(),
        metrics_interval_ms: model.engine_metrics_interval_ms as f64,
        now_ms: 0.0,
        end_ms: 0.0,
    };
    for _ in 0..fleet.engines {
        s.add_engine()?;
    }
    for (i, (r, _)) in load.open.iter().enumerate() {
        s.agenda.push(
            r.arrival.as_secs_f64() * 1000.0,
            Phase::Send,
            Happening::SendOpen(i),
        );
    }
    for (g, c) in load.closed.iter().enumerate() {
        for _ in 0..c.clients {
            s.agenda.push(0.0, Phase::Send, Happening::SendClosed(g));
        }
    }
    for (i, c) in fleet.changes.iter().enumerate() {
        s.agenda.push(c.at_ms, Phase::Change, Happening::Change(i));
    }
    // The router reads the engines' queues as `kvgate serve` scrapes their metrics.
    if model.engine_metrics_interval_ms > 0 {
        s.agenda.push(0.0, Phase::Deliver, Happening::ReadQueues);
    }
    s.run()?;
    Ok(SimRun {
        engine_names: (0..s.engines.len()).map(engine_name).collect(),
        records: s.records,
        changes: s.changes_done,
        steps: s.steps,
        end_ms: s.end_ms,
    })
}

/// The name an engine is reported under.
pub fn engine_name(i: usize) -> String {
    format!("engine-{i}")
}

impl Simulation<'_> {
    fn run(&mut self) -> anyhow::Result<()> {
        while let Some((at, what)) = self.agenda.pop() {
            self.now_ms = at;
            match what {
                Happening::SendOpen(i) => {
                    let (request, target) = &self.open[i];
                    self.send(request.clone(), *target, None);
                }
                Happening::SendClosed(g) => {
                    let c = &mut self.closed[g];
                    if self.now_ms < c.spec.until_ms {
                        let request = (c.spec.source)(c.next_id);
                        c.next_id += 1;
                        let target = c.spec.target;
                        self.send(request, target, Some(g));
                    }
                }
                Happening::Kick { engine, generation } => self.kick(engine, generation),
                Happening::StepDone { engine, generation } => self.step_done(engine, generation),
                Happening::Deliver {
                    engine,
                    seq,
                    payload,
                } => {
                    if let Some(feed) = self.engines[engine].feed.as_mut() {
                        feed.deliver(seq, &payload);
                    }
                }
                Happening::Change(i) => self.change(i)?,
                Happening::ReadQueues => self.read_queues(),
                Happening::BackUp { engine, generation } => {
                    let e = &mut self.engines[engine];
                    if e.generation == generation {
                        e.down = false;
                        e.in_rotation = !e.removed;
                        self.changes_done.push(FleetChange {
                            at_ms: self.now_ms,
                            kind: ChangeKind::Restart(engine),
                        });
                    }
                }
            }
        }
        Ok(())
    }

    /// The router reads each engine's queue, as the gateway scrapes its metrics, and
    /// does again an interval later while anything else is left to happen.
    fn read_queues(&mut self) {
        let ledger = self.service.ledger();
        for e in self.engines.iter().filter(|e| e.in_rotation) {
            let snapshot = e.sim.snapshot();
            let queue = EngineQueue {
                running: u32::try_from(snapshot.running).unwrap_or(u32::MAX),
                waiting: u32::try_from(snapshot.waiting).unwrap_or(u32::MAX),
            };
            ledger.engine_reported(e.worker, queue);
        }
        if !self.agenda.is_empty() {
            self.agenda.push(
                self.now_ms + self.metrics_interval_ms,
                Phase::Deliver,
                Happening::ReadQueues,
            );
        }
    }

    /// The service's clock at the current virtual time.
    fn instant(&self) -> Instant {
        self.origin + Duration::from_nanos((self.now_ms * 1e6) as u64)
    }

    fn add_engine(&mut self) -> anyhow::Result<()> {
        let index = self.engines.len();
        let worker = self.service.allocate_id();
        let feed = self
            .service
            .add_worker_with_feed(worker, &engine_name(index))?;
        let sim = Simulator::new(self.engine_config(index))?;
        self.engines.push(SimEngine {
            worker,
            sim,
            feed,
            next_seq: 0,
            generation: 0,
            pending: None,
            flights: FxHashMap::default(),
            in_rotation: true,
            down: false,
            removed: false,
        });
        Ok(())
    }

    fn engine_config(&self, index: usize) -> EngineSimConfig {
        EngineSimConfig {
            seed: self.fleet.engine.seed.wrapping_add(index as u64),
            ..self.fleet.engine.clone()
        }
    }

    fn send(&mut self, request: Request, target: Target, group: Option<usize>) {
        let record = self.records.len();
        self.records.push(RequestRecord {
            id: request.id,
            target,
            sent_ms: self.now_ms,
            engine: None,
            first_token_ms: None,
            done_ms: None,
            itl_ms: Vec::new(),
            prompt_tokens: u32::try_from(request.prompt.len()).unwrap_or(u32::MAX),
            output_tokens: 0,
            cached_tokens: None,
            predicted_cached_tokens: None,
            predicted_ttft_ms: None,
            objective: request.objective,
            error: None,
            failed_over_from: None,
        });
        self.record_group.push(group);
        match target {
            Target::Engine(i) if i < self.engines.len() && !self.engines[i].down => {
                self.submit(i, record, request, None);
            }
            Target::Engine(_) => self.fail(record, RequestError::NoWorkers),
            Target::Router => self.route(record, request),
        }
    }

    /// The gateway's path for one request: candidates in rotation, the policy's
    /// choice, a booking on it, the engine.
    fn route(&mut self, record: usize, request: Request) {
        let mut candidates: Vec<(WorkerId, usize)> = self
            .engines
            .iter()
            .enumerate()
            .filter(|(_, e)| e.in_rotation)
            .map(|(i, e)| (e.worker, i))
            .collect();
        candidates.sort_unstable();
        let ids: Vec<WorkerId> = candidates.iter().map(|(w, _)| *w).collect();
        // As the gateway prepares a request (prepare::prepare): only a policy that
        // reads the prompt gets it tokenized and keyed; the others book the estimate
        // of `prepare::PromptSize`, which for a prompt of token ids (what the bench
        // sends) is its length.
        let prompt_tokens = self.records[record].prompt_tokens;
        let keys = self
            .kind
            .uses_tokens()
            .then(|| self.service.block_keys(&request.prompt, None));
        let now = self.instant();
        let select = SelectRequest {
            block_keys: keys.as_deref(),
            prompt_tokens,
            session_key: request.session_id.as_deref(),
            now,
            objective: match request.objective {
                o if o.hidden => Objective::default(),
                o => Objective {
                    ttft: o.ttft_ms.map(|ms| Duration::from_millis(u64::from(ms))),
                    tpot: None,
                    priority: o.priority,
                },
            },
        };
        let decision = match self.service.select(&select, &ids) {
            Ok(d) => d,
            Err(SelectError::Shed { .. }) => return self.fail(record, RequestError::Shed),
            Err(SelectError::NoCandidates | SelectError::NoIndex | SelectError::MissingTokens) => {
                return self.fail(record, RequestError::NoWorkers);
            }
        };
        let Some(&(_, engine)) = candidates.iter().find(|(w, _)| *w == decision.worker) else {
            return self.fail(record, RequestError::NoWorkers);
        };
        // Without a per-worker limit a booking is never refused.
        let booking = self.service.try_book(
            &decision,
            prompt_tokens,
            Some(request.max_tokens),
            keys.as_deref().unwrap_or_default(),
            0,
            now,
        );
        // Only policies that read the prompt predict what the engine will have cached.
        if self.kind.uses_tokens() {
            self.records[record].predicted_cached_tokens = Some(decision.predicted_cached_tokens);
        }
        self.submit(engine, record, request, booking);
    }

    fn submit(
        &mut self,
        engine: usize,
        record: usize,
        request: Request,
        booking: Option<BookingGuard>,
    ) {
        let now = self.now_ms;
        // Kept only where an engine may die under it: a fleet with a restart planned.
        let may_die = self
            .fleet
            .changes
            .iter()
            .any(|c| matches!(c.kind, ChangeKind::Restart(_)));
        let unanswered =
            (may_die && self.records[record].target == Target::Router).then(|| request.clone());
        let e = &mut self.engines[engine];
        if e.pending.is_none() {
            e.sim.advance_to(now);
        }
        let submitted = e.sim.submit(SimRequest {
            prompt: request.prompt,
            max_tokens: request.max_tokens,
            ignore_eos: true,
            transferred_tokens: 0,
        });
        self.records[record].engine = Some(engine);
        match submitted {
            Ok(id) => {
                e.flights.insert(
                    id,
                    Flight {
                        record,
                        booking,
                        unanswered,
                    },
                );
                if e.pending.is_none() {
                    let generation = e.generation;
                    self.agenda
                        .push(now, Phase::Kick, Happening::Kick { engine, generation });
                }
            }
            Err(_) => {
                drop(booking);
                self.fail(record, RequestError::Rejected);
            }
        }
    }

    fn fail(&mut self, record: usize, error: RequestError) {
        let r = &mut self.records[record];
        r.error = Some(error);
        r.done_ms = Some(self.now_ms);
        self.ended(record);
    }

    /// A request ended (answered or not): its closed-loop client sends the next one.
    fn ended(&mut self, record: usize) {
        self.end_ms = self.end_ms.max(self.now_ms);
        if let Some(g) = self.record_group[record] {
            self.agenda
                .push(self.now_ms, Phase::Send, Happening::SendClosed(g));
        }
    }

    /// Starts the engine's next step if it is not stepping and has work.
    fn kick(&mut self, engine: usize, generation: u32) {
        let e = &mut self.engines[engine];
        if e.generation != generation || e.pending.is_some() {
            return;
        }
        if let Some(out) = e.sim.step() {
            self.steps += 1;
            let end = e.sim.clock_ms();
            e.pending = Some(out);
            self.agenda.push(
                end,
                Phase::StepDone,
                Happening::StepDone { engine, generation },
            );
        }
    }

    /// A step ended: publish its events, hand out its tokens, start the next step.
    fn step_done(&mut self, engine: usize, generation: u32) {
        let now = self.now_ms;
        let instant = self.instant();
        let delay = self.fleet.event_delay_ms;
        let e = &mut self.engines[engine];
        if e.generation != generation {
            return;
        }
        let Some(out) = e.pending.take() else { return };
        publish(&mut self.agenda, e, engine, &out.events, now, delay);
        let mut ended = Vec::new();
        for o in &out.outputs {
            let Some(flight) = e.flights.get_mut(&o.id) else {
                continue;
            };
            let r = &mut self.records[flight.record];
            let produced = o.index + 1;
            if o.index == 0 {
                flight.unanswered = None;
                r.first_token_ms = Some(now);
                r.cached_tokens = Some(o.cached_tokens);
                if let Some(receipt) = flight
                    .booking
                    .as_ref()
                    .and_then(|b| b.prefill_done(instant))
                {
                    r.predicted_ttft_ms = Some(receipt.predicted_secs * 1e3);
                }
            } else if let Some(last) = r.done_ms.or(r.first_token_ms) {
                r.itl_ms.push(now - last);
            }
            // `done_ms` holds the latest token's time until the request ends.
            r.done_ms = Some(now);
            r.output_tokens = produced;
            if o.finished.is_some() {
                if let Some(b) = &flight.booking {
                    b.progress(produced, instant);
                    b.engine_reported_cached(o.cached_tokens);
                }
                let record = flight.record;
                e.flights.remove(&o.id);
                ended.push(record);
            } else if produced % PROGRESS_EVERY == 0 {
                if let Some(b) = &flight.booking {
                    b.progress(produced, instant);
                }
            }
        }
        if !e.sim.is_idle() {
            self.agenda
                .push(now, Phase::Kick, Happening::Kick { engine, generation });
        }
        for record in ended {
            self.ended(record);
        }
    }

    fn change(&mut self, i: usize) -> anyhow::Result<()> {
        let change = self.fleet.changes[i];
        let check = |engine: usize, n: usize| {
            if engine >= n {
                bail!("fleet change {change}: there is no engine {engine} (the fleet has {n})");
            }
            Ok(())
        };
        match change.kind {
            ChangeKind::Add => self.add_engine()?,
            ChangeKind::Remove(engine) => {
                check(engine, self.engines.len())?;
                let e = &mut self.engines[engine];
                e.in_rotation = false;
                e.removed = true;
                e.feed = None;
                self.service.remove_worker(e.worker);
            }
            ChangeKind::Restart(engine) => {
                check(engine, self.engines.len())?;
                // Recorded as done when the engine is back.
                return self.restart(engine);
            }
            ChangeKind::Reset(engine) => {
                check(engine, self.engines.len())?;
                let now = self.now_ms;
                let delay = self.fleet.event_delay_ms;
                let e = &mut self.engines[engine];
                if let Some(events) = e.sim.reset_prefix_cache(true) {
                    publish(&mut self.agenda, e, engine, &events, now, delay);
                }
                if e.pending.is_none() && !e.sim.is_idle() {
                    let generation = e.generation;
                    self.agenda
                        .push(now, Phase::Kick, Happening::Kick { engine, generation });
                }
            }
        }
        self.changes_done.push(FleetChange {
            at_ms: self.now_ms,
            ..change
        });
        Ok(())
    }

    /// The engine dies now and comes back empty after the downtime.
    fn restart(&mut self, engine: usize) -> anyhow::Result<()> {
        let config = self.engine_config(engine);
        let e = &mut self.engines[engine];
        e.generation += 1;
        e.pending = None;
        e.in_rotation = false;
        e.down = true;
        e.next_seq = 0;
        e.sim = Simulator::new(config)?;
        let generation = e.generation;
        let worker = e.worker;
        // Each booking ends here, with its flight.
        let mut lost: Vec<(usize, Option<Request>)> = e
            .flights
            .drain()
            .map(|(_, f)| (f.record, f.unanswered))
            .collect();
        // Declared dead: what the index held for it is forgotten (its new process
        // starts its event sequence over, which the feed would also take as a restart).
        self.service.purge_worker(worker);
        lost.sort_unstable_by_key(|(record, _)| *record);
        for (record, unanswered) in lost {
            match unanswered {
                // No token yet: the router sends it to another engine.
                Some(request) => {
                    self.records[record].failed_over_from = Some(engine);
                    self.route(record, request);
                }
                None => self.fail(record, RequestError::EngineDied),
            }
        }
        self.agenda.push(
            self.now_ms + self.fleet.restart_downtime_ms,
            Phase::Change,
            Happening::BackUp { engine, generation },
        );
        Ok(())
    }
}

/// An engine publishes `events` at `now` (one batch, the next sequence number), encoded
/// as vLLM 0.32 encodes them; they reach the router's feed, which decodes them as a
/// subscriber does, `delay_ms` later.
fn publish(
    agenda: &mut Agenda<Happening>,
    e: &mut SimEngine,
    engine: usize,
    events: &[kvgate_mock_engine::KvEvent],
    now: f64,
    delay_ms: f64,
) {
    if events.is_empty() {
        return;
    }
    if let Ok(payload) = kvgate_mock_engine::wire::encode_batch(now / 1000.0, events, 0) {
        let seq = e.next_seq;
        e.next_seq += 1;
        agenda.push(
            now + delay_ms,
            Phase::Deliver,
            Happening::Deliver {
                engine,
                seq,
                payload,
            },
        );
    }
}
