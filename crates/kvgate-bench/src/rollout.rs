//! A rolling update of a row's router replicas during its replay (`@rollout`): at evenly
//! spaced points of the replay, one replica at a time is taken out of the clients'
//! rotation (as a load balancer does with a pod that is terminating), sent SIGTERM and
//! left to drain its requests, started again under its name on its port, and put back
//! once `/ready` says so (its index bootstrap from its peers done). That is a
//! StatefulSet's rolling update, or a Deployment's with `maxSurge: 0`.
//!
//! Owns the schedule and the replace step. It must not send requests or measure them
//! (the runner and the client do).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::client::Rotation;
use crate::process::ManagedChild;
use crate::routers::Launch;

/// How long a replica may take to drain after SIGTERM (kvgate's default grace period
/// is 30 s).
const DRAIN: Duration = Duration::from_secs(40);

/// What a rollout did: per replica, when it left the rotation and how long it was out
/// (seconds from the start of the replay).
#[derive(Debug, Clone, Default)]
pub struct RolloutLog {
    pub steps: Vec<(String, f64, f64)>,
}

/// Replaces `replicas[i]` (started as `launches[i]`, target `i` of `rotation`) one
/// after another, the i-th of n at `span * (i + 1) / (n + 1)` from now. Gives the
/// replicas back, running, whether or not every step worked.
pub async fn roll(
    mut replicas: Vec<ManagedChild>,
    launches: Vec<Launch>,
    rotation: Rotation,
    span: Duration,
    startup: Duration,
    log_dir: PathBuf,
) -> (Vec<ManagedChild>, anyhow::Result<RolloutLog>) {
    let n = replicas.len();
    let start = Instant::now();
    let mut log = RolloutLog::default();
    for (i, launch) in launches.iter().enumerate().take(n) {
        let at = start + span.mul_f64((i + 1) as f64 / (n + 1) as f64);
        tokio::time::sleep_until(at.into()).await;
        let out_at = start.elapsed().as_secs_f64();
        let step = replace(&mut replicas[i], launch, &rotation, i, startup, &log_dir).await;
        if let Err(e) = step {
            return (replicas, Err(e));
        }
        let back_at = start.elapsed().as_secs_f64();
        log.steps
            .push((launch.name.clone(), out_at, back_at - out_at));
    }
    (replicas, Ok(log))
}

async fn replace(
    running: &mut ManagedChild,
    launch: &Launch,
    rotation: &Rotation,
    i: usize,
    startup: Duration,
    log_dir: &std::path::Path,
) -> anyhow::Result<()> {
    rotation.set(i, false);
    running
        .signal(libc::SIGTERM)
        .with_context(|| format!("stopping {}", launch.name))?;
    if !running.wait_exit(DRAIN).await {
        bail!("{} did not exit within {DRAIN:?} of SIGTERM", launch.name);
    }
    let name = format!("{}-rolled", launch.name);
    let mut new = ManagedChild::spawn(&name, &launch.bin, &launch.args, log_dir)?;
    new.wait_for_http(&[format!("{}/ready", launch.url)], startup)
        .await?;
    rotation.set(i, true);
    *running = new;
    Ok(())
}
