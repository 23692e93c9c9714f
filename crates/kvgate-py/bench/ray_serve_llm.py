"""Ray Serve LLM's routers side by side on real vLLM: what a Ray Serve LLM user gets.

One local Ray cluster (loopback, Ray's direct-streaming path), and for each router a
fresh deployment of the same LLMConfig (two vLLM CPU replicas of the tiny Qwen3 with the
real Qwen3 tokenizer, 256 KV blocks of 32 tokens each; tests/llm_stack.py), driven by the
same workload for each seed:

  T tenants, each with its own long system prompt; together the prompts need more than
  one replica's cache but fit in two. Each request is a random tenant's system prompt
  plus a unique question, sent by C closed-loop clients for D seconds. Tenants draw
  equal traffic, or with --tenant-skew S tenant k draws in proportion to 1/(k+1)^S
  (Zipf: with 16 tenants and S=1 the busiest sends 30% of requests, the quietest 2%).

Rows: Ray's PowerOfTwoChoices (its default), Ray's PrefixCacheAffinityRouter, Ray's
KVAwareRouter with ai-dynamo (the `dynamo` row: ai-dynamo is installed into a folder
that only that deployment sees, see --dynamo-site), and kvgate.ray.llm.KVAwareRouter.
Reported per row and seed: requests served, errors, TTFT p50/p90 at the client, the
engines' own hit rate (cached / prompt tokens from `usage`), and for kvgate its time per
decision and the bookings left at the end (kvgate.ray.llm.routing_stats).

    target/py-venv/bin/python crates/kvgate-py/bench/ray_serve_llm.py --seeds 0,1,2

About 7 minutes per row (a deployment takes 3-4 minutes to start on 2 cores).
"""

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import aiohttp  # noqa: E402

from llm_stack import MODEL_ID, REPO, Cluster  # noqa: E402
from workload import WORDS, pct, tenant_prompt  # noqa: E402

async def one(session, url, system, question, max_tokens):
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft, usage = None, None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return {"error": resp.status}
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    return {"error": "stream"}
                if ttft is None and event.get("choices"):
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    usage = event["usage"]
    except aiohttp.ClientError as e:
        return {"error": type(e).__name__}
    if ttft is None or usage is None:
        return {"error": "incomplete"}
    return {"ttft": ttft, "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def drive(url, args, seed):
    rng = random.Random(seed)
    systems = [tenant_prompt(t, args.system_words) for t in range(args.tenants)]
    weights = [1.0 / (t + 1) ** args.tenant_skew for t in range(args.tenants)]
    results = []
    deadline = time.perf_counter() + args.duration
    counter = iter(range(10**9))
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async def client():
            while time.perf_counter() < deadline:
                i = next(counter)
                # randrange when equal: the default workload's draws stay as they were
                tenant = (rng.choices(range(args.tenants), weights)[0] if args.tenant_skew
                          else rng.randrange(args.tenants))
                q = f"Question {seed}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(12))
                results.append(await one(s, url, systems[tenant], q, args.max_tokens))

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    return results


def kvgate_stats(app):
    import ray
    import kvgate.ray.llm

    if not ray.is_initialized():
        return None
    by_process = kvgate.ray.llm.routing_stats(app)
    return next(iter(by_process.values()), None)


def dynamo_site(path: Path) -> Path:
    """ai-dynamo 1.6.1 in a folder of its own (only the dynamo row's processes see it)."""
    if not (path / "dynamo").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", str(path), "ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1"],
                       check=True)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--routers", default="pow2,prefix_tree,dynamo,kvgate")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--tenant-skew", type=float, default=0.0,
                    help="Zipf exponent of the tenants' traffic (0: equal)")
    ap.add_argument("--system-words", type=int, default=1300,
                    help="words per system prompt (~1.1 tokens a word)")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds per seed")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dynamo-site", default=str(REPO / "target" / "dynamo-site"))
    ap.add_argument("--out", default=str(REPO / "bench-out"))
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"command: python crates/kvgate-py/bench/ray_serve_llm.py {' '.join(sys.argv[1:])}",
          flush=True)

    import ray

    cluster = Cluster()
    rows = []
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        for n, router in enumerate(args.routers.split(",")):
            name = f"row{n}"
            extra = []
            if router == "dynamo":
                site = dynamo_site(Path(args.dynamo_site))
                extra = ["--env", json.dumps({"PYTHONPATH": str(site)})]
            t0 = time.time()
            cluster.deploy("--router", router, "--name", name, *extra)
            print(f"{router}: deployed in {time.time() - t0:.0f} s", flush=True)
            url = cluster.url(f"/{name}/v1/chat/completions")
            # Warm-up: the replicas advertise their KV events within a stats period.
            asyncio.run(drive(url, argparse.Namespace(**{**vars(args), "duration": 15}), 999))
            for seed in seeds:
                results = asyncio.run(drive(url, args, seed))
                ok = [r for r in results if "error" not in r]
                ttfts = [r["ttft"] * 1e3 for r in ok]
                row = {
                    "router": router, "seed": seed, "served": len(ok),
                    "errors": len(results) - len(ok),
                    "ttft_p50_ms": pct(ttfts, 50), "ttft_p90_ms": pct(ttfts, 90),
                    "hit_rate": sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)),
                }
                if router == "kvgate":
                    time.sleep(3)
                    st = kvgate_stats(name) or {}
                    row.update({"decision_p50_ms": st.get("decision_p50_ms"),
                                "decision_p99_ms": st.get("decision_p99_ms"),
                                "bookings_left": st.get("open_bookings")})
                print(json.dumps(row), flush=True)
                rows.append(row)
            from ray import serve

            serve.delete(name)  # the next row starts on fresh engines
    finally:
        ray.shutdown()
        cluster.stop()

    print("\n| router | seed | served | errors | TTFT p50 ms | TTFT p90 ms | hit rate | decision p50/p99 ms | bookings left |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        dec = (f"{r['decision_p50_ms']:.3f} / {r['decision_p99_ms']:.3f}"
               if r.get("decision_p50_ms") is not None else "-")
        print(f"| {r['router']} | {r['seed']} | {r['served']} | {r['errors']} | {r['ttft_p50_ms']:.0f} "
              f"| {r['ttft_p90_ms']:.0f} | {r['hit_rate']:.3f} | {dec} | {r.get('bookings_left', '-')} |")
    os.makedirs(args.out, exist_ok=True)
    path = Path(args.out) / f"ray-serve-llm-{int(time.time())}.json"
    path.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\nwritten to {path}")


if __name__ == "__main__":
    main()
