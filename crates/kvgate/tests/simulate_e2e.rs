//! `kvgate simulate` through the real binary: the same command twice writes the same
//! bytes; `plan` and `scenarios` run. (Agreement with a real-time run:
//! `simulate_fidelity_e2e.rs`.)

mod common;

use common::*;

#[test]
fn the_same_command_writes_the_same_report() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for dir in [&a, &b] {
        let mut args = vec!["simulate"];
        args.extend(WORKLOAD);
        args.extend(FLEET);
        args.extend([
            "--policies",
            "round_robin,kv_aware,kv_aware@locality-weight=0",
            "--change",
            "5s:add",
            "--out-dir",
            dir.path().to_str().unwrap(),
        ]);
        let table = kvgate(&args);
        assert!(table.contains("| kv_aware@locality-weight=0 |"), "{table}");
    }
    for file in ["compare.json", "compare.md", "ttft.svg", "report.html"] {
        let read = |d: &tempfile::TempDir| std::fs::read(d.path().join(file)).unwrap();
        assert_eq!(read(&a), read(&b), "{file} differs between two runs");
    }
    let s = summary(a.path());
    let rep = s.rows[1].report.as_ref().unwrap();
    assert_eq!(rep.ok, 120);
    assert!(
        rep.per_worker.contains_key("engine-4"),
        "the added engine served"
    );
}

#[test]
fn plan_and_scenarios_run_from_the_command_line() {
    let mut args = vec!["simulate", "plan"];
    args.extend(WORKLOAD);
    args.extend([
        "--ttft-p90-ms",
        "100",
        "--max-engines",
        "8",
        "--num-blocks",
        "1024",
    ]);
    let table = kvgate(&args);
    assert!(table.contains("| engines |"), "{table}");
    assert!(table.contains("With 1024 KV blocks per engine:"), "{table}");

    let dir = tempfile::tempdir().unwrap();
    let md = kvgate(&[
        "simulate",
        "scenarios",
        "--scenarios",
        "added,reset",
        "--duration",
        "12",
        "--out-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(md.contains("### added") && md.contains("### reset"), "{md}");
    for f in ["scenarios.md", "scenarios.json", "added-share.svg"] {
        assert!(dir.path().join(f).exists(), "{f}");
    }
    // Each row's request log, as `kvgate bench scenarios` writes it: one line per
    // request sent through the router, with its tenant and the engine that served it.
    let summary: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("scenarios.json")).unwrap()).unwrap();
    let added = summary
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["scenario"] == "added")
        .unwrap();
    let kv_aware = added["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["label"] == "kv_aware")
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("logs/added/kv_aware/requests.jsonl"))
        .expect("the kv_aware row's request log");
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines.len() as u64,
        kv_aware["report"]["requests"].as_u64().unwrap()
    );
    assert!(lines
        .iter()
        .all(|l| l["tenant"].as_u64().is_some_and(|t| t < 8)));
    let served_by_added_engine = lines.iter().filter(|l| l["worker"] == "engine-1").count();
    assert!(
        served_by_added_engine > 0,
        "the added engine served nothing: {log}"
    );
    assert!(lines
        .iter()
        .all(|l| l["worker"] == "engine-0" || l["worker"] == "engine-1"));
}
