//! Gateway configuration: one [`Config`] built either from a YAML file or from CLI
//! flags, declaring one or more models, each with its workers, policy and tokenizer,
//! plus global limits, timeouts, health checking and auth.
//!
//! Owns parsing, defaults and validation (with error messages that say what to fix).
//! It must not start anything: `server::start` turns a validated config into a
//! running gateway.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use kvgate_core::{KvAwareConfig, PolicyConfig, PolicyKind, PrefixAffinityConfig, SessionConfig};
use kvgate_selection::SelectionConfig;
use serde::{Deserialize, Serialize};

/// Everything one gateway process serves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Interface to listen on.
    pub host: String,
    /// Port to listen on (0 = ephemeral, for tests).
    pub port: u16,
    pub models: Vec<ModelConfig>,
    /// Clients must send `Authorization: Bearer <api_key>` when set.
    pub api_key: Option<String>,
    /// Enables the admin API (`/admin/workers`), guarded by this bearer token.
    pub admin_token: Option<String>,
    /// Sent to workers as `Authorization: Bearer ...` (engines started with --api-key).
    pub worker_api_key: Option<String>,
    /// `/metrics` (which names worker URLs) requires `Authorization: Bearer <token>`
    /// when set.
    pub metrics_token: Option<String>,
    pub limits: LimitsConfig,
    pub timeouts: TimeoutsConfig,
    pub health: HealthConfig,
    pub failover: FailoverConfig,
    /// Bookings older than this are freed by the ledger sweep (a backstop for leaks).
    pub ledger_ttl_secs: u64,
    /// On SIGTERM/ctrl-c, in-flight requests get this long to finish.
    pub shutdown_grace_secs: u64,
    /// Other kvgate replicas in front of the same workers, sharing their load.
    pub peers: PeersConfig,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            host: "0.0.0.0".into(),
            port: 8000,
            models: Vec::new(),
            api_key: None,
            admin_token: None,
            worker_api_key: None,
            metrics_token: None,
            limits: LimitsConfig::default(),
            timeouts: TimeoutsConfig::default(),
            health: HealthConfig::default(),
            failover: FailoverConfig::default(),
            ledger_ttl_secs: 3600,
            shutdown_grace_secs: 30,
            peers: PeersConfig::default(),
        }
    }
}

/// Router replicas in front of the same workers: each reports the load it booked to
/// the others over HTTP, and scores the whole fleet's (docs/DESIGN.md, section 3).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PeersConfig {
    /// This replica's name among its peers, stable across its restarts (a Kubernetes
    /// pod name). Default: `HOSTNAME/LISTEN_ADDRESS:PORT`.
    pub replica_id: Option<String>,
    /// Other replicas' base URLs (`http://host:port`).
    pub urls: Vec<String>,
    /// A DNS name whose addresses are the replicas (`name:port`, e.g. a Kubernetes
    /// headless Service), re-resolved every `dns_refresh_ms`; this replica's own
    /// address is recognized and skipped.
    pub dns: Option<String>,
    pub dns_refresh_ms: u64,
    /// How often this replica looks for a change in its bookings to report, ms.
    pub publish_ms: u64,
    /// A report goes out at least this often without a change, ms.
    pub heartbeat_ms: u64,
    /// A peer not heard from for this long loses its bookings here, ms.
    pub expiry_ms: u64,
    /// Where a request's worker is chosen when replicas follow each other.
    pub decisions: PeerDecisions,
    /// How long a replica waits for the leader's choice before choosing itself, ms.
    pub decide_timeout_ms: u64,
}

/// Where replicas that follow each other choose workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PeerDecisions {
    /// The replica with the smallest name among those connected (the leader) chooses
    /// for all of them: requests that reach several replicas at the same instant are
    /// decided in one place, in order, each seeing the ones before it. A replica that
    /// cannot reach the leader within `decide_timeout_ms` chooses itself.
    #[default]
    Leader,
    /// Every replica chooses for its own requests, on the load its peers last reported
    /// (up to `publish_ms` old, and blind to requests decided at the same instant).
    Local,
}

impl std::fmt::Display for PeerDecisions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PeerDecisions::Leader => "leader",
            PeerDecisions::Local => "local",
        })
    }
}

impl Default for PeersConfig {
    fn default() -> Self {
        Self {
            replica_id: None,
            urls: Vec::new(),
            dns: None,
            dns_refresh_ms: 5_000,
            publish_ms: 20,
            heartbeat_ms: 500,
            expiry_ms: 2_000,
            decisions: PeerDecisions::Leader,
            decide_timeout_ms: 50,
        }
    }
}

impl PeersConfig {
    /// Whether this replica follows any peer.
    pub fn enabled(&self) -> bool {
        !self.urls.is_empty() || self.dns.is_some()
    }

    fn validate(&self) -> anyhow::Result<()> {
        for url in &self.urls {
            validate_worker_url(url).with_context(|| format!("peers.urls: {url}"))?;
        }
        if let Some(dns) = &self.dns {
            validate_name_port("peers.dns", dns)?;
        }
        if self
            .replica_id
            .as_deref()
            .is_some_and(|r| r.trim().is_empty())
        {
            bail!("peers.replica_id is set but empty");
        }
        if self.publish_ms == 0
            || self.heartbeat_ms == 0
            || self.dns_refresh_ms == 0
            || self.decide_timeout_ms == 0
        {
            bail!("peers.publish_ms, heartbeat_ms, dns_refresh_ms and decide_timeout_ms must be positive");
        }
        if self.expiry_ms <= self.heartbeat_ms {
            bail!(
                "peers.expiry_ms ({}) must be longer than peers.heartbeat_ms ({}), or every peer would expire between reports",
                self.expiry_ms,
                self.heartbeat_ms
            );
        }
        Ok(())
    }
}

