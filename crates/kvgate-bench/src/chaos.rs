//! `kvgate bench chaos`: the fault suite. A mock fleet and `kvgate serve` under steady
//! streaming load while faults are injected on a schedule; every request is judged by
//! how it ended, and the gateway's books and memory are checked at the end.
//!
//! Owns the fault schedule (cycling, one fault per `--fault-every`: malformed KV event
//! frames, a KV event socket pause longer than the engine's replay buffer, a prefix
//! cache reset, an engine SIGKILL and restart), the client mix (plain streams, clients
//! that cancel after their first chunk, bodies over the gateway's limit), the final
//! gateway SIGTERM with streams running, and the report. A request ends one of these
//! ways:
//! * `completed`: a 2xx stream ending in `data: [DONE]`;
//! * `clean error`: an OpenAI-style JSON error (`{"error":{"message","type","code"}}`)
//!   with a non-2xx status, or a 2xx stream whose last event is such an error;
//! * `silent failure` (target 0): anything else once the gateway accepted the
//!   connection: a reset or cut stream, a stream without `[DONE]` or an error event, a
//!   non-JSON error, no answer within the request timeout;
//! * `not accepted`: the connection was refused (after the gateway exited);
//! * `cancelled`: the client left on purpose.
//!
//! It must not contain routing logic: it talks to the gateway and engines over HTTP,
//! reads `/metrics` and `/proc`, and sends signals.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use poison_free::Mutex;
use serde::Serialize;
use serde_json::Value;

use crate::compare::parse_counter_sum;
use crate::fleet::{EngineConfig, Fleet};
use crate::process::ManagedChild;
use crate::rng::SplitMix64;
use crate::routers::{self, RouterContext, RouterSpec, Started};
use crate::sse::SseParser;

/// A `std::sync::Mutex` that ignores poisoning (a panicking client task must not hide
/// the others' results).
mod poison_free {
    pub struct Mutex<T>(std::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub fn new(v: T) -> Self {
            Self(std::sync::Mutex::new(v))
        }

        pub fn lock(&self) -> std::sync::MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|p| p.into_inner())
        }
    }
}

/// The gateway's body limit in the suite; oversized clients send more.
const MAX_BODY_BYTES: usize = 1 << 20;
/// Engines keep this many event batches for replay, so a pause outlasts the buffer.
const REPLAY_BUFFER: usize = 32;
/// How long a KV event pause lasts.
const EVENT_PAUSE: Duration = Duration::from_secs(3);
/// How long a killed engine stays down before it is restarted.
const DOWN_FOR: Duration = Duration::from_secs(2);
/// The gateway's shutdown grace period in the suite (seconds).
const GRACE_SECS: u64 = 1;
/// Streams running when the gateway gets SIGTERM.
const STREAMS_AT_SIGTERM: usize = 8;

/// What to run.
#[derive(Clone, Debug)]
pub struct ChaosConfig {
    pub kvgate_bin: PathBuf,
    pub engines: usize,
    /// Load duration (the SIGTERM phase comes after it).
    pub duration: Duration,
    /// Clients in the closed loop.
    pub concurrency: usize,
    /// One fault per interval, cycling through the kinds.
    pub fault_every: Duration,
    pub engine_speedup: f64,
    pub seed: u64,
    /// Routing policy of the gateway.
    pub policy: String,
    pub request_timeout: Duration,
    pub out_dir: PathBuf,
    pub kvgate_extra_args: Vec<String>,
}

/// The kinds of fault, in schedule order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultKind {
    GarbageEvents,
    EventPause,
    CacheReset,
    KillRestart,
}

impl FaultKind {
    const CYCLE: [FaultKind; 4] = [
        FaultKind::GarbageEvents,
        FaultKind::EventPause,
        FaultKind::CacheReset,
        FaultKind::KillRestart,
    ];

    fn describe(self) -> &'static str {
        match self {
            FaultKind::GarbageEvents => "30 malformed KV event frames",
            FaultKind::EventPause => {
                "KV event socket paused 3 s (longer than the 32-batch replay buffer)"
            }
            FaultKind::CacheReset => "prefix cache reset, running requests preempted",
            FaultKind::KillRestart => "engine SIGKILL, restarted 2 s later with an empty cache",
        }
    }
}

