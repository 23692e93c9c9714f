//! `kvgate simulate`, `kvgate simulate plan` and `kvgate simulate scenarios`: flags,
//! and turning them into fleets, loads and rows.
//!
//! Owns argument parsing and where output goes. The workload flags are `kvgate bench`'s
//! own ([`WorkloadArgs`]), the engine flags `kvgate mock-engine`'s ([`MockEngineArgs`],
//! through `--engine-arg`), the row flags `kvgate serve`'s (through the row specs and
//! `--kvgate-arg`), so a simulated run is described exactly as a real one. It must not
//! simulate or compute statistics itself.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Parser;
use kvgate_bench::cli::{ScenarioLoadArgs, WorkloadArgs};
use kvgate_bench::compare::{render_markdown, write_outputs, CompareRow, CompareSummary};
use kvgate_bench::report::{fmt_pct, Report};
use kvgate_bench::request::{summarize, Request};
use kvgate_bench::scenario::{
    phases, render_share_svg, row_log_dir, write_request_log, Change, ScenarioRow, ScenarioSummary,
    Shape, TenantWorkload,
};
use kvgate_mock_engine::cli::MockEngineArgs;
use kvgate_mock_engine::SimConfig as EngineSimConfig;

use crate::change::{ChangeKind, FleetChange};
use crate::plan::{plan, PlanConfig};
use crate::report::{report, routed_outcomes, share_between};
use crate::rows::{parse_rows, SimRow};
use crate::simulation::{simulate, ClosedLoop, FleetConfig, Load, SimRun, Target};

/// The rows a simulation runs when `--policies` is not given.
pub const DEFAULT_POLICIES: &str = "round_robin,least_loaded,prefix_affinity,kv_aware";

/// Run routing policies against a simulated fleet in virtual time: deterministic, no
/// sockets, the real routing code.
#[derive(clap::Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true)]
pub struct SimulateArgs {
    #[command(subcommand)]
    pub command: Option<SimulateCommand>,
    #[command(flatten)]
    pub run: RunArgs,
}

#[derive(clap::Subcommand, Debug, Clone)]
pub enum SimulateCommand {
    /// Find the smallest fleet (engine count, and optionally cache size) that meets a
    /// TTFT p90 target for a workload under one policy, and print the curve.
    Plan(PlanArgs),
    /// The fleet-change scenarios of `kvgate bench scenarios`, in virtual time.
    Scenarios(ScenariosArgs),
}

/// The simulated fleet.
#[derive(clap::Args, Debug, Clone)]
pub struct FleetFlags {
    /// Engines at the start.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 8192)]
    pub num_blocks: u32,
    /// KV block size of the engines and the router (tokens).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Engine latency runs this many times faster (as `kvgate bench --engine-speedup`).
    #[arg(long, default_value_t = 1.0)]
    pub engine_speedup: f64,
    /// Extra `kvgate mock-engine` flag for every engine (repeatable), e.g.
    /// --engine-arg=--max-num-seqs=64.
    #[arg(long, allow_hyphen_values = true)]
    pub engine_arg: Vec<String>,
    /// From the end of an engine step to the router applying its KV events, in ms.
    #[arg(long, default_value_t = 1.0)]
    pub event_delay_ms: f64,
    /// How long a restarted engine is gone, in ms.
    #[arg(long, default_value_t = 10_000.0)]
    pub restart_downtime_ms: f64,
    /// A fleet change (repeatable): AT:add, AT:remove=I, AT:restart=I, AT:reset=I, with
    /// AT in seconds (30, 30s) or ms (1500ms) of the run.
    #[arg(long = "change", value_name = "AT:WHAT")]
    pub changes: Vec<String>,
}

impl FleetFlags {
    /// The fleet these flags describe, engines seeded from `seed`.
    pub fn fleet(&self, seed: u64) -> anyhow::Result<FleetConfig> {
        if self.engines == 0 {
            bail!("--engines must be at least 1");
        }
        if !(self.event_delay_ms.is_finite() && self.event_delay_ms >= 0.0) {
            bail!("--event-delay-ms must be a non-negative number");
        }
        if !(self.restart_downtime_ms.is_finite() && self.restart_downtime_ms >= 0.0) {
            bail!("--restart-downtime-ms must be a non-negative number");
        }
        let changes = self
            .changes
            .iter()
            .map(|c| FleetChange::parse(c))
            .collect::<anyhow::Result<Vec<_>>>()?;
        Ok(FleetConfig {
            engines: self.engines,
            engine: engine_config(
                self.block_size,
                self.num_blocks,
                self.engine_speedup,
                seed,
                &self.engine_arg,
            )?,
            event_delay_ms: self.event_delay_ms,
            restart_downtime_ms: self.restart_downtime_ms,
            changes,
        })
    }
}

