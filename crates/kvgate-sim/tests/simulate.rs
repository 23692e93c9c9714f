//! `kvgate simulate` end to end through the library: determinism, that the routing is
//! the real code, fleet changes, the event path, bypass traffic and the planner.

use std::sync::Arc;

use kvgate_bench::request::Request;
use kvgate_bench::scenario::{ScenarioKind, TenantWorkload};
use kvgate_bench::workload::{WorkloadConfig, WorkloadKind};
use kvgate_sim::cli::engine_config;
use kvgate_sim::plan::{plan, PlanConfig};
use kvgate_sim::report::{report, share_between};
use kvgate_sim::simulation::RequestError;
use kvgate_sim::{
    parse_rows, simulate, ClosedLoop, FleetChange, FleetConfig, Load, SimRow, SimRun, Target,
};

fn fleet(engines: usize, num_blocks: u32) -> FleetConfig {
    FleetConfig {
        engines,
        engine: engine_config(16, num_blocks, 1.0, 0, &[]).unwrap(),
        event_delay_ms: 1.0,
        restart_downtime_ms: 5_000.0,
        changes: Vec::new(),
    }
}

fn row(spec: &str) -> SimRow {
    parse_rows(spec, &[], 16, 0).unwrap().remove(0)
}

/// 8 tenants with 1024-token system prompts at 8 req/s.
fn tenants(requests: usize, seed: u64) -> Vec<Request> {
    tenants_at(requests, 8.0, seed)
}

fn tenants_at(requests: usize, rate: f64, seed: u64) -> Vec<Request> {
    tenants_config(requests, rate, seed).generate()
}

fn tenants_config(requests: usize, rate: f64, seed: u64) -> WorkloadConfig {
    WorkloadConfig {
        kind: WorkloadKind::SharedPrefix,
        requests,
        rate,
        prefix_tokens: 1024,
        suffix_tokens: 32,
        output_tokens: 16,
        groups: 8,
        users: 64,
        seed,
        ..WorkloadConfig::default()
    }
}

fn engines_of(run: &SimRun) -> Vec<Option<usize>> {
    run.records.iter().map(|r| r.engine).collect()
}

fn closed_tenants(kind: ScenarioKind, until_ms: f64) -> Load {
    closed_tenants_by(kind, until_ms, 4)
}

fn closed_tenants_by(kind: ScenarioKind, until_ms: f64, clients: usize) -> Load {
    let shape = kind.shape();
    let w = Arc::new(TenantWorkload::new(&shape, 0));
    Load {
        open: Vec::new(),
        closed: vec![ClosedLoop {
            target: Target::Router,
            clients,
            until_ms,
            first_id: 0,
            source: Arc::new(move |k| w.request(k)),
        }],
    }
}

#[test]
fn the_same_seed_gives_byte_identical_reports() {
    let requests = tenants(200, 1);
    let f = fleet(3, 512);
    for spec in ["round_robin", "least_loaded", "prefix_affinity", "kv_aware"] {
        let r = row(spec);
        let a = simulate(&r.model, &f, &Load::open(&requests)).unwrap();
        let b = simulate(&r.model, &f, &Load::open(&requests)).unwrap();
        let json = |run: &SimRun| serde_json::to_vec(&(report(spec, run), run)).unwrap();
        assert_eq!(json(&a), json(&b), "{spec}: two runs differ");
    }
    // A different seed is a different run (policy ties, engine hashes).
    let seeded = parse_rows("least_loaded", &[], 16, 9).unwrap().remove(0);
    let a = simulate(&row("least_loaded").model, &f, &Load::open(&requests)).unwrap();
    let b = simulate(&seeded.model, &f, &Load::open(&requests)).unwrap();
    assert_ne!(engines_of(&a), engines_of(&b));
}

#[test]
fn rows_route_with_the_real_policy_code_and_its_flags() {
    let requests = tenants(240, 2);
    // Room for about four tenants per engine: the fleet holds them all, one engine not.
    let f = fleet(4, 256);
    let run = |spec: &str| simulate(&row(spec).model, &f, &Load::open(&requests)).unwrap();
    let kv = run("kv_aware");
    let kv_heavy = run("kv_aware@overlap-weight=0.01");
    assert_ne!(
        engines_of(&kv),
        engines_of(&kv_heavy),
        "a policy flag changes routing"
    );
    // kv_aware keeps tenants together: far more prefix hits than round robin.
    let hit = |r: &SimRun| report("x", r).prefix_hit_rate.unwrap();
    let rr = run("round_robin");
    assert!(hit(&kv) > hit(&rr) + 0.2, "kv {} rr {}", hit(&kv), hit(&rr));
    // Round robin is exactly round robin over the sorted engines.
    let seq: Vec<usize> = rr.records.iter().filter_map(|r| r.engine).take(8).collect();
    assert_eq!(seq, [0, 1, 2, 3, 0, 1, 2, 3]);
}

