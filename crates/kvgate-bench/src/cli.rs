//! Command-line surface: `kvgate bench`, `kvgate bench compare` and `kvgate demo`.
//!
//! Owns argument parsing, turning arguments into requests/configs, Ctrl-C handling and
//! where output goes. The `kvgate` binary calls `run_bench` and `run_demo`. It must not
//! contain measurement, statistics or process management of its own.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};

use crate::client::{BenchClient, PromptFormat};
use crate::compare::{self, render_markdown, CompareConfig};
use crate::fleet::EngineConfig;
use crate::process::which;
use crate::report::Report;
use crate::request::{summarize, Request, RequestObjective};
use crate::rng::SplitMix64;
use crate::routers::RouterSpec;
use crate::runner::{self, RunConfig};
use crate::scenario::{self, ScenarioConfig, ScenarioKind};
use crate::trace::{self, SynthConfig, MOONCAKE_BLOCK_TOKENS};
use crate::workload::{WorkloadConfig, WorkloadKind};

/// Default KV blocks per engine for `bench compare`.
const COMPARE_NUM_BLOCKS: u32 = 8192;
/// Default KV blocks per engine for the demo: 16k tokens at block size 16, room for
/// three or four of the eight 4096-token tenant prompts.
const DEMO_NUM_BLOCKS: u32 = 1024;

/// Where requests come from: a Mooncake trace or a built-in synthetic workload.
#[derive(clap::Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// Mooncake JSONL trace to replay (timestamp, input_length, output_length, hash_ids).
    #[arg(long, value_name = "FILE", conflicts_with = "workload")]
    pub trace: Option<PathBuf>,
    /// Built-in synthetic workload instead of a trace.
    #[arg(long, value_enum, value_name = "NAME")]
    pub workload: Option<WorkloadKind>,
    /// First trace record to replay (0-based).
    #[arg(long, default_value_t = 0)]
    pub start: usize,
    /// Number of requests (trace window size; synthetic workload size, default 200).
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Tokens synthesized per trace hash id (512 = full size; smaller shrinks every
    /// prompt proportionally, keeping the sharing structure).
    #[arg(long, default_value_t = MOONCAKE_BLOCK_TOKENS)]
    pub block_tokens: u32,
    /// Synthesized token ids are drawn from [100, 100 + vocab-size).
    #[arg(long, default_value_t = 32_000)]
    pub vocab_size: u32,
    /// Seed for token synthesis and synthetic arrivals (kvgate simulate: also the
    /// engines' hashes and the policies' random choices).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Multiply trace output lengths by this factor.
    #[arg(long, default_value_t = 1.0)]
    pub output_scale: f64,
    /// Cap on max_tokens per request.
    #[arg(long)]
    pub max_output_tokens: Option<u32>,
    /// Synthetic: mean arrival rate (requests/s, Poisson).
    #[arg(long, default_value_t = 10.0)]
    pub rate: f64,
    /// Synthetic: shared system-prompt tokens (no-sharing: prompt tokens).
    #[arg(long, default_value_t = 2048)]
    pub prefix_tokens: usize,
    /// Synthetic: distinct suffix tokens per request / per user turn.
    #[arg(long, default_value_t = 128)]
    pub suffix_tokens: usize,
    /// Synthetic: output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    /// Synthetic shared-prefix: number of distinct system prompts.
    #[arg(long, default_value_t = 1)]
    pub groups: usize,
    /// Synthetic: users (shared-prefix), conversations (multi-turn) or agent episodes
    /// (tool-agent).
    #[arg(long, default_value_t = 32)]
    pub users: usize,
    /// Synthetic multi-turn / tool-agent: mean think time (tool latency) between turns,
    /// seconds.
    #[arg(long, default_value_t = 2.0)]
    pub think_time: f64,
    /// Every request's time-to-first-token objective in ms, sent as `x-slo-ttft-ms`;
    /// the report's goodput counts the requests answered within it.
    #[arg(long, value_name = "MS")]
    pub slo_ttft_ms: Option<u32>,
    /// Share of the requests (drawn by seed) marked sheddable, `x-priority: -1`: batch
    /// work a router may refuse at once when it predicts the objective missed.
    #[arg(long, value_name = "FRACTION", default_value_t = 0.0)]
    pub sheddable_share: f64,
    /// The sheddable requests' TTFT objective in ms (default: --slo-ttft-ms).
    #[arg(long, value_name = "MS")]
    pub sheddable_slo_ttft_ms: Option<u32>,
    /// Score goodput against the objectives but send none (no `x-slo-ttft-ms`, no
    /// `x-priority`): the baseline of a router that ignores them.
    #[arg(long)]
    pub objectives_hidden: bool,
}

