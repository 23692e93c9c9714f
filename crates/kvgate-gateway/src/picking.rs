//! The request path of a front door that picks a worker and does not call it: the
//! Endpoint Picker (crate kvgate-epp), behind which the cluster's own gateway proxies
//! to the endpoint picked. The same steps as pipeline.rs up to the choice (prepare.rs,
//! then select.rs's [`Routed`] picker: policy, lease, data-parallel rank, decision log),
//! then the response the gateway proxies is watched as the HTTP path watches its own
//! ([`ResponseWatch`]: first token, output, usage, end; the lease ends with it).
//!
//! Owns what only this door has: the allowed set of a pick (the gateway's subset
//! hint), the ranked fallbacks, a request that is not routed (picked by rotation, no
//! booking), and moving a booking to the endpoint that served when it is not the one
//! picked. Must not send requests (failover.rs) or speak a wire protocol (kvgate-epp).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use http::HeaderMap;
use kvgate_core::{BlockKey, Decision, WorkerId};
use kvgate_tokenize::RequestKind;

use crate::errors::ApiError;
use crate::failover::Picker;
use crate::gateway::Gateway;
use crate::lease::{booking_spec, Lease};
use crate::limits::Admission;
use crate::metrics::RequestRecord;
use crate::observe::{Lifecycle, ResponseWatch};
use crate::prepare::{prepare, TokenUse};
use crate::registry::{ModelState, Worker};
use crate::select::Routed;

/// One request the gateway in front asks a pick for.
pub struct PickRequest {
    /// The request's path (`:path`), which tells a chat or completion request from one
    /// that is not routed.
    pub path: String,
    pub headers: HeaderMap,
    /// The whole body (empty for a request without one).
    pub body: Bytes,
    /// Its admission (front_door::admit_head), held until its response ends.
    pub admission: Arc<Admission>,
    /// Its line in `kvgate_requests_total`: chat and completions only, as the HTTP
    /// front door counts them (`None` for any other request).
    pub record: Option<RequestRecord>,
    /// The endpoints (`host:port`) the pick must come from (the gateway's subset
    /// hint); `None`: any of the pool's.
    pub allowed: Option<Vec<String>>,
    /// How many ranked fallback endpoints to add after the pick.
    pub fallbacks: usize,
}

/// What was picked for a request, and its hold until its response ends.
pub struct EndpointPick {
    /// `host:port` of the worker picked (it stays the pick when the booking moves).
    pub endpoint: String,
    /// Further endpoints, best first, for a gateway that retries down a list.
    pub fallbacks: Vec<String>,
    /// The data-parallel rank to pin the request to (`x-data-parallel-rank`).
    pub rank: Option<u32>,
    /// The rule that decided (`rotation` for a request that is not routed).
    pub rule: &'static str,
    /// The request's model (`None` for a request that is not routed).
    pub model: Option<Arc<ModelState>>,
    /// The response's watch, holding the lease (`None`: nothing booked).
    pub watch: Option<ResponseWatch>,
    decision: Option<Decision>,
    keys: Vec<BlockKey>,
    prompt_tokens: u32,
    max_tokens: Option<u32>,
    admission: Arc<Admission>,
}

/// The request kind of a routed path; `None` for any other path.
pub fn routed_kind(path: &str) -> Option<RequestKind> {
    let path = path.split('?').next().unwrap_or(path);
    if path.ends_with("/chat/completions") {
        Some(RequestKind::Chat)
    } else if path.ends_with("/completions") {
        Some(RequestKind::Completion)
    } else {
        None
    }
}

/// `host:port` of a worker URL (`http://10.0.0.1:8000` → `10.0.0.1:8000`), as gateways
/// name endpoints.
pub fn endpoint_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.split('/').next().unwrap_or(rest).to_owned()
}

/// Picks the endpoint for `req`: a chat or completion request through prepare and the
/// model's policy, booked until its response ends; any other request by rotation over
/// the healthy endpoints, booking nothing.
pub async fn pick_endpoint(gw: &Arc<Gateway>, req: PickRequest) -> Result<EndpointPick, ApiError> {
    let Some(kind) = routed_kind(&req.path) else {
        return pick_unrouted(gw, req);
    };
    let record = req
        .record
        .as_ref()
        .ok_or_else(|| ApiError::internal("a routed pick that is not counted"))?;
    let p = prepare(gw, Some(kind), &req.headers, &req.body, TokenUse::ForPolicy).await?;
    record.model(&p.model.name, p.model.kind().as_str());
    let workers = p.model.workers();
    let excluded = outside(&workers, req.allowed.as_deref());
    if excluded.len() == workers.len() {
        return Err(no_eligible_endpoint(&p.model.name));
    }
    let mut routed = Routed {
        p: &p,
        headers: &req.headers,
        admission: &req.admission,
        record,
    };
    let picked = routed.pick(gw, &excluded).await?;
    let Some((decision, lease)) = picked.held else {
        return Err(ApiError::internal("a routed pick without a lease"));
    };
    let fallbacks = ranked_fallbacks(&decision, &workers, &excluded, req.fallbacks);
    let watch = ResponseWatch::new(
        Lifecycle::new(lease, gw.clone(), decision.predicted_cached_tokens),
        p.stream,
    );
    Ok(EndpointPick {
        endpoint: endpoint_of(&picked.worker.url),
        fallbacks,
        rank: picked.rank,
        rule: decision.rule,
        model: Some(p.model.clone()),
        watch: Some(watch),
        keys: p.keys.clone().unwrap_or_default(),
        prompt_tokens: p.prompt_tokens,
        max_tokens: p.max_tokens,
        decision: Some(decision),
        admission: req.admission,
    })
}