/// One served model (its name is what clients put in `"model"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    pub workers: Vec<WorkerConfig>,
    pub policy: PolicyKind,
    /// Seed for the policy's random choices (tests, reproducible benchmarks).
    pub seed: Option<u64>,
    pub kv_aware: KvAwareConfig,
    pub prefix_affinity: PrefixAffinityConfig,
    pub session: SessionConfig,
    /// Header carrying the session key for the `session` policy.
    pub session_header: String,
    /// Directory with `tokenizer.json` (+ `tokenizer_config.json`) for local tokenization.
    pub tokenizer: Option<PathBuf>,
    /// Tokenize with a healthy replica's `POST /tokenize` instead of locally.
    pub remote_tokenize: bool,
    /// The engines' context length (`--max-model-len`), in tokens. When set, local
    /// tokenization refuses longer prompts with 400 `context_length_exceeded` and stops
    /// encoding as soon as the limit is passed, which bounds its time and memory.
    pub max_model_len: Option<u32>,
    /// Tokens per KV block (must equal the engines' block size; events say so loudly).
    pub block_size: u32,
    /// Extra salt folded into block keys (must match on every router replica).
    pub hash_salt: Option<String>,
    /// Model names that are LoRA adapters served by these workers; requests naming
    /// one are routed here, with block keys salted by the adapter name.
    pub lora_adapters: Vec<String>,
    /// kv_aware only: when no KV event source is configured, route with this policy
    /// instead of answering 503.
    pub kv_fallback: Option<PolicyKind>,
    /// ZeroMQ topic prefix to subscribe to ("" = all).
    pub kv_topic: String,
    /// Cap on prefix-index entries for this model.
    pub index_max_blocks: usize,
    /// How often each worker's queue is read from its Prometheus metrics (`GET
    /// {worker}/metrics`: vLLM's `vllm:num_requests_running`/`_waiting`, SGLang's
    /// `sglang:num_running_reqs`/`_queue_reqs`), so requests the engine holds that no
    /// kvgate replica booked (clients calling it directly, another router) count as its
    /// load. 0 = never.
    pub engine_metrics_interval_ms: u64,
    /// Workers found through a DNS name, in addition to `workers`.
    pub workers_dns: Option<WorkersDnsConfig>,
    /// Workers found through the Kubernetes API (pods by label selector), in addition
    /// to `workers`; needs a build with `--features kubernetes`.
    pub workers_kubernetes: Option<WorkersKubernetesConfig>,
    /// Prefill/decode disaggregation: `workers` are then the decode pool, `policy`
    /// chooses among the prefill pool's workers (see [`PdConfig`]).
    pub pd: Option<PdConfig>,
}

/// How a disaggregated model hands a request from its prefill worker to its decode
/// worker (the engines' KV-transfer protocol).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum PdMode {
    /// vLLM's KV connectors (NIXL and alike): the prefill worker runs the request with
    /// `max_tokens: 1` and `kv_transfer_params` asking for a remote decode; its answer's
    /// `kv_transfer_params` go with the original request to the decode worker.
    Vllm,
    /// SGLang's bootstrap transfer: the request goes to the prefill and the decode
    /// worker at once, both carrying the prefill worker's bootstrap address and a
    /// random room number that pairs them.
    Sglang,
}

impl std::fmt::Display for PdMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            PdMode::Vllm => "vllm",
            PdMode::Sglang => "sglang",
        })
    }
}

/// Prefill/decode disaggregation of one model: a prefill pool beside the decode pool
/// (the model's `workers`). Each pool has its own workers, KV events, index, ledger and
/// policy: the model's `policy` chooses the prefill worker (where the prompt's KV cache
/// counts), `decode_policy` the decode worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PdConfig {
    pub mode: PdMode,
    /// The prefill pool (SGLang: each with its `bootstrap_port`).
    pub prefill_workers: Vec<WorkerConfig>,
    /// Prefill workers found through a DNS name, in addition to `prefill_workers`.
    pub prefill_workers_dns: Option<WorkersDnsConfig>,
    /// Prefill workers found through the Kubernetes API (`--features kubernetes`).
    pub prefill_workers_kubernetes: Option<WorkersKubernetesConfig>,
    /// Policy of the decode pool (default: kv_aware when a decode worker publishes KV
    /// events, least_loaded otherwise).
    pub decode_policy: Option<PolicyKind>,
    /// Prompts with fewer uncached tokens than this (the prefill pool's best cached
    /// prefix taken off) skip the split and go to a decode worker whole (0 = never).
    pub uncached_token_threshold: u32,
}

impl Default for PdConfig {
    fn default() -> Self {
        Self {
            mode: PdMode::Vllm,
            prefill_workers: Vec::new(),
            prefill_workers_dns: None,
            prefill_workers_kubernetes: None,
            decode_policy: None,
            uncached_token_threshold: 0,
        }
    }
}