/// One engine's simulation core as `kvgate mock-engine` would build it from the same
/// flags, its latency model divided by `speedup`.
pub fn engine_config(
    block_size: u32,
    num_blocks: u32,
    speedup: f64,
    seed: u64,
    extra: &[String],
) -> anyhow::Result<EngineSimConfig> {
    #[derive(Parser)]
    struct Line {
        #[command(flatten)]
        engine: MockEngineArgs,
    }
    if !(speedup.is_finite() && speedup > 0.0) {
        bail!("--engine-speedup must be a positive number");
    }
    let mut line: Vec<String> = vec![
        "mock-engine".into(),
        "--block-size".into(),
        block_size.to_string(),
        "--num-blocks".into(),
        num_blocks.to_string(),
        "--seed".into(),
        seed.to_string(),
    ];
    line.extend(extra.iter().cloned());
    let parsed = Line::try_parse_from(&line)
        .map_err(|e| anyhow::anyhow!("engine flags: {}", e.render().to_string().trim()))?;
    let mut sim = parsed.engine.to_config()?.sim;
    let l = &mut sim.latency;
    for v in [
        &mut l.prefill_a,
        &mut l.prefill_b,
        &mut l.prefill_c,
        &mut l.decode_d,
        &mut l.decode_e,
        &mut l.decode_f,
        &mut l.decode_floor_ms,
    ] {
        *v /= speedup;
    }
    Ok(sim)
}

/// `kvgate simulate` itself.
#[derive(clap::Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    #[command(flatten)]
    pub fleet: FleetFlags,
    /// Rows, comma-separated: kvgate policies with per-row `kvgate serve` flags, as for
    /// `kvgate bench compare` (kv_aware@overlap-weight=2@locality-weight=0).
    #[arg(long, default_value = DEFAULT_POLICIES)]
    pub policies: String,
    /// Extra `kvgate serve` flag for every row (repeatable), e.g. --kvgate-arg=--pending-credit-secs=5.
    #[arg(long, allow_hyphen_values = true)]
    pub kvgate_arg: Vec<String>,
    /// Trace time runs this many times faster (arrivals divided by it), as for `kvgate bench`.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Send this share of the requests straight to one engine, bypassing the router:
    /// ENGINE:SHARE, e.g. 1:0.25.
    #[arg(long, value_name = "ENGINE:SHARE")]
    pub bypass: Option<String>,
    /// Row whose TTFT p90 the others are compared with.
    #[arg(long, default_value = "round_robin")]
    pub baseline: String,
    /// Output folder: compare.md, compare.json, ttft.svg, ttft-cdf.svg, report.html,
    /// reports/<row>.json.
    #[arg(long, default_value = "bench-out/simulate")]
    pub out_dir: PathBuf,
}

/// `kvgate simulate plan`.
#[derive(clap::Args, Debug, Clone)]
pub struct PlanArgs {
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// The target: TTFT p90 at most this many ms.
    #[arg(long)]
    pub ttft_p90_ms: f64,
    /// The policy (with per-row flags, as for --policies).
    #[arg(long, default_value = "kv_aware")]
    pub policy: String,
    /// Cache sizes to plan for, in KV blocks per engine, comma-separated (default: the
    /// one --num-blocks).
    #[arg(long, value_delimiter = ',')]
    pub num_blocks_options: Vec<u32>,
    /// Largest engine count to try.
    #[arg(long, default_value_t = 64)]
    pub max_engines: usize,
    #[command(flatten)]
    pub fleet: FleetFlags,
    #[arg(long, allow_hyphen_values = true)]
    pub kvgate_arg: Vec<String>,
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
}

