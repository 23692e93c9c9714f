//! The fault suite's short form through the real `kvgate` binary: `kvgate bench chaos`
//! runs mock engines and `kvgate serve` as child processes under streaming load while
//! it injects every fault kind once (garbage event frames, an event pause longer than
//! the replay buffer, a cache reset, an engine SIGKILL and restart), with clients that
//! cancel and clients that send oversized bodies, then SIGTERMs the gateway with
//! streams running. Every request must end completed or with a clean OpenAI-style
//! error, and no booking may be left. The long form is in docs/BENCHMARKS.md.

use std::path::PathBuf;
use std::time::Duration;

use kvgate_bench::chaos::{run_chaos, ChaosConfig, FaultKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_ends_cleanly_under_faults_and_no_booking_is_left() {
    let out = tempfile::tempdir().unwrap();
    let cfg = ChaosConfig {
        kvgate_bin: PathBuf::from(env!("CARGO_BIN_EXE_kvgate")),
        engines: 3,
        duration: Duration::from_secs(20),
        concurrency: 8,
        fault_every: Duration::from_secs(4),
        engine_speedup: 10.0,
        seed: 0,
        policy: "kv_aware".into(),
        request_timeout: Duration::from_secs(60),
        out_dir: out.path().to_path_buf(),
        kvgate_extra_args: vec![],
    };
    let s = tokio::time::timeout(Duration::from_secs(240), run_chaos(&cfg))
        .await
        .expect("the fault suite timed out")
        .unwrap();
    let report = kvgate_bench::chaos::render_markdown(&s);
    // Every fault kind was injected, and none failed to inject.
    for kind in [
        FaultKind::GarbageEvents,
        FaultKind::EventPause,
        FaultKind::CacheReset,
        FaultKind::KillRestart,
    ] {
        let f = s
            .faults
            .iter()
            .find(|f| f.kind == kind)
            .unwrap_or_else(|| panic!("{kind:?} not injected:\n{report}"));
        assert!(f.error.is_none(), "{report}");
    }
    let t = &s.tally;
    assert!(t.completed > 200, "{report}");
    assert_eq!(t.silent_failures, 0, "{report}");
    assert_eq!(s.bookings_left, Some(0.0), "{report}");
    assert_eq!(s.worker_in_flight_left, Some(0.0), "{report}");
    assert!(t.cancelled > 0 && t.oversized_sent > 0, "{report}");
    assert_eq!(t.oversized_413, t.oversized_sent, "{report}");
    // The faults reached the gateway and were counted.
    assert!(
        s.events_dropped
            .get("decode_error")
            .is_some_and(|n| *n >= 1.0),
        "{report}"
    );
    assert!(s.index_purges.is_some_and(|n| n >= 1.0), "{report}");
    let kill = s
        .faults
        .iter()
        .find(|f| f.kind == FaultKind::KillRestart)
        .unwrap();
    assert!(kill.used_again_after_s.is_some(), "{report}");
    // SIGTERM with streams running: each ends completed or with an error event.
    assert_eq!(s.sigterm.silent_failures, 0, "{report}");
    assert_eq!(
        s.sigterm.completed + s.sigterm.clean_errors.values().sum::<u64>(),
        8,
        "{report}"
    );
    assert!(s.sigterm_exit_s.is_some(), "{report}");
    assert!(s.passed());
}
