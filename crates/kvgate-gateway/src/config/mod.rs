//! Gateway configuration: one [`Config`] built either from a YAML file or from CLI
//! flags, declaring one or more models, each with its workers, policy and tokenizer,
//! plus global limits, timeouts, health checking and auth.
//!
//! Owns parsing, defaults and validation (with error messages that say what to fix).
//! It must not start anything: `server::start` turns a validated config into a
//! running gateway.

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

mod models;
mod workers;

pub use models::{ModelConfig, PdConfig, PdMode};
use workers::validate_name_port;
pub use workers::{
    normalize_url, rank_endpoint, validate_worker_url, DiscoveredPorts, WorkerConfig,
    WorkersDnsConfig, WorkersKubernetesConfig, MAX_DP_SIZE,
};

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
    /// The longest-running replica among those connected (the leader; ties by name)
    /// chooses for all of them: requests that reach several replicas at the same instant are
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
    use kvgate_core::PolicyKind;

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
