//! Prefill/decode disaggregation: a request of a disaggregated model runs as two legs,
//! the prompt's prefill on a worker of the prefill pool and the generation on a worker
//! of the decode pool, which receives the prompt's KV cache from the prefill worker.
//!
//! - **vLLM** (KV connectors such as NIXL): the prefill leg is the request with
//!   `max_tokens: 1`, `stream: false`, no `stream_options` and `kv_transfer_params`
//!   asking for a remote decode; the `kv_transfer_params` of its answer go with the
//!   original request to the decode worker, whose answer is the client's. Each leg has
//!   its own failover (a dead prefill worker before its answer: another prefill worker;
//!   a failed decode attempt: another decode worker with the same parameters).
//! - **SGLang** (bootstrap transfer): the request goes to a prefill and a decode worker
//!   at once, both carrying the prefill worker's `bootstrap_host`/`bootstrap_port` and a
//!   random `bootstrap_room` that pairs them; the decode answer is the client's. A
//!   prefill leg that fails before the decode answer begins ends the pair, and the pair
//!   is tried again (new room, another prefill worker).
//!
//! Both legs share one `x-request-id` (the client's, or a new one). Each leg holds a
//! lease on its own pool: the prefill booking (prefill work on the prefill pool's
//! ledger) ends when the prefill leg returns; the decode booking (no prefill work: the
//! KV arrives by transfer) ends with the client's response. A client that leaves ends
//! both legs.
//!
//! Owns the handover protocols and the order of the legs. Must not choose workers
//! (select.rs) or send requests itself (failover.rs's attempt loop sends every leg).

use std::sync::Arc;
use std::time::Duration;

use axum::response::Response;
use bytes::Bytes;
use http::{HeaderName, HeaderValue, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Map, Value};

use crate::body::read_bounded;
use crate::config::PdMode;
use crate::errors::ApiError;
use crate::failover::{call_workers, engine_error, Accepted, Attempts, Forwarded, Given, Held};
use crate::gateway::Gateway;
use crate::limits::Admission;
use crate::metrics::RequestRecord;
use crate::prepare::Prepared;
use crate::registry::{ModelState, PrefillPool};
use crate::respond::answer;
use crate::select::{pick, try_pick, Candidates, Pick, Routed};

/// Counts a disaggregated request by how it ran (one of
/// [`crate::metrics::DISAGGREGATED_ROUTES`]).
pub(crate) fn count(gw: &Gateway, model: &str, route: &str) {
    gw.metrics
        .disaggregated
        .with_label_values(&[model, route])
        .inc();
}

/// Header naming the prefill worker of a disaggregated response.
pub const PREFILL_WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvgate-prefill-worker");

/// The request id both legs carry (vLLM and SGLang log and trace by it).
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Largest prefill answer read for its `kv_transfer_params` (a one-token answer).
const PREFILL_ANSWER_MAX_BYTES: usize = 4 << 20;
/// How long a prefill answer's body may take once its head arrived.
const PREFILL_ANSWER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Whether a request of a disaggregated model skips the split: its prompt has fewer
/// uncached tokens (the prefill pool's best prediction taken off) than the threshold,
/// so a decode worker computes it whole.
pub fn skips_prefill(gw: &Gateway, prefill: &PrefillPool, p: &Prepared) -> bool {
    let threshold = prefill.uncached_token_threshold;
    if threshold == 0 {
        return false;
    }
    if p.prompt_tokens < threshold {
        return true;
    }
    let cached = match try_pick(
        gw,
        &for_prefill(prefill, p),
        None,
        &[],
        Candidates::AllHealthy,
    ) {
        Ok(Pick::Chosen { decision, .. }) => decision.predicted_cached_tokens,
        _ => 0,
    };
    p.prompt_tokens.saturating_sub(cached) < threshold
}

/// The prefill leg of a request: routed on the prefill pool, one output token.
fn for_prefill(prefill: &PrefillPool, p: &Prepared) -> Prepared {
    Prepared {
        model: prefill.pool.clone(),
        max_tokens: Some(1),
        stream: false,
        token_ids: None,
        kv_transferred: false,
        ..p.clone()
    }
}

