//! `kvgate bench scenarios`: routers under a changing fleet, side by side.
//!
//! Owns the scenario definitions (fleet shape, tenant workload, what changes and when),
//! the closed-loop load with a schedule of fleet changes (add an engine through the
//! router's API, hang then kill and restart an engine, reset an engine's cache, send
//! traffic straight to an engine behind the router's back), the per-second sampling of
//! which engine served what, and each scenario's table and plot. Every router row gets
//! a fresh fleet. It must not contain routing logic: it talks to routers and engines
//! over HTTP and signals only.
//!
//! Scenarios (block size 16, tenants each with a system prompt and a unique question):
//! * `steady`: 2 engines, 8 tenants, caches that hold every tenant.
//! * `added`: 1 engine routed, a second added through the router's API under load.
//! * `restart`: engine 1 hangs (SIGSTOP: connections open, nothing answers, as a vLLM
//!   API server whose engine died), then is killed and restarted with an empty cache.
//! * `reset`: engine 0's prefix cache is reset under load.
//! * `bypass`: a second client sends tenant prompts straight to engine 1 all along, so
//!   only the engine's KV events show what it caches.
//! * `zipf`: 32 tenants with Zipf(1.1) popularity, caches holding about half of them.
//! * `overload`: 24 tenants, more than the fleet's caches hold.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::client::{BenchClient, Outcome};
use crate::compare::{engine_finished_requests, first_line, not_run_row, start_router, RunError};
use crate::fleet::{EngineAddr, EngineConfig, Fleet};
use crate::plot::{line_chart_svg, Line, SeriesLabelPosition};
use crate::report::{fmt_opt, fmt_pct, CacheReports, Report};
use crate::request::Request;
use crate::rng::SplitMix64;
use crate::routers::{RouterContext, RouterSpec};
use crate::runner::RunResult;

/// Admin token given to kvgate rows so the bench can add workers at run time.
const ADMIN_TOKEN: &str = "kvgate-bench";
/// Window after a fleet change in which the watched engine's share is measured.
const SHARE_WINDOW: Duration = Duration::from_secs(10);
/// How long a hung engine stays hung before it is killed and restarted: longer than
/// kvgate's default health checks take to declare it dead (3 failed probes, 2 s apart,
/// 1 s timeout), so the requests waiting on it are cut off by health, not by the kill.
pub const HANG: Duration = Duration::from_secs(10);

/// The scenarios, in suite order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ScenarioKind {
    Steady,
    Added,
    Restart,
    Reset,
    Bypass,
    Zipf,
    Overload,
}

impl ScenarioKind {
    pub const ALL: [ScenarioKind; 7] = [
        ScenarioKind::Steady,
        ScenarioKind::Added,
        ScenarioKind::Restart,
        ScenarioKind::Reset,
        ScenarioKind::Bypass,
        ScenarioKind::Zipf,
        ScenarioKind::Overload,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ScenarioKind::Steady => "steady",
            ScenarioKind::Added => "added",
            ScenarioKind::Restart => "restart",
            ScenarioKind::Reset => "reset",
            ScenarioKind::Bypass => "bypass",
            ScenarioKind::Zipf => "zipf",
            ScenarioKind::Overload => "overload",
        }
    }

    /// The fleet, workload and change of this scenario.
    pub fn shape(self) -> Shape {
        let base = Shape {
            engines: 2,
            routed_at_start: 2,
            num_blocks: 2048,
            tenants: 8,
            prefix_tokens: 1536,
            suffix_tokens: 64,
            output_tokens: 32,
            zipf: None,
            change: None,
            bypass: false,
            watched: 1,
        };
        match self {
            ScenarioKind::Steady => base,
            ScenarioKind::Added => Shape {
                routed_at_start: 1,
                change: Some(Change::Add(1)),
                ..base
            },
            ScenarioKind::Restart => Shape {
                change: Some(Change::HangThenRestart(1)),
                ..base
            },
            ScenarioKind::Reset => Shape {
                change: Some(Change::ResetCache(0)),
                watched: 0,
                ..base
            },
            ScenarioKind::Bypass => Shape {
                num_blocks: 1024,
                bypass: true,
                ..base
            },
            ScenarioKind::Zipf => Shape {
                num_blocks: 1024,
                tenants: 32,
                prefix_tokens: 1024,
                zipf: Some(1.1),
                ..base
            },
            ScenarioKind::Overload => Shape {
                num_blocks: 768,
                tenants: 24,
                ..base
            },
        }
    }
}

impl std::fmt::Display for ScenarioKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What changes in the fleet, at the scenario's change time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Change {
    /// Engine i (running, not routed at start) is added through the router's API.
    Add(usize),
    /// Engine i is stopped (SIGSTOP) for [`HANG`], then killed and started again.
    HangThenRestart(usize),
    /// Engine i's prefix cache is reset (`POST /reset_prefix_cache`).
    ResetCache(usize),
}

