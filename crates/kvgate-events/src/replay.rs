//! Replay client: asks an engine's ROUTER socket for buffered batches from a sequence.
//!
//! Owns the replay protocol only: a DEALER sends `["", start_seq (8 bytes BE)]`; the
//! engine answers each buffered batch with seq ≥ start as `["", (topic,)? seq, payload]`
//! and ends with seq = -1 (0xFF × 8) and an empty payload. It must not decode payloads
//! or touch the index. Every request is bounded in time and size, and runs in its own
//! task so that a fault inside the socket library cannot take the subscriber down.

use std::time::Duration;

use bytes::Bytes;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The sequence number that ends a replay answer.
pub const END_SEQ: u64 = u64::MAX;

/// One buffered batch returned by the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayedBatch {
    pub seq: u64,
    pub payload: Bytes,
}

/// Why a replay could not be obtained.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("replay endpoint unreachable: {0}")]
    Connect(String),
    #[error("replay request failed: {0}")]
    Io(String),
    #[error("replay timed out after {0:?}")]
    Timeout(Duration),
    #[error("malformed replay frame ({frames} frames)")]
    Malformed { frames: usize },
    #[error("replay answer exceeded {0} batches")]
    TooLarge(usize),
    #[error("replay task failed: {0}")]
    Task(String),
}

/// Limits of one replay request.
#[derive(Clone, Copy, Debug)]
pub struct ReplayLimits {
    /// Whole request: connect, send, and read until the end marker.
    pub timeout: Duration,
    /// Most batches accepted in one answer (vLLM buffers 10 000 by default).
    pub max_batches: usize,
}

impl Default for ReplayLimits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(5),
            max_batches: 100_000,
        }
    }
}

/// Splits one replay message into `(seq, payload)`. Accepts `["", topic, seq, payload]`,
/// `["", seq, payload]` (or `[topic, seq, payload]`) and `[seq, payload]`.
pub fn parse_replay_frames(frames: &[Bytes]) -> Option<(u64, Bytes)> {
    let (seq, payload) = match frames.len() {
        4 => (&frames[2], &frames[3]),
        3 => (&frames[1], &frames[2]),
        2 => (&frames[0], &frames[1]),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload.clone()))
}

/// Requests every buffered batch with seq ≥ `start_seq` from `endpoint`, in the order
/// the engine sends them (ascending).
pub async fn fetch_replay(
    endpoint: &str,
    start_seq: u64,
    limits: ReplayLimits,
) -> Result<Vec<ReplayedBatch>, ReplayError> {
    let endpoint = endpoint.to_owned();
    let task = tokio::spawn(async move {
        tokio::time::timeout(
            limits.timeout,
            request(&endpoint, start_seq, limits.max_batches),
        )
        .await
        .unwrap_or(Err(ReplayError::Timeout(limits.timeout)))
    });
    match task.await {
        Ok(r) => r,
        Err(e) => Err(ReplayError::Task(e.to_string())),
    }
}

async fn request(
    endpoint: &str,
    start_seq: u64,
    max_batches: usize,
) -> Result<Vec<ReplayedBatch>, ReplayError> {
    let mut socket = DealerSocket::new();
    socket
        .connect(endpoint)
        .await
        .map_err(|e| ReplayError::Connect(e.to_string()))?;
    let mut msg = ZmqMessage::from(Bytes::new());
    msg.push_back(Bytes::copy_from_slice(&start_seq.to_be_bytes()));
    socket
        .send(msg)
        .await
        .map_err(|e| ReplayError::Io(e.to_string()))?;
    let mut out = Vec::new();
    loop {
        let msg = socket
            .recv()
            .await
            .map_err(|e| ReplayError::Io(e.to_string()))?;
        let frames = msg.into_vec();
        let Some((seq, payload)) = parse_replay_frames(&frames) else {
            return Err(ReplayError::Malformed {
                frames: frames.len(),
            });
        };
        if seq == END_SEQ {
            return Ok(out);
        }
        if out.len() >= max_batches {
            return Err(ReplayError::TooLarge(max_batches));
        }
        out.push(ReplayedBatch { seq, payload });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_with_and_without_topic() {
        let b = |s: &[u8]| Bytes::copy_from_slice(s);
        let seq = 7u64.to_be_bytes();
        assert_eq!(
            parse_replay_frames(&[b(b""), b(b"kv"), b(&seq), b(b"p")]),
            Some((7, b(b"p")))
        );
        assert_eq!(
            parse_replay_frames(&[b(b""), b(&seq), b(b"p")]),
            Some((7, b(b"p")))
        );
        assert_eq!(parse_replay_frames(&[b(&seq), b(b"p")]), Some((7, b(b"p"))));
        assert_eq!(
            parse_replay_frames(&[b(b""), b(b""), b(&[0xff; 8]), b(b"")]),
            Some((END_SEQ, b(b"")))
        );
        assert_eq!(parse_replay_frames(&[b(b""), b(b"short"), b(b"p")]), None);
        assert_eq!(parse_replay_frames(&[b(b"x")]), None);
    }
}
