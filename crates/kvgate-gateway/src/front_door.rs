//! The front door: what every request passes before any per-request work, as axum
//! middleware that server.rs applies from its route table, so no route is served
//! without it.
//!
//! 1. [`count`] (chat and completions): the request's line in `kvgate_requests_total`
//!    ([`RequestRecord`]: once, however it ends), and the end of the shutdown grace
//!    period, which answers a request still queued or tokenizing with a 503.
//! 2. [`guard`] (every route): its group's token ([`Access`]): the API key, the metrics
//!    token, or the admin token (the admin API and the peer endpoints, each off with a
//!    404 unless one is configured); `Authorization: Bearer`, scheme case-insensitive.
//! 3. [`admit`] (routes that take a request body for the engines): the Content-Type
//!    (absent or JSON; anything else is 415), a declared `Content-Length` above the
//!    body limit (413 before any wait), **admission** (a gateway-wide in-flight slot,
//!    waiting in the bounded queue: 429 with `Retry-After` beyond it), then the body,
//!    read up to the limit (413 beyond it), which must be a JSON object. The handler
//!    takes it as [`Admitted`].
//!
//! Admission comes before the body is read, so `--max-in-flight` bounds the memory and
//! CPU of everything after it (body, parsing, tokenization, routing, proxying). The slot
//! travels with the request ([`Admitted::admission`], then each attempt's lease) until
//! its response ends. Owns no routing or proxying.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{FromRequestParts, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http::{header, HeaderMap};

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

/// Refuses a request without its route group's token.
pub async fn guard(
    State((gw, access)): State<(Arc<Gateway>, Access)>,
    req: Request,
    next: Next,
) -> Response {
    let headers = req.headers();
    let checked = match access {
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
    };
    match checked {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

/// Counts the request once in `kvgate_requests_total` (with the status and worker of
/// its answer, or 499 if the client leaves first), and answers 503 when the shutdown
/// grace period ends before its response began.
pub async fn count(State(gw): State<Arc<Gateway>>, mut req: Request, next: Next) -> Response {
    let record = RequestRecord::new(&gw.metrics);
    req.extensions_mut().insert(record.clone());
    let grace_over = gw.grace_over.clone();
    let response = tokio::select! {
        r = next.run(req) => r,
        () = grace_over.cancelled() => ApiError::gateway_shutting_down().into_response(),
    };
    let worker = response
        .headers()
        .get(WORKER_HEADER)
        .and_then(|v| v.to_str().ok());
    record.answered(response.status(), worker);
    response
}

/// A request past the front door's admission: its body and its admission.
#[derive(Clone)]
pub struct Admitted {
    /// The whole body: a JSON object (checked by its first byte; parsed later).
    pub body: Bytes,
    /// The request's admission (its gateway-wide in-flight slot), shared with the
    /// leases of its attempts.
    pub admission: Arc<Admission>,
}

impl<S: Send + Sync> FromRequestParts<S> for Admitted {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .remove::<Admitted>()
            .ok_or_else(|| ApiError::internal("a route took a body without the front door"))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for RequestRecord {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, ApiError> {
        parts
            .extensions
            .get::<RequestRecord>()
            .cloned()
            .ok_or_else(|| ApiError::internal("a counted route without its record"))
    }
}

/// Checks the body's type and declared size, admits the request, reads its body; the
/// handler takes both as [`Admitted`].
pub async fn admit(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    let (mut parts, mut body) = req.into_parts();
    match admitted(&gw, &parts.headers, &mut body).await {
        Ok(a) => {
            parts.extensions.insert(a);
            next.run(Request::from_parts(parts, Body::empty())).await
        }
        Err(e) => e.into_response(),
    }
}

async fn admitted(
    gw: &Gateway,
    headers: &HeaderMap,
    body: &mut Body,
) -> Result<Admitted, ApiError> {
    check_json_content_type(headers)?;
    let max = gw.config.limits.max_body_bytes;
    if declared_length(headers).is_some_and(|len| len > max) {
        // Read (and drop) what the client is sending so it can read the 413.
        discard(body, max.saturating_mul(4), DISCARD_BODY_FOR).await;
        return Err(ApiError::body_too_large(max));
    }
    let admission = match gw.limiter.acquire().await {
        Ok(a) => Arc::new(a),
        Err(refused) => {
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
        body: bytes,
        admission,
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
