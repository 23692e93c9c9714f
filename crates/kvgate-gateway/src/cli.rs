//! `kvgate serve`: command-line flags, building the [`Config`] from them (or from
//! `--config FILE`, with global flags overriding the file), and running until SIGTERM
//! or ctrl-c. Must not contain gateway logic.

use std::path::PathBuf;

use anyhow::bail;
use kvgate_core::{KvAwareConfig, PolicyKind};

use crate::config::{
    normalize_url, parse_assignment, Config, FailoverConfig, HealthConfig, LimitsConfig,
    ModelConfig, PeersConfig, TimeoutsConfig, WorkerConfig, WorkersDnsConfig,
};

/// Help headings of `kvgate serve --help`.
const MODEL: &str = "One model (without --config)";
const KV_AWARE: &str = "kv_aware policy";
const AUTH: &str = "Authentication";
const LIMITS: &str = "Admission limits";
const UPSTREAM: &str = "Upstream timeouts, health and failover";
const PEERS: &str = "Replicas sharing load";
const PD: &str = "Prefill/decode disaggregation (without --config)";

/// A flag's help with the default it falls back to, read from the config's own
/// `Default` so the two cannot drift (the flag stays optional: unset, a `--config`
/// file's value applies).
fn with_default(text: &str, default: impl std::fmt::Display) -> String {
    format!("{text} [default: {default}]")
}

/// `err` from parsing a `kvgate serve` command line, or, where it is an unknown flag
/// that was a kv_aware option, the reason that option was removed: an operator's
/// command line must not change meaning without a word.
pub fn explain_removed_flag(err: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    if err.kind() != ErrorKind::UnknownArgument {
        return err;
    }
    let Some(ContextValue::String(arg)) = err.get(ContextKind::InvalidArg) else {
        return err;
    };
    let flag = arg.split('=').next().unwrap_or(arg);
    match kvgate_core::removed_kv_aware_option(flag) {
        Some(why) => clap::Error::raw(ErrorKind::UnknownArgument, format!("{why}\n")),
        None => err,
    }
}

/// Overrides `dst` with a flag's value when the flag was given.
fn set<T: Clone>(dst: &mut T, v: &Option<T>) {
    if let Some(v) = v {
        *dst = v.clone();
    }
}

