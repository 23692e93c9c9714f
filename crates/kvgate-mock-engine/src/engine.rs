//! Starting a whole engine in-process: engine loop, KV event publisher, HTTP server.
//!
//! Owns assembly and lifecycle (bind, serve, shut down) of one mock engine; used by
//! the CLI and by other crates' tests and benchmarks. No simulation or HTTP logic.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use anyhow::Context;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::disaggregation::{bootstrap_router, Disaggregation, PdMode, PdRole};
use crate::kv_publisher::{KvPublisher, PublisherConfig};
use crate::scheduler::{SimConfig, Simulator};
use crate::server::{router, unix_now, AppState};
use crate::tokenizer::{CheapTokenizer, PromptTokenizer};

/// Everything needed to run one engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub sim: SimConfig,
    /// HTTP bind host.
    pub host: String,
    /// HTTP port; 0 picks an ephemeral port.
    pub port: u16,
    /// Served model name.
    pub model: String,
    /// Simulated time runs this many times faster than real time.
    pub speedup: f64,
    /// KV events (None = off).
    pub kv_events: Option<PublisherConfig>,
    /// A directory with `tokenizer.json` (+ `tokenizer_config.json`); None = the
    /// deterministic cheap tokenizer.
    pub tokenizer: Option<PathBuf>,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: u32,
    /// Request bodies above this size are refused with 413 (text/plain, as a web
    /// server in front of an engine may); vLLM itself sets no limit.
    pub max_body_bytes: usize,
    /// Prefill/decode disaggregation: this engine's role and protocol (None = an
    /// ordinary engine).
    pub pd: Option<crate::disaggregation::PdConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            sim: SimConfig::default(),
            host: "127.0.0.1".into(),
            port: 0,
            model: "mock-model".into(),
            speedup: 1.0,
            kv_events: Some(PublisherConfig::default()),
            tokenizer: None,
            default_max_tokens: 16,
            max_body_bytes: 256 << 20,
            pd: None,
        }
    }
}

/// A running engine. Dropping it does not stop it; call [`RunningEngine::shutdown`].
pub struct RunningEngine {
    pub http_addr: SocketAddr,
    /// `tcp://host:port` of the KV events PUB socket.
    pub kv_events_endpoint: Option<String>,
    /// `tcp://host:port` of the replay ROUTER socket.
    pub replay_endpoint: Option<String>,
    /// An SGLang prefill engine's bootstrap server.
    pub bootstrap_addr: Option<SocketAddr>,
    cancel: CancellationToken,
    server: JoinHandle<()>,
}

impl RunningEngine {
    /// `http://host:port` of the OpenAI server.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// Stop serving, stop the engine loop and close the sockets.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        let _ = self.server.await;
    }

    /// A token that is cancelled when the engine stops (for callers that wait on it).
    pub fn cancellation(&self) -> CancellationToken {
        self.cancel.clone()
    }
}

fn load_tokenizer(dir: Option<&PathBuf>) -> anyhow::Result<Arc<dyn PromptTokenizer>> {
    match dir {
        None => Ok(Arc::new(CheapTokenizer)),
        Some(dir) => crate::local_tokenizer::load(dir),
    }
}

/// Start an engine on the current tokio runtime and return once it is listening.
pub async fn spawn(config: EngineConfig) -> anyhow::Result<RunningEngine> {
    let tokenizer = load_tokenizer(config.tokenizer.as_ref())?;
    let max_model_len = config.sim.max_sequence_len();
    let sim = Simulator::new(config.sim.clone()).context("invalid engine configuration")?;
    let cancel = CancellationToken::new();

    let publisher = match &config.kv_events {
        Some(p) => Some(KvPublisher::start(p.clone(), cancel.clone()).await?),
        None => None,
    };
    let kv_events_endpoint = publisher.as_ref().map(|p| p.endpoint.clone());
    let replay_endpoint = publisher.as_ref().and_then(|p| p.replay_endpoint.clone());

    let faults = publisher.clone();
    let latency = config.sim.latency;
    let block_size = config.sim.block_size;
    let engine = crate::driver::start(sim, config.speedup, publisher, cancel.clone());
    let listener = tokio::net::TcpListener::bind((config.host.as_str(), config.port))
        .await
        .with_context(|| format!("binding HTTP on {}:{}", config.host, config.port))?;
    let http_addr = listener.local_addr()?;
    let pd = config.pd.clone().map(|pd| {
        Arc::new(Disaggregation::new(
            pd,
            http_addr,
            block_size,
            latency,
            config.speedup,
        ))
    });
    let mut bootstrap_addr = None;
    if let Some(pd) = pd
        .as_ref()
        .filter(|pd| pd.config.role == PdRole::Prefill && pd.config.mode == PdMode::Sglang)
    {
        let port = pd.config.bootstrap_port;
        let bootstrap = tokio::net::TcpListener::bind((config.host.as_str(), port))
            .await
            .with_context(|| format!("binding the bootstrap server on {}:{port}", config.host))?;
        bootstrap_addr = Some(bootstrap.local_addr()?);
        let app = bootstrap_router(pd.clone());
        let stop = cancel.clone();
        tokio::spawn(async move {
            let _ = axum::serve(bootstrap, app)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
        });
    }
    let state = AppState {
        engine,
        tokenizer,
        model: config.model.clone(),
        max_model_len,
        default_max_tokens: config.default_max_tokens.max(1),
        created: unix_now(),
        next_response: Arc::new(AtomicU64::new(0)),
        max_body_bytes: config.max_body_bytes,
        publisher: faults,
        pd,
    };
    let app = router(state);
    let stop = cancel.clone();
    let server = tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { stop.cancelled().await })
            .await;
        if let Err(err) = result {
            tracing::error!(%err, "mock engine HTTP server failed");
        }
    });
    Ok(RunningEngine {
        http_addr,
        kv_events_endpoint,
        replay_endpoint,
        bootstrap_addr,
        cancel,
        server,
    })
}
