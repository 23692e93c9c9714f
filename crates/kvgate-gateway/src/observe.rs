//! The proxied response body: the worker's bytes, passed on frame by frame unchanged,
//! observed only to drive the request's ledger booking.
//!
//! Owns the request's lifecycle after routing: its [`Lease`] (booking, worker slot,
//! admission), the progress it reports to the booking, and the end-of-request
//! accounting. For SSE it watches `data:` lines: the first one marks prefill done (its
//! TTFT receipt, predicted against observed, goes to `kvgate_ttft_prediction_error`, and
//! to the log at debug under `kvgate::ttft` with the situation it was predicted from),
//! later ones count output tokens (or the `usage` object's `completion_tokens` when
//! present), `[DONE]`/end/error/drop free everything.
//! For JSON it keeps the body (bounded) to read the final `usage` object once. A client
//! disconnect drops this body, which drops the upstream body (aborting the engine's
//! request) and the guard. When the response cannot finish (the worker's stream broke,
//! the total timeout passed, or health checks declared the worker dead), a streaming
//! client gets an OpenAI-style error event (`data: {"error":{...}}`) as its last event
//! and a clean end of stream, never a silently cut stream. Must not modify, delay or
//! buffer the bytes it passes on.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use kvgate_core::{BookingGuard, PROGRESS_EVERY};
use memchr::memmem;
use serde::Deserialize;
use tokio::time::Sleep;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::lease::Lease;
use crate::metrics::ResponseEnd;
use crate::proxy::UpstreamBody;

/// Longest SSE line kept across frame boundaries.
const MAX_LINE: usize = 1 << 20;
/// Largest JSON body kept to read its `usage`.
const MAX_JSON: usize = 8 << 20;

/// OpenAI `usage`, the parts kvgate reads.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    #[serde(default)]
    pub completion_tokens: Option<u64>,
    #[serde(default)]
    pub prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
pub struct PromptDetails {
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct UsageChunk {
    #[serde(default)]
    usage: Option<Usage>,
}

/// Everything a routed request holds until it ends: its lease (admission and the
/// worker's booking), freed at the response's end.
pub struct Lifecycle {
    pub(crate) lease: Option<Lease>,
    pub(crate) gw: Arc<Gateway>,
    pub(crate) predicted_cached: u32,
}

impl Lifecycle {
    /// A request holding `lease`, whose engine is predicted to serve
    /// `predicted_cached` prompt tokens from its cache.
    pub fn new(lease: Lease, gw: Arc<Gateway>, predicted_cached: u32) -> Self {
        Self {
            lease: Some(lease),
            gw,
            predicted_cached,
        }
    }

    fn booking(&self) -> Option<&BookingGuard> {
        self.lease.as_ref().and_then(Lease::booking)
    }

    fn model_name(&self) -> &str {
        self.lease.as_ref().map_or("", |l| &*l.model().name)
    }
}

/// A routed request's response watched as it passes: the first token marks prefill
/// done, output progress and the final `usage` go to the booking, and [`finish`] ends
/// the lease (dropped unfinished, it counts as the client leaving). The HTTP path's
/// [`ObservedBody`] feeds it the frames it proxies; a front door whose gateway proxies
/// (the Endpoint Picker, crate kvgate-epp) feeds it the chunks the gateway shows it.
///
/// [`finish`]: ResponseWatch::finish
pub struct ResponseWatch {
    life: Lifecycle,
    sse: bool,
    first_seen: bool,
    events: u32,
    reported: u32,
    buf: Vec<u8>,
    overflow: bool,
    usage: Option<Usage>,
    finished: bool,
}

/// The body handed to the client.
pub struct ObservedBody {
    inner: UpstreamBody,
    obs: ResponseWatch,
    deadline: Option<Pin<Box<Sleep>>>,
    cut_off: Pin<Box<WaitForCancellationFutureOwned>>,
}

impl ObservedBody {
    /// Wraps `inner`. `sse` selects event-stream observation; `deadline` is the total
    /// request timeout; `cut_off` ends the response when the worker is declared dead or
    /// the gateway's shutdown grace period ends.
    pub fn new(
        inner: UpstreamBody,
        life: Lifecycle,
        sse: bool,
        deadline: Option<Pin<Box<Sleep>>>,
        cut_off: CancellationToken,
    ) -> Self {
        Self {
            inner,
            obs: ResponseWatch::new(life, sse),
            deadline,
            cut_off: Box::pin(cut_off.cancelled_owned()),
        }
    }

