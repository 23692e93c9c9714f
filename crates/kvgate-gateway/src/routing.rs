//! From request body to chosen worker: parse the fields routing needs, find the model,
//! tokenize when the policy scores on tokens, hash block keys, and ask the model's
//! selection service (kvgate-selection) to choose among the healthy candidates with
//! free slots.
//!
//! Owns request preparation and selection, and taking the chosen worker's lease
//! (lease.rs books it) including waiting for a worker slot; with replicas that decide at
//! a leader, the choice comes from the leader (peers.rs carries the question) and is
//! booked here the same way. It must not talk to
//! workers about the request itself (failover.rs and proxy.rs do), and never holds the
//! index lock across an `.await`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Instant;

use http::HeaderMap;
use http_body_util::BodyExt;
use kvgate_core::{BlockKey, Decision, PolicyKind, SelectError, WorkerId};
use kvgate_selection::SelectRequest;
use kvgate_tokenize::{
    remote_answer, remote_request, RemoteRequest, RequestKind, RoutingTokens, TokenizeError,
};
use serde::Deserialize;
use smallvec::SmallVec;

use crate::errors::ApiError;
use crate::failover::side_call;
use crate::gateway::Gateway;
use crate::lease::Lease;
use crate::limits::Admission;
use crate::registry::{Endpoint, ModelState, Worker};

/// The request fields routing reads; everything else is skipped while parsing.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<f64>,
    #[serde(default)]
    max_completion_tokens: Option<f64>,
    /// Present in chat requests; only its size is read.
    #[serde(default)]
    messages: Option<PromptSize>,
    /// A completion's prompt; only its size is read.
    #[serde(default)]
    prompt: Option<PromptSize>,
}

/// An estimate of a prompt's length in tokens without tokenizing it, for policies that
/// route on load alone (they must still know a long prompt from a short one: the
/// ledger books its prefill). Token ids count one each; text counts one token per 4
/// bytes (about right for English with common tokenizers); inside messages, every
/// string value counts (content, tool calls) and keys do not. Read while the body is
/// scanned, without allocating.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PromptSize(pub u64);

impl<'de> Deserialize<'de> for PromptSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = PromptSize;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a prompt")
            }
            fn visit_str<E>(self, v: &str) -> Result<PromptSize, E> {
                Ok(PromptSize((v.len() as u64).div_ceil(4)))
            }
            fn visit_u64<E>(self, _: u64) -> Result<PromptSize, E> {
                Ok(PromptSize(1))
            }
            fn visit_i64<E>(self, _: i64) -> Result<PromptSize, E> {
                Ok(PromptSize(1))
            }
            fn visit_f64<E>(self, _: f64) -> Result<PromptSize, E> {
                Ok(PromptSize(1))
            }
            fn visit_bool<E>(self, _: bool) -> Result<PromptSize, E> {
                Ok(PromptSize(0))
            }
            fn visit_unit<E>(self) -> Result<PromptSize, E> {
                Ok(PromptSize(0))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<PromptSize, A::Error> {
                let mut n = 0u64;
                while let Some(PromptSize(x)) = seq.next_element()? {
                    n = n.saturating_add(x);
                }
                Ok(PromptSize(n))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<PromptSize, A::Error> {
                let mut n = 0u64;
                while let Some((_, PromptSize(x))) =
                    map.next_entry::<serde::de::IgnoredAny, PromptSize>()?
                {
                    n = n.saturating_add(x);
                }
                Ok(PromptSize(n))
            }
        }
        d.deserialize_any(Visit)
    }
}

/// A request ready to be routed.
#[derive(Clone)]
pub struct Prepared {
    pub model: Arc<ModelState>,
    pub lora: Option<Arc<str>>,
    pub stream: bool,
    pub max_tokens: Option<u32>,
    /// Block keys (`Some(empty)` when the body has nothing to route on).
    pub keys: Option<Vec<BlockKey>>,
    pub prompt_tokens: u32,
    /// `prompt_tokens` is [`PromptSize`]'s estimate (the policy reads no tokens).
    pub prompt_tokens_estimated: bool,
    /// Token ids, when tokenized and asked for (`/tokenize`).
    pub token_ids: Option<Vec<u32>>,
    /// The prompt's KV cache arrives from a prefill worker (a disaggregated request's
    /// decode leg): its booking counts no prefill work.
    pub kv_transferred: bool,
}

fn to_u32(v: Option<f64>) -> Option<u32> {
    v.filter(|x| x.is_finite() && *x >= 0.0)
        .map(|x| x.min(f64::from(u32::MAX)) as u32)
}