/// One injected fault.
#[derive(Clone, Debug, Serialize)]
pub struct Fault {
    pub kind: FaultKind,
    pub engine: usize,
    /// Seconds since the load started.
    pub at_s: f64,
    /// Kill/restart: seconds from the kill until the gateway reported the worker
    /// unhealthy (it routes around it from then on; attempts that hit it before fail
    /// over without the client noticing).
    pub marked_down_after_s: Option<f64>,
    /// Kill/restart: seconds from the restarted engine being ready until a request it
    /// served completed through the gateway.
    pub used_again_after_s: Option<f64>,
    pub error: Option<String>,
}

/// How requests ended.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Tally {
    pub sent: u64,
    pub accepted: u64,
    pub completed: u64,
    pub clean_errors: BTreeMap<String, u64>,
    pub silent_failures: u64,
    /// Up to 20 silent failures, described.
    pub silent_examples: Vec<String>,
    pub not_accepted: u64,
    pub cancelled: u64,
    /// Oversized bodies answered 413 `request_too_large`, out of those sent.
    pub oversized_413: u64,
    pub oversized_sent: u64,
}

impl Tally {
    fn clean_total(&self) -> u64 {
        self.clean_errors.values().sum()
    }

    fn record(&mut self, v: &Verdict, oversized: bool) {
        self.sent += 1;
        if oversized {
            self.oversized_sent += 1;
        }
        match v {
            Verdict::NotAccepted => {
                self.not_accepted += 1;
                return;
            }
            Verdict::Completed => self.completed += 1,
            Verdict::CleanError(code) => {
                if oversized && code == "request_too_large" {
                    self.oversized_413 += 1;
                }
                *self.clean_errors.entry(code.clone()).or_default() += 1;
            }
            Verdict::Silent(why) => {
                self.silent_failures += 1;
                if self.silent_examples.len() < 20 {
                    self.silent_examples.push(why.clone());
                }
            }
            Verdict::Cancelled => self.cancelled += 1,
        }
        self.accepted += 1;
    }
}

/// The suite's result.
#[derive(Clone, Debug, Serialize)]
pub struct ChaosSummary {
    pub duration_s: f64,
    pub concurrency: usize,
    pub engines: usize,
    pub policy: String,
    pub tally: Tally,
    pub faults: Vec<Fault>,
    /// Bookings in the gateway's ledger after the load drained (target 0).
    pub bookings_left: Option<f64>,
    /// Requests the gateway counted in flight on workers after the load drained.
    pub worker_in_flight_left: Option<f64>,
    pub rss_start_mib: Option<u64>,
    pub rss_peak_mib: Option<u64>,
    pub rss_end_mib: Option<u64>,
    /// `kvgate_kv_events_dropped_total` by reason, over the run.
    pub events_dropped: BTreeMap<String, f64>,
    pub index_purges: Option<f64>,
    pub event_gaps: Option<f64>,
    /// The SIGTERM phase: streams running at SIGTERM and how they ended.
    pub sigterm: Tally,
    /// Seconds from SIGTERM until the gateway process exited.
    pub sigterm_exit_s: Option<f64>,
}

impl ChaosSummary {
    /// Silent failures over the whole run (load and SIGTERM phase).
    pub fn silent_failures(&self) -> u64 {
        self.tally.silent_failures + self.sigterm.silent_failures
    }

    /// The suite's targets: no silent failure, no booking left.
    pub fn passed(&self) -> bool {
        self.silent_failures() == 0 && self.bookings_left == Some(0.0)
    }
}

/// How one request ended.
#[derive(Clone, Debug, PartialEq)]
enum Verdict {
    Completed,
    CleanError(String),
    Silent(String),
    NotAccepted,
    Cancelled,
}

