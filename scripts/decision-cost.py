#!/usr/bin/env python3
"""What routing a long conversation costs (issue 43): kvgate's decision, and the request
end to end beside the peer routers' cache-aware policies, on the same bodies.

Two instant fake engines (`bench_engine`: a fixed answer at once); kvgate with kv_aware and
the local Qwen3 tokenizer (`--kv-fallback least_loaded`: the fakes publish no KV events, so
the choice falls back after the prompt is tokenized and hashed); vllm-router and
sglang-router with `cache_aware` when they are on PATH. Bodies are chat conversations of a
2,000-word system prompt and 300-word turns, grown to about 8k, 32k, 128k and 256k tokens.

- decision: `POST /v1/route/explain`, timed by kvgate itself from the body's arrival to the
  choice (its `Server-Timing` header: parse, tokenize = template and encoding, hash = block
  keys, select); `cold` = a conversation never sent, `seen` = the last one sent with one
  turn more (an agent's next turn); the client's round trip beside it (the body's transfer
  and this client's own cost included);
- end to end: `POST /v1/chat/completions` (`max_tokens: 1`) through each router to the
  instant engine, `seen` bodies, against the engine reached directly.

With `--core N` every router runs on core N only, and the engines and this client on the
others: the decision's cost on one core, the way issue 43 asks for it.

    cargo build --release -p kvgate -p kvgate-gateway --examples
    PATH=target/peers-venv/bin:$PATH python3 scripts/decision-cost.py [--repeats 7] [--core 0]
"""
import argparse
import http.client
import json
import os
import random
import shutil
import subprocess
import time

from localhost import free_port, pct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
         "but have an they you were her she there been one all we their has would when if so what "
         "out up more will about into them can only other time new some could these two may first "
         "then do any like my now over such our man me even most made after also did many before "
         "must through back years where much your way well down should because each just those "
         "people how too little state good very make world still own see men work long get here "
         "between both life being under never day same another know while last might us great old "
         "year off come since against go came right used take three router cache engine token").split()


def text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(seed, turns):
    rng = random.Random(seed)
    messages = [{"role": "system", "content": f"[{seed}] " + text(rng, 2000)}]
    for t in range(turns):
        role = "user" if t % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"[{seed}.{t}] " + text(rng, 300)})
    return messages


