//! `kvgate bench compare`: the same requests through several routers, one fresh fleet
//! per router, side by side.
//!
//! Owns the comparison loop (fresh engines → router → replay → report → teardown), the
//! markdown table, the JSON summary, the plots (drawn by `plot`) and `report.html`, the
//! table and plots in one self-contained page, written to the output folder.
//! Engines are restarted for every router so no router inherits a warm cache. It must
//! not contain routing logic or per-request measurement.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

use crate::client::BenchClient;
use crate::fleet::{EngineConfig, Fleet};
use crate::plot::{grouped_bars_svg, line_chart_svg, BarGroup, Line, SeriesLabelPosition};
use crate::report::{fmt_opt, fmt_pct, Report};
use crate::request::Request;
use crate::routers::{self, RouterContext, RouterSpec, Started};
use crate::runner::{self, RunConfig};

/// Everything a comparison needs.
#[derive(Debug, Clone)]
pub struct CompareConfig {
    /// The fleet.
    pub engine: EngineConfig,
    /// Routers to run, in order.
    pub routers: Vec<RouterSpec>,
    /// Model name sent in requests and given to kvgate.
    pub model: String,
    /// Output folder.
    pub out_dir: PathBuf,
    /// Replay settings (speedup, concurrency, progress).
    pub run: RunConfig,
    /// Per-request timeout.
    pub request_timeout: Duration,
    /// How long a router may take to become ready.
    pub router_startup_timeout: Duration,
    /// Extra arguments for `kvgate serve`.
    pub kvgate_extra_args: Vec<String>,
    /// What was replayed (for the report header), e.g. `trace conversation_trace.jsonl [0, 1000)`.
    pub workload_description: String,
    /// Label of the baseline row for ratio columns.
    pub baseline: String,
}

/// One row of the comparison.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareRow {
    /// Router label (`kv_aware`, `vllm-router:cache_aware`, ...).
    pub label: String,
    /// `ok`, `skipped` or `failed`.
    pub status: String,
    /// Why a row was skipped or failed.
    pub note: Option<String>,
    /// The run's report when it ran.
    pub report: Option<Report>,
}

/// The comparison's JSON summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareSummary {
    /// What was replayed.
    pub workload: String,
    /// Number of requests replayed per router.
    pub requests: usize,
    /// Engines in the fleet.
    pub engines: usize,
    /// Trace-time speedup.
    pub speedup: f64,
    /// One row per router.
    pub rows: Vec<CompareRow>,
}

/// Run every router over `requests`. A router that is not installed, or fails to start,
/// becomes a skipped/failed row; only errors of the bench itself abort the comparison.
pub async fn compare(cfg: &CompareConfig, requests: &[Request]) -> anyhow::Result<CompareSummary> {
    let logs = cfg.out_dir.join("logs");
    let reports_dir = cfg.out_dir.join("reports");
    std::fs::create_dir_all(&reports_dir)
        .with_context(|| format!("cannot create {}", reports_dir.display()))?;
    let mut rows = Vec::with_capacity(cfg.routers.len());
    for spec in &cfg.routers {
        let label = spec.label();
        eprintln!("kvgate bench compare: {label} ...");
        let row = match run_one(cfg, spec, requests, &logs).await {
            Ok(report) => {
                let path = reports_dir.join(format!("{}.json", spec.file_stem()));
                std::fs::write(&path, serde_json::to_vec_pretty(&report)?)
                    .with_context(|| format!("cannot write {}", path.display()))?;
                eprint!("{}", report.render_table());
                CompareRow {
                    label,
                    status: "ok".into(),
                    note: None,
                    report: Some(report),
                }
            }
            Err(RunError::Skipped(why)) => {
                eprintln!("  skipped: {why}");
                CompareRow {
                    label,
                    status: "skipped".into(),
                    note: Some(why),
                    report: None,
                }
            }
            Err(RunError::Failed(err)) => {
                let msg = format!("{err:#}");
                eprintln!("  failed: {msg}");
                CompareRow {
                    label,
                    status: "failed".into(),
                    note: Some(first_line(&msg)),
                    report: None,
                }
            }
        };
        rows.push(row);
    }
    let summary = CompareSummary {
        workload: cfg.workload_description.clone(),
        requests: requests.len(),
        engines: cfg.engine.engines,
        speedup: cfg.run.speedup,
        rows,
    };
    write_outputs(&cfg.out_dir, &summary, &cfg.baseline)?;
    Ok(summary)
}

