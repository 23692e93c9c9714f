//! Publishes the engine's KV events like vLLM's `ZmqEventPublisher`: a ZeroMQ PUB
//! socket sending `[topic, seq (u64 BE), payload]`, and a ROUTER replay socket that
//! answers `["", start_seq]` with every buffered batch whose seq ≥ start, as
//! `["", topic, seq, payload]`, then `["", "", -1, ""]`.
//!
//! Owns the sockets, the sequence counter and the bounded replay buffer. It does not
//! decide what the events are (the simulation core does) nor how they are encoded
//! (`wire`).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

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

/// A running publisher: send event batches with [`KvPublisher::publish`].
#[derive(Debug, Clone)]
pub struct KvPublisher {
    tx: mpsc::UnboundedSender<Vec<KvEvent>>,
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
            let _ = self.tx.send(events);
        }
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
    mut rx: mpsc::UnboundedReceiver<Vec<KvEvent>>,
    buffer: Arc<Mutex<VecDeque<Buffered>>>,
    topic: Bytes,
    cfg: PublisherConfig,
    shutdown: CancellationToken,
) {
    let mut seq: u64 = 0;
    loop {
        let events = tokio::select! {
            _ = shutdown.cancelled() => break,
            ev = rx.recv() => match ev {
                Some(ev) => ev,
                None => break,
            },
        };
        let payload = match encode_batch(now_secs(), &events, cfg.dp_rank) {
            Ok(p) => Bytes::from(p),
            Err(err) => {
                tracing::error!(%err, "cannot encode a KV event batch; dropped");
                continue;
            }
        };
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