/// `kvgate simulate scenarios`.
#[derive(clap::Args, Debug, Clone)]
pub struct ScenariosArgs {
    #[command(flatten)]
    pub load: ScenarioLoadArgs,
    /// Rows, comma-separated, as for --policies.
    #[arg(long, default_value = "round_robin,prefix_affinity,kv_aware")]
    pub policies: String,
    /// From the end of an engine step to the router applying its KV events, in ms.
    #[arg(long, default_value_t = 1.0)]
    pub event_delay_ms: f64,
    #[arg(long, allow_hyphen_values = true)]
    pub kvgate_arg: Vec<String>,
    /// Output folder: scenarios.md, scenarios.json, <scenario>-share.svg, and
    /// logs/<scenario>/<row>/requests.jsonl (every routed request's tenant, cached tokens
    /// and engine, as `kvgate bench scenarios` writes them).
    #[arg(long, default_value = "bench-out/simulate-scenarios")]
    pub out_dir: PathBuf,
}

/// Entry point of `kvgate simulate`.
pub fn run(args: SimulateArgs) -> anyhow::Result<()> {
    match args.command {
        Some(SimulateCommand::Plan(p)) => run_plan(p),
        Some(SimulateCommand::Scenarios(s)) => run_scenarios(s),
        None => run_compare(args.run),
    }
}

/// Arrival times divided by `speedup`.
fn speed_up(mut requests: Vec<Request>, speedup: f64) -> anyhow::Result<Vec<Request>> {
    if !(speedup.is_finite() && speedup > 0.0) {
        bail!("--speedup must be a positive number");
    }
    for r in &mut requests {
        r.arrival = r.arrival.div_f64(speedup);
    }
    Ok(requests)
}

/// `ENGINE:SHARE`: which requests go straight to an engine (chosen by a hash of the
/// request id and the seed, so the same ones every row).
fn bypass_load(requests: Vec<Request>, spec: Option<&str>, seed: u64) -> anyhow::Result<Load> {
    let mut load = Load::from_requests(requests);
    let Some(spec) = spec else { return Ok(load) };
    let shape = || format!("--bypass {spec:?} must look like ENGINE:SHARE, e.g. 1:0.25");
    let (engine, share) = spec.split_once(':').with_context(shape)?;
    let engine: usize = engine.trim().parse().with_context(shape)?;
    let share: f64 = share.trim().parse().with_context(shape)?;
    if !(0.0..=1.0).contains(&share) {
        bail!(shape());
    }
    for (r, target) in &mut load.open {
        let mut rng = kvgate_bench::rng::SplitMix64::keyed(seed ^ 0xB1A5, r.id);
        if rng.unit() < share {
            *target = Target::Engine(engine);
        }
    }
    Ok(load)
}

/// Runs every row over the same load and fleet; returns each row's report.
pub fn run_rows(
    rows: &[SimRow],
    fleet: &FleetConfig,
    load: &Load,
    quiet: bool,
) -> anyhow::Result<Vec<(SimRun, Report)>> {
    let mut out = Vec::with_capacity(rows.len());
    for row in rows {
        let started = Instant::now();
        let run =
            simulate(&row.model, fleet, load).with_context(|| format!("row {}", row.label))?;
        let rep = report(&row.label, &run);
        if !quiet {
            eprintln!(
                "kvgate simulate: {} — {} requests, {} engine steps, {:.0} s of virtual time in {:.2} s · TTFT p90 {:.1} ms · hit {}",
                row.label,
                run.records.len(),
                run.steps,
                run.end_ms / 1000.0,
                started.elapsed().as_secs_f64(),
                rep.ttft_ms.p90,
                fmt_pct(rep.prefix_hit_rate),
            );
        }
        out.push((run, rep));
    }
    Ok(out)
}