/// A scenario's fleet and workload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    /// Engines started.
    pub engines: usize,
    /// The first this many are given to the router at start.
    pub routed_at_start: usize,
    /// KV blocks per engine.
    pub num_blocks: u32,
    /// Tenants, each with its own system prompt.
    pub tenants: usize,
    pub prefix_tokens: usize,
    pub suffix_tokens: usize,
    pub output_tokens: u32,
    /// Zipf exponent of tenant popularity (uniform when `None`).
    pub zipf: Option<f64>,
    pub change: Option<Change>,
    /// A second client sends tenant prompts straight to engine 1.
    pub bypass: bool,
    /// The engine whose share of requests over time is plotted.
    pub watched: usize,
}

/// The tenant workload: request `k` is tenant `tenant(k)`'s system prompt plus a
/// question of its own. Deterministic for a seed.
#[derive(Clone, Debug)]
pub struct TenantWorkload {
    prompts: Vec<Vec<u32>>,
    /// Cumulative popularity, for drawing a tenant.
    cdf: Vec<f64>,
    suffix_tokens: usize,
    output_tokens: u32,
    seed: u64,
}

impl TenantWorkload {
    pub fn new(shape: &Shape, seed: u64) -> Self {
        let prompts = (0..shape.tenants)
            .map(|t| {
                let mut rng = SplitMix64::keyed(seed, 0x7E4A_0000 + t as u64);
                (0..shape.prefix_tokens)
                    .map(|_| 100 + rng.below(30_000) as u32)
                    .collect()
            })
            .collect();
        let weights: Vec<f64> = (1..=shape.tenants)
            .map(|rank| shape.zipf.map_or(1.0, |s| 1.0 / (rank as f64).powf(s)))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        let cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
        Self {
            prompts,
            cdf,
            suffix_tokens: shape.suffix_tokens,
            output_tokens: shape.output_tokens,
            seed,
        }
    }

    /// The tenant of request `k`.
    pub fn tenant(&self, k: u64) -> usize {
        let u = SplitMix64::keyed(self.seed, k).unit();
        self.cdf
            .iter()
            .position(|c| u < *c)
            .unwrap_or(self.cdf.len().saturating_sub(1))
    }

    /// Request `k` (arrival 0: the closed loop sends it when a slot frees).
    pub fn request(&self, k: u64) -> Request {
        let mut prompt = self.prompts[self.tenant(k)].clone();
        let mut rng = SplitMix64::keyed(self.seed ^ 0x005F_F1C5, k);
        prompt.extend((0..self.suffix_tokens).map(|_| 100 + rng.below(30_000) as u32));
        Request {
            id: k,
            arrival: Duration::ZERO,
            prompt,
            max_tokens: self.output_tokens,
            session_id: None,
            objective: Default::default(),
        }
    }
}

/// The suite's default rows: kvgate's kv_aware, the baselines, and the peer routers
/// (skipped when not installed).
pub fn default_routers() -> Vec<RouterSpec> {
    vec![
        RouterSpec::Kvgate("kv_aware".into()),
        RouterSpec::Kvgate("prefix_affinity".into()),
        RouterSpec::Kvgate("round_robin".into()),
        RouterSpec::VllmRouter("kv_aware".into()),
        RouterSpec::SglangRouter("cache_aware".into()),
    ]
}

/// Everything a scenario suite run needs.
#[derive(Debug, Clone)]
pub struct ScenarioConfig {
    /// Engine settings; `engines` and `num_blocks` come from each scenario's shape
    /// (`num_blocks` overridden by `num_blocks_override`).
    pub engine: EngineConfig,
    pub num_blocks_override: Option<u32>,
    pub routers: Vec<RouterSpec>,
    pub model: String,
    pub out_dir: PathBuf,
    /// Length of the routed load.
    pub duration: Duration,
    /// Requests in flight through the router (closed loop).
    pub concurrency: usize,
    /// When the fleet changes, from the start of the load.
    pub change_at: Duration,
    pub request_timeout: Duration,
    pub router_startup_timeout: Duration,
    pub kvgate_extra_args: Vec<String>,
}

/// One router's run of one scenario.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioRow {
    pub label: String,
    /// `ok`, `skipped` or `failed`.
    pub status: String,
    pub note: Option<String>,
    pub report: Option<Report>,
    /// Share of routed requests the watched engine served in the 10 s after the change
    /// (or, without a change, over the whole run).
    pub watched_share: Option<f64>,
    /// The watched engine's share per second: `(seconds since load start, share)`.
    pub share_timeline: Vec<(f64, f64)>,
    /// Seconds from the start of the load to the end of the change.
    pub change_done_s: Option<f64>,
    /// The router's predicted over engine-reported cached tokens (kvgate rows).
    pub predicted_over_reported: Option<f64>,
    /// Requests sent straight to an engine by the bypass client.
    pub bypass_requests: usize,
    /// The routed requests by when they were sent relative to the change (scenarios
    /// with a change).
    #[serde(default)]
    pub phases: Option<Phases>,
}

/// One phase of a row: the routed requests sent in it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct PhaseStats {
    /// Requests sent.
    pub sent: usize,
    /// Of them, the ones that ended without an error.
    pub ok: usize,
    /// Cached over prompt tokens of the ok ones whose engine reported cached tokens.
    pub prefix_hit_rate: Option<f64>,
}

