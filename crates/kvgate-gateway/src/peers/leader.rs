//! Choices made at the leader replica (`peers.decisions: leader`): asking the leader
//! to choose for one of this replica's requests, and choosing at the leader for a
//! peer's (held as that peer's booking until its reports settle it). Must not book
//! this replica's own requests (select.rs takes the lease).

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use kvgate_core::{BlockKey, Decision, SelectError};

use crate::config::PeerDecisions;
use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::lease::booking_spec;
use crate::prepare::Prepared;
use crate::registry::{ModelState, Worker};

use crate::peer_link::client::{answered, error_code, exchange_bytes};
use crate::peer_link::hub::Ask;
use crate::peer_link::wire::{
    encode_decide, keys_refused, same_keys, DecideAnswer, DecideRequest, DECIDE_CONTENT_TYPE,
    DECIDE_PATH, MAX_DECIDE_BYTES,
};

/// How long a leader that did not answer is passed over.
const LEADER_BACKOFF: Duration = Duration::from_secs(1);
/// How long a leader that does not decide for peers (a kvgate from before
/// `/peer/v1/decide`, during a rolling update) is passed over.
const LEADER_UNSUPPORTED_BACKOFF: Duration = Duration::from_secs(60);

/// A choice made at the leader, for this replica to book through its `ask`
/// ([`Ask::settle`]; given up if dropped).
pub struct LeaderChoice<'g> {
    pub ask: Ask<'g>,
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
pub async fn choose_at_leader<'g>(
    gw: &'g Gateway,
    (url, leader): (String, String),
    p: &Prepared,
    candidates: &[Arc<Worker>],
    session_key: Option<&str>,
) -> Option<LeaderChoice<'g>> {
    let model = &*p.model;
    let identity = gw.peers.identity()?;
    let pool = gw
        .pools_named()
        .find(|(m, _)| std::ptr::eq(m.as_ref(), model))
        .map_or("", |(_, pool)| pool);
    // Settled however this ends: booked by the caller, or given up when dropped (a
    // leader that answered too late may hold it; the next reports end that hold).
    let ask = gw.peers.ask();
    let id = ask.id;
    let fingerprint = model.selection.hasher().fingerprint();
    let request = DecideRequest {
        model: model.name.to_string(),
        pool: pool.to_owned(),
        incarnation: identity.incarnation,
        id,
        candidates: candidates.iter().map(|w| w.url.to_string()).collect(),
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
    let body = encode_decide(&request, p.keys.as_deref());
    let answer = tokio::time::timeout(timeout, ask_leader(gw, &url, body)).await;
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
    if p.keys.is_some() {
        if let Err(why) = same_keys(fingerprint, answer.key_fingerprint) {
            // Chosen blind to this prompt's cache: not used (given up as `ask` drops).
            if gw.peers.skip_leader(LEADER_UNSUPPORTED_BACKOFF) {
                tracing::warn!(%leader, peer = %url, %why, backoff = ?LEADER_UNSUPPORTED_BACKOFF, "the leader keys prompts otherwise (every replica must run the same kvgate version, block size and hash salt); choosing here");
            }
            outcome("fallback");
            return None;
        }
    }
    let url_answered = crate::config::normalize_url(&answer.worker);
    let Some(worker) = candidates.iter().find(|w| *w.url == *url_answered).cloned() else {
        tracing::warn!(%leader, worker = %answer.worker, "the leader chose a worker that was not a candidate; choosing here");
        outcome("fallback");
        return None;
    };
    outcome("asked");
    Some(LeaderChoice {
        ask,
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
    request: Bytes,
) -> Result<DecideAnswer, LeaderRefused> {
    let (status, body) = exchange_bytes(
        &gw.client,
        &gw.peers,
        gw.config.admin_token.as_deref(),
        format!("{url}{DECIDE_PATH}"),
        (request, DECIDE_CONTENT_TYPE),
        MAX_DECIDE_BYTES,
    )
    .await
    .map_err(LeaderRefused::Failed)?;
    if status != StatusCode::OK {
        return Err(refusal(status, &body));
    }
    serde_json::from_slice(&body).map_err(|e| LeaderRefused::Failed(e.to_string()))
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
        // A leader that reads decide requests otherwise (another kvgate version).
        StatusCode::METHOD_NOT_ALLOWED
        | StatusCode::UNSUPPORTED_MEDIA_TYPE
        | StatusCode::BAD_REQUEST => LeaderRefused::Unsupported(why),
        _ => LeaderRefused::Failed(why),
    }
}

/// Chooses for `asker`'s request `req` with the prompt's block `keys`.
pub(crate) fn decide_for_peer(
    gw: &Gateway,
    asker: &str,
    req: &DecideRequest,
    keys: Option<&[BlockKey]>,
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
    if keys.is_some() {
        if let Err(why) = same_keys(fingerprint, req.key_fingerprint) {
            return Err(keys_refused(why));
        }
    }
    let now = Instant::now();
    let select = kvgate_selection::SelectRequest {
        block_keys: keys,
        prompt_tokens: req.prompt_tokens,
        session_key: req.session_key.as_deref(),
        now,
        // The ask carries no objective: a leader chooses as without one.
        objective: Default::default(),
    };
    // In order with this replica's own choices (select::pick holds it too).
    let _choosing = model.choosing.lock();
    let decision = match model.selection.select(&select, &ids) {
        Ok(d) => d,
        Err(SelectError::NoCandidates) => {
            return Err(refuse("no_candidate", "no candidate can be chosen".into()))
        }
        Err(e) => return Err(refuse("cannot_choose", e.to_string())),
    };
    // Booked as the asker's lease will book it.
    let spec = booking_spec(
        &decision,
        req.prompt_tokens,
        req.expected_output_tokens,
        req.kv_transferred,
    );
    let held = model.ledger().book_for_peer(
        asker,
        req.incarnation,
        req.id,
        decision.worker,
        spec,
        keys.unwrap_or_default(),
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
        // A leader that reads decide requests otherwise: an older one answers the
        // binary encoding with a JSON parse error, a newer one JSON with 415.
        is(
            StatusCode::BAD_REQUEST,
            &json("invalid_json"),
            LeaderRefused::Unsupported,
        );
        is(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            &json("unsupported_media_type"),
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