def post(port, path, body, headers=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    data = json.dumps(body).encode()
    h = {"content-type": "application/json"}
    h.update(headers or {})
    t0 = time.perf_counter()
    c.request("POST", path, body=data, headers=h)
    r = c.getresponse()
    payload = r.read()
    took = time.perf_counter() - t0
    c.close()
    if r.status != 200:
        raise SystemExit(f"{path} on {port}: {r.status} {payload[:300]!r}")
    return took, payload, r.getheader("server-timing")


def stages(header):
    """kvgate's `Server-Timing` as {stage: seconds}."""
    out = {}
    for part in (header or "").split(","):
        name, _, dur = part.strip().partition(";dur=")
        if dur:
            out[name] = float(dur) / 1000
    return out


def wait_up(port, timeout=60):
    end = time.time() + timeout
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    while time.time() < end:
        try:
            post(port, "/v1/chat/completions", body)
            return
        except (OSError, SystemExit):
            time.sleep(0.2)
    raise SystemExit(f"port {port} never answered")


def ms(x):
    return f"{x * 1000:.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvgate", default=os.path.join(ROOT, "target/release/kvgate"))
    ap.add_argument("--engine", default=os.path.join(ROOT, "target/release/examples/bench_engine"))
    ap.add_argument("--tokens", default="8000,32000,128000,256000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--core", type=int, default=None, help="run the routers on this core only")
    args = ap.parse_args()
    pin = []
    if args.core is not None:
        pin = ["taskset", "-c", str(args.core)]
        others = os.sched_getaffinity(0) - {args.core}
        if others:
            # This client, and the engines it starts, stay off the routers' core.
            os.sched_setaffinity(0, others)
    procs = []
    try:
        engines = [free_port(), free_port()]
        for p in engines:
            procs.append(subprocess.Popen([args.engine, str(p), "m"], env=dict(os.environ, BENCH_ENGINE_THREADS="1"),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        urls = [f"http://127.0.0.1:{p}" for p in engines]
        kv = free_port()
        serve = pin + [args.kvgate, "serve", "--host", "127.0.0.1", "--port", str(kv), "--model", "m",
                 "--policy", "kv_aware", "--kv-fallback", "least_loaded",
                 "--tokenizer", os.path.join(ROOT, "fixtures/qwen3-tokenizer"),
                 "--engine-metrics-interval-ms", "0", "--max-body-bytes", str(64 << 20)]
        for u in urls:
            serve += ["--worker", u]
        procs.append(subprocess.Popen(serve, env=dict(os.environ, KVGATE_LOG="warn"),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        routers = [("direct", engines[0]), ("kvgate", kv)]
        if shutil.which("vllm-router"):
            p = free_port()
            procs.append(subprocess.Popen(pin + ["vllm-router", "--host", "127.0.0.1", "--port", str(p), "--worker-urls", *urls,
                                           "--policy", "cache_aware", "--log-level", "warning",
                                           "--prometheus-port", str(free_port())],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            routers.append(("vllm-router cache_aware", p))
        if shutil.which("sglang-router"):
            p = free_port()
            procs.append(subprocess.Popen(pin + ["sglang-router", "launch", "--host", "127.0.0.1", "--port", str(p),
                                           "--worker-urls", *urls, "--policy", "cache_aware", "--log-level", "warn",
                                           "--prometheus-port", str(free_port())],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            routers.append(("sglang-router cache_aware", p))
        for _, p in routers:
            wait_up(p)
        print("| tokens | body KiB | decision cold p50 / p99 ms | decision seen p50 / p99 ms | "
              "seen: parse / tokenize / hash / select p50 ms | explain round trip seen p50 ms | "
              + " | ".join(f"{n} e2e p50 / p99 ms" for n, _ in routers) + " |")
        print("|---:|---:|---:|---:|---:|---:|" + "---:|" * len(routers))
        seed = 0
        for target in [int(t) for t in args.tokens.split(",")]:
            # Grow the turns until the prompt reaches the target (kvgate's own count).
            turns, tokens = 2, 0
            while True:
                seed += 1
                _, answer, _ = post(kv, "/v1/route/explain", {"model": "m", "messages": conversation(seed, turns)})
                tokens = json.loads(answer)["prompt_tokens"]
                if tokens >= target:
                    break
                turns = max(turns + 2, int(turns * target / max(tokens, 1)))
            cold, seen, trip, e2e = [], [], [], {n: [] for n, _ in routers}
            for r in range(args.repeats):
                seed += 1
                history = conversation(seed, turns)
                _, _, timing = post(kv, "/v1/route/explain", {"model": "m", "messages": history})
                cold.append(stages(timing))
                # The agent's next turn: the whole history again, one message more.
                more = history + [{"role": "user", "content": f"[{seed}+] " + text(random.Random(seed), 300)}]
                took, _, timing = post(kv, "/v1/route/explain", {"model": "m", "messages": more})
                seen.append(stages(timing))
                trip.append(took)
                body = {"model": "m", "messages": more, "max_tokens": 1}
                for name, port in routers:
                    took, _, _ = post(port, "/v1/chat/completions", body)
                    e2e[name].append(took)
            size = len(json.dumps({"model": "m", "messages": more})) // 1024
            total = lambda runs: [t["total"] for t in runs]
            parts = " / ".join(ms(pct([t[k] for t in seen], .5)) for k in ("parse", "tokenize", "hash", "select"))
            print(f"| {tokens:,} | {size:,} | {ms(pct(total(cold), .5))} / {ms(pct(total(cold), .99))} | "
                  f"{ms(pct(total(seen), .5))} / {ms(pct(total(seen), .99))} | {parts} | {ms(pct(trip, .5))} | "
                  + " | ".join(f"{ms(pct(e2e[n], .5))} / {ms(pct(e2e[n], .99))}" for n, _ in routers) + " |",
                  flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