impl WorkloadArgs {
    /// Build the request list and a one-line description of it (with the objectives
    /// and priorities asked for).
    pub fn build(&self) -> anyhow::Result<(Vec<Request>, String)> {
        let (mut requests, mut desc) = self.build_requests()?;
        if !(0.0..=1.0).contains(&self.sheddable_share) {
            bail!("--sheddable-share must be between 0 and 1");
        }
        if self.slo_ttft_ms.is_some() || self.sheddable_share > 0.0 {
            let interactive = self.slo_ttft_ms;
            let batch = self.sheddable_slo_ttft_ms.or(interactive);
            for r in &mut requests {
                let sheddable =
                    SplitMix64::keyed(self.seed ^ 0x5eed_ab1e, r.id).unit() < self.sheddable_share;
                r.objective = RequestObjective {
                    ttft_ms: if sheddable { batch } else { interactive },
                    priority: if sheddable { -1 } else { 0 },
                    hidden: self.objectives_hidden,
                };
            }
            desc.push_str(&format!(
                "; TTFT objective {} ms, {:.0}% sheddable (objective {} ms){}",
                interactive.map_or("none".into(), |v| v.to_string()),
                self.sheddable_share * 100.0,
                batch.map_or("none".into(), |v| v.to_string()),
                if self.objectives_hidden {
                    ", not sent"
                } else {
                    ""
                },
            ));
        }
        Ok((requests, desc))
    }

    fn build_requests(&self) -> anyhow::Result<(Vec<Request>, String)> {
        if self.block_tokens == 0 {
            bail!("--block-tokens must be at least 1");
        }
        if let Some(path) = &self.trace {
            let records = trace::load_mooncake(path)?;
            let window = trace::select_window(&records, self.start, self.max_requests);
            if window.is_empty() {
                bail!(
                    "trace {} has {} records; window starting at {} is empty",
                    path.display(),
                    records.len(),
                    self.start
                );
            }
            let synth = SynthConfig {
                block_tokens: self.block_tokens,
                vocab_size: self.vocab_size,
                seed: self.seed,
                output_scale: self.output_scale,
                max_output_tokens: self.max_output_tokens,
                ..SynthConfig::default()
            };
            let name = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            let desc = format!(
                "trace {name} [{}, {}) block-tokens {}",
                self.start,
                self.start + window.len(),
                self.block_tokens
            );
            return Ok((synth.to_requests(window), desc));
        }
        let Some(kind) = self.workload else {
            bail!("give a trace (--trace FILE) or a synthetic workload (--workload shared-prefix|multi-turn|tool-agent|no-sharing)");
        };
        let cfg = WorkloadConfig {
            kind,
            requests: self.max_requests.unwrap_or(200),
            rate: self.rate,
            prefix_tokens: self.prefix_tokens,
            suffix_tokens: self.suffix_tokens,
            output_tokens: self
                .max_output_tokens
                .map_or(self.output_tokens, |c| self.output_tokens.min(c)),
            groups: self.groups,
            users: self.users,
            think_time_s: self.think_time,
            seed: self.seed,
            vocab_size: self.vocab_size,
            token_base: 100,
        };
        let desc = format!(
            "{} ({} req at {}/s, prefix {} + suffix {} tokens, {} out)",
            kind.name(),
            cfg.requests,
            cfg.rate,
            cfg.prefix_tokens,
            cfg.suffix_tokens,
            cfg.output_tokens
        );
        Ok((cfg.generate(), desc))
    }
}

