//! Replicas that agree: this gateway's load reports to its peer replicas, and theirs to
//! it.
//!
//! Owns this replica's identity (name, incarnation), the report it publishes (the
//! load it booked per worker, by worker URL, for every model), the report stream it
//! serves at `GET /peer/v1/loads`, following each peer's stream (static URLs, or the
//! addresses of a DNS name re-resolved periodically) and handing what arrives to the
//! model's ledger, which holds it beside this replica's own bookings
//! (`kvgate_core::peer_loads`). Also the index bootstrap over the same links: serving
//! a snapshot of one worker rank's index entries with the event sequence number they
//! reflect (`POST /peer/v1/index`), and the callback a new replica's KV-event
//! subscribers use to ask its peers for one before replaying the engine's buffer. And
//! the transport of decisions made at a leader (`peers.decisions: leader`): which
//! connected replica leads (the smallest name), asking it to choose
//! (`POST /peer/v1/decide`), serving such requests, and the `settled` ids by which a
//! replica's reports tell the leader that a choice it made is now in the replica's own
//! bookings. It must not choose workers itself (the model's selection service does,
//! here and at the leader) or change this replica's own bookings, and it never forwards
//! a peer's load to another peer (each replica reports only what it booked, so nothing
//! is counted twice).
//!
//! Why a leader: reports make every replica see the others' load within `publish_ms`,
//! but requests that reach several replicas at the same instant are decided
//! concurrently, each blind to the others' choices, so they herd onto the same
//! worker however short the reporting interval (measured on the Mooncake trace, whose
//! requests arrive in bursts: docs/BENCHMARKS.md, "Replicas that agree"). One replica
//! deciding for all puts those decisions in order, as a single router would, for one
//! loopback or in-cluster round trip each (the choice is a few microseconds of work;
//! the asker sends the prompt's block keys, not its text). The leader holds each
//! choice as the asker's booking until the asker's report shows it; a leader that does
//! not answer within `decide_timeout_ms` is skipped for a second while every replica
//! decides alone on the reported loads, as with `decisions: local`.
//!
//! Why reports of totals over HTTP, not per-booking messages over ZeroMQ: a report is
//! this replica's whole booked load per worker, sent when it changes (checked every
//! `publish_ms`) and at least every `heartbeat_ms`. A lost, repeated or reordered
//! report cannot leave drift, a late joiner is complete after one report, and a
//! restarted replica's report replaces its old run's bookings by construction; the
//! size is one line per worker, not per request. HTTP rides the listener that is
//! already exposed (no second port in a Kubernetes Service), reuses the admin token
//! for authentication, and a closed connection says at once that a peer is gone
//! (killed process: its bookings drop immediately; silent peer: after `expiry_ms`).
//! The `zeromq` crate's SUB socket neither reports a lost peer nor reconnects (the
//! KV-event subscriber needs its own link watch for that).

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use bytes::{Bytes, BytesMut};
use http::{header, HeaderMap, HeaderName, HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use kvgate_core::{
    BlockKey, Decision, HeldBlock, PeerApplied, PeerReport, SelectError, Tier, WorkerLoad,
};
use kvgate_events::{Bootstrap, RankSnapshot};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::auth::require_bearer;
use crate::config::{PeerDecisions, PeersConfig};
use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::proxy::HttpClient;
use crate::registry::{ModelState, Worker};
use crate::routing::Prepared;

/// Path of the report stream.
pub const LOADS_PATH: &str = "/peer/v1/loads";
/// Path of the index snapshot of one worker rank (`POST` with [`SnapshotRequest`]).
pub const INDEX_PATH: &str = "/peer/v1/index";
/// Path of a choice made at the leader (`POST` with [`DecideRequest`]).
pub const DECIDE_PATH: &str = "/peer/v1/decide";
/// Largest decide request read (the block keys of a prompt of about 1.5M tokens at
/// block size 16).
const MAX_DECIDE_BYTES: usize = 2 << 20;
/// The outcomes `kvgate_peer_decisions_total` counts.
pub const DECISION_OUTCOMES: [&str; 3] = ["asked", "fallback", "served"];
/// Settled ids older than this are forgotten whether or not they were reported.
const SETTLED_MAX_AGE: Duration = Duration::from_secs(10);
/// How long a leader that did not answer is passed over.
const LEADER_BACKOFF: Duration = Duration::from_secs(1);
/// How long a leader that does not decide for peers (a kvgate from before
/// `/peer/v1/decide`, during a rolling update) is passed over.
const LEADER_UNSUPPORTED_BACKOFF: Duration = Duration::from_secs(60);
/// Largest snapshot accepted from a peer.
const MAX_SNAPSHOT_BYTES: usize = 1 << 30;
/// How long one peer may take to answer a snapshot request. The subscriber waits for
/// it before replaying and applying live events (which queue meanwhile), so a hung peer
/// must not hold it long; a snapshot of a million blocks is a few seconds' transfer.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(10);
/// Header with which a follower names itself, so a replica can refuse to follow
/// itself (a DNS name lists every replica, this one included).
pub const REPLICA_HEADER: HeaderName = HeaderName::from_static("x-kvgate-replica");
/// A report line longer than this ends the stream (a peer gone wrong).
const MAX_REPORT_BYTES: usize = 4 << 20;
/// Wait before following a peer again after its stream ended or failed.
const BACKOFF_INITIAL: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Who this replica is among its peers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub replica: String,
    /// Start time in nanoseconds since the Unix epoch: a restart has a larger one.
    pub incarnation: u64,
}

/// A report as it travels: one JSON object per line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireReport {
    pub replica: String,
    pub incarnation: u64,
    pub seq: u64,
    pub models: Vec<WireModel>,
    /// Ids of choices a leader made for this replica that it has booked (or given up)
    /// recently: the leader stops counting them as its own hold on them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settled: Vec<u64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireModel {
    pub model: String,
    /// The model's pool: absent for its own workers, `prefill` for a disaggregated
    /// model's prefill pool.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
    pub workers: Vec<WireLoad>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WireLoad {
    /// The worker's URL, as configured (normalized).
    pub url: String,
    pub in_flight: u32,
    pub prefill_tokens: u64,
    pub decode_blocks: f64,
    /// Prompts in prefill on this worker: per booking, its prompt's checkpoint keys
    /// (for kv_aware's prefill credit at the peers).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prefilling: Vec<Vec<u64>>,
}