/// A row's routed requests split by when they were sent: before the change, while it
/// was under way (an engine hung, then restarting), and after it was done. Where a
/// row's hit rate comes from: a router that keeps serving while an engine is down pays
/// for it in hits then (the survivors' caches take the other engine's tenants), one
/// whose requests wait on the hung engine serves fewer requests and loses no hits, and
/// only the phase after the change shows how well a router used what it knew of the
/// caches then.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    pub before: PhaseStats,
    pub during: PhaseStats,
    pub after: PhaseStats,
}

/// Splits `outcomes` at `change_at_s` and `change_done_s` (seconds since the load
/// started; equal for an instant change, which then has no "during").
pub fn phases(outcomes: &[Outcome], change_at_s: f64, change_done_s: f64) -> Phases {
    let stats = |from: f64, to: f64| {
        let sent: Vec<&Outcome> = outcomes
            .iter()
            .filter(|o| (from..to).contains(&o.sent_at.as_secs_f64()))
            .collect();
        let ok: Vec<&Outcome> = sent.iter().copied().filter(|o| o.is_ok()).collect();
        PhaseStats {
            sent: sent.len(),
            ok: ok.len(),
            prefix_hit_rate: CacheReports::of(ok).prefix_hit_rate(),
        }
    };
    Phases {
        before: stats(f64::NEG_INFINITY, change_at_s),
        during: stats(change_at_s, change_done_s),
        after: stats(change_done_s.max(change_at_s), f64::INFINITY),
    }
}

/// `hit (sent) · hit (sent) · hit (sent)`, before, during and after the change (`-`
/// for a phase with no requests).
pub fn fmt_phases(p: &Phases) -> String {
    [p.before, p.during, p.after]
        .iter()
        .map(|s| match s.sent {
            0 => "- (0)".to_string(),
            n => format!("{} ({n})", fmt_pct(s.prefix_hit_rate)),
        })
        .collect::<Vec<_>>()
        .join(" · ")
}

/// One scenario's rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScenarioSummary {
    pub scenario: ScenarioKind,
    pub shape: Shape,
    pub duration_s: f64,
    pub concurrency: usize,
    pub change_at_s: f64,
    pub rows: Vec<ScenarioRow>,
}

/// Runs `scenarios` for every router and writes `scenarios.md`, `scenarios.json` and one
/// `<scenario>-share.svg` per scenario into the output folder.
pub async fn run_scenarios(
    cfg: &ScenarioConfig,
    scenarios: &[ScenarioKind],
) -> anyhow::Result<Vec<ScenarioSummary>> {
    std::fs::create_dir_all(&cfg.out_dir)
        .with_context(|| format!("cannot create {}", cfg.out_dir.display()))?;
    let mut out = Vec::new();
    for &kind in scenarios {
        let shape = Shape {
            num_blocks: cfg.num_blocks_override.unwrap_or(kind.shape().num_blocks),
            ..kind.shape()
        };
        let mut rows = Vec::new();
        for spec in &cfg.routers {
            eprintln!("kvgate bench scenarios: {kind} / {} ...", spec.label());
            let row = match run_row(cfg, kind, &shape, spec).await {
                Ok(row) => row,
                Err(RunError::Skipped(why)) => {
                    eprintln!("  skipped: {why}");
                    empty_row(spec.label(), "skipped", why)
                }
                Err(RunError::Failed(e)) => {
                    let msg = format!("{e:#}");
                    eprintln!("  failed: {msg}");
                    empty_row(spec.label(), "failed", first_line(&msg))
                }
            };
            if let Some(r) = &row.report {
                eprintln!(
                    "  hit {} · TTFT p90 {:.1} ms · watched share {} · errors {}",
                    fmt_pct(r.prefix_hit_rate),
                    r.ttft_ms.p90,
                    fmt_pct(row.watched_share),
                    r.errors
                );
            }
            rows.push(row);
        }
        let summary = ScenarioSummary {
            scenario: kind,
            shape,
            duration_s: cfg.duration.as_secs_f64(),
            concurrency: cfg.concurrency,
            change_at_s: cfg.change_at.as_secs_f64(),
            rows,
        };
        let svg = cfg.out_dir.join(format!("{kind}-share.svg"));
        std::fs::write(&svg, render_share_svg(&summary))
            .with_context(|| format!("cannot write {}", svg.display()))?;
        out.push(summary);
        // Written after every scenario, so a long suite leaves results as it goes.
        write_outputs(&cfg.out_dir, &out, &render_markdown(&out))?;
    }
    Ok(out)
}

fn empty_row(label: String, status: &str, note: String) -> ScenarioRow {
    ScenarioRow {
        label,
        status: status.into(),
        note: Some(note),
        report: None,
        watched_share: None,
        share_timeline: Vec::new(),
        change_done_s: None,
        predicted_over_reported: None,
        bypass_requests: 0,
        phases: None,
    }
}