/// First line of an error plus its last non-empty line (the child's last log line).
pub(crate) fn first_line(s: &str) -> String {
    let first = s.lines().next().unwrap_or("");
    let last = s.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let text = if last == first {
        first.to_string()
    } else {
        format!("{first} … {}", last.trim())
    };
    text.chars().take(300).collect()
}

/// Why a row produced no report: the router is not installed, or the run failed.
pub(crate) enum RunError {
    Skipped(String),
    Failed(anyhow::Error),
}

impl From<anyhow::Error> for RunError {
    fn from(e: anyhow::Error) -> Self {
        RunError::Failed(e)
    }
}

async fn run_one(
    cfg: &CompareConfig,
    spec: &RouterSpec,
    requests: &[Request],
    logs: &Path,
) -> Result<Report, RunError> {
    let log_dir = logs.join(spec.file_stem());
    // A fresh fleet per router: cold caches, fresh event sequence numbers; split into
    // prefill and decode engines for a disaggregated row.
    let engine_cfg = crate::fleet::EngineConfig {
        pd: spec.policy_spec().pd_fleet(cfg.engine.engines),
        ..cfg.engine.clone()
    };
    let fleet = Fleet::start(&engine_cfg, &log_dir)
        .await
        .context("starting the mock-engine fleet")?;
    let ctx = RouterContext {
        kvgate_bin: cfg.engine.kvgate_bin.clone(),
        model: cfg.model.clone(),
        block_size: cfg.engine.block_size,
        log_dir: log_dir.clone(),
        startup_timeout: cfg.router_startup_timeout,
        kvgate_extra_args: [
            cfg.engine.limit_args_for_router(),
            cfg.kvgate_extra_args.clone(),
        ]
        .concat(),
    };
    let engines = fleet.addrs().to_vec();
    let (mut fleet, router, url, more, launches, sidecars) =
        start_router(spec, &ctx, fleet, &engines).await?;
    let mut urls = vec![url.clone()];
    urls.extend(more.iter().map(|(_, u)| u.clone()));
    // Clients spread round-robin over the row's replicas (one URL without @replicas),
    // or the first @clients=K of them.
    let client = BenchClient::new(&url, &cfg.model, cfg.request_timeout)?
        .with_prompt_format(spec.prompt_format())
        .spread_over(&urls[..spec.policy_spec().client_replicas().min(urls.len())]);
    let run_cfg = RunConfig {
        label: spec.label(),
        ..cfg.run.clone()
    };
    let mut replicas: Vec<_> = std::iter::once(*router)
        .chain(more.into_iter().map(|(child, _)| child))
        .collect();
    // `@rollout`: the replicas are restarted one at a time while the replay runs.
    let rollout = spec.policy_spec().rolls_out().then(|| {
        let span = crate::request::summarize(requests)
            .span
            .div_f64(cfg.run.speedup);
        tokio::spawn(crate::rollout::roll(
            std::mem::take(&mut replicas),
            launches,
            client.rotation(),
            span,
            cfg.router_startup_timeout,
            log_dir.clone(),
        ))
    });
    let result = runner::run(&client, requests.to_vec(), &run_cfg).await;
    let mut rolled = Ok(());
    if let Some(task) = rollout {
        let (back, log) = task.await.context("the rollout task failed")?;
        replicas = back;
        rolled = log.map(|log| {
            for (name, out_at, took) in log.steps {
                eprintln!(
                    "{}: {name} restarted at {out_at:.1} s, back after {took:.1} s",
                    spec.label()
                );
            }
        });
    }
    let mut report = Report::from_run(&spec.label(), &result);
    if report.per_worker.is_empty() {
        if let Some(counts) = engine_request_counts(&fleet).await {
            report.set_per_worker(counts);
        }
    } else {
        // Named per request (x-kvgate-worker, the worker's URL): count the engines
        // that got none too.
        let urls: Vec<String> = fleet.addrs().iter().map(|a| a.url.clone()).collect();
        report.include_idle_workers(&urls);
    }
    if spec.kvgate_routes() {
        // Policies that do not read the prompt predict nothing (0). Several replicas:
        // the sum of their predictions. Behind Envoy, the picker predicts.
        let kvgate_urls: Vec<&String> = match spec {
            RouterSpec::Envoy(_) => sidecars.iter().map(|(_, u)| u).collect(),
            _ => urls.iter().collect(),
        };
        let mut predicted = 0.0;
        for u in kvgate_urls {
            predicted += kvgate_prediction(u).await.map_or(0.0, |(p, _)| p);
        }
        report.predicted_cached_tokens = Some(predicted.round() as u64).filter(|&p| p > 0);
    }
    let alive = fleet.check_alive();
    for child in replicas {
        child.shutdown().await;
    }
    for (child, _) in sidecars {
        child.shutdown().await;
    }
    fleet.shutdown().await;
    alive.context("an engine died during the run")?;
    rolled.context("the rolling restart failed")?;
    Ok(report)
}