/// This replica's side of the exchange: its identity and its latest report line.
/// Shared (`Arc`) with the index bootstrap callbacks.
pub struct PeerHub {
    identity: OnceLock<Identity>,
    latest: watch::Sender<Bytes>,
    /// Peers whose report stream is open now: address → replica name.
    followed: parking_lot::Mutex<BTreeMap<String, String>>,
    /// Choices the leader made for this replica and their settling time, kept in the
    /// reports for a while (a follower may skip a report; the next still names them).
    settled: parking_lot::Mutex<VecDeque<(Instant, u64)>>,
    /// Ids of the choices asked of a leader.
    next_choice: AtomicU64,
    /// A leader that did not answer is passed over until then.
    leader_skipped_until: parking_lot::Mutex<Option<Instant>>,
}

impl Default for PeerHub {
    fn default() -> Self {
        Self {
            identity: OnceLock::new(),
            latest: watch::Sender::new(Bytes::new()),
            followed: Default::default(),
            settled: Default::default(),
            next_choice: AtomicU64::new(1),
            leader_skipped_until: Default::default(),
        }
    }
}

impl PeerHub {
    /// Sets this replica's identity once it listens (the default name needs the port).
    pub fn init_identity(&self, configured: Option<&str>, addr: SocketAddr) -> &Identity {
        self.identity.get_or_init(|| Identity {
            replica: configured
                .map(str::to_owned)
                .unwrap_or_else(|| format!("{}/{addr}", host_name())),
            incarnation: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
        })
    }

    pub fn identity(&self) -> Option<&Identity> {
        self.identity.get()
    }

    /// The address of the replica that chooses for this one: the smallest name among
    /// this replica and the peers whose streams are open. `None` when that is this
    /// replica (or a leader that did not answer is being passed over).
    pub fn leader(&self) -> Option<(String, String)> {
        let own = self.identity()?;
        if self
            .leader_skipped_until
            .lock()
            .is_some_and(|until| Instant::now() < until)
        {
            return None;
        }
        let followed = self.followed.lock();
        let (url, name) = followed.iter().min_by(|a, b| a.1.cmp(b.1))?;
        (name.as_str() < own.replica.as_str()).then(|| (url.clone(), name.clone()))
    }

    /// Passes the leader over for `how_long`; true when it was not being
    /// passed over already (so one warning is logged per back-off, not per request).
    fn skip_leader(&self, how_long: Duration) -> bool {
        let now = Instant::now();
        let mut until = self.leader_skipped_until.lock();
        let fresh = until.is_none_or(|u| u <= now);
        *until = Some(now + how_long);
        fresh
    }

    /// A choice asked of the leader is done with: `book` books it here (or gives it
    /// up), and the next reports name it as settled. The booking and the settling are
    /// one step for the publisher, which reads both under the same lock
    /// ([`Self::settled_with_loads`]): a report never shows the booking without the id,
    /// which would count it twice at the leader, or the id without the booking.
    pub fn settle<T>(&self, id: u64, book: impl FnOnce() -> T) -> T {
        let mut settled = self.settled.lock();
        let booked = book();
        let now = Instant::now();
        // Bounded even while nobody follows this replica (the publisher then prunes
        // nothing).
        while settled
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > SETTLED_MAX_AGE)
        {
            settled.pop_front();
        }
        settled.push_back((now, id));
        booked
    }

    /// The ids settled within `window` (older ones are dropped), and `loads` read
    /// under the same lock as [`Self::settle`] books.
    fn settled_with_loads<T>(&self, window: Duration, loads: impl FnOnce() -> T) -> (Vec<u64>, T) {
        let mut settled = self.settled.lock();
        let now = Instant::now();
        while settled
            .front()
            .is_some_and(|(at, _)| now.saturating_duration_since(*at) > window)
        {
            settled.pop_front();
        }
        let ids = settled.iter().map(|(_, id)| *id).collect();
        (ids, loads())
    }
}

/// The machine's host name (a Kubernetes pod's name), for the default replica name.
fn host_name() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|h| h.trim().to_owned())
                .filter(|h| !h.is_empty())
        })
        .unwrap_or_else(|| "kvgate".to_owned())
}

/// This replica's load per model and worker, by URL.
fn local_loads(gw: &Gateway) -> Vec<WireModel> {
    gw.pools_named()
        .map(|(m, pool)| {
            let workers = m.workers();
            let ids: Vec<_> = workers.iter().map(|w| w.id).collect();
            let loads = m.ledger().loads_of(&ids);
            let mut prefilling = m.ledger().prefilling_checkpoints();
            WireModel {
                model: m.name.to_string(),
                pool: pool.to_string(),
                workers: workers
                    .iter()
                    .zip(loads)
                    .filter(|(_, l)| l.in_flight > 0)
                    .map(|(w, l)| WireLoad {
                        url: w.url.to_string(),
                        in_flight: l.in_flight,
                        prefill_tokens: l.prefill_tokens,
                        decode_blocks: l.decode_blocks,
                        prefilling: prefilling
                            .iter_mut()
                            .filter(|(on, _)| *on == w.id)
                            .map(|(_, keys)| keys.drain(..).map(|k| k.0).collect())
                            .collect(),
                    })
                    .collect(),
            }
        })
        .collect()
}

/// Publishes this replica's report whenever its bookings change (checked every
/// `publish_ms`) and at least every `heartbeat_ms`, and expires silent peers, until
/// shutdown. Runs whether or not peers are configured: a peer may follow this
/// replica without this one following it.
pub async fn run_publisher(gw: Arc<Gateway>) {
    let Some(identity) = gw.peers.identity().cloned() else {
        return;
    };
    let cfg = &gw.config.peers;
    let heartbeat = Duration::from_millis(cfg.heartbeat_ms);
    let expiry = Duration::from_millis(cfg.expiry_ms);
    let mut ticks = gw.ticks(Duration::from_millis(cfg.publish_ms));
    // Long enough for every follower to see a settled id in some report.
    let settled_window = Duration::from_millis((cfg.publish_ms * 10).max(250));
    let mut last: Option<(Vec<WireModel>, Vec<u64>, Instant)> = None;
    let mut seq = 0u64;
    while ticks.next().await {
        let now = Instant::now();
        // Only a replica that follows peers holds their reports (and a follower also
        // drops a peer whose stream goes silent; this is the backstop).
        for m in gw.pools().filter(|_| cfg.enabled()) {
            for gone in m.ledger().expire_peers(now, expiry) {
                tracing::warn!(model = %m.name, replica = %gone, ?expiry, "peer replica went silent; dropping its bookings");
            }
        }
        if gw.peers.latest.receiver_count() == 0 {
            // Nobody follows this replica: build nothing, and let the next follower
            // wait for a fresh report rather than read a stale one.
            if !gw.peers.latest.borrow().is_empty() {
                gw.peers.latest.send_replace(Bytes::new());
            }
            last = None;
            continue;
        }
        let (settled, models) = gw
            .peers
            .settled_with_loads(settled_window, || local_loads(&gw));
        let due = match &last {
            None => true,
            Some((prev, prev_settled, at)) => {
                *prev != models || *prev_settled != settled || now.duration_since(*at) >= heartbeat
            }
        };
        if !due {
            continue;
        }
        seq += 1;
        let report = WireReport {
            replica: identity.replica.clone(),
            incarnation: identity.incarnation,
            seq,
            models: models.clone(),
            settled: settled.clone(),
        };
        match serde_json::to_vec(&report) {
            Ok(mut line) => {
                line.push(b'\n');
                gw.peers.latest.send_replace(Bytes::from(line));
            }
            Err(err) => tracing::warn!(%err, "cannot encode the load report"),
        }
        last = Some((models, settled, now));
    }
}