/// How requests are replayed.
#[derive(clap::Args, Debug, Clone)]
pub struct ReplayArgs {
    /// Replay arrival times this many times faster (2 = twice the trace's rate).
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// At most this many requests in flight (default: open loop, no cap).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Model name sent in every request.
    #[arg(long, default_value = "mock-model")]
    pub model: String,
    /// Do not draw a progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Prompt encoding for `kvgate bench --target` (compare picks per router).
    #[arg(long, value_enum, default_value = "tokens")]
    pub prompt_format: PromptFormat,
}

impl ReplayArgs {
    fn run_config(&self, label: &str) -> anyhow::Result<RunConfig> {
        if !(self.speedup > 0.0 && self.speedup.is_finite()) {
            bail!("--speedup must be a positive number");
        }
        Ok(RunConfig {
            speedup: self.speedup,
            concurrency: self.concurrency,
            progress: !self.no_progress,
            label: label.to_string(),
        })
    }

    fn timeout(&self) -> anyhow::Result<Duration> {
        Duration::try_from_secs_f64(self.request_timeout)
            .ok()
            .filter(|d| !d.is_zero())
            .context("--request-timeout must be a positive number of seconds")
    }
}

/// `kvgate bench`: replay a trace or workload against one endpoint, or `compare` routers.
#[derive(clap::Args, Debug)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    /// Run several routers over the same requests on a simulated fleet.
    #[command(subcommand)]
    pub command: Option<BenchCommand>,
    /// Base URL of the OpenAI-compatible endpoint (kvgate, a peer router, or one engine).
    #[arg(long)]
    pub target: Option<String>,
    /// What to replay.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// How to replay.
    #[command(flatten)]
    pub replay: ReplayArgs,
    /// Write the report as JSON to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Subcommands of `kvgate bench`. Parsed once per process, so the size difference
/// between the variants costs nothing worth a box.
#[derive(clap::Subcommand, Debug)]
#[allow(clippy::large_enum_variant)]
pub enum BenchCommand {
    /// Start mock engines and compare routers side by side on the same requests.
    Compare(CompareArgs),
    /// Routers under a changing fleet (steady, worker added, restart, cache reset,
    /// bypass traffic, Zipf tenants, overload): one table and plot per scenario.
    Scenarios(ScenariosArgs),
    /// The fault suite: steady streaming load through kvgate while engines are killed
    /// and restarted, caches reset, event sockets paused and fed garbage, clients cancel
    /// and send oversized bodies, then a SIGTERM; fails unless every request ended
    /// cleanly and no booking is left.
    Chaos(ChaosArgs),
}

