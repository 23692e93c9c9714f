//! The fleet-change scenarios through the real `kvgate` binary, in a short form:
//! `kvgate bench scenarios` starts mock engines and `kvgate serve` as child processes
//! and changes the fleet under load. Checks what kv_aware promises when the fleet
//! changes: an engine added under load gets at least half its fair share within 10 s,
//! predictions of cached tokens stay within 5% of what the engines report, and an
//! engine that hangs holds no request longer than the health checks take to see it.

use std::path::PathBuf;
use std::time::Duration;

use kvgate_bench::fleet::EngineConfig;
use kvgate_bench::routers::RouterSpec;
use kvgate_bench::scenario::{run_scenarios, ScenarioConfig, ScenarioKind, ScenarioSummary};

fn config(out: &std::path::Path, routers: &[&str]) -> ScenarioConfig {
    ScenarioConfig {
        engine: EngineConfig {
            kvgate_bin: PathBuf::from(env!("CARGO_BIN_EXE_kvgate")),
            engines: 2,
            block_size: 16,
            num_blocks: 0,
            speedup: 1.0,
            seed: 0,
            extra_args: vec![],
            startup_timeout: Duration::from_secs(30),
            pd: None,
        },
        num_blocks_override: None,
        routers: routers
            .iter()
            .map(|r| RouterSpec::parse(r).unwrap())
            .collect(),
        model: "mock-model".into(),
        out_dir: out.to_path_buf(),
        duration: Duration::from_secs(16),
        concurrency: 4,
        change_at: Duration::from_secs(3),
        request_timeout: Duration::from_secs(60),
        router_startup_timeout: Duration::from_secs(30),
        kvgate_extra_args: vec![],
    }
}

fn row<'a>(s: &'a ScenarioSummary, label: &str) -> &'a kvgate_bench::scenario::ScenarioRow {
    s.rows
        .iter()
        .find(|r| r.label == label)
        .unwrap_or_else(|| panic!("no row {label}: {s:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_added_engine_gets_its_share_and_predictions_stay_honest() {
    let out = tempfile::tempdir().unwrap();
    let cfg = config(out.path(), &["kv_aware"]);
    let summaries = tokio::time::timeout(
        Duration::from_secs(120),
        run_scenarios(&cfg, &[ScenarioKind::Added]),
    )
    .await
    .expect("scenario timed out")
    .unwrap();
    let kv = row(&summaries[0], "kv_aware");
    let report = kv.report.as_ref().unwrap_or_else(|| panic!("{kv:?}"));
    assert_eq!(report.errors, 0, "{:?}", report.errors_by_kind);
    let share = kv.watched_share.unwrap();
    assert!(
        share >= 0.25,
        "the added engine got {share:.3} of requests in the 10 s after it joined (fair share 0.5)"
    );
    let ratio = kv.predicted_over_reported.unwrap();
    assert!(
        (0.95..=1.05).contains(&ratio),
        "predicted / reported cached tokens {ratio}"
    );
    assert!(out.path().join("added-share.svg").is_file());
    assert!(std::fs::read_to_string(out.path().join("scenarios.md"))
        .unwrap()
        .contains("| kv_aware |"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_holds_no_request_past_the_health_bound() {
    let out = tempfile::tempdir().unwrap();
    let cfg = config(out.path(), &["kv_aware"]);
    let summaries = tokio::time::timeout(
        Duration::from_secs(120),
        run_scenarios(&cfg, &[ScenarioKind::Restart]),
    )
    .await
    .expect("scenario timed out")
    .unwrap();
    let kv = row(&summaries[0], "kv_aware");
    let report = kv.report.as_ref().unwrap_or_else(|| panic!("{kv:?}"));
    // Streams already under way on the engine when it hung end with an error event
    // (at most one per slot); requests still waiting for their first event fail over.
    assert!(
        report.errors <= cfg.concurrency,
        "{} errors: {:?}",
        report.errors,
        report.errors_by_kind
    );
    // Health defaults: a probe every 2 s, 1 s timeout, 3 failures to declare it dead.
    let bound_ms = (3 * 2_000 + 1_000 + 2_000) as f64;
    assert!(
        report.e2e_ms.max < bound_ms,
        "a request took {} ms with the engine hung",
        report.e2e_ms.max
    );
    assert!(report.ok > 50, "{report:?}");
    // The requests split by when they were sent: before the hang, while the engine was
    // hung or restarting, after it was back.
    let phases = kv
        .phases
        .expect("a scenario with a change reports its phases");
    let sent = [phases.before.sent, phases.during.sent, phases.after.sent];
    assert!(sent.iter().all(|n| *n > 0), "{phases:?}");
    assert_eq!(sent.iter().sum::<usize>(), report.requests, "{phases:?}");
    // The row's request log: one line per request, naming who answered. The mock
    // engine's answer ids carry its process id, so the engine that stayed up, the one
    // that hung and its restart are three responders.
    let log =
        std::fs::read_to_string(out.path().join("logs/restart/kv_aware/requests.jsonl")).unwrap();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), report.requests);
    let responders: std::collections::BTreeSet<&str> = lines
        .iter()
        .filter_map(|l| l["response_id"].as_str())
        .filter_map(|id| id.split('-').nth(2))
        .collect();
    assert_eq!(responders.len(), 3, "{responders:?}");
    assert!(lines
        .iter()
        .all(|l| l["tenant"].as_u64().is_some_and(|t| t < 8)));
}
