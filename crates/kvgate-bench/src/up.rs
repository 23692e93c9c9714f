//! `kvgate up`: a live local fleet in one command. Starts N simulated engines (KV events
//! and replay on), a kvgate gateway in front of them (kv_aware by default, tokenizing
//! through the engines' `/tokenize`), waits until both answer, prints the gateway's URL
//! and copy-paste `curl` commands, and runs until Ctrl-C or SIGTERM, then stops
//! everything it started.
//!
//! Owns only the orchestration and what it prints; engines and the gateway are `kvgate`
//! child processes (fleet.rs, routers.rs), killed with their process groups even if
//! this process dies. It must not contain routing or engine logic.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

use crate::fleet::{EngineConfig, Fleet};
use crate::process::ManagedChild;
use crate::routers::{command_line, PolicySpec, RouterContext, RouterSpec};

/// The model name the simulated engines serve.
pub const MODEL: &str = "mock-model";
/// The line printed once everything answers (tests wait for it).
pub const READY_LINE: &str = "kvgate is up:";

/// `kvgate up`.
#[derive(clap::Args, Debug, Clone)]
pub struct UpArgs {
    /// Simulated engines.
    #[arg(long, default_value_t = 2)]
    pub engines: usize,
    /// Gateway port on 127.0.0.1.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Routing policy (a kvgate policy, optionally with options: kv_aware@overlap-weight=8;
    /// kv_aware@pd=vllm splits the engines into prefill and decode engines).
    #[arg(long, default_value = "kv_aware")]
    pub policy: String,
    /// KV block size of the engines (tokens).
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV blocks per engine.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: u32,
    /// Simulated-time speedup of the engines (1 = the H100 latency model in real time).
    #[arg(long, default_value_t = 1.0)]
    pub engine_speedup: f64,
    /// Extra argument for `kvgate serve` (repeatable).
    #[arg(long, allow_hyphen_values = true)]
    pub kvgate_arg: Vec<String>,
    /// The kvgate binary (default: this executable).
    #[arg(long)]
    pub kvgate_bin: Option<PathBuf>,
    /// Where the engines' and the gateway's logs go (default: a new folder in /tmp).
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
}

/// Runs `kvgate up` until Ctrl-C or SIGTERM.
pub async fn run_up(args: UpArgs) -> anyhow::Result<()> {
    let kvgate_bin = crate::cli::resolve_kvgate_bin(args.kvgate_bin.as_deref())?;
    let log_dir = args
        .log_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("kvgate-up-{}", std::process::id())));
    let spec = RouterSpec::Kvgate(PolicySpec::parse(&args.policy)?);
    let engines = args.engines.max(1);
    let engine_cfg = EngineConfig {
        kvgate_bin: kvgate_bin.clone(),
        engines,
        block_size: args.block_size,
        num_blocks: args.num_blocks,
        speedup: args.engine_speedup,
        seed: 0,
        extra_args: Vec::new(),
        startup_timeout: Duration::from_secs(60),
        // `--policy kv_aware@pd=vllm`: prefill and decode engines, kvgate in its
        // disaggregated mode.
        pd: spec.policy_spec().pd_fleet(engines),
    };
    // Hold the gateway's port while the engines start: it is taken now or never (a
    // clear error before anything starts), and no engine is given it.
    let reserved = std::net::TcpListener::bind(("127.0.0.1", args.port)).with_context(|| {
        format!(
            "port {} is taken on 127.0.0.1; choose another with --port",
            args.port
        )
    })?;
    eprintln!("starting {} simulated engines...", engine_cfg.engines);
    let fleet = Fleet::start(&engine_cfg, &log_dir)
        .await
        .context("starting the simulated engines")?;
    drop(reserved);
    let ctx = RouterContext {
        kvgate_bin,
        model: MODEL.into(),
        block_size: args.block_size,
        log_dir: log_dir.clone(),
        startup_timeout: Duration::from_secs(60),
        kvgate_extra_args: args.kvgate_arg.clone(),
    };
    let Some((bin, mut serve_args)) = command_line(&spec, &ctx, fleet.addrs(), args.port, 0) else {
        anyhow::bail!("cannot build the kvgate serve command line");
    };
    serve_args.extend(["--host".into(), "127.0.0.1".into()]);
    let mut gateway = ManagedChild::spawn("gateway", &bin, &serve_args, &log_dir)?;
    let url = format!("http://127.0.0.1:{}", args.port);
    gateway
        .wait_for_http(
            &[format!("{url}/health"), format!("{url}/v1/models")],
            Duration::from_secs(60),
        )
        .await
        .with_context(|| {
            format!(
                "the gateway did not start (is port {} free? try --port); its log: {}",
                args.port,
                log_dir.join("gateway.err.log").display()
            )
        })?;
    // Whatever answered must be this gateway, not another server that took the port
    // after it was released (the gateway then failed to bind and exits).
    if !answers_as_kvgate(&url).await {
        anyhow::bail!(
            "something other than the gateway answers on port {}; choose another with --port (the gateway's log: {})",
            args.port,
            log_dir.join("gateway.err.log").display()
        );
    }
    println!("{}", banner(&url, &args, fleet.addrs().len(), &log_dir));
    wait_for_stop().await;
    eprintln!("stopping the gateway and the engines...");
    gateway.shutdown().await;
    fleet.shutdown().await;
    Ok(())
}

/// Whether the server at `url` is a kvgate gateway: its `/ready` (never behind a key)
/// answers kvgate's readiness object, which an engine does not have.
async fn answers_as_kvgate(url: &str) -> bool {
    let Ok(http) = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
    else {
        return false;
    };
    let Ok(resp) = http.get(format!("{url}/ready")).send().await else {
        return false;
    };
    let Ok(ready) = resp.json::<serde_json::Value>().await else {
        return false;
    };
    ready["ready"].is_boolean() && ready["models"].is_array()
}

/// What `kvgate up` prints once everything answers: the URL and commands to try.
pub fn banner(url: &str, args: &UpArgs, engines: usize, log_dir: &std::path::Path) -> String {
    let json = "-H 'content-type: application/json'";
    let chat = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hello! What is a KV cache?"}}],"max_tokens":32}}"#
    );
    let stream = format!(
        r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hello! What is a KV cache?"}}],"max_tokens":32,"stream":true}}"#
    );
    format!(
        "{READY_LINE} {url}  ({policy} over {engines} simulated engines; Ctrl-C stops everything)\n\
         \n\
         chat:       curl -s {url}/v1/chat/completions {json} -d '{chat}'\n\
         streaming:  curl -sN {url}/v1/chat/completions {json} -d '{stream}'\n\
         explain:    curl -s {url}/v1/route/explain {json} -d '{chat}'\n\
         metrics:    curl -s {url}/metrics\n\
         \n\
         logs: {logs}",
        policy = args.policy,
        logs = log_dir.display(),
    )
}

async fn wait_for_stop() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