/// What a prepared request needs its tokens for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenUse {
    /// Routing: tokenize only when the model's policy scores on tokens.
    ForPolicy,
    /// `/tokenize`: always tokenize, and keep the ids in [`Prepared::token_ids`].
    ReturnIds,
}

/// Reads the routing fields (a borrowed scan that skips everything else), resolves
/// the model, and tokenizes when `tokens` asks for it: only then is the body parsed
/// into a document, once. `kind` is the endpoint's request kind; `None` detects it
/// (`messages` present means chat). With [`TokenUse::ReturnIds`] and no local
/// tokenizer nothing is tokenized: the caller forwards `/tokenize` to a worker.
pub async fn prepare(
    gw: &Gateway,
    kind: Option<RequestKind>,
    body: &[u8],
    tokens: TokenUse,
) -> Result<Prepared, ApiError> {
    // Parsing and tokenizing a large body costs several times its size in memory.
    let _large_body = gw.limiter.acquire_large_body(body.len()).await?;
    let head: Head<'_> = serde_json::from_slice(body).map_err(ApiError::malformed_json)?;
    let kind = kind.unwrap_or(if head.messages.is_some() {
        RequestKind::Chat
    } else {
        RequestKind::Completion
    });
    let (model, lora) = gw.resolve(head.model.as_deref())?;
    let (model, lora) = (model.clone(), lora.cloned());
    let mut p = Prepared {
        stream: head.stream.unwrap_or(false),
        max_tokens: to_u32(head.max_completion_tokens).or(to_u32(head.max_tokens)),
        keys: None,
        prompt_tokens: 0,
        prompt_tokens_estimated: false,
        token_ids: None,
        kv_transferred: false,
        model,
        lora,
    };
    let needed = match tokens {
        TokenUse::ForPolicy => p.model.uses_tokens(),
        TokenUse::ReturnIds => p.model.tokenizer.is_some(),
    };
    if !needed {
        // Load-only routing still books the prompt's prefill: estimate its length.
        let size = head.messages.or(head.prompt).unwrap_or_default();
        p.prompt_tokens = u32::try_from(size.0).unwrap_or(u32::MAX);
        p.prompt_tokens_estimated = true;
        return Ok(p);
    }
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(ApiError::malformed_json)?;
    let value = &value;
    match tokenize(gw, &p.model, kind, value).await? {
        RoutingTokens::Tokens { ids, .. } => {
            p.keys = Some(p.model.selection.block_keys(&ids, p.lora.as_deref()));
            p.prompt_tokens = u32::try_from(ids.len()).unwrap_or(u32::MAX);
            if tokens == TokenUse::ReturnIds {
                p.token_ids = Some(ids);
            }
        }
        RoutingTokens::NoRoutingTokens { reason } => {
            tracing::debug!(model = %p.model.name, reason, "request has no routing tokens; routing on load only");
            p.keys = Some(Vec::new());
        }
    }
    Ok(p)
}

async fn tokenize(
    gw: &Gateway,
    model: &ModelState,
    kind: RequestKind,
    value: &serde_json::Value,
) -> Result<RoutingTokens, ApiError> {
    let start = Instant::now();
    let result = if let Some(t) = &model.tokenizer {
        t.tokenize(kind, value).await.map_err(tokenize_error)
    } else if model.config.remote_tokenize {
        tokenize_remotely(gw, model, kind, value).await
    } else {
        return Ok(RoutingTokens::NoRoutingTokens {
            reason: "no tokenizer configured",
        });
    };
    gw.metrics
        .tokenize_seconds
        .with_label_values(&[&*model.name])
        .observe(start.elapsed().as_secs_f64());
    result
}

fn tokenize_error(e: TokenizeError) -> ApiError {
    match e {
        TokenizeError::Invalid(msg) => ApiError::untokenizable(msg),
        TokenizeError::TooLong { limit } => ApiError::context_length_exceeded(limit),
        TokenizeError::Unavailable(msg) => ApiError::tokenizer_unavailable(msg),
    }
}