/// What a client does with its request.
#[derive(Clone, Copy, Debug, PartialEq)]
enum ClientKind {
    Plain,
    /// Leaves after the first chunk.
    Cancel,
    /// Sends a body over the gateway's limit.
    Oversized,
}

/// Runs the suite.
pub async fn run_chaos(cfg: &ChaosConfig) -> anyhow::Result<ChaosSummary> {
    let log_dir = cfg.out_dir.join("logs");
    let engine_cfg = EngineConfig {
        kvgate_bin: cfg.kvgate_bin.clone(),
        engines: cfg.engines.max(2),
        block_size: 16,
        num_blocks: 4096,
        speedup: cfg.engine_speedup,
        seed: cfg.seed,
        extra_args: vec!["--replay-buffer".into(), REPLAY_BUFFER.to_string()],
        startup_timeout: Duration::from_secs(60),
        pd: None,
    };
    let mut fleet = Fleet::start(&engine_cfg, &log_dir)
        .await
        .context("starting the mock-engine fleet")?;
    let addrs = fleet.addrs().to_vec();
    let mut extra = vec![
        "--max-body-bytes".to_string(),
        MAX_BODY_BYTES.to_string(),
        "--shutdown-grace-secs".into(),
        GRACE_SECS.to_string(),
        "--health-interval-ms".into(),
        "500".into(),
        "--health-timeout-ms".into(),
        "500".into(),
        "--failure-threshold".into(),
        "2".into(),
        "--breaker-open-ms".into(),
        "1000".into(),
    ];
    extra.extend(cfg.kvgate_extra_args.iter().cloned());
    let ctx = RouterContext {
        kvgate_bin: cfg.kvgate_bin.clone(),
        model: "mock-model".into(),
        block_size: 16,
        log_dir: log_dir.clone(),
        startup_timeout: Duration::from_secs(60),
        kvgate_extra_args: extra,
    };
    let spec = RouterSpec::parse(&cfg.policy)?;
    anyhow::ensure!(
        matches!(spec, RouterSpec::Kvgate(_)),
        "the fault suite runs kvgate policies only, not {}",
        spec.label()
    );
    let (gateway, url) = match routers::start(&spec, &ctx, &addrs).await? {
        Started::Running {
            child, url, more, ..
        } => {
            anyhow::ensure!(more.is_empty(), "the fault suite runs one kvgate replica");
            (child, url)
        }
        Started::Skipped(why) => anyhow::bail!("kvgate did not start: {why}"),
    };
    let gateway_pid = gateway.pid();
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(cfg.concurrency.max(1) * 2)
        .build()?;
    let control = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()?;
    let rss_start = gateway_pid.and_then(|p| proc_status_mib(p, "VmRSS"));

    // Health of each worker as the gateway reports it, sampled every 100 ms.
    let start = Instant::now();
    let deadline = start + cfg.duration;
    let health_log: Arc<Mutex<Vec<(f64, String, bool)>>> = Arc::new(Mutex::new(Vec::new()));
    let health_task = tokio::spawn(sample_health(
        control.clone(),
        url.clone(),
        health_log.clone(),
        start,
        deadline,
    ));
    // Completions by serving worker, with their start time.
    let served: Arc<Mutex<Vec<(f64, String)>>> = Arc::new(Mutex::new(Vec::new()));
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next = Arc::new(AtomicU64::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..cfg.concurrency.max(1) {
        let (http, url, tally, next, served) = (
            http.clone(),
            url.clone(),
            tally.clone(),
            next.clone(),
            served.clone(),
        );
        let (seed, timeout) = (cfg.seed, cfg.request_timeout);
        clients.spawn(async move {
            while Instant::now() < deadline {
                let k = next.fetch_add(1, Ordering::Relaxed);
                let kind = client_kind(seed, k);
                let body = request_body(seed, k, kind, 16);
                let t = start.elapsed().as_secs_f64();
                let (verdict, worker) = one_request(&http, &url, body, kind, timeout, None).await;
                if let (Verdict::Completed, Some(w)) = (&verdict, worker) {
                    served.lock().push((t, w));
                }
                tally.lock().record(&verdict, kind == ClientKind::Oversized);
            }
        });
    }
    let faults = inject_faults(cfg, &mut fleet, &control, start, deadline).await;
    while clients.join_next().await.is_some() {}
    let _ = health_task.await;

    // The books once the load has drained.
    let mut bookings_left = None;
    let mut in_flight_left = None;
    let drain_deadline = Instant::now() + Duration::from_secs(10);
    let mut metrics_text = String::new();
    while Instant::now() < drain_deadline {
        if let Ok(text) = get_text(&control, &format!("{url}/metrics")).await {
            bookings_left = parse_counter_sum(&text, "kvgate_ledger_active_bookings");
            in_flight_left = parse_counter_sum(&text, "kvgate_worker_in_flight");
            metrics_text = text;
            if bookings_left == Some(0.0) && in_flight_left.is_none_or(|v| v == 0.0) {
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let rss_peak = gateway_pid.and_then(|p| proc_status_mib(p, "VmHWM"));
    let rss_end = gateway_pid.and_then(|p| proc_status_mib(p, "VmRSS"));
    let events_dropped = dropped_by_reason(&metrics_text);
    let index_purges = parse_counter_sum(&metrics_text, "kvgate_kv_events_purges_total");
    let event_gaps = parse_counter_sum(&metrics_text, "kvgate_kv_events_gaps_total");

    let faults = time_kill_recovery(faults, &health_log.lock(), &served.lock(), &addrs);
    let (sigterm, sigterm_exit_s) = sigterm_phase(cfg, gateway, &http, &url).await;
    fleet.shutdown().await;
    let summary = ChaosSummary {
        duration_s: cfg.duration.as_secs_f64(),
        concurrency: cfg.concurrency,
        engines: engine_cfg.engines,
        policy: cfg.policy.clone(),
        tally: tally.lock().clone(),
        faults,
        bookings_left,
        worker_in_flight_left: in_flight_left,
        rss_start_mib: rss_start,
        rss_peak_mib: rss_peak,
        rss_end_mib: rss_end,
        events_dropped,
        index_purges,
        event_gaps,
        sigterm,
        sigterm_exit_s,
    };
    std::fs::create_dir_all(&cfg.out_dir)?;
    std::fs::write(
        cfg.out_dir.join("chaos.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    std::fs::write(cfg.out_dir.join("chaos.md"), render_markdown(&summary))?;
    Ok(summary)
}

/// 2% of clients send an oversized body, 8% cancel after their first chunk.
fn client_kind(seed: u64, k: u64) -> ClientKind {
    match SplitMix64::keyed(seed ^ 0xC4A0_5000, k).below(100) {
        0..=1 => ClientKind::Oversized,
        2..=9 => ClientKind::Cancel,
        _ => ClientKind::Plain,
    }
}

/// A streaming completion: one of 8 tenants' 256-token prompts plus 32 tokens of its
/// own, `max_tokens` output. Oversized bodies pad the prompt past the body limit.
fn request_body(seed: u64, k: u64, kind: ClientKind, max_tokens: u32) -> Vec<u8> {
    let mut rng = SplitMix64::keyed(seed ^ 0x7E4A, k);
    let tenant = rng.below(8);
    let mut tenant_rng = SplitMix64::keyed(seed ^ 0x5157, tenant);
    let mut prompt: Vec<u32> = (0..256)
        .map(|_| 100 + tenant_rng.below(30_000) as u32)
        .collect();
    prompt.extend((0..32).map(|_| 100 + rng.below(30_000) as u32));
    if kind == ClientKind::Oversized {
        // About 6 bytes per id: past the 1 MiB limit.
        prompt.extend((0..(MAX_BODY_BYTES / 5) as u32).map(|i| 100 + i % 30_000));
    }
    let body = serde_json::json!({
        "model": "mock-model",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Sends one request and judges how it ended; returns the serving worker too.
/// `first_chunk` (if any) is told when the first chunk of a stream arrives.
async fn one_request(
    http: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    kind: ClientKind,
    timeout: Duration,
    first_chunk: Option<&tokio::sync::mpsc::Sender<()>>,
) -> (Verdict, Option<String>) {
    let fut = async {
        let resp = match http
            .post(format!("{url}/v1/completions"))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
        {
            Ok(r) => r,
            Err(e) if e.is_connect() => return (Verdict::NotAccepted, None),
            Err(e) => {
                return (
                    Verdict::Silent(format!("no response head: {}", chain(&e))),
                    None,
                )
            }
        };
        let worker = resp
            .headers()
            .get(crate::client::WORKER_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return (judge_error_body(status.as_u16(), &text), worker);
        }
        let mut stream = resp.bytes_stream();
        let mut parser = SseParser::new();
        let mut done = false;
        let mut error_code: Option<String> = None;
        let mut events_after_error = 0u32;
        let mut first_chunk = first_chunk;
        while let Some(chunk) = stream.next().await {
            let bytes = match chunk {
                Ok(b) => b,
                Err(e) => {
                    return (
                        Verdict::Silent(format!(
                            "stream cut (error event before: {error_code:?}): {}",
                            chain(&e)
                        )),
                        worker,
                    )
                }
            };
            if kind == ClientKind::Cancel {
                return (Verdict::Cancelled, worker);
            }
            if let Some(tx) = first_chunk.take() {
                let _ = tx.send(()).await;
            }
            for ev in parser.push(&bytes) {
                if error_code.is_some() {
                    events_after_error += 1;
                }
                let ev = ev.trim();
                if ev == "[DONE]" {
                    done = true;
                } else if let Some(code) = error_event_code(ev) {
                    error_code = Some(code);
                }
            }
        }
        for ev in parser.finish() {
            if ev.trim() == "[DONE]" {
                done = true;
            }
        }
        let verdict = match (error_code, done) {
            (Some(code), _) if events_after_error == 0 => Verdict::CleanError(code),
            (Some(code), _) => Verdict::Silent(format!("events after the error event {code}")),
            (None, true) => Verdict::Completed,
            (None, false) => {
                Verdict::Silent("stream ended without [DONE] or an error event".into())
            }
        };
        (verdict, worker)
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(v) => v,
        Err(_) => (Verdict::Silent(format!("no end within {timeout:?}")), None),
    }
}

/// An error with its sources, `: `-joined.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(inner) = next {
        let _ = write!(s, ": {inner}");
        next = inner.source();
    }
    s
}

/// The `code` of an OpenAI-style error object (`{"error":{"message","type","code"}}`).
fn openai_error_code(v: &Value) -> Option<String> {
    let e = v.get("error")?;
    let message = e.get("message")?.as_str()?;
    e.get("type")?.as_str()?;
    let code = match e.get("code")? {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        _ => return None,
    };
    (!message.is_empty()).then_some(code)
}

fn error_event_code(data: &str) -> Option<String> {
    let v: Value = serde_json::from_str(data).ok()?;
    openai_error_code(&v)
}

fn judge_error_body(status: u16, text: &str) -> Verdict {
    match serde_json::from_str::<Value>(text)
        .ok()
        .as_ref()
        .and_then(openai_error_code)
    {
        Some(code) => Verdict::CleanError(code),
        None => Verdict::Silent(format!(
            "{status} without an OpenAI JSON error: {}",
            text.chars().take(120).collect::<String>()
        )),
    }
}

/// Injects one fault per `fault_every` until `deadline`, cycling kinds and engines.
async fn inject_faults(
    cfg: &ChaosConfig,
    fleet: &mut Fleet,
    control: &reqwest::Client,
    start: Instant,
    deadline: Instant,
) -> Vec<Fault> {
    let addrs = fleet.addrs().to_vec();
    let mut faults = Vec::new();
    let mut n = 0usize;
    loop {
        let at = start + cfg.fault_every * (n as u32 + 1);
        // Leave room for the fault to play out before the load ends.
        if at + DOWN_FOR + Duration::from_secs(1) >= deadline {
            break;
        }
        tokio::time::sleep_until(tokio::time::Instant::from_std(at)).await;
        let kind = FaultKind::CYCLE[n % FaultKind::CYCLE.len()];
        let engine = (n / FaultKind::CYCLE.len() + n) % addrs.len();
        let engine_url = &addrs[engine].url;
        let at_s = start.elapsed().as_secs_f64();
        let result: anyhow::Result<()> = async {
            match kind {
                FaultKind::GarbageEvents => {
                    post_ok(
                        control,
                        &format!("{engine_url}/fault/kv_events/garbage?count=30"),
                    )
                    .await
                }
                FaultKind::EventPause => {
                    let ms = EVENT_PAUSE.as_millis();
                    post_ok(
                        control,
                        &format!("{engine_url}/fault/kv_events/pause?ms={ms}"),
                    )
                    .await
                }
                FaultKind::CacheReset => {
                    post_ok(
                        control,
                        &format!("{engine_url}/reset_prefix_cache?reset_running_requests=true"),
                    )
                    .await
                }
                FaultKind::KillRestart => {
                    fleet.kill(engine).await?;
                    tokio::time::sleep(DOWN_FOR).await;
                    fleet.restart(engine).await
                }
            }
        }
        .await;
        faults.push(Fault {
            kind,
            engine,
            at_s,
            marked_down_after_s: None,
            used_again_after_s: None,
            error: result.err().map(|e| format!("{e:#}")),
        });
        n += 1;
    }
    faults
}

async fn post_ok(http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
    let r = http.post(url).send().await?;
    anyhow::ensure!(r.status().is_success(), "{url} answered {}", r.status());
    Ok(())
}

async fn get_text(http: &reqwest::Client, url: &str) -> anyhow::Result<String> {
    Ok(http
        .get(url)
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?)
}

/// Samples `kvgate_worker_healthy` every 100 ms until `deadline`.
async fn sample_health(
    http: reqwest::Client,
    url: String,
    log: Arc<Mutex<Vec<(f64, String, bool)>>>,
    start: Instant,
    deadline: Instant,
) {
    while Instant::now() < deadline {
        if let Ok(text) = get_text(&http, &format!("{url}/metrics")).await {
            let t = start.elapsed().as_secs_f64();
            let mut log = log.lock();
            for line in text
                .lines()
                .filter(|l| l.starts_with("kvgate_worker_healthy{"))
            {
                let worker = label_value(line, "worker").to_string();
                let healthy = line.trim_end().ends_with(" 1");
                log.push((t, worker, healthy));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// For each kill: when the gateway first reported the worker unhealthy, and when a
/// request it served after the restart completed.
fn time_kill_recovery(
    mut faults: Vec<Fault>,
    health: &[(f64, String, bool)],
    served: &[(f64, String)],
    addrs: &[crate::fleet::EngineAddr],
) -> Vec<Fault> {
    for f in faults
        .iter_mut()
        .filter(|f| f.kind == FaultKind::KillRestart)
    {
        let url = &addrs[f.engine].url;
        f.marked_down_after_s = health
            .iter()
            .find(|(t, w, healthy)| *t >= f.at_s && w == url && !healthy)
            .map(|(t, _, _)| t - f.at_s);
        let back = f.at_s + DOWN_FOR.as_secs_f64();
        f.used_again_after_s = served
            .iter()
            .filter(|(t, w)| *t >= back && w == url)
            .map(|(t, _)| t - back)
            .min_by(f64::total_cmp);
    }
    faults
}

/// The value of label `name` in a Prometheus sample line (empty when absent).
fn label_value<'a>(line: &'a str, name: &str) -> &'a str {
    line.split(&format!("{name}=\""))
        .nth(1)
        .and_then(|r| r.split('"').next())
        .unwrap_or_default()
}

fn dropped_by_reason(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with("kvgate_kv_events_dropped_total{"))
    {
        let reason = label_value(line, "reason");
        let value = line
            .rsplit(' ')
            .next()
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0);
        *out.entry(reason.to_string()).or_default() += value;
    }
    out
}

/// Starts long streams, SIGTERMs the gateway once each has its first chunk, and judges
/// how they end; returns the tally and how long the gateway took to exit.
async fn sigterm_phase(
    cfg: &ChaosConfig,
    mut gateway: Box<ManagedChild>,
    http: &reqwest::Client,
    url: &str,
) -> (Tally, Option<f64>) {
    let (first_chunk_tx, mut first_chunk_rx) = tokio::sync::mpsc::channel::<()>(STREAMS_AT_SIGTERM);
    let mut streams = tokio::task::JoinSet::new();
    for i in 0..STREAMS_AT_SIGTERM {
        let (http, url, tx) = (http.clone(), url.to_string(), first_chunk_tx.clone());
        let body = request_body(cfg.seed, (1 << 40) + i as u64, ClientKind::Plain, 4000);
        let timeout = cfg.request_timeout;
        streams.spawn(async move {
            one_request(&http, &url, body, ClientKind::Plain, timeout, Some(&tx))
                .await
                .0
        });
    }
    drop(first_chunk_tx);
    let mut started = 0;
    let wait = tokio::time::sleep(Duration::from_secs(30));
    tokio::pin!(wait);
    while started < STREAMS_AT_SIGTERM {
        tokio::select! {
            got = first_chunk_rx.recv() => match got {
                Some(()) => started += 1,
                None => break,
            },
            () = &mut wait => break,
        }
    }
    let sent_at = Instant::now();
    let signalled = gateway.signal(libc::SIGTERM).is_ok();
    let mut tally = Tally::default();
    while let Some(done) = streams.join_next().await {
        if let Ok(v) = done {
            tally.record(&v, false);
        }
    }
    let exited = if signalled {
        gateway
            .wait_exit(Duration::from_secs(GRACE_SECS + 10))
            .await
            .then(|| sent_at.elapsed().as_secs_f64())
    } else {
        None
    };
    gateway.shutdown().await;
    (tally, exited)
}

/// A field of `/proc/<pid>/status` in MiB (VmRSS, VmHWM).
fn proc_status_mib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "n/a".into(), |v| v.to_string())
}

/// The report.
pub fn render_markdown(s: &ChaosSummary) -> String {
    let t = &s.tally;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Fault suite: {} engines, `{}`, {} clients, {:.0} s\n",
        s.engines, s.policy, s.concurrency, s.duration_s
    );
    let _ = writeln!(out, "| measure | value | target |\n|---|---:|---|");
    let clean: Vec<String> = t
        .clean_errors
        .iter()
        .map(|(c, n)| format!("{c} {n}"))
        .collect();
    let rows: Vec<(&str, String, &str)> = vec![
        ("requests sent", t.sent.to_string(), ""),
        ("accepted", t.accepted.to_string(), ""),
        ("completed", t.completed.to_string(), ""),
        (
            "failed with a clean error",
            format!("{} ({})", t.clean_total(), clean.join(", ")),
            "",
        ),
        ("**failed without one**", t.silent_failures.to_string(), "0"),
        ("cancelled by the client", t.cancelled.to_string(), ""),
        (
            "oversized bodies answered 413 JSON",
            format!("{} of {}", t.oversized_413, t.oversized_sent),
            "all",
        ),
        (
            "not accepted (connection refused)",
            t.not_accepted.to_string(),
            "",
        ),
        (
            "**bookings left after the load**",
            opt(s.bookings_left),
            "0",
        ),
        ("worker in-flight left", opt(s.worker_in_flight_left), "0"),
        (
            "gateway RSS start / peak / end (MiB)",
            format!(
                "{} / {} / {}",
                opt(s.rss_start_mib),
                opt(s.rss_peak_mib),
                opt(s.rss_end_mib)
            ),
            "",
        ),
        (
            "index purges / event gaps",
            format!("{} / {}", opt(s.index_purges), opt(s.event_gaps)),
            "",
        ),
        (
            "events dropped by reason",
            s.events_dropped
                .iter()
                .filter(|(_, n)| **n > 0.0)
                .map(|(r, n)| format!("{r} {n}"))
                .collect::<Vec<_>>()
                .join(", "),
            "",
        ),
        (
            "SIGTERM with streams running: completed / clean error / **silent**",
            format!(
                "{} / {} / {}",
                s.sigterm.completed,
                s.sigterm.clean_total(),
                s.sigterm.silent_failures
            ),
            "silent 0",
        ),
        (
            "gateway exit after SIGTERM (s)",
            s.sigterm_exit_s.map_or("n/a".into(), |v| format!("{v:.1}")),
            "",
        ),
    ];
    for (name, value, target) in rows {
        let _ = writeln!(out, "| {name} | {value} | {target} |");
    }
    let _ = writeln!(
        out,
        "\n| fault | engine | at (s) | marked down after (s) | used again after restart (s) |\n|---|---:|---:|---:|---:|"
    );
    for f in &s.faults {
        let fmt = |v: Option<f64>| v.map_or("".into(), |v| format!("{v:.1}"));
        let _ = writeln!(
            out,
            "| {}{} | {} | {:.1} | {} | {} |",
            f.kind.describe(),
            f.error
                .as_deref()
                .map(|e| format!(" (failed: {e})"))
                .unwrap_or_default(),
            f.engine,
            f.at_s,
            fmt(f.marked_down_after_s),
            fmt(f.used_again_after_s),
        );
    }
    if !t.silent_examples.is_empty() || !s.sigterm.silent_examples.is_empty() {
        let _ = writeln!(out, "\nSilent failures (first 20):");
        for e in t.silent_examples.iter().chain(&s.sigterm.silent_examples) {
            let _ = writeln!(out, "- {e}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_bodies_and_events_are_judged() {
        let clean = r#"{"error":{"message":"busy","type":"rate_limit_error","code":"overloaded"}}"#;
        assert_eq!(
            judge_error_body(429, clean),
            Verdict::CleanError("overloaded".into())
        );
        assert!(matches!(
            judge_error_body(413, "length limit exceeded"),
            Verdict::Silent(_)
        ));
        assert!(matches!(
            judge_error_body(500, r#"{"error":"x"}"#),
            Verdict::Silent(_)
        ));
        assert_eq!(error_event_code(clean).as_deref(), Some("overloaded"));
        // vLLM's own error objects carry a numeric code.
        let vllm = r#"{"error":{"message":"bad","type":"BadRequestError","code":400}}"#;
        assert_eq!(
            judge_error_body(400, vllm),
            Verdict::CleanError("400".into())
        );
    }

    #[test]
    fn the_client_mix_and_bodies() {
        let kinds: Vec<ClientKind> = (0..10_000).map(|k| client_kind(0, k)).collect();
        let share = |k| kinds.iter().filter(|x| **x == k).count();
        assert!((100..300).contains(&share(ClientKind::Oversized)));
        assert!((600..1000).contains(&share(ClientKind::Cancel)));
        assert!(request_body(0, 1, ClientKind::Oversized, 16).len() > MAX_BODY_BYTES);
        assert!(request_body(0, 1, ClientKind::Plain, 16).len() < 16 << 10);
    }

    #[test]
    fn labels_are_read_from_sample_lines() {
        let line = r#"kvgate_kv_events_dropped_total{reason="stale",worker="http://w:1"} 3"#;
        assert_eq!(label_value(line, "reason"), "stale");
        assert_eq!(label_value(line, "worker"), "http://w:1");
        assert_eq!(label_value(line, "model"), "");
    }

    #[test]
    fn tally_counts_each_ending_once() {
        let mut t = Tally::default();
        t.record(&Verdict::Completed, false);
        t.record(&Verdict::CleanError("request_too_large".into()), true);
        t.record(&Verdict::Silent("cut".into()), false);
        t.record(&Verdict::NotAccepted, false);
        t.record(&Verdict::Cancelled, false);
        assert_eq!((t.sent, t.accepted, t.completed), (5, 4, 1));
        assert_eq!((t.oversized_413, t.oversized_sent), (1, 1));
        assert_eq!((t.silent_failures, t.not_accepted, t.cancelled), (1, 1, 1));
    }
}