impl PdConfig {
    /// The decode pool's policy: as configured, else kv_aware where decode workers
    /// publish KV events, else least_loaded.
    pub fn decode_policy_for(&self, decode_workers: &[WorkerConfig]) -> PolicyKind {
        self.decode_policy.unwrap_or_else(|| {
            if decode_workers.iter().any(|w| w.kv_events.is_some()) {
                PolicyKind::KvAware
            } else {
                PolicyKind::LeastLoaded
            }
        })
    }
}

/// Engines found through the Kubernetes API: the running, ready pods matching a label
/// selector, each a worker at `http://POD_IP:PORT` with its KV events and replay on the
/// same IP. Listed every `refresh_ms`; pods that become ready join, pods that stop
/// being ready or go away leave.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkersKubernetesConfig {
    /// Namespace of the pods (default: the client's, i.e. this pod's namespace in a
    /// cluster).
    pub namespace: Option<String>,
    /// Label selector, e.g. `app=vllm,model=qwen3-8b`.
    pub label_selector: String,
    /// The engines' HTTP port.
    pub port: u16,
    pub kv_events_port: Option<u16>,
    pub kv_events_replay_port: Option<u16>,
    pub dp_size: u32,
    pub refresh_ms: u64,
    /// SGLang prefill pods: their bootstrap server's port.
    pub bootstrap_port: Option<u16>,
    /// The API server's URL instead of the in-cluster or kubeconfig one (e.g.
    /// `http://127.0.0.1:8001` behind `kubectl proxy`).
    pub api_url: Option<String>,
}

impl Default for WorkersKubernetesConfig {
    fn default() -> Self {
        Self {
            namespace: None,
            label_selector: String::new(),
            port: 8000,
            kv_events_port: None,
            kv_events_replay_port: None,
            dp_size: 1,
            refresh_ms: 5_000,
            bootstrap_port: None,
            api_url: None,
        }
    }
}

impl WorkersKubernetesConfig {
    fn validate(&self) -> anyhow::Result<()> {
        if !cfg!(feature = "kubernetes") {
            bail!("workers_kubernetes needs kvgate built with `--features kubernetes`");
        }
        if self.label_selector.trim().is_empty() {
            bail!("workers_kubernetes.label_selector must name the engines' pods");
        }
        if self.refresh_ms == 0 || self.port == 0 {
            bail!("workers_kubernetes.refresh_ms and port must be positive");
        }
        self.ports().validate("workers_kubernetes")
    }

    /// What each pod found is given.
    pub fn ports(&self) -> DiscoveredPorts {
        DiscoveredPorts {
            kv_events_port: self.kv_events_port,
            kv_events_replay_port: self.kv_events_replay_port,
            dp_size: self.dp_size,
            bootstrap_port: self.bootstrap_port,
        }
    }
}

/// Engines found through one DNS name (a Kubernetes headless Service of vLLM pods):
/// every address it resolves to is a worker at `http://ADDRESS:PORT`, with its KV
/// events and replay on the same address at the ports given. Re-resolved every
/// `refresh_ms`: a new address joins as through the admin API, a vanished one leaves
/// (its index entries are purged; its requests in flight finish).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WorkersDnsConfig {
    /// `NAME:PORT`, the port being the engines' HTTP port.
    pub name: String,
    /// The engines' KV-event PUB port, if they publish events.
    pub kv_events_port: Option<u16>,
    /// The engines' replay ROUTER port.
    pub kv_events_replay_port: Option<u16>,
    /// Data-parallel ranks per engine.
    pub dp_size: u32,
    pub refresh_ms: u64,
    /// SGLang prefill engines: their bootstrap server's port.
    pub bootstrap_port: Option<u16>,
}

impl Default for WorkersDnsConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            kv_events_port: None,
            kv_events_replay_port: None,
            dp_size: 1,
            refresh_ms: 5_000,
            bootstrap_port: None,
        }
    }
}

impl WorkersDnsConfig {
    fn validate(&self) -> anyhow::Result<()> {
        validate_name_port("workers_dns.name", &self.name)?;
        if self.refresh_ms == 0 {
            bail!("workers_dns.refresh_ms must be positive");
        }
        self.ports().validate("workers_dns")
    }

    /// What each address found is given.
    pub fn ports(&self) -> DiscoveredPorts {
        DiscoveredPorts {
            kv_events_port: self.kv_events_port,
            kv_events_replay_port: self.kv_events_replay_port,
            dp_size: self.dp_size,
            bootstrap_port: self.bootstrap_port,
        }
    }
}

/// What a discovered worker is given besides its address (from `workers_dns` or
/// `workers_kubernetes`): the engines' KV-event and replay ports and their ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiscoveredPorts {
    pub kv_events_port: Option<u16>,
    pub kv_events_replay_port: Option<u16>,
    pub dp_size: u32,
    pub bootstrap_port: Option<u16>,
}

impl DiscoveredPorts {
    fn validate(&self, section: &str) -> anyhow::Result<()> {
        if self.dp_size == 0 || self.dp_size > MAX_DP_SIZE {
            bail!("{section}.dp_size must be 1 to {MAX_DP_SIZE}");
        }
        if self.kv_events_replay_port.is_some() && self.kv_events_port.is_none() {
            bail!("{section}.kv_events_replay_port needs kv_events_port");
        }
        Ok(())
    }

