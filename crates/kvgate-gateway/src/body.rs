//! Reading an HTTP body whole, bounded in size and in time: the one place every body
//! the gateway reads goes through (a client's request, an engine's `/tokenize` or
//! prefill answer or error page, a peer's snapshot or choice, an engine's metrics).
//!
//! Owns the frame loop, the size bound and the deadline. Must not interpret what it
//! reads.

use std::time::Duration;

use bytes::Bytes;
use http_body::Body;
use http_body_util::BodyExt;

/// Why a body could not be read whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyError {
    /// It grew past the bound.
    TooLarge { max: usize },
    /// The connection broke mid-body.
    Broken(String),
    /// It did not end in time.
    TimedOut,
}

impl std::fmt::Display for BodyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BodyError::TooLarge { max } => write!(f, "the body is larger than {max} bytes"),
            BodyError::Broken(e) => write!(f, "the body broke off: {e}"),
            BodyError::TimedOut => f.write_str("the body did not arrive in time"),
        }
    }
}

/// Reads `body` to its end: at most `max` bytes, within `within` when set. A body in
/// one frame (the usual case) is kept as it is; several are joined. After an error the
/// rest of the body is still the caller's (to [`discard`], or to drop).
pub async fn read_bounded<B>(
    body: &mut B,
    max: usize,
    within: Option<Duration>,
) -> Result<Bytes, BodyError>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Display,
{
    let read = async {
        let mut frames: Vec<Bytes> = Vec::new();
        let mut len = 0usize;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| BodyError::Broken(e.to_string()))?;
            let Ok(data) = frame.into_data() else {
                continue; // trailers
            };
            if len + data.len() > max {
                return Err(BodyError::TooLarge { max });
            }
            len += data.len();
            frames.push(data);
        }
        Ok(match frames.len() {
            0 => Bytes::new(),
            1 => frames.swap_remove(0),
            _ => frames.concat().into(),
        })
    };
    match within {
        Some(d) => tokio::time::timeout(d, read)
            .await
            .unwrap_or(Err(BodyError::TimedOut)),
        None => read.await,
    }
}

/// Reads and drops what is left of a body (up to `max` bytes, for at most `within`),
/// keeping none of it: so a client whose request was refused can read the answer
/// instead of a connection reset (what web servers call a lingering close).
pub async fn discard<B>(body: &mut B, max: usize, within: Duration)
where
    B: Body<Data = Bytes> + Unpin,
{
    let drain = async {
        let mut len = 0usize;
        while let Some(Ok(frame)) = body.frame().await {
            len += frame.data_ref().map_or(0, Bytes::len);
            if len > max {
                return;
            }
        }
    };
    let _ = tokio::time::timeout(within, drain).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunks(parts: &[&'static str]) -> axum::body::Body {
        let parts: Vec<Result<Bytes, std::io::Error>> = parts
            .iter()
            .map(|p| Ok(Bytes::from_static(p.as_bytes())))
            .collect();
        axum::body::Body::from_stream(futures::stream::iter(parts))
    }

    #[tokio::test]
    async fn bodies_are_read_whole_within_the_bound() {
        let read = |parts: &'static [&'static str], max| async move {
            read_bounded(&mut chunks(parts), max, None).await
        };
        assert_eq!(read(&["{\"a\":", "1", "}"], 64).await.unwrap(), "{\"a\":1}");
        assert_eq!(read(&["{}"], 64).await.unwrap(), "{}");
        assert_eq!(read(&[], 64).await.unwrap(), "");
        assert_eq!(
            read(&["{\"a\":", "12345"], 8).await,
            Err(BodyError::TooLarge { max: 8 })
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_body_that_does_not_end_times_out() {
        let mut never = axum::body::Body::from_stream(futures::stream::pending::<
            Result<Bytes, std::io::Error>,
        >());
        let read = read_bounded(&mut never, 64, Some(Duration::from_secs(1))).await;
        assert_eq!(read, Err(BodyError::TimedOut));
    }
}
