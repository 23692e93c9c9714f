//! The rows of a simulation: `--policies round_robin,kv_aware@locality-weight=0`.
//!
//! Owns turning a row's spec into the model configuration `kvgate serve` would build
//! from the same flags: the spec syntax is `kvgate bench compare`'s ([`PolicySpec`]),
//! and the flags are parsed by the gateway's own [`ServeArgs`], so a row means the same
//! here as in a real-time comparison. It must not route or simulate.

use anyhow::{bail, Context};
use clap::Parser;
use kvgate_bench::routers::{PolicySpec, RouterSpec};
use kvgate_gateway::cli::ServeArgs;
use kvgate_gateway::config::ModelConfig;

/// One policy row.
#[derive(Clone, Debug)]
pub struct SimRow {
    /// The spec as written (`kv_aware@overlap-weight=2`).
    pub label: String,
    /// Where its per-row report goes: `reports/<file_stem>.json`, named as `bench
    /// compare` names a row's.
    pub file_stem: String,
    /// What `kvgate serve --policy ... <flags>` would route with.
    pub model: ModelConfig,
}

#[derive(Parser)]
#[command(name = "serve", no_binary_name = false)]
struct ServeLine {
    #[command(flatten)]
    serve: ServeArgs,
}

/// Parses a comma-separated list of row specs. `global_args` are `kvgate serve` flags
/// for every row (before each row's own); `seed` seeds every policy that gives none.
pub fn parse_rows(
    specs: &str,
    global_args: &[String],
    block_size: u32,
    seed: u64,
) -> anyhow::Result<Vec<SimRow>> {
    let mut rows = Vec::new();
    for spec in specs.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        rows.push(parse_row(spec, global_args, block_size, seed)?);
    }
    if rows.is_empty() {
        bail!("--policies names no policy");
    }
    Ok(rows)
}

fn parse_row(
    spec: &str,
    global_args: &[String],
    block_size: u32,
    seed: u64,
) -> anyhow::Result<SimRow> {
    let policy = match RouterSpec::parse(spec)? {
        RouterSpec::Kvgate(p) => p,
        other => bail!(
            "{}: peer routers run as processes; compare them in real time with `kvgate bench compare`",
            other.label()
        ),
    };
    if policy
        .options
        .iter()
        .any(|(flag, _)| kvgate_bench::routers::BENCH_OPTIONS.contains(&flag.as_str()))
    {
        bail!("row {spec:?}: router replicas (@replicas, @sync) are not simulated; compare them in real time with `kvgate bench compare`");
    }
    let line = serve_line(&policy, global_args, block_size);
    let parsed = ServeLine::try_parse_from(&line).map_err(|e| {
        let e = kvgate_gateway::cli::explain_removed_flag(e);
        anyhow::anyhow!("row {spec:?}: {}", e.render().to_string().trim())
    })?;
    let config = parsed
        .serve
        .to_config()
        .with_context(|| format!("row {spec:?}"))?;
    if config.limits.max_in_flight != 0 || config.limits.max_in_flight_per_worker != 0 {
        bail!("row {spec:?}: in-flight limits (--max-in-flight, --max-in-flight-per-worker) are not simulated");
    }
    let Some(mut model) = config.models.into_iter().next() else {
        bail!("row {spec:?}: no model configured");
    };
    model.seed.get_or_insert(seed);
    let label = policy.to_string();
    Ok(SimRow {
        file_stem: RouterSpec::Kvgate(policy).file_stem(),
        label,
        model,
    })
}

/// The `kvgate serve` command line a row stands for. The prompts are token ids, so no
/// tokenizer is loaded (`--remote-tokenize` only satisfies the check that a token
/// policy has one); the workers are the simulated engines.
fn serve_line(policy: &PolicySpec, global_args: &[String], block_size: u32) -> Vec<String> {
    let mut line: Vec<String> = [
        "serve",
        "--model",
        "sim-model",
        "--policy",
        policy.name.as_str(),
        "--block-size",
        &block_size.to_string(),
        "--remote-tokenize",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    line.extend(global_args.iter().cloned());
    line.extend(policy.extra_args());
    line
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvgate_core::PolicyKind;

    #[test]
    fn rows_take_serve_flags_and_a_seed() {
        let rows = parse_rows(
            "round_robin, kv_aware@overlap-weight=2@locality-weight=0",
            &["--pending-credit-secs".into(), "3".into()],
            16,
            7,
        )
        .unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].model.policy, PolicyKind::RoundRobin);
        assert_eq!(rows[0].model.seed, Some(7));
        let kv = &rows[1];
        assert_eq!(kv.label, "kv_aware@overlap-weight=2@locality-weight=0");
        assert_eq!(kv.model.kv_aware.overlap_weight, 2.0);
        assert_eq!(kv.model.kv_aware.locality_weight, 0.0);
        assert_eq!(kv.model.kv_aware.pending_credit_secs, 3.0);
        assert_eq!(kv.model.block_size, 16);
        let seeded = parse_rows("kv_aware@seed=3", &[], 16, 7).unwrap();
        assert_eq!(seeded[0].model.seed, Some(3));
    }

    #[test]
    fn peers_unknown_flags_and_limits_are_refused() {
        for replicas in ["kv_aware@replicas=3", "kv_aware@replicas=3@sync=off"] {
            let err = parse_rows(replicas, &[], 16, 0).unwrap_err();
            assert!(err.to_string().contains("not simulated"), "{err}");
        }
        let err = parse_rows("sglang-router:cache_aware", &[], 16, 0).unwrap_err();
        assert!(err.to_string().contains("kvgate bench compare"), "{err}");
        assert!(parse_rows("kv_aware@no-such-flag=1", &[], 16, 0).is_err());
        let err = parse_rows("kv_aware@max-in-flight-per-worker=4", &[], 16, 0).unwrap_err();
        assert!(err.to_string().contains("not simulated"), "{err}");
        assert!(parse_rows(" , ", &[], 16, 0).is_err());
    }
}