    /// The worker at one address found (its port is the engines' HTTP port).
    pub fn worker_at(&self, addr: std::net::SocketAddr) -> WorkerConfig {
        let ip = match addr.ip() {
            std::net::IpAddr::V6(v6) => format!("[{v6}]"),
            v4 => v4.to_string(),
        };
        WorkerConfig {
            url: format!("http://{ip}:{}", addr.port()),
            kv_events: self.kv_events_port.map(|p| format!("tcp://{ip}:{p}")),
            kv_events_replay: self
                .kv_events_replay_port
                .map(|p| format!("tcp://{ip}:{p}")),
            dp_size: self.dp_size,
            bootstrap_port: self.bootstrap_port,
        }
    }
}

/// A `NAME:PORT` setting (a DNS name and a port).
fn validate_name_port(what: &str, value: &str) -> anyhow::Result<()> {
    match value.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => bail!("{what} {value:?} must be NAME:PORT"),
    }
}

impl ModelConfig {
    /// The selection service this model routes with (the gateway builds one per model;
    /// `kvgate simulate` builds the same from the same flags).
    pub fn selection_config(&self, booking_ttl: Duration) -> SelectionConfig {
        SelectionConfig {
            model: self.name.clone(),
            block_size: self.block_size,
            hash_salt: self.hash_salt.clone(),
            policy: PolicyConfig {
                kind: self.policy,
                seed: self.seed,
                kv_aware: self.kv_aware.clone(),
                prefix_affinity: self.prefix_affinity.clone(),
                session: self.session.clone(),
            },
            fallback: self.kv_fallback,
            index_max_blocks: self.index_max_blocks,
            kv_topic: self.kv_topic.clone(),
            booking_ttl,
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            workers: Vec::new(),
            policy: PolicyKind::RoundRobin,
            seed: None,
            kv_aware: KvAwareConfig::default(),
            prefix_affinity: PrefixAffinityConfig::default(),
            session: SessionConfig::default(),
            session_header: "x-session-id".into(),
            tokenizer: None,
            remote_tokenize: false,
            max_model_len: None,
            block_size: 16,
            hash_salt: None,
            lora_adapters: Vec::new(),
            kv_fallback: None,
            kv_topic: String::new(),
            index_max_blocks: kvgate_core::IndexConfig::default().max_blocks,
            engine_metrics_interval_ms: 500,
            workers_dns: None,
            workers_kubernetes: None,
            pd: None,
        }
    }
}

impl ModelConfig {
    /// Whether requests for this model need routing tokens (for either pool of a
    /// disaggregated model).
    pub fn needs_tokens(&self) -> bool {
        match &self.pd {
            Some(pd) => {
                self.policy.uses_tokens() || pd.decode_policy_for(&self.workers).uses_tokens()
            }
            None => self.policy.uses_tokens(),
        }
    }

    /// A disaggregated model's two pools as models of their own: the decode pool (the
    /// model's `workers`, routed with the decode policy) and the prefill pool (the
    /// prefill workers, routed with the model's policy). Both keep the model's name,
    /// block size and hash salt, so one tokenization gives both the same block keys.
    /// `None` for a model that is not disaggregated.
    pub fn pd_pools(&self) -> Option<(ModelConfig, ModelConfig)> {
        let pd = self.pd.as_ref()?;
        let decode = ModelConfig {
            policy: pd.decode_policy_for(&self.workers),
            kv_fallback: None,
            pd: None,
            ..self.clone()
        };
        // The prefill pool routes on the block keys of the model's own tokenization.
        let prefill = ModelConfig {
            workers: pd.prefill_workers.clone(),
            tokenizer: None,
            remote_tokenize: false,
            workers_dns: pd.prefill_workers_dns.clone(),
            workers_kubernetes: pd.prefill_workers_kubernetes.clone(),
            lora_adapters: Vec::new(),
            pd: None,
            ..self.clone()
        };
        Some((decode, prefill))
    }

    /// Whether any worker publishes KV events (or will, found through DNS).
    pub fn has_event_source(&self) -> bool {
        self.workers.iter().any(|w| w.kv_events.is_some())
            || self
                .workers_dns
                .as_ref()
                .is_some_and(|d| d.kv_events_port.is_some())
            || self
                .workers_kubernetes
                .as_ref()
                .is_some_and(|k| k.kv_events_port.is_some())
    }
}

/// One engine replica. In YAML either a URL string or a map.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "WorkerSpec")]
pub struct WorkerConfig {
    /// Base URL, e.g. `http://10.0.0.5:8000`.
    pub url: String,
    /// ZeroMQ PUB endpoint of its KV events, e.g. `tcp://10.0.0.5:5557`.
    pub kv_events: Option<String>,
    /// ZeroMQ ROUTER endpoint for replay, e.g. `tcp://10.0.0.5:5558`.
    pub kv_events_replay: Option<String>,
    /// Data-parallel ranks (rank r publishes on the events port + r).
    pub dp_size: u32,
    /// SGLang disaggregation: the port of this prefill worker's bootstrap server (its
    /// `--disaggregation-bootstrap-port`), sent to decode workers with its host.
    pub bootstrap_port: Option<u16>,
}

/// Most data-parallel ranks one worker may declare (one event subscriber each).
pub const MAX_DP_SIZE: u32 = 1024;