    /// Ends the response early: a streaming client gets the error as its last event
    /// and a clean end of stream; any other client gets a broken body (its head, with
    /// a 2xx status, is already sent).
    fn fail(
        &mut self,
        outcome: ResponseEnd,
        err: ApiError,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::BoxError>>> {
        tracing::warn!(model = self.obs.life.model_name(), worker = self.obs.worker_url(), outcome = outcome.as_str(), error = %err.message, "response ended early");
        self.obs.finish(outcome);
        if self.obs.sse {
            Poll::Ready(Some(Ok(Frame::data(err.sse_event()))))
        } else {
            Poll::Ready(Some(Err(err.message.into())))
        }
    }
}

impl Body for ObservedBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if this.obs.finished {
            return Poll::Ready(None);
        }
        if let Some(d) = &mut this.deadline {
            if d.as_mut().poll(cx).is_ready() {
                return this.fail(ResponseEnd::Timeout, ApiError::upstream_total_timeout());
            }
        }
        if this.cut_off.as_mut().poll(cx).is_ready() {
            // Cut off because the shutdown grace period ended, or the worker died.
            if this.obs.life.gw.grace_over.is_cancelled() {
                return this.fail(ResponseEnd::Shutdown, ApiError::gateway_shutting_down());
            }
            let err = ApiError::worker_gone(this.obs.worker_url());
            return this.fail(ResponseEnd::WorkerDown, err);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                this.obs.finish(ResponseEnd::Complete);
                Poll::Ready(None)
            }
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    this.obs.observe(data);
                }
                if this.inner.is_end_stream() {
                    this.obs.finish(ResponseEnd::Complete);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.fail(ResponseEnd::UpstreamError, ApiError::upstream_broken(e))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.obs.finished || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        if !self.obs.finished {
            let outcome = if self.inner.is_end_stream() {
                ResponseEnd::Complete
            } else {
                ResponseEnd::ClientDisconnect
            };
            self.obs.finish(outcome);
        }
    }
}

impl ResponseWatch {
    /// Watches the response of the request `life` holds; `sse`: an event stream.
    pub fn new(life: Lifecycle, sse: bool) -> Self {
        Self {
            life,
            sse,
            first_seen: false,
            events: 0,
            reported: 0,
            buf: Vec::new(),
            overflow: false,
            usage: None,
            finished: false,
        }
    }

    /// Whether the response is an event stream (known only from its head, which a
    /// front door that picks sees after the choice).
    pub fn set_event_stream(&mut self, sse: bool) {
        self.sse = sse;
    }

    /// The lease the request holds (`None` once finished).
    pub fn lease(&self) -> Option<&Lease> {
        self.life.lease.as_ref()
    }

    /// Hands the request's hold to `lease` (the worker that serves it is not the one
    /// chosen); the old lease ends.
    pub fn replace_lease(&mut self, lease: Lease, predicted_cached: u32) {
        self.life.lease = Some(lease);
        self.life.predicted_cached = predicted_cached;
    }

    fn worker_url(&self) -> &str {
        self.life.lease.as_ref().map_or("", |l| &*l.worker().url)
    }

    /// One chunk of the response body, as it passes: the worker answered (the stall
    /// watcher reads that), and the booking hears of its first token and progress.
    pub fn observe(&mut self, data: &[u8]) {
        if let Some(lease) = &self.life.lease {
            lease.worker().progress.touch();
        }
        if !self.sse {
            if !self.first_seen {
                self.first_token();
            }
            if !self.overflow {
                if self.buf.len() + data.len() > MAX_JSON {
                    self.overflow = true;
                    self.buf = Vec::new();
                } else {
                    self.buf.extend_from_slice(data);
                }
            }
            return;
        }
        let mut data = data;
        if !self.buf.is_empty() || self.overflow {
            match memchr::memchr(b'\n', data) {
                None => {
                    self.stash(data);
                    return;
                }
                Some(i) => {
                    self.stash(&data[..i]);
                    let line = std::mem::take(&mut self.buf);
                    if !self.overflow {
                        self.on_line(&line);
                    }
                    self.overflow = false;
                    self.buf = line;
                    self.buf.clear();
                    data = &data[i + 1..];
                }
            }
        }
        while let Some(i) = memchr::memchr(b'\n', data) {
            self.on_line(&data[..i]);
            data = &data[i + 1..];
        }
        if !data.is_empty() {
            self.stash(data);
        }
    }

    fn stash(&mut self, part: &[u8]) {
        if self.overflow {
            return;
        }
        if self.buf.len() + part.len() > MAX_LINE {
            self.overflow = true;
            self.buf.clear();
        } else {
            self.buf.extend_from_slice(part);
        }
    }

