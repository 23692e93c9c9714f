//! A fleet of `kvgate mock-engine` child processes on free loopback ports.
//!
//! Owns starting, readiness, killing, restarting (same ports) and teardown of the
//! simulated engines (each engine: HTTP port, KV-event PUB port, replay ROUTER port). Dropping a `Fleet` kills every engine.
//! It must not start routers or send benchmark traffic.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

use crate::process::{free_ports, ManagedChild};

/// The line a mock engine prints on stdout once it listens.
pub const ENGINE_READY_LINE: &str = "mock-engine ready";

/// How to start each engine.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The `kvgate` binary.
    pub kvgate_bin: PathBuf,
    /// Number of engines.
    pub engines: usize,
    /// KV block size in tokens.
    pub block_size: u32,
    /// KV blocks per engine.
    pub num_blocks: u32,
    /// Simulated-time speedup of the engines' latency model.
    pub speedup: f64,
    /// Base seed (engine i gets seed + i).
    pub seed: u64,
    /// Extra arguments appended to every engine's command line.
    pub extra_args: Vec<String>,
    /// How long an engine may take to become ready.
    pub startup_timeout: Duration,
    /// Prefill/decode disaggregation: the first engines prefill, the others decode.
    pub pd: Option<FleetPd>,
}

impl EngineConfig {
    /// The engines' batch limits as `kvgate serve` flags (`--max-num-seqs N
    /// --max-num-batched-tokens N`) when the extra engine arguments set them, so the
    /// router's time model knows them as a user would tell it; empty otherwise (kvgate's
    /// defaults are the mock's).
    pub fn limit_args_for_router(&self) -> Vec<String> {
        let mut out = Vec::new();
        let args = &self.extra_args;
        for (engine_flag, router_flag) in [
            ("--max-num-seqs", "--max-num-seqs"),
            ("--max-batched-tokens", "--max-num-batched-tokens"),
            ("--max-num-batched-tokens", "--max-num-batched-tokens"),
        ] {
            let value = args.iter().enumerate().find_map(|(i, a)| {
                match a.strip_prefix(engine_flag)?.strip_prefix('=') {
                    Some(v) => Some(v.to_string()),
                    None if a == engine_flag => args.get(i + 1).cloned(),
                    None => None,
                }
            });
            if let Some(v) = value {
                out.extend([router_flag.to_string(), v]);
            }
        }
        out
    }
}

/// A disaggregated fleet: `prefill` prefill engines, then decode engines, speaking
/// `mode` (`vllm` or `sglang`, `kvgate mock-engine --pd-mode`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FleetPd {
    pub mode: String,
    pub prefill: usize,
}

/// An engine's part in disaggregated serving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineRole {
    /// An ordinary engine (prefill and decode).
    Both,
    Prefill,
    Decode,
}

/// Addresses of one running engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineAddr {
    /// `http://127.0.0.1:P`.
    pub url: String,
    /// `tcp://127.0.0.1:K`, the KV-event PUB endpoint.
    pub kv_events: String,
    /// `tcp://127.0.0.1:R`, the replay ROUTER endpoint.
    pub replay: String,
    pub role: EngineRole,
    /// An SGLang prefill engine's bootstrap port.
    pub bootstrap_port: Option<u16>,
}

/// Running engines; killed on drop.
#[derive(Debug)]
pub struct Fleet {
    children: Vec<ManagedChild>,
    addrs: Vec<EngineAddr>,
    /// Each engine's command line, to start it again on the same ports.
    commands: Vec<Vec<String>>,
    kvgate_bin: PathBuf,
    log_dir: PathBuf,
    startup_timeout: Duration,
    restarts: usize,
}