impl WorkerConfig {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            kv_events: None,
            kv_events_replay: None,
            dp_size: 1,
            bootstrap_port: None,
        }
    }

    /// The one check of a worker's settings, used by flags, YAML and the admin API:
    /// the URL is `http://host:port[/prefix]`, each KV event endpoint is
    /// `tcp://HOST:PORT` and its port plus every rank fits in a port number, a replay
    /// endpoint comes with an events endpoint, and `dp_size` is 1 to [`MAX_DP_SIZE`].
    pub fn validate(&self) -> anyhow::Result<()> {
        validate_worker_url(&self.url)?;
        if self.dp_size == 0 || self.dp_size > MAX_DP_SIZE {
            bail!(
                "worker {}: dp_size {} must be between 1 and {MAX_DP_SIZE}",
                self.url,
                self.dp_size
            );
        }
        for ep in [&self.kv_events, &self.kv_events_replay]
            .into_iter()
            .flatten()
        {
            for rank in [0, self.dp_size - 1] {
                rank_endpoint(ep, rank).with_context(|| format!("worker {}", self.url))?;
            }
        }
        if self.kv_events_replay.is_some() && self.kv_events.is_none() {
            bail!(
                "worker {} has a replay endpoint but no --kv-events endpoint",
                self.url
            );
        }
        Ok(())
    }
}

pub use kvgate_selection::rank_endpoint;

#[derive(Deserialize)]
#[serde(untagged)]
enum WorkerSpec {
    Url(String),
    Full {
        url: String,
        #[serde(default)]
        kv_events: Option<String>,
        #[serde(default)]
        kv_events_replay: Option<String>,
        #[serde(default)]
        dp_size: Option<u32>,
        #[serde(default)]
        bootstrap_port: Option<u16>,
    },
}

impl From<WorkerSpec> for WorkerConfig {
    fn from(s: WorkerSpec) -> Self {
        match s {
            WorkerSpec::Url(url) => WorkerConfig::new(url),
            WorkerSpec::Full {
                url,
                kv_events,
                kv_events_replay,
                dp_size,
                bootstrap_port,
            } => WorkerConfig {
                url,
                kv_events,
                kv_events_replay,
                dp_size: dp_size.unwrap_or(1),
                bootstrap_port,
            },
        }
    }
}

/// In-flight limits and the wait queue in front of them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsConfig {
    /// Requests proxied at once across all models (0 = unlimited).
    pub max_in_flight: usize,
    /// Requests proxied at once to one worker (0 = unlimited).
    pub max_in_flight_per_worker: u32,
    /// Requests allowed to wait for a free slot; beyond this, 429 at once.
    pub max_queue: usize,
    /// How long a request may wait for a slot before 429.
    pub queue_timeout_ms: u64,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Requests with a body of at least 16 KiB parsed and tokenized at once (0 = one
    /// per CPU core); others wait in the queue. Tokenization is CPU-bound, so more at
    /// once only adds memory: this bounds the gateway's peak memory under large bodies
    /// (docs/BENCHMARKS.md, "Large bodies").
    pub large_body_concurrency: usize,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        Self {
            max_in_flight: 0,
            max_in_flight_per_worker: 0,
            max_queue: 1024,
            queue_timeout_ms: 5000,
            max_body_bytes: 32 << 20,
            large_body_concurrency: 0,
        }
    }
}

impl LimitsConfig {
    pub fn queue_timeout(&self) -> Duration {
        Duration::from_millis(self.queue_timeout_ms)
    }

    /// `Retry-After` seconds for a 429.
    pub fn retry_after_secs(&self) -> u64 {
        self.queue_timeout_ms.div_ceil(1000).max(1)
    }
}

/// Upstream timeouts (0 = none).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TimeoutsConfig {
    /// TCP connect to a worker.
    pub connect_ms: u64,
    /// From sending the request to the start of the answer: its head, and for a
    /// stream its first event (covers queueing and prefill; for non-streaming requests,
    /// the whole generation).
    pub first_byte_ms: u64,
    /// Whole request, including streaming the body.
    pub total_ms: u64,
}

impl Default for TimeoutsConfig {
    fn default() -> Self {
        Self {
            connect_ms: 3_000,
            first_byte_ms: 600_000,
            total_ms: 3_600_000,
        }
    }
}

fn opt_ms(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

impl TimeoutsConfig {
    pub fn connect(&self) -> Option<Duration> {
        opt_ms(self.connect_ms)
    }
    pub fn first_byte(&self) -> Option<Duration> {
        opt_ms(self.first_byte_ms)
    }
    pub fn total(&self) -> Option<Duration> {
        opt_ms(self.total_ms)
    }
}

/// Active health checks and the per-worker circuit breaker.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct HealthConfig {
    /// Interval between `GET {worker}{path}` checks (0 = no active checks; an open
    /// breaker then half-opens by itself after `open_ms`).
    pub interval_ms: u64,
    /// Interval between checks of a worker out of rotation (its breaker open), so an
    /// engine that restarts or recovers is back within this of answering rather than
    /// within `interval_ms` (0 = the same as `interval_ms`). A stalled worker's
    /// generation probe keeps `interval_ms`: it costs its engine a token.
    pub unhealthy_interval_ms: u64,
    pub timeout_ms: u64,
    pub path: String,
    /// Consecutive failures (checks or proxied requests) that open the breaker.
    pub failure_threshold: u32,
    /// How long an open breaker keeps a worker out before a probe may close it.
    pub open_ms: u64,
    /// A worker that holds routed requests while its engine sends no answer byte and
    /// publishes no KV event for this long is stalled: out of rotation, its requests
    /// cut off, until a one-token completion answers (stall.rs; only workers whose KV
    /// events kvgate reads, as kv_aware does; 0 = off).
    pub stall_ms: u64,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            interval_ms: 2_000,
            unhealthy_interval_ms: 500,
            timeout_ms: 1_000,
            path: "/health".into(),
            failure_threshold: 3,
            open_ms: 5_000,
            stall_ms: 60_000,
        }
    }
}