/// `kvgate bench chaos`.
#[derive(clap::Args, Debug)]
pub struct ChaosArgs {
    /// Seconds of load (the SIGTERM phase follows).
    #[arg(long, default_value_t = 60.0)]
    pub duration: f64,
    /// Clients in the closed loop.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Seconds between faults (kinds cycle: garbage events, event pause, cache reset,
    /// kill and restart).
    #[arg(long, default_value_t = 5.0)]
    pub fault_every: f64,
    /// Mock engines.
    #[arg(long, default_value_t = 3)]
    pub engines: usize,
    /// Simulated-time speedup of the engines.
    #[arg(long, default_value_t = 10.0)]
    pub engine_speedup: f64,
    /// kvgate policy.
    #[arg(long, default_value = "kv_aware")]
    pub policy: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Per-request timeout in seconds (a request without an end by then is a silent
    /// failure).
    #[arg(long, default_value_t = 60.0)]
    pub request_timeout: f64,
    /// Extra argument for `kvgate serve` (repeatable).
    #[arg(long, allow_hyphen_values = true)]
    pub kvgate_arg: Vec<String>,
    /// The kvgate binary (default: this executable, or `kvgate` on PATH).
    #[arg(long)]
    pub kvgate_bin: Option<PathBuf>,
    /// Output folder (chaos.md, chaos.json, logs/).
    #[arg(long, default_value = "bench-out/chaos")]
    pub out_dir: PathBuf,
}

/// Which scenarios, and the load each row gets: shared by `kvgate bench scenarios` and
/// `kvgate simulate scenarios`.
#[derive(clap::Args, Debug, Clone)]
pub struct ScenarioLoadArgs {
    /// Scenarios to run, comma-separated (default: all, in suite order).
    #[arg(long, value_enum, value_delimiter = ',')]
    pub scenarios: Vec<ScenarioKind>,
    /// Seconds of routed load per row.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Requests in flight through the router (closed loop).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Seconds into the load at which the fleet changes.
    #[arg(long, default_value_t = 8.0)]
    pub change_at: f64,
    /// KV blocks per engine for every scenario (default: each scenario's own).
    #[arg(long)]
    pub num_blocks: Option<u32>,
    /// Seed for the tenants' prompts and popularity draws (simulated: also the engines
    /// and the policies).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

impl ScenarioLoadArgs {
    /// The scenarios asked for, all of them by default.
    pub fn kinds(&self) -> Vec<ScenarioKind> {
        if self.scenarios.is_empty() {
            ScenarioKind::ALL.to_vec()
        } else {
            self.scenarios.clone()
        }
    }
}

/// `kvgate bench scenarios`.
#[derive(clap::Args, Debug)]
pub struct ScenariosArgs {
    #[command(flatten)]
    pub load: ScenarioLoadArgs,
    /// Routers, comma-separated, as for `bench compare` (default: kv_aware,
    /// prefix_affinity, round_robin and the peer routers, skipped when not installed).
    #[arg(long, value_delimiter = ',')]
    pub routers: Vec<String>,
    /// Simulated-time speedup of the engines' latency model.
    #[arg(long, default_value_t = 1.0)]
    pub engine_speedup: f64,
    /// Extra argument for `kvgate serve` (repeatable).
    #[arg(long, allow_hyphen_values = true)]
    pub kvgate_arg: Vec<String>,
    /// The kvgate binary (default: this executable, or `kvgate` on PATH).
    #[arg(long)]
    pub kvgate_bin: Option<PathBuf>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 120.0)]
    pub request_timeout: f64,
    /// Output folder (scenarios.md, scenarios.json, <scenario>-share.svg, and logs/ with
    /// each row's process logs and requests.jsonl: every request's tenant, cached tokens
    /// and responder).
    #[arg(long, default_value = "bench-out/scenarios")]
    pub out_dir: PathBuf,
}

/// Simulated fleet options shared by `compare` and `demo`.
#[derive(clap::Args, Debug, Clone)]
pub struct FleetArgs {
    /// Number of mock engines.
    #[arg(long, default_value_t = 4)]
    pub engines: usize,
    /// KV block size of the engines (tokens).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV blocks per engine (default: 8192 for compare; 1024 for the demo, so one
    /// engine holds only a few tenants' system prompts and placement matters).
    #[arg(long)]
    pub num_blocks: Option<u32>,
    /// Simulated-time speedup of the engines' latency model.
    #[arg(long, default_value_t = 1.0)]
    pub engine_speedup: f64,
    /// Extra argument for every engine (repeatable), e.g. --engine-arg=--max-num-seqs=64.
    #[arg(long, allow_hyphen_values = true)]
    pub engine_arg: Vec<String>,
    /// Extra argument for `kvgate serve` (repeatable).
    #[arg(long, allow_hyphen_values = true)]
    pub kvgate_arg: Vec<String>,
    /// The kvgate binary (default: this executable, or `kvgate` on PATH).
    #[arg(long)]
    pub kvgate_bin: Option<PathBuf>,
    /// Seconds an engine or router may take to become ready.
    #[arg(long, default_value_t = 60.0)]
    pub startup_timeout: f64,
}

impl FleetArgs {
    fn engine_config(&self, seed: u64, default_blocks: u32) -> anyhow::Result<EngineConfig> {
        if self.engines == 0 {
            bail!("--engines must be at least 1");
        }
        Ok(EngineConfig {
            kvgate_bin: resolve_kvgate_bin(self.kvgate_bin.as_deref())?,
            engines: self.engines,
            block_size: self.block_size,
            num_blocks: self.num_blocks.unwrap_or(default_blocks),
            speedup: self.engine_speedup,
            seed,
            extra_args: self.engine_arg.clone(),
            startup_timeout: self.startup_timeout(),
            pd: None,
        })
    }

    fn startup_timeout(&self) -> Duration {
        Duration::try_from_secs_f64(self.startup_timeout).unwrap_or(Duration::from_secs(60))
    }
}

