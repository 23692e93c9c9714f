#!/usr/bin/env python3
"""Peak gateway memory under concurrent oversized chat bodies (issue 17's scenario).

Starts one mock engine and `kvgate serve` (prefix_affinity, local Qwen3 tokenizer,
--max-in-flight 2 unless told), sends N concurrent chat bodies of SIZE MB each, and reports the
gateway's RSS before, its peak (VmHWM) and after, with each request's status and time.

    python3 scripts/big-bodies.py [--kvgate target/release/kvgate] [--n 6] [--mb 10] [--max-in-flight 2]
                                  [-- extra serve flags...]
"""
import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time

from localhost import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mem(pid, field):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024  # MiB
    return 0


def wait_http(port, path, timeout=30):
    end = time.time() + timeout
    while time.time() < end:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            c.request("GET", path)
            if c.getresponse().status < 500:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"port {port} did not answer {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvgate", default=os.path.join(ROOT, "target/release/kvgate"))
    ap.add_argument("--engine-kvgate", default=None,
                    help="binary for the mock engine (default: --kvgate)")
    ap.add_argument("--max-in-flight", default="2")
    ap.add_argument("--n", type=int, default=6)
    ap.add_argument("--mb", type=float, default=10)
    ap.add_argument("extra", nargs="*")
    a = ap.parse_args()
    tok = os.path.join(ROOT, "fixtures/qwen3-tokenizer")
    ep, gp = free_port(), free_port()
    engine = subprocess.Popen([a.engine_kvgate or a.kvgate, "mock-engine", "--port", str(ep), "--log", "warn"],
                              stdout=subprocess.DEVNULL)
    gw = subprocess.Popen([a.kvgate, "serve", "--port", str(gp), "--model", "m",
                           "--worker", f"http://127.0.0.1:{ep}", "--policy", "prefix_affinity",
                           "--tokenizer", tok, "--max-in-flight", a.max_in_flight, "--log", "warn"] + a.extra,
                          stdout=subprocess.DEVNULL)
    try:
        wait_http(ep, "/health")
        wait_http(gp, "/health")
        # Varied words (seeded), so no tokenizer cache makes the text cheap.
        rng = random.Random(17)
        letters = "abcdefghijklmnopqrstuvwxyz"
        parts, size = [], 0
        while size < a.mb * 1e6:
            w = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10))) + " "
            parts.append(w)
            size += len(w)
        text = "".join(parts)
        body = json.dumps({"model": "m", "max_tokens": 1,
                           "messages": [{"role": "user", "content": text}]}).encode()
        base = mem(gw.pid, "VmRSS")
        results = []

        def one(i):
            t = time.time()
            try:
                c = http.client.HTTPConnection("127.0.0.1", gp, timeout=600)
                c.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
                r = c.getresponse()
                payload = r.read()
                code = ""
                if r.status != 200:
                    try:
                        code = json.loads(payload)["error"]["code"]
                    except (ValueError, KeyError, TypeError):
                        code = "non-JSON body: " + payload[:60].decode(errors="replace")
                results.append((i, r.status, code, time.time() - t))
            except OSError as e:
                results.append((i, "error", str(e), time.time() - t))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(a.n)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.time() - t0
        time.sleep(1)
        out = {
            "bodies": a.n, "mb_each": a.mb, "wall_s": round(wall, 1),
            "rss_start_mib": base, "rss_peak_mib": mem(gw.pid, "VmHWM"),
            "rss_end_mib": mem(gw.pid, "VmRSS"),
            "results": [{"status": s, "code": c, "secs": round(d, 1)} for _, s, c, d in sorted(results)],
        }
        print(json.dumps(out, indent=1))
    finally:
        for p in (gw, engine):
            p.terminate()
        for p in (gw, engine):
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