async fn run_row(
    cfg: &ScenarioConfig,
    kind: ScenarioKind,
    shape: &Shape,
    spec: &RouterSpec,
) -> Result<ScenarioRow, RunError> {
    if matches!(spec, RouterSpec::Envoy(_)) {
        // An Envoy row's fleet is fixed in its configuration: no engine could join it.
        return Err(RunError::Failed(anyhow::anyhow!(
            "scenarios change the fleet; an envoy: row's fleet is fixed in Envoy's configuration"
        )));
    }
    let log_dir = row_log_dir(&cfg.out_dir, kind, &spec.file_stem());
    let engine_cfg = EngineConfig {
        engines: shape.engines,
        num_blocks: shape.num_blocks,
        ..cfg.engine.clone()
    };
    let fleet = Fleet::start(&engine_cfg, &log_dir)
        .await
        .context("starting the mock-engine fleet")?;
    let addrs: Vec<EngineAddr> = fleet.addrs().to_vec();
    let mut kvgate_args = cfg.kvgate_extra_args.clone();
    kvgate_args.extend(["--admin-token".into(), ADMIN_TOKEN.into()]);
    let ctx = RouterContext {
        kvgate_bin: cfg.engine.kvgate_bin.clone(),
        model: cfg.model.clone(),
        block_size: cfg.engine.block_size,
        log_dir: log_dir.clone(),
        startup_timeout: cfg.router_startup_timeout,
        kvgate_extra_args: kvgate_args,
    };
    let (mut fleet, router, url, more, _, _) =
        start_router(spec, &ctx, fleet, &addrs[..shape.routed_at_start]).await?;
    if !more.is_empty() {
        return Err(RunError::Failed(anyhow::anyhow!(
            "scenarios run one router replica per row"
        )));
    }
    let workload = Arc::new(TenantWorkload::new(shape, cfg.engine.seed));
    let client = BenchClient::new(&url, &cfg.model, cfg.request_timeout)?
        .with_prompt_format(spec.prompt_format());
    let start = Instant::now();
    let deadline = start + cfg.duration;
    let sampler = tokio::spawn(sample_engine_counts(addrs.clone(), start, deadline));
    let bypass = shape.bypass.then(|| {
        let engine = BenchClient::new(&addrs[1].url, &cfg.model, cfg.request_timeout);
        let workload = workload.clone();
        tokio::spawn(async move {
            match engine {
                Ok(c) => bypass_load(c, workload, start, deadline).await,
                Err(_) => Vec::new(),
            }
        })
    });
    let load = closed_loop(&client, workload.clone(), cfg.concurrency, start, deadline);
    let change = apply_change(
        shape.change,
        &mut fleet,
        &addrs,
        spec,
        &url,
        start,
        start + cfg.change_at,
    );
    let (outcomes, change_done) = tokio::join!(load, change);
    let change_done = change_done.context("applying the fleet change")?;
    let wall = start.elapsed();
    let counts = sampler.await.unwrap_or_default();
    let bypass_done = match bypass {
        Some(h) => h.await.unwrap_or_default(),
        None => Vec::new(),
    };
    let predicted_over_reported = match spec {
        RouterSpec::Kvgate(_) => prediction_ratio(&url).await,
        _ => None,
    };
    router.shutdown().await;
    fleet.shutdown().await;
    let timeline = share_timeline(&counts, &bypass_done, shape.watched);
    let from = change_done.map_or(0.0, |d| d.as_secs_f64());
    let to = change_done.map_or(f64::INFINITY, |d| (d + SHARE_WINDOW).as_secs_f64());
    let watched_share = window_share(&counts, &bypass_done, shape.watched, from, to);
    let phases =
        change_done.map(|done| phases(&outcomes, cfg.change_at.as_secs_f64(), done.as_secs_f64()));
    write_request_log(&log_dir, &outcomes, &workload).context("writing the row's request log")?;
    let run = RunResult { outcomes, wall };
    let mut report = Report::from_run(&spec.label(), &run);
    if report.per_worker.is_empty() {
        report.set_per_worker(final_counts(&counts, &bypass_done, &addrs));
    }
    Ok(ScenarioRow {
        label: spec.label(),
        status: "ok".into(),
        note: None,
        report: Some(report),
        watched_share,
        share_timeline: timeline,
        change_done_s: change_done.map(|d| d.as_secs_f64()),
        predicted_over_reported,
        bypass_requests: bypass_done.len(),
        phases,
    })
}

