//! Publishes the engine's KV events like vLLM's `ZmqEventPublisher`: a ZeroMQ PUB
//! socket sending `[topic, seq (u64 BE), payload]`, and a ROUTER replay socket that
//! answers `["", start_seq]` with every buffered batch whose seq ≥ start, as
//! `["", topic, seq, payload]`, then `["", "", -1, ""]`.
//!
//! Owns the sockets, the sequence counter and the bounded replay buffer, and two faults
//! for testing routers ([`KvPublisher::pause`]: batches keep their sequence numbers and
//! enter the replay buffer but are not sent, as when the socket stalls;
//! [`KvPublisher::send_garbage`]: malformed messages). It does not decide what the
//! events are (the simulation core does) nor how they are encoded (`wire`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::events::KvEvent;
use crate::wire::{encode_batch, seq_frame, REPLAY_END_SEQ};

/// Where and how to publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// Interface to bind (e.g. `127.0.0.1`, `0.0.0.0`).
    pub host: String,
    /// PUB port; 0 picks an ephemeral port.
    pub port: u16,
    /// ROUTER replay port (None = no replay socket; 0 = ephemeral).
    pub replay_port: Option<u16>,
    pub topic: String,
    pub dp_rank: u32,
    /// Batches kept for replay.
    pub replay_buffer: usize,
}

impl Default for PublisherConfig {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 0,
            replay_port: Some(0),
            topic: "kv".into(),
            dp_rank: 0,
            replay_buffer: 10_000,
        }
    }
}

struct Buffered {
    seq: u64,
    payload: Bytes,
}

/// What the publishing task is asked to do.
#[derive(Debug)]
enum Command {
    Batch(Vec<KvEvent>),
    /// Send nothing live for this long (batches still take sequence numbers and enter
    /// the replay buffer).
    Pause(Duration),
    /// Send this many malformed messages.
    Garbage(u32),
}

/// A running publisher: send event batches with [`KvPublisher::publish`].
#[derive(Debug, Clone)]
pub struct KvPublisher {
    tx: mpsc::UnboundedSender<Command>,
    /// `tcp://host:port` of the PUB socket.
    pub endpoint: String,
    /// `tcp://host:port` of the replay ROUTER socket.
    pub replay_endpoint: Option<String>,
}

impl KvPublisher {
    /// Bind the sockets and start the publishing tasks (they stop on `shutdown`).
    pub async fn start(cfg: PublisherConfig, shutdown: CancellationToken) -> anyhow::Result<Self> {
        let mut pub_socket = zeromq::PubSocket::new();
        let endpoint = pub_socket
            .bind(&format!("tcp://{}:{}", cfg.host, cfg.port))
            .await
            .with_context(|| format!("binding the KV events PUB socket on port {}", cfg.port))?
            .to_string();
        let buffer: Arc<Mutex<VecDeque<Buffered>>> = Arc::new(Mutex::new(VecDeque::new()));
        let topic = Bytes::from(cfg.topic.clone().into_bytes());

        let replay_endpoint = match cfg.replay_port {
            Some(port) => {
                let mut router = zeromq::RouterSocket::new();
                let ep = router
                    .bind(&format!("tcp://{}:{}", cfg.host, port))
                    .await
                    .with_context(|| format!("binding the KV events replay socket on port {port}"))?
                    .to_string();
                tokio::spawn(serve_replay(
                    router,
                    buffer.clone(),
                    topic.clone(),
                    shutdown.clone(),
                ));
                Some(ep)
            }
            None => None,
        };

        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(publish_loop(pub_socket, rx, buffer, topic, cfg, shutdown));
        Ok(Self {
            tx,
            endpoint,
            replay_endpoint,
        })
    }

    /// Queue one step's events as one batch (never blocks).
    pub fn publish(&self, events: Vec<KvEvent>) {
        if !events.is_empty() {
            // A closed channel means we are shutting down: dropping is correct.
            let _ = self.tx.send(Command::Batch(events));
        }
    }

    /// Fault: stop sending live messages for `d` (a stalled socket). Batches produced
    /// meanwhile are numbered and buffered for replay, so a subscriber sees a gap it
    /// can recover only if the replay buffer still holds them.
    pub fn pause(&self, d: Duration) {
        let _ = self.tx.send(Command::Pause(d));
    }

