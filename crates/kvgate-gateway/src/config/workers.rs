//! A worker's settings (URL, KV event endpoints, data-parallel ranks, SGLang bootstrap
//! port) and the two ways a model finds workers by name (DNS, Kubernetes).
//!
//! Owns their parsing, defaults and the one check of a worker's settings (flags,
//! YAML and the admin API use it). Must not start anything.

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// Engines found through the Kubernetes API: the running, ready pods matching a label
/// selector, each a worker at `http://POD_IP:PORT` with its KV events and replay on the
/// same IP. Watched (listed once, then the API server's changes): pods that become
/// ready join, pods that stop being ready or go away leave.
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
    /// SGLang prefill pods: their bootstrap server's port.
    pub bootstrap_port: Option<u16>,
    /// The API server's URL instead of the in-cluster or kubeconfig one (e.g.
    /// `http://127.0.0.1:8001` behind `kubectl proxy`).
    pub api_url: Option<String>,
    /// An InferencePool (`inference.networking.k8s.io/v1`) to follow: its
    /// `spec.selector.matchLabels` and `spec.targetPorts` stand for `label_selector`
    /// and the ports; the pool is watched too (a changed selector or port list is
    /// followed).
    pub inference_pool: Option<String>,
    /// Several ports per pod, each an endpoint (data-parallel ranks behind an HTTP
    /// server each): the endpoint on the i-th port publishes KV events on
    /// `kv_events_port + i` (and replays on `kv_events_replay_port + i`). Empty: `port`.
    pub target_ports: Vec<u16>,
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
            bootstrap_port: None,
            api_url: None,
            inference_pool: None,
            target_ports: Vec::new(),
        }
    }
}

impl WorkersKubernetesConfig {
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
        if !cfg!(feature = "kubernetes") {
            bail!("workers_kubernetes needs kvgate built with `--features kubernetes`");
        }
        if self.label_selector.trim().is_empty() && self.inference_pool.is_none() {
            bail!(
                "workers_kubernetes.label_selector (or inference_pool) must name the engines' pods"
            );
        }
        if self.port == 0 || self.target_ports.contains(&0) {
            bail!("workers_kubernetes: the ports must be positive");
        }
        if self.target_ports.len() > 1 && self.dp_size > 1 {
            bail!("workers_kubernetes: several target_ports are the ranks; dp_size must be 1");
        }
        self.ports().validate("workers_kubernetes")
    }

    /// The pods' ports (each an endpoint): `target_ports`, else `port`.
    pub fn pod_ports(&self) -> Vec<u16> {
        if self.target_ports.is_empty() {
            vec![self.port]
        } else {
            self.target_ports.clone()
        }
    }

    /// What each pod found is given.
    pub fn ports(&self) -> DiscoveredPorts {
        DiscoveredPorts {
            kv_events_port: self.kv_events_port,
            kv_events_replay_port: self.kv_events_replay_port,
            dp_size: self.dp_size,
            bootstrap_port: self.bootstrap_port,
            target_ports: self.pod_ports(),
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
    pub(crate) fn validate(&self) -> anyhow::Result<()> {
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
            target_ports: Vec::new(),
        }
    }
}

/// What a discovered worker is given besides its address (from `workers_dns` or
/// `workers_kubernetes`): the engines' KV-event and replay ports and their ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveredPorts {
    pub kv_events_port: Option<u16>,
    pub kv_events_replay_port: Option<u16>,
    pub dp_size: u32,
    pub bootstrap_port: Option<u16>,
    /// A pod's HTTP ports when it has several (an InferencePool's `targetPorts`): the
    /// endpoint on the i-th publishes its KV events on the events port + i.
    pub target_ports: Vec<u16>,
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
        // The i-th target port's rank publishes on the events ports + i.
        let rank = self
            .target_ports
            .iter()
            .position(|p| *p == addr.port())
            .unwrap_or(0) as u16;
        let at = |port: Option<u16>| port.map(|p| format!("tcp://{ip}:{}", p.saturating_add(rank)));
        WorkerConfig {
            url: format!("http://{ip}:{}", addr.port()),
            kv_events: at(self.kv_events_port),
            kv_events_replay: at(self.kv_events_replay_port),
            dp_size: self.dp_size,
            bootstrap_port: self.bootstrap_port,
        }
    }
}

/// A `NAME:PORT` setting (a DNS name and a port).
pub(crate) fn validate_name_port(what: &str, value: &str) -> anyhow::Result<()> {
    match value.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(()),
        _ => bail!("{what} {value:?} must be NAME:PORT"),
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