/// A burst of 64 requests on one system prompt to two engines that run 16 sequences a
/// step (vLLM on a small device): the holder's lead ends when its batch is full, so the
/// other engine takes part of the burst; a router told a batch of 1000 sends every
/// request to the holder, TTFT p90 more than doubles, and the report's spread says so
/// (2.0: the idle engine counts).
#[test]
fn a_burst_on_one_prompt_spreads_once_the_holders_batch_is_full() {
    let requests = WorkloadConfig {
        kind: WorkloadKind::SharedPrefix,
        requests: 64,
        rate: 1000.0,
        prefix_tokens: 4096,
        suffix_tokens: 64,
        output_tokens: 64,
        groups: 1,
        users: 32,
        ..WorkloadConfig::default()
    }
    .generate();
    let f = FleetConfig {
        engine: engine_config(16, 8192, 1.0, 0, &["--max-num-seqs=16".into()]).unwrap(),
        ..fleet(2, 8192)
    };
    let run = |model: &kvgate_gateway::config::ModelConfig| {
        report("x", &simulate(model, &f, &Load::open(&requests)).unwrap())
    };
    let told = run(&row("kv_aware").model);
    let mut wrong = row("kv_aware").model;
    wrong.max_num_seqs = 1000;
    let untold = run(&wrong);
    assert_eq!(
        untold.per_worker.values().filter(|n| **n == 0).count(),
        1,
        "{:?}",
        untold.per_worker
    );
    assert_eq!(untold.worker_spread, Some(2.0));
    assert!(told.worker_spread.unwrap() < 1.2, "{:?}", told.per_worker);
    let p90 = |r: &kvgate_bench::report::Report| r.ttft_ms.p90;
    assert!(
        p90(&untold) > 2.0 * p90(&told),
        "{} against {}",
        p90(&untold),
        p90(&told)
    );
}

/// The routing decisions of one fixed run, summarised. If this test fails, the
/// routing code changed (a policy, the index, the ledger, the credit) or the engine
/// simulation did: the simulation runs the real code, so it must notice. When the
/// change is intended, take the new value from the failure message.
#[test]
fn a_change_of_routing_code_changes_the_simulation() {
    // Loaded, short of cache and with long outputs, so that every term of the cost
    // (cached prefix, locality lead, queued prefill, decode load, credit) decides
    // somewhere.
    let requests = WorkloadConfig {
        output_tokens: 192,
        ..tenants_config(300, 12.0, 3)
    }
    .generate();
    let run = simulate(
        &row("kv_aware").model,
        &fleet(3, 256),
        &Load::open(&requests),
    )
    .unwrap();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for r in &run.records {
        for b in [
            r.engine.unwrap_or(99) as u64,
            u64::from(r.cached_tokens.unwrap_or(0)),
        ] {
            h = (h ^ b).wrapping_mul(0x0100_0000_01b3);
        }
    }
    const EXPECTED: u64 = 0xd57a_db36_104f_344d;
    assert_eq!(
        h, EXPECTED,
        "kv_aware's decisions on the fixed workload changed: fingerprint {h:#x}"
    );
}

#[test]
fn kv_events_reach_the_index_after_the_configured_delay() {
    let requests = tenants(240, 4);
    // Only the index (and the credit while a prompt is in prefill) keeps a tenant on
    // the engine that cached it.
    let kv = row("kv_aware");
    let prompt = fleet(4, 256);
    let never = FleetConfig {
        event_delay_ms: 1e9,
        ..prompt.clone()
    };
    let hit = |f: &FleetConfig| {
        report(
            "kv",
            &simulate(&kv.model, f, &Load::open(&requests)).unwrap(),
        )
        .prefix_hit_rate
        .unwrap()
    };
    let (on_time, blind) = (hit(&prompt), hit(&never));
    assert!(
        on_time > blind + 0.3,
        "with events {on_time}, without {blind}"
    );
}

