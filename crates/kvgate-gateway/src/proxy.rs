//! Upstream HTTP: the pooled client, forwarding one request to one worker, and
//! turning the worker's response head into the client's.
//!
//! Owns header hygiene (hop-by-hop headers, `Host`, the gateway's own credentials,
//! `Accept-Encoding` so the stream stays observable), the connect/first-byte timeouts,
//! and where an answer begins: its head, or for an event stream its first event
//! ([`UpstreamBody`]). The body is passed on untouched by `observe.rs`. Must not retry
//! (failover.rs) or choose workers (select.rs).

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::body::read_bounded;
use crate::config::TimeoutsConfig;
use crate::registry::{Endpoint, Worker};

/// The shared upstream client (HTTP/1.1, keep-alive pool).
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Header naming the worker that served a response.
pub const WORKER_HEADER: HeaderName = HeaderName::from_static("x-kvgate-worker");
/// Response header: the request's time to first token predicted when it was booked, in
/// milliseconds (its receipt: compare with the TTFT the client saw).
pub const PREDICTED_TTFT_HEADER: HeaderName = HeaderName::from_static("x-kvgate-predicted-ttft-ms");

pub fn build_client(t: &TimeoutsConfig) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(t.connect());
    conn.enforce_http(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(4096)
        .build(conn)
}

/// Why a request did not get a response head from its worker.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be made: nothing listens, or the host is unreachable.
    Connect(String),
    /// The connection broke (reset, closed) before a response head: the engine died,
    /// or it (or a proxy in front of it) refused this request's body and hung up.
    Transport(String),
    /// An event stream broke after its head, before its first event: the engine took
    /// the request and failed before its first token.
    BrokeBeforeFirstEvent(String),
    /// No answer (a response head, and for a stream its first event) within the
    /// first-byte timeout.
    Timeout,
    /// Health checks declared the worker dead while the request waited on it.
    WorkerDown,
}

impl SendError {
    /// Its `kvgate_retries_total` label (one of [`crate::metrics::RETRY_REASONS`]).
    pub fn reason(&self) -> &'static str {
        match self {
            SendError::Connect(_) => "connect",
            SendError::Transport(_) | SendError::BrokeBeforeFirstEvent(_) => "transport",
            SendError::Timeout => "first_byte_timeout",
            SendError::WorkerDown => "worker_down",
        }
    }
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(e) => write!(f, "cannot connect to the worker: {e}"),
            SendError::Transport(e) => write!(f, "upstream transport error: {e}"),
            SendError::BrokeBeforeFirstEvent(e) => {
                write!(f, "the worker's stream broke before its first event: {e}")
            }
            SendError::Timeout => f.write_str("upstream first-byte timeout"),
            SendError::WorkerDown => {
                f.write_str("the worker was taken out of rotation (its engine died or stalled) before it answered")
            }
        }
    }
}

/// What the gateway adds to or strips from forwarded requests.
#[derive(Clone, Debug, Default)]
pub struct ForwardAuth {
    /// Strip the client's `Authorization` (it carried the gateway's own key).
    pub strip_client_auth: bool,
    /// `Authorization` to send to workers.
    pub worker_auth: Option<HeaderValue>,
}

/// How requests go upstream: the pooled client, the credentials rule, and how long
/// to wait for a response head. Built by the gateway ([`crate::Gateway::upstream`]).
#[derive(Clone, Copy)]
pub struct Upstream<'a> {
    pub client: &'a HttpClient,
    pub auth: &'a ForwardAuth,
    pub first_byte_timeout: Option<Duration>,
}

impl Upstream<'_> {
    /// POSTs `body` to `endpoint` of `worker` with the client's headers (cleaned),
    /// returning the start of the answer: the response head, and for a successful
    /// event stream its first event too, all within the first-byte timeout. An engine
    /// behind an API server that sends a stream's head at once (vLLM does) has not
    /// answered until its first event, so until then the request may still go to
    /// another worker.
    pub async fn send(
        &self,
        worker: &Worker,
        endpoint: Endpoint,
        client_headers: &HeaderMap,
        body: Bytes,
    ) -> Result<Response<UpstreamBody>, SendError> {
        let mut req = Request::new(Full::new(body));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = worker.uri(endpoint);
        copy_request_headers(client_headers, req.headers_mut(), self.auth);
        let answer = async {
            let resp = match self.client.request(req).await {
                Err(e) if e.is_connect() => return Err(SendError::Connect(error_chain(&e))),
                Err(e) => return Err(SendError::Transport(error_chain(&e))),
                Ok(resp) => resp,
            };
            let (parts, mut rest) = resp.into_parts();
            let first = if parts.status.is_success() && is_event_stream(&parts.headers) {
                match rest.frame().await {
                    Some(Ok(frame)) => Some(Box::new(frame)),
                    Some(Err(e)) => return Err(SendError::BrokeBeforeFirstEvent(error_chain(&e))),
                    // An empty stream: the client gets it as it is.
                    None => None,
                }
            } else {
                None
            };
            Ok(Response::from_parts(parts, UpstreamBody { first, rest }))
        };
        match self.first_byte_timeout {
            Some(d) => tokio::time::timeout(d, answer)
                .await
                .unwrap_or(Err(SendError::Timeout)),
            None => answer.await,
        }
    }
}

/// Whether a response is a server-sent event stream.
pub fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"))
}

