#!/usr/bin/env python3
"""How far kvgate's TTFT predictions are from what was observed, and how far they could
be with the time model's features: reads the `ttft receipt` events of a kvgate log
(`KVGATE_LOG=info,kvgate::ttft=debug KVGATE_LOG_JSON=true kvgate serve ...`) and prints

- the median and 90th-percentile error |predicted - observed| / observed of the
  predictions made at booking (online: the rates as they were then);
- the same with rates fitted in hindsight to these very receipts (least squares in
  relative error over the four features, one set of rates per worker): no rates the
  model could learn predict these requests better, so what is left is what the
  features do not see (on a shared CPU machine, mostly noise).

Usage: scripts/ttft-floor.py LOG [FIRST_LINE [LAST_LINE]]  (1-based, inclusive: a slice
of the log, e.g. one benchmark run's). Standard library only.
"""

import json
import statistics
import sys

FEATURES = ("prefill_steps", "prefill_tokens", "slot_steps", "kv_block_steps")


def receipts(lines):
    for line in lines:
        if '"ttft receipt"' not in line:
            continue
        try:
            fields = json.loads(line)["fields"]
        except (ValueError, KeyError):
            continue
        if fields.get("observed_secs", 0) > 0:
            yield fields


def solve(a, b):
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    a = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-300:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            for k in range(col, n + 1):
                a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x


def hindsight_errors(rs):
    """Relative errors with each worker's rates fitted to its own receipts."""
    errors = []
    for worker in {r["worker"] for r in rs}:
        mine = [r for r in rs if r["worker"] == worker]
        # Features that never vary from zero are left out (they cannot be fitted).
        used = [f for f in FEATURES if any(r[f] != 0 for r in mine)]
        xs = [[r[f] / r["observed_secs"] for f in used] for r in mine]
        k = len(used)
        ata = [[sum(x[i] * x[j] for x in xs) for j in range(k)] for i in range(k)]
        atb = [sum(x[i] for x in xs) for i in range(k)]  # y / observed = 1
        beta = solve(ata, atb) or [0.0] * k
        for r in mine:
            p = sum(b * r[f] for b, f in zip(beta, used))
            errors.append(abs(p - r["observed_secs"]) / r["observed_secs"])
    return errors


def describe(errors):
    errors = sorted(errors)
    p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
    return f"p50 {100 * statistics.median(errors):.1f}%  p90 {100 * p90:.1f}%"


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    with open(sys.argv[1], encoding="utf-8", errors="replace") as f:
        lines = f.readlines()
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    last = int(sys.argv[3]) if len(sys.argv) > 3 else len(lines)
    rs = list(receipts(lines[first - 1 : last]))
    if not rs:
        sys.exit("no `ttft receipt` events (run kvgate with KVGATE_LOG=info,kvgate::ttft=debug KVGATE_LOG_JSON=true)")
    online = [abs(r["predicted_secs"] - r["observed_secs"]) / r["observed_secs"] for r in rs]
    print(f"{len(rs)} receipts: predicted at booking {describe(online)}; "
          f"rates fitted in hindsight {describe(hindsight_errors(rs))}")


if __name__ == "__main__":
    main()