    /// Fault: send `n` malformed messages (wrong frame count, a short sequence frame,
    /// or an undecodable payload under the next sequence number).
    pub fn send_garbage(&self, n: u32) {
        let _ = self.tx.send(Command::Garbage(n));
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

async fn publish_loop(
    mut socket: zeromq::PubSocket,
    mut rx: mpsc::UnboundedReceiver<Command>,
    buffer: Arc<Mutex<VecDeque<Buffered>>>,
    topic: Bytes,
    cfg: PublisherConfig,
    shutdown: CancellationToken,
) {
    let mut seq: u64 = 0;
    let mut paused_until: Option<Instant> = None;
    loop {
        let command = tokio::select! {
            _ = shutdown.cancelled() => break,
            c = rx.recv() => match c {
                Some(c) => c,
                None => break,
            },
        };
        let events = match command {
            Command::Batch(events) => events,
            Command::Pause(d) => {
                paused_until = Some(Instant::now() + d);
                continue;
            }
            Command::Garbage(n) => {
                for i in 0..n {
                    let frames = match i % 3 {
                        0 => vec![Bytes::from_static(b"garbage")],
                        1 => vec![
                            topic.clone(),
                            Bytes::from_static(b"\x01\x02\x03"),
                            Bytes::new(),
                        ],
                        _ => {
                            // An undecodable payload under the next sequence number
                            // (it consumes the number, as a real batch would).
                            let f = vec![
                                topic.clone(),
                                Bytes::copy_from_slice(&seq_frame(seq)),
                                Bytes::from_static(b"\xc1\xc1 not msgpack"),
                            ];
                            seq += 1;
                            f
                        }
                    };
                    if let Ok(msg) = ZmqMessage::try_from(frames) {
                        let _ = socket.send(msg).await;
                    }
                }
                continue;
            }
        };
        let payload = match encode_batch(now_secs(), &events, cfg.dp_rank) {
            Ok(p) => Bytes::from(p),
            Err(err) => {
                tracing::error!(%err, "cannot encode a KV event batch; dropped");
                continue;
            }
        };
        let live = paused_until.is_none_or(|t| Instant::now() >= t);
        if live {
            paused_until = None;
            let frames = vec![
                topic.clone(),
                Bytes::copy_from_slice(&seq_frame(seq)),
                payload.clone(),
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames) {
                if let Err(err) = socket.send(msg).await {
                    tracing::warn!(%err, seq, "KV events PUB send failed");
                }
            }
        }
        {
            let mut buf = buffer.lock();
            buf.push_back(Buffered { seq, payload });
            while buf.len() > cfg.replay_buffer.max(1) {
                buf.pop_front();
            }
        }
        seq += 1;
    }
    let _ = socket.close().await;
}

async fn serve_replay(
    mut socket: zeromq::RouterSocket,
    buffer: Arc<Mutex<VecDeque<Buffered>>>,
    topic: Bytes,
    shutdown: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = socket.recv() => m,
        };
        let msg = match msg {
            Ok(m) => m,
            Err(err) => {
                tracing::debug!(%err, "replay socket receive error");
                continue;
            }
        };
        let frames = msg.into_vec();
        // [identity, "", start_seq]; tolerate a missing empty delimiter.
        let Some(identity) = frames.first().cloned() else {
            continue;
        };
        let Some(start) = frames
            .last()
            .and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok())
            .map(u64::from_be_bytes)
        else {
            tracing::debug!("malformed replay request ignored");
            continue;
        };
        let replies: Vec<(u64, Bytes)> = buffer
            .lock()
            .iter()
            .filter(|b| b.seq >= start)
            .map(|b| (b.seq, b.payload.clone()))
            .collect();
        for (seq, payload) in replies {
            let frames = vec![
                identity.clone(),
                Bytes::new(),
                topic.clone(),
                Bytes::copy_from_slice(&seq_frame(seq)),
                payload,
            ];
            if let Ok(m) = ZmqMessage::try_from(frames) {
                if socket.send(m).await.is_err() {
                    break;
                }
            }
        }
        let end = vec![
            identity,
            Bytes::new(),
            Bytes::new(),
            Bytes::copy_from_slice(&REPLAY_END_SEQ),
            Bytes::new(),
        ];
        if let Ok(m) = ZmqMessage::try_from(end) {
            let _ = socket.send(m).await;
        }
    }
    let _ = socket.close().await;
}