/// Per-engine finished-request counts from the engines' Prometheus `/metrics`
/// (`vllm:request_success_total`), for routers that do not report the worker in a
/// response header. `None` when any engine does not expose it.
async fn engine_request_counts(fleet: &Fleet) -> Option<BTreeMap<String, usize>> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()
        .ok()?;
    let mut out = BTreeMap::new();
    for a in fleet.addrs() {
        let n = engine_finished_requests(&http, &a.url).await?;
        out.insert(a.url.clone(), n.round() as usize);
    }
    Some(out)
}

/// One engine's finished-request counter (`vllm:request_success_total` on its
/// `/metrics`); `None` when it does not answer or does not expose it.
pub(crate) async fn engine_finished_requests(
    http: &reqwest::Client,
    engine_url: &str,
) -> Option<f64> {
    let text = http
        .get(format!("{engine_url}/metrics"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    parse_counter_sum(&text, "vllm:request_success_total")
}

/// A row's fleet, its router (first replica) and URL, its other replicas, and how
/// each replica was started.
pub(crate) type RunningRouter = (
    Fleet,
    Box<crate::process::ManagedChild>,
    String,
    Vec<(crate::process::ManagedChild, String)>,
    Vec<routers::Launch>,
    Vec<(crate::process::ManagedChild, String)>,
);

/// Starts `spec` in front of `engines` (this row's fleet). When the router is skipped or
/// fails to start, the fleet is shut down and the row's error returned.
pub(crate) async fn start_router(
    spec: &RouterSpec,
    ctx: &RouterContext,
    fleet: Fleet,
    engines: &[crate::fleet::EngineAddr],
) -> Result<RunningRouter, RunError> {
    match routers::start(spec, ctx, engines).await {
        Ok(Started::Running {
            child,
            url,
            more,
            launches,
            sidecars,
        }) => Ok((fleet, child, url, more, launches, sidecars)),
        Ok(Started::Skipped(why)) => {
            fleet.shutdown().await;
            Err(RunError::Skipped(why))
        }
        Err(e) => {
            fleet.shutdown().await;
            Err(RunError::Failed(
                e.context(format!("starting {}", spec.label())),
            ))
        }
    }
}

/// kvgate's predicted and engine-reported cached tokens so far, from its `/metrics`.
pub(crate) async fn kvgate_prediction(router_url: &str) -> Option<(f64, f64)> {
    let text = reqwest::get(format!("{router_url}/metrics"))
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    let predicted = parse_counter_sum(&text, "kvgate_predicted_cached_tokens_total")?;
    let reported = parse_counter_sum(&text, "kvgate_reported_cached_tokens_total")?;
    Some((predicted, reported))
}

/// Sum of every sample of a Prometheus metric family in text exposition format.
pub fn parse_counter_sum(text: &str, name: &str) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let value = rest.rsplit(['}', ' ']).find(|s| !s.is_empty())?;
        if let Ok(v) = value.parse::<f64>() {
            sum += v;
            found = true;
        }
    }
    found.then_some(sum)
}