impl Fleet {
    /// Start `cfg.engines` engines and wait until each prints its ready line.
    /// Engine logs go to `log_dir/engine-<i>.{out,err}.log`.
    pub async fn start(cfg: &EngineConfig, log_dir: &Path) -> anyhow::Result<Self> {
        let ports = free_ports(cfg.engines * 4)?;
        let mut children = Vec::with_capacity(cfg.engines);
        let mut addrs = Vec::with_capacity(cfg.engines);
        let mut commands = Vec::with_capacity(cfg.engines);
        if let Some(pd) = &cfg.pd {
            if pd.prefill == 0 || pd.prefill >= cfg.engines {
                anyhow::bail!(
                    "a disaggregated fleet of {} engines needs 1 to {} prefill engines, not {}",
                    cfg.engines,
                    cfg.engines.saturating_sub(1),
                    pd.prefill
                );
            }
        }
        for i in 0..cfg.engines {
            let (http, kv, replay, bootstrap) = (
                ports[4 * i],
                ports[4 * i + 1],
                ports[4 * i + 2],
                ports[4 * i + 3],
            );
            let mut args: Vec<String> = vec![
                "mock-engine".into(),
                "--port".into(),
                http.to_string(),
                "--kv-events-port".into(),
                kv.to_string(),
                "--replay-port".into(),
                replay.to_string(),
                "--block-size".into(),
                cfg.block_size.to_string(),
                "--num-blocks".into(),
                cfg.num_blocks.to_string(),
                "--speedup".into(),
                cfg.speedup.to_string(),
                "--seed".into(),
                (cfg.seed + i as u64).to_string(),
            ];
            let (role, bootstrap_port) = match &cfg.pd {
                None => (EngineRole::Both, None),
                Some(pd) => {
                    let prefill = i < pd.prefill;
                    let role = if prefill { "prefill" } else { "decode" };
                    args.extend([
                        "--role".into(),
                        role.into(),
                        "--pd-mode".into(),
                        pd.mode.clone(),
                    ]);
                    if prefill && pd.mode == "sglang" {
                        args.extend(["--bootstrap-port".into(), bootstrap.to_string()]);
                        (EngineRole::Prefill, Some(bootstrap))
                    } else if prefill {
                        (EngineRole::Prefill, None)
                    } else {
                        (EngineRole::Decode, None)
                    }
                }
            };
            args.extend(cfg.extra_args.iter().cloned());
            let child =
                ManagedChild::spawn(&format!("engine-{i}"), &cfg.kvgate_bin, &args, log_dir)?;
            children.push(child);
            commands.push(args);
            addrs.push(EngineAddr {
                url: format!("http://127.0.0.1:{http}"),
                kv_events: format!("tcp://127.0.0.1:{kv}"),
                replay: format!("tcp://127.0.0.1:{replay}"),
                role,
                bootstrap_port,
            });
        }
        for child in &mut children {
            child
                .wait_for_line(ENGINE_READY_LINE, cfg.startup_timeout)
                .await?;
        }
        Ok(Self {
            children,
            addrs,
            commands,
            kvgate_bin: cfg.kvgate_bin.clone(),
            log_dir: log_dir.to_path_buf(),
            startup_timeout: cfg.startup_timeout,
            restarts: 0,
        })
    }

    /// Kills engine `i` (as a crash would: SIGKILL, no drain) and reaps it.
    pub async fn kill(&mut self, i: usize) -> anyhow::Result<()> {
        let child = self
            .children
            .get_mut(i)
            .with_context(|| format!("no engine {i}"))?;
        child.kill().await;
        Ok(())
    }

    /// Sends `signal` to engine `i`'s process group (SIGSTOP: the engine hangs with its
    /// connections open, as a vLLM API server whose engine died).
    pub fn signal(&self, i: usize, signal: i32) -> anyhow::Result<()> {
        let child = self
            .children
            .get(i)
            .with_context(|| format!("no engine {i}"))?;
        child.signal(signal)
    }

    /// Starts engine `i` again on the same ports (a fresh process: empty cache, event
    /// sequence from 0) and waits until it is ready. Its logs go to
    /// `engine-<i>-restart-<n>.*`.
    pub async fn restart(&mut self, i: usize) -> anyhow::Result<()> {
        let args = self
            .commands
            .get(i)
            .with_context(|| format!("no engine {i}"))?
            .clone();
        self.restarts += 1;
        let name = format!("engine-{i}-restart-{}", self.restarts);
        let mut child = ManagedChild::spawn(&name, &self.kvgate_bin, &args, &self.log_dir)?;
        child
            .wait_for_line(ENGINE_READY_LINE, self.startup_timeout)
            .await?;
        let old = std::mem::replace(&mut self.children[i], child);
        old.shutdown().await;
        Ok(())
    }

    /// The engines' addresses, in start order.
    pub fn addrs(&self) -> &[EngineAddr] {
        &self.addrs
    }

    /// Fail with the log tail of the first engine that has died.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        self.children
            .iter_mut()
            .try_for_each(ManagedChild::check_alive)
    }

    /// Kill every engine and reap them.
    pub async fn shutdown(self) {
        for child in self.children {
            child.shutdown().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engines' batch limits reach the router in its own flags' names, whichever
    /// spelling the engine arguments used; nothing when they set none.
    #[test]
    fn engine_limits_are_passed_to_the_router() {
        let cfg = |args: &[&str]| EngineConfig {
            kvgate_bin: PathBuf::new(),
            engines: 2,
            block_size: 16,
            num_blocks: 64,
            speedup: 1.0,
            seed: 0,
            extra_args: args.iter().map(|a| a.to_string()).collect(),
            startup_timeout: Duration::from_secs(1),
            pd: None,
        };
        assert!(cfg(&["--eos-probability=0"])
            .limit_args_for_router()
            .is_empty());
        assert_eq!(
            cfg(&["--max-num-seqs=16", "--max-batched-tokens", "512"]).limit_args_for_router(),
            ["--max-num-seqs", "16", "--max-num-batched-tokens", "512"]
        );
        assert_eq!(
            cfg(&["--max-num-batched-tokens=2048"]).limit_args_for_router(),
            ["--max-num-batched-tokens", "2048"]
        );
    }
}
