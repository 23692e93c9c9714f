"""Routers side by side inside Ray Serve, on one mock fleet and one workload.

Starts a local Ray (loopback), and for each router deploys the same application
(tests/serve_app.py: an ingress that tokenizes for kvgate, N engine replicas each
fronting a `kvgate mock-engine` with real KV events) with fresh engines, replays the
same multi-tenant workload against it over HTTP, and reports TTFT p50/p90/p99 at the
client, the engines' reported prefix hit rate (cached / prompt tokens from `usage`),
and the router's own time per `choose_replicas` call (measured in the ingress process
where the handle's router runs). Routers: Ray's default PowerOfTwoChoices, Ray's
PrefixCacheAffinityRouter (text prefix tree), kvgate.ray:KVAwareRequestRouter (with
its service in the router's process, and `kvgate_actor`: in the deployment's actor).

Workload: T tenants, each with its own long system prompt, tenant popularity Zipf(s);
every request is a tenant's system prompt plus a unique question, Poisson arrivals.
The engines' caches (--num-blocks each) hold well under all tenants' prefixes.

    python crates/kvgate-py/bench/ray_routers.py --duration 60 --rate 12
"""

import argparse
import asyncio
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
sys.path.insert(0, str(TESTS))

import aiohttp  # noqa: E402
import ray  # noqa: E402
from ray import serve  # noqa: E402

from conftest import REPO, free_port  # noqa: E402
from serve_app import build_app  # noqa: E402
from workload import WORDS, pct, tenant_prompt  # noqa: E402

ROUTERS = {
    "pow2": ("serve_app:TimedPow2", {}),
    "prefix_tree": ("serve_app:TimedPrefixTree", {}),
    "kvgate": ("serve_app:TimedKvgate", {"block_size": 16}),
    # The service in the deployment's actor: one shared ledger, an actor call per request.
    "kvgate_actor": ("serve_app:TimedKvgate", {"block_size": 16, "placement": "actor"}),
}

def workload(args):
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.tenants)]
    n = int(args.rate * args.duration)
    t = 0.0
    out = []
    for i in range(n):
        t += rng.expovariate(args.rate)
        tenant = rng.choices(range(args.tenants), weights)[0]
        question = f"Question {i}: " + " ".join(rng.choice(WORDS) for _ in range(12))
        out.append((t, tenant, question))
    return out


async def one(session, url, system, question, max_tokens):
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    start = time.perf_counter()
    ttft, usage, timing, replica = None, None, {}, None
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            return {"error": resp.status}
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith(": replica="):
                replica = line.split("=", 1)[1]
            if line.startswith(": tokenize_ms="):
                timing = dict(kv.split("=") for kv in line[2:].split())
            if line.startswith("data:") and line != "data: [DONE]":
                if ttft is None:
                    ttft = time.perf_counter() - start
                event = json.loads(line[5:])
                if "error" in event:
                    return {"error": event["error"].get("code")}
                if event.get("usage"):
                    usage = event["usage"]
    if ttft is None or usage is None:
        return {"error": "incomplete"}
    return {
        "t": start,
        "ttft": ttft,
        "prompt": usage["prompt_tokens"],
        "cached": usage["prompt_tokens_details"]["cached_tokens"],
        "replica": replica,
        "tokenize_ms": float(timing.get("tokenize_ms", "nan")),
        "first_item_ms": float(timing.get("first_item_ms", "nan")),
    }


async def drive(base, prefix, reqs, systems, max_tokens):
    url = f"{base}/{prefix}/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
        # Warm-up: one request per replica's worth so routers have learnt the fleet.
        await one(s, url, "warm up", "hello", 2)
        await asyncio.sleep(2.0)
        async with s.get(f"{base}/{prefix}/router_stats") as r:
            await r.json()  # clear the warm-up's timings
        start = time.perf_counter()

        async def at(t, tenant, q):
            await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
            r = await one(s, url, systems[tenant], q, max_tokens)
            r["tenant"] = tenant
            if "t" in r:
                r["t"] -= start
            return r

        results = await asyncio.gather(*(at(*r) for r in reqs))
        async with s.get(f"{base}/{prefix}/router_stats") as r:
            router = await r.json()
    return results, router


def _without(xs, some):
    """xs less one occurrence of each of some."""
    rest = list(xs)
    for x in some:
        rest.remove(x)
    return rest


