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
# prints kvgate's own receipts (`kvgate_ttft_prediction_error`). About 9 GB of RAM, 5-10
# minutes. Usage:
#   scripts/real-vllm-ttft.sh [OUT_DIR]
# Env: CONCURRENCIES (default "4 16"), REQUESTS per run (default 400), TENANTS (default 8),
# PREFIX_WORDS per tenant prompt (default 300), VLLM_SERVE (default ../shared/real-vllm/serve.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/kvgate-real-ttft-$$}
CONCURRENCIES=${CONCURRENCIES:-4 16}
REQUESTS=${REQUESTS:-400}
TENANTS=${TENANTS:-8}
PREFIX_WORDS=${PREFIX_WORDS:-300}
VLLM_SERVE=${VLLM_SERVE:-../shared/real-vllm/serve.sh}
KVGATE=${KVGATE:-./target/release/kvgate}
GW_PORT=${GW_PORT:-8196}
GW=http://127.0.0.1:$GW_PORT
mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -- -"$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

for i in 1 2; do
  VLLM_CPU_OMP_THREADS_BIND=$((i - 1)) setsid "$VLLM_SERVE" "810$i" "560$i" "570$i" \
    >"$OUT/vllm-$i.log" 2>&1 &
  pids+=($!)
done
for i in 1 2; do
  for _ in $(seq 600); do curl -fsS "http://127.0.0.1:810$i/health" >/dev/null 2>&1 && break; sleep 1; done
  curl -fsS "http://127.0.0.1:810$i/health" >/dev/null || { echo "replica $i did not start: $OUT/vllm-$i.log"; exit 1; }
done
setsid "$KVGATE" serve --port "$GW_PORT" --model tiny --policy kv_aware --block-size 32 \
  --tokenizer fixtures/qwen3-tokenizer --max-num-seqs 16 --max-num-batched-tokens 2048 \
  --worker http://127.0.0.1:8101 --kv-events "http://127.0.0.1:8101=tcp://127.0.0.1:5601" \
  --worker http://127.0.0.1:8102 --kv-events "http://127.0.0.1:8102=tcp://127.0.0.1:5602" \
  >"$OUT/kvgate.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do curl -fsS "$GW/ready" >/dev/null 2>&1 && break; sleep 0.1; done

# kvgate's own receipts (booking to the engine's first event): its histogram's requests
# within 20% and within 50% of the prediction, since the previous read.
within() {
  curl -fsS "$GW/metrics" | awk '/^kvgate_ttft_prediction_error_bucket/ {
    if ($0 ~ /le="0.2"/) a += $2; if ($0 ~ /le="0.5"/) b += $2; if ($0 ~ /le="\+Inf"/) n += $2 }
    END { printf "%d %d %d", a, b, n }'
}
read -r a0 b0 n0 <<<"$(within)"
for c in $CONCURRENCIES; do
  "$KVGATE" bench --target "$GW" --model tiny --workload shared-prefix --groups "$TENANTS" \
    --users 256 --prefix-tokens "$PREFIX_WORDS" --suffix-tokens 16 --output-tokens 16 \
    --rate 10000 --concurrency "$c" --max-requests "$REQUESTS" --prompt-format text \
    --request-timeout 120 --no-progress --out "$OUT/c$c.json" >"$OUT/c$c.log" 2>&1
  echo "concurrency $c: $(grep -E '^TTFT ' "$OUT/c$c.log" | head -1 | tr -s ' ')"
  grep -E 'TTFT prediction error|requests ok|^ok' "$OUT/c$c.log" | sed "s/^/concurrency $c: client-side /"
  read -r a1 b1 n1 <<<"$(within)"
  echo "concurrency $c: kvgate's receipts: $((a1 - a0)) of $((n1 - n0)) within 20% of the prediction, $((b1 - b0)) within 50%"
  a0=$a1 b0=$b1 n0=$n1
done
echo "logs and reports: $OUT"