    fn first_token(&mut self) {
        self.first_seen = true;
        let Some(receipt) = self
            .life
            .booking()
            .and_then(|g| g.prefill_done(Instant::now()))
        else {
            return;
        };
        let f = receipt.features;
        tracing::debug!(
            target: "kvgate::ttft",
            worker = self.worker_url(),
            predicted_secs = receipt.predicted_secs,
            observed_secs = receipt.observed_secs,
            prefill_steps = f.prefill_steps(),
            prefill_tokens = f.prefill_tokens(),
            slot_steps = f.slot_steps(),
            kv_block_steps = f.kv_block_steps(),
            "ttft receipt"
        );
        if receipt.observed_secs > 0.0 {
            let error =
                (receipt.predicted_secs - receipt.observed_secs).abs() / receipt.observed_secs;
            self.life
                .gw
                .metrics
                .ttft_prediction_error
                .with_label_values(&[self.life.model_name()])
                .observe(error);
        }
    }

    fn on_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(payload) = line.strip_prefix(b"data:") else {
            return;
        };
        let payload = payload.strip_prefix(b" ").unwrap_or(payload);
        if payload == b"[DONE]" {
            return;
        }
        if !self.first_seen {
            self.first_token();
        }
        self.events += 1;
        if memmem::find(payload, b"\"usage\"").is_some() {
            if let Ok(UsageChunk { usage: Some(u) }) = serde_json::from_slice::<UsageChunk>(payload)
            {
                self.usage = Some(u);
                if let (Some(n), Some(g)) = (u.completion_tokens, self.life.booking()) {
                    g.progress(n.min(u64::from(u32::MAX)) as u32, Instant::now());
                    self.reported = self.events;
                }
                return;
            }
        }
        if self.events - self.reported >= PROGRESS_EVERY {
            self.reported = self.events;
            if let Some(g) = self.life.booking() {
                g.progress(self.events, Instant::now());
            }
        }
    }

    /// The response ended (`outcome` says how): counts it, reads the final `usage`,
    /// and ends the lease. Later calls do nothing.
    pub fn finish(&mut self, outcome: ResponseEnd) {
        if self.finished {
            return;
        }
        self.finished = true;
        if !self.sse && outcome == ResponseEnd::Complete && !self.overflow {
            self.usage = usage_of_json(&self.buf);
        }
        self.buf = Vec::new();
        let life = &self.life;
        let model = life.model_name();
        let m = &life.gw.metrics;
        m.stream_ends
            .with_label_values(&[model, outcome.as_str()])
            .inc();
        if let Some(u) = self.usage {
            if let Some(p) = u.prompt_tokens {
                m.reported_prompt_tokens
                    .with_label_values(&[model])
                    .inc_by(p);
            }
            if let Some(cached) = u.prompt_tokens_details.and_then(|d| d.cached_tokens) {
                if let Some(g) = life.booking() {
                    g.engine_reported_cached(cached.min(u64::from(u32::MAX)) as u32);
                }
                let predicted = u64::from(life.predicted_cached);
                m.predicted_cached_tokens
                    .with_label_values(&[model])
                    .inc_by(predicted);
                m.reported_cached_tokens
                    .with_label_values(&[model])
                    .inc_by(cached);
                m.cached_tokens_error
                    .with_label_values(&[model])
                    .observe(cached as f64 - predicted as f64);
                tracing::debug!(
                    target: "kvgate::decision",
                    model,
                    predicted_cached_tokens = predicted,
                    reported_cached_tokens = cached,
                    "engine usage"
                );
            }
        }
        // End the lease now (booking, worker slot, admission), not whenever the body
        // is dropped.
        self.life.lease = None;
    }
}

impl Drop for ResponseWatch {
    fn drop(&mut self) {
        // Dropped unfinished: the response was cut (its stream broke, the client left).
        self.finish(ResponseEnd::ClientDisconnect);
    }
}

/// Reads the top-level `usage` object of a complete JSON response (searching from the
/// end, where OpenAI servers put it), parsing only that object.
pub fn usage_of_json(body: &[u8]) -> Option<Usage> {
    let pos = memmem::rfind(body, b"\"usage\"")?;
    let rest = &body[pos + b"\"usage\"".len()..];
    let rest = rest.trim_ascii_start().strip_prefix(b":")?;
    let mut it = serde_json::Deserializer::from_slice(rest).into_iter::<Option<Usage>>();
    it.next()?.ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_from_json_body() {
        let body = br#"{"id":"x","choices":[{"text":"the \"usage\" word"}],"usage":{"prompt_tokens":40,"total_tokens":45,"completion_tokens":5,"prompt_tokens_details":{"cached_tokens":32}},"kv_transfer_params":null}"#;
        let u = usage_of_json(body).unwrap();
        assert_eq!(u.prompt_tokens, Some(40));
        assert_eq!(u.completion_tokens, Some(5));
        assert_eq!(u.prompt_tokens_details.unwrap().cached_tokens, Some(32));
        assert_eq!(usage_of_json(br#"{"usage":null}"#), None);
        assert_eq!(usage_of_json(b"not json"), None);
    }
}