/// A worker's response body: the frame [`Upstream::send`] already read (a stream's
/// first event), then the rest as it arrives.
pub struct UpstreamBody {
    /// Boxed: the response travels through the attempt loop's futures by value.
    first: Option<Box<Frame<Bytes>>>,
    rest: Incoming,
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        if let Some(first) = this.first.take() {
            return Poll::Ready(Some(Ok(*first)));
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.first.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let first = self
            .first
            .as_deref()
            .and_then(Frame::data_ref)
            .map_or(0, |d| d.len() as u64);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + first);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + first);
        }
        hint
    }
}

/// GETs `endpoint` of `worker` (health checks), returning the status; the body is
/// read (so the connection returns to the pool) and dropped, whatever it holds.
pub async fn get_status(
    client: &HttpClient,
    worker: &Worker,
    endpoint: Endpoint,
    timeout: Duration,
) -> Result<http::StatusCode, SendError> {
    get_body(client, worker, endpoint, timeout, usize::MAX)
        .await
        .map(|(status, _)| status)
}

/// `GET` of an endpoint within `timeout`: its status, and its body or why it could not
/// be read (a body past `max_bytes`, a connection cut mid-body).
pub async fn get_body(
    client: &HttpClient,
    worker: &Worker,
    endpoint: Endpoint,
    timeout: Duration,
    max_bytes: usize,
) -> Result<(http::StatusCode, Result<Bytes, String>), SendError> {
    let mut req = Request::new(Full::new(Bytes::new()));
    *req.uri_mut() = worker.uri(endpoint);
    let fut = async {
        let resp = client.request(req).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        let bytes = read_bounded(&mut body, max_bytes, None)
            .await
            .map_err(|e| e.to_string());
        Ok::<_, hyper_util::client::legacy::Error>((status, bytes))
    };
    match tokio::time::timeout(timeout, fut).await {
        Err(_) => Err(SendError::Timeout),
        Ok(Err(e)) => Err(SendError::Transport(error_chain(&e))),
        Ok(Ok(r)) => Ok(r),
    }
}

/// Whether a Content-Type names JSON: `application/json` or `*+json`, any case, with
/// any parameters (client bodies at the front door, engines' error pages).
pub fn is_json_media_type(value: &HeaderValue) -> bool {
    value
        .to_str()
        .ok()
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .is_some_and(|m| m == "application/json" || m.ends_with("+json"))
}

/// Whether a message's body is JSON, by its Content-Type.
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .is_some_and(is_json_media_type)
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn is_hop_by_hop(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TRANSFER_ENCODING
        || name == header::TE
        || name == header::TRAILER
        || name == header::UPGRADE
        || name == header::PROXY_AUTHORIZATION
        || name.as_str() == "keep-alive"
        || name.as_str() == "proxy-connection"
}

/// Copies client headers to the upstream request.
pub fn copy_request_headers(from: &HeaderMap, to: &mut HeaderMap, auth: &ForwardAuth) {
    to.reserve(from.len() + 1);
    for (name, value) in from {
        if is_hop_by_hop(name)
            || name == header::HOST
            || name == header::CONTENT_LENGTH
            || name == header::ACCEPT_ENCODING
            || (name == header::AUTHORIZATION
                && (auth.strip_client_auth || auth.worker_auth.is_some()))
        {
            continue;
        }
        to.append(name.clone(), value.clone());
    }
    if let Some(v) = &auth.worker_auth {
        to.insert(header::AUTHORIZATION, v.clone());
    }
}

/// Removes hop-by-hop headers from an upstream response and names the worker.
pub fn prepare_response_headers(headers: &mut HeaderMap, worker: &Worker) {
    let drop: smallvec::SmallVec<[HeaderName; 4]> = headers
        .keys()
        .filter(|n| is_hop_by_hop(n))
        .cloned()
        .collect();
    for n in drop {
        headers.remove(n);
    }
    headers.insert(WORKER_HEADER, worker.header_value.clone());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The retry metric is zero-initialised from REASONS: it must hold every reason.
    #[test]
    fn every_send_error_reason_is_listed() {
        for e in [
            SendError::Connect(String::new()),
            SendError::Transport(String::new()),
            SendError::Timeout,
            SendError::WorkerDown,
        ] {
            assert!(
                crate::metrics::RETRY_REASONS.contains(&e.reason()),
                "{}",
                e.reason()
            );
        }
    }

    #[test]
    fn request_headers_are_cleaned() {
        let mut from = HeaderMap::new();
        from.insert(header::HOST, HeaderValue::from_static("gw"));
        from.insert(header::CONNECTION, HeaderValue::from_static("keep-alive"));
        from.insert(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
        from.insert(header::ACCEPT_ENCODING, HeaderValue::from_static("gzip"));
        from.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer client"),
        );
        from.insert("x-request-id", HeaderValue::from_static("abc"));
        let mut to = HeaderMap::new();
        copy_request_headers(&from, &mut to, &ForwardAuth::default());
        assert_eq!(to.len(), 2);
        assert_eq!(to["x-request-id"], "abc");
        assert_eq!(to[header::AUTHORIZATION], "Bearer client");
        let mut to = HeaderMap::new();
        let auth = ForwardAuth {
            strip_client_auth: true,
            worker_auth: Some(HeaderValue::from_static("Bearer engine")),
        };
        copy_request_headers(&from, &mut to, &auth);
        assert_eq!(to[header::AUTHORIZATION], "Bearer engine");
    }
}
