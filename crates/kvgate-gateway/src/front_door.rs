//! The front door: what every client API request passes, in this order, before any
//! per-request work.
//!
//! 1. the API key (`Authorization: Bearer`, scheme case-insensitive);
//! 2. the Content-Type (absent or JSON; anything else is 415);
//! 3. a declared `Content-Length` above the body limit (413 before any wait);
//! 4. **admission**: a gateway-wide in-flight slot, waiting in the bounded queue
//!    (429 with `Retry-After` beyond it);
//! 5. the body, read up to the limit (413 beyond it), which must be a JSON object.
//!
//! Admission comes before the body is read, so `--max-in-flight` bounds the memory and
//! CPU of everything after it (body, parsing, tokenization, routing, proxying): at most
//! `max_in_flight` requests hold a body and tokenize at once. The slot travels with the
//! request ([`Admitted::admission`], then each attempt's lease) until its response
//! ends. Owns no routing or proxying; the per-worker slot is taken with the lease when
//! a worker is chosen (routing.rs, lease.rs).

use axum::body::Body;
use axum::extract::Request;
use bytes::Bytes;
use http::{header, HeaderMap};
use http_body_util::{BodyExt, Limited};
use std::sync::Arc;

use crate::auth::check_bearer;
use crate::errors::ApiError;
use crate::gateway::Gateway;
use crate::limits::Admission;

/// A request past the front door.
pub struct Admitted {
    pub headers: HeaderMap,
    /// The whole body: a JSON object (checked by its first byte; parsed later).
    pub body: Bytes,
    /// The request's admission (its gateway-wide in-flight slot), shared with the
    /// leases of its attempts.
    pub admission: Arc<Admission>,
}

/// Runs the front door's checks and admission for one API request.
pub async fn admit(gw: &Gateway, req: Request) -> Result<Admitted, ApiError> {
    let (parts, body) = req.into_parts();
    check_bearer(&parts.headers, gw.config.api_key.as_deref(), "API key")?;
    check_json_content_type(&parts.headers)?;
    let max = gw.config.limits.max_body_bytes;
    if declared_length(&parts.headers).is_some_and(|len| len > max) {
        // Read (and drop) what the client is sending so it can read the 413.
        discard_body(body, max.saturating_mul(4)).await;
        return Err(ApiError::body_too_large(max));
    }
    let admission = match gw.limiter.acquire().await {
        Ok(a) => Arc::new(a),
        Err(refused) => {
            // A client still sending its body would see a reset, not the 429.
            discard_body(body, max).await;
            return Err(refused);
        }
    };
    let body = read_body(body, max).await?;
    check_json_object(&body)?;
    Ok(Admitted {
        headers: parts.headers,
        body,
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

/// Whether a Content-Type names JSON: `application/json` or `*+json`, any case, with
/// any parameters. Used for client bodies here and for engine error pages (failover.rs).
pub(crate) fn is_json_media_type(value: &http::HeaderValue) -> bool {
    value
        .to_str()
        .ok()
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
        .is_some_and(|m| m == "application/json" || m.ends_with("+json"))
}

async fn read_body(mut body: Body, max: usize) -> Result<Bytes, ApiError> {
    // Most bodies arrive in one frame: keep it as is, copy only to join several.
    let mut frames: Vec<Bytes> = Vec::new();
    let mut len = 0usize;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::bad_request("invalid_body", format!("cannot read the request body: {e}"))
        })?;
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        if len + data.len() > max {
            discard_body(body, max.saturating_mul(4)).await;
            return Err(ApiError::body_too_large(max));
        }
        len += data.len();
        frames.push(data);
    }
    Ok(match frames.len() {
        0 => Bytes::new(),
        1 => frames.swap_remove(0),
        _ => frames.concat().into(),
    })
}

/// Reads and drops a refused request's body (up to `max` bytes, for at most
/// [`DISCARD_BODY_FOR`]), so its client can read the answer instead of a connection
/// reset (what web servers call a lingering close).
async fn discard_body(body: Body, max: usize) {
    let mut body = Limited::new(body, max);
    let drain = async { while let Some(Ok(_)) = body.frame().await {} };
    let _ = tokio::time::timeout(DISCARD_BODY_FOR, drain).await;
}

/// How long a refused request's body is read (and dropped) before the answer.
const DISCARD_BODY_FOR: std::time::Duration = std::time::Duration::from_secs(2);

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
pub async fn method_not_allowed(req: Request) -> axum::response::Response {
    use axum::response::IntoResponse;
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

    #[tokio::test]
    async fn bodies_are_read_whole_within_the_limit() {
        let chunks = |parts: &[&'static str]| {
            let parts: Vec<Result<Bytes, std::io::Error>> = parts
                .iter()
                .map(|p| Ok(Bytes::from_static(p.as_bytes())))
                .collect();
            Body::from_stream(futures::stream::iter(parts))
        };
        assert_eq!(
            read_body(chunks(&["{\"a\":", "1", "}"]), 64).await.unwrap(),
            "{\"a\":1}"
        );
        assert_eq!(read_body(chunks(&["{}"]), 64).await.unwrap(), "{}");
        assert_eq!(read_body(chunks(&[]), 64).await.unwrap(), "");
        let e = read_body(chunks(&["{\"a\":", "12345"]), 8)
            .await
            .unwrap_err();
        assert_eq!(e.status, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn only_objects_pass() {
        assert!(check_json_object(b"  {\"a\":1}").is_ok());
        for bad in [&b"[1]"[..], b"\"x\"", b"", b"   ", b"42"] {
            assert!(check_json_object(bad).is_err());
        }
    }
}