/// Markdown table of the rows, with TTFT ratios against `baseline`.
pub fn render_markdown(summary: &CompareSummary, baseline: &str) -> String {
    let base = summary
        .rows
        .iter()
        .find(|r| r.label == baseline)
        .and_then(|r| r.report.as_ref());
    let mut s = String::new();
    let _ = writeln!(
        s,
        "Workload: {} — {} requests, {} engines, speedup {}\n",
        summary.workload, summary.requests, summary.engines, summary.speedup
    );
    let _ = writeln!(
        s,
        "| router | ok | errors | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | TTFT p90 vs {baseline} | ITL p50 ms | ITL p90 ms | ITL p99 ms | E2E p50 ms | E2E p99 ms | req/s | goodput req/s | out tok/s | prefix hit | predicted / reported cached | TTFT prediction error p50 / p90 | spread max/mean | note |"
    );
    let _ = writeln!(
        s,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    );
    for row in &summary.rows {
        match &row.report {
            Some(r) => {
                let ratio = base
                    .filter(|b| r.ttft_ms.p90 > 0.0 && b.ttft_ms.count > 0)
                    .map(|b| b.ttft_ms.p90 / r.ttft_ms.p90);
                let _ = writeln!(
                    s,
                    "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {} | {:.1} | {} | {} | {} | {} | {} |",
                    row.label,
                    r.ok,
                    r.errors,
                    r.ttft_ms.p50,
                    r.ttft_ms.p90,
                    r.ttft_ms.p99,
                    ratio.map_or_else(|| "n/a".into(), |x| format!("{x:.2}x")),
                    r.itl_ms.p50,
                    r.itl_ms.p90,
                    r.itl_ms.p99,
                    r.e2e_ms.p50,
                    r.e2e_ms.p99,
                    r.requests_per_s,
                    fmt_opt(r.goodput_per_s, 2),
                    r.output_tokens_per_s,
                    fmt_pct(r.prefix_hit_rate),
                    fmt_opt(r.predicted_over_reported(), 3),
                    r.ttft_prediction_error.map_or_else(
                        || "n/a".into(),
                        |e| format!("{:.0}% / {:.0}%", e.p50 * 100.0, e.p90 * 100.0)
                    ),
                    fmt_opt(r.worker_spread, 2),
                    row.note.as_deref().unwrap_or(""),
                );
            }
            None => not_run_row(&mut s, &row.label, &row.status, row.note.as_deref(), 18),
        }
    }
    s
}

/// A table row for a router that did not run: its label, `blank` empty cells, then
/// `status: note` in the last column.
pub(crate) fn not_run_row(
    s: &mut String,
    label: &str,
    status: &str,
    note: Option<&str>,
    blank: usize,
) {
    let _ = writeln!(
        s,
        "| {label} |{} {status}: {} |",
        " |".repeat(blank),
        note.unwrap_or("").replace('|', "/")
    );
}

/// The TTFT plot of the rows that ran.
pub fn render_svg(summary: &CompareSummary) -> String {
    let groups: Vec<BarGroup> = summary
        .rows
        .iter()
        .filter_map(|r| {
            r.report.as_ref().map(|rep| BarGroup {
                label: r.label.clone(),
                values: vec![rep.ttft_ms.p50, rep.ttft_ms.p90, rep.ttft_ms.p99],
            })
        })
        .collect();
    grouped_bars_svg(
        "TTFT by router (lower is better)",
        &format!(
            "{} — {} requests, {} engines",
            summary.workload, summary.requests, summary.engines
        ),
        "TTFT (ms)",
        &["p50", "p90", "p99"],
        &groups,
    )
}

/// The TTFT distribution of every row that ran, one line per router.
pub fn render_cdf_svg(summary: &CompareSummary) -> String {
    let lines: Vec<Line> = summary
        .rows
        .iter()
        .filter_map(|r| {
            let rep = r.report.as_ref()?;
            Some(Line {
                label: r.label.clone(),
                points: rep.ttft_cdf_ms.clone(),
            })
        })
        .collect();
    line_chart_svg(
        "TTFT distribution by router (further left is better)",
        &format!("{} — {} requests", summary.workload, summary.requests),
        "TTFT (ms)",
        "share of requests at or below",
        &lines,
        None,
        SeriesLabelPosition::LowerRight,
    )
}

