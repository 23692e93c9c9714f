//! One ext_proc stream: one HTTP request that the gateway in front proxies, from its
//! headers to its response's end.
//!
//! The request: admission on its head (kvgate-gateway's `front_door::admit_head`, the
//! one place that admits), its body buffered to its end (or its trailers), then the pick
//! (kvgate-gateway's `picking::pick_endpoint`: prepare, policy, lease) answered as the
//! protocol asks and the body sent back. The response: its head says which endpoint
//! served (the booking moves if it is not the one picked) and whether it streams; every
//! chunk is echoed back at once and shown to the response's watch (first token,
//! progress, usage); its end, or the stream breaking, ends the booking.
//!
//! Owns the order of the protocol's messages for one request. Must not choose,
//! tokenize or book itself (kvgate-gateway does), nor build messages (wire.rs).

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request::Request as Msg, ProcessingRequest, ProcessingResponse,
};
use futures::{Stream, StreamExt};
use kvgate_gateway::errors::ApiError;
use kvgate_gateway::front_door::{admit_head, check_body, HeadRefused};
use kvgate_gateway::limits::Admission;
use kvgate_gateway::metrics::{RequestRecord, ResponseEnd};
use kvgate_gateway::picking::{pick_endpoint, EndpointPick, PickRequest};
use kvgate_gateway::proxy::is_event_stream;
use kvgate_gateway::Gateway;
use tonic::{Status, Streaming};

use crate::metrics::EppMetrics;
use crate::wire::{self, Half, Head, PickMessage};

/// How the picker answers; the same for every stream.
#[derive(Clone, Debug, Default)]
pub struct PickerOptions {
    /// Ranked fallback endpoints added after the pick (0: the pick alone).
    pub fallbacks: usize,
    /// The conformance suite's hooks: `test-epp-endpoint-selection` names the endpoints
    /// to pick from, and the pick is echoed in `x-echo-set-header`.
    pub conformance_hooks: bool,
}

/// Where the stream is.
enum Phase {
    /// Waiting for the request's headers.
    Start,
    /// Headers read, admitted; the body is being buffered.
    Body(Box<Pending>),
    /// Picked: waiting for the response (the hold, if any, is in `pick`).
    Picked,
}

/// A request admitted and not yet picked.
struct Pending {
    head: Head,
    allowed: Option<Vec<String>>,
    admission: Arc<Admission>,
    body: BytesMut,
}

/// One request's stream.
pub struct RequestStream {
    gw: Arc<Gateway>,
    opts: PickerOptions,
    metrics: Arc<EppMetrics>,
    /// The answers to the message being handled, sent once it is.
    outbox: Vec<ProcessingResponse>,
    /// The request's line in `kvgate_requests_total` (chat and completions only, as
    /// `kvgate serve` counts).
    record: Option<RequestRecord>,
    phase: Phase,
    /// The request body's mode, from the first message (`None`: not told; then the
    /// headers are answered at once and the pick rides on the body's answer).
    request_mode: Option<BodySendMode>,
    response_duplex: bool,
    /// The request headers were answered before the pick (buffered mode).
    headers_answered: bool,
    pick: Option<EndpointPick>,
}

/// How a request's reading ended before its pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ended {
    /// With its head (no body, or one the gateway does not send).
    WithHead,
    /// With its body's last chunk.
    WithBody,
    /// With its trailers (the body's last chunk did not say it was the last).
    ByTrailers,
}

impl RequestStream {
    pub fn new(gw: Arc<Gateway>, opts: PickerOptions, metrics: Arc<EppMetrics>) -> Self {
        metrics.streams_open.inc();
        Self {
            gw,
            opts,
            metrics,
            outbox: Vec::new(),
            record: None,
            phase: Phase::Start,
            request_mode: None,
            response_duplex: false,
            headers_answered: false,
            pick: None,
        }
    }