/// Run the OpenAI-compatible routing gateway.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ServeArgs {
    /// YAML config file (may declare several models). Model flags below are then not allowed.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    #[arg(long, help = with_default("Interface to listen on", Config::default().host))]
    pub host: Option<String>,
    #[arg(long, help = with_default("Port to listen on", Config::default().port))]
    pub port: Option<u16>,

    /// Served model name (what clients send as "model"); required without --config.
    #[arg(long, help_heading = MODEL, required_unless_present = "config")]
    pub model: Option<String>,
    /// Engine replica base URL (repeat for each replica). With --pd-mode, the decode
    /// pool (--decode-worker is the same flag).
    #[arg(long = "worker", visible_alias = "decode-worker", value_name = "URL", help_heading = MODEL)]
    pub workers: Vec<String>,
    /// Prefill/decode disaggregation: vllm (KV connectors such as NIXL: prefill with
    /// max_tokens 1, its kv_transfer_params to decode) or sglang (both at once, paired by
    /// a bootstrap room). --policy then chooses the prefill worker.
    #[arg(long, value_name = "MODE", help_heading = PD)]
    pub pd_mode: Option<crate::config::PdMode>,
    /// With --pd-mode: a prefill worker's base URL (repeat). Its KV events are given
    /// with --kv-events URL=ENDPOINT like any worker's.
    #[arg(long = "prefill-worker", value_name = "URL", help_heading = PD, requires = "pd_mode")]
    pub prefill_workers: Vec<String>,
    /// With --pd-mode sglang: a prefill worker's bootstrap port, URL=PORT (repeat).
    #[arg(long = "bootstrap-port", value_name = "URL=PORT", help_heading = PD, requires = "pd_mode")]
    pub bootstrap_ports: Vec<String>,
    /// With --pd-mode: the decode pool's policy (default: kv_aware when decode workers
    /// publish KV events, least_loaded otherwise).
    #[arg(long, value_name = "POLICY", help_heading = PD, requires = "pd_mode")]
    pub decode_policy: Option<PolicyKind>,
    #[arg(long, value_name = "TOKENS", help_heading = PD, requires = "pd_mode", help = with_default("With --pd-mode: prompts with fewer uncached tokens than this go to a decode worker whole, without a prefill leg (0 = never)", 0))]
    pub pd_uncached_token_threshold: Option<u32>,
    #[arg(long, help_heading = MODEL, help = with_default("Routing policy: round_robin, random, least_loaded, session, prefix_affinity, kv_aware", PolicyKind::default()))]
    pub policy: Option<PolicyKind>,
    /// Directory with tokenizer.json (+ tokenizer_config.json) for local tokenization.
    #[arg(long, value_name = "DIR", help_heading = MODEL)]
    pub tokenizer: Option<PathBuf>,
    /// Tokenize with a replica's POST /tokenize instead of locally.
    #[arg(long, help_heading = MODEL)]
    pub remote_tokenize: bool,
    /// The engines' context length in tokens: longer prompts get 400
    /// context_length_exceeded before they are fully tokenized.
    #[arg(long, value_name = "TOKENS", help_heading = MODEL)]
    pub max_model_len: Option<u32>,
    /// Local tokenization keeps the ids of text it already encoded, up to this many
    /// MiB, so a conversation's history is not encoded again at every turn (0 = off).
    #[arg(long, value_name = "MIB", default_value_t = 128, help_heading = MODEL)]
    pub tokenize_cache_mib: u64,
    /// Workers from a DNS name, NAME:PORT (a Kubernetes headless Service of engine
    /// pods): every address is a worker at http://ADDRESS:PORT, re-resolved every 5 s
    /// (new addresses join, vanished ones leave).
    #[arg(long, value_name = "NAME:PORT", help_heading = MODEL)]
    pub workers_dns: Option<String>,
    /// With --workers-dns: the engines' KV-event port (events at tcp://ADDRESS:PORT).
    #[arg(long, value_name = "PORT", help_heading = MODEL, requires = "workers_dns")]
    pub workers_dns_kv_events_port: Option<u16>,
    /// With --workers-dns: the engines' KV-event replay port.
    #[arg(long, value_name = "PORT", help_heading = MODEL, requires = "workers_dns_kv_events_port")]
    pub workers_dns_replay_port: Option<u16>,
    /// KV events of a worker: WORKER_URL=tcp://HOST:PORT (repeat per worker).
    #[arg(long = "kv-events", value_name = "URL=ENDPOINT", help_heading = MODEL)]
    pub kv_events: Vec<String>,
    /// Replay endpoint of a worker: WORKER_URL=tcp://HOST:PORT.
    #[arg(long = "kv-events-replay", value_name = "URL=ENDPOINT", help_heading = MODEL)]
    pub kv_events_replay: Vec<String>,
    /// ZeroMQ topic prefix to subscribe to ("" = all).
    #[arg(long, default_value = "", help_heading = MODEL)]
    pub kv_topic: String,
    /// How often each worker's queue is read from its metrics (GET /metrics: requests
    /// running and waiting), so requests nobody booked through kvgate count as load
    /// (0 = never).
    #[arg(long, value_name = "MS", default_value_t = ModelConfig::default().engine_metrics_interval_ms, help_heading = MODEL)]
    pub engine_metrics_interval_ms: u64,
    /// Data-parallel ranks per worker (rank r publishes events on port + r).
    #[arg(long, default_value_t = 1, help_heading = MODEL)]
    pub dp_size: u32,
    /// Tokens per KV block (must match the engines).
    #[arg(long, default_value_t = 16, help_heading = MODEL)]
    pub block_size: u32,
    /// The engines' --max-num-seqs (sequences an engine step runs at most; beyond it
    /// requests wait for a slot). Default: vLLM's on an H100; vLLM defaults to 256 on
    /// smaller GPUs and 128 on CPUs.
    #[arg(long, value_name = "N", default_value_t = ModelConfig::default().max_num_seqs, help_heading = MODEL)]
    pub max_num_seqs: u32,
    /// The engines' --max-num-batched-tokens (tokens an engine step computes at most).
    /// Default: vLLM's on an H100; 2048 on smaller GPUs and CPUs.
    #[arg(long, value_name = "N", default_value_t = ModelConfig::default().max_num_batched_tokens, help_heading = MODEL)]
    pub max_num_batched_tokens: u32,
    /// The engines' KV-cache size in blocks (vLLM's num_gpu_blocks): requests beyond
    /// what fits wait as behind a full batch. Default: what each vLLM engine's
    /// /metrics says (vllm:cache_config_info), else no limit.
    #[arg(long, value_name = "BLOCKS", help_heading = MODEL)]
    pub num_gpu_blocks: Option<u32>,
    /// Time-to-first-token objective of a request whose headers (x-slo-ttft-ms,
    /// x-llm-d-slo-ttft-ms) name none: requests go where it is predicted to be met, and
    /// sheddable ones (x-priority below 0) get 429 when nowhere is.
    #[arg(long, value_name = "MS", help_heading = MODEL)]
    pub slo_ttft_ms: Option<u64>,
    /// Time-per-output-token objective of a request whose headers name none.
    #[arg(long, value_name = "MS", help_heading = MODEL)]
    pub slo_tpot_ms: Option<u64>,
    /// kv_aware without any KV event source: route with this policy instead of 503.
    #[arg(long, value_name = "POLICY", help_heading = MODEL)]
    pub kv_fallback: Option<PolicyKind>,
    /// Header carrying the session key for the session policy.
    #[arg(long, default_value = "x-session-id", help_heading = MODEL)]
    pub session_header: String,
    /// A LoRA adapter name served by the workers (repeat).
    #[arg(long = "lora-adapter", value_name = "NAME", help_heading = MODEL)]
    pub lora_adapters: Vec<String>,
    /// Extra salt folded into block keys (the same on every replica of the fleet;
    /// YAML `hash_salt`).
    #[arg(long, value_name = "TEXT", help_heading = MODEL)]
    pub hash_salt: Option<String>,
    #[arg(long, help_heading = KV_AWARE, help = with_default("kv_aware: weight of a block of prefill against a block of decode", KvAwareConfig::default().overlap_weight))]
    pub overlap_weight: Option<f64>,
    #[arg(long, help_heading = KV_AWARE, help = with_default("kv_aware: extra weight of the best-cached worker's lead over the runner-up, which keeps a conversation with its history (0 = DESIGN cost only)", KvAwareConfig::default().locality_weight))]
    pub locality_weight: Option<f64>,
    #[arg(long, help_heading = KV_AWARE, help = with_default("kv_aware: longest time a prompt still being prefilled counts as cached on its worker; the credit ends at its first token anyway (0 = off)", KvAwareConfig::default().pending_credit_secs))]
    pub pending_credit_secs: Option<f64>,
    #[arg(long, help_heading = KV_AWARE, help = with_default("kv_aware warm-up: a worker whose index holds less than this fraction of the workers' mean (just added, restarted or reset) may not be more than one request in flight behind any other (0 = off)", KvAwareConfig::default().warmup_fraction))]
    pub warmup_fraction: Option<f64>,
    /// Seed for the policy's random choices (unset: seeded from the OS).
    #[arg(long, help_heading = KV_AWARE)]
    pub seed: Option<u64>,

    /// Clients must send Authorization: Bearer KEY.
    #[arg(long, env = "KVGATE_API_KEY", hide_env_values = true, help_heading = AUTH)]
    pub api_key: Option<String>,
    /// Enables the admin API, guarded by this bearer token.
    #[arg(long, env = "KVGATE_ADMIN_TOKEN", hide_env_values = true, help_heading = AUTH)]
    pub admin_token: Option<String>,
    /// Bearer token sent to the workers.
    #[arg(long, env = "KVGATE_WORKER_API_KEY", hide_env_values = true, help_heading = AUTH)]
    pub worker_api_key: Option<String>,
    /// /metrics requires Authorization: Bearer TOKEN (it lists worker URLs).
    #[arg(long, env = "KVGATE_METRICS_TOKEN", hide_env_values = true, help_heading = AUTH)]
    pub metrics_token: Option<String>,

    #[arg(long, help_heading = LIMITS, help = with_default("Max requests in flight across the gateway (0 = unlimited)", LimitsConfig::default().max_in_flight))]
    pub max_in_flight: Option<usize>,
    #[arg(long, help_heading = LIMITS, help = with_default("Max requests in flight per worker (0 = unlimited)", LimitsConfig::default().max_in_flight_per_worker))]
    pub max_in_flight_per_worker: Option<u32>,
    #[arg(long, help_heading = LIMITS, help = with_default("Requests allowed to wait for a slot before 429", LimitsConfig::default().max_queue))]
    pub max_queue: Option<usize>,
    #[arg(long, help_heading = LIMITS, help = with_default("Longest wait for a slot before 429, in ms", LimitsConfig::default().queue_timeout_ms))]
    pub queue_timeout_ms: Option<u64>,
    #[arg(long, help_heading = LIMITS, help = with_default("Largest accepted request body, in bytes", LimitsConfig::default().max_body_bytes))]
    pub max_body_bytes: Option<usize>,
    #[arg(long, help_heading = LIMITS, help = with_default("Requests with a body of 16 KiB or more parsed and tokenized at once (0 = one per CPU core): bounds the memory large bodies take", LimitsConfig::default().large_body_concurrency))]
    pub large_body_concurrency: Option<usize>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Upstream connect timeout, ms (0 = none)", TimeoutsConfig::default().connect_ms))]
    pub connect_timeout_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Upstream time to the answer's start (its head; for a stream, its first event), ms (0 = none)", TimeoutsConfig::default().first_byte_ms))]
    pub first_byte_timeout_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Upstream whole-request timeout, ms (0 = none)", TimeoutsConfig::default().total_ms))]
    pub request_timeout_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Active health check interval, ms (0 = off)", HealthConfig::default().interval_ms))]
    pub health_interval_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Health check interval for a worker out of rotation, so a restarted engine is back within it, ms (0 = the regular interval)", HealthConfig::default().unhealthy_interval_ms))]
    pub health_unhealthy_interval_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Health check timeout, ms", HealthConfig::default().timeout_ms))]
    pub health_timeout_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Consecutive failures that take a worker out of rotation", HealthConfig::default().failure_threshold))]
    pub failure_threshold: Option<u32>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("How long an open circuit breaker keeps a worker out, ms", HealthConfig::default().open_ms))]
    pub breaker_open_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("A worker whose engine sends no answer byte and no KV event for this long while it holds requests is stalled: out of rotation, its requests cut off (waiting ones go elsewhere), until a one-token completion answers; ms (0 = off; only workers whose KV events kvgate reads, as kv_aware does)", HealthConfig::default().stall_ms))]
    pub stall_timeout_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Attempts per request on distinct workers before giving up (1 = no retry)", FailoverConfig::default().max_attempts))]
    pub max_attempts: Option<u32>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Backoff before the first retry, ms (doubles per attempt)", FailoverConfig::default().backoff_ms))]
    pub retry_backoff_ms: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Bookings older than this are freed by the ledger sweep, seconds", Config::default().ledger_ttl_secs))]
    pub ledger_ttl_secs: Option<u64>,
    #[arg(long, help_heading = UPSTREAM, help = with_default("Grace period for in-flight requests on shutdown, seconds", Config::default().shutdown_grace_secs))]
    pub shutdown_grace_secs: Option<u64>,

    /// Another kvgate replica in front of the same workers, http://HOST:PORT (repeat):
    /// each reports its bookings to the others, and every replica scores the whole
    /// fleet's load. Peers authenticate with --admin-token when one is set.
    #[arg(long = "peer", value_name = "URL", help_heading = PEERS)]
    pub peers: Vec<String>,
    /// The replicas as one DNS name, NAME:PORT (a Kubernetes headless Service),
    /// re-resolved periodically; this replica's own address is skipped.
    #[arg(long, value_name = "NAME:PORT", help_heading = PEERS)]
    pub peers_dns: Option<String>,
    /// This replica's name among its peers, stable across restarts (a pod name)
    /// [default: HOSTNAME/LISTEN_ADDRESS:PORT].
    #[arg(long, env = "KVGATE_REPLICA_ID", help_heading = PEERS)]
    pub replica_id: Option<String>,
    #[arg(long, value_name = "MS", help_heading = PEERS, help = with_default("A peer not heard from for this long loses its bookings here, ms", PeersConfig::default().expiry_ms))]
    pub peer_expiry_ms: Option<u64>,
    #[arg(long, value_name = "MS", help_heading = PEERS, help = with_default("How often this replica looks for a change in its bookings to report to its peers, ms", PeersConfig::default().publish_ms))]
    pub peer_publish_ms: Option<u64>,
    /// Where replicas choose workers: `leader` (the longest-running connected
    /// replica chooses for all, so requests reaching several replicas at once are
    /// decided in order) or `local` (each on its peers' last reports) [default:
    /// leader].
    #[arg(long, value_name = "WHERE", help_heading = PEERS)]
    pub peer_decisions: Option<crate::config::PeerDecisions>,
    #[arg(long, value_name = "MS", help_heading = PEERS, help = with_default("How long a replica waits for the leader's choice before choosing itself, ms", PeersConfig::default().decide_timeout_ms))]
    pub peer_decide_timeout_ms: Option<u64>,
}

