//! `kvgate mock-engine`: command-line flags and the process entry point.
//!
//! Owns flag parsing and the ready line the bench harness waits for. Everything else
//! is delegated to [`crate::engine::spawn`].

use std::path::PathBuf;

use clap::Args;

use crate::engine::{spawn, EngineConfig};
use crate::kv_publisher::PublisherConfig;
use crate::latency::LatencyModel;
use crate::scheduler::SimConfig;

/// Run one simulated vLLM-compatible engine.
#[derive(Args, Debug, Clone)]
pub struct MockEngineArgs {
    /// HTTP port (0 = ephemeral).
    #[arg(long, default_value_t = 8001)]
    pub port: u16,
    /// Interface to bind HTTP and KV event sockets on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Served model name.
    #[arg(long, default_value = "mock-model")]
    pub model: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// KV cache size in blocks.
    #[arg(long, default_value_t = 16384)]
    pub num_blocks: u32,
    /// Maximum running requests per step (vLLM's `--max-num-seqs`; default: vLLM's on
    /// an H100, the latency model's GPU).
    #[arg(long, default_value_t = SimConfig::default().max_num_seqs)]
    pub max_num_seqs: u32,
    /// Token budget per step, chunked prefill (vLLM's `--max-num-batched-tokens`;
    /// default: vLLM's on an H100).
    #[arg(long, alias = "max-num-batched-tokens", default_value_t = SimConfig::default().max_batched_tokens)]
    pub max_batched_tokens: u32,
    /// Maximum prompt + output length (also capped by the cache size).
    #[arg(long, default_value_t = 131072)]
    pub max_model_len: u32,
    /// ZeroMQ PUB port for KV events (0 or absent = off).
    #[arg(long)]
    pub kv_events_port: Option<u16>,
    /// ZeroMQ ROUTER replay port (absent = no replay socket).
    #[arg(long)]
    pub replay_port: Option<u16>,
    /// KV events topic.
    #[arg(long, default_value = "kv")]
    pub topic: String,
    /// Data-parallel rank written into every event batch.
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    /// Refuse request bodies above this many bytes with a text/plain 413 (vLLM sets no
    /// limit; a proxy in front of it may).
    #[arg(long, default_value_t = 256 << 20)]
    pub max_body_bytes: usize,
    /// Event batches kept for replay.
    #[arg(long, default_value_t = 10000)]
    pub replay_buffer: usize,
    /// Simulated time runs this many times faster than real time.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Seeds the engine's opaque block hashes and simulated EOS positions.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Directory with tokenizer.json (+ tokenizer_config.json); default: a
    /// deterministic whitespace tokenizer that needs no model files.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// `max_tokens` for requests that give none.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,
    /// Per-token probability of an early EOS for requests without ignore_eos.
    #[arg(long, default_value_t = 0.0)]
    pub eos_probability: f64,
    /// Prefill latency: a in a·T² + b·T + c (ms, T = uncached tokens in the step).
    #[arg(long, default_value_t = 4.21e-7, allow_negative_numbers = true)]
    pub prefill_a: f64,
    #[arg(long, default_value_t = 1.52e-2, allow_negative_numbers = true)]
    pub prefill_b: f64,
    #[arg(long, default_value_t = 16.5, allow_negative_numbers = true)]
    pub prefill_c: f64,
    /// Decode latency: max(floor, d·u² + e·u + f) ms, u = KV usage fraction.
    #[arg(long, default_value_t = -25.74, allow_negative_numbers = true)]
    pub decode_d: f64,
    #[arg(long, default_value_t = 54.01, allow_negative_numbers = true)]
    pub decode_e: f64,
    #[arg(long, default_value_t = 5.74, allow_negative_numbers = true)]
    pub decode_f: f64,
    #[arg(long, default_value_t = 1.0)]
    pub decode_floor_ms: f64,
    /// Disaggregated serving: KV transfer time per prompt token, ms.
    #[arg(long, default_value_t = LatencyModel::default().kv_transfer_ms_per_token)]
    pub kv_transfer_ms_per_token: f64,
    /// Each step's duration times a log-normal factor of mean 1 and this log standard
    /// deviation (0: deterministic steps; about 0.5 is a CPU engine on a shared host).
    #[arg(long, default_value_t = 0.0)]
    pub step_jitter: f64,
    /// Prefill/decode disaggregation: this engine's role (prefill or decode); absent =
    /// an ordinary engine that does both.
    #[arg(long, requires = "pd_mode")]
    pub role: Option<crate::disaggregation::PdRole>,
    /// With --role: the transfer protocol, vllm (kv_transfer_params, as with NIXL) or
    /// sglang (bootstrap server and rooms).
    #[arg(long, requires = "role")]
    pub pd_mode: Option<crate::disaggregation::PdMode>,
    /// With --role prefill --pd-mode sglang: the bootstrap server's port (0 = ephemeral).
    #[arg(long, default_value_t = 0)]
    pub bootstrap_port: u16,
    /// Disaggregated serving: how long a prefill engine holds KV for its decode engine,
    /// and how long a decode engine waits for it, ms.
    #[arg(long, default_value_t = 30_000)]
    pub kv_transfer_timeout_ms: u64,
}

