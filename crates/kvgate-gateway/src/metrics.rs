//! Prometheus metrics for `GET /metrics`.
//!
//! Owns the metric registry and the text rendering. Counters and histograms are
//! updated on the request path; per-worker load gauges (from the ledger), health,
//! index size and the KV-event ingestion counters (from kvgate-events) are read at
//! scrape time, so the hot path never touches them. Also owns every label whose values
//! are known ahead (so each series exists from the first scrape) and the one place a
//! request is counted in `kvgate_requests_total` ([`RequestRecord`]). Must not make
//! routing decisions, and imports nothing of the gateway: every module records here.

use std::fmt::Write as _;
use std::sync::Arc;

use http::StatusCode;
use parking_lot::Mutex;

use kvgate_events::EventMetricsSnapshot;
use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

/// The `reason` labels of `kvgate_retries_total`: a retryable HTTP status, or why an
/// attempt got no response head (`SendError::reason`).
pub const RETRY_REASONS: [&str; 5] = [
    "status",
    "connect",
    "transport",
    "first_byte_timeout",
    "worker_down",
];

/// The `route` labels of `kvgate_disaggregated_requests_total`.
pub const DISAGGREGATED_ROUTES: [&str; 4] =
    ["split", "whole", "handover_failed", "prefill_retried"];

/// The `to` labels of `kvgate_worker_health_transitions_total`.
pub const BREAKER_TRANSITIONS: [&str; 2] = ["open", "closed"];

/// The outcomes `kvgate_peer_decisions_total` counts.
pub const PEER_DECISION_OUTCOMES: [&str; 3] = ["asked", "fallback", "served"];

/// How a proxied response ended (`kvgate_response_ends_total{outcome}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ResponseEnd {
    Complete,
    ClientDisconnect,
    UpstreamError,
    Timeout,
    /// Health checks declared the worker dead mid-response.
    WorkerDown,
    /// The gateway's shutdown grace period ended mid-response.
    Shutdown,
}

impl ResponseEnd {
    pub const ALL: [ResponseEnd; 6] = [
        ResponseEnd::Complete,
        ResponseEnd::ClientDisconnect,
        ResponseEnd::UpstreamError,
        ResponseEnd::Timeout,
        ResponseEnd::WorkerDown,
        ResponseEnd::Shutdown,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ResponseEnd::Complete => "complete",
            ResponseEnd::ClientDisconnect => "client_disconnect",
            ResponseEnd::UpstreamError => "upstream_error",
            ResponseEnd::Timeout => "timeout",
            ResponseEnd::WorkerDown => "worker_down",
            ResponseEnd::Shutdown => "shutdown",
        }
    }
}

/// One request's line in `kvgate_requests_total`, counted exactly once however the
/// request ends: with the status it was answered with (and the worker that answered,
/// when one did), or as 499 when it is dropped unanswered (the client went away while
/// it waited for admission, tokenization, a worker slot or a first byte). Shared
/// (`Clone`) between the front door, which answers, and the request's pipeline, which
/// names its model and the worker it waits on.
#[derive(Clone)]
pub struct RequestRecord(Arc<Mutex<RecordState>>);

struct RecordState {
    counter: IntCounterVec,
    model: Option<Arc<str>>,
    policy: &'static str,
    /// The worker the request waits on now (for a 499).
    worker: Option<Arc<str>>,
    counted: bool,
}

impl RequestRecord {
    pub fn new(metrics: &Metrics) -> Self {
        Self(Arc::new(Mutex::new(RecordState {
            counter: metrics.requests.clone(),
            model: None,
            policy: "",
            worker: None,
            counted: false,
        })))
    }

    /// The request's model, and the policy that routes it.
    pub fn model(&self, name: &Arc<str>, policy: &'static str) {
        let mut s = self.0.lock();
        s.model = Some(name.clone());
        s.policy = policy;
    }