impl EndpointPick {
    /// The gateway says `served` (`host:port`) answered the request. When that is not
    /// the endpoint picked (the gateway retried elsewhere, or ignored the pick), the
    /// booking moves there, priced with what the index showed cached on it. Returns
    /// whether it moved. An endpoint that is not one of the model's workers keeps the
    /// booking where it is.
    pub fn served_by(&mut self, served: &str) -> bool {
        let (Some(watch), Some(decision)) = (&mut self.watch, &self.decision) else {
            return false;
        };
        let Some(lease) = watch.lease() else {
            return false;
        };
        if endpoint_of(&lease.worker().url) == served {
            return false;
        }
        let model = lease.model().clone();
        let Some(worker) = model
            .workers()
            .iter()
            .find(|w| endpoint_of(&w.url) == served)
            .cloned()
        else {
            return false;
        };
        let moved = decision_for(decision, &worker, model.selection.block_size());
        let spec = booking_spec(&moved, self.prompt_tokens, self.max_tokens, false);
        // No in-flight limit: the request is there already.
        let Some(lease) = Lease::try_take(&model, &worker, spec, &self.keys, &self.admission, 0)
        else {
            return false;
        };
        watch.replace_lease(lease, moved.predicted_cached_tokens);
        true
    }
}

/// `decision` as if it had chosen `worker`: what the index showed cached there.
fn decision_for(decision: &Decision, worker: &Worker, block_size: u32) -> Decision {
    let cached = decision
        .scores
        .iter()
        .find(|s| s.worker == worker.id)
        .map_or(0, |s| s.overlap_blocks[0].saturating_mul(block_size));
    Decision {
        worker: worker.id,
        predicted_cached_tokens: cached,
        indexed_cached_tokens: cached,
        credited_tokens: 0,
        ..decision.clone()
    }
}

/// The workers whose endpoint is not in `allowed` (none when there is no hint).
fn outside(workers: &[Arc<Worker>], allowed: Option<&[String]>) -> Vec<WorkerId> {
    let Some(allowed) = allowed else {
        return Vec::new();
    };
    workers
        .iter()
        .filter(|w| !allowed.iter().any(|a| *a == endpoint_of(&w.url)))
        .map(|w| w.id)
        .collect()
}

/// Up to `n` endpoints after the choice, by the policy's cost (lowest first; a policy
/// without costs: in its score order), none excluded.
fn ranked_fallbacks(
    decision: &Decision,
    workers: &[Arc<Worker>],
    excluded: &[WorkerId],
    n: usize,
) -> Vec<String> {
    if n == 0 {
        return Vec::new();
    }
    let mut scores: Vec<_> = decision
        .scores
        .iter()
        .filter(|s| s.worker != decision.worker && !excluded.contains(&s.worker))
        .collect();
    scores.sort_by(|a, b| {
        let cost = |s: &&kvgate_core::WorkerScore| s.cost.unwrap_or(0.0);
        cost(a).total_cmp(&cost(b))
    });
    scores
        .iter()
        .filter_map(|s| workers.iter().find(|w| w.id == s.worker))
        .filter(|w| !w.breaker.is_open())
        .take(n)
        .map(|w| endpoint_of(&w.url))
        .collect()
}

/// A request that is not routed (a path other than chat or completions): the next
/// healthy allowed endpoint of any model, in rotation; nothing booked.
fn pick_unrouted(gw: &Arc<Gateway>, req: PickRequest) -> Result<EndpointPick, ApiError> {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let passive = gw.passive_open_ms();
    let healthy: Vec<Arc<Worker>> = gw
        .models()
        .flat_map(|m| m.workers().iter().cloned().collect::<Vec<_>>())
        .filter(|w| w.breaker.available(passive))
        .filter(|w| {
            req.allowed
                .as_ref()
                .is_none_or(|a| a.iter().any(|e| *e == endpoint_of(&w.url)))
        })
        .collect();
    if healthy.is_empty() {
        return Err(no_eligible_endpoint("any"));
    }
    let worker = &healthy[NEXT.fetch_add(1, Ordering::Relaxed) % healthy.len()];
    Ok(EndpointPick {
        endpoint: endpoint_of(&worker.url),
        fallbacks: Vec::new(),
        rank: None,
        rule: "rotation",
        model: None,
        watch: None,
        decision: None,
        keys: Vec::new(),
        prompt_tokens: 0,
        max_tokens: None,
        admission: req.admission,
    })
}

/// 503: no endpoint the gateway allows is one of the model's healthy workers.
fn no_eligible_endpoint(model: &str) -> ApiError {
    ApiError::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "no_eligible_endpoint",
        format!("no endpoint the gateway allows serves model {model:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routed_paths_and_endpoints() {
        assert_eq!(routed_kind("/v1/chat/completions"), Some(RequestKind::Chat));
        assert_eq!(
            routed_kind("/v1/completions?x=1"),
            Some(RequestKind::Completion)
        );
        assert_eq!(routed_kind("/v1/models"), None);
        assert_eq!(endpoint_of("http://10.0.0.1:8000"), "10.0.0.1:8000");
        assert_eq!(endpoint_of("http://10.0.0.1:8000/"), "10.0.0.1:8000");
        assert_eq!(endpoint_of("https://[::1]:9/v1"), "[::1]:9");
    }
}