/// Remote tokenization through the gateway's worker client ([`side_call`]: failover
/// and breaker accounting as for any call to a worker); kvgate-tokenize supplies the
/// `/tokenize` protocol.
async fn tokenize_remotely(
    gw: &Gateway,
    model: &ModelState,
    kind: RequestKind,
    value: &serde_json::Value,
) -> Result<RoutingTokens, ApiError> {
    let (payload, non_text_parts) = match remote_request(kind, value).map_err(tokenize_error)? {
        RemoteRequest::Answered(tokens) => return Ok(tokens),
        RemoteRequest::Post {
            payload,
            non_text_parts,
        } => (payload, non_text_parts),
    };
    let body = serde_json::to_vec(&payload)
        .map_err(|e| ApiError::internal(format!("cannot encode a /tokenize request: {e}")))?;
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    let (worker, resp) = side_call(gw, model, Endpoint::Tokenize, &headers, body.into())
        .await
        .map_err(|e| ApiError::tokenizer_unavailable(e.message))?;
    let status = resp.status().as_u16();
    let read = http_body_util::Limited::new(resp.into_body(), REMOTE_TOKENIZE_MAX_BYTES);
    let bytes = match tokio::time::timeout(REMOTE_TOKENIZE_READ_TIMEOUT, read.collect()).await {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(e)) => {
            return Err(ApiError::tokenizer_unavailable(format!(
                "{}: {e}",
                worker.url
            )))
        }
        Err(_) => {
            return Err(ApiError::tokenizer_unavailable(format!(
                "{}: the /tokenize answer did not arrive in time",
                worker.url
            )))
        }
    };
    remote_answer(&worker.url, status, &bytes, non_text_parts).map_err(tokenize_error)
}

/// Largest `/tokenize` answer read (ids of a prompt at any context length fit).
const REMOTE_TOKENIZE_MAX_BYTES: usize = 64 << 20;
/// How long the body of a `/tokenize` answer may take once its head arrived.
const REMOTE_TOKENIZE_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Which healthy workers a selection may choose from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Candidates {
    /// Only workers below `--max-in-flight-per-worker` (a request about to be sent).
    WithFreeSlot,
    /// Every healthy worker (`/v1/route/explain`: nothing is booked).
    AllHealthy,
}

/// Outcome of one selection attempt.
pub enum Pick {
    Chosen {
        decision: Decision,
        worker: Arc<Worker>,
    },
    /// Healthy candidates exist but all are at their in-flight limit.
    Full,
    /// No healthy candidate (after exclusions).
    NoneHealthy,
}

/// One synchronous selection over the healthy workers not in `excluded`. Books
/// nothing: the caller takes a lease on the chosen worker.
pub fn try_pick(
    gw: &Gateway,
    p: &Prepared,
    session_key: Option<&str>,
    excluded: &[WorkerId],
    candidates_from: Candidates,
) -> Result<Pick, ApiError> {
    let model = &p.model;
    let workers = model.workers();
    let found = candidates(gw, model, &workers, excluded, candidates_from);
    if found.ids.is_empty() {
        return Ok(if found.any_healthy {
            Pick::Full
        } else {
            Pick::NoneHealthy
        });
    }
    let req = SelectRequest {
        block_keys: p.keys.as_deref(),
        prompt_tokens: p.prompt_tokens,
        session_key,
        now: Instant::now(),
    };
    let start = Instant::now();
    let result = model.selection.select(&req, &found.ids);
    gw.metrics
        .decision_seconds
        .with_label_values(&[&*model.name, model.kind().as_str()])
        .observe(start.elapsed().as_secs_f64());
    let decision = match result {
        Ok(d) => d,
        Err(SelectError::NoIndex) => return Err(ApiError::kv_events_not_configured(&model.name)),
        Err(SelectError::MissingTokens) => {
            return Err(ApiError::bad_request(
                "missing_tokens",
                format!(
                    "{} routing needs the prompt's token ids and this request has none",
                    model.kind()
                ),
            ))
        }
        Err(SelectError::NoCandidates) => return Ok(Pick::NoneHealthy),
    };
    let Some(worker) = workers.iter().find(|w| w.id == decision.worker).cloned() else {
        return Err(ApiError::internal("the policy chose an unknown worker"));
    };
    Ok(Pick::Chosen { decision, worker })
}

/// The workers a selection may choose from.
struct Found {
    ids: SmallVec<[WorkerId; 16]>,
    /// Some worker is healthy (the candidates may still be empty: all full).
    any_healthy: bool,
}