/// One line per routed request, in request order: its tenant, when it was sent, how it
/// ended, what the engine served from cache, and who answered (the router's worker
/// header and the answer's id, which names the mock engine's process). What a row's
/// totals cannot show, such as where each tenant lived over time, can be read from it.
/// `kvgate simulate scenarios` writes its rows' logs with it too, so a simulated row and
/// a real-time one can be read with the same script. Written to `requests.jsonl` in
/// `log_dir` ([`row_log_dir`]), which must exist.
pub fn write_request_log(
    log_dir: &Path,
    outcomes: &[Outcome],
    workload: &TenantWorkload,
) -> anyhow::Result<()> {
    let path = log_dir.join("requests.jsonl");
    let mut text = String::new();
    for o in outcomes {
        let line = serde_json::json!({
            "id": o.id,
            "tenant": workload.tenant(o.id),
            "sent_s": o.sent_at.as_secs_f64(),
            "ttft_ms": o.ttft.map(|t| t.as_secs_f64() * 1e3),
            "e2e_ms": o.e2e.as_secs_f64() * 1e3,
            "prompt_tokens": o.prompt_tokens,
            "cached_tokens": o.cached_tokens,
            "error": o.error,
            "worker": o.worker,
            "response_id": o.response_id,
        });
        text.push_str(&line.to_string());
        text.push('\n');
    }
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// Where a scenario row's logs go under an output folder: `logs/<scenario>/<row>`, the
/// row named by its file stem ([`RouterSpec::file_stem`]). The real-time suite and
/// `kvgate simulate scenarios` both lay their logs out so.
pub fn row_log_dir(out_dir: &Path, kind: ScenarioKind, row_file_stem: &str) -> PathBuf {
    out_dir.join("logs").join(kind.name()).join(row_file_stem)
}

/// `concurrency` senders, each sending the next request as soon as its previous one
/// ended, until `deadline`. Outcomes sorted by request id, each with when it was sent
/// since `start`.
async fn closed_loop(
    client: &BenchClient,
    workload: Arc<TenantWorkload>,
    concurrency: usize,
    start: Instant,
    deadline: Instant,
) -> Vec<Outcome> {
    let next = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..concurrency.max(1) {
        let (client, workload, next) = (client.clone(), workload.clone(), next.clone());
        set.spawn(async move {
            let mut outs = Vec::new();
            while Instant::now() < deadline {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let sent_at = start.elapsed();
                let mut out = client.send(&workload.request(k)).await;
                out.sent_at = sent_at;
                outs.push(out);
            }
            outs
        });
    }
    let mut all = Vec::new();
    while let Some(done) = set.join_next().await {
        all.extend(done.unwrap_or_default());
    }
    all.sort_by_key(|o| o.id);
    all
}

/// Tenant requests sent straight to one engine, one at a time, until `deadline`.
/// Returns when each completed (seconds since `start`).
async fn bypass_load(
    client: BenchClient,
    workload: Arc<TenantWorkload>,
    start: Instant,
    deadline: Instant,
) -> Vec<f64> {
    let mut done = Vec::new();
    let mut k = 1u64 << 40; // ids apart from the routed requests'
    while Instant::now() < deadline {
        let out = client.send(&workload.request(k)).await;
        if out.is_ok() {
            done.push(start.elapsed().as_secs_f64());
        }
        k += 1;
    }
    done
}

/// Applies `change` at `at`; returns when it was done, since `load_start`.
async fn apply_change(
    change: Option<Change>,
    fleet: &mut Fleet,
    addrs: &[EngineAddr],
    spec: &RouterSpec,
    router_url: &str,
    load_start: Instant,
    at: Instant,
) -> anyhow::Result<Option<Duration>> {
    let Some(change) = change else {
        return Ok(None);
    };
    tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    match change {
        Change::Add(i) => add_worker(&http, spec, router_url, &addrs[i]).await?,
        Change::HangThenRestart(i) => {
            fleet.signal(i, libc::SIGSTOP)?;
            tokio::time::sleep(HANG).await;
            fleet.kill(i).await?;
            fleet.restart(i).await?;
        }
        Change::ResetCache(i) => {
            // vLLM refuses a reset while requests run unless told to preempt them.
            let r = http
                .post(format!("{}/reset_prefix_cache", addrs[i].url))
                .query(&[("reset_running_requests", "true")])
                .send()
                .await?;
            anyhow::ensure!(r.status().is_success(), "reset answered {}", r.status());
        }
    }
    Ok(Some(load_start.elapsed()))
}

/// Adds `engine` to a running router: kvgate's admin API; for the peers, the SGLang
/// gateway's `POST /workers` (`{"url"}`), falling back to the older `POST
/// /add_worker?url=` that vllm-router keeps.
async fn add_worker(
    http: &reqwest::Client,
    spec: &RouterSpec,
    router_url: &str,
    engine: &EngineAddr,
) -> anyhow::Result<()> {
    let resp = match spec {
        RouterSpec::Kvgate(_) => {
            http.post(format!("{router_url}/admin/workers"))
                .bearer_auth(ADMIN_TOKEN)
                .json(&serde_json::json!({
                    "url": engine.url,
                    "kv_events": engine.kv_events,
                    "kv_events_replay": engine.replay,
                }))
                .send()
                .await?
        }
        RouterSpec::Envoy(_) => anyhow::bail!("an envoy: row's fleet is fixed"),
        RouterSpec::VllmRouter(_) | RouterSpec::SglangRouter(_) => {
            let first = http
                .post(format!("{router_url}/workers"))
                .json(&serde_json::json!({ "url": engine.url }))
                .send()
                .await?;
            if matches!(first.status().as_u16(), 404 | 405) {
                http.post(format!("{router_url}/add_worker"))
                    .query(&[("url", engine.url.as_str())])
                    .send()
                    .await?
            } else {
                first
            }
        }
    };
    let status = resp.status();
    anyhow::ensure!(
        status.is_success(),
        "adding {} answered {status}: {}",
        engine.url,
        resp.text().await.unwrap_or_default()
    );
    Ok(())
}

/// Every second until `deadline`: each engine's finished-request counter
/// (`vllm:request_success_total`; `None` while it does not answer). Rows of
/// `(seconds since start, counts)`.
async fn sample_engine_counts(
    addrs: Vec<EngineAddr>,
    start: Instant,
    deadline: Instant,
) -> Vec<(f64, Vec<Option<f64>>)> {
    let Ok(http) = reqwest::Client::builder()
        .timeout(Duration::from_millis(500))
        .build()
    else {
        return Vec::new();
    };
    let mut rows = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let t = start.elapsed().as_secs_f64();
        let mut counts = Vec::with_capacity(addrs.len());
        for a in &addrs {
            counts.push(engine_finished_requests(&http, &a.url).await);
        }
        rows.push((t, counts));
        if Instant::now() >= deadline + Duration::from_secs(1) {
            return rows;
        }
    }
}