/// Runs a disaggregated request's legs; the decode worker's answer is the client's.
pub async fn serve(
    gw: &Arc<Gateway>,
    prefill: &PrefillPool,
    mut request: Forwarded,
    p: &Prepared,
    admission: &Arc<Admission>,
    record: &RequestRecord,
) -> Result<Response, ApiError> {
    count(gw, &p.model.name, "split");
    if !request.headers.contains_key(REQUEST_ID) {
        request.headers.insert(REQUEST_ID, new_request_id());
    }
    let decode = Prepared {
        kv_transferred: true,
        ..p.clone()
    };
    let legs = Legs {
        gw,
        prefill,
        request,
        prefill_p: for_prefill(prefill, p),
        decode_p: decode,
        admission,
        record,
    };
    match prefill.mode {
        PdMode::Vllm => legs.vllm().await,
        PdMode::Sglang => legs.sglang().await,
    }
}

/// What both legs of one request share.
struct Legs<'a> {
    gw: &'a Arc<Gateway>,
    prefill: &'a PrefillPool,
    request: Forwarded,
    prefill_p: Prepared,
    decode_p: Prepared,
    admission: &'a Arc<Admission>,
    record: &'a RequestRecord,
}

impl Legs<'_> {
    /// The attempt loop's picker for one leg (`p`: the leg's prepared request).
    fn routed<'a>(&'a self, p: &'a Prepared) -> Routed<'a> {
        Routed {
            p,
            headers: &self.request.headers,
            admission: self.admission,
            record: self.record,
        }
    }

    /// vLLM: prefill, then decode with the prefill answer's `kv_transfer_params`.
    async fn vllm(&self) -> Result<Response, ApiError> {
        let gw = self.gw;
        let prefill_request = Forwarded {
            body: vllm_prefill_body(&self.request.body)?,
            ..self.request.clone()
        };
        let accepted =
            call_workers(gw, &prefill_request, &mut self.routed(&self.prefill_p)).await?;
        if !accepted.resp.status().is_success() {
            // The engine refused the request, or every attempt failed: its answer.
            return answer(gw, &prefill_request, accepted).await;
        }
        let prefill_worker = accepted.worker.clone();
        // Reading the answer ends the prefill leg and its booking.
        let params = transfer_params_of(accepted).await.map_err(|why| {
            count(gw, &self.decode_p.model.name, "handover_failed");
            ApiError::prefill_handover_failed(&prefill_worker.url, why)
        })?;
        let decode_request = Forwarded {
            body: vllm_decode_body(&self.request.body, params)?,
            ..self.request.clone()
        };
        let accepted = call_workers(gw, &decode_request, &mut self.routed(&self.decode_p)).await?;
        let mut resp = answer(gw, &decode_request, accepted).await?;
        resp.headers_mut()
            .insert(PREFILL_WORKER_HEADER, prefill_worker.header_value.clone());
        Ok(resp)
    }

    /// SGLang: prefill and decode at once, paired by a bootstrap room; a prefill leg
    /// that fails before the decode answer begins ends the pair, which is tried again
    /// (the attempt loop's [`Attempts`]: another prefill worker, after a backoff).
    async fn sglang(&self) -> Result<Response, ApiError> {
        let gw = self.gw;
        let failover = &gw.config.failover;
        let mut attempts = Attempts::new(failover, failover.max_attempts as usize);
        while attempts.next().await {
            let picked = pick(
                gw,
                &self.prefill_p,
                &self.request.headers,
                attempts.excluded(),
                self.admission,
            )
            .await;
            let (decision, lease) = match picked {
                Ok(x) => x,
                Err(e) => return Err(attempts.none_left(e)),
            };
            let prefill_worker = lease.worker().clone();
            let Some(port) = prefill_worker.config.bootstrap_port else {
                return Err(ApiError::internal(format!(
                    "prefill worker {} has no bootstrap port",
                    prefill_worker.url
                )));
            };
            // SGLang sends a prefill to its data-parallel rank `room % dp_size`: the
            // room is chosen so that this is the rank holding most of the prompt.
            let best_rank = (prefill_worker.config.dp_size > 1)
                .then(|| {
                    self.prefill_p.model.selection.best_rank(
                        prefill_worker.id,
                        self.prefill_p.keys.as_deref().unwrap_or_default(),
                    )
                })
                .flatten();
            let room = room_for_rank(
                rand::random::<u64>(),
                prefill_worker.config.dp_size,
                best_rank,
            );
            let body = sglang_body(&self.request.body, prefill_worker.host(), port, room)?;
            let prefill_request = Forwarded {
                body: body.clone(),
                ..self.request.clone()
            };
            let decode_request = Forwarded {
                body,
                ..self.request.clone()
            };
            let mut leg = PrefillLeg::spawn(
                gw.clone(),
                self.prefill.pool.clone(),
                prefill_request,
                (decision, lease),
            );
            let mut decode_picker = self.routed(&self.decode_p);
            let decode = call_workers(gw, &decode_request, &mut decode_picker);
            tokio::pin!(decode);
            let first = tokio::select! {
                accepted = &mut decode => First::Decode(Box::new(accepted)),
                done = leg.finished() => First::Prefill(done),
            };
            let accepted = match first {
                First::Decode(accepted) => (*accepted)?,
                First::Prefill(Ok(())) => (&mut decode).await?,
                First::Prefill(Err(LegFailure::Final(e))) => return Err(e),
                First::Prefill(Err(LegFailure::Retry(e))) => {
                    // The decode attempt waits for KV that will not come: drop it.
                    tracing::debug!(worker = %prefill_worker.url, error = %e.message, "prefill leg failed before the decode answer");
                    count(gw, &self.decode_p.model.name, "prefill_retried");
                    attempts.failed(prefill_worker.id, e);
                    continue;
                }
            };
            // The prefill leg finishes on its own, holding its booking until then.
            leg.detach();
            let mut resp = answer(gw, &decode_request, accepted).await?;
            resp.headers_mut()
                .insert(PREFILL_WORKER_HEADER, prefill_worker.header_value.clone());
            return Ok(resp);
        }
        Err(attempts.exhausted(|| {
            ApiError::no_healthy_worker(
                &self.prefill.pool.name,
                gw.config.health.open_ms.div_ceil(1000),
            )
        }))
    }
}