#[test]
fn an_added_engine_gets_traffic_and_a_restarted_one_fails_or_moves_its_requests_then_serves() {
    let kv = row("kv_aware");
    let mut f = fleet(1, 2048);
    f.changes = vec![FleetChange::parse("8s:add").unwrap()];
    let run = simulate(
        &kv.model,
        &f,
        &closed_tenants(ScenarioKind::Added, 30_000.0),
    )
    .unwrap();
    assert_eq!(run.engine_names, ["engine-0", "engine-1"]);
    let share = share_between(&run, 1, 8_000.0, 18_000.0).unwrap();
    assert!(
        share >= 0.25,
        "the added engine got {share} of the next 10 s"
    );
    assert_eq!(share_between(&run, 1, 0.0, 8_000.0), Some(0.0));

    // Restarts at several moments, so that some catch requests still waiting for
    // their first token and some catch streams under way.
    let restarted_at = |ms: u32| {
        let mut f = fleet(2, 2048);
        f.changes = vec![FleetChange::parse(&format!("{ms}ms:restart=1")).unwrap()];
        let run = simulate(
            &kv.model,
            &f,
            &closed_tenants_by(ScenarioKind::Restart, 30_000.0, 16),
        )
        .unwrap();
        (f64::from(ms), run)
    };
    let (mut died, mut moved) = (0, 0);
    for ms in (8_000..8_400).step_by(40) {
        let (at, run) = restarted_at(ms);
        for r in &run.records {
            if r.error == Some(RequestError::EngineDied) {
                // A stream under way on the dead engine fails.
                assert!(r.engine == Some(1) && r.done_ms == Some(at) && r.first_token_ms.is_some());
                died += 1;
            }
            if r.failed_over_from == Some(1) {
                // A request still waiting for its first token goes to the other
                // engine, as the gateway fails over an answer that has not begun.
                assert!(r.engine == Some(0) && r.error.is_none() && r.sent_ms < at);
                assert!(r.first_token_ms.is_some_and(|t| t > at), "{r:?}");
                moved += 1;
            }
        }
    }
    assert!(died > 0 && moved > 0, "{died} failed, {moved} moved");
    let (_, run) = restarted_at(8_000);
    // Gone for the downtime, then back in rotation and serving.
    assert_eq!(share_between(&run, 1, 8_001.0, 13_000.0), Some(0.0));
    let back = run.changes[0].at_ms;
    assert_eq!(back, 13_000.0);
    assert!(share_between(&run, 1, back, back + 10_000.0).unwrap() > 0.2);
    // Every booking was freed: the prediction stayed honest across the restart.
    let rep = report("kv", &run);
    let ratio = rep.predicted_over_reported().unwrap();
    assert!((0.95..=1.05).contains(&ratio), "predicted/reported {ratio}");
}

#[test]
fn a_cache_reset_is_seen_through_the_events_and_predictions_stay_honest() {
    let kv = row("kv_aware");
    let mut f = fleet(2, 2048);
    f.changes = vec![FleetChange::parse("8s:reset=0").unwrap()];
    let run = simulate(
        &kv.model,
        &f,
        &closed_tenants(ScenarioKind::Reset, 30_000.0),
    )
    .unwrap();
    let rep = report("kv", &run);
    assert_eq!(rep.errors, 0);
    let ratio = rep.predicted_over_reported().unwrap();
    assert!((0.95..=1.05).contains(&ratio), "predicted/reported {ratio}");
    // Right after the reset, a request routed to engine 0 is not promised its cache.
    let after: Vec<_> = run
        .records
        .iter()
        .filter(|r| r.engine == Some(0) && r.sent_ms > 8_002.0 && r.sent_ms < 8_100.0)
        .collect();
    assert!(after
        .iter()
        .all(|r| r.predicted_cached_tokens <= r.cached_tokens));
}

#[test]
fn bypass_traffic_is_served_but_not_reported_as_routed() {
    let requests = tenants(200, 5);
    let mut load = Load::open(&requests);
    for (i, (_, target)) in load.open.iter_mut().enumerate() {
        if i % 4 == 0 {
            *target = Target::Engine(1);
        }
    }
    let run = simulate(&row("kv_aware").model, &fleet(2, 1024), &load).unwrap();
    let direct = run
        .records
        .iter()
        .filter(|r| r.target == Target::Engine(1))
        .count();
    assert_eq!(direct, 50);
    assert!(run
        .records
        .iter()
        .filter(|r| r.target == Target::Engine(1))
        .all(|r| r.engine == Some(1) && r.predicted_cached_tokens.is_none()));
    let rep = report("kv", &run);
    assert_eq!(rep.requests, 150);
}