fn has_model_flags(a: &ServeArgs) -> bool {
    a.model.is_some()
        || !a.workers.is_empty()
        || a.pd_mode.is_some()
        || a.workers_dns.is_some()
        || a.policy.is_some()
        || a.tokenizer.is_some()
        || a.remote_tokenize
        || a.max_model_len.is_some()
        || !a.kv_events.is_empty()
        || !a.kv_events_replay.is_empty()
        || a.kv_fallback.is_some()
        || !a.lora_adapters.is_empty()
        || a.hash_salt.is_some()
}

impl ServeArgs {
    /// Builds and validates the config these flags describe.
    pub fn to_config(&self) -> anyhow::Result<Config> {
        let mut config = match &self.config {
            Some(path) => {
                if has_model_flags(self) {
                    bail!("--config declares the models; do not combine it with --model/--worker/--policy/--tokenizer/--kv-events flags");
                }
                Config::from_yaml_file(path)?
            }
            None => Config {
                models: vec![self.model_config()?],
                ..Config::default()
            },
        };
        self.apply_globals(&mut config);
        config.validate()?;
        Ok(config)
    }

    fn model_config(&self) -> anyhow::Result<ModelConfig> {
        let Some(name) = self.model.clone() else {
            bail!("pass --model NAME (the model name clients send) and at least one --worker URL, or --config FILE");
        };
        let pool = |urls: &[String]| -> Vec<WorkerConfig> {
            urls.iter()
                .map(|u| WorkerConfig {
                    dp_size: self.dp_size,
                    ..WorkerConfig::new(normalize_url(u))
                })
                .collect()
        };
        let mut workers = pool(&self.workers);
        let mut prefill_workers = pool(&self.prefill_workers);
        for (flag, list, replay) in [
            ("--kv-events", &self.kv_events, false),
            ("--kv-events-replay", &self.kv_events_replay, true),
        ] {
            for a in list {
                let (url, endpoint) = parse_assignment(a)?;
                let Some(w) = workers
                    .iter_mut()
                    .chain(prefill_workers.iter_mut())
                    .find(|w| w.url == url)
                else {
                    bail!(
                        "{flag} {a}: {url} is not one of the --worker (or --prefill-worker) URLs"
                    );
                };
                if replay {
                    w.kv_events_replay = Some(endpoint);
                } else {
                    w.kv_events = Some(endpoint);
                }
            }
        }
        for a in &self.bootstrap_ports {
            let (url, port) = parse_assignment(a)?;
            let Some(w) = prefill_workers.iter_mut().find(|w| w.url == url) else {
                bail!("--bootstrap-port {a}: {url} is not one of the --prefill-worker URLs");
            };
            w.bootstrap_port =
                Some(port.parse().map_err(|_| {
                    anyhow::anyhow!("--bootstrap-port {a}: {port:?} is not a port")
                })?);
        }
        let pd = self.pd_mode.map(|mode| crate::config::PdConfig {
            mode,
            prefill_workers,
            decode_policy: self.decode_policy,
            uncached_token_threshold: self.pd_uncached_token_threshold.unwrap_or(0),
            // Prefill engines found through DNS or Kubernetes: YAML only.
            ..crate::config::PdConfig::default()
        });
        let mut m = ModelConfig {
            name,
            workers,
            policy: self.policy.unwrap_or_default(),
            seed: self.seed,
            tokenizer: self.tokenizer.clone(),
            remote_tokenize: self.remote_tokenize,
            max_model_len: self.max_model_len,
            tokenize_cache_mib: self.tokenize_cache_mib,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            num_gpu_blocks: self.num_gpu_blocks,
            slo_ttft_ms: self.slo_ttft_ms,
            slo_tpot_ms: self.slo_tpot_ms,
            kv_fallback: self.kv_fallback,
            session_header: self.session_header.clone(),
            lora_adapters: self.lora_adapters.clone(),
            hash_salt: self.hash_salt.clone(),
            kv_topic: self.kv_topic.clone(),
            engine_metrics_interval_ms: self.engine_metrics_interval_ms,
            workers_dns: self.workers_dns.as_ref().map(|name| WorkersDnsConfig {
                name: name.clone(),
                kv_events_port: self.workers_dns_kv_events_port,
                kv_events_replay_port: self.workers_dns_replay_port,
                dp_size: self.dp_size,
                ..WorkersDnsConfig::default()
            }),
            pd,
            ..ModelConfig::default()
        };
        let k = &mut m.kv_aware;
        set(&mut k.overlap_weight, &self.overlap_weight);
        set(&mut k.locality_weight, &self.locality_weight);
        set(&mut k.pending_credit_secs, &self.pending_credit_secs);
        set(&mut k.warmup_fraction, &self.warmup_fraction);
        Ok(m)
    }

