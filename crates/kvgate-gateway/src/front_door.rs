//! The front door: what every request passes before any per-request work
//! ([`FrontDoor`], which server.rs builds for every route of its table, so no route is
//! served without it). In order:
//!
//! 1. the count (chat and completions, [`Door::Counted`]): the request's line in
//!    `kvgate_requests_total` ([`RequestRecord`]: once, however it ends), and the end of
//!    the shutdown grace period, which answers a request still queued or tokenizing
//!    with a 503;
//! 2. the token (every route): its group's ([`Access`]): the API key, the metrics
//!    token, or the admin token (the admin API and the peer endpoints, each off with a
//!    404 unless one is configured); `Authorization: Bearer`, scheme case-insensitive;
//! 3. admission (routes that take a request body for the engines): the Content-Type
//!    (absent or JSON; anything else is 415), a declared `Content-Length` above the
//!    body limit (413 before any wait), **admission** (a gateway-wide in-flight slot,
//!    waiting in the bounded queue: 429 with `Retry-After` beyond it), then the body,
//!    read up to the limit (413 beyond it), which must be a JSON object. The handler
//!    takes it, with the request's headers, as [`Admitted`].
//!
//! Admission comes before the body is read, so `--max-in-flight` bounds the memory and
//! CPU of everything after it (body, parsing, tokenization, routing, proxying). The slot
//! travels with the request ([`Admitted::admission`], then each attempt's lease) until
//! its response ends. Owns no routing or proxying.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{header, HeaderMap};
use tower::{Layer, Service};

use crate::auth::{check_bearer, require_bearer};
use crate::body::{discard, read_bounded, BodyError};
use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::limits::Admission;
use crate::metrics::RequestRecord;
use crate::proxy::{is_json_media_type, WORKER_HEADER};

/// How long a refused request's body is read (and dropped) before the answer.
const DISCARD_BODY_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// Which token a route group asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// No token (liveness and readiness probes).
    Public,
    /// The client API key (`api_key`), when one is configured.
    ApiKey,
    /// The metrics token (`metrics_token`), when one is configured.
    MetricsToken,
    /// The admin token (`admin_token`) for the admin API, off (404) without one.
    Admin,
    /// The admin token for the peer endpoints, which other kvgate replicas call; off
    /// (404) without one (peers refuse to start without it).
    Peer,
}

/// Which front door a route passes beyond its token ([`Access`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Door {
    /// The token only.
    Token,
    /// Admission and the request body: routes whose body goes to the engines or their
    /// tokenizer. The handler takes them as [`Admitted`].
    Admitted,
    /// As `Admitted`, and counted in `kvgate_requests_total` ([`RequestRecord`]): the
    /// proxied requests.
    Counted,
}

/// The front door of one route: server.rs builds one for every route of its table.
/// A route that takes no body wears it as a tower layer (its token only); one that
/// does is served by it ([`FrontDoor::admitted`]): count, token, admission, then its
/// handler with the [`Admitted`] request, in one boxed future per request (axum's
/// `middleware::from_fn` with request extensions cost about 8 µs of CPU a request
/// more, measured with `benches/gateway_load.sh`'s setup).
#[derive(Clone)]
pub struct FrontDoor {
    gw: Arc<Gateway>,
    access: Access,
    door: Door,
}

impl FrontDoor {
    pub fn new(gw: Arc<Gateway>, access: Access, door: Door) -> Self {
        Self { gw, access, door }
    }

    /// The service of a route that takes a body: its front door, then `handler`.
    pub fn admitted<H, Fut>(self, handler: H) -> AdmittedService<H>
    where
        H: Fn(Arc<Gateway>, Admitted) -> Fut + Clone + Send + Sync + 'static,
        Fut: Future<Output = Response> + Send + 'static,
    {
        AdmittedService {
            door: self,
            handler,
        }
    }

    /// A request through its count (when the door counts), token and admission, then
    /// `handler`.
    async fn serve<H, Fut>(self, req: Request, handler: H) -> Response
    where
        H: Fn(Arc<Gateway>, Admitted) -> Fut,
        Fut: Future<Output = Response>,
    {
        if self.door != Door::Counted {
            return self.admit_then(req, None, handler).await;
        }
        let record = RequestRecord::new(&self.gw.metrics);
        let gw = self.gw.clone();
        let response = tokio::select! {
            r = self.admit_then(req, Some(record.clone()), handler) => r,
            // Still queued or tokenizing when the shutdown grace period ends.
            () = gw.grace_over.cancelled() => ApiError::gateway_shutting_down().into_response(),
        };
        let worker = response
            .headers()
            .get(WORKER_HEADER)
            .and_then(|v| v.to_str().ok());
        record.answered(response.status(), worker);
        response
    }