    /// The worker the request was sent to (its 499's worker if the client leaves now).
    pub fn worker(&self, url: &Arc<str>) {
        self.0.lock().worker = Some(url.clone());
    }

    /// Counts the request as answered with `status` by `worker` (`None`: the gateway
    /// answered itself). Only the first call counts.
    pub fn answered(&self, status: StatusCode, worker: Option<&str>) {
        let mut s = self.0.lock();
        if std::mem::replace(&mut s.counted, true) {
            return;
        }
        let model = s.model.as_deref().unwrap_or("");
        s.counter
            .with_label_values(&[model, worker.unwrap_or(""), s.policy, status.as_str()])
            .inc();
    }
}

impl Drop for RecordState {
    fn drop(&mut self) {
        if !self.counted {
            let worker = self.worker.as_deref().unwrap_or("");
            let model = self.model.as_deref().unwrap_or("");
            self.counter
                .with_label_values(&[model, worker, self.policy, "499"])
                .inc();
        }
    }
}

/// All gateway metrics.
pub struct Metrics {
    registry: Registry,
    /// Responses by model, worker (URL, or "" when the gateway answered), policy, status.
    pub requests: IntCounterVec,
    pub decision_seconds: HistogramVec,
    pub routing_decisions: IntCounterVec,
    pub tokenize_seconds: HistogramVec,
    pub retries: IntCounterVec,
    /// Disaggregated models' requests by how they ran: `split` (prefill and decode
    /// legs), `whole` (short enough to skip the split), `handover_failed` (the prefill
    /// answer could not be handed to a decode worker), `prefill_retried` (an SGLang
    /// pair tried again after its prefill leg failed).
    pub disaggregated: IntCounterVec,
    pub stream_ends: IntCounterVec,
    pub predicted_cached_tokens: IntCounterVec,
    pub reported_cached_tokens: IntCounterVec,
    pub reported_prompt_tokens: IntCounterVec,
    pub cached_tokens_error: HistogramVec,
    pub ttft_prediction_error: HistogramVec,
    pub health_transitions: IntCounterVec,
    pub worker_stalls: IntCounterVec,
    pub index_purged_entries: IntCounterVec,
    worker_in_flight: IntGaugeVec,
    worker_prefill_tokens: IntGaugeVec,
    worker_decode_blocks: GaugeVec,
    worker_healthy: IntGaugeVec,
    worker_unseen_requests: IntGaugeVec,
    worker_prediction_ratio: GaugeVec,
    worker_credit_trust: GaugeVec,
    ledger_active: IntGaugeVec,
    ledger_booked: IntGaugeVec,
    ledger_swept: IntGaugeVec,
    index_entries: IntGaugeVec,
    index_lookup_waits: IntGaugeVec,
    tokenize_cache_hits: IntGaugeVec,
    tokenize_cache_misses: IntGaugeVec,
    tokenize_cache_bytes: IntGaugeVec,
    /// Load reports sent to peers (`out`, one per report per subscribed peer) and
    /// received from them (`in`).
    pub peer_reports: IntCounterVec,
    /// Peers whose report stream this replica follows now.
    pub peers_connected: IntGauge,
    /// Choices made at the leader replica: `asked` (this replica used the leader's
    /// choice), `fallback` (the leader did not answer or refused: chosen here), `served`
    /// (chosen here for a peer).
    pub peer_decisions: IntCounterVec,
    /// Peers following this replica's report stream now.
    pub peer_subscribers: IntGauge,
    peer_in_flight: IntGaugeVec,
    peer_replicas: IntGaugeVec,
}

