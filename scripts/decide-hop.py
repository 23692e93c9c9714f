#!/usr/bin/env python3
"""What deciding at the leader adds (issue 44): three kvgate replicas (kv_aware, deciding at
the leader, `--peer-decisions leader`) over two instant fake engines (`bench_engine`).

- hop: completions of 8k, 32k and 128k-token prompts (token ids: no tokenizer in the way),
  sent alternately to the leader (which chooses where it stands) and to a follower (which
  sends the leader the prompt's block keys and its candidates, `POST /peer/v1/decide`, and
  waits for the choice); client-timed on loopback, to the instant engine's whole answer. The
  follower's time less the leader's, per percentile, is what the hop adds.
- saturation: `--conns` connections per follower (wrk) send 1k-token prompts to both
  followers at once for `--seconds`; the leader's `kvgate_peer_decisions_total{outcome="served"}` over
  that time is its decisions per second (on this machine, which also runs the client, the
  engines and the followers).

    cargo build --release -p kvgate -p kvgate-gateway --examples
    python3 scripts/decide-hop.py [--requests 300]
"""
import argparse
import http.client
import json
import os
import random
import re
import subprocess
import time

from localhost import free_port, pct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "decide-hop"


class Client:
    """One kept-alive connection."""

    def __init__(self, port):
        self.port = port
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def post(self, path, data):
        t0 = time.perf_counter()
        self.conn.request("POST", path, body=data, headers={"content-type": "application/json"})
        r = self.conn.getresponse()
        payload = r.read()
        took = time.perf_counter() - t0
        if r.status != 200:
            raise SystemExit(f"{path} on {self.port}: {r.status} {payload[:300]!r}")
        return took

    def get(self, path):
        self.conn.request("GET", path, headers={"authorization": f"Bearer {TOKEN}"})
        return self.conn.getresponse().read().decode()