/// `kvgate bench compare`.
#[derive(clap::Args, Debug)]
pub struct CompareArgs {
    /// What to replay.
    #[command(flatten)]
    pub workload: WorkloadArgs,
    /// How to replay.
    #[command(flatten)]
    pub replay: ReplayArgs,
    /// The simulated fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Routers, comma-separated: kvgate policies (kv_aware, round_robin, ...) and peers
    /// (vllm-router:kv_aware, vllm-router:cache_aware, sglang-router:cache_aware).
    /// Default: every kvgate policy and the three peer rows (skipped when not installed).
    /// A row may carry its own options: `kv_aware@overlap-weight=2@locality-weight=8`
    /// appends `--overlap-weight 2 --locality-weight 8` to that row's command line only;
    /// `kv_aware@replicas=3` starts three kvgate replicas that follow each other's load
    /// and spreads the requests over them (`@sync=off`: unaware of each other;
    /// `@rollout`: restarted one at a time during the replay, as a rolling update);
    /// `kv_aware@pd=vllm` and `vllm-router:cache_aware@pd=vllm` split the row's engines
    /// into prefill and decode engines (`@pd=sglang`: SGLang's protocol; `@prefill=P`
    /// of them prefill, default half) and run the router in its disaggregated mode.
    #[arg(long, value_delimiter = ',')]
    pub routers: Vec<String>,
    /// Row the ratio column compares against.
    #[arg(long, default_value = "round_robin")]
    pub baseline: String,
    /// Output folder (report.html, compare.md, compare.json, ttft.svg, ttft-cdf.svg,
    /// reports/, logs/).
    #[arg(long, default_value = "bench-out")]
    pub out_dir: PathBuf,
}

/// `kvgate demo`: 4 mock engines + kvgate, round_robin vs kv_aware on a shared prefix.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// The simulated fleet.
    #[command(flatten)]
    pub fleet: FleetArgs,
    /// Requests in the shared-prefix workload.
    #[arg(long, default_value_t = 240)]
    pub requests: usize,
    /// Arrival rate (requests/s).
    #[arg(long, default_value_t = 8.0)]
    pub rate: f64,
    /// Shared system-prompt tokens.
    #[arg(long, default_value_t = 4096)]
    pub prefix_tokens: usize,
    /// Distinct suffix tokens per request.
    #[arg(long, default_value_t = 64)]
    pub suffix_tokens: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 32)]
    pub output_tokens: u32,
    /// Distinct system prompts (one per "tenant"); several make placement matter.
    #[arg(long, default_value_t = 8)]
    pub groups: usize,
    /// Policies to compare.
    #[arg(long, value_delimiter = ',', default_value = "round_robin,kv_aware")]
    pub routers: Vec<String>,
    /// Model name.
    #[arg(long, default_value = "mock-model")]
    pub model: String,
    /// Output folder (default: a new folder under the system temp dir).
    #[arg(long)]
    pub out_dir: Option<PathBuf>,
    /// Do not draw progress bars.
    #[arg(long)]
    pub no_progress: bool,
}

/// The kvgate binary: the flag, else this executable when it is `kvgate`, else PATH.
pub fn resolve_kvgate_bin(flag: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = flag {
        if !p.is_file() {
            bail!("--kvgate-bin {} is not a file", p.display());
        }
        return Ok(p.to_path_buf());
    }
    if let Ok(exe) = std::env::current_exe() {
        let is_kvgate = exe
            .file_stem()
            .and_then(|s| s.to_str())
            .is_some_and(|s| s == "kvgate");
        if is_kvgate {
            return Ok(exe);
        }
    }
    which("kvgate").context("cannot find the kvgate binary: pass --kvgate-bin PATH")
}

fn parse_routers(list: &[String]) -> anyhow::Result<Vec<RouterSpec>> {
    if list.is_empty() {
        return Ok(RouterSpec::default_lineup());
    }
    list.iter()
        .filter(|s| !s.trim().is_empty())
        .map(|s| RouterSpec::parse(s))
        .collect()
}

