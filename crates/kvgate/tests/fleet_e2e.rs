//! End to end through the real `kvgate` binary: `kvgate bench compare` starts mock
//! engines and `kvgate serve` as child processes, replays a shared-prefix workload
//! through round_robin and kv_aware, and checks every request succeeded, every
//! response named its worker, the engines reported cached tokens, and kv_aware reached
//! a higher prefix hit rate on engines too small to cache every prefix.

use std::path::PathBuf;
use std::time::Duration;

use kvgate_bench::compare::{compare, CompareConfig};
use kvgate_bench::fleet::EngineConfig;
use kvgate_bench::routers::RouterSpec;
use kvgate_bench::runner::RunConfig;
use kvgate_bench::workload::{WorkloadConfig, WorkloadKind};

/// `requests` at `rate` a second from 4 groups sharing 512-token prefixes, 8 output
/// tokens each.
fn shared_prefix(requests: usize, rate: f64) -> Vec<kvgate_bench::request::Request> {
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
fn config(routers: Vec<RouterSpec>, out: &std::path::Path) -> CompareConfig {
    CompareConfig {
        engine: EngineConfig {
            kvgate_bin: PathBuf::from(env!("CARGO_BIN_EXE_kvgate")),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_round_robin_and_kv_aware_on_shared_prefix() {
    let out = tempfile::tempdir().unwrap();
    let requests = shared_prefix(40, 20.0);
    let routers = vec![
        RouterSpec::Kvgate("round_robin".into()),
        RouterSpec::Kvgate("kv_aware".into()),
    ];
    let cfg = config(routers, out.path());
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
    eprintln!(
        "prefix hit: round_robin {:.3}, kv_aware {:.3}",
        hit(0),
        hit(1)
    );
    assert!(
        hit(1) > hit(0),
        "kv_aware hit rate {} < round_robin {}",
        hit(1),
        hit(0)
    );
    for f in ["compare.md", "compare.json", "ttft.svg"] {
        assert!(out.path().join(f).is_file());
    }
}

/// Three kv_aware replicas restarted one at a time while the load runs (`@rollout`: each
/// out of the clients' rotation, drained by SIGTERM, started again under its name,
/// back once ready): every request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_three_replicas_loses_no_request() {
    let out = tempfile::tempdir().unwrap();
    let requests = shared_prefix(160, 16.0);
    let row = "kv_aware@replicas=3@rollout";
    let mut cfg = config(vec![RouterSpec::parse(row).unwrap()], out.path());
    cfg.baseline = row.into();
    let summary = tokio::time::timeout(Duration::from_secs(120), compare(&cfg, &requests))
        .await
        .unwrap()
        .unwrap();
    let r = summary.rows[0].report.as_ref().unwrap();
    assert_eq!((r.ok, r.errors), (160, 0), "{:?}", summary.rows[0]);
    let logs = out.path().join("logs").join("kv_aware-replicas-3-rollout");
    let rolled = std::fs::read_dir(&logs)
        .unwrap()
        .filter(|e| {
            let name = e.as_ref().unwrap().file_name();
            name.to_string_lossy().ends_with("-rolled.err.log")
        })
        .count();
    assert_eq!(rolled, 3, "each replica restarted once");
}
