//! The running gateway's shared state and its lifecycle operations.
//!
//! Owns [`Gateway`]: the models (with LoRA-adapter aliases, each with its selection
//! service), the worker-id counter, the upstream HTTP client, limits and metrics.
//! Adding a worker registers it with the model's selection service (which starts its
//! KV-event subscribers); removing one (or declaring it dead) tells the service, which
//! stops them and purges its index entries. Must not serve HTTP (server.rs) or pick
//! workers (select.rs).

use std::sync::atomic::AtomicU32;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use http::{HeaderName, HeaderValue};
use kvgate_core::{PolicyKind, WorkerId};
use kvgate_events::EventMetrics;
use kvgate_selection::{SelectionService, WorkerEvents};
use kvgate_tokenize::{LocalTokenizer, Tokenizer};
use rustc_hash::FxHashMap;
use tokio_util::sync::CancellationToken;

use crate::config::{Config, ModelConfig, WorkerConfig};
use crate::errors::ApiError;
use crate::limits::GlobalLimiter;
use crate::metrics::Metrics;
use crate::proxy::{build_client, ForwardAuth, HttpClient, Upstream};
use crate::registry::{ModelState, PrefillPool, Worker};

/// Shared state of one gateway process.
pub struct Gateway {
    pub config: Config,
    models: FxHashMap<String, Arc<ModelState>>,
    /// Served names in declaration order (models, then their LoRA adapters).
    names: Vec<(String, Arc<ModelState>, Option<Arc<str>>)>,
    pub(crate) client: HttpClient,
    pub(crate) limiter: GlobalLimiter,
    pub metrics: Metrics,
    pub events: Arc<EventMetrics>,
    pub(crate) shutdown: CancellationToken,
    /// Cancelled when the shutdown grace period ends, just before every worker's
    /// in-flight requests are cut off: a request cut off with this set ends with
    /// `gateway_shutting_down` (an SSE error event, or a JSON 503 before the first
    /// byte); requests still queued or tokenizing watch it directly.
    pub(crate) grace_over: CancellationToken,
    forward_auth: ForwardAuth,
    /// This replica's identity and load reports for its peers.
    pub(crate) peers: Arc<crate::peer_link::hub::PeerHub>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field(
                "models",
                &self.names.iter().map(|n| &n.0).collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// Builds the gateway from a validated config: loads tokenizers, builds policies and
    /// indexes, registers workers and starts their event subscribers. Must run inside a
    /// tokio runtime.
    pub fn build(config: Config, shutdown: CancellationToken) -> anyhow::Result<Arc<Gateway>> {
        config.validate()?;
        let mut models = FxHashMap::default();
        let mut names = Vec::new();
        let mut pending = Vec::new();
        let events = EventMetrics::new();
        // One worker-id counter for every model's service: ids are unique gateway-wide.
        let worker_ids = Arc::new(AtomicU32::new(0));
        let ledger_ttl = Duration::from_secs(config.ledger_ttl_secs.max(1));
        let peers = Arc::new(crate::peer_link::hub::PeerHub::default());
        let client = build_client(&config.timeouts);
        for mc in &config.models {
            let model = match mc.pd_pools() {
                None => build_model(mc, &events, &worker_ids, ledger_ttl, None)?,
                Some((decode, prefill)) => {
                    let pool = Arc::new(build_model(
                        &prefill,
                        &events,
                        &worker_ids,
                        ledger_ttl,
                        None,
                    )?);
                    pending.push((pool.clone(), prefill.workers.clone()));
                    let pd = mc.pd.as_ref().map(|pd| PrefillPool {
                        mode: pd.mode,
                        pool,
                        uncached_token_threshold: pd.uncached_token_threshold,
                    });
                    build_model(&decode, &events, &worker_ids, ledger_ttl, pd)?
                }
            };
            let model = Arc::new(model);
            if config.peers.enabled() {
                // Before any worker is added: their subscribers ask the peers for a
                // snapshot of the worker before replaying its engine's buffer (a
                // prefill pool's too: peers find its workers by URL in either pool).
                for (pool, _) in model.pools() {
                    pool.selection
                        .set_bootstrap(crate::peer_link::client::bootstrap(
                            client.clone(),
                            peers.clone(),
                            config.peers.clone(),
                            config.admin_token.clone(),
                            mc.name.clone(),
                            pool.selection.hasher().fingerprint(),
                        ));
                }
            }
            models.insert(mc.name.clone(), model.clone());
            names.push((mc.name.clone(), model.clone(), None));
            for a in &mc.lora_adapters {
                names.push((a.clone(), model.clone(), Some(Arc::from(a.as_str()))));
            }
            pending.push((model, mc.workers.clone()));
        }
        let worker_auth = match &config.worker_api_key {
            Some(k) => Some(
                HeaderValue::from_str(&format!("Bearer {k}"))
                    .context("worker_api_key contains characters not allowed in a header")?,
            ),
            None => None,
        };
        let gw = Arc::new(Gateway {
            client,
            limiter: GlobalLimiter::new(&config.limits),
            metrics: Metrics::new().context("cannot register metrics")?,
            events,
            shutdown,
            grace_over: CancellationToken::new(),
            forward_auth: ForwardAuth {
                strip_client_auth: config.api_key.is_some(),
                worker_auth,
            },
            models,
            names,
            config,
            peers,
        });
        for (model, workers) in pending {
            gw.metrics.init_model(&model.name, model.kind().as_str());
            for w in workers {
                gw.add_worker_to(&model, w)?;
            }
        }
        Ok(gw)
    }

    /// Looks up the model a request names. `None` is accepted when exactly one model is
    /// served. Returns the model and the LoRA adapter named, if any.
    pub fn resolve(
        &self,
        name: Option<&str>,
    ) -> Result<(&Arc<ModelState>, Option<&Arc<str>>), ApiError> {
        match name {
            Some(n) => {
                if let Some(m) = self.models.get(n) {
                    return Ok((m, None));
                }
                self.names
                    .iter()
                    .find(|(alias, _, lora)| lora.is_some() && alias == n)
                    .map(|(_, m, lora)| (m, lora.as_ref()))
                    .ok_or_else(|| {
                        let known: Vec<&str> = self.names.iter().map(|n| n.0.as_str()).collect();
                        ApiError::unknown_model(n, &known)
                    })
            }
            None if self.models.len() == 1 => Ok((&self.names[0].1, None)),
            None => Err(ApiError::bad_request(
                "missing_model",
                "the request has no \"model\" field and this gateway serves several models",
            )),
        }
    }

    /// Every served name (models and LoRA adapters) with its model.
    pub fn served_names(&self) -> impl Iterator<Item = (&str, &Arc<ModelState>, bool)> {
        self.names
            .iter()
            .map(|(n, m, lora)| (n.as_str(), m, lora.is_some()))
    }

    pub fn model(&self, name: &str) -> Option<&Arc<ModelState>> {
        self.models.get(name)
    }

    pub fn models(&self) -> impl Iterator<Item = &Arc<ModelState>> {
        self.names.iter().filter(|n| n.2.is_none()).map(|n| &n.1)
    }

    /// Every pool of workers: each model, and the prefill pool of a disaggregated
    /// model (health checks, worker metrics, peers' load reports and shutdown cover
    /// them all).
    pub fn pools(&self) -> impl Iterator<Item = &Arc<ModelState>> {
        self.pools_named().map(|(m, _)| m)
    }

    /// As [`Self::pools`], each with its pool's name within its model: `""` for the
    /// model's own workers (a disaggregated model's decode pool), `"prefill"`.
    pub fn pools_named(&self) -> impl Iterator<Item = (&Arc<ModelState>, &'static str)> {
        self.models().flat_map(|m| m.pools())
    }

    /// Header handling for forwarded requests.
    /// How this gateway sends requests to workers.
    pub(crate) fn upstream(&self) -> Upstream<'_> {
        Upstream {
            client: &self.client,
            auth: &self.forward_auth,
            first_byte_timeout: self.config.timeouts.first_byte(),
        }
    }