/// Run a future, or stop it (dropping it kills every child process) on Ctrl-C.
async fn interruptible<T>(
    fut: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<T> {
    tokio::select! {
        r = fut => r,
        _ = tokio::signal::ctrl_c() => bail!("interrupted"),
    }
}

/// Entry point of `kvgate bench`.
pub async fn run_bench(args: BenchArgs) -> anyhow::Result<()> {
    match args.command {
        Some(BenchCommand::Compare(c)) => interruptible(run_compare(c)).await,
        Some(BenchCommand::Scenarios(a)) => interruptible(run_scenario_suite(a)).await,
        Some(BenchCommand::Chaos(a)) => interruptible(run_chaos_suite(a)).await,
        None => {
            interruptible(run_single(
                args.target,
                args.workload,
                args.replay,
                args.out,
            ))
            .await
        }
    }
}

async fn run_single(
    target: Option<String>,
    workload: WorkloadArgs,
    replay: ReplayArgs,
    out: Option<PathBuf>,
) -> anyhow::Result<()> {
    let target = target.context("--target URL is required (or use `kvgate bench compare`)")?;
    let (requests, desc) = workload.build()?;
    let sum = summarize(&requests);
    eprintln!(
        "kvgate bench: {desc}: {} requests, {} prompt tokens, {} output tokens over {:.1} s (before speedup {})",
        sum.requests,
        sum.prompt_tokens,
        sum.output_tokens,
        sum.span.as_secs_f64(),
        replay.speedup
    );
    let client = BenchClient::new(&target, &replay.model, replay.timeout()?)?
        .with_prompt_format(replay.prompt_format);
    let result = runner::run(&client, requests, &replay.run_config(&target)?).await;
    let report = Report::from_run(&target, &result);
    println!("{}", report.render_table());
    if let Some(path) = out {
        std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("report written to {}", path.display());
    }
    Ok(())
}

async fn run_compare(args: CompareArgs) -> anyhow::Result<()> {
    let (requests, desc) = args.workload.build()?;
    let cfg = CompareConfig {
        engine: args
            .fleet
            .engine_config(args.workload.seed, COMPARE_NUM_BLOCKS)?,
        routers: parse_routers(&args.routers)?,
        model: args.replay.model.clone(),
        out_dir: args.out_dir.clone(),
        run: args.replay.run_config("")?,
        request_timeout: args.replay.timeout()?,
        router_startup_timeout: args.fleet.startup_timeout(),
        kvgate_extra_args: args.fleet.kvgate_arg.clone(),
        workload_description: desc,
        baseline: args.baseline.clone(),
    };
    let summary = compare::compare(&cfg, &requests).await?;
    println!("{}", render_markdown(&summary, &cfg.baseline));
    eprintln!(
        "wrote {}/report.html (tables and plots in one page), compare.md, compare.json, ttft.svg, ttft-cdf.svg",
        cfg.out_dir.display()
    );
    Ok(())
}

/// A flag's value as a positive duration in seconds.
fn positive_secs(v: f64, flag: &str) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(v)
        .ok()
        .filter(|d| !d.is_zero())
        .with_context(|| format!("{flag} must be a positive number of seconds"))
}

async fn run_scenario_suite(args: ScenariosArgs) -> anyhow::Result<()> {
    let routers = if args.routers.is_empty() {
        scenario::default_routers()
    } else {
        parse_routers(&args.routers)?
    };
    let scenarios = args.load.kinds();
    let cfg = ScenarioConfig {
        engine: EngineConfig {
            kvgate_bin: resolve_kvgate_bin(args.kvgate_bin.as_deref())?,
            engines: 2,
            block_size: 16,
            num_blocks: 0,
            speedup: args.engine_speedup,
            seed: args.load.seed,
            extra_args: Vec::new(),
            startup_timeout: Duration::from_secs(60),
            pd: None,
        },
        num_blocks_override: args.load.num_blocks,
        routers,
        model: "mock-model".into(),
        out_dir: args.out_dir.clone(),
        duration: positive_secs(args.load.duration, "--duration")?,
        concurrency: args.load.concurrency.max(1),
        change_at: Duration::try_from_secs_f64(args.load.change_at)
            .context("--change-at must be a number of seconds")?,
        request_timeout: positive_secs(args.request_timeout, "--request-timeout")?,
        router_startup_timeout: Duration::from_secs(60),
        kvgate_extra_args: args.kvgate_arg.clone(),
    };
    let summaries = scenario::run_scenarios(&cfg, &scenarios).await?;
    println!("{}", scenario::render_markdown(&summaries));
    eprintln!(
        "wrote {}/scenarios.md, scenarios.json and one <scenario>-share.svg per scenario",
        cfg.out_dir.display()
    );
    Ok(())
}