/// Which leg of an SGLang pair was heard from first.
enum First {
    /// Boxed: an accepted response is large, and this enum only passes it on.
    Decode(Box<Result<Accepted, ApiError>>),
    Prefill(Result<(), LegFailure>),
}

/// How an SGLang prefill leg failed.
enum LegFailure {
    /// Another pair may succeed (transport failure, 5xx, 429).
    Retry(ApiError),
    /// The engine refused the request itself (4xx): the client's answer.
    Final(ApiError),
}

/// An SGLang prefill leg running beside its decode leg: sent through the attempt loop
/// on its already leased worker, its answer read to the end (the lease ends then).
/// Dropped before [`PrefillLeg::detach`], it is aborted (the client left, or the pair
/// failed).
struct PrefillLeg {
    task: Option<tokio::task::JoinHandle<Result<(), LegFailure>>>,
}

impl PrefillLeg {
    fn spawn(
        gw: Arc<Gateway>,
        pool: Arc<ModelState>,
        request: Forwarded,
        held: Held,
    ) -> PrefillLeg {
        let task = tokio::spawn(async move {
            let mut given = Given {
                model: pool,
                held: Some(held),
            };
            let accepted = call_workers(&gw, &request, &mut given)
                .await
                .map_err(LegFailure::Retry)?;
            let status = accepted.resp.status();
            if !status.is_success() {
                let e = engine_error(accepted.resp, &accepted.worker).await;
                return Err(
                    if status.is_server_error() || status == StatusCode::TOO_MANY_REQUESTS {
                        LegFailure::Retry(e)
                    } else {
                        LegFailure::Final(e)
                    },
                );
            }
            let Accepted {
                worker,
                resp,
                held,
                cut_off,
            } = accepted;
            let mut body = resp.into_body();
            loop {
                tokio::select! {
                    frame = body.frame() => match frame {
                        None => break,
                        Some(Ok(_)) => {}
                        Some(Err(e)) => {
                            return Err(LegFailure::Retry(ApiError::upstream_unreachable(&worker.url, e)));
                        }
                    },
                    () = cut_off.cancelled() => {
                        return Err(LegFailure::Retry(ApiError::worker_gone(&worker.url)));
                    }
                }
            }
            drop(held);
            Ok(())
        });
        PrefillLeg { task: Some(task) }
    }