def served(port):
    text = Client(port).get("/metrics")
    m = re.search(r'kvgate_peer_decisions_total\{[^}]*outcome="served"[^}]*\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def decision_buckets(port):
    """kvgate_routing_decision_seconds's cumulative buckets: upper bound -> count."""
    text = Client(port).get("/metrics")
    out = {}
    for m in re.finditer(r'kvgate_routing_decision_seconds_bucket\{[^}]*le="([^"]+)"[^}]*\} (\S+)', text):
        le = float("inf") if m.group(1) == "+Inf" else float(m.group(1))
        out[le] = out.get(le, 0) + float(m.group(2))
    return out


def quantile(before, after, q):
    """histogram_quantile over the buckets' growth between two reads (linear within one)."""
    les = sorted(after)
    counts = [after[le] - before.get(le, 0) for le in les]
    total = counts[-1]
    if total == 0:
        return float("nan")
    rank, lo, below = q * total, 0.0, 0.0
    for le, c in zip(les, counts):
        if c >= rank:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (rank - below) / max(c - below, 1e-9)
        lo, below = le, c
    return lo


def share_over(before, after, bound):
    """The share of the histogram's growth between two reads above `bound` (a bucket's bound)."""
    total = after[float("inf")] - before.get(float("inf"), 0)
    under = after[bound] - before.get(bound, 0)
    return (total - under) / total if total else float("nan")


def explain_leader(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("POST", "/v1/route/explain", body=json.dumps({"model": "m", "prompt": [1, 2, 3]}),
              headers={"content-type": "application/json"})
    return json.loads(c.getresponse().read()).get("leader")


def body(tokens, rng):
    return json.dumps({"model": "m", "prompt": [rng.randrange(1, 150000) for _ in range(tokens)],
                       "max_tokens": 1}).encode()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvgate", default=os.path.join(ROOT, "target/release/kvgate"))
    ap.add_argument("--engine", default=os.path.join(ROOT, "target/release/examples/bench_engine"))
    ap.add_argument("--tokens", default="8000,32000,128000")
    ap.add_argument("--requests", type=int, default=300, help="per size and replica")
    ap.add_argument("--conns", type=int, default=8, help="per follower, for the saturation run")
    ap.add_argument("--seconds", type=int, default=10)
    ap.add_argument("--saturation-tokens", type=int, default=1000)
    args = ap.parse_args()
    procs = []
    try:
        engines = [free_port(), free_port()]
        for p in engines:
            procs.append(subprocess.Popen([args.engine, str(p), "m"], env=dict(os.environ, BENCH_ENGINE_THREADS="1"),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        ports = [free_port() for _ in range(3)]
        for i, port in enumerate(ports):
            cmd = [args.kvgate, "serve", "--host", "127.0.0.1", "--port", str(port), "--model", "m",
                   "--policy", "kv_aware", "--kv-fallback", "least_loaded", "--admin-token", TOKEN,
                   "--replica-id", "r%d" % i, "--engine-metrics-interval-ms", "0",
                   "--tokenizer", os.path.join(ROOT, "fixtures/qwen3-tokenizer"),
                   "--max-body-bytes", str(16 << 20)]
            for e in engines:
                cmd += ["--worker", f"http://127.0.0.1:{e}"]
            for j, other in enumerate(ports):
                if j != i:
                    cmd += ["--peer", f"http://127.0.0.1:{other}"]
            procs.append(subprocess.Popen(cmd, env=dict(os.environ, KVGATE_LOG="warn"),
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            # r0 starts first, so it has run longest: it leads.
            time.sleep(0.5)
        end = time.time() + 60
        while True:
            try:
                if explain_leader(ports[1]) == "r0" and explain_leader(ports[2]) == "r0":
                    break
            except (OSError, ValueError):
                pass
            if time.time() > end:
                raise SystemExit("the followers never named r0 their leader")
            time.sleep(0.2)
        leader, follower = Client(ports[0]), Client(ports[1])
        rng = random.Random(1)
        print("| prompt tokens | block keys | request at the leader p50 / p99 ms | at a follower p50 / p99 ms "
              "| choice here p50 / p99 ms | choice at the leader p50 / p99 ms | asked choices over 1 ms |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for tokens in [int(t) for t in args.tokens.split(",")]:
            bodies = [body(tokens, rng) for _ in range(8)]
            at_leader, at_follower = [], []
            warm = 10
            for i in range(args.requests + 10):
                b = bodies[i % len(bodies)]
                a, f = leader.post("/v1/completions", b), follower.post("/v1/completions", b)
                if i == warm - 1:
                    hist = [decision_buckets(p) for p in ports[:2]]
                if i >= warm:
                    at_leader.append(a)
                    at_follower.append(f)
            # The choice as each replica timed it: the leader's own (selection), and the
            # follower's (the decide request's round trip, the leader's selection in it).
            now = [decision_buckets(p) for p in ports[:2]]
            choice = [quantile(h, n, q) * 1000 for h, n in zip(hist, now) for q in (.5, .99)]
            over = share_over(hist[1], now[1], 1e-3)
            row = [pct(xs, q) * 1000 for xs in (at_leader, at_follower) for q in (.5, .99)]
            print(f"| {tokens:,} | {tokens // 16:,} | {row[0]:.2f} / {row[1]:.2f} | {row[2]:.2f} / {row[3]:.2f} | "
                  f"{choice[0]:.3f} / {choice[1]:.3f} | {choice[2]:.3f} / {choice[3]:.3f} | {over:.1%} |", flush=True)

        # Saturation: both followers at once (wrk), every choice made at r0.
        body_file = os.path.join(ROOT, "target", "decide-hop-body.json")
        lua_file = os.path.join(ROOT, "target", "decide-hop.lua")
        with open(body_file, "wb") as f:
            f.write(body(args.saturation_tokens, rng))
        with open(lua_file, "w") as f:
            f.write('wrk.method = "POST"\nwrk.headers["content-type"] = "application/json"\n'
                    f'local f = io.open("{body_file}", "rb")\nwrk.body = f:read("*a")\nf:close()\n')
        before = served(ports[0])
        t0 = time.perf_counter()
        wrks = [subprocess.Popen(["wrk", "-t1", f"-c{args.conns}", f"-d{args.seconds}s", "-s", lua_file,
                                  f"http://127.0.0.1:{p}/v1/completions"], stdout=subprocess.PIPE, text=True)
                for p in ports[1:]]
        outs = [w.communicate()[0] for w in wrks]
        took = time.perf_counter() - t0
        decided = served(ports[0]) - before
        sent = sum(float(re.search(r"Requests/sec:\s+(\S+)", o).group(1)) for o in outs)
        print(f"\nsaturation ({args.saturation_tokens}-token prompts): {args.conns} connections to each follower, {sent:,.0f} requests/s in all; "
              f"the leader decided {decided / took:,.0f}/s for them")
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
