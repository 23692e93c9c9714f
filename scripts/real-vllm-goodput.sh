#!/usr/bin/env bash
# Goodput of two kvgate builds on two real vLLM replicas under overload: an open-loop
# shared-prefix workload (8 tenants) faster than the replicas serve, every request with a
# TTFT objective and half of them sheddable; the builds take turns on the same replicas,
# seed by seed (paired), and each run prints its requests that met the objective. Needs a
# release build and the real vLLM of scripts/real-vllm-fleet.sh; about 9 GB of RAM, 1-2
# minutes a seed. One build against itself differs by SD 0.6 req/s a seed on this 2-core
# machine (mean 0.0), so 12 seeds are the default (SE of a paired difference about 0.2).
# Usage:
#   scripts/real-vllm-goodput.sh BEFORE_BIN AFTER_BIN [OUT_DIR]
# Env: SEEDS (default 1 to 12), RATE (requests/s, default 5: the two CPU replicas
# served about 3.5 on a 2-core machine; on a slower host, where they serve 1.7, 5 leaves
# no goodput to compare: set RATE to about 1.4x what they serve, e.g. 2.2), REQUESTS per
# run (default 200), SLO_TTFT_MS (default 500), AFTER_POLICY (AFTER's policy, default
# kv_aware; with the same build twice, kv_aware against another policy).
# The same shape simulated (docs/BENCHMARKS.md section 15; the mock engine slowed 5x):
#   kvgate simulate --workload shared-prefix --groups 8 --users 256 --prefix-tokens 300 \
#     --suffix-tokens 16 --output-tokens 16 --engines 2 --num-blocks 256 --block-size 32 \
#     --engine-arg=--max-num-seqs=16 --engine-arg=--max-num-batched-tokens=2048 \
#     --max-requests 400 --slo-ttft-ms 500 --sheddable-share 0.5 --engine-speedup 0.2 --rate 16
# and with the CPU engines' step scatter, which decides the sign there: add
#   --engine-arg=--step-jitter=0.5
set -euo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1
AFTER=$2
OUT=${3:-${TMPDIR:-/tmp}/kvgate-real-goodput-$$}
SEEDS=${SEEDS:-1 2 3 4 5 6 7 8 9 10 11 12}
RATE=${RATE:-5}
REQUESTS=${REQUESTS:-200}
SLO_TTFT_MS=${SLO_TTFT_MS:-500}
AFTER_POLICY=${AFTER_POLICY:-kv_aware}
mkdir -p "$OUT"
. scripts/real-vllm-fleet.sh
start_replicas "$OUT"

run() { # BIN LABEL SEED POLICY
  POLICY=$4 start_kvgate "$1" "$OUT/kvgate-$2-$3.log"
  # One client for both builds: AFTER's `kvgate bench`.
  "$AFTER" bench --target "$GW" --model tiny --workload shared-prefix --groups 8 --users 256 \
    --prefix-tokens 300 --suffix-tokens 16 --output-tokens 16 --seed "$3" --rate "$RATE" \
    --max-requests "$REQUESTS" --prompt-format text --slo-ttft-ms "$SLO_TTFT_MS" \
    --sheddable-share 0.5 --request-timeout 120 --no-progress --out "$OUT/$2-$3.json" \
    >"$OUT/$2-$3.log" 2>&1
  echo "$2 seed $3: $(grep -E '^goodput' "$OUT/$2-$3.log")"
  kill "$KVGATE_PID"
  wait "$KVGATE_PID" 2>/dev/null || true
}
for s in $SEEDS; do
  run "$BEFORE" before "$s" kv_aware
  run "$AFTER" after "$s" "$AFTER_POLICY"
done
echo "logs and reports: $OUT"