def with_override(kwargs, override):
    """`a.b=value` (value as JSON, else a string) merged into a copy of kwargs."""
    key, _, raw = override.partition("=")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    out = copy.deepcopy(kwargs)
    *path, last = key.split(".")
    node = out
    for k in path:
        node = node.setdefault(k, {})
    node[last] = value
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--routers", default="pow2,prefix_tree,kvgate",
        help="rows, comma-separated; a kvgate row takes overrides of its router kwargs: "
        "kvgate@policy=prefix_affinity, kvgate@kv_aware.locality_weight=0",
    )
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tenants", type=int, default=24)
    ap.add_argument("--system-words", type=int, default=900)
    ap.add_argument("--zipf", type=float, default=0.8)
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=600, help="KV cache blocks per engine")
    ap.add_argument(
        "--speedup", type=float, default=1.0,
        help="the mock engines' simulated time per real second (below 1: a slower engine, "
        "so engine time, not this machine's CPU, dominates TTFT)",
    )
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", default=str(REPO / "bench-out"))
    ap.add_argument(
        "--kvgate-kwargs", default="{}",
        help="JSON merged into kvgate's request_router_kwargs (e.g. '{\"kv_aware\": {\"overlap_weight\": 1}}')",
    )
    args = ap.parse_args()

    systems = [tenant_prompt(t, args.system_words) for t in range(args.tenants)]
    reqs = workload(args)
    ray.init(
        runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}},
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        namespace="kvgate-bench",
    )
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    engine_args = ["--num-blocks", str(args.num_blocks), "--speedup", str(args.speedup)]
    rows = []
    print(f"command: python crates/kvgate-py/bench/ray_routers.py {' '.join(sys.argv[1:])}", flush=True)
    for name in args.routers.split(","):
        base_name, *overrides = name.split("@")
        cls, kwargs = ROUTERS[base_name]
        if base_name.startswith("kvgate"):
            kwargs = {**kwargs, **json.loads(args.kvgate_kwargs)}
            for o in overrides:
                kwargs = with_override(kwargs, o)
        app = build_app(
            cls, kwargs, replicas=args.replicas, engine_args=engine_args,
            tokenize=name.startswith("kvgate"),
        )
        app_name = f"row{len(rows)}"
        serve.run(app, name=app_name, route_prefix=f"/{app_name}")
        results, router = asyncio.run(drive(base, app_name, reqs, systems, args.max_tokens))
        serve.delete(app_name)
        ok = [r for r in results if "error" not in r]
        ttfts = [r["ttft"] * 1e3 for r in ok]
        hit = sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok))
        rs = [x * 1e3 for x in router["seconds"]]
        row = {
            "router": name,
            "requests": len(results),
            "errors": len(results) - len(ok),
            "ttft_p50_ms": pct(ttfts, 50),
            "ttft_p90_ms": pct(ttfts, 90),
            "ttft_p99_ms": pct(ttfts, 99),
            "hit_rate": hit,
            "router_calls": router["calls"],
            "router_p50_ms": pct(rs, 50),
            "router_p99_ms": pct(rs, 99),
            "router_cpu_p50_ms": pct([x * 1e3 for x in router["cpu_seconds"]], 50),
            "router_cpu_p99_ms": pct([x * 1e3 for x in router["cpu_seconds"]], 99),
            # calls inside which the ingress process ran a garbage collection
            "router_calls_with_gc": len(router["with_gc_seconds"]),
            "router_slowest_1pct_with_gc": sum(
                1 for x in router["with_gc_seconds"] if x >= pct(router["seconds"], 99)
            ),
            "router_p99_ms_without_gc": pct(
                [x * 1e3 for x in _without(router["seconds"], router["with_gc_seconds"])], 99
            ),
            "busiest_replica_share": max(
                (sum(1 for r in ok if r["replica"] == x) for x in {r["replica"] for r in ok}),
                default=0,
            ) / max(1, len(ok)),
            "tokenize_p50_ms": pct([r["tokenize_ms"] for r in ok], 50),
            "tokenize_p99_ms": pct([r["tokenize_ms"] for r in ok], 99),
            "first_item_p50_ms": pct([r["first_item_ms"] for r in ok], 50),
            "first_item_p99_ms": pct([r["first_item_ms"] for r in ok], 99),
        }
        print(json.dumps(row), flush=True)
        row["results"] = results
        rows.append(row)
    serve.shutdown()
    ray.shutdown()

    print()
    print(
        "| router | requests | errors | TTFT p50 ms | p90 ms | p99 ms | hit rate "
        "| choose_replicas p50 ms | p99 ms | CPU p50 ms | CPU p99 ms "
        "| calls with a GC pass (in the slowest 1%) | p99 ms of the others |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['router']} | {r['requests']} | {r['errors']} | {r['ttft_p50_ms']:.0f} | "
            f"{r['ttft_p90_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['hit_rate']:.1%} | "
            f"{r['router_p50_ms']:.3f} | {r['router_p99_ms']:.3f} | "
            f"{r['router_cpu_p50_ms']:.3f} | {r['router_cpu_p99_ms']:.3f} | "
            f"{r['router_calls_with_gc']} ({r['router_slowest_1pct_with_gc']}) | "
            f"{r['router_p99_ms_without_gc']:.3f} |"
        )
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / f"ray-routers-{int(time.time())}.json"
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
