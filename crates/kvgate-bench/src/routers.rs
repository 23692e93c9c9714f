//! Routers under test: kvgate (one row per policy) and, when installed, the peer routers
//! vllm-router and sglang-router, all started as child processes in front of a fleet.
//!
//! Owns each router's command line and readiness check. A peer that is not installed is
//! a skipped row, not a failure. It must not send benchmark traffic or start engines.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::bail;

use crate::fleet::Fleet;
use crate::process::{free_ports, which, ManagedChild};

/// kvgate's own policies, in the order a full comparison runs them.
pub const KVGATE_POLICIES: &[&str] = &[
    "round_robin",
    "least_loaded",
    "session",
    "prefix_affinity",
    "kv_aware",
];

/// One router configuration under test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterSpec {
    /// `kvgate serve --policy <policy>`.
    Kvgate(String),
    /// `vllm-router --policy <policy>` (pip install vllm-router).
    VllmRouter(String),
    /// `sglang-router launch --policy <policy>` (pip install sglang-router).
    SglangRouter(String),
}

impl RouterSpec {
    /// Parse `kv_aware`, `kvgate:kv_aware`, `vllm-router:cache_aware`, `sglang-router:cache_aware`.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let s = s.trim();
        let (router, policy) = match s.split_once(':') {
            Some((r, p)) => (r, p),
            None => ("kvgate", s),
        };
        if policy.is_empty() {
            bail!("router spec {s:?} has no policy");
        }
        match router {
            "kvgate" => Ok(Self::Kvgate(policy.into())),
            "vllm-router" | "vllm_router" => Ok(Self::VllmRouter(policy.into())),
            "sglang-router" | "sglang_router" => Ok(Self::SglangRouter(policy.into())),
            other => bail!("unknown router {other:?} (kvgate, vllm-router, sglang-router)"),
        }
    }

    /// The full default line-up: every kvgate policy and the installed-or-skipped peers.
    pub fn default_lineup() -> Vec<Self> {
        let mut v: Vec<Self> = KVGATE_POLICIES
            .iter()
            .map(|p| Self::Kvgate((*p).into()))
            .collect();
        v.push(Self::VllmRouter("kv_aware".into()));
        v.push(Self::VllmRouter("cache_aware".into()));
        v.push(Self::SglangRouter("cache_aware".into()));
        v
    }

    /// Row label: `kv_aware` for kvgate, `vllm-router:kv_aware` for peers.
    pub fn label(&self) -> String {
        match self {
            Self::Kvgate(p) => p.clone(),
            Self::VllmRouter(p) => format!("vllm-router:{p}"),
            Self::SglangRouter(p) => format!("sglang-router:{p}"),
        }
    }

    /// The policy name.
    pub fn policy(&self) -> &str {
        match self {
            Self::Kvgate(p) | Self::VllmRouter(p) | Self::SglangRouter(p) => p,
        }
    }

    /// How this router needs prompts: sglang-router rejects token-id prompts on
    /// `/v1/completions`, so it gets the equivalent one-word-per-token text.
    pub fn prompt_format(&self) -> crate::client::PromptFormat {
        match self {
            Self::SglangRouter(_) => crate::client::PromptFormat::Text,
            _ => crate::client::PromptFormat::Tokens,
        }
    }

    fn file_stem(&self) -> String {
        self.label().replace(':', "-")
    }
}

/// What a router needs to know to start.
#[derive(Debug, Clone)]
pub struct RouterContext {
    /// The `kvgate` binary.
    pub kvgate_bin: PathBuf,
    /// Model name served.
    pub model: String,
    /// Engine KV block size.
    pub block_size: u32,
    /// Where logs go.
    pub log_dir: PathBuf,
    /// How long a router may take to become ready.
    pub startup_timeout: Duration,
    /// Extra arguments for `kvgate serve`.
    pub kvgate_extra_args: Vec<String>,
}

/// A started router, or why it was skipped.
#[derive(Debug)]
pub enum Started {
    /// Running at `url`.
    Running {
        /// The router process.
        child: Box<ManagedChild>,
        /// Base URL, e.g. `http://127.0.0.1:8000`.
        url: String,
    },
    /// Not run (e.g. not installed).
    Skipped(String),
}