/// Retrying a request that failed before any byte reached the client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FailoverConfig {
    /// Total attempts, each on a different worker (1 = no retry).
    pub max_attempts: u32,
    /// Delay before the second attempt; doubles per attempt.
    pub backoff_ms: u64,
}

impl Default for FailoverConfig {
    fn default() -> Self {
        Self {
            max_attempts: 3,
            backoff_ms: 10,
        }
    }
}

impl Config {
    /// Reads and validates a YAML config file.
    pub fn from_yaml_file(path: &Path) -> anyhow::Result<Config> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_yaml_str(&text).with_context(|| format!("in config file {}", path.display()))
    }

    /// Parses and validates YAML text.
    pub fn from_yaml_str(text: &str) -> anyhow::Result<Config> {
        let config: Config = serde_norway::from_str(text).context("invalid YAML config")?;
        config.validate()?;
        Ok(config)
    }

    /// What only the whole configuration (the YAML file, flags and environment
    /// together: a Kubernetes Secret usually supplies the token) can tell, checked when
    /// the gateway starts: following peers needs the admin token they authenticate
    /// to each other's /peer/v1 endpoints with.
    pub fn check_peer_token(&self) -> anyhow::Result<()> {
        if self.peers.enabled() && self.admin_token.is_none() {
            bail!(
                "peers need a token to authenticate to each other's /peer/v1 endpoints: \
                 set --admin-token (env KVGATE_ADMIN_TOKEN, YAML admin_token), the same on \
                 every replica"
            );
        }
        Ok(())
    }

    /// Checks the config, returning an error that says what to change.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.models.is_empty() {
            bail!("no model configured: pass --model NAME --worker URL, or declare `models:` in the config file");
        }
        let mut names = HashSet::new();
        for m in &self.models {
            m.validate()?;
            for name in std::iter::once(&m.name).chain(m.lora_adapters.iter()) {
                if !names.insert(name.as_str()) {
                    bail!("model name {name:?} is declared twice (as a model or LoRA adapter)");
                }
            }
        }
        if self.failover.max_attempts == 0 {
            bail!("failover.max_attempts must be at least 1");
        }
        if self.health.failure_threshold == 0 {
            bail!("health.failure_threshold must be at least 1");
        }
        if self.limits.max_body_bytes == 0 {
            bail!("limits.max_body_bytes must be positive");
        }
        self.peers.validate()?;
        for (what, key) in [
            ("api_key", &self.api_key),
            ("admin_token", &self.admin_token),
            ("metrics_token", &self.metrics_token),
        ] {
            if key.as_deref().is_some_and(str::is_empty) {
                bail!("{what} is set but empty");
            }
        }
        Ok(())
    }
}

impl ModelConfig {
    fn validate(&self) -> anyhow::Result<()> {
        let name = &self.name;
        if self.max_model_len == Some(0) {
            bail!("model {name:?}: max_model_len must be positive");
        }
        if name.trim().is_empty() {
            bail!("a model has an empty name");
        }
        if self.block_size == 0 {
            bail!("model {name:?}: block_size must be at least 1");
        }
        if let Some(dns) = &self.workers_dns {
            dns.validate().with_context(|| format!("model {name:?}"))?;
        }
        if let Some(k8s) = &self.workers_kubernetes {
            k8s.validate().with_context(|| format!("model {name:?}"))?;
        }
        let mut urls = HashSet::new();
        for w in &self.workers {
            w.validate().with_context(|| format!("model {name:?}"))?;
            if !urls.insert(normalize_url(&w.url)) {
                bail!("model {name:?}: worker {} is listed twice", w.url);
            }
        }
        if let Some(pd) = &self.pd {
            pd.validate(self)
                .with_context(|| format!("model {name:?}"))?;
        }
        if self.needs_tokens() && self.tokenizer.is_none() && !self.remote_tokenize {
            bail!(
                "model {name:?}: policy {} routes on token ids: pass --tokenizer DIR (a directory with tokenizer.json) or --remote-tokenize",
                self.policy
            );
        }
        if let Some(fb) = self.kv_fallback {
            if self.policy != PolicyKind::KvAware {
                bail!("model {name:?}: kv_fallback only applies to the kv_aware policy");
            }
            if fb == PolicyKind::KvAware {
                bail!("model {name:?}: kv_fallback cannot be kv_aware itself");
            }
        }
        if self.session_header.is_empty()
            || http::HeaderName::from_bytes(self.session_header.as_bytes()).is_err()
        {
            bail!(
                "model {name:?}: session_header {:?} is not a valid HTTP header name",
                self.session_header
            );
        }
        Ok(())
    }
}