#[test]
fn plan_finds_the_smallest_fleet_that_meets_the_target() {
    let requests = WorkloadConfig {
        kind: WorkloadKind::NoSharing,
        requests: 200,
        rate: 20.0,
        prefix_tokens: 2048,
        suffix_tokens: 0,
        output_tokens: 16,
        ..WorkloadConfig::default()
    }
    .generate();
    let kv = row("least_loaded");
    let cfg = PlanConfig {
        ttft_p90_ms: 120.0,
        max_engines: 16,
        num_blocks_options: vec![4096],
    };
    let result = plan(&kv, &fleet(1, 4096), &Load::open(&requests), &cfg).unwrap();
    let n = result.smallest[&4096].expect("met within 16 engines");
    let at = |e: usize| result.points.iter().find(|p| p.engines == e);
    assert!(at(n).unwrap().meets);
    assert!(
        n > 1,
        "one engine cannot prefill 20 × 2048 tokens/s in time"
    );
    assert!(
        !at(n - 1).unwrap().meets,
        "the engine count below was measured and missed"
    );
    assert!(result.render_markdown().contains(&format!("{n} engines")));
}

/// A scenario's workload with 400-block caches on two engines, 120 virtual seconds
/// (`kvgate simulate scenarios --num-blocks 400 --duration 120`): the prefix hit rate of
/// a row spec on `seed`.
fn scenario_400_hit(kind: ScenarioKind, seed: u64) -> impl Fn(&str) -> f64 {
    let shape = kvgate_bench::scenario::Shape {
        num_blocks: 400,
        ..kind.shape()
    };
    let w = Arc::new(TenantWorkload::new(&shape, seed));
    let load = Load {
        open: Vec::new(),
        closed: vec![ClosedLoop {
            target: Target::Router,
            clients: 4,
            until_ms: 120_000.0,
            first_id: 0,
            source: Arc::new(move |k| w.request(k)),
        }],
    };
    let f = FleetConfig {
        engines: 2,
        engine: engine_config(16, 400, 1.0, seed, &[]).unwrap(),
        event_delay_ms: 1.0,
        restart_downtime_ms: 5_000.0,
        changes: Vec::new(),
    };
    move |spec: &str| {
        let r = parse_rows(spec, &[], 16, seed).unwrap().remove(0);
        let run = simulate(&r.model, &f, &load).unwrap();
        report(spec, &run).prefix_hit_rate.unwrap()
    }
}

/// Under cache pressure (the steady scenario's 8 tenants on two engines that hold
/// about four each), kv_aware must not pile tenants on one engine: prefix_affinity's
/// partition of the tenants is the bar (`kvgate simulate scenarios --scenarios steady
/// --num-blocks 400 --duration 120 --seed 2`).
#[test]
fn kv_aware_spreads_tenants_that_one_cache_cannot_hold() {
    let hit = scenario_400_hit(ScenarioKind::Steady, 2);
    let kv = hit("kv_aware");
    let pa = hit("prefix_affinity");
    eprintln!("kv_aware {kv}, prefix_affinity {pa}");
    assert!(
        kv >= pa - 0.02,
        "kv_aware {kv} against prefix_affinity {pa}"
    );
}

/// The router reads each engine's queue as the gateway scrapes its metrics: requests
/// sent straight to engine 1 count as its load, so least_loaded sends fewer of its own
/// there than when it reads nothing (`--engine-metrics-interval-ms 0`).
#[test]
fn requests_that_bypass_the_router_count_as_load_through_the_engines_metrics() {
    let requests = tenants_at(400, 16.0, 3);
    let mut load = Load::open(&requests);
    for (i, (_, target)) in load.open.iter_mut().enumerate() {
        if i % 2 == 0 {
            *target = Target::Engine(1);
        }
    }
    let routed_to_engine_1 = |spec: &str| {
        let run = simulate(&row(spec).model, &fleet(2, 1024), &load).unwrap();
        run.records
            .iter()
            .filter(|r| r.target == Target::Router && r.engine == Some(1))
            .count()
    };
    let reading = routed_to_engine_1("least_loaded");
    let blind = routed_to_engine_1("least_loaded@engine-metrics-interval-ms=0");
    assert!(
        reading * 2 < blind,
        "routed to the bypassed engine: {reading} reading its queue, {blind} blind"
    );
}
