//! Helpers of the binary's end-to-end tests: the binary's path and running it, reading
//! a comparison's JSON, the workload and fleet both the simulated and the real-time
//! `kvgate simulate` runs use, and a small `kvgate bench compare` setup.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kvgate_bench::compare::{CompareConfig, CompareSummary};
use kvgate_bench::fleet::EngineConfig;
use kvgate_bench::request::Request;
use kvgate_bench::routers::RouterSpec;
use kvgate_bench::runner::RunConfig;
use kvgate_bench::workload::{WorkloadConfig, WorkloadKind};

pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_kvgate"))
}

pub fn kvgate(args: &[&str]) -> String {
    let out = Command::new(bin()).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "kvgate {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn summary(dir: &Path) -> CompareSummary {
    serde_json::from_slice(&std::fs::read(dir.join("compare.json")).unwrap()).unwrap()
}

/// The demo's workload, shorter: 8 tenants with 4096-token system prompts on 4 engines
/// whose caches hold about half of them each.
pub const WORKLOAD: &[&str] = &[
    "--workload",
    "shared-prefix",
    "--max-requests",
    "120",
    "--rate",
    "8",
    "--prefix-tokens",
    "4096",
    "--suffix-tokens",
    "64",
    "--output-tokens",
    "32",
    "--groups",
    "8",
    "--users",
    "64",
];
pub const FLEET: &[&str] = &[
    "--engines",
    "4",
    "--block-size",
    "16",
    "--num-blocks",
    "1024",
];

/// `requests` at `rate` a second from 4 groups sharing 512-token prefixes, 8 output
/// tokens each.
pub fn shared_prefix(requests: usize, rate: f64) -> Vec<Request> {
    WorkloadConfig {
        kind: WorkloadKind::SharedPrefix,
        requests,
        rate,
        prefix_tokens: 512,
        suffix_tokens: 32,
        output_tokens: 8,
        groups: 4,
        ..WorkloadConfig::default()
    }
    .generate()
}

/// The comparison of `routers` on 2 engines (96 blocks each).
pub fn compare_config(routers: Vec<RouterSpec>, out: &Path) -> CompareConfig {
    CompareConfig {
        engine: EngineConfig {
            kvgate_bin: bin(),
            engines: 2,
            block_size: 16,
            // 96 blocks hold two of the four 512-token prefixes plus working space:
            // spreading every group over both engines thrashes, placement does not.
            num_blocks: 96,
            speedup: 10.0,
            seed: 0,
            extra_args: vec![],
            startup_timeout: Duration::from_secs(30),
            pd: None,
        },
        routers,
        model: "mock-model".into(),
        out_dir: out.to_path_buf(),
        run: RunConfig {
            progress: false,
            ..RunConfig::default()
        },
        request_timeout: Duration::from_secs(30),
        router_startup_timeout: Duration::from_secs(30),
        kvgate_extra_args: vec![],
        workload_description: "e2e".into(),
        baseline: "round_robin".into(),
    }
}

/// The folder a test's child processes log to (`ManagedChild::spawn`'s `log_dir`):
/// removed when the test passes; when it fails, kept, and the tail of every child's
/// stderr printed beside the panic, so a failure seen only in CI shows what the
/// processes said.
pub struct ProcessLogs(Option<tempfile::TempDir>);

impl ProcessLogs {
    pub fn new() -> Self {
        Self(Some(tempfile::tempdir().unwrap()))
    }

    pub fn path(&self) -> &Path {
        self.0.as_ref().map(|d| d.path()).unwrap_or(Path::new("."))
    }
}

impl Drop for ProcessLogs {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let Some(dir) = self.0.take() else { return };
        let dir = dir.keep();
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        let mut logs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.to_string_lossy().ends_with(".err.log"))
            .collect();
        logs.sort();
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            eprintln!(
                "--- {} (last 30 lines)\n{}",
                log.display(),
                lines[lines.len().saturating_sub(30)..].join("\n")
            );
        }
    }
}
