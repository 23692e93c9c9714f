//! The simulation agrees with a real-time `kvgate bench compare` of the same fleet and
//! workload (mock engines and `kvgate serve` as processes on loopback): each row's
//! prefix hit rate, and which row has the better TTFT p90. Its own test binary, so no
//! other test of this crate competes for the cores while the real-time run is timed.

mod common;

use common::*;
use kvgate_bench::compare::CompareSummary;

#[test]
fn the_simulation_agrees_with_a_real_time_run_of_the_same_fleet() {
    let (real, sim) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let rows = "round_robin,kv_aware";
    let mut args = vec!["bench", "compare"];
    args.extend(WORKLOAD);
    args.extend(FLEET);
    args.extend([
        "--routers",
        rows,
        "--no-progress",
        "--out-dir",
        real.path().to_str().unwrap(),
    ]);
    kvgate(&args);
    let mut args = vec!["simulate"];
    args.extend(WORKLOAD);
    args.extend(FLEET);
    args.extend([
        "--policies",
        rows,
        "--out-dir",
        sim.path().to_str().unwrap(),
    ]);
    kvgate(&args);
    let (real, sim) = (summary(real.path()), summary(sim.path()));
    let row = |s: &CompareSummary, label: &str| {
        s.rows
            .iter()
            .find(|r| r.label == label)
            .and_then(|r| r.report.clone())
            .unwrap()
    };
    // docs/BENCHMARKS.md measures within 1 point on the reference machine; a busy test
    // machine moves real-time runs more than that. round_robin most: every engine sees
    // every tenant in a cache that holds half of them, so which prefixes survive depends
    // on how many requests are in flight when the CPU is slow (a CI run measured 0.395
    // real against 0.443 simulated); kv_aware keeps each tenant on its holder and moves
    // little.
    for (label, tolerance) in [("round_robin", 0.10), ("kv_aware", 0.04)] {
        let (r, s) = (row(&real, label), row(&sim, label));
        let (hr, hs) = (r.prefix_hit_rate.unwrap(), s.prefix_hit_rate.unwrap());
        assert!(
            (hr - hs).abs() < tolerance,
            "{label}: real hit {hr}, simulated {hs}"
        );
    }
    let hit = |s: &CompareSummary, label: &str| row(s, label).prefix_hit_rate.unwrap();
    for (name, s) in [("real", &real), ("simulated", &sim)] {
        assert!(
            hit(s, "kv_aware") > hit(s, "round_robin") + 0.2,
            "{name}: kv_aware's hit rate well above round_robin's"
        );
    }
    let better =
        |s: &CompareSummary| row(s, "kv_aware").ttft_ms.p90 < row(s, "round_robin").ttft_ms.p90;
    assert!(
        better(&real) && better(&sim),
        "kv_aware's TTFT p90 ranks the same in both"
    );
}