/// Requests each engine finished in each sampling interval, less the bypass client's
/// (counted on engine 1). An engine that did not answer, or restarted (its counter went
/// down), contributes what its counter shows since.
fn per_interval(
    counts: &[(f64, Vec<Option<f64>>)],
    bypass_done: &[f64],
) -> Vec<(f64, f64, Vec<f64>)> {
    let mut out = Vec::new();
    let Some((_, first)) = counts.first() else {
        return out;
    };
    let mut last: Vec<f64> = first.iter().map(|c| c.unwrap_or(0.0)).collect();
    let mut t0 = counts[0].0;
    for (t, row) in &counts[1..] {
        let mut delta = Vec::with_capacity(row.len());
        for (i, c) in row.iter().enumerate() {
            match c {
                Some(v) if *v >= last[i] => {
                    delta.push(v - last[i]);
                    last[i] = *v;
                }
                Some(v) => {
                    delta.push(*v);
                    last[i] = *v;
                }
                None => delta.push(0.0),
            }
        }
        if delta.len() > 1 {
            let bypassed = bypass_done.iter().filter(|d| **d > t0 && **d <= *t).count();
            delta[1] = (delta[1] - bypassed as f64).max(0.0);
        }
        out.push((t0, *t, delta));
        t0 = *t;
    }
    out
}

fn share_timeline(
    counts: &[(f64, Vec<Option<f64>>)],
    bypass_done: &[f64],
    watched: usize,
) -> Vec<(f64, f64)> {
    per_interval(counts, bypass_done)
        .into_iter()
        .filter_map(|(_, t, d)| {
            let total: f64 = d.iter().sum();
            (total > 0.0).then(|| (t, d.get(watched).copied().unwrap_or(0.0) / total))
        })
        .collect()
}

/// The watched engine's share of routed requests finished in `(from, to]`.
fn window_share(
    counts: &[(f64, Vec<Option<f64>>)],
    bypass_done: &[f64],
    watched: usize,
    from: f64,
    to: f64,
) -> Option<f64> {
    let (mut mine, mut total) = (0.0, 0.0);
    for (t0, t1, d) in per_interval(counts, bypass_done) {
        if t0 >= from && t1 <= to + 1e-9 {
            mine += d.get(watched).copied().unwrap_or(0.0);
            total += d.iter().sum::<f64>();
        }
    }
    (total > 0.0).then(|| mine / total)
}

fn final_counts(
    counts: &[(f64, Vec<Option<f64>>)],
    bypass_done: &[f64],
    addrs: &[EngineAddr],
) -> BTreeMap<String, usize> {
    let mut totals = vec![0.0; addrs.len()];
    for (_, _, d) in per_interval(counts, bypass_done) {
        for (i, v) in d.iter().enumerate() {
            totals[i] += v;
        }
    }
    addrs
        .iter()
        .zip(totals)
        .map(|(a, n)| (a.url.clone(), n.round() as usize))
        .collect()
}

/// kvgate's predicted over engine-reported cached tokens, from its `/metrics`.
async fn prediction_ratio(router_url: &str) -> Option<f64> {
    let (predicted, reported) = crate::compare::kvgate_prediction(router_url).await?;
    (reported > 0.0).then(|| predicted / reported)
}