    /// Waits for the leg to end (pending forever once detached).
    async fn finished(&mut self) -> Result<(), LegFailure> {
        match self.task.as_mut() {
            Some(task) => task
                .await
                .unwrap_or_else(|e| Err(LegFailure::Retry(ApiError::internal(e.to_string())))),
            None => std::future::pending().await,
        }
    }

    /// Lets the leg finish on its own.
    fn detach(mut self) {
        self.task = None;
    }
}

impl Drop for PrefillLeg {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

/// The `kv_transfer_params` of a prefill answer (read to its end, which ends the leg
/// and frees its booking).
async fn transfer_params_of(accepted: Accepted) -> Result<Value, String> {
    let Accepted {
        resp,
        held,
        cut_off,
        ..
    } = accepted;
    let mut body = resp.into_body();
    let read = read_bounded(
        &mut body,
        PREFILL_ANSWER_MAX_BYTES,
        Some(PREFILL_ANSWER_READ_TIMEOUT),
    );
    let body = tokio::select! {
        read = read => read.map_err(|e| format!("its answer could not be read: {e}"))?,
        () = cut_off.cancelled() => return Err("it was taken out of rotation (dead or stalled) while answering".into()),
    };
    drop(held);
    transfer_params_in(&body)
}

/// The `kv_transfer_params` object of a prefill answer's body.
pub fn transfer_params_in(body: &[u8]) -> Result<Value, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("its answer is not JSON: {e}"))?;
    match v.get("kv_transfer_params") {
        Some(p @ Value::Object(_)) => Ok(p.clone()),
        _ => Err("its answer has no kv_transfer_params: start the prefill engines with a KV connector that produces KV (--kv-transfer-config with kv_role kv_producer or kv_both)".into()),
    }
}

/// A client body with some fields changed.
fn edit_body(body: &[u8], edit: impl FnOnce(&mut Map<String, Value>)) -> Result<Bytes, ApiError> {
    let mut fields: Map<String, Value> =
        serde_json::from_slice(body).map_err(ApiError::malformed_json)?;
    edit(&mut fields);
    serde_json::to_vec(&fields)
        .map(Bytes::from)
        .map_err(|e| ApiError::internal(format!("cannot encode a leg's request: {e}")))
}

/// vLLM's prefill leg: one token, not streamed, asking for a remote decode.
pub fn vllm_prefill_body(body: &[u8]) -> Result<Bytes, ApiError> {
    edit_body(body, |f| {
        f.insert("max_tokens".into(), json!(1));
        if f.contains_key("max_completion_tokens") {
            f.insert("max_completion_tokens".into(), json!(1));
        }
        f.insert("stream".into(), json!(false));
        f.remove("stream_options");
        f.insert(
            "kv_transfer_params".into(),
            json!({
                "do_remote_decode": true,
                "do_remote_prefill": false,
                "remote_engine_id": null,
                "remote_block_ids": null,
                "remote_host": null,
                "remote_port": null,
            }),
        );
    })
}

/// vLLM's decode leg: the client's request with the prefill answer's parameters.
pub fn vllm_decode_body(body: &[u8], params: Value) -> Result<Bytes, ApiError> {
    edit_body(body, |f| {
        f.insert("kv_transfer_params".into(), params);
    })
}

/// SGLang's legs (both): the client's request with the prefill worker's bootstrap
/// address and the pair's room.
pub fn sglang_body(body: &[u8], host: &str, port: u16, room: u64) -> Result<Bytes, ApiError> {
    // An IPv6 host is sent without its URL brackets.
    let host = host.trim_start_matches('[').trim_end_matches(']');
    edit_body(body, |f| {
        f.insert("bootstrap_host".into(), json!(host));
        f.insert("bootstrap_port".into(), json!(port));
        f.insert("bootstrap_room".into(), json!(room));
    })
}