    /// Health-check based recovery is the probe unless active checks are off.
    /// Index snapshots still being loaded from peer replicas: a replica that picks
    /// before they are in picks blind, so readiness waits for none (`/ready`, and the
    /// Endpoint Picker's gRPC readiness).
    pub fn index_bootstraps(&self) -> usize {
        self.peers.bootstrapping()
    }

    pub(crate) fn passive_open_ms(&self) -> Option<u64> {
        (self.config.health.interval_ms == 0).then_some(self.config.health.open_ms)
    }

    /// Adds a worker to a model at run time.
    pub fn add_worker(&self, model: &str, config: WorkerConfig) -> anyhow::Result<Arc<Worker>> {
        let m = self
            .models
            .get(model)
            .ok_or_else(|| anyhow::anyhow!("unknown model {model:?}"))?
            .clone();
        self.add_worker_to(&m, config)
    }

    /// A model's pool by name within it (`""`: the model's own workers; `prefill`).
    pub fn pool(&self, model: &str, pool: &str) -> Option<Arc<ModelState>> {
        self.pools_named()
            .find(|(m, p)| *m.name == *model && *p == pool)
            .map(|(m, _)| m.clone())
    }

    /// Adds a worker to one pool (a model's own workers, or its prefill pool).
    pub(crate) fn add_worker_to(
        &self,
        model: &Arc<ModelState>,
        config: WorkerConfig,
    ) -> anyhow::Result<Arc<Worker>> {
        config.validate()?;
        if model.worker_by_url(&config.url).is_some() {
            anyhow::bail!(
                "worker {} is already registered for model {:?}",
                config.url,
                &*model.name
            );
        }
        let id = model.selection.allocate_id();
        let worker = Arc::new(Worker::new(id, config, &self.config.health.path)?);
        let events = worker
            .config
            .kv_events
            .as_ref()
            .map(|endpoint| WorkerEvents {
                endpoint: endpoint.clone(),
                replay_endpoint: worker.config.kv_events_replay.clone(),
                dp_size: worker.config.dp_size,
                block_size: None,
            });
        model.selection.add_worker(id, &worker.url, events)?;
        if let Err(e) = model.insert_worker(worker.clone()) {
            model.selection.remove_worker(id);
            return Err(e);
        }
        self.metrics
            .init_worker(&model.name, model.kind().as_str(), &worker.url);
        tracing::info!(model = %model.name, worker = %worker.url, id = %id, "worker added");
        Ok(worker)
    }