/// `GET /peer/v1/loads`: this replica's reports as a stream of JSON lines, the
/// latest at once and then each new one, until shutdown. Guarded by the admin token.
pub async fn serve_loads(State(gw): State<Arc<Gateway>>, headers: HeaderMap) -> Response {
    if let Err(e) = admit_peer(&gw, &headers) {
        return e.into_response();
    }
    let mut rx = gw.peers.latest.subscribe();
    rx.mark_changed();
    let stop = gw.shutdown.clone();
    let subscribers = gw.metrics.peer_subscribers.clone();
    let sent = gw.metrics.peer_reports.with_label_values(&["out"]);
    subscribers.inc();
    // Decrements the subscriber gauge when the stream is dropped, however it ends.
    let guard = OnDrop(move || subscribers.dec());
    let stream = futures::stream::unfold((rx, stop, guard), move |(mut rx, stop, guard)| {
        let sent = sent.clone();
        async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return None,
                    changed = rx.changed() => changed.ok()?,
                }
                let line = rx.borrow_and_update().clone();
                if !line.is_empty() {
                    sent.inc();
                    return Some((Ok::<_, std::convert::Infallible>(line), (rx, stop, guard)));
                }
            }
        }
    });
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

/// What every peer endpoint checks first: the admin token (without one the peer
/// endpoints are off: they would let anyone book phantom load or read the index), that
/// this replica knows its name, and that the asker is not this replica itself (a DNS
/// name lists every replica; 409 `peer_is_self` tells the asker to skip the address).
fn admit_peer(gw: &Gateway, headers: &HeaderMap) -> Result<(), ApiError> {
    require_bearer(
        headers,
        gw.config.admin_token.as_deref(),
        "admin token",
        "the peer endpoints",
    )?;
    let Some(identity) = gw.peers.identity() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            "starting",
            "this replica is starting",
        )
        .with_retry_after(1));
    };
    let asker = headers.get(&REPLICA_HEADER).and_then(|v| v.to_str().ok());
    if asker == Some(identity.replica.as_str()) {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            "peer_is_self",
            "this is the replica asking: a replica does not follow or bootstrap from itself",
        ));
    }
    Ok(())
}

/// What a request to a peer carries: this replica's name (so a peer that is this
/// replica refuses it) and the admin token, when one is set.
fn peer_request(
    method: http::Method,
    url: String,
    body: Bytes,
    hub: &PeerHub,
    admin_token: Option<&str>,
) -> Result<Request<Full<Bytes>>, String> {
    let mut req = Request::builder()
        .method(method)
        .uri(url)
        .body(Full::new(body))
        .map_err(|e| format!("bad peer URL: {e}"))?;
    if let Some(v) = hub
        .identity()
        .and_then(|i| HeaderValue::from_str(&i.replica).ok())
    {
        req.headers_mut().insert(REPLICA_HEADER, v);
    }
    if let Some(v) = admin_token.and_then(|t| HeaderValue::from_str(&format!("Bearer {t}")).ok()) {
        req.headers_mut().insert(header::AUTHORIZATION, v);
    }
    Ok(req)
}

/// The peers' base URLs now: the configured ones, then the DNS name's addresses.
async fn peer_urls(cfg: &PeersConfig) -> std::io::Result<Vec<String>> {
    let mut urls = cfg.urls.clone();
    if let Some(name) = &cfg.dns {
        urls.extend(
            tokio::net::lookup_host(name.as_str())
                .await?
                .map(|a| format!("http://{a}")),
        );
    }
    Ok(urls)
}

/// Runs a closure when dropped.
struct OnDrop<F: FnMut()>(F);

impl<F: FnMut()> Drop for OnDrop<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

/// Follows every configured peer until shutdown: the static URLs, and the addresses
/// of the DNS name, re-resolved every `dns_refresh_ms` (a peer whose address leaves
/// the name stops being followed, and its bookings drop).
pub async fn run_followers(gw: Arc<Gateway>) {
    let cfg = gw.config.peers.clone();
    if !cfg.enabled() {
        return;
    }
    let mut following: BTreeMap<String, CancellationToken> = BTreeMap::new();
    let mut refresh = gw.ticks(Duration::from_millis(cfg.dns_refresh_ms));
    while refresh.next().await {
        let mut wanted = match peer_urls(&cfg).await {
            Ok(urls) => urls,
            Err(err) => {
                // Keep following the last known addresses rather than drop them all on
                // a resolver hiccup.
                tracing::warn!(dns = ?cfg.dns, %err, "cannot resolve the peers' DNS name; keeping the last addresses");
                let mut urls = cfg.urls.clone();
                urls.extend(following.keys().cloned());
                urls
            }
        };
        wanted.sort();
        wanted.dedup();
        following.retain(|url, stop| {
            let keep = wanted.contains(url);
            if !keep {
                tracing::info!(peer = %url, "peer address gone from DNS; no longer following it");
                stop.cancel();
            }
            keep
        });
        for url in wanted {
            if following.contains_key(&url) {
                continue;
            }
            let stop = gw.shutdown.child_token();
            following.insert(url.clone(), stop.clone());
            tokio::spawn(follow(gw.clone(), url, stop));
        }
    }
    for stop in following.values() {
        stop.cancel();
    }
}

/// How one stream from a peer ended.
#[derive(Debug)]
enum StreamEnd {
    /// The address is this replica: never follow it.
    IsSelf,
    /// Told to stop (shutdown, or the address left DNS).
    Stopped,
    /// Ended or failed: follow again after a backoff.
    Retry(String),
}