    fn apply_globals(&self, c: &mut Config) {
        set(&mut c.host, &self.host);
        set(&mut c.port, &self.port);
        if self.api_key.is_some() {
            c.api_key = self.api_key.clone();
        }
        if self.admin_token.is_some() {
            c.admin_token = self.admin_token.clone();
        }
        if self.metrics_token.is_some() {
            c.metrics_token = self.metrics_token.clone();
        }
        if self.worker_api_key.is_some() {
            c.worker_api_key = self.worker_api_key.clone();
        }
        set(&mut c.limits.max_in_flight, &self.max_in_flight);
        set(
            &mut c.limits.max_in_flight_per_worker,
            &self.max_in_flight_per_worker,
        );
        set(&mut c.limits.max_queue, &self.max_queue);
        set(&mut c.limits.queue_timeout_ms, &self.queue_timeout_ms);
        set(&mut c.limits.max_body_bytes, &self.max_body_bytes);
        set(
            &mut c.limits.large_body_concurrency,
            &self.large_body_concurrency,
        );
        set(&mut c.timeouts.connect_ms, &self.connect_timeout_ms);
        set(&mut c.timeouts.first_byte_ms, &self.first_byte_timeout_ms);
        set(&mut c.timeouts.total_ms, &self.request_timeout_ms);
        set(&mut c.health.interval_ms, &self.health_interval_ms);
        set(
            &mut c.health.unhealthy_interval_ms,
            &self.health_unhealthy_interval_ms,
        );
        set(&mut c.health.timeout_ms, &self.health_timeout_ms);
        set(&mut c.health.failure_threshold, &self.failure_threshold);
        set(&mut c.health.open_ms, &self.breaker_open_ms);
        set(&mut c.health.stall_ms, &self.stall_timeout_ms);
        set(&mut c.failover.max_attempts, &self.max_attempts);
        set(&mut c.failover.backoff_ms, &self.retry_backoff_ms);
        set(&mut c.ledger_ttl_secs, &self.ledger_ttl_secs);
        set(&mut c.shutdown_grace_secs, &self.shutdown_grace_secs);
        if !self.peers.is_empty() {
            c.peers.urls = self.peers.iter().map(|u| normalize_url(u)).collect();
        }
        if self.peers_dns.is_some() {
            c.peers.dns = self.peers_dns.clone();
        }
        if self.replica_id.is_some() {
            c.peers.replica_id = self.replica_id.clone();
        }
        set(&mut c.peers.expiry_ms, &self.peer_expiry_ms);
        set(&mut c.peers.publish_ms, &self.peer_publish_ms);
        set(&mut c.peers.decisions, &self.peer_decisions);
        set(&mut c.peers.decide_timeout_ms, &self.peer_decide_timeout_ms);
    }
}

