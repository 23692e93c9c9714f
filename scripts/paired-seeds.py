#!/usr/bin/env python3
"""Paired-seed comparison of policy rows in `kvgate simulate`.

Runs the scenario suite (`kvgate simulate scenarios`), or each `--workload NAME=FLAGS`
(`kvgate simulate FLAGS`), once per seed with every row (virtual time: one seed of the
whole suite takes well under a second), then, per scenario or workload and row,
prints the mean TTFT p50 and p90, requests served and hit rate, and each row's paired
difference from the reference row (the first) with its standard error over seeds. A
row is worse than the reference only where its difference is beyond one standard
error on the wrong side (docs/BENCHMARKS.md's rule).

    scripts/paired-seeds.py --seeds 128 --num-blocks 400 \
        --policies kv_aware,prefix_affinity --before /tmp/old-kvgate=kv_aware

    scripts/paired-seeds.py --seeds 8 --policies kv_aware,prefix_affinity \
        --workload "window=--trace traces/mooncake/conversation_trace.jsonl --max-requests 1000 --speedup 4 --engines 4"

With --real, each workload runs in real time instead (`kvgate bench compare FLAGS
--routers ROWS --seed S`: simulated engines, real routers, peers and Envoy rows too),
one seed after another; minutes a seed, so a few seeds:

    scripts/paired-seeds.py --real --seeds 3 --policies kv_aware,envoy:kv_aware,envoy:round_robin \
        --workload "demo=--workload shared-prefix --max-requests 240 --rate 8 --engines 4"

Markdown goes to stdout; --json also writes every seed's numbers.
"""

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

METRICS = [
    # (key, label, lower is better)
    ("ttft_p50", "TTFT p50 ms", True),
    ("ttft_p90", "TTFT p90 ms", True),
    ("served", "served", False),
    ("hit", "hit %", False),
    ("goodput", "goodput req/s", False),
    ("ttft_error", "TTFT prediction error p50 %", True),
]


def report_numbers(r):
    return {
        "ttft_p50": r["ttft_ms"]["p50"],
        "ttft_p90": r["ttft_ms"]["p90"],
        "served": r["ok"],
        "hit": 100.0 * (r["prefix_hit_rate"] or 0.0),
        # Requests answered within their TTFT objective per second (0 without objectives).
        "goodput": r.get("goodput_per_s") or 0.0,
        "ttft_error": 100.0 * ((r.get("ttft_prediction_error") or {}).get("p50") or 0.0),
    }


def one_workload(args, seed, name, flags):
    with tempfile.TemporaryDirectory() as out:
        if args.real:
            cmd = [args.kvgate, "bench", "compare", *shlex.split(flags), "--seed", str(seed),
                   "--routers", args.policies, "--out-dir", out, "--no-progress",
                   "--log", "error"]
        else:
            cmd = [args.kvgate, "simulate", *shlex.split(flags), "--seed", str(seed),
                   "--policies", args.policies, "--out-dir", out, "--log", "error"]
        for a in args.kvgate_arg:
            cmd.append(f"--kvgate-arg={a}")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "compare.json")) as f:
            rows = json.load(f)["rows"]
    return {(name, row["label"]): report_numbers(row["report"]) for row in rows}


def one_seed(args, seed):
    result = one_build(args, seed)
    for other in args.before:
        prefix, binary, policies = other_build(other)
        theirs = argparse.Namespace(**{**vars(args), "kvgate": binary, "policies": policies})
        for (scenario, label), numbers in one_build(theirs, seed).items():
            result[(scenario, f"{prefix}:{label}")] = numbers
    return result


def other_build(spec):
    """`[PREFIX:]KVGATE=POLICIES` -> (prefix, binary, policies); prefix `before`."""
    binary, _, policies = spec.partition("=")
    prefix, _, path = binary.rpartition(":")
    return prefix or "before", path, policies


def one_build(args, seed):
    if args.workload:
        result = {}
        for w in args.workload:
            name, _, flags = w.partition("=")
            result.update(one_workload(args, seed, name, flags))
        return result
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            args.kvgate, "simulate", "scenarios", "--seed", str(seed),
            "--duration", str(args.duration), "--policies", args.policies,
            "--out-dir", out, "--log", "error",
        ]
        if args.num_blocks:
            cmd += ["--num-blocks", str(args.num_blocks)]
        if args.scenarios:
            cmd += ["--scenarios", args.scenarios]
        if args.concurrency:
            cmd += ["--concurrency", str(args.concurrency)]
        for a in args.kvgate_arg:
            cmd.append(f"--kvgate-arg={a}")
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "scenarios.json")) as f:
            suite = json.load(f)
    result = {}
    for scenario in suite:
        for row in scenario["rows"]:
            result[(scenario["scenario"], row["label"])] = report_numbers(row["report"])
    return result


def mean_se(xs):
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, math.sqrt(var / n)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kvgate", default="target/release/kvgate")
    p.add_argument("--seeds", type=int, default=32)
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--num-blocks", type=int, default=0, help="0: each scenario's own")
    p.add_argument("--duration", type=float, default=60)
    p.add_argument("--scenarios", default="")
    p.add_argument("--concurrency", type=int, default=0, help="0: the suite's own")
    p.add_argument("--policies", required=True, help="rows; the first is the reference")
    p.add_argument("--kvgate-arg", action="append", default=[])
    p.add_argument("--workload", action="append", default=[],
                   help="NAME=FLAGS: `kvgate simulate FLAGS` instead of the scenario suite (repeatable)")
    p.add_argument("--before", action="append", default=[],
                   help="[PREFIX:]KVGATE=POLICIES: rows from another build, labelled PREFIX:ROW "
                   "(PREFIX `before` unless given; repeatable)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--json", help="also write every seed's numbers here")
    p.add_argument("--real", action="store_true",
                   help="each --workload in real time (kvgate bench compare), one seed at a time")
    args = p.parse_args()
    if args.real:
        if not args.workload:
            p.error("--real runs --workload rows")
        args.jobs = 1

    seeds = range(args.first_seed, args.first_seed + args.seeds)
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = list(pool.map(lambda s: one_seed(args, s), seeds))
    labels = [s.strip() for s in args.policies.split(",") if s.strip()]
    for other in args.before:
        prefix, _, policies = other_build(other)
        labels += [f"{prefix}:{s.strip()}" for s in policies.split(",") if s.strip()]
    reference = labels[0]
    scenarios = list(dict.fromkeys(k[0] for k in runs[0]))

    cmd = " ".join(sys.argv[1:])
    print(f"`scripts/paired-seeds.py {cmd}`: {len(runs)} seeds; "
          f"each cell: mean (paired difference from {reference}, its SE); "
          "**bold**: worse than the reference beyond one SE\n")
    print("| scenario | row | " + " | ".join(m[1] for m in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    worse = []
    for sc in scenarios:
        for label in labels:
            cells = []
            for key, _, lower_better in METRICS:
                xs = [r[(sc, label)][key] for r in runs]
                m, _ = mean_se(xs)
                if label == reference:
                    cells.append(f"{m:.1f}")
                    continue
                diffs = [r[(sc, label)][key] - r[(sc, reference)][key] for r in runs]
                d, se = mean_se(diffs)
                is_worse = (d > se) if lower_better else (d < -se)
                cell = f"{m:.1f} ({d:+.1f}, {se:.1f})"
                if is_worse:
                    cell = f"**{cell}**"
                    worse.append((sc, label, key))
                cells.append(cell)
            print(f"| {sc} | {label} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seeds": list(seeds), "runs": [
                {f"{k[0]}|{k[1]}": v for k, v in r.items()} for r in runs]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