/// Follows one peer address until `stop`: streams its reports into the ledgers, and
/// when the stream ends drops the bookings it reported and follows it again.
async fn follow(gw: Arc<Gateway>, url: String, stop: CancellationToken) {
    let mut backoff = BACKOFF_INITIAL;
    let mut last_error = String::new();
    loop {
        let started = Instant::now();
        match follow_once(&gw, &url, &stop).await {
            StreamEnd::IsSelf => {
                tracing::debug!(peer = %url, "peer address is this replica; skipping it");
                return;
            }
            StreamEnd::Stopped => return,
            StreamEnd::Retry(error) => {
                if error != last_error {
                    tracing::warn!(peer = %url, %error, "peer report stream ended; following it again");
                    last_error = error;
                }
            }
        }
        if started.elapsed() > BACKOFF_MAX {
            backoff = BACKOFF_INITIAL;
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

/// One stream from a peer; whatever the peer reported is dropped when it ends.
async fn follow_once(gw: &Gateway, url: &str, stop: &CancellationToken) -> StreamEnd {
    if gw.peers.identity().is_none() {
        return StreamEnd::Stopped;
    }
    let expiry = Duration::from_millis(gw.config.peers.expiry_ms);
    let req = match peer_request(
        http::Method::GET,
        format!("{url}{LOADS_PATH}"),
        Bytes::new(),
        &gw.peers,
        gw.config.admin_token.as_deref(),
    ) {
        Ok(r) => r,
        Err(e) => return StreamEnd::Retry(e),
    };
    let resp = tokio::select! {
        _ = stop.cancelled() => return StreamEnd::Stopped,
        r = tokio::time::timeout(expiry, gw.client.request(req)) => match r {
            Ok(Ok(resp)) => resp,
            Ok(Err(e)) => return StreamEnd::Retry(format!("cannot connect: {e}")),
            Err(_) => return StreamEnd::Retry("no answer".into()),
        },
    };
    match resp.status() {
        StatusCode::OK => {}
        StatusCode::CONFLICT => return StreamEnd::IsSelf,
        status => return StreamEnd::Retry(format!("answered {status}")),
    }
    let connected = gw.metrics.peers_connected.clone();
    connected.inc();
    let mut heard: Option<(String, u64)> = None;
    let end = read_reports(gw, url, resp.into_body(), expiry, stop, &mut heard).await;
    gw.peers.followed.lock().remove(url);
    connected.dec();
    if let Some((replica, incarnation)) = heard {
        for m in gw.pools() {
            if m.ledger().remove_peer(&replica, incarnation) {
                tracing::info!(model = %m.name, %replica, peer = %url, "peer replica's stream ended; dropped its bookings");
            }
        }
    }
    end
}

/// Reads report lines until the stream ends, goes silent for `expiry`, or `stop`.
async fn read_reports(
    gw: &Gateway,
    url: &str,
    mut body: hyper::body::Incoming,
    expiry: Duration,
    stop: &CancellationToken,
    heard: &mut Option<(String, u64)>,
) -> StreamEnd {
    let received = gw.metrics.peer_reports.with_label_values(&["in"]);
    let own = gw.peers.identity().map(|i| i.replica.clone());
    let mut buf = BytesMut::new();
    loop {
        let frame = tokio::select! {
            _ = stop.cancelled() => return StreamEnd::Stopped,
            f = tokio::time::timeout(expiry, body.frame()) => f,
        };
        let data = match frame {
            Err(_) => return StreamEnd::Retry(format!("silent for {expiry:?}")),
            Ok(None) => return StreamEnd::Retry("the peer closed the stream".into()),
            Ok(Some(Err(e))) => return StreamEnd::Retry(format!("stream failed: {e}")),
            Ok(Some(Ok(frame))) => match frame.into_data() {
                Ok(d) => d,
                Err(_) => continue,
            },
        };
        buf.extend_from_slice(&data);
        while let Some(nl) = memchr::memchr(b'\n', &buf) {
            let line = buf.split_to(nl + 1);
            let report: WireReport = match serde_json::from_slice(&line[..nl]) {
                Ok(r) => r,
                Err(e) => return StreamEnd::Retry(format!("bad report: {e}")),
            };
            if own.as_deref() == Some(report.replica.as_str()) {
                return StreamEnd::IsSelf;
            }
            received.inc();
            let run = (report.replica.clone(), report.incarnation);
            if heard.as_ref().is_some_and(|h| *h != run) {
                return StreamEnd::Retry("the peer changed its name or run mid-stream".into());
            }
            if heard.is_none() {
                gw.peers
                    .followed
                    .lock()
                    .insert(url.to_owned(), report.replica.clone());
            }
            *heard = Some(run);
            apply(gw, report);
        }
        if buf.len() > MAX_REPORT_BYTES {
            return StreamEnd::Retry("report line too long".into());
        }
    }
}

/// Hands a report to each model's ledger, with worker URLs resolved to this
/// replica's ids (workers this replica does not serve are left out).
fn apply(gw: &Gateway, report: WireReport) {
    let now = Instant::now();
    for (m, pool) in gw.pools_named() {
        let wire = report
            .models
            .iter()
            .find(|w| *w.model == *m.name && w.pool == pool);
        let workers = m.workers();
        let resolve = |url: &str| {
            let url = crate::config::normalize_url(url);
            workers.iter().find(|w| *w.url == *url).map(|w| w.id)
        };
        let prefilling = wire
            .map(|w| {
                w.workers
                    .iter()
                    .filter_map(|l| Some((resolve(&l.url)?, &l.prefilling)))
                    .flat_map(|(id, bookings)| {
                        bookings
                            .iter()
                            .map(move |keys| (id, keys.iter().map(|k| BlockKey(*k)).collect()))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let loads = wire
            .map(|w| {
                w.workers
                    .iter()
                    .filter_map(|l| {
                        Some((
                            resolve(&l.url)?,
                            WorkerLoad {
                                in_flight: l.in_flight,
                                prefill_tokens: l.prefill_tokens,
                                decode_blocks: if l.decode_blocks.is_finite() {
                                    l.decode_blocks.max(0.0)
                                } else {
                                    0.0
                                },
                            },
                        ))
                    })
                    .collect()
            })
            .unwrap_or_default();
        let applied = m.ledger().apply_peer_report(
            PeerReport {
                replica: report.replica.clone(),
                incarnation: report.incarnation,
                seq: report.seq,
                loads,
                prefilling,
                settled: report.settled.clone(),
            },
            now,
        );
        match applied {
            PeerApplied::New => {
                tracing::info!(model = %m.name, replica = %report.replica, "following a peer replica's bookings")
            }
            PeerApplied::Restarted => {
                tracing::info!(model = %m.name, replica = %report.replica, "peer replica restarted; its old bookings are replaced")
            }
            PeerApplied::Updated | PeerApplied::Stale => {}
        }
    }
}

/// What a replica asks a peer for: its index entries of one worker rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRequest {
    pub model: String,
    /// The worker's URL, as configured.
    pub worker: String,
    #[serde(default)]
    pub rank: u32,
    /// The asker's [`BlockHasher::fingerprint`](kvgate_core::BlockHasher::fingerprint)
    /// (absent from replicas before key scheme v2): a snapshot is keyed by the
    /// serving replica's hasher, useless to one that keys prompts otherwise.
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

/// Whether a peer keys prompts as this replica does (`theirs`: the fingerprint it sent;
/// none from a replica older than key scheme v2). Keys of another scheme, block size
/// or salt match nothing here, and a snapshot or decision made with them would look
/// valid while routing blind, so they are refused with a reason.
pub fn same_keys(ours: u64, theirs: Option<u64>) -> Result<(), String> {
    match theirs {
        Some(t) if t == ours => Ok(()),
        Some(t) => Err(format!(
            "block keys differ (fingerprint {t:016x} there, {ours:016x} here): another kvgate \
             version, block size or hash salt"
        )),
        None => Err("block keys of an older kvgate (no key fingerprint)".to_owned()),
    }
}

/// A worker rank's index entries as they travel: `[key, parent or null, engine hash,
/// tier (0 device, 1 host, 2 disk)]` per block held, and the last event sequence
/// number they reflect.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireSnapshot {
    pub last_seq: u64,
    pub blocks: Vec<(u64, Option<u64>, u64, u8)>,
    /// Root-to-parent key paths of blocks after a hole (absent from older replicas).
    #[serde(default)]
    pub hole_paths: Vec<Vec<u64>>,
    /// The serving replica's key fingerprint (see [`SnapshotRequest`]).
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

impl WireSnapshot {
    fn from_rank(s: &RankSnapshot, key_fingerprint: u64) -> Self {
        Self {
            last_seq: s.last_seq,
            blocks: s
                .blocks
                .iter()
                .map(|b| {
                    (
                        b.key.0,
                        b.parent.map(|p| p.0),
                        b.engine_hash,
                        b.tier.index() as u8,
                    )
                })
                .collect(),
            hole_paths: s
                .hole_paths
                .iter()
                .map(|p| p.iter().map(|k| k.0).collect())
                .collect(),
            key_fingerprint: Some(key_fingerprint),
        }
    }

    /// The snapshot, or `None` when a block names a tier that does not exist.
    fn into_rank(self) -> Option<RankSnapshot> {
        let blocks = self
            .blocks
            .into_iter()
            .map(|(key, parent, engine_hash, tier)| {
                Some(HeldBlock {
                    key: BlockKey(key),
                    parent: parent.map(BlockKey),
                    engine_hash,
                    tier: *Tier::ALL.get(usize::from(tier))?,
                })
            })
            .collect::<Option<Vec<_>>>()?;
        Some(RankSnapshot {
            blocks,
            hole_paths: self
                .hole_paths
                .into_iter()
                .map(|p| p.into_iter().map(BlockKey).collect())
                .collect(),
            last_seq: self.last_seq,
        })
    }
}

/// `POST /peer/v1/index`: this replica's index entries of one worker rank, for a peer
/// that is starting. 404 when the model or worker is unknown here or this replica has
/// applied none of that rank's events (a snapshot must say where events continue).
pub async fn serve_snapshot(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(e) = admit_peer(&gw, &headers) {
        return e.into_response();
    }
    let req: SnapshotRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::malformed_json(e).into_response(),
    };
    let Some(model) = gw.model(&req.model) else {
        return ApiError::not_found(format!("unknown model {:?}", req.model)).into_response();
    };
    // The worker may be in the model's prefill pool.
    let found = model
        .pools()
        .find_map(|(pool, _)| Some((pool.clone(), pool.worker_by_url(&req.worker)?)));
    let Some((model, worker)) = found else {
        return ApiError::not_found(format!("unknown worker {:?}", req.worker)).into_response();
    };
    let fingerprint = model.selection.hasher().fingerprint();
    if let Err(why) = same_keys(fingerprint, req.key_fingerprint) {
        return keys_refused(format!("no snapshot: {why}")).into_response();
    }
    let id = worker.id;
    // Exporting a large index takes a while: off the async workers.
    let snapshot =
        tokio::task::spawn_blocking(move || model.selection.snapshot_rank(id, req.rank)).await;
    match snapshot {
        Ok(Some(s)) => Json(WireSnapshot::from_rank(&s, fingerprint)).into_response(),
        Ok(None) => ApiError::not_found(format!(
            "no KV events of {} rank {} applied here yet",
            worker.url, req.rank
        ))
        .into_response(),
        Err(e) => ApiError::internal(format!("snapshot failed: {e}")).into_response(),
    }
}

/// The index bootstrap a model's KV-event subscribers use: asks each peer (the
/// configured URLs, then the DNS name's addresses) in turn for its snapshot of the
/// worker rank, and returns the first one given whose keys are keyed as this pool's
/// (`key_fingerprint`, [`same_keys`]).
pub fn bootstrap(
    client: HttpClient,
    hub: Arc<PeerHub>,
    cfg: PeersConfig,
    admin_token: Option<String>,
    model: String,
    key_fingerprint: u64,
) -> Bootstrap {
    Arc::new(move |worker: String, rank: u32| {
        let (client, hub, cfg, token, model) = (
            client.clone(),
            hub.clone(),
            cfg.clone(),
            admin_token.clone(),
            model.clone(),
        );
        Box::pin(async move {
            // A failed lookup leaves the configured URLs.
            let candidates = peer_urls(&cfg).await.unwrap_or_else(|_| cfg.urls.clone());
            let request = SnapshotRequest {
                model,
                worker,
                rank,
                key_fingerprint: Some(key_fingerprint),
            };
            for peer in candidates {
                match fetch_snapshot(&client, &hub, token.as_deref(), &peer, &request).await {
                    Ok(s) => return Some(s),
                    Err(SnapshotRefused::OtherKeys(why)) => {
                        tracing::warn!(%peer, worker = %request.worker, rank, %why, "not loading this peer's index snapshot: its block keys are not ours (every replica must run the same kvgate version, block size and hash salt)")
                    }
                    Err(SnapshotRefused::Failed(why)) => {
                        tracing::debug!(%peer, worker = %request.worker, rank, %why, "no index snapshot from this peer")
                    }
                }
            }
            None
        })
    })
}

/// Why a peer gave no snapshot.
enum SnapshotRefused {
    /// Its keys are not this replica's ([`same_keys`]): worth a warning.
    OtherKeys(String),
    /// No snapshot (none applied there, unreachable, malformed).
    Failed(String),
}

async fn fetch_snapshot(
    client: &HttpClient,
    hub: &PeerHub,
    token: Option<&str>,
    peer: &str,
    request: &SnapshotRequest,
) -> Result<RankSnapshot, SnapshotRefused> {
    let failed = |e: &dyn std::fmt::Display| SnapshotRefused::Failed(e.to_string());
    let body = serde_json::to_vec(request).map_err(|e| failed(&e))?;
    let mut req = peer_request(
        http::Method::POST,
        format!("{peer}{INDEX_PATH}"),
        Bytes::from(body),
        hub,
        token,
    )
    .map_err(SnapshotRefused::Failed)?;
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let ours = request.key_fingerprint.unwrap_or_default();
    let answer = async {
        let resp = client.request(req).await.map_err(|e| failed(&e))?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_SNAPSHOT_BYTES)
            .collect()
            .await
            .map_err(|e| failed(&e))?
            .to_bytes();
        if status != StatusCode::OK {
            let why = answered(status, &body);
            return Err(
                if error_code(&body).as_deref() == Some("key_scheme_mismatch") {
                    SnapshotRefused::OtherKeys(why)
                } else {
                    SnapshotRefused::Failed(why)
                },
            );
        }
        let wire: WireSnapshot = serde_json::from_slice(&body).map_err(|e| failed(&e))?;
        same_keys(ours, wire.key_fingerprint).map_err(SnapshotRefused::OtherKeys)?;
        wire.into_rank()
            .ok_or_else(|| failed(&"a block names an unknown tier"))
    };
    tokio::time::timeout(SNAPSHOT_TIMEOUT, answer)
        .await
        .map_err(|_| failed(&"timed out"))?
}

/// The 409 a replica answers a peer whose keys are not its own ([`same_keys`]).
fn keys_refused(why: String) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "invalid_request_error",
        "key_scheme_mismatch",
        why,
    )
}

/// A peer's answer other than 200, for logs: its status and the start of its body.
fn answered(status: StatusCode, body: &[u8]) -> String {
    format!(
        "answered {status}: {}",
        String::from_utf8_lossy(&body[..body.len().min(200)])
    )
}

/// The `error.code` of an OpenAI-style error body.
fn error_code(body: &[u8]) -> Option<String> {
    serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(str::to_owned))
}

/// What a replica asks the leader to choose.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecideRequest {
    pub model: String,
    /// The model's pool: absent for its own workers, `prefill` for its prefill pool.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
    /// The asker's run (its reports' incarnation).
    pub incarnation: u64,
    /// The choice's id, named again in the asker's reports once it is booked there.
    pub id: u64,
    /// The workers the asker may send to (healthy there, with a free slot), by URL.
    pub candidates: Vec<String>,
    /// The prompt's block keys; absent when the request has no routing tokens.
    #[serde(default)]
    pub keys: Option<Vec<u64>>,
    pub prompt_tokens: u32,
    #[serde(default)]
    pub expected_output_tokens: Option<u32>,
    #[serde(default)]
    pub session_key: Option<String>,
    /// A decode leg whose prompt's KV arrives from its prefill worker: booked as
    /// cached.
    #[serde(default)]
    pub kv_transferred: bool,
    /// The asker's key fingerprint (see [`SnapshotRequest`]); the leader refuses
    /// `keys` made by another hasher (409 `key_scheme_mismatch`).
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

/// The leader's choice: the worker and what the asker's booking of it should predict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecideAnswer {
    pub worker: String,
    pub predicted_cached_tokens: u32,
    pub indexed_cached_tokens: u32,
    pub credited_tokens: u32,
    /// The leader's key fingerprint (absent from a leader older than key scheme v2,
    /// which would have read the keys as its own).
    #[serde(default)]
    pub key_fingerprint: Option<u64>,
}

/// A choice made at the leader, for this replica to book.
pub struct LeaderChoice {
    /// Book it through [`PeerHub::settle`].
    pub id: u64,
    pub decision: Decision,
    pub worker: Arc<Worker>,
}

/// Whether requests for `model` (in `pool`) are decided at a leader: when replicas
/// follow each other with `decisions: leader` and the policy scores the fleet's load.
pub fn decides_at_leader(gw: &Gateway, model: &ModelState) -> bool {
    use kvgate_core::PolicyKind;
    gw.config.peers.enabled()
        && gw.config.peers.decisions == PeerDecisions::Leader
        && matches!(
            model.kind(),
            PolicyKind::KvAware | PolicyKind::LeastLoaded | PolicyKind::PrefixAffinity
        )
}

/// Asks `leader` ([`PeerHub::leader`]: its address and name) to choose among
/// `candidates` for request `p`. `None` (after counting why) when the leader did not
/// answer in time or refused: the caller then chooses itself.
pub async fn choose_at_leader(
    gw: &Gateway,
    (url, leader): (String, String),
    p: &Prepared,
    candidates: &[Arc<Worker>],
    session_key: Option<&str>,
) -> Option<LeaderChoice> {
    let model = &*p.model;
    let identity = gw.peers.identity()?;
    let pool = gw
        .pools_named()
        .find(|(m, _)| std::ptr::eq(m.as_ref(), model))
        .map_or("", |(_, pool)| pool);
    let id = gw.peers.next_choice.fetch_add(1, Ordering::Relaxed);
    let fingerprint = model.selection.hasher().fingerprint();
    let request = DecideRequest {
        model: model.name.to_string(),
        pool: pool.to_owned(),
        incarnation: identity.incarnation,
        id,
        candidates: candidates.iter().map(|w| w.url.to_string()).collect(),
        keys: p.keys.as_ref().map(|k| k.iter().map(|k| k.0).collect()),
        prompt_tokens: p.prompt_tokens,
        expected_output_tokens: p.max_tokens,
        kv_transferred: p.kv_transferred,
        session_key: session_key.map(str::to_owned),
        key_fingerprint: Some(fingerprint),
    };
    let outcome = |o: &str| {
        gw.metrics
            .peer_decisions
            .with_label_values(&[&*model.name, o])
            .inc()
    };
    let timeout = Duration::from_millis(gw.config.peers.decide_timeout_ms);
    let asked = Instant::now();
    let answer = tokio::time::timeout(timeout, ask_leader(gw, &url, &request)).await;
    if matches!(answer, Ok(Ok(_))) {
        // A choice made at the leader takes its round trip.
        gw.metrics
            .decision_seconds
            .with_label_values(&[&*model.name, model.kind().as_str()])
            .observe(asked.elapsed().as_secs_f64());
    }
    let answer = match answer {
        Ok(Ok(a)) => a,
        Ok(Err(LeaderRefused::NotFollowing(why))) => {
            // A leader that does not follow this replica yet (it just started, or the
            // links are one-sided): ask again in a while.
            if gw.peers.skip_leader(LEADER_BACKOFF) {
                tracing::info!(%leader, peer = %url, %why, "the leader does not follow this replica yet; choosing here for a while");
            }
            outcome("fallback");
            return None;
        }
        Ok(Err(LeaderRefused::ThisRequest(why))) => {
            tracing::debug!(%leader, peer = %url, %why, "the leader could not choose for this request; choosing here");
            outcome("fallback");
            return None;
        }
        Ok(Err(LeaderRefused::Unsupported(why))) => {
            if gw.peers.skip_leader(LEADER_UNSUPPORTED_BACKOFF) {
                tracing::info!(%leader, peer = %url, %why, backoff = ?LEADER_UNSUPPORTED_BACKOFF, "the leader does not decide for peers (an older kvgate?); choosing here");
            }
            outcome("fallback");
            return None;
        }
        Ok(Err(LeaderRefused::Failed(why))) => {
            if gw.peers.skip_leader(LEADER_BACKOFF) {
                tracing::warn!(%leader, peer = %url, %why, "the leader did not choose; choosing here for a while");
            }
            outcome("fallback");
            return None;
        }
        Err(_) => {
            if gw.peers.skip_leader(LEADER_BACKOFF) {
                tracing::warn!(%leader, peer = %url, ?timeout, "the leader did not answer in time; choosing here for a while");
            }
            outcome("fallback");
            return None;
        }
    };
    if request.keys.is_some() {
        if let Err(why) = same_keys(fingerprint, answer.key_fingerprint) {
            // Chosen blind to this prompt's cache: not used, and settled at once.
            gw.peers.settle(id, || ());
            if gw.peers.skip_leader(LEADER_UNSUPPORTED_BACKOFF) {
                tracing::warn!(%leader, peer = %url, %why, backoff = ?LEADER_UNSUPPORTED_BACKOFF, "the leader keys prompts otherwise (every replica must run the same kvgate version, block size and hash salt); choosing here");
            }
            outcome("fallback");
            return None;
        }
    }
    let url_answered = crate::config::normalize_url(&answer.worker);
    let Some(worker) = candidates.iter().find(|w| *w.url == *url_answered).cloned() else {
        // Settled at once: nothing here will book it.
        gw.peers.settle(id, || ());
        tracing::warn!(%leader, worker = %answer.worker, "the leader chose a worker that was not a candidate; choosing here");
        outcome("fallback");
        return None;
    };
    outcome("asked");
    Some(LeaderChoice {
        id,
        decision: Decision {
            worker: worker.id,
            policy: model.kind(),
            predicted_cached_tokens: answer.predicted_cached_tokens,
            indexed_cached_tokens: answer.indexed_cached_tokens,
            credited_tokens: answer.credited_tokens,
            rule: "leader",
            reason: "chosen by the leader replica",
            scores: Vec::new(),
        },
        worker,
    })
}

/// Why the leader gave no choice.
#[derive(Debug, PartialEq, Eq)]
enum LeaderRefused {
    /// It does not follow this replica's reports (409 `not_following`).
    NotFollowing(String),
    /// It has no decide endpoint (404, 405: an older kvgate).
    Unsupported(String),
    /// It could not choose for this request (another 409: no candidate healthy there).
    ThisRequest(String),
    /// No usable answer.
    Failed(String),
}

async fn ask_leader(
    gw: &Gateway,
    url: &str,
    request: &DecideRequest,
) -> Result<DecideAnswer, LeaderRefused> {
    let failed = |e: &dyn std::fmt::Display| LeaderRefused::Failed(e.to_string());
    let body = serde_json::to_vec(request).map_err(|e| failed(&e))?;
    let mut req = peer_request(
        http::Method::POST,
        format!("{url}{DECIDE_PATH}"),
        Bytes::from(body),
        &gw.peers,
        gw.config.admin_token.as_deref(),
    )
    .map_err(LeaderRefused::Failed)?;
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let resp = gw.client.request(req).await.map_err(|e| failed(&e))?;
    let status = resp.status();
    let body = http_body_util::Limited::new(resp.into_body(), MAX_DECIDE_BYTES)
        .collect()
        .await
        .map_err(|e| failed(&e))?
        .to_bytes();
    if status != StatusCode::OK {
        return Err(refusal(status, &body));
    }
    serde_json::from_slice(&body).map_err(|e| failed(&e))
}

/// Why a leader's answer other than 200 gave no choice.
fn refusal(status: StatusCode, body: &[u8]) -> LeaderRefused {
    let why = answered(status, body);
    let code = error_code(body);
    match status {
        StatusCode::CONFLICT if code.as_deref() == Some("not_following") => {
            LeaderRefused::NotFollowing(why)
        }
        StatusCode::CONFLICT if code.as_deref() == Some("key_scheme_mismatch") => {
            LeaderRefused::Unsupported(why)
        }
        StatusCode::CONFLICT => LeaderRefused::ThisRequest(why),
        StatusCode::NOT_FOUND if code.as_deref() != Some("model_not_found") => {
            LeaderRefused::Unsupported(why)
        }
        StatusCode::METHOD_NOT_ALLOWED => LeaderRefused::Unsupported(why),
        _ => LeaderRefused::Failed(why),
    }
}

/// `POST /peer/v1/decide`: chooses a worker for a peer replica's request, among the
/// candidates it named that are healthy here too, and holds the choice as that
/// replica's booking until its reports settle it. 409 when this replica does not
/// follow the asker (it would never learn the choice was booked) or no candidate is
/// healthy here; the asker then chooses itself.
pub async fn serve_decide(
    State(gw): State<Arc<Gateway>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    if let Err(e) = admit_peer(&gw, &headers) {
        return e.into_response();
    }
    let Some(asker) = headers
        .get(&REPLICA_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return ApiError::bad_request(
            "missing_replica",
            format!("a decide request names its replica in {REPLICA_HEADER}"),
        )
        .into_response();
    };
    if body.len() > MAX_DECIDE_BYTES {
        return ApiError::body_too_large(MAX_DECIDE_BYTES).into_response();
    }
    let req: DecideRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return ApiError::malformed_json(e).into_response(),
    };
    match decide_for_peer(&gw, &asker, &req) {
        Ok(answer) => {
            gw.metrics
                .peer_decisions
                .with_label_values(&[req.model.as_str(), "served"])
                .inc();
            Json(answer).into_response()
        }
        Err(e) => e.into_response(),
    }
}

