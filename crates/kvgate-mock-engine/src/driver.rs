//! The async engine loop: one task owns the [`Simulator`], takes commands from HTTP
//! handlers, runs steps, sleeps each step's modelled duration (divided by the
//! speedup), then delivers tokens to requests and event batches to the publisher.
//!
//! Owns real-time pacing and the request ↔ channel plumbing. It makes no scheduling
//! decisions (the core does) and does no HTTP or socket work itself.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::kv_publisher::KvPublisher;
use crate::scheduler::{RequestId, SimRequest, SimSnapshot, Simulator, SubmitError, TokenOutput};

/// How far the loop may fall behind its schedule before it stops catching up.
const MAX_LAG: Duration = Duration::from_millis(50);

enum Command {
    Submit {
        req: SimRequest,
        tokens: mpsc::UnboundedSender<TokenOutput>,
        reply: oneshot::Sender<Result<RequestId, SubmitError>>,
    },
    Abort(RequestId),
    Reset(bool, oneshot::Sender<bool>),
    Hang(Duration),
}

/// Cheap, cloneable access to the engine loop.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::UnboundedSender<Command>,
    snapshot: Arc<Mutex<SimSnapshot>>,
}

/// The engine loop has stopped.
#[derive(Debug, thiserror::Error)]
#[error("the engine is shutting down")]
pub struct EngineStopped;

impl EngineHandle {
    /// Queue a request; tokens arrive on the returned receiver. Dropping the
    /// [`AbortOnDrop`] guard before the request finishes aborts it.
    pub async fn submit(
        &self,
        req: SimRequest,
    ) -> Result<
        Result<(AbortOnDrop, mpsc::UnboundedReceiver<TokenOutput>), SubmitError>,
        EngineStopped,
    > {
        let (tokens, rx) = mpsc::unbounded_channel();
        let (reply, reply_rx) = oneshot::channel();
        self.tx
            .send(Command::Submit { req, tokens, reply })
            .map_err(|_| EngineStopped)?;
        match reply_rx.await.map_err(|_| EngineStopped)? {
            Ok(id) => Ok(Ok((
                AbortOnDrop {
                    id,
                    tx: self.tx.clone(),
                    armed: true,
                },
                rx,
            ))),
            Err(e) => Ok(Err(e)),
        }
    }

    /// Reset the prefix cache; false when requests still hold blocks (unless
    /// `reset_running_requests` preempts them first).
    pub async fn reset_prefix_cache(
        &self,
        reset_running_requests: bool,
    ) -> Result<bool, EngineStopped> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::Reset(reset_running_requests, reply))
            .map_err(|_| EngineStopped)?;
        rx.await.map_err(|_| EngineStopped)
    }

    /// Fault: the engine loop stops for `d` (no step, no token, no KV event, no new
    /// request taken in) while the HTTP server keeps answering, as a vLLM engine core
    /// that hangs behind a live API server.
    pub fn hang(&self, d: Duration) -> Result<(), EngineStopped> {
        self.tx.send(Command::Hang(d)).map_err(|_| EngineStopped)
    }

    /// The state after the latest step.
    pub fn snapshot(&self) -> SimSnapshot {
        *self.snapshot.lock()
    }
}

/// Aborts its request when dropped, unless [`AbortOnDrop::disarm`] was called
/// (the request finished). Every way a client can go away ends here.
pub struct AbortOnDrop {
    id: RequestId,
    tx: mpsc::UnboundedSender<Command>,
    armed: bool,
}

impl AbortOnDrop {
    pub fn id(&self) -> RequestId {
        self.id
    }

    pub fn disarm(&mut self) {
        self.armed = false;
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.tx.send(Command::Abort(self.id));
        }
    }
}

/// Start the engine loop on the current runtime.
pub fn start(
    sim: Simulator,
    speedup: f64,
    publisher: Option<KvPublisher>,
    shutdown: CancellationToken,
) -> EngineHandle {
    let (tx, rx) = mpsc::unbounded_channel();
    let snapshot = Arc::new(Mutex::new(sim.snapshot()));
    tokio::spawn(run_loop(
        sim,
        speedup,
        publisher,
        rx,
        snapshot.clone(),
        shutdown,
    ));
    EngineHandle { tx, snapshot }
}

struct LoopState {
    sim: Simulator,
    subscribers: FxHashMap<RequestId, mpsc::UnboundedSender<TokenOutput>>,
    publisher: Option<KvPublisher>,
    /// A hang asked for and not begun yet.
    hang: Option<Duration>,
}

impl LoopState {
    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { req, tokens, reply } => {
                let result = self.sim.submit(req);
                if let Ok(id) = result {
                    self.subscribers.insert(id, tokens);
                }
                if let Err(Ok(id)) = reply.send(result) {
                    // The handler went away before hearing back.
                    self.abort(id);
                }
            }
            Command::Abort(id) => self.abort(id),
            Command::Reset(reset_running, reply) => {
                let done = match self.sim.reset_prefix_cache(reset_running) {
                    Some(events) => {
                        if let Some(p) = &self.publisher {
                            p.publish(events);
                        }
                        true
                    }
                    None => false,
                };
                let _ = reply.send(done);
            }
            Command::Hang(d) => self.hang = Some(d),
        }
    }

    fn abort(&mut self, id: RequestId) {
        self.subscribers.remove(&id);
        self.sim.abort(id);
    }
}

async fn run_loop(
    sim: Simulator,
    speedup: f64,
    publisher: Option<KvPublisher>,
    mut rx: mpsc::UnboundedReceiver<Command>,
    snapshot: Arc<Mutex<crate::scheduler::SimSnapshot>>,
    shutdown: CancellationToken,
) {
    let speedup = if speedup.is_finite() && speedup > 0.0 {
        speedup
    } else {
        1.0
    };
    let started = Instant::now();
    let mut st = LoopState {
        sim,
        subscribers: FxHashMap::default(),
        publisher,
        hang: None,
    };
    let mut deadline = Instant::now();
    loop {
        if st.sim.is_idle() {
            *snapshot.lock() = st.sim.snapshot();
            let cmd = tokio::select! {
                _ = shutdown.cancelled() => break,
                cmd = rx.recv() => match cmd {
                    Some(c) => c,
                    None => break,
                },
            };
            st.handle(cmd);
            // Idle time passes on the virtual clock too (scaled like steps).
            let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0 * speedup;
            st.sim.advance_to(elapsed_ms);
            deadline = Instant::now();
        }
        while let Ok(cmd) = rx.try_recv() {
            st.handle(cmd);
        }
        if let Some(d) = st.hang.take() {
            tokio::select! {
                _ = shutdown.cancelled() => break,
                _ = tokio::time::sleep(d) => {}
            }
            deadline = Instant::now();
            continue;
        }
        let Some(out) = st.sim.step() else {
            continue;
        };
        *snapshot.lock() = st.sim.snapshot();
        let secs = out.duration_ms / 1000.0 / speedup;
        deadline += Duration::from_secs_f64(secs.max(0.0));
        let now = Instant::now();
        if deadline + MAX_LAG < now {
            deadline = now;
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep_until(deadline) => {}
        }
        if let Some(p) = &st.publisher {
            p.publish(out.events);
        }
        for o in out.outputs {
            let id = o.id;
            let finished = o.finished.is_some();
            let delivered = st.subscribers.get(&id).is_some_and(|tx| tx.send(o).is_ok());
            if finished {
                st.subscribers.remove(&id);
            } else if !delivered {
                // Nobody is listening any more: free the blocks now.
                st.abort(id);
            }
        }
    }
}
