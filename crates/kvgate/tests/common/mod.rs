//! Helpers of the binary's end-to-end tests: the binary's path and running it, reading
//! a comparison's JSON, and the workload and fleet both the simulated and the
//! real-time `kvgate simulate` runs use.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kvgate_bench::compare::CompareSummary;

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