/// All scenarios as markdown tables.
pub fn render_markdown(summaries: &[ScenarioSummary]) -> String {
    let mut s = String::new();
    for sum in summaries {
        let sh = &sum.shape;
        let _ = writeln!(
            s,
            "### {}\n\n{} engines ({} routed at start), {} blocks each, {} tenants × {}-token prompt + {}-token question, {} output tokens{}; concurrency {}, {:.0} s{}{}\n",
            sum.scenario,
            sh.engines,
            sh.routed_at_start,
            sh.num_blocks,
            sh.tenants,
            sh.prefix_tokens,
            sh.suffix_tokens,
            sh.output_tokens,
            sh.zipf.map_or_else(String::new, |z| format!(", Zipf({z}) popularity")),
            sum.concurrency,
            sum.duration_s,
            sh.change.map_or_else(String::new, |c| format!(
                "; change at {:.0} s: {}",
                sum.change_at_s,
                describe(c)
            )),
            if sh.bypass { "; a bypass client sends tenant prompts straight to engine 1" } else { "" },
        );
        let share_head = if sh.change.is_some() {
            format!("engine {} share, 10 s after the change", sh.watched)
        } else {
            format!("engine {} share", sh.watched)
        };
        let (phase_head, phase_rule) = if sh.change.is_some() {
            (
                " prefix hit before · during · after the change (requests sent) |",
                "---:|",
            )
        } else {
            ("", "")
        };
        let _ = writeln!(
            s,
            "| router | ok | errors | prefix hit |{phase_head} TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | E2E max ms | {share_head} | predicted / reported cached | note |"
        );
        let _ = writeln!(
            s,
            "|---|---:|---:|---:|{phase_rule}---:|---:|---:|---:|---:|---:|---|"
        );
        for row in &sum.rows {
            match &row.report {
                Some(r) => {
                    let phase_cell = if sh.change.is_some() {
                        format!(
                            " {} |",
                            row.phases.as_ref().map_or_else(|| "-".into(), fmt_phases)
                        )
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} |{phase_cell} {:.1} | {:.1} | {:.1} | {:.0} | {} | {} | {} |",
                        row.label,
                        r.ok,
                        r.errors,
                        fmt_pct(r.prefix_hit_rate),
                        r.ttft_ms.p50,
                        r.ttft_ms.p90,
                        r.ttft_ms.p99,
                        r.e2e_ms.max,
                        fmt_pct(row.watched_share),
                        fmt_opt(row.predicted_over_reported, 3),
                        row.note.as_deref().unwrap_or(""),
                    );
                }
                None => not_run_row(
                    &mut s,
                    &row.label,
                    &row.status,
                    row.note.as_deref(),
                    9 + usize::from(sh.change.is_some()),
                ),
            }
        }
        s.push('\n');
    }
    s
}

fn describe(c: Change) -> String {
    match c {
        Change::Add(i) => format!("engine {i} added through the router's API"),
        Change::HangThenRestart(i) => format!(
            "engine {i} hangs (SIGSTOP) for {} s, then is killed and restarted",
            HANG.as_secs()
        ),
        Change::ResetCache(i) => format!("engine {i}'s prefix cache reset"),
    }
}

/// The watched engine's share of requests per second, one line per router.
pub fn render_share_svg(sum: &ScenarioSummary) -> String {
    let lines: Vec<Line> = sum
        .rows
        .iter()
        .filter(|r| !r.share_timeline.is_empty())
        .map(|r| Line {
            label: r.label.clone(),
            points: r
                .share_timeline
                .iter()
                .map(|(t, v)| (*t, v * 100.0))
                .collect(),
        })
        .collect();
    let marker = sum
        .rows
        .iter()
        .find_map(|r| r.change_done_s)
        .or(sum.shape.change.map(|_| sum.change_at_s));
    line_chart_svg(
        &format!(
            "{}: engine {}'s share of requests per second",
            sum.scenario, sum.shape.watched
        ),
        &sum.shape
            .change
            .map_or_else(|| "no fleet change".to_string(), describe),
        "seconds since the load started",
        "share (%)",
        &lines,
        marker,
        SeriesLabelPosition::UpperRight,
    )
}