fn run_compare(args: RunArgs) -> anyhow::Result<()> {
    let (requests, desc) = args.workload.build()?;
    let requests = speed_up(requests, args.speedup)?;
    let seed = args.workload.seed;
    let fleet = args.fleet.fleet(seed)?;
    let rows = parse_rows(
        &args.policies,
        &args.kvgate_arg,
        args.fleet.block_size,
        seed,
    )?;
    let s = summarize(&requests);
    let load = bypass_load(requests, args.bypass.as_deref(), seed)?;
    eprintln!(
        "kvgate simulate: {} requests ({} prompt tokens) over {:.0} s on {} engines × {} blocks ({} sequences, {} tokens a step), {} rows",
        s.requests,
        s.prompt_tokens,
        s.span.as_secs_f64(),
        fleet.engines,
        args.fleet.num_blocks,
        fleet.engine.max_num_seqs,
        fleet.engine.max_batched_tokens,
        rows.len()
    );
    let results = run_rows(&rows, &fleet, &load, false)?;
    let mut workload = format!("simulated: {desc}");
    for c in &fleet.changes {
        workload.push_str(&format!("; change {c}"));
    }
    if let Some(b) = &args.bypass {
        workload.push_str(&format!("; bypass {b}"));
    }
    let summary = CompareSummary {
        workload,
        requests: s.requests,
        engines: fleet.engines,
        speedup: args.speedup,
        rows: results
            .iter()
            .map(|(_, rep)| CompareRow {
                label: rep.label.clone(),
                status: "ok".into(),
                note: None,
                report: Some(rep.clone()),
            })
            .collect(),
    };
    write_reports(&args.out_dir, &rows, &results)?;
    write_outputs(&args.out_dir, &summary, &args.baseline)?;
    println!("{}", render_markdown(&summary, &args.baseline));
    println!(
        "Virtual time: the same seed gives the same table. Results with plots: {}/report.html",
        args.out_dir.display()
    );
    Ok(())
}