fn counter(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

/// Sets one model's series of an integer gauge to a count (saturating).
fn set_count(gauge: &IntGaugeVec, model: &str, count: u64) {
    gauge
        .with_label_values(&[model])
        .set(count.min(i64::MAX as u64) as i64);
}

fn igauge(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

fn plain_gauge(r: &Registry, name: &str, help: &str) -> prometheus::Result<IntGauge> {
    let g = IntGauge::new(name, help)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

fn gauge(r: &Registry, name: &str, help: &str, labels: &[&str]) -> prometheus::Result<GaugeVec> {
    let g = GaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: Vec<f64>,
) -> prometheus::Result<HistogramVec> {
    let h = HistogramVec::new(HistogramOpts::new(name, help).buckets(buckets), labels)?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

/// Buckets for sub-millisecond to second latencies.
fn latency_buckets() -> Vec<f64> {
    vec![
        5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
        0.25, 0.5, 1.0,
    ]
}

/// Symmetric buckets for (reported − predicted) cached tokens.
fn error_buckets() -> Vec<f64> {
    let pos = [0.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0];
    let mut v: Vec<f64> = pos.iter().skip(1).rev().map(|x| -x - 0.5).collect();
    v.extend(pos.iter().map(|x| x + 0.5));
    v
}

impl Metrics {
    pub fn new() -> prometheus::Result<Metrics> {
        let r = Registry::new();
        let mw = &["model", "worker"];
        Ok(Metrics {
            requests: counter(&r, "kvgate_requests_total", "Requests answered, by model, worker, policy and HTTP status", &["model", "worker", "policy", "status"])?,
            decision_seconds: histogram(&r, "kvgate_routing_decision_seconds", "Time to select a worker (policy + index lookup)", &["model", "policy"], latency_buckets())?,
            routing_decisions: counter(&r, "kvgate_routing_decisions_total", "Workers chosen by this replica's policy (for its own requests and for peers' at the leader), by the rule that decided (kv_aware: cached, least_work, warmup; with a latency objective: objective, objective_missed)", &["model", "policy", "rule"])?,
            tokenize_seconds: histogram(&r, "kvgate_tokenization_seconds", "Time to tokenize a request for routing", &["model"], latency_buckets())?,
            retries: counter(&r, "kvgate_retries_total", "Requests retried on another worker before the first byte", &["model", "reason"])?,
            disaggregated: counter(&r, "kvgate_disaggregated_requests_total", "Disaggregated models' requests: split (prefill and decode legs), whole (skipped the split), handover_failed, prefill_retried", &["model", "route"])?,
            stream_ends: counter(&r, "kvgate_response_ends_total", "How proxied responses ended: complete, client_disconnect, upstream_error, timeout", &["model", "outcome"])?,
            predicted_cached_tokens: counter(&r, "kvgate_predicted_cached_tokens_total", "Prompt tokens the policy predicted the engine would serve from cache (requests whose engine reported usage)", &["model"])?,
            reported_cached_tokens: counter(&r, "kvgate_reported_cached_tokens_total", "usage.prompt_tokens_details.cached_tokens reported by engines", &["model"])?,
            reported_prompt_tokens: counter(&r, "kvgate_reported_prompt_tokens_total", "usage.prompt_tokens reported by engines", &["model"])?,
            cached_tokens_error: histogram(&r, "kvgate_cached_tokens_prediction_error", "Engine-reported minus predicted cached tokens, per request", &["model"], error_buckets())?,
            ttft_prediction_error: histogram(&r, "kvgate_ttft_prediction_error", "Per routed request, |predicted - observed| / observed time to first token (booking to first byte); the prediction is the time model's at booking", &["model"], vec![0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0])?,
            health_transitions: counter(&r, "kvgate_worker_health_transitions_total", "Circuit breaker transitions", &["model", "worker", "to"])?,
            worker_stalls: counter(&r, "kvgate_worker_stalls_total", "Times a worker was taken out of rotation because its engine sent no answer byte and no KV event for health.stall_ms while it held requests", &["model", "worker"])?,
            index_purged_entries: counter(&r, "kvgate_index_purged_entries_total", "Index entries purged for dead or removed workers", &["model"])?,
            worker_in_flight: igauge(&r, "kvgate_worker_in_flight", "Requests in flight per worker (ledger)", mw)?,
            worker_prefill_tokens: igauge(&r, "kvgate_worker_prefill_tokens", "Uncached prompt tokens waiting for prefill per worker (ledger)", mw)?,
            worker_decode_blocks: gauge(&r, "kvgate_worker_decode_blocks", "Weighted decode KV blocks per worker (ledger)", mw)?,
            worker_healthy: igauge(&r, "kvgate_worker_healthy", "1 when the worker's circuit breaker is closed", mw)?,
            worker_unseen_requests: igauge(&r, "kvgate_worker_unseen_requests", "Requests the worker's engine last reported holding beyond those kvgate replicas booked there (clients calling it directly, other routers); counted as its load", mw)?,
            worker_prediction_ratio: gauge(&r, "kvgate_worker_cached_tokens_prediction_ratio", "Predicted over engine-reported cached prompt tokens per worker, over about the last 64 reports (1 = honest, above 1 = over-predicting)", mw)?,
            worker_credit_trust: gauge(&r, "kvgate_worker_credit_trust", "Share of tokens credited to a worker for prompts in prefill that its engine then served from cache (a diagnostic of kv_aware's prefill credit)", mw)?,
            ledger_active: igauge(&r, "kvgate_ledger_active_bookings", "Bookings currently held", &["model"])?,
            ledger_booked: igauge(&r, "kvgate_ledger_booked_total", "Bookings made since start", &["model"])?,
            ledger_swept: igauge(&r, "kvgate_ledger_swept_total", "Bookings freed by the TTL sweep (leaks caught)", &["model"])?,
            index_entries: igauge(&r, "kvgate_index_entries", "Prefix index entries per model", &["model"])?,
            index_lookup_waits: igauge(&r, "kvgate_index_lookup_waits_total", "Reads of the prefix index (routing lookups, also scrapes and peer snapshots) that found it being written and waited for the writer (at most a slice of its batch)", &["model"])?,
            tokenize_cache_hits: igauge(&r, "kvgate_tokenize_cache_hits_total", "Text segments (a message between special tokens) whose ids local tokenization took from its cache", &["model"])?,
            tokenize_cache_misses: igauge(&r, "kvgate_tokenize_cache_misses_total", "Text segments long enough for the cache that local tokenization encoded", &["model"])?,
            tokenize_cache_bytes: igauge(&r, "kvgate_tokenize_cache_bytes", "Bytes the tokenization cache holds (at most --tokenize-cache-mib)", &["model"])?,
            peer_reports: counter(&r, "kvgate_peer_reports_total", "Load reports exchanged with peer replicas: out = sent (per subscriber), in = received", &["direction"])?,
            peer_decisions: counter(&r, "kvgate_peer_decisions_total", "Worker choices made at the leader replica: asked = used the leader's choice, fallback = the leader did not answer or refused (chosen here), served = chosen here for a peer", &["model", "outcome"])?,
            peers_connected: plain_gauge(&r, "kvgate_peers_connected", "Peer replicas whose load reports this replica follows")?,
            peer_subscribers: plain_gauge(&r, "kvgate_peer_subscribers", "Peer replicas following this replica's load reports")?,
            peer_in_flight: igauge(&r, "kvgate_peer_in_flight", "Requests in flight that peer replicas reported booking, per model", &["model"])?,
            peer_replicas: igauge(&r, "kvgate_peer_replicas", "Peer replicas whose bookings are held, per model", &["model"])?,
            registry: r,
        })
    }

    /// Creates, at zero, every series of a model whose labels are known before its
    /// first request, so each metric a dashboard or alert names is in `/metrics` from
    /// the first scrape (a counter that first appears at 1 looks like no increase to
    /// `rate()`). Called when the gateway is built.
    pub fn init_model(&self, model: &str, policy: &str) {
        self.decision_seconds.with_label_values(&[model, policy]);
        if policy == kvgate_core::PolicyKind::KvAware.as_str() {
            for rule in kvgate_core::KvAwareRule::ALL {
                self.routing_decisions
                    .with_label_values(&[model, policy, rule.as_str()]);
            }
        }
        self.tokenize_seconds.with_label_values(&[model]);
        for reason in RETRY_REASONS {
            self.retries.with_label_values(&[model, reason]);
        }
        for outcome in ResponseEnd::ALL {
            self.stream_ends
                .with_label_values(&[model, outcome.as_str()]);
        }
        for route in DISAGGREGATED_ROUTES {
            self.disaggregated.with_label_values(&[model, route]);
        }
        for outcome in PEER_DECISION_OUTCOMES {
            self.peer_decisions.with_label_values(&[model, outcome]);
        }
        for c in [
            &self.predicted_cached_tokens,
            &self.reported_cached_tokens,
            &self.reported_prompt_tokens,
            &self.index_purged_entries,
        ] {
            c.with_label_values(&[model]);
        }
        self.cached_tokens_error.with_label_values(&[model]);
        self.ttft_prediction_error.with_label_values(&[model]);
        for direction in ["in", "out"] {
            self.peer_reports.with_label_values(&[direction]);
        }
    }

    /// [`init_model`](Self::init_model) for a worker's series (at start and when one is
    /// added): its answered requests and its health transitions.
    pub fn init_worker(&self, model: &str, policy: &str, worker: &str) {
        self.requests
            .with_label_values(&[model, worker, policy, "200"]);
        for to in BREAKER_TRANSITIONS {
            self.health_transitions
                .with_label_values(&[model, worker, to]);
        }
        self.worker_stalls.with_label_values(&[model, worker]);
    }

    /// The registry, for a front door that adds metrics of its own (the Endpoint
    /// Picker's, crate kvgate-epp); they render with the gateway's at `/metrics`.
    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// Renders every metric in the Prometheus text format. `fill` sets the
    /// scrape-time gauges; `events` adds KV-event ingestion counters by worker URL.
    pub fn render(
        &self,
        fill: impl FnOnce(&ScrapeGauges<'_>),
        events: &EventMetricsSnapshot,
        worker_url: impl Fn(kvgate_core::WorkerId) -> Option<String>,
    ) -> String {
        for g in [
            &self.worker_in_flight,
            &self.worker_prefill_tokens,
            &self.worker_healthy,
            &self.worker_unseen_requests,
            &self.ledger_active,
            &self.ledger_booked,
            &self.ledger_swept,
            &self.index_entries,
            &self.index_lookup_waits,
            &self.tokenize_cache_hits,
            &self.tokenize_cache_misses,
            &self.tokenize_cache_bytes,
            &self.peer_in_flight,
            &self.peer_replicas,
        ] {
            g.reset();
        }
        for g in [
            &self.worker_decode_blocks,
            &self.worker_prediction_ratio,
            &self.worker_credit_trust,
        ] {
            g.reset();
        }
        fill(&ScrapeGauges { m: self });
        let mut buf = Vec::with_capacity(16 * 1024);
        if let Err(err) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::warn!(%err, "cannot encode metrics");
        }
        let mut out = String::from_utf8(buf).unwrap_or_default();
        render_events(&mut out, events, worker_url);
        out
    }
}

/// Setters for scrape-time gauges.
pub struct ScrapeGauges<'a> {
    m: &'a Metrics,
}

impl ScrapeGauges<'_> {
    /// One worker's booked load, its health, and the requests its engine reported
    /// beyond the bookings (`unseen`).
    pub fn worker(
        &self,
        model: &str,
        worker: &str,
        load: &kvgate_core::WorkerLoad,
        healthy: bool,
        unseen: u32,
    ) {
        let l = [model, worker];
        self.m
            .worker_unseen_requests
            .with_label_values(&l)
            .set(i64::from(unseen));
        self.m
            .worker_in_flight
            .with_label_values(&l)
            .set(i64::from(load.in_flight));
        self.m
            .worker_prefill_tokens
            .with_label_values(&l)
            .set(load.prefill_tokens.min(i64::MAX as u64) as i64);
        self.m
            .worker_decode_blocks
            .with_label_values(&l)
            .set(load.decode_blocks);
        self.m
            .worker_healthy
            .with_label_values(&l)
            .set(i64::from(healthy));
    }

    /// How honest the predictions for one worker have been.
    pub fn accuracy(&self, model: &str, worker: &str, a: &kvgate_core::WorkerAccuracy) {
        let l = [model, worker];
        // NaN (unknown) until the worker's engine reported cached tokens.
        self.m
            .worker_prediction_ratio
            .with_label_values(&l)
            .set(a.ratio().unwrap_or(f64::NAN));
        self.m
            .worker_credit_trust
            .with_label_values(&l)
            .set(a.credit_trust());
    }

    pub fn ledger(&self, model: &str, stats: &kvgate_core::LedgerStats) {
        set_count(&self.m.ledger_active, model, stats.active);
        set_count(&self.m.ledger_booked, model, stats.booked);
        set_count(&self.m.ledger_swept, model, stats.swept);
    }

    /// What the peer replicas reported for one model.
    pub fn peers(&self, model: &str, stats: &kvgate_core::PeerStats) {
        set_count(&self.m.peer_in_flight, model, stats.in_flight);
        set_count(&self.m.peer_replicas, model, stats.replicas as u64);
    }

    /// A model's tokenization cache.
    pub fn tokenize_cache(&self, model: &str, stats: &kvgate_tokenize::SegmentCacheStats) {
        set_count(&self.m.tokenize_cache_hits, model, stats.hits);
        set_count(&self.m.tokenize_cache_misses, model, stats.misses);
        set_count(&self.m.tokenize_cache_bytes, model, stats.bytes);
    }

    /// A model's prefix index: its entries and the lookups so far that waited for a
    /// writer ([`kvgate_events::IndexLock::read_waits`]).
    pub fn index(&self, model: &str, entries: usize, lookup_waits: u64) {
        set_count(&self.m.index_entries, model, entries as u64);
        set_count(&self.m.index_lookup_waits, model, lookup_waits);
    }
}

fn render_events(
    out: &mut String,
    snap: &EventMetricsSnapshot,
    worker_url: impl Fn(kvgate_core::WorkerId) -> Option<String>,
) {
    type Field = fn(&kvgate_events::WorkerEventStats) -> u64;
    let counters: [(&str, &str, Field); 13] = [
        ("batches", "Event batches received", |s| s.batches),
        ("events_applied", "Events applied to the index", |s| {
            s.events_applied
        }),
        ("blocks_stored", "Blocks stored", |s| s.blocks_stored),
        ("blocks_removed", "Blocks removed", |s| s.blocks_removed),
        ("clears", "AllBlocksCleared events", |s| s.clears),
        ("gaps", "Sequence gaps detected", |s| s.gaps),
        ("replays", "Replays performed", |s| s.replays),
        ("replay_failures", "Replays that failed", |s| {
            s.replay_failures
        }),
        ("purges", "Worker purges after an untrusted stream", |s| {
            s.purges
        }),
        ("reconnects", "Reconnects", |s| s.reconnects),
        (
            "restarts",
            "Engine restarts seen (event sequence went backwards)",
            |s| s.restarts,
        ),
        (
            "incomplete_starts",
            "Joins of the engine's event stream that could not learn everything it cached before (no replay endpoint, a failed replay, or a replay buffer that no longer reaches back): the index may miss blocks until the cache turns over",
            |s| s.incomplete_starts,
        ),
        (
            "snapshot_loads",
            "Snapshots of this worker's index entries loaded from a peer replica at start",
            |s| s.snapshot_loads,
        ),
    ];
    let labels: Vec<String> = snap
        .workers
        .iter()
        .map(|s| escape(&worker_url(s.worker).unwrap_or_else(|| s.worker.to_string())))
        .collect();
    for (name, help, field) in counters {
        let _ = writeln!(out, "# HELP kvgate_kv_events_{name}_total {help}");
        let _ = writeln!(out, "# TYPE kvgate_kv_events_{name}_total counter");
        for (s, l) in snap.workers.iter().zip(&labels) {
            let _ = writeln!(
                out,
                "kvgate_kv_events_{name}_total{{worker=\"{l}\"}} {}",
                field(s)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP kvgate_kv_events_dropped_total Events or messages not applied to the index, by reason"
    );
    let _ = writeln!(out, "# TYPE kvgate_kv_events_dropped_total counter");
    for (s, l) in snap.workers.iter().zip(&labels) {
        for (reason, n) in s.drops() {
            let _ = writeln!(
                out,
                "kvgate_kv_events_dropped_total{{reason=\"{}\",worker=\"{l}\"}} {n}",
                reason.as_str()
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP kvgate_kv_events_connected 1 while the worker's event stream is connected"
    );
    let _ = writeln!(out, "# TYPE kvgate_kv_events_connected gauge");
    for (s, l) in snap.workers.iter().zip(&labels) {
        let _ = writeln!(
            out,
            "kvgate_kv_events_connected{{worker=\"{l}\"}} {}",
            u8::from(s.connected)
        );
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_registered_and_event_metrics() {
        let m = Metrics::new().unwrap();
        m.requests
            .with_label_values(&["m", "http://w", "round_robin", "200"])
            .inc();
        let ev = kvgate_events::EventMetrics::new();
        ev.worker(kvgate_core::WorkerId(3))
            .batches
            .fetch_add(7, std::sync::atomic::Ordering::Relaxed);
        let snap = ev.snapshot();
        let text = m.render(|g| g.index("m", 5, 2), &snap, |_| Some("http://w".into()));
        assert!(text.contains("kvgate_requests_total{model=\"m\",policy=\"round_robin\",status=\"200\",worker=\"http://w\"} 1"), "{text}");
        assert!(
            text.contains("kvgate_kv_events_batches_total{worker=\"http://w\"} 7"),
            "{text}"
        );
        assert!(
            text.contains("kvgate_index_entries{model=\"m\"} 5"),
            "{text}"
        );
        assert!(
            text.contains("kvgate_index_lookup_waits_total{model=\"m\"} 2"),
            "{text}"
        );
    }

    /// Every drop reason is exported for every worker, zero or not.
    #[test]
    fn every_event_drop_reason_is_exported() {
        let m = Metrics::new().unwrap();
        let ev = kvgate_events::EventMetrics::new();
        let w = ev.worker(kvgate_core::WorkerId(0));
        let at = kvgate_core::WorkerRef::new(kvgate_core::WorkerId(0), 0);
        w.dropped(at, kvgate_events::DropReason::TokenCountMismatch, 2);
        w.dropped(at, kvgate_events::DropReason::Stale, 1);
        kvgate_events::WorkerCounters::inc(&w.restarts);
        let text = m.render(|_| {}, &ev.snapshot(), |_| Some("http://w".into()));
        for reason in kvgate_events::DropReason::ALL {
            let n = match reason {
                kvgate_events::DropReason::TokenCountMismatch => 2,
                kvgate_events::DropReason::Stale => 1,
                _ => 0,
            };
            let line = format!(
                "kvgate_kv_events_dropped_total{{reason=\"{}\",worker=\"http://w\"}} {n}",
                reason.as_str()
            );
            assert!(text.contains(&line), "{line} missing from {text}");
        }
        assert!(
            text.contains("kvgate_kv_events_restarts_total{worker=\"http://w\"} 1"),
            "{text}"
        );
    }
}