    /// Removes a worker: it gets no new requests, its event subscribers stop and its
    /// index entries are purged. Requests in flight to it finish normally.
    pub fn remove_worker(&self, model: &str, id: WorkerId) -> Option<Arc<Worker>> {
        let m = self.models.get(model)?.clone();
        self.remove_worker_from(&m, id)
    }

    /// Removes a worker from one pool (as [`Self::remove_worker`]).
    pub(crate) fn remove_worker_from(&self, m: &ModelState, id: WorkerId) -> Option<Arc<Worker>> {
        let w = m.remove_worker(id)?;
        let purged = m.selection.remove_worker(id).unwrap_or(0);
        self.count_purged(m, &w, purged, "removed");
        tracing::info!(model = %m.name, worker = %w.url, id = %id, "worker removed");
        Some(w)
    }

    /// Forgets what the index says a worker holds.
    pub(crate) fn purge(&self, model: &ModelState, worker: &Worker, why: &str) {
        let n = model.selection.purge_worker(worker.id);
        self.count_purged(model, worker, n, why);
    }

    fn count_purged(&self, model: &ModelState, worker: &Worker, n: usize, why: &str) {
        if model.index().is_some() {
            self.metrics
                .index_purged_entries
                .with_label_values(&[&*model.name])
                .inc_by(n as u64);
            tracing::info!(model = %model.name, worker = %worker.url, entries = n, why, "purged worker from the prefix index");
        }
    }

    /// URL of a worker id in any model.
    pub fn worker_url(&self, id: WorkerId) -> Option<String> {
        self.pools().find_map(|m| {
            m.workers()
                .iter()
                .find(|w| w.id == id)
                .map(|w| w.url.to_string())
        })
    }

    /// The ticks of a background task that runs every `period` until shutdown.
    pub(crate) fn ticks(&self, period: Duration) -> Ticks {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Ticks {
            interval,
            shutdown: self.shutdown.clone(),
        }
    }
}

/// A background task's schedule: the first tick at once, then one every period (a
/// round that overruns delays the next rather than bunching them), none after shutdown.
pub(crate) struct Ticks {
    interval: tokio::time::Interval,
    shutdown: CancellationToken,
}

impl Ticks {
    /// Waits for the next tick; false once the gateway shuts down.
    pub(crate) async fn next(&mut self) -> bool {
        tokio::select! {
            _ = self.shutdown.cancelled() => false,
            _ = self.interval.tick() => true,
        }
    }
}

fn build_model(
    mc: &ModelConfig,
    events: &Arc<EventMetrics>,
    worker_ids: &Arc<AtomicU32>,
    booking_ttl: Duration,
    prefill: Option<PrefillPool>,
) -> anyhow::Result<ModelState> {
    let name = &mc.name;
    let selection = SelectionService::new(
        mc.selection_config(booking_ttl),
        events.clone(),
        worker_ids.clone(),
    )?;
    let tokenizer = match (&mc.tokenizer, mc.remote_tokenize) {
        (Some(dir), false) => Some(Tokenizer::Local(Arc::new(
            LocalTokenizer::from_dir(dir)
                .with_context(|| {
                    format!(
                        "model {name:?}: cannot load tokenizer from {}",
                        dir.display()
                    )
                })?
                .with_max_prompt_tokens(mc.max_model_len)
                .with_segment_cache(mc.tokenize_cache_mib.saturating_mul(1 << 20)),
        ))),
        _ => None,
    };
    let session_header = HeaderName::from_bytes(mc.session_header.to_ascii_lowercase().as_bytes())
        .with_context(|| format!("model {name:?}: invalid session header"))?;
    if mc.policy == PolicyKind::KvAware && !mc.has_event_source() {
        match mc.kv_fallback {
            Some(fb) => {
                tracing::warn!(model = %name, fallback = %fb, "kv_aware has no KV event source: routing with the fallback policy until workers with --kv-events are added")
            }
            None => {
                tracing::warn!(model = %name, "kv_aware has no KV event source: requests get 503 until workers with --kv-events are added (or pass --kv-fallback POLICY)")
            }
        }
    }
    Ok(ModelState::new(
        mc.clone(),
        selection,
        tokenizer,
        session_header,
        prefill,
    ))
}