/// Runs the gateway until SIGTERM or ctrl-c, then drains in-flight requests.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.to_config()?;
    let running = crate::server::start(config).await?;
    shutdown_signal().await;
    tracing::info!("shutdown requested: no new connections; draining in-flight requests");
    running.shutdown().await;
    tracing::info!("gateway stopped");
    Ok(())
}

/// Resolves at SIGTERM or ctrl-c.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(err) = tokio::signal::ctrl_c().await {
            tracing::warn!(%err, "cannot listen for ctrl-c");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(err) => {
                tracing::warn!(%err, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        serve: ServeArgs,
    }

    fn parse(args: &[&str]) -> anyhow::Result<Config> {
        let mut v = vec!["kvgate"];
        v.extend_from_slice(args);
        T::try_parse_from(v)?.serve.to_config()
    }

    /// A kv_aware flag that was removed is refused with the reason it went (not as
    /// just an unknown argument), both as `--flag value` and `--flag=value`; other
    /// unknown flags keep clap's own error.
    #[test]
    fn a_removed_kv_aware_flag_is_refused_with_its_reason() {
        let refuse = |args: &[&str]| {
            let mut v = vec!["kvgate", "--model", "m", "--worker", "http://h:1"];
            v.extend_from_slice(args);
            let err = T::try_parse_from(v).err().expect("refused");
            explain_removed_flag(err).to_string()
        };
        let e = refuse(&["--cold-homing", "false"]);
        assert!(
            e.contains("`--cold-homing` was removed: cold homing is gone"),
            "{e}"
        );
        let e = refuse(&["--home-plans-by-demand=false"]);
        assert!(
            e.contains("cold homing is gone, with its refinements"),
            "{e}"
        );
        let e = refuse(&["--no-such-flag"]);
        assert!(e.contains("unexpected argument"), "{e}");
    }

    #[test]
    fn issue_example_flags() {
        let dir = tempfile::tempdir().unwrap();
        let c = parse(&[
            "--port",
            "8000",
            "--model",
            "m",
            "--worker",
            "http://127.0.0.1:8101",
            "--worker",
            "http://127.0.0.1:8102",
            "--policy",
            "kv_aware",
            "--tokenizer",
            dir.path().to_str().unwrap(),
            "--kv-events",
            "http://127.0.0.1:8101=tcp://127.0.0.1:5601",
            "--kv-events-replay",
            "http://127.0.0.1:8101=tcp://127.0.0.1:5701",
            "--block-size",
            "32",
        ])
        .unwrap();
        let m = &c.models[0];
        assert_eq!(m.policy, PolicyKind::KvAware);
        assert_eq!(m.block_size, 32);
        assert_eq!(
            m.workers[0].kv_events.as_deref(),
            Some("tcp://127.0.0.1:5601")
        );
        assert_eq!(
            m.workers[0].kv_events_replay.as_deref(),
            Some("tcp://127.0.0.1:5701")
        );
        assert_eq!(m.workers[1].kv_events, None);
    }

    #[test]
    fn peer_flags_choose_where_replicas_decide() {
        let base = [
            "--model",
            "m",
            "--worker",
            "http://h:1",
            "--peer",
            "http://p:2",
        ];
        let c = parse(&base).unwrap();
        assert_eq!(c.peers.decisions, crate::config::PeerDecisions::Leader);
        assert_eq!(c.peers.decide_timeout_ms, 50);
        let mut args = base.to_vec();
        args.extend([
            "--peer-decisions",
            "local",
            "--peer-decide-timeout-ms",
            "20",
        ]);
        let c = parse(&args).unwrap();
        assert_eq!(c.peers.decisions, crate::config::PeerDecisions::Local);
        assert_eq!(c.peers.decide_timeout_ms, 20);
        let mut args = base.to_vec();
        args.extend(["--peer-decide-timeout-ms", "0"]);
        let e = parse(&args).unwrap_err();
        assert!(e.to_string().contains("decide_timeout_ms"), "{e}");
        let yaml: crate::config::PeersConfig =
            serde_norway::from_str("{urls: ['http://p:2'], decisions: local}").unwrap();
        assert_eq!(yaml.decisions, crate::config::PeerDecisions::Local);
    }

    #[test]
    fn default_policy_is_round_robin_and_errors_are_clear() {
        let c = parse(&["--model", "m", "--worker", "http://h:1"]).unwrap();
        assert_eq!(c.models[0].policy, PolicyKind::RoundRobin);
        let e = parse(&["--worker", "http://h:1"]).unwrap_err();
        assert!(e.to_string().contains("--model"), "{e}");
        let e = parse(&[
            "--model",
            "m",
            "--worker",
            "http://h:1",
            "--kv-events",
            "http://other:1=tcp://h:5",
        ])
        .unwrap_err();
        assert!(e.to_string().contains("not one of the --worker"), "{e}");
    }

    #[test]
    fn disaggregation_flags_build_both_pools() {
        let c = parse(&[
            "--model",
            "m",
            "--remote-tokenize",
            "--policy",
            "kv_aware",
            "--pd-mode",
            "sglang",
            "--prefill-worker",
            "http://p:1",
            "--bootstrap-port",
            "http://p:1=8998",
            "--kv-events",
            "http://p:1=tcp://p:5557",
            "--decode-worker",
            "http://d:1",
            "--worker",
            "http://d:2",
        ])
        .unwrap();
        let m = &c.models[0];
        let pd = m.pd.as_ref().unwrap();
        assert_eq!(pd.mode, crate::config::PdMode::Sglang);
        assert_eq!(pd.prefill_workers.len(), 1);
        assert_eq!(pd.prefill_workers[0].bootstrap_port, Some(8998));
        assert_eq!(
            pd.prefill_workers[0].kv_events.as_deref(),
            Some("tcp://p:5557")
        );
        assert_eq!(pd.uncached_token_threshold, 0);
        assert_eq!(
            m.workers.len(),
            2,
            "--decode-worker and --worker are one flag"
        );
        // Without events on the decode pool its policy is least_loaded.
        let (decode, prefill) = m.pd_pools().unwrap();
        assert_eq!(decode.policy, PolicyKind::LeastLoaded);
        assert_eq!(prefill.policy, PolicyKind::KvAware);
        assert_eq!(prefill.workers[0].url, "http://p:1");

        // SGLang needs each prefill worker's bootstrap port; a URL in both pools and a
        // model without prefill workers are refused.
        let base = [
            "--model",
            "m",
            "--pd-mode",
            "sglang",
            "--decode-worker",
            "http://d:1",
        ];
        let e = parse(&[&base[..], &["--prefill-worker", "http://p:1"]].concat()).unwrap_err();
        assert!(format!("{e:#}").contains("bootstrap port"), "{e:#}");
        let e = parse(&base).unwrap_err();
        assert!(format!("{e:#}").contains("prefill worker"), "{e:#}");
        let e = parse(&[
            "--model",
            "m",
            "--pd-mode",
            "vllm",
            "--decode-worker",
            "http://d:1",
            "--prefill-worker",
            "http://d:1",
        ])
        .unwrap_err();
        assert!(
            format!("{e:#}").contains("both the prefill and the decode pool"),
            "{e:#}"
        );
        // The threshold sends whole requests to decode workers: vLLM's only.
        let vllm = [
            "--model",
            "m",
            "--pd-mode",
            "vllm",
            "--decode-worker",
            "http://d:1",
            "--prefill-worker",
            "http://p:1",
            "--pd-uncached-token-threshold",
            "64",
        ];
        assert_eq!(
            parse(&vllm).unwrap().models[0]
                .pd
                .as_ref()
                .unwrap()
                .uncached_token_threshold,
            64
        );
        let e = parse(
            &[
                &base[..],
                &[
                    "--prefill-worker",
                    "http://p:1",
                    "--bootstrap-port",
                    "http://p:1=1",
                ],
                &["--pd-uncached-token-threshold", "64"],
            ]
            .concat(),
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("needs mode vllm"), "{e:#}");
        // The pool flags need --pd-mode.
        assert!(parse(&[
            "--model",
            "m",
            "--worker",
            "http://d:1",
            "--prefill-worker",
            "http://p:1"
        ])
        .is_err());
    }
}
