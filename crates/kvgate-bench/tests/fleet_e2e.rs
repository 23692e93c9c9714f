//! End to end against the real `kvgate` binary (mock engines + gateway as child
//! processes). Opt-in: `cargo build -p kvgate && KVGATE_BIN=target/debug/kvgate cargo
//! test -p kvgate-bench --test fleet_e2e`. Without `KVGATE_BIN` the test says so and
//! passes (a stale binary in target/ must not decide the result).

use std::path::PathBuf;
use std::time::Duration;

use kvgate_bench::compare::{compare, CompareConfig};
use kvgate_bench::fleet::EngineConfig;
use kvgate_bench::routers::RouterSpec;
use kvgate_bench::runner::RunConfig;
use kvgate_bench::workload::{WorkloadConfig, WorkloadKind};

fn kvgate_bin() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("KVGATE_BIN")?);
    if p.is_absolute() {
        Some(p)
    } else {
        // Relative paths are relative to the workspace root.
        Some(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(p),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_round_robin_and_kv_aware_on_shared_prefix() {
    let Some(bin) = kvgate_bin() else {
        eprintln!("skipping: set KVGATE_BIN to a built kvgate binary to run this test");
        return;
    };
    let out = tempfile::tempdir().unwrap();
    let requests = WorkloadConfig {
        kind: WorkloadKind::SharedPrefix,
        requests: 40,
        rate: 20.0,
        prefix_tokens: 512,
        suffix_tokens: 32,
        output_tokens: 8,
        groups: 4,
        ..WorkloadConfig::default()
    }
    .generate();
    let cfg = CompareConfig {
        engine: EngineConfig {
            kvgate_bin: bin,
            engines: 2,
            block_size: 16,
            num_blocks: 4096,
            speedup: 10.0,
            seed: 0,
            extra_args: vec![],
            startup_timeout: Duration::from_secs(30),
        },
        routers: vec![
            RouterSpec::Kvgate("round_robin".into()),
            RouterSpec::Kvgate("kv_aware".into()),
        ],
        model: "mock-model".into(),
        out_dir: out.path().to_path_buf(),
        run: RunConfig {
            progress: false,
            ..RunConfig::default()
        },
        request_timeout: Duration::from_secs(30),
        router_startup_timeout: Duration::from_secs(30),
        kvgate_extra_args: vec![],
        workload_description: "e2e".into(),
        baseline: "round_robin".into(),
    };
    let summary = tokio::time::timeout(Duration::from_secs(120), compare(&cfg, &requests))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(summary.rows.len(), 2);
    for row in &summary.rows {
        assert_eq!(row.status, "ok", "{row:?}");
        let r = row.report.as_ref().unwrap();
        assert_eq!(r.errors, 0, "{row:?}");
        assert_eq!(r.ok, 40);
        assert!(r.prefix_hit_rate.is_some(), "engines report cached_tokens");
        assert_eq!(
            r.per_worker.values().sum::<usize>(),
            40,
            "x-kvgate-worker on every response"
        );
    }
    let hit = |i: usize| {
        summary.rows[i]
            .report
            .as_ref()
            .unwrap()
            .prefix_hit_rate
            .unwrap()
    };
    assert!(
        hit(1) >= hit(0),
        "kv_aware hit rate {} < round_robin {}",
        hit(1),
        hit(0)
    );
    for f in ["compare.md", "compare.json", "ttft.svg"] {
        assert!(out.path().join(f).is_file());
    }
}