fn decide_for_peer(
    gw: &Gateway,
    asker: &str,
    req: &DecideRequest,
) -> Result<DecideAnswer, ApiError> {
    let Some((model, _)) = gw
        .pools_named()
        .find(|(m, pool)| *m.name == *req.model && *pool == req.pool)
    else {
        // model_not_found, not a plain 404: the asker tells it from a kvgate without
        // this endpoint.
        let pools: Vec<String> = gw
            .pools_named()
            .map(|(m, pool)| format!("{}{}{pool}", m.name, if pool.is_empty() { "" } else { "/" }))
            .collect();
        let pools: Vec<&str> = pools.iter().map(String::as_str).collect();
        return Err(ApiError::unknown_model(
            &format!("{} (pool {:?})", req.model, req.pool),
            &pools,
        ));
    };
    let refuse = |code: &'static str, msg: String| {
        ApiError::new(StatusCode::CONFLICT, "invalid_request_error", code, msg)
    };
    let passive = gw.passive_open_ms();
    let workers = model.workers();
    let ids: Vec<_> = req
        .candidates
        .iter()
        .filter_map(|url| {
            let url = crate::config::normalize_url(url);
            workers.iter().find(|w| *w.url == *url)
        })
        .filter(|w| w.breaker.available(passive))
        .map(|w| w.id)
        .collect();
    if ids.is_empty() {
        return Err(refuse(
            "no_candidate",
            "none of the candidates is a healthy worker here".into(),
        ));
    }
    let fingerprint = model.selection.hasher().fingerprint();
    if req.keys.is_some() {
        if let Err(why) = same_keys(fingerprint, req.key_fingerprint) {
            return Err(keys_refused(why));
        }
    }
    let keys: Option<Vec<BlockKey>> = req
        .keys
        .as_ref()
        .map(|k| k.iter().map(|k| BlockKey(*k)).collect());
    let now = Instant::now();
    let select = kvgate_selection::SelectRequest {
        block_keys: keys.as_deref(),
        prompt_tokens: req.prompt_tokens,
        session_key: req.session_key.as_deref(),
        now,
    };
    // In order with this replica's own choices (routing::pick holds it too).
    let _choosing = model.choosing.lock();
    let decision = match model.selection.select(&select, &ids) {
        Ok(d) => d,
        Err(SelectError::NoCandidates) => {
            return Err(refuse("no_candidate", "no candidate can be chosen".into()))
        }
        Err(e) => return Err(refuse("cannot_choose", e.to_string())),
    };
    // Booked as the asker's lease will book it.
    let mut spec = decision.booking(req.prompt_tokens, req.expected_output_tokens);
    if req.kv_transferred {
        spec.cached_tokens = spec.prompt_tokens;
    }
    let held = model.ledger().book_for_peer(
        asker,
        req.incarnation,
        req.id,
        decision.worker,
        spec,
        keys.as_deref().unwrap_or_default(),
        now,
    );
    if !held {
        return Err(refuse(
            "not_following",
            format!("this replica does not follow {asker:?}'s reports (yet)"),
        ));
    }
    let Some(worker) = workers.iter().find(|w| w.id == decision.worker) else {
        return Err(ApiError::internal("the policy chose an unknown worker"));
    };
    gw.metrics
        .routing_decisions
        .with_label_values(&[&*model.name, model.kind().as_str(), decision.rule])
        .inc();
    Ok(DecideAnswer {
        worker: worker.url.to_string(),
        predicted_cached_tokens: decision.predicted_cached_tokens,
        indexed_cached_tokens: decision.indexed_cached_tokens,
        credited_tokens: decision.credited_tokens,
        key_fingerprint: Some(fingerprint),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A worker rank's snapshot travels whole; an older replica's snapshot (no hole
    /// paths, and an `evicting` flag this version no longer reads) loads.
    #[test]
    fn a_snapshot_travels_whole_and_an_older_one_loads() {
        let rank = RankSnapshot {
            blocks: vec![HeldBlock {
                key: BlockKey(7),
                parent: None,
                engine_hash: 70,
                tier: Tier::Device,
            }],
            hole_paths: vec![vec![BlockKey(1), BlockKey(2)]],
            last_seq: 9,
        };
        let json = serde_json::to_string(&WireSnapshot::from_rank(&rank, 5)).unwrap();
        let back: WireSnapshot = serde_json::from_str(&json).unwrap();
        assert_eq!(back.into_rank(), Some(rank));
        let older: WireSnapshot = serde_json::from_str(
            r#"{"last_seq": 3, "blocks": [[7, null, 70, 0]], "evicting": true}"#,
        )
        .unwrap();
        let older = older.into_rank().unwrap();
        assert_eq!(older.blocks.len(), 1);
    }

    /// Keys are exchanged only between replicas that key prompts alike: a snapshot or
    /// decision request from an older kvgate (no fingerprint) or another hasher is
    /// refused, and so is such an answer.
    #[test]
    fn keys_travel_only_between_replicas_that_key_alike() {
        let ours = kvgate_core::BlockHasher::new(16).unwrap().fingerprint();
        let salted = kvgate_core::BlockHasher::with_salt(16, b"tenant")
            .unwrap()
            .fingerprint();
        assert_eq!(same_keys(ours, Some(ours)), Ok(()));
        assert!(same_keys(ours, Some(salted)).is_err());
        assert!(same_keys(ours, None).is_err());
        // What an older replica sends parses, without a fingerprint.
        let older: SnapshotRequest =
            serde_json::from_str(r#"{"model": "m", "worker": "http://w"}"#).unwrap();
        assert_eq!(older.key_fingerprint, None);
        let older: DecideAnswer = serde_json::from_str(
            r#"{"worker": "http://w", "predicted_cached_tokens": 1, "indexed_cached_tokens": 1, "credited_tokens": 0}"#,
        )
        .unwrap();
        assert_eq!(older.key_fingerprint, None);
        let older: WireSnapshot = serde_json::from_str(r#"{"last_seq": 3, "blocks": []}"#).unwrap();
        assert_eq!(older.key_fingerprint, None);
    }

    #[test]
    fn a_leaders_refusal_says_whether_to_ask_it_again_soon() {
        let json = |code: &str| {
            serde_json::json!({"error": {"message": "m", "type": "t", "code": code}}).to_string()
        };
        let is = |status, body: &str, expected: fn(String) -> LeaderRefused| {
            let got = refusal(status, body.as_bytes());
            let want = expected(String::new());
            assert_eq!(
                std::mem::discriminant(&got),
                std::mem::discriminant(&want),
                "{status} {body}: {got:?}"
            );
        };
        is(
            StatusCode::CONFLICT,
            &json("not_following"),
            LeaderRefused::NotFollowing,
        );
        is(
            StatusCode::CONFLICT,
            &json("no_candidate"),
            LeaderRefused::ThisRequest,
        );
        // Keys of another scheme: not this request's fault; ask again much later.
        is(
            StatusCode::CONFLICT,
            &json("key_scheme_mismatch"),
            LeaderRefused::Unsupported,
        );
        // A kvgate without the endpoint (its route fallback), and an unknown model there.
        is(
            StatusCode::NOT_FOUND,
            &json("not_found"),
            LeaderRefused::Unsupported,
        );
        is(
            StatusCode::METHOD_NOT_ALLOWED,
            "",
            LeaderRefused::Unsupported,
        );
        is(
            StatusCode::NOT_FOUND,
            &json("model_not_found"),
            LeaderRefused::Failed,
        );
        is(
            StatusCode::SERVICE_UNAVAILABLE,
            "starting",
            LeaderRefused::Failed,
        );
    }
}