/// Writes `markdown` as `scenarios.md` and the summaries as `scenarios.json` into `dir`
/// (also what `kvgate simulate scenarios` writes).
pub fn write_outputs(
    dir: &Path,
    summaries: &[ScenarioSummary],
    markdown: &str,
) -> anyhow::Result<()> {
    for (name, bytes) in [
        ("scenarios.md", markdown.as_bytes().to_vec()),
        ("scenarios.json", serde_json::to_vec_pretty(summaries)?),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_workload_is_deterministic_and_shares_each_tenants_prompt() {
        let shape = ScenarioKind::Steady.shape();
        let a = TenantWorkload::new(&shape, 3);
        let b = TenantWorkload::new(&shape, 3);
        for k in 0..50 {
            assert_eq!(a.request(k).prompt, b.request(k).prompt);
        }
        let (r0, r1) = (a.request(0), a.request(1));
        assert_eq!(r0.prompt.len(), shape.prefix_tokens + shape.suffix_tokens);
        let same_tenant = (1..200).find(|k| a.tenant(*k) == a.tenant(0)).unwrap();
        let rs = a.request(same_tenant);
        assert_eq!(
            rs.prompt[..shape.prefix_tokens],
            r0.prompt[..shape.prefix_tokens]
        );
        assert_ne!(
            rs.prompt[shape.prefix_tokens..],
            r0.prompt[shape.prefix_tokens..]
        );
        if a.tenant(1) != a.tenant(0) {
            assert_ne!(r1.prompt[..16], r0.prompt[..16]);
        }
    }

    #[test]
    fn zipf_popularity_is_skewed_and_uniform_is_not() {
        let zipf = TenantWorkload::new(&ScenarioKind::Zipf.shape(), 1);
        let mut counts = vec![0usize; 32];
        for k in 0..20_000 {
            counts[zipf.tenant(k)] += 1;
        }
        assert!(counts[0] > 5 * counts[31], "{counts:?}");
        let uniform = TenantWorkload::new(&ScenarioKind::Steady.shape(), 1);
        let mut counts = vec![0usize; 8];
        for k in 0..20_000 {
            counts[uniform.tenant(k)] += 1;
        }
        assert!(
            counts.iter().all(|c| (2000..3000).contains(c)),
            "{counts:?}"
        );
    }

    /// Shares come from counter deltas; a restarted engine's counter starts over, a
    /// silent engine adds nothing, and the bypass client's requests on engine 1 are not
    /// counted as routed.
    #[test]
    fn shares_come_from_counter_deltas_less_bypass_traffic() {
        let counts = vec![
            (0.0, vec![Some(0.0), Some(0.0)]),
            (1.0, vec![Some(10.0), Some(0.0)]),
            (2.0, vec![Some(20.0), None]),
            (3.0, vec![Some(25.0), Some(5.0)]),
            (4.0, vec![Some(30.0), Some(12.0)]),
        ];
        let bypass = [3.5, 3.6];
        let d = per_interval(&counts, &bypass);
        assert_eq!(d.len(), 4);
        assert_eq!(d[2].2, vec![5.0, 5.0], "counter went from 0 (silent) to 5");
        assert_eq!(d[3].2, vec![5.0, 5.0], "7 finished, 2 of them bypass");
        let share = window_share(&counts, &bypass, 1, 2.0, 4.0).unwrap();
        assert!((share - 0.5).abs() < 1e-9, "{share}");
        assert_eq!(window_share(&counts, &bypass, 1, 0.0, 2.0), Some(0.0));
        let timeline = share_timeline(&counts, &bypass, 1);
        assert_eq!(timeline.len(), 4);
        assert!((timeline[3].1 - 0.5).abs() < 1e-9);
    }

    /// A row's requests split by when they were sent: before the change, while it was
    /// under way (a hung engine), after it was done. Errors count as sent, not in the
    /// hit rate; requests without cache info are left out of the hit rate.
    #[test]
    fn phases_split_requests_by_when_they_were_sent() {
        let out = |sent_s: f64, cached: Option<u64>, error: bool| Outcome {
            sent_at: Duration::from_secs_f64(sent_s),
            prompt_tokens: 100,
            cached_tokens: cached,
            error: error.then(|| "stream_error".to_string()),
            ..Outcome::default()
        };
        let outcomes = [
            out(1.0, Some(90), false),
            out(7.9, Some(70), false),
            out(8.0, Some(10), false),
            out(9.0, None, true),
            out(17.9, Some(30), false),
            out(18.0, Some(80), false),
            out(30.0, None, false),
        ];
        let p = phases(&outcomes, 8.0, 18.0);
        assert_eq!((p.before.sent, p.before.ok), (2, 2));
        assert!((p.before.prefix_hit_rate.unwrap() - 0.8).abs() < 1e-9);
        assert_eq!((p.during.sent, p.during.ok), (3, 2));
        assert!((p.during.prefix_hit_rate.unwrap() - 0.2).abs() < 1e-9);
        assert_eq!((p.after.sent, p.after.ok), (2, 2));
        assert!((p.after.prefix_hit_rate.unwrap() - 0.8).abs() < 1e-9);
        // An instant change (a cache reset) has no "during".
        let instant = phases(&outcomes, 8.0, 8.0);
        assert_eq!(instant.during, PhaseStats::default());
        assert_eq!(instant.after.sent, 5);
        assert_eq!(
            fmt_phases(&p),
            "80.0% (2) · 20.0% (3) · 80.0% (2)",
            "hit rate (requests sent) per phase"
        );
        assert_eq!(fmt_phases(&instant).split(" · ").nth(1), Some("- (0)"));
    }

    #[test]
    fn markdown_and_svg_name_every_row() {
        let row = |label: &str| ScenarioRow {
            label: label.into(),
            status: "ok".into(),
            note: None,
            report: Some(Report {
                label: label.into(),
                ok: 10,
                requests: 10,
                ..Report::default()
            }),
            watched_share: Some(0.4),
            share_timeline: vec![(1.0, 0.2), (2.0, 0.5)],
            change_done_s: Some(8.0),
            predicted_over_reported: Some(1.01),
            bypass_requests: 0,
            phases: Some(Phases::default()),
        };
        let sum = ScenarioSummary {
            scenario: ScenarioKind::Added,
            shape: ScenarioKind::Added.shape(),
            duration_s: 30.0,
            concurrency: 4,
            change_at_s: 8.0,
            rows: vec![
                row("kv_aware"),
                empty_row(
                    "sglang-router:cache_aware".into(),
                    "skipped",
                    "not installed".into(),
                ),
            ],
        };
        let md = render_markdown(std::slice::from_ref(&sum));
        assert!(md.contains("| kv_aware | 10 | 0 |"), "{md}");
        assert!(md.contains("40.0%"), "{md}");
        assert!(md.contains("skipped: not installed"), "{md}");
        let cells = |prefix: &str| {
            md.lines()
                .find(|l| l.starts_with(prefix))
                .map(|l| l.matches('|').count())
        };
        assert_eq!(cells("| router |"), cells("| sglang-router"), "{md}");
        let svg = render_share_svg(&sum);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("kv_aware"), "the row that ran is plotted");
        assert!(!svg.contains("sglang-router"), "the skipped row is not");
    }
}