fn write_reports(dir: &Path, rows: &[SimRow], results: &[(SimRun, Report)]) -> anyhow::Result<()> {
    let reports = dir.join("reports");
    std::fs::create_dir_all(&reports)
        .with_context(|| format!("cannot create {}", reports.display()))?;
    for (row, (_, rep)) in rows.iter().zip(results) {
        let path = reports.join(format!("{}.json", row.file_stem));
        std::fs::write(&path, serde_json::to_vec_pretty(rep)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

fn run_plan(args: PlanArgs) -> anyhow::Result<()> {
    let (requests, desc) = args.workload.build()?;
    let requests = speed_up(requests, args.speedup)?;
    let seed = args.workload.seed;
    let rows = parse_rows(&args.policy, &args.kvgate_arg, args.fleet.block_size, seed)?;
    let [row] = rows.as_slice() else {
        bail!("--policy takes one row");
    };
    let fleet = args.fleet.fleet(seed)?;
    let sizes = if args.num_blocks_options.is_empty() {
        vec![args.fleet.num_blocks]
    } else {
        args.num_blocks_options.clone()
    };
    let cfg = PlanConfig {
        ttft_p90_ms: args.ttft_p90_ms,
        max_engines: args.max_engines,
        num_blocks_options: sizes,
    };
    eprintln!(
        "kvgate simulate plan: {desc}; {} at TTFT p90 ≤ {} ms",
        row.label, args.ttft_p90_ms
    );
    let result = plan(row, &fleet, &Load::from_requests(requests), &cfg)?;
    println!("{}", result.render_markdown());
    Ok(())
}

/// The bench scenario's fleet, in virtual time.
fn scenario_fleet(
    shape: &Shape,
    change_at_ms: f64,
    seed: u64,
    delay: f64,
) -> anyhow::Result<FleetConfig> {
    let change = shape.change.map(|c| FleetChange {
        at_ms: change_at_ms,
        kind: match c {
            Change::Add(_) => ChangeKind::Add,
            Change::HangThenRestart(i) => ChangeKind::Restart(i),
            Change::ResetCache(i) => ChangeKind::Reset(i),
        },
    });
    Ok(FleetConfig {
        engines: shape.routed_at_start,
        engine: engine_config(16, shape.num_blocks, 1.0, seed, &[])?,
        event_delay_ms: delay,
        restart_downtime_ms: kvgate_bench::scenario::HANG.as_secs_f64() * 1000.0,
        changes: change.into_iter().collect(),
    })
}

/// Seconds of the share timeline's bins.
const SHARE_BIN_MS: f64 = 1000.0;
/// The window after a change in which the watched engine's share is measured.
const SHARE_WINDOW_MS: f64 = 10_000.0;

fn run_scenarios(args: ScenariosArgs) -> anyhow::Result<()> {
    let load_args = &args.load;
    let kinds = load_args.kinds();
    if !(load_args.duration.is_finite() && load_args.duration > 0.0) {
        bail!("--duration must be a positive number of seconds");
    }
    let rows = parse_rows(&args.policies, &args.kvgate_arg, 16, load_args.seed)?;
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("cannot create {}", args.out_dir.display()))?;
    let duration_ms = load_args.duration * 1000.0;
    let change_at_ms = load_args.change_at * 1000.0;
    let mut summaries = Vec::new();
    for kind in kinds {
        let shape = Shape {
            num_blocks: load_args.num_blocks.unwrap_or(kind.shape().num_blocks),
            ..kind.shape()
        };
        let fleet = scenario_fleet(&shape, change_at_ms, load_args.seed, args.event_delay_ms)?;
        let workload = Arc::new(TenantWorkload::new(&shape, load_args.seed));
        let source = {
            let w = workload.clone();
            Arc::new(move |k: u64| w.request(k)) as Arc<dyn Fn(u64) -> Request + Send + Sync>
        };
        let mut load = Load {
            open: Vec::new(),
            closed: vec![ClosedLoop {
                target: Target::Router,
                clients: load_args.concurrency.max(1),
                until_ms: duration_ms,
                first_id: 0,
                source: source.clone(),
            }],
        };
        if shape.bypass {
            load.closed.push(ClosedLoop {
                target: Target::Engine(1),
                clients: 1,
                until_ms: duration_ms,
                first_id: 1 << 40,
                source,
            });
        }
        let mut out_rows = Vec::new();
        for (row, (run, rep)) in rows.iter().zip(run_rows(&rows, &fleet, &load, true)?) {
            let log_dir = row_log_dir(&args.out_dir, kind, &row.file_stem);
            std::fs::create_dir_all(&log_dir)
                .with_context(|| format!("cannot create {}", log_dir.display()))?;
            let outcomes = routed_outcomes(&run);
            write_request_log(&log_dir, &outcomes, &workload)?;
            let change_done = run.changes.first().map(|c| c.at_ms);
            let (from, to) = match change_done {
                Some(at) => (at, at + SHARE_WINDOW_MS),
                None => (0.0, f64::INFINITY),
            };
            let timeline = (0..(duration_ms / SHARE_BIN_MS).ceil() as usize)
                .filter_map(|b| {
                    let t0 = b as f64 * SHARE_BIN_MS;
                    share_between(&run, shape.watched, t0, t0 + SHARE_BIN_MS)
                        .map(|s| ((t0 + SHARE_BIN_MS) / 1000.0, s))
                })
                .collect();
            eprintln!(
                "kvgate simulate scenarios: {kind} / {} — hit {} · TTFT p90 {:.1} ms · watched share {} · errors {}",
                rep.label,
                fmt_pct(rep.prefix_hit_rate),
                rep.ttft_ms.p90,
                fmt_pct(share_between(&run, shape.watched, from, to)),
                rep.errors
            );
            out_rows.push(ScenarioRow {
                label: rep.label.clone(),
                status: "ok".into(),
                note: None,
                watched_share: share_between(&run, shape.watched, from, to),
                share_timeline: timeline,
                change_done_s: change_done.map(|t| t / 1000.0),
                predicted_over_reported: rep.predicted_over_reported(),
                bypass_requests: run
                    .records
                    .iter()
                    .filter(|r| r.target != Target::Router && r.error.is_none())
                    .count(),
                phases: change_done
                    .map(|done| phases(&outcomes, change_at_ms / 1000.0, done / 1000.0)),
                report: Some(rep),
            });
        }
        let summary = ScenarioSummary {
            scenario: kind,
            shape,
            duration_s: load_args.duration,
            concurrency: load_args.concurrency,
            change_at_s: load_args.change_at,
            rows: out_rows,
        };
        let svg = args.out_dir.join(format!("{kind}-share.svg"));
        std::fs::write(&svg, render_share_svg(&summary))
            .with_context(|| format!("cannot write {}", svg.display()))?;
        summaries.push(summary);
    }
    let md = format!(
        "Simulated in virtual time (`kvgate simulate scenarios`): a restart kills the engine at once (its requests in flight fail) and it is gone {} s; the router takes a dead engine out of rotation at once.\n\n{}",
        kvgate_bench::scenario::HANG.as_secs(),
        kvgate_bench::scenario::render_markdown(&summaries)
    );
    kvgate_bench::scenario::write_outputs(&args.out_dir, &summaries, &md)?;
    println!("{md}");
    Ok(())
}