impl PdConfig {
    fn validate(&self, model: &ModelConfig) -> anyhow::Result<()> {
        if self.prefill_workers.is_empty()
            && self.prefill_workers_dns.is_none()
            && self.prefill_workers_kubernetes.is_none()
        {
            bail!("prefill/decode disaggregation needs at least one prefill worker (--prefill-worker URL, or prefill_workers_dns / prefill_workers_kubernetes)");
        }
        if let Some(dns) = &self.prefill_workers_dns {
            dns.validate().context("prefill_workers_dns")?;
            if self.mode == PdMode::Sglang && dns.bootstrap_port.is_none() {
                bail!(
                    "prefill_workers_dns: SGLang disaggregation needs the engines' bootstrap_port"
                );
            }
        }
        if let Some(k8s) = &self.prefill_workers_kubernetes {
            k8s.validate().context("prefill_workers_kubernetes")?;
            if self.mode == PdMode::Sglang && k8s.bootstrap_port.is_none() {
                bail!("prefill_workers_kubernetes: SGLang disaggregation needs the pods' bootstrap_port");
            }
        }
        if model.workers.is_empty()
            && model.workers_dns.is_none()
            && model.workers_kubernetes.is_none()
        {
            bail!("prefill/decode disaggregation needs at least one decode worker (--decode-worker URL)");
        }
        let mut urls = HashSet::new();
        for w in &self.prefill_workers {
            w.validate()?;
            if !urls.insert(normalize_url(&w.url)) {
                bail!("prefill worker {} is listed twice", w.url);
            }
            if self.mode == PdMode::Sglang && w.bootstrap_port.is_none() {
                bail!("prefill worker {}: SGLang disaggregation needs its bootstrap port (--bootstrap-port URL=PORT, or bootstrap_port in YAML)", w.url);
            }
        }
        if self.mode == PdMode::Sglang && self.uncached_token_threshold > 0 {
            bail!("uncached_token_threshold needs mode vllm: SGLang's decode servers take no request without its prefill");
        }
        if let Some(w) = model
            .workers
            .iter()
            .find(|w| urls.contains(&normalize_url(&w.url)))
        {
            bail!(
                "worker {} is in both the prefill and the decode pool",
                w.url
            );
        }
        if let Some(fb) = model.kv_fallback {
            if model.policy != PolicyKind::KvAware || fb == PolicyKind::KvAware {
                bail!(
                    "kv_fallback {fb} does not apply to prefill policy {}",
                    model.policy
                );
            }
        }
        if self.decode_policy_for(&model.workers) == PolicyKind::KvAware
            && !model.has_event_source()
        {
            bail!("decode_policy kv_aware needs decode workers with KV events (--kv-events URL=ENDPOINT)");
        }
        Ok(())
    }
}

/// Removes a trailing `/` so `http://h:1/` and `http://h:1` are the same worker.
pub fn normalize_url(url: &str) -> String {
    url.trim().trim_end_matches('/').to_string()
}

