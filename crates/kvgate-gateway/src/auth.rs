//! Bearer-token checks for the client API key and the admin token.
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
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .map(str::trim);
    match given {
        Some(g) if bool::from(g.as_bytes().ct_eq(expected.as_bytes())) => Ok(()),
        Some(_) => Err(ApiError::unauthorized(format!("invalid {what}"))),
        None => Err(ApiError::unauthorized(format!(
            "missing {what}: send Authorization: Bearer <{what}>"
        ))),
    }
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
    }
}
