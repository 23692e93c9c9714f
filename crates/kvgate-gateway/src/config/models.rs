//! One served model's settings: its workers, policy, tokenizer, and prefill/decode
//! disaggregation.
//!
//! Owns their parsing, defaults and validation. Must not start anything.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use kvgate_core::{
    EngineLimits, KvAwareConfig, PolicyConfig, PolicyKind, PrefixAffinityConfig, SessionConfig,
};
use kvgate_selection::SelectionConfig;
use serde::{Deserialize, Serialize};

use super::workers::{normalize_url, WorkerConfig, WorkersDnsConfig, WorkersKubernetesConfig};

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
    /// Local tokenization keeps the ids of text it already encoded, up to this many MiB
    /// (`--tokenize-cache-mib`; 0 = off).
    pub tokenize_cache_mib: u64,
    /// Tokens per KV block (must equal the engines' block size; events say so loudly).
    pub block_size: u32,
    /// A request's time-to-first-token objective when its headers name none (`None`:
    /// no objective), in milliseconds.
    pub slo_ttft_ms: Option<u64>,
    /// A request's time-per-output-token objective when its headers name none.
    pub slo_tpot_ms: Option<u64>,
    /// The engines' `--max-num-seqs`: sequences one engine step runs at most, beyond
    /// which requests wait for a batch slot (the time model prices that wait).
    pub max_num_seqs: u32,
    /// The engines' `--max-num-batched-tokens`: tokens one engine step computes at most
    /// (the time model's prefill step budget).
    pub max_num_batched_tokens: u32,
    /// The engines' KV-cache size in blocks (vLLM's `num_gpu_blocks`): the requests that
    /// fit at once, beyond which they wait as behind a full batch. `None`: what each
    /// vLLM engine's metrics say (`vllm:cache_config_info`), else no limit.
    pub num_gpu_blocks: Option<u32>,
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
            engine_limits: EngineLimits {
                max_num_seqs: self.max_num_seqs,
                max_num_batched_tokens: self.max_num_batched_tokens,
                num_gpu_blocks: self.num_gpu_blocks,
            },
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
            tokenize_cache_mib: 128,
            block_size: 16,
            slo_ttft_ms: None,
            slo_tpot_ms: None,
            max_num_seqs: EngineLimits::default().max_num_seqs,
            max_num_batched_tokens: EngineLimits::default().max_num_batched_tokens,
            num_gpu_blocks: None,
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

impl ModelConfig {
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        let name = &self.name;
        if self.max_model_len == Some(0) {
            bail!("model {name:?}: max_model_len must be positive");
        }
        if name.trim().is_empty() {
            bail!("a model has an empty name");
        }
        if self.max_num_seqs == 0
            || self.max_num_batched_tokens == 0
            || self.num_gpu_blocks == Some(0)
        {
            bail!("model {name:?}: max_num_seqs, max_num_batched_tokens and num_gpu_blocks must be at least 1");
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