    async fn admit_then<H, Fut>(
        self,
        req: Request,
        record: Option<RequestRecord>,
        handler: H,
    ) -> Response
    where
        H: Fn(Arc<Gateway>, Admitted) -> Fut,
        Fut: Future<Output = Response>,
    {
        if let Err(e) = check_token(&self.gw, self.access, req.headers()) {
            return e.into_response();
        }
        let (parts, mut body) = req.into_parts();
        match admit(&self.gw, parts.headers, &mut body, record).await {
            Ok(admitted) => handler(self.gw, admitted).await,
            Err(e) => e.into_response(),
        }
    }
}

/// A route that takes a body, behind its [`FrontDoor`].
#[derive(Clone)]
pub struct AdmittedService<H> {
    door: FrontDoor,
    handler: H,
}

impl<H, Fut> Service<Request> for AdmittedService<H>
where
    H: Fn(Arc<Gateway>, Admitted) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response> + Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let (door, handler) = (self.door.clone(), self.handler.clone());
        Box::pin(async move { Ok(door.serve(req, handler).await) })
    }
}

impl<S> Layer<S> for FrontDoor {
    type Service = TokenService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TokenService {
            inner,
            door: self.clone(),
        }
    }
}

/// A route that takes no body, behind its token.
#[derive(Clone)]
pub struct TokenService<S> {
    inner: S,
    door: FrontDoor,
}

impl<S> Service<Request> for TokenService<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request) -> Self::Future {
        let door = &self.door;
        let checked = match door.door {
            Door::Token => check_token(&door.gw, door.access, req.headers()),
            // A route that takes a body is served by `FrontDoor::admitted`.
            _ => Err(ApiError::internal(
                "a route that takes a body wears its front door as a layer",
            )),
        };
        if let Err(e) = checked {
            return Box::pin(std::future::ready(Ok(e.into_response())));
        }
        // The ready service goes with this request; a clone waits for the next.
        let not_ready = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, not_ready);
        Box::pin(async move { inner.call(req).await })
    }
}

/// Refuses a request without its route group's token.
fn check_token(gw: &Gateway, access: Access, headers: &HeaderMap) -> Result<(), ApiError> {
    match access {
        Access::Public => Ok(()),
        Access::ApiKey => check_bearer(headers, gw.config.api_key.as_deref(), "API key"),
        Access::MetricsToken => {
            check_bearer(headers, gw.config.metrics_token.as_deref(), "metrics token")
        }
        Access::Admin => require_bearer(
            headers,
            gw.config.admin_token.as_deref(),
            "admin token",
            "the admin API endpoints",
        ),
        Access::Peer => require_bearer(
            headers,
            gw.config.admin_token.as_deref(),
            "admin token",
            "the peer endpoints",
        ),
    }
}

/// A request past the front door's admission: its headers, its body, its admission,
/// and (for a counted route) its record.
pub struct Admitted {
    pub headers: HeaderMap,
    /// The whole body: a JSON object (checked by its first byte; parsed later).
    pub body: Bytes,
    /// The request's admission (its gateway-wide in-flight slot), shared with the
    /// leases of its attempts.
    pub admission: Arc<Admission>,
    /// Its line in `kvgate_requests_total` (counted routes only).
    pub record: Option<RequestRecord>,
}

/// Why a request was not admitted on its head alone.
pub enum HeadRefused {
    /// Its Content-Type or declared length (before any wait).
    Head(ApiError),
    /// Admission refused it (the queue is full or its wait timed out).
    Admission(ApiError),
}

/// Admission on a request's head, before its body is read: the Content-Type, a
/// declared length over the body limit, then the gateway-wide in-flight slot. Every
/// front door admits through here (this one, and the Endpoint Picker's, whose body
/// arrives from the gateway in front; it checks the body with [`check_body`]).
pub async fn admit_head(gw: &Gateway, headers: &HeaderMap) -> Result<Arc<Admission>, HeadRefused> {
    check_json_content_type(headers).map_err(HeadRefused::Head)?;
    let max = gw.config.limits.max_body_bytes;
    if declared_length(headers).is_some_and(|len| len > max) {
        return Err(HeadRefused::Head(ApiError::body_too_large(max)));
    }
    gw.limiter
        .acquire()
        .await
        .map(Arc::new)
        .map_err(HeadRefused::Admission)
}