/// Command line (program, args) for a router on `port` in front of `fleet`; `None` when
/// the router is not installed.
pub fn command_line(
    spec: &RouterSpec,
    ctx: &RouterContext,
    fleet: &Fleet,
    port: u16,
    metrics_port: u16,
) -> Option<(PathBuf, Vec<String>)> {
    let workers: Vec<String> = fleet.addrs().iter().map(|a| a.url.clone()).collect();
    match spec {
        RouterSpec::Kvgate(policy) => {
            let mut args: Vec<String> = vec![
                "serve".into(),
                "--port".into(),
                port.to_string(),
                "--model".into(),
                ctx.model.clone(),
                "--policy".into(),
                policy.clone(),
                "--block-size".into(),
                ctx.block_size.to_string(),
                "--remote-tokenize".into(),
            ];
            for a in fleet.addrs() {
                args.extend(["--worker".into(), a.url.clone()]);
            }
            for a in fleet.addrs() {
                args.extend(["--kv-events".into(), format!("{}={}", a.url, a.kv_events)]);
                args.extend([
                    "--kv-events-replay".into(),
                    format!("{}={}", a.url, a.replay),
                ]);
            }
            args.extend(ctx.kvgate_extra_args.iter().cloned());
            Some((ctx.kvgate_bin.clone(), args))
        }
        RouterSpec::VllmRouter(policy) => {
            let bin = which("vllm-router")?;
            let mut args: Vec<String> = vec![
                "--host".into(),
                "127.0.0.1".into(),
                "--port".into(),
                port.to_string(),
                "--prometheus-port".into(),
                metrics_port.to_string(),
                "--policy".into(),
                policy.clone(),
                "--worker-urls".into(),
            ];
            args.extend(workers);
            if policy == "kv_aware" {
                for a in fleet.addrs() {
                    args.extend([
                        "--kv-event-source".into(),
                        format!("{}={}", a.url, a.kv_events),
                    ]);
                    args.extend([
                        "--kv-event-replay-source".into(),
                        format!("{}={}", a.url, a.replay),
                    ]);
                }
                args.extend([
                    "--kv-event-block-size".into(),
                    ctx.block_size.to_string(),
                    "--kv-event-model".into(),
                    ctx.model.clone(),
                ]);
            }
            Some((bin, args))
        }
        RouterSpec::SglangRouter(policy) => {
            let bin = which("sglang-router")?;
            let mut args: Vec<String> = vec![
                "launch".into(),
                "--host".into(),
                "127.0.0.1".into(),
                "--port".into(),
                port.to_string(),
                "--prometheus-port".into(),
                metrics_port.to_string(),
                "--policy".into(),
                policy.clone(),
                "--worker-urls".into(),
            ];
            args.extend(workers);
            Some((bin, args))
        }
    }
}

/// Start a router in front of `fleet` and wait until it answers.
pub async fn start(
    spec: &RouterSpec,
    ctx: &RouterContext,
    fleet: &Fleet,
) -> anyhow::Result<Started> {
    let ports = free_ports(2)?;
    let (port, metrics_port) = (ports[0], ports[1]);
    let Some((bin, args)) = command_line(spec, ctx, fleet, port, metrics_port) else {
        return Ok(Started::Skipped(format!(
            "{} not installed (pip install {})",
            spec.label(),
            match spec {
                RouterSpec::VllmRouter(_) => "vllm-router",
                RouterSpec::SglangRouter(_) => "sglang-router",
                RouterSpec::Kvgate(_) => "kvgate",
            }
        )));
    };
    let mut child = ManagedChild::spawn(
        &format!("router-{}", spec.file_stem()),
        &bin,
        &args,
        &ctx.log_dir,
    )?;
    let url = format!("http://127.0.0.1:{port}");
    child
        .wait_for_http(
            &[format!("{url}/health"), format!("{url}/v1/models")],
            ctx.startup_timeout,
        )
        .await?;
    Ok(Started::Running {
        child: Box::new(child),
        url,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        assert_eq!(
            RouterSpec::parse("kv_aware").unwrap(),
            RouterSpec::Kvgate("kv_aware".into())
        );
        assert_eq!(
            RouterSpec::parse("vllm-router:cache_aware").unwrap(),
            RouterSpec::VllmRouter("cache_aware".into())
        );
        assert_eq!(
            RouterSpec::parse("sglang-router:cache_aware")
                .unwrap()
                .label(),
            "sglang-router:cache_aware"
        );
        assert!(RouterSpec::parse("nginx:rr").is_err());
        assert!(RouterSpec::parse("kvgate:").is_err());
    }

    #[test]
    fn default_lineup_has_every_policy_and_the_peers() {
        let labels: Vec<String> = RouterSpec::default_lineup()
            .iter()
            .map(RouterSpec::label)
            .collect();
        for p in KVGATE_POLICIES {
            assert!(labels.contains(&p.to_string()));
        }
        assert!(labels.contains(&"vllm-router:kv_aware".to_string()));
        assert!(labels.contains(&"sglang-router:cache_aware".to_string()));
    }
}