/// One router's requests per second on each worker over the replay.
pub fn render_worker_load_svg(label: &str, report: &Report) -> String {
    let lines: Vec<Line> = report
        .per_worker_per_second
        .iter()
        .map(|(worker, bins)| Line {
            label: worker.clone(),
            points: bins
                .iter()
                .enumerate()
                .map(|(s, n)| (s as f64, f64::from(*n)))
                .collect(),
        })
        .collect();
    line_chart_svg(
        &format!("{label}: requests per second on each worker"),
        "by the second each request was sent",
        "seconds since the replay started",
        "requests per second",
        &lines,
        None,
        SeriesLabelPosition::UpperRight,
    )
}

/// The whole comparison as one self-contained HTML page: the table, the TTFT plots and
/// one per-worker load plot per router (no external files, scripts or fonts).
pub fn render_html(summary: &CompareSummary, baseline: &str) -> String {
    let mut s = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>kvgate bench compare</title>\n<style>body{font-family:sans-serif;margin:24px;max-width:1400px}table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child,th:first-child{text-align:left}th{background:#f4f4f4}figure{margin:24px 0}svg{max-width:100%;height:auto}</style>\n</head><body>\n<h1>kvgate bench compare</h1>\n",
    );
    let md = render_markdown(summary, baseline);
    let mut in_table = false;
    for line in md.lines() {
        if let Some(row) = line.strip_prefix('|') {
            let cells: Vec<&str> = row
                .trim_end_matches('|')
                .split('|')
                .map(str::trim)
                .collect();
            if cells
                .iter()
                .all(|c| c.chars().all(|ch| ch == '-' || ch == ':'))
            {
                continue; // the alignment row
            }
            let tag = if in_table { "td" } else { "th" };
            if !in_table {
                s.push_str("<table>\n");
                in_table = true;
            }
            s.push_str("<tr>");
            for c in cells {
                let _ = write!(s, "<{tag}>{}</{tag}>", html_escape(c));
            }
            s.push_str("</tr>\n");
        } else {
            if in_table {
                s.push_str("</table>\n");
                in_table = false;
            }
            if !line.trim().is_empty() {
                let _ = writeln!(s, "<p>{}</p>", html_escape(line));
            }
        }
    }
    if in_table {
        s.push_str("</table>\n");
    }
    let _ = writeln!(
        s,
        "<p>TTFT p90 vs {}: the baseline's p90 divided by the row's (above 1: faster than the baseline). Prefix hit: cached over prompt tokens as the engines reported them. Predicted / reported cached: what kvgate expected the engines to serve from cache over what they reported (1 = honest; n/a: the policy does not read prompts). Spread: the busiest worker's requests over the mean (1 = even).</p>",
        html_escape(baseline)
    );
    for svg in [render_svg(summary), render_cdf_svg(summary)] {
        let _ = writeln!(s, "<figure>{svg}</figure>");
    }
    s.push_str("<h2>Load per worker</h2>\n");
    for row in &summary.rows {
        if let Some(rep) = row
            .report
            .as_ref()
            .filter(|r| !r.per_worker_per_second.is_empty())
        {
            let _ = writeln!(
                s,
                "<figure>{}</figure>",
                render_worker_load_svg(&row.label, rep)
            );
        }
    }
    s.push_str("</body></html>\n");
    s
}