/// Healthy workers (breaker closed) not in `excluded`, and with a free slot unless
/// `from` says otherwise.
fn candidates(
    gw: &Gateway,
    model: &ModelState,
    workers: &[Arc<Worker>],
    excluded: &[WorkerId],
    from: Candidates,
) -> Found {
    let passive = gw.passive_open_ms();
    let limit = gw.config.limits.max_in_flight_per_worker;
    let mut found = Found {
        ids: SmallVec::new(),
        any_healthy: false,
    };
    for w in workers {
        if w.breaker.available(passive) && !excluded.contains(&w.id) {
            found.ids.push(w.id);
        }
    }
    found.any_healthy = !found.ids.is_empty();
    if from == Candidates::WithFreeSlot && limit > 0 {
        // One read of the ledger for every healthy worker's in-flight count.
        let loads = model.ledger().loads_of(&found.ids);
        let mut loads = loads.iter();
        found
            .ids
            .retain(|_| loads.next().is_some_and(|l| l.in_flight < limit));
    }
    found
}

/// The session key of a request, from the model's session header.
pub fn session_key<'h>(model: &ModelState, headers: &'h HeaderMap) -> Option<&'h str> {
    if model.kind() != PolicyKind::Session {
        return None;
    }
    headers
        .get(&model.session_header)
        .and_then(|v| v.to_str().ok())
}

/// The leader replica's choice among this replica's candidates (healthy, with a free
/// slot here), when replicas decide at a leader ([`crate::peers`]) and this one does
/// not lead; `None` to choose here.
async fn pick_at_leader(
    gw: &Gateway,
    p: &Prepared,
    session: Option<&str>,
    excluded: &[WorkerId],
) -> Option<crate::peers::LeaderChoice> {
    if !crate::peers::decides_at_leader(gw, &p.model) {
        return None;
    }
    // Before any other work: the leader itself (and a replica without peers connected)
    // chooses here.
    let leader = gw.peers.leader()?;
    let workers = p.model.workers();
    let found = candidates(gw, &p.model, &workers, excluded, Candidates::WithFreeSlot);
    if found.ids.len() < 2 {
        // Nothing to choose (or nothing to choose from: the local path says why).
        return None;
    }
    let candidates: Vec<Arc<Worker>> = workers
        .iter()
        .filter(|w| found.ids.contains(&w.id))
        .cloned()
        .collect();
    crate::peers::choose_at_leader(gw, leader, p, &candidates, session).await
}

/// Selects a worker and takes a lease on it (admission plus booking, in one step on
/// the worker's in-flight count), waiting (bounded) when every healthy worker is full.
pub async fn pick(
    gw: &Gateway,
    p: &Prepared,
    headers: &HeaderMap,
    excluded: &[WorkerId],
    admission: &Arc<Admission>,
) -> Result<(Decision, Lease), ApiError> {
    let session = session_key(&p.model, headers);
    let limit = gw.config.limits.max_in_flight_per_worker;
    if let Some(choice) = pick_at_leader(gw, p, session, excluded).await {
        let lease = gw.peers.settle(choice.id, || {
            Lease::try_take(p, &choice.worker, &choice.decision, admission, limit)
        });
        if let Some(lease) = lease {
            return Ok((choice.decision, lease));
        }
        // The worker filled up meanwhile: choose here.
    }
    // `None`: every candidate is full (or the chosen one filled up meanwhile): wait.
    let attempt = || {
        // Choice and booking under the model's lock: requests arriving together each
        // see the bookings of those chosen before them.
        let _choosing = p.model.choosing.lock();
        match try_pick(gw, p, session, excluded, Candidates::WithFreeSlot) {
            Err(e) => Some(Err(e)),
            Ok(Pick::Chosen { decision, worker }) => {
                let lease = Lease::try_take(p, &worker, &decision, admission, limit)?;
                // Counted once the choice is booked: a choice whose worker filled up
                // meanwhile is made again.
                gw.metrics
                    .routing_decisions
                    .with_label_values(&[&*p.model.name, p.model.kind().as_str(), decision.rule])
                    .inc();
                Some(Ok((decision, lease)))
            }
            Ok(Pick::Full) => None,
            Ok(Pick::NoneHealthy) => Some(Err(ApiError::no_healthy_worker(
                &p.model.name,
                gw.config.health.open_ms.div_ceil(1000),
            ))),
        }
    };
    if let Some(r) = attempt() {
        return r;
    }
    let deadline = tokio::time::Instant::now() + gw.limiter.timeout();
    let waited =
        crate::limits::wait_for_slot(&p.model, gw.config.limits.max_queue, deadline, attempt).await;
    waited.unwrap_or_else(|| {
        Err(ApiError::overloaded(
            format!(
                "every healthy worker of model {:?} is at its in-flight limit and stayed so for the queue timeout; retry later",
                &*p.model.name
            ),
            gw.limiter.retry_after(),
        ))
    })
}