impl MockEngineArgs {
    /// The engine configuration these flags describe.
    pub fn to_config(&self) -> anyhow::Result<EngineConfig> {
        if !(self.speedup.is_finite() && self.speedup > 0.0) {
            anyhow::bail!("--speedup must be a positive number");
        }
        if !(self.step_jitter.is_finite() && self.step_jitter >= 0.0) {
            anyhow::bail!("--step-jitter must be a number at least 0");
        }
        if !(0.0..=1.0).contains(&self.eos_probability) {
            anyhow::bail!("--eos-probability must be within 0..=1");
        }
        let latency = LatencyModel {
            prefill_a: self.prefill_a,
            prefill_b: self.prefill_b,
            prefill_c: self.prefill_c,
            decode_d: self.decode_d,
            decode_e: self.decode_e,
            decode_f: self.decode_f,
            decode_floor_ms: self.decode_floor_ms,
            kv_transfer_ms_per_token: self.kv_transfer_ms_per_token,
            step_jitter: self.step_jitter,
        };
        let sim = SimConfig {
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_num_seqs: self.max_num_seqs,
            max_batched_tokens: self.max_batched_tokens,
            max_model_len: self.max_model_len,
            seed: self.seed,
            latency,
            eos_probability: self.eos_probability,
            ..SimConfig::default()
        };
        sim.validate()?;
        let kv_events = match self.kv_events_port {
            None | Some(0) => None,
            Some(port) => Some(PublisherConfig {
                host: self.host.clone(),
                port,
                replay_port: self.replay_port,
                topic: self.topic.clone(),
                dp_rank: self.dp_rank,
                replay_buffer: self.replay_buffer,
            }),
        };
        Ok(EngineConfig {
            sim,
            host: self.host.clone(),
            port: self.port,
            model: self.model.clone(),
            speedup: self.speedup,
            kv_events,
            tokenizer: self.tokenizer.clone(),
            default_max_tokens: self.default_max_tokens,
            max_body_bytes: self.max_body_bytes,
            pd: match (self.role, self.pd_mode) {
                (Some(role), Some(mode)) => Some(crate::disaggregation::PdConfig {
                    role,
                    mode,
                    bootstrap_port: self.bootstrap_port,
                    transfer_timeout: std::time::Duration::from_millis(self.kv_transfer_timeout_ms),
                }),
                _ => None,
            },
        })
    }
}

/// Entry point of `kvgate mock-engine`: serve until Ctrl-C / SIGTERM.
pub async fn run(args: MockEngineArgs) -> anyhow::Result<()> {
    let config = args.to_config()?;
    let engine = spawn(config).await?;
    println!(
        "mock-engine ready port={} kv_events={} replay={} bootstrap={}",
        engine.http_addr.port(),
        engine.kv_events_endpoint.as_deref().unwrap_or("off"),
        engine.replay_endpoint.as_deref().unwrap_or("off"),
        engine
            .bootstrap_addr
            .map_or_else(|| "off".to_string(), |a| a.port().to_string()),
    );
    tracing::info!(addr = %engine.http_addr, "mock engine listening");
    wait_for_signal().await;
    engine.shutdown().await;
    Ok(())
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