fn html_escape(t: &str) -> String {
    t.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Writes `compare.md`, `compare.json`, `ttft.svg`, `ttft-cdf.svg` and `report.html`
/// for `summary` into `dir` (also what `kvgate simulate` writes).
pub fn write_outputs(dir: &Path, summary: &CompareSummary, baseline: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let md = render_markdown(summary, baseline);
    for (name, bytes) in [
        ("compare.md", md.into_bytes()),
        ("compare.json", serde_json::to_vec_pretty(summary)?),
        ("ttft.svg", render_svg(summary).into_bytes()),
        ("ttft-cdf.svg", render_cdf_svg(summary).into_bytes()),
        ("report.html", render_html(summary, baseline).into_bytes()),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::LatencyStats;

    fn report(label: &str, p90: f64) -> Report {
        Report {
            label: label.into(),
            ok: 10,
            requests: 10,
            ttft_ms: LatencyStats {
                count: 10,
                p50: p90 / 2.0,
                p90,
                p99: p90 * 2.0,
                ..LatencyStats::default()
            },
            prefix_hit_rate: Some(0.5),
            ..Report::default()
        }
    }

    fn summary() -> CompareSummary {
        CompareSummary {
            workload: "shared-prefix".into(),
            requests: 10,
            engines: 4,
            speedup: 1.0,
            rows: vec![
                CompareRow {
                    label: "round_robin".into(),
                    status: "ok".into(),
                    note: None,
                    report: Some(report("round_robin", 500.0)),
                },
                CompareRow {
                    label: "kv_aware".into(),
                    status: "ok".into(),
                    note: None,
                    report: Some(report("kv_aware", 100.0)),
                },
                CompareRow {
                    label: "vllm-router:kv_aware".into(),
                    status: "skipped".into(),
                    note: Some("not installed".into()),
                    report: None,
                },
            ],
        }
    }

    #[test]
    fn markdown_has_ratios_and_skipped_rows() {
        let md = render_markdown(&summary(), "round_robin");
        assert!(
            md.contains("| kv_aware | 10 | 0 | 50.0 | 100.0 | 200.0 | 5.00x |"),
            "{md}"
        );
        assert!(md.contains("| round_robin |") && md.contains("1.00x"));
        assert!(md.contains("skipped: not installed"));
        assert!(md.contains("50.0%"));
        let cells = |l: &str| l.matches('|').count();
        let header = md.lines().find(|l| l.starts_with("| router |")).unwrap();
        let skipped = md.lines().find(|l| l.contains("skipped:")).unwrap();
        assert_eq!(cells(header), cells(skipped), "{md}");
    }

    #[test]
    fn plots_only_rows_that_ran() {
        let sum = summary();
        let ran: Vec<&str> = sum
            .rows
            .iter()
            .filter(|r| r.report.is_some())
            .map(|r| r.label.as_str())
            .collect();
        let skipped = sum.rows.iter().find(|r| r.report.is_none()).unwrap();
        for svg in [render_svg(&sum), render_cdf_svg(&sum)] {
            assert!(ran.iter().all(|l| svg.contains(l)), "{svg}");
            assert!(!svg.contains(&skipped.label), "{svg}");
        }
    }

    /// The HTML report holds the table, both TTFT plots and a load plot per router that
    /// knows its workers, with nothing loaded from elsewhere.
    #[test]
    fn html_report_is_self_contained() {
        let mut sum = summary();
        if let Some(rep) = sum.rows[0].report.as_mut() {
            rep.per_worker_per_second
                .insert("http://w1".into(), vec![3, 4, 5]);
            rep.ttft_cdf_ms = vec![(10.0, 0.5), (20.0, 1.0)];
        }
        let html = render_html(&sum, "round_robin");
        assert!(html.starts_with("<!DOCTYPE html>") && html.trim_end().ends_with("</html>"));
        assert_eq!(html.matches("<svg").count(), 3, "{html}");
        assert!(html.contains("<th>router</th>") && html.contains("<td>round_robin</td>"));
        assert!(html.contains("requests per second on each worker"));
        for external in ["src=", "href=", "<script"] {
            assert!(!html.contains(external), "{external} in the report");
        }
    }

    #[test]
    fn outputs_are_written() {
        let dir = tempfile::tempdir().unwrap();
        write_outputs(dir.path(), &summary(), "round_robin").unwrap();
        for f in [
            "compare.md",
            "compare.json",
            "ttft.svg",
            "ttft-cdf.svg",
            "report.html",
        ] {
            assert!(dir.path().join(f).is_file(), "{f}");
        }
        let back: CompareSummary =
            serde_json::from_slice(&std::fs::read(dir.path().join("compare.json")).unwrap())
                .unwrap();
        assert_eq!(back, summary());
    }

    #[test]
    fn prometheus_counter_sum() {
        let text = "# HELP x\nvllm:request_success_total{finished_reason=\"length\"} 3\nvllm:request_success_total{finished_reason=\"stop\"} 2.0\nvllm:request_success_total_created 99\n";
        assert_eq!(
            parse_counter_sum(text, "vllm:request_success_total"),
            Some(5.0)
        );
        assert_eq!(parse_counter_sum(text, "nope"), None);
    }
}
