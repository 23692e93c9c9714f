//! End to end through the real `kvgate` binary: `kvgate bench compare` starts mock
//! engines and `kvgate serve` as child processes, replays a shared-prefix workload
//! through round_robin and kv_aware, and checks every request succeeded, every
//! response named its worker, the engines reported cached tokens, and kv_aware reached
//! a higher prefix hit rate on engines too small to cache every prefix; each request's
//! TTFT receipt is in its router's log, which scripts/ttft-floor.py reads.

mod common;

use std::time::Duration;

use common::{compare_config as config, shared_prefix};
use kvgate_bench::compare::compare;
use kvgate_bench::routers::RouterSpec;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compare_round_robin_and_kv_aware_on_shared_prefix() {
    let out = tempfile::tempdir().unwrap();
    let requests = shared_prefix(40, 20.0);
    let routers = vec![
        RouterSpec::Kvgate("round_robin".into()),
        RouterSpec::Kvgate("kv_aware".into()),
    ];
    let mut cfg = config(routers, out.path());
    // Each TTFT receipt logged (the time model's diagnosis: scripts/ttft-floor.py).
    cfg.kvgate_extra_args = ["--log", "info,kvgate::ttft=debug", "--log-json"]
        .map(String::from)
        .to_vec();
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
    // Every routed request's receipt is in its router's log, as the script reads it.
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/ttft-floor.py");
    let mut logs = 0;
    let rows = std::fs::read_dir(out.path().join("logs")).unwrap();
    let files = rows.flat_map(|row| std::fs::read_dir(row.unwrap().path()).unwrap());
    for entry in files {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        if !text.contains("\"ttft receipt\"") {
            continue;
        }
        logs += 1;
        let floor = std::process::Command::new("python3")
            .arg(script)
            .arg(&path)
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&floor.stdout);
        assert!(floor.status.success(), "{said} {floor:?}");
        assert!(
            said.starts_with("40 receipts: "),
            "{}: {said}",
            path.display()
        );
    }
    assert_eq!(logs, 2, "one log of receipts per router");
}