/// A worker URL must be `http://host:port[/prefix]`.
pub fn validate_worker_url(url: &str) -> anyhow::Result<()> {
    let url = normalize_url(url);
    let uri: http::Uri = url
        .parse()
        .with_context(|| format!("worker URL {url:?} is not a valid URL"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => bail!("worker URL {url:?}: https upstreams are not supported; terminate TLS in front of the engine or use http://"),
        _ => bail!("worker URL {url:?} must start with http://"),
    }
    if uri.authority().is_none() {
        bail!("worker URL {url:?} has no host");
    }
    if uri.query().is_some() {
        bail!("worker URL {url:?} must not have a query string");
    }
    Ok(())
}

/// Parses `URL=ENDPOINT` (the `--kv-events` / `--kv-events-replay` flag syntax).
pub fn parse_assignment(s: &str) -> anyhow::Result<(String, String)> {
    let Some((url, endpoint)) = s.rsplit_once('=') else {
        bail!("expected WORKER_URL=tcp://HOST:PORT, got {s:?}");
    };
    if url.is_empty() || endpoint.is_empty() {
        bail!("expected WORKER_URL=tcp://HOST:PORT, got {s:?}");
    }
    Ok((normalize_url(url), endpoint.trim().to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dp_rank_ports() {
        assert_eq!(rank_endpoint("tcp://h:5557", 0).unwrap(), "tcp://h:5557");
        assert_eq!(rank_endpoint("tcp://h:5557", 2).unwrap(), "tcp://h:5559");
        assert!(rank_endpoint("tcp://h:65535", 1).is_err());
        assert!(rank_endpoint("tcp://h:65535", u32::MAX).is_err());
        for bad in [
            "tcp://h",
            "tcp://:5557",
            "tcp://h:99999",
            "udp://h:1",
            "h:1",
            "tcp://h:x",
        ] {
            assert!(rank_endpoint(bad, 0).is_err(), "{bad}");
        }
    }

    /// Peers authenticate to each other's /peer/v1 endpoints with the admin token, so
    /// following peers without one is refused at start-up, naming the flag; a YAML file
    /// alone may leave the token to the environment.
    #[test]
    fn peers_without_a_token_are_a_start_up_error() {
        let models = "models: [{name: m, workers: [{url: 'http://127.0.0.1:8000'}]}]\n";
        for peers in [
            "peers: {urls: ['http://127.0.0.1:9100']}\n",
            "peers: {dns: 'kvgate-peers:8080'}\n",
        ] {
            let mut c = Config::from_yaml_str(&format!("{models}{peers}")).unwrap();
            let e = c.check_peer_token().unwrap_err();
            assert!(format!("{e:#}").contains("--admin-token"), "{e:#}");
            c.admin_token = Some("t".into());
            assert!(c.check_peer_token().is_ok());
        }
        assert!(Config::from_yaml_str(models)
            .unwrap()
            .check_peer_token()
            .is_ok());
    }

    /// One check for every way a worker arrives (flags, YAML, admin API).
    #[test]
    fn worker_settings_are_checked_once() {
        let ok = WorkerConfig {
            url: "http://10.0.0.1:8000".into(),
            kv_events: Some("tcp://10.0.0.1:5557".into()),
            kv_events_replay: Some("tcp://10.0.0.1:5600".into()),
            dp_size: 4,
            bootstrap_port: None,
        };
        assert!(ok.validate().is_ok());
        let with = |f: &dyn Fn(&mut WorkerConfig)| {
            let mut w = ok.clone();
            f(&mut w);
            w.validate()
        };
        assert!(with(&|w| w.dp_size = 0).is_err());
        assert!(with(&|w| w.dp_size = u32::MAX).is_err());
        assert!(with(&|w| w.dp_size = MAX_DP_SIZE + 1).is_err());
        assert!(with(&|w| w.kv_events = Some("tcp://10.0.0.1:65534".into())).is_err());
        assert!(with(&|w| w.kv_events = None).is_err());
        assert!(with(&|w| w.url = "https://x:1".into()).is_err());
        assert!(with(&|w| w.url = "not a url".into()).is_err());
    }

    #[test]
    fn yaml_declares_a_disaggregated_model() {
        let c = Config::from_yaml_str(
            r#"
models:
  - name: m
    policy: kv_aware
    remote_tokenize: true
    workers: [http://d:1]
    pd:
      mode: vllm
      decode_policy: least_loaded
      uncached_token_threshold: 32
      prefill_workers:
        - {url: "http://p:1", kv_events: "tcp://p:5557"}
"#,
        )
        .unwrap();
        let pd = c.models[0].pd.as_ref().unwrap();
        assert_eq!(pd.mode, PdMode::Vllm);
        assert_eq!(pd.decode_policy, Some(PolicyKind::LeastLoaded));
        assert_eq!(pd.uncached_token_threshold, 32);
        assert_eq!(
            pd.prefill_workers[0].kv_events.as_deref(),
            Some("tcp://p:5557")
        );
        assert!(Config::from_yaml_str(
            "models: [{name: m, workers: [http://d:1], pd: {mode: nixl, prefill_workers: [http://p:1]}}]"
        )
        .is_err());
        // A prefill pool found through DNS; SGLang's needs the bootstrap port.
        let c = Config::from_yaml_str(
            "models: [{name: m, workers: [http://d:1], pd: {mode: sglang, prefill_workers_dns: {name: 'prefill.llm.svc:30000', bootstrap_port: 8998}}}]",
        )
        .unwrap();
        let (_, prefill) = c.models[0].pd_pools().unwrap();
        assert_eq!(
            prefill
                .workers_dns
                .as_ref()
                .map(|d| d.ports().bootstrap_port),
            Some(Some(8998))
        );
        let e = Config::from_yaml_str(
            "models: [{name: m, workers: [http://d:1], pd: {mode: sglang, prefill_workers_dns: {name: 'prefill.llm.svc:30000'}}}]",
        )
        .unwrap_err();
        assert!(format!("{e:#}").contains("bootstrap_port"), "{e:#}");
    }

    #[test]
    fn yaml_with_two_models() {
        let c = Config::from_yaml_str(
            r#"
port: 9000
models:
  - name: a
    policy: kv_aware
    tokenizer: /tmp/tok
    block_size: 32
    workers:
      - url: http://127.0.0.1:8101
        kv_events: tcp://127.0.0.1:5601
        kv_events_replay: tcp://127.0.0.1:5701
      - http://127.0.0.1:8102
  - name: b
    workers: [http://127.0.0.1:8201/]
limits: { max_in_flight_per_worker: 4 }
"#,
        )
        .unwrap();
        assert_eq!(c.port, 9000);
        assert_eq!(c.models.len(), 2);
        assert_eq!(c.models[0].policy, PolicyKind::KvAware);
        assert_eq!(
            c.models[0].workers[1],
            WorkerConfig::new("http://127.0.0.1:8102")
        );
        assert!(c.models[0].has_event_source());
        assert_eq!(c.models[1].policy, PolicyKind::RoundRobin);
        assert_eq!(c.limits.max_in_flight_per_worker, 4);
        assert_eq!(c.limits.max_queue, 1024);
    }

    #[test]
    fn errors_say_what_to_fix() {
        let err =
            Config::from_yaml_str("models: [{name: a, policy: kv_aware, workers: [http://h:1]}]")
                .unwrap_err();
        assert!(format!("{err:#}").contains("--tokenizer"), "{err:#}");
        let err = Config::from_yaml_str("models: [{name: a, workers: [ftp://h:1]}]").unwrap_err();
        assert!(format!("{err:#}").contains("http://"), "{err:#}");
        let err = Config::from_yaml_str("models: []").unwrap_err();
        assert!(format!("{err:#}").contains("--model"), "{err:#}");
        let err = Config::from_yaml_str("modles: []").unwrap_err();
        assert!(format!("{err:#}").contains("modles"), "{err:#}");
    }

    #[test]
    fn assignment_syntax() {
        assert_eq!(
            parse_assignment("http://127.0.0.1:8101/=tcp://127.0.0.1:5601").unwrap(),
            (
                "http://127.0.0.1:8101".into(),
                "tcp://127.0.0.1:5601".into()
            )
        );
        assert!(parse_assignment("http://x").is_err());
    }
}
