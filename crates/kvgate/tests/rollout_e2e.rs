//! A rolling restart end to end: `kvgate bench compare` restarts a row's three kv_aware
//! replicas one at a time while the load runs. Its own test binary: a replica comes
//! back on the port it left, so nothing else may reserve loopback ports meanwhile (a
//! test beside it starting fleets could take the port in the gap).

mod common;

use std::time::Duration;

use common::{compare_config, shared_prefix};
use kvgate_bench::compare::compare;
use kvgate_bench::routers::RouterSpec;

/// Three kv_aware replicas restarted one at a time while the load runs (`@rollout`: each
/// out of the clients' rotation, drained by SIGTERM, started again under its name,
/// back once ready): every request is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_of_three_replicas_loses_no_request() {
    let out = tempfile::tempdir().unwrap();
    let requests = shared_prefix(160, 16.0);
    let row = "kv_aware@replicas=3@rollout";
    let mut cfg = compare_config(vec![RouterSpec::parse(row).unwrap()], out.path());
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
