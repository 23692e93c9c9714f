//! `kvgate simulate plan`: the smallest fleet that meets a TTFT target.
//!
//! Owns the search over engine counts (per cache size) and its table. Each point is a
//! full simulation of the workload ([`simulate`]); the search doubles the engine count
//! until the target is met, then bisects between the last miss and the first hit, so
//! it assumes TTFT p90 does not get worse with more engines (it reports every point
//! it measured, so a curve that is not monotone shows). It must not simulate anything
//! itself.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use anyhow::bail;
use kvgate_bench::report::{fmt_pct, Report};

use crate::report::report;
use crate::rows::SimRow;
use crate::simulation::{simulate, FleetConfig, Load};

/// What to search.
#[derive(Clone, Debug)]
pub struct PlanConfig {
    pub ttft_p90_ms: f64,
    pub max_engines: usize,
    /// Cache sizes (KV blocks per engine) to search, each on its own.
    pub num_blocks_options: Vec<u32>,
}

/// One measured fleet.
#[derive(Clone, Debug)]
pub struct PlanPoint {
    pub engines: usize,
    pub num_blocks: u32,
    pub report: Report,
    pub meets: bool,
}

/// Every point measured, and the smallest fleet per cache size that met the target.
#[derive(Clone, Debug)]
pub struct PlanResult {
    pub label: String,
    pub ttft_p90_ms: f64,
    pub points: Vec<PlanPoint>,
    /// Cache size → the fewest engines that met the target (`None`: not within the
    /// largest count tried).
    pub smallest: BTreeMap<u32, Option<usize>>,
}

/// Searches, for each cache size, the fewest engines whose TTFT p90 meets the target.
pub fn plan(
    row: &SimRow,
    fleet: &FleetConfig,
    load: &Load,
    cfg: &PlanConfig,
) -> anyhow::Result<PlanResult> {
    if !(cfg.ttft_p90_ms.is_finite() && cfg.ttft_p90_ms > 0.0) {
        bail!("--ttft-p90-ms must be a positive number");
    }
    if cfg.max_engines == 0 || cfg.num_blocks_options.is_empty() {
        bail!("nothing to search: give --max-engines ≥ 1 and at least one cache size");
    }
    let mut points = Vec::new();
    let mut smallest = BTreeMap::new();
    for &num_blocks in &cfg.num_blocks_options {
        let mut measure = |engines: usize| -> anyhow::Result<bool> {
            let mut f = fleet.clone();
            f.engines = engines;
            f.engine.num_blocks = num_blocks;
            let rep = report(&row.label, &simulate(&row.model, &f, load)?);
            let meets = rep.errors == 0 && rep.ttft_ms.p90 <= cfg.ttft_p90_ms;
            eprintln!(
                "  {engines} engines × {num_blocks} blocks: TTFT p90 {:.1} ms, hit {}{}",
                rep.ttft_ms.p90,
                fmt_pct(rep.prefix_hit_rate),
                if meets { " (meets the target)" } else { "" }
            );
            points.push(PlanPoint {
                engines,
                num_blocks,
                report: rep,
                meets,
            });
            Ok(meets)
        };
        // Double until the target is met, then bisect (miss, hit].
        let (mut miss, mut hit) = (0usize, None);
        let mut n = 1usize;
        loop {
            if measure(n)? {
                hit = Some(n);
                break;
            }
            miss = n;
            if n >= cfg.max_engines {
                break;
            }
            n = (n * 2).min(cfg.max_engines);
        }
        if let Some(mut h) = hit {
            while h - miss > 1 {
                let mid = miss + (h - miss) / 2;
                if measure(mid)? {
                    h = mid;
                } else {
                    miss = mid;
                }
            }
            hit = Some(h);
        }
        smallest.insert(num_blocks, hit);
    }
    points.sort_by_key(|p| (p.num_blocks, p.engines));
    Ok(PlanResult {
        label: row.label.clone(),
        ttft_p90_ms: cfg.ttft_p90_ms,
        points,
        smallest,
    })
}

impl PlanResult {
    /// The curve and the answer, as markdown.
    pub fn render_markdown(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "Target: TTFT p90 ≤ {} ms with {}\n",
            self.ttft_p90_ms, self.label
        );
        let _ = writeln!(
            s,
            "| engines | KV blocks each | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | prefix hit | errors | meets |"
        );
        let _ = writeln!(s, "|---:|---:|---:|---:|---:|---:|---:|---|");
        for p in &self.points {
            let r = &p.report;
            let _ = writeln!(
                s,
                "| {} | {} | {:.1} | {:.1} | {:.1} | {} | {} | {} |",
                p.engines,
                p.num_blocks,
                r.ttft_ms.p50,
                r.ttft_ms.p90,
                r.ttft_ms.p99,
                fmt_pct(r.prefix_hit_rate),
                r.errors,
                if p.meets { "yes" } else { "no" }
            );
        }
        s.push('\n');
        for (blocks, n) in &self.smallest {
            let _ = match n {
                Some(n) => writeln!(
                    s,
                    "With {blocks} KV blocks per engine: {n} engines ({} blocks in all).",
                    *n as u64 * u64::from(*blocks)
                ),
                None => writeln!(
                    s,
                    "With {blocks} KV blocks per engine: not met within the largest fleet tried."
                ),
            };
        }
        s
    }
}