    /// The stream's answers: every message of `inbound` handled in order, on the task
    /// that polls the answers (no task or channel between: each hop between threads
    /// costs a wake-up, and a request's messages are a few round trips). When the
    /// gateway ends the stream, or it breaks, `self` is dropped, and with it whatever
    /// the request still holds: an unfinished response's booking ends as the client
    /// leaving.
    pub fn answers(
        self,
        inbound: Streaming<ProcessingRequest>,
    ) -> impl Stream<Item = Result<ProcessingResponse, Status>> + Send {
        futures::stream::unfold((self, inbound), |(mut this, mut inbound)| async move {
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => return None,
                    Err(status) => {
                        tracing::debug!(%status, "ext_proc stream broke");
                        return None;
                    }
                };
                this.handle(msg).await;
                if !this.outbox.is_empty() {
                    let answers = std::mem::take(&mut this.outbox);
                    return Some((answers, (this, inbound)));
                }
            }
        })
        .flat_map(|answers| futures::stream::iter(answers.into_iter().map(Ok)))
    }

    fn send(&mut self, msg: ProcessingResponse) {
        self.outbox.push(msg);
    }

    /// Answers the client with `err` (an immediate response) and ends the request.
    fn refuse(&mut self, err: ApiError) {
        self.metrics
            .immediate
            .with_label_values(&[err.status.as_str()])
            .inc();
        if let Some(record) = &self.record {
            record.answered(err.status, None);
        }
        self.phase = Phase::Picked;
        self.pick = None;
        self.send(wire::immediate(&err))
    }

    async fn handle(&mut self, msg: ProcessingRequest) {
        if let Some(pc) = &msg.protocol_config {
            self.request_mode = BodySendMode::try_from(pc.request_body_mode).ok();
            self.response_duplex = BodySendMode::try_from(pc.response_body_mode)
                .is_ok_and(|m| m == BodySendMode::FullDuplexStreamed);
        }
        let Some(request) = msg.request else {
            return;
        };
        match request {
            Msg::RequestHeaders(h) => {
                let head = wire::read_head(h.headers.as_ref());
                let mut allowed = wire::subset_hint(msg.metadata_context.as_ref());
                if self.opts.conformance_hooks {
                    if let Some(v) = head.headers.get(wire::CONFORMANCE_SELECTION_HEADER) {
                        let named = v.to_str().unwrap_or_default();
                        allowed = Some(named.split(',').map(|s| s.trim().to_owned()).collect());
                    }
                }
                self.on_request_headers(head, allowed, h.end_of_stream)
                    .await
            }
            Msg::RequestBody(b) => self.on_request_body(b.body.into(), b.end_of_stream).await,
            Msg::RequestTrailers(_) => {
                if matches!(self.phase, Phase::Body(_)) {
                    self.pick_and_answer(Ended::ByTrailers).await;
                }
                self.send(wire::continue_trailers(Half::Request))
            }
            Msg::ResponseHeaders(h) => {
                let attributes = [&msg.attributes, &h.attributes];
                let served = wire::served_endpoint(msg.metadata_context.as_ref(), &attributes);
                let head = wire::read_head(h.headers.as_ref());
                self.on_response_headers(&head, served);
                if h.end_of_stream {
                    self.finish(ResponseEnd::Complete);
                }
                let answer = match &self.pick {
                    Some(pick) => wire::response_headers_naming(&pick.endpoint),
                    None => wire::continue_headers(Half::Response),
                };
                self.send(answer)
            }
            Msg::ResponseBody(b) => {
                if let Some(watch) = self.pick.as_mut().and_then(|p| p.watch.as_mut()) {
                    watch.observe(&b.body);
                }
                if b.end_of_stream {
                    self.finish(ResponseEnd::Complete);
                }
                if self.response_duplex {
                    self.send(wire::response_chunk(b.body, b.end_of_stream))
                } else {
                    self.send(wire::continue_body(Half::Response))
                }
            }
            Msg::ResponseTrailers(_) => {
                self.finish(ResponseEnd::Complete);
                self.send(wire::continue_trailers(Half::Response))
            }
        }
    }

    async fn on_request_headers(
        &mut self,
        head: Head,
        allowed: Option<Vec<String>>,
        end_of_stream: bool,
    ) {
        if !matches!(self.phase, Phase::Start) {
            return self.refuse(ApiError::bad_request(
                "invalid_stream",
                "a second request head on one ext_proc stream",
            ));
        }
        if kvgate_gateway::picking::routed_kind(&head.path).is_some() {
            self.record = Some(RequestRecord::new(&self.gw.metrics));
        }
        if allowed.as_ref().is_some_and(Vec::is_empty) {
            return self.refuse(no_endpoint_allowed());
        }
        let admission = match admit_head(&self.gw, &head.headers).await {
            Ok(a) => a,
            Err(HeadRefused::Head(e) | HeadRefused::Admission(e)) => return self.refuse(e),
        };
        self.phase = Phase::Body(Box::new(Pending {
            head,
            allowed,
            admission,
            body: BytesMut::new(),
        }));
        let duplex = self.request_mode == Some(BodySendMode::FullDuplexStreamed);
        let buffered = matches!(
            self.request_mode,
            None | Some(BodySendMode::Buffered | BodySendMode::BufferedPartial)
        );
        if end_of_stream || !(duplex || buffered) {
            // No body to wait for (none, or the gateway does not send it).
            return self.pick_and_answer(Ended::WithHead).await;
        }
        if duplex {
            // The headers' answer carries the pick, once the body is read.
            return;
        }
        // Buffered: the gateway waits for this answer before it sends the body; the
        // pick rides on the body's answer.
        self.headers_answered = true;
        self.send(wire::continue_headers(Half::Request))
    }

    async fn on_request_body(&mut self, chunk: Bytes, end_of_stream: bool) {
        let max = self.gw.config.limits.max_body_bytes;
        let Phase::Body(pending) = &mut self.phase else {
            // Picked on the head alone: a streamed body's chunks pass unchanged (after
            // an immediate response, or with no head, nothing is sent).
            if self.pick.is_some() && self.request_mode == Some(BodySendMode::Streamed) {
                return self.send(wire::continue_body(Half::Request));
            }
            return;
        };
        if pending.body.len() + chunk.len() > max {
            return self.refuse(ApiError::body_too_large(max));
        }
        pending.body.extend_from_slice(&chunk);
        if end_of_stream {
            self.pick_and_answer(Ended::WithBody).await;
        }
    }

    /// The request is read as far as the pick needs (`ended` says how it ended): pick,
    /// and answer as the request's mode wants.
    async fn pick_and_answer(&mut self, ended: Ended) {
        let Phase::Body(pending) = std::mem::replace(&mut self.phase, Phase::Picked) else {
            return;
        };
        let Pending {
            head,
            allowed,
            admission,
            body,
        } = *pending;
        let body = body.freeze();
        let routed = kvgate_gateway::picking::routed_kind(&head.path).is_some();
        if routed {
            if let Err(e) = check_body(&self.gw, &body) {
                return self.refuse(e);
            }
        }
        let remove: Vec<String> = head
            .headers
            .keys()
            .map(http::HeaderName::as_str)
            .filter(|k| k.starts_with(wire::DESTINATION_KEY))
            .map(str::to_owned)
            .collect();
        let req = PickRequest {
            path: head.path,
            headers: head.headers,
            body: body.clone(),
            admission,
            record: self.record.clone(),
            allowed,
            fallbacks: self.opts.fallbacks,
        };
        let pick = match pick_endpoint(&self.gw, req).await {
            Ok(p) => p,
            Err(e) => return self.refuse(e),
        };
        let model = pick.model.as_ref().map_or("", |m| &*m.name).to_owned();
        self.metrics
            .picks
            .with_label_values(&[&model, pick.rule])
            .inc();
        let destination = std::iter::once(&pick.endpoint)
            .chain(&pick.fallbacks)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(",");
        let message = PickMessage {
            destination: &destination,
            rank: pick.rank,
            remove,
            conformance_echo: self.opts.conformance_hooks,
        };
        self.pick = Some(pick);
        match self.request_mode {
            Some(BodySendMode::FullDuplexStreamed) if ended != Ended::WithHead => {
                self.send(message.headers_response());
                let end_of_stream = ended == Ended::WithBody;
                for chunk in wire::request_body_chunks(&body, end_of_stream) {
                    self.send(chunk);
                }
            }
            // Buffered: the headers were answered; the pick rides on the body's answer.
            _ if self.headers_answered => self.send(message.body_response()),
            // Picked on the head: its answer carries the pick.
            _ => self.send(message.headers_response()),
        }
    }

    fn on_response_headers(&mut self, head: &Head, served: Option<String>) {
        let Some(pick) = &mut self.pick else {
            return;
        };
        if let Some(served) = served {
            if pick.served_by(&served) {
                let model = pick.model.as_ref().map_or("", |m| &*m.name);
                self.metrics
                    .served_elsewhere
                    .with_label_values(&[model])
                    .inc();
                tracing::info!(model, served, "the gateway sent the request to another endpoint than the one picked; its booking moved there");
            }
        }
        if let Some(watch) = &mut pick.watch {
            watch.set_event_stream(is_event_stream(&head.headers));
            // The worker answered (the stall watcher reads this, as it does a proxied
            // response's first byte).
            if let Some(lease) = watch.lease() {
                lease.worker().progress.touch();
            }
        }
        let status = head
            .status
            .and_then(|s| http::StatusCode::from_u16(s).ok())
            .unwrap_or(http::StatusCode::OK);
        let worker = pick
            .watch
            .as_ref()
            .and_then(|w| w.lease())
            .map(|l| l.worker().url.to_string());
        if let Some(record) = &self.record {
            record.answered(status, worker.as_deref());
        }
    }

    fn finish(&mut self, outcome: ResponseEnd) {
        if let Some(watch) = self.pick.as_mut().and_then(|p| p.watch.as_mut()) {
            watch.finish(outcome);
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.metrics.streams_open.dec();
        self.metrics.streams.inc();
    }
}

/// 503: the gateway's subset hint allows no endpoint.
fn no_endpoint_allowed() -> ApiError {
    ApiError::new(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "service_unavailable",
        "no_eligible_endpoint",
        "the gateway's subset hint allows no endpoint",
    )
}