async fn run_chaos_suite(args: ChaosArgs) -> anyhow::Result<()> {
    let cfg = crate::chaos::ChaosConfig {
        kvgate_bin: resolve_kvgate_bin(args.kvgate_bin.as_deref())?,
        engines: args.engines,
        duration: positive_secs(args.duration, "--duration")?,
        concurrency: args.concurrency.max(1),
        fault_every: positive_secs(args.fault_every, "--fault-every")?,
        engine_speedup: args.engine_speedup,
        seed: args.seed,
        policy: args.policy.clone(),
        request_timeout: positive_secs(args.request_timeout, "--request-timeout")?,
        out_dir: args.out_dir.clone(),
        kvgate_extra_args: args.kvgate_arg.clone(),
    };
    let summary = crate::chaos::run_chaos(&cfg).await?;
    println!("{}", crate::chaos::render_markdown(&summary));
    eprintln!("wrote {}/chaos.md and chaos.json", cfg.out_dir.display());
    anyhow::ensure!(
        summary.passed(),
        "the fault suite failed: {} request(s) failed without a clean error, {} booking(s) left",
        summary.silent_failures(),
        summary
            .bookings_left
            .map_or_else(|| "unknown".into(), |b| b.to_string())
    );
    Ok(())
}

/// Entry point of `kvgate demo`.
pub async fn run_demo(args: DemoArgs) -> anyhow::Result<()> {
    interruptible(demo(args)).await
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let workload = WorkloadConfig {
        kind: WorkloadKind::SharedPrefix,
        requests: args.requests,
        rate: args.rate,
        prefix_tokens: args.prefix_tokens,
        suffix_tokens: args.suffix_tokens,
        output_tokens: args.output_tokens,
        groups: args.groups,
        users: 64,
        ..WorkloadConfig::default()
    };
    let requests = workload.generate();
    let out_dir = args.out_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("kvgate-demo-{}", std::process::id()))
    });
    let desc = format!(
        "shared-prefix demo ({} tenants × {}-token system prompt + {}-token question, {} req at {}/s)",
        args.groups, args.prefix_tokens, args.suffix_tokens, args.requests, args.rate
    );
    let cfg = CompareConfig {
        engine: args.fleet.engine_config(0, DEMO_NUM_BLOCKS)?,
        routers: parse_routers(&args.routers)?,
        model: args.model.clone(),
        out_dir: out_dir.clone(),
        run: RunConfig {
            speedup: 1.0,
            concurrency: None,
            progress: !args.no_progress,
            label: String::new(),
        },
        request_timeout: Duration::from_secs(120),
        router_startup_timeout: args.fleet.startup_timeout(),
        kvgate_extra_args: args.fleet.kvgate_arg.clone(),
        workload_description: desc,
        baseline: "round_robin".into(),
    };
    eprintln!(
        "kvgate demo: {} mock engines (batch limits: `kvgate mock-engine`'s defaults, vLLM's on an H100, unless --engine-arg sets them), {} requests per router; output in {}",
        cfg.engine.engines,
        requests.len(),
        out_dir.display()
    );
    let summary = compare::compare(&cfg, &requests).await?;
    println!("{}", render_markdown(&summary, &cfg.baseline));
    println!(
        "TTFT p90 vs round_robin: round_robin's p90 divided by the row's (above 1: faster). \
         Prefix hit: cached over prompt tokens as the engines reported. \
         Predicted / reported cached: what kvgate expected the engines to serve from cache over what they reported (1 = honest; n/a: the policy does not read prompts). \
         Goodput: requests answered within their TTFT objective per second (n/a: none had one). \
         TTFT prediction error: kvgate's predicted against the observed TTFT, |p - o| / o, median / p90. \
         Spread: the busiest engine's requests over the mean (1 = even)."
    );
    println!(
        "Results with plots: {}/report.html (also compare.md, compare.json, ttft.svg, ttft-cdf.svg, logs/)",
        out_dir.display()
    );
    let failed: Vec<&str> = summary
        .rows
        .iter()
        .filter(|r| r.status == "failed")
        .map(|r| r.label.as_str())
        .collect();
    if !failed.is_empty() {
        bail!(
            "demo rows failed: {} (logs in {}/logs)",
            failed.join(", "),
            out_dir.display()
        );
    }
    // The demo is the front door: a request that errors means something is broken.
    let with_errors: Vec<String> = summary
        .rows
        .iter()
        .filter_map(|r| {
            let errors = r.report.as_ref()?.errors;
            (errors > 0).then(|| format!("{} ({errors} errors)", r.label))
        })
        .collect();
    if !with_errors.is_empty() {
        bail!(
            "demo requests failed: {} (logs in {}/logs)",
            with_errors.join(", "),
            out_dir.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Top {
        #[command(subcommand)]
        cmd: Cmd,
    }

    #[derive(clap::Subcommand)]
    #[allow(clippy::large_enum_variant)]
    enum Cmd {
        Bench(BenchArgs),
        Demo(DemoArgs),
    }

    #[test]
    fn parses_single_bench() {
        let t = Top::try_parse_from([
            "kvgate",
            "bench",
            "--target",
            "http://x:1",
            "--workload",
            "shared-prefix",
            "--speedup",
            "2",
            "--max-requests",
            "5",
            "--concurrency",
            "3",
            "--out",
            "r.json",
        ])
        .unwrap();
        let Cmd::Bench(b) = t.cmd else { panic!() };
        assert!(b.command.is_none());
        assert_eq!(b.target.as_deref(), Some("http://x:1"));
        assert_eq!(b.replay.concurrency, Some(3));
        let (reqs, _) = b.workload.build().unwrap();
        assert_eq!(reqs.len(), 5);
    }

    #[test]
    fn parses_compare_and_demo() {
        let t = Top::try_parse_from([
            "kvgate",
            "bench",
            "compare",
            "--trace",
            "t.jsonl",
            "--routers",
            "round_robin,kv_aware,vllm-router:kv_aware",
            "--engines",
            "2",
            "--engine-arg=--foo",
            "--out-dir",
            "o",
        ])
        .unwrap();
        let Cmd::Bench(b) = t.cmd else { panic!() };
        let Some(BenchCommand::Compare(c)) = b.command else {
            panic!()
        };
        assert_eq!(parse_routers(&c.routers).unwrap().len(), 3);
        assert_eq!(c.fleet.engine_arg, vec!["--foo"]);
        let t = Top::try_parse_from(["kvgate", "demo", "--requests", "10"]).unwrap();
        let Cmd::Demo(d) = t.cmd else { panic!() };
        assert_eq!(d.routers, vec!["round_robin", "kv_aware"]);
    }

    #[test]
    fn trace_and_workload_conflict_and_one_is_required() {
        assert!(Top::try_parse_from([
            "kvgate",
            "bench",
            "--trace",
            "a",
            "--workload",
            "no-sharing"
        ])
        .is_err());
        let t = Top::try_parse_from(["kvgate", "bench", "--target", "http://x"]).unwrap();
        let Cmd::Bench(b) = t.cmd else { panic!() };
        assert!(b.workload.build().is_err());
    }

    #[test]
    fn builds_trace_window() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../traces/mooncake/conversation_trace.jsonl");
        let t = Top::try_parse_from([
            "kvgate".into(),
            "bench".into(),
            "--target".into(),
            "http://x".into(),
            "--trace".into(),
            path.display().to_string(),
            "--start".into(),
            "10".into(),
            "--max-requests".into(),
            "20".into(),
            "--block-tokens".into(),
            "32".into(),
        ])
        .unwrap();
        let Cmd::Bench(b) = t.cmd else { panic!() };
        let (reqs, desc) = b.workload.build().unwrap();
        assert_eq!(reqs.len(), 20);
        assert!(desc.contains("[10, 30)"), "{desc}");
        assert_eq!(reqs[0].arrival, Duration::ZERO);
    }
}