/// An SGLang bootstrap room from a random number: below 2^63 (a JSON integer every
/// client reads), and `room % dp_size == rank` when a rank is asked for (SGLang's data
/// parallel controller sends a disaggregated prefill to rank `room % dp_size`).
pub fn room_for_rank(random: u64, dp_size: u32, rank: Option<u32>) -> u64 {
    let room = random >> 1;
    match rank {
        Some(rank) if dp_size > 1 && rank < dp_size => {
            let dp = u64::from(dp_size);
            let room = room - room % dp + u64::from(rank);
            if room >= 1 << 63 {
                room - dp
            } else {
                room
            }
        }
        _ => room,
    }
}

/// A new request id for both legs.
fn new_request_id() -> HeaderValue {
    let id = format!("kvgate-pd-{:032x}", rand::random::<u128>());
    HeaderValue::from_str(&id).unwrap_or_else(|_| HeaderValue::from_static("kvgate-pd"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(b: &Bytes) -> Value {
        serde_json::from_slice(b).unwrap()
    }

    #[test]
    fn the_vllm_prefill_leg_asks_for_one_token_and_a_remote_decode() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":64,"max_completion_tokens":64,"stream":true,"stream_options":{"include_usage":true},"temperature":0.5}"#;
        let v = fields(&vllm_prefill_body(body).unwrap());
        assert_eq!(v["max_tokens"], 1);
        assert_eq!(v["max_completion_tokens"], 1);
        assert_eq!(v["stream"], false);
        assert!(v.get("stream_options").is_none());
        assert_eq!(v["temperature"], 0.5);
        assert_eq!(v["messages"][0]["content"], "hi");
        assert_eq!(
            v["kv_transfer_params"],
            json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                   "remote_block_ids": null, "remote_host": null, "remote_port": null})
        );
        // No max_completion_tokens is added where the client sent none.
        let v = fields(&vllm_prefill_body(br#"{"prompt":"x"}"#).unwrap());
        assert!(v.get("max_completion_tokens").is_none());
    }

    #[test]
    fn the_vllm_decode_leg_is_the_clients_request_with_the_prefill_parameters() {
        let answer = br#"{"id":"c","choices":[],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_engine_id":"e","remote_host":"10.0.0.1","remote_port":5600}}"#;
        let params = transfer_params_in(answer).unwrap();
        let body = br#"{"model":"m","prompt":"x","max_tokens":64,"stream":true}"#;
        let v = fields(&vllm_decode_body(body, params.clone()).unwrap());
        assert_eq!(v["kv_transfer_params"], params);
        assert_eq!(v["max_tokens"], 64);
        assert_eq!(v["stream"], true);
        assert!(transfer_params_in(br#"{"choices":[]}"#)
            .unwrap_err()
            .contains("KV connector"));
        assert!(transfer_params_in(b"not json").is_err());
    }

    #[test]
    fn a_room_picks_the_rank_sglang_will_send_the_prefill_to() {
        for random in [0, 1, 12345, u64::MAX, u64::MAX - 7] {
            assert!(room_for_rank(random, 1, None) < 1 << 63);
            for (dp, rank) in [(2, 1), (4, 3), (8, 0), (3, 2)] {
                let room = room_for_rank(random, dp, Some(rank));
                assert_eq!(
                    room % u64::from(dp),
                    u64::from(rank),
                    "{random} {dp} {rank}"
                );
                assert!(room < 1 << 63);
            }
        }
        // No rank, or one out of range: the random room as it is.
        assert_eq!(room_for_rank(10, 4, None), 5);
        assert_eq!(room_for_rank(10, 4, Some(9)), 5);
    }

    #[test]
    fn the_sglang_legs_carry_the_bootstrap_address_and_room() {
        let body = br#"{"model":"m","prompt":"x","stream":true}"#;
        let v = fields(&sglang_body(body, "10.0.0.7", 8998, 42).unwrap());
        assert_eq!(v["bootstrap_host"], "10.0.0.7");
        assert_eq!(v["bootstrap_port"], 8998);
        assert_eq!(v["bootstrap_room"], 42);
        assert_eq!(v["stream"], true);
        let v = fields(&sglang_body(body, "[::1]", 1, 2).unwrap());
        assert_eq!(v["bootstrap_host"], "::1");
    }
}