/// An admitted request's whole body: within the body limit, and a JSON object.
pub fn check_body(gw: &Gateway, body: &[u8]) -> Result<(), ApiError> {
    let max = gw.config.limits.max_body_bytes;
    if body.len() > max {
        return Err(ApiError::body_too_large(max));
    }
    check_json_object(body)
}

/// Checks the body's type and declared size, admits the request, reads its body.
async fn admit(
    gw: &Gateway,
    headers: HeaderMap,
    body: &mut Body,
    record: Option<RequestRecord>,
) -> Result<Admitted, ApiError> {
    let max = gw.config.limits.max_body_bytes;
    let admission = match admit_head(gw, &headers).await {
        Ok(a) => a,
        Err(HeadRefused::Head(e)) => {
            if e.status == http::StatusCode::PAYLOAD_TOO_LARGE {
                // Read (and drop) what the client is sending so it can read the 413.
                discard(body, max.saturating_mul(4), DISCARD_BODY_FOR).await;
            }
            return Err(e);
        }
        Err(HeadRefused::Admission(refused)) => {
            // A client still sending its body would see a reset, not the 429.
            discard(body, max, DISCARD_BODY_FOR).await;
            return Err(refused);
        }
    };
    let bytes = match read_bounded(body, max, None).await {
        Ok(b) => b,
        Err(BodyError::TooLarge { .. }) => {
            discard(body, max.saturating_mul(4), DISCARD_BODY_FOR).await;
            return Err(ApiError::body_too_large(max));
        }
        Err(e) => {
            return Err(ApiError::bad_request(
                "invalid_body",
                format!("cannot read the request body: {e}"),
            ))
        }
    };
    check_json_object(&bytes)?;
    Ok(Admitted {
        headers,
        body: bytes,
        admission,
        record,
    })
}

fn declared_length(headers: &HeaderMap) -> Option<usize> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
}

/// Absent (curl without `-H`) or `application/json` / `*+json`, with any parameters.
fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    match headers.get(header::CONTENT_TYPE) {
        None => Ok(()),
        Some(value) if is_json_media_type(value) => Ok(()),
        Some(value) => Err(ApiError::unsupported_media_type(&String::from_utf8_lossy(
            value.as_bytes(),
        ))),
    }
}

/// Every API body is a JSON object; say so plainly instead of a serde type error.
fn check_json_object(body: &[u8]) -> Result<(), ApiError> {
    match body.trim_ascii_start().first() {
        Some(b'{') => Ok(()),
        Some(_) => Err(ApiError::bad_request(
            "invalid_json",
            "the request body must be a JSON object ({...})",
        )),
        None => Err(ApiError::bad_request(
            "invalid_json",
            "the request body is empty; it must be a JSON object",
        )),
    }
}

/// A wrong method on a known path: a JSON 405 (axum's own answer has no body).
pub async fn method_not_allowed(req: Request) -> Response {
    ApiError::method_not_allowed(req.method(), req.uri().path()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, StatusCode};

    #[test]
    fn json_content_types() {
        let mut h = HeaderMap::new();
        assert!(check_json_content_type(&h).is_ok());
        for ok in [
            "application/json",
            "Application/JSON; charset=utf-8",
            "application/vnd.api+json",
        ] {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ok));
            assert!(check_json_content_type(&h).is_ok(), "{ok}");
        }
        for bad in [
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data",
        ] {
            h.insert(header::CONTENT_TYPE, HeaderValue::from_static(bad));
            let e = check_json_content_type(&h).unwrap_err();
            assert_eq!(e.status, StatusCode::UNSUPPORTED_MEDIA_TYPE, "{bad}");
        }
    }

    #[test]
    fn only_objects_pass() {
        assert!(check_json_object(b"  {\"a\":1}").is_ok());
        for bad in [&b"[1]"[..], b"\"x\"", b"", b"   ", b"42"] {
            assert!(check_json_object(bad).is_err());
        }
    }
}
