//! Bearer-token checks for the client API key and the admin token (which also guards
//! the peer endpoints).
//!
//! Owns constant-time comparison of `Authorization: Bearer <token>` against a
//! configured secret. Must not log or echo secrets.

use http::{header, HeaderMap};
use subtle::ConstantTimeEq;

use crate::errors::ApiError;

/// Ok when no token is configured or the request carries it.
pub fn check_bearer(
    headers: &HeaderMap,
    expected: Option<&str>,
    what: &str,
) -> Result<(), ApiError> {
    let Some(expected) = expected else {
        return Ok(());
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    match given {
        Some(g) if bool::from(g.as_bytes().ct_eq(expected.as_bytes())) => Ok(()),
        Some(_) => Err(ApiError::unauthorized(format!("invalid {what}"))),
        None => Err(ApiError::unauthorized(format!(
            "missing {what}: send Authorization: Bearer <{what}>"
        ))),
    }
}

/// For endpoints that are off unless a token is configured (the admin API, the peer
/// endpoints): 404 naming the flag that turns them on when none is, else
/// [`check_bearer`].
pub fn require_bearer(
    headers: &HeaderMap,
    expected: Option<&str>,
    what: &str,
    endpoints: &str,
) -> Result<(), ApiError> {
    match expected {
        None => Err(ApiError::not_found(format!(
            "{endpoints} are disabled: start the gateway with --admin-token"
        ))),
        Some(t) => check_bearer(headers, Some(t), what),
    }
}

/// The token of an `Authorization: Bearer <token>` value; the scheme name is
/// case-insensitive (RFC 7235 §2.1).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn bearer_checks() {
        let mut h = HeaderMap::new();
        assert!(check_bearer(&h, None, "API key").is_ok());
        assert!(check_bearer(&h, Some("k"), "API key").is_err());
        h.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer nope"),
        );
        assert!(check_bearer(&h, Some("k"), "API key").is_err());
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        assert!(check_bearer(&h, Some("k"), "API key").is_ok());
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("BEARER k"));
        assert!(check_bearer(&h, Some("k"), "API key").is_ok());
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Basic k"));
        assert!(check_bearer(&h, Some("k"), "API key").is_err());
    }

    #[test]
    fn required_tokens_refuse_everyone_when_none_is_configured() {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        let off = require_bearer(&h, None, "admin token", "the peer endpoints").unwrap_err();
        assert_eq!(off.status, http::StatusCode::NOT_FOUND);
        assert!(require_bearer(&h, Some("k"), "admin token", "x").is_ok());
        assert!(require_bearer(&h, Some("other"), "admin token", "x").is_err());
    }
}
