#!/usr/bin/env bash
# Checks against a real vLLM that kvgate's block keys for a request and for the engine's
# KV events agree: kv_aware's predicted cached tokens (from the prompt's keys looked up
# in the index built from vLLM's BlockStored events) must match the cached tokens vLLM
# reports in `usage.prompt_tokens_details.cached_tokens`. Run it after any change to
# tokenization or block hashing (the key scheme).
#
# Needs a real vLLM replica serving model "tiny" with KV events (the CPU build in
# ../shared/real-vllm: `setup.sh` once, then `serve.sh 8101 5601 5701`) and a release
# build (`cargo build --release -p kvgate`). Usage:
# scripts/real-vllm-predictions.sh [VLLM_URL] [VLLM_EVENTS] [TOKENIZER_DIR]
#
# What it does: resets vLLM's prefix cache; starts kvgate (kv_aware, block size 32,
# in-process tokenizer, vLLM's events) in front of it; sends chat requests for TENANTS
# tenants (a long system prompt each, a short question) ROUNDS times, one after the
# other, each waiting for vLLM's events of the one before; then reads kvgate's
# kvgate_predicted_cached_tokens_total and kvgate_reported_cached_tokens_total. Passes
# when vLLM reported cached tokens and the two agree within 1%.
set -euo pipefail
VLLM=${1:-http://127.0.0.1:8101}
VLLM_EVENTS=${2:-tcp://127.0.0.1:5601}
TOKENIZER=${3:-$(dirname "$0")/../fixtures/qwen3-tokenizer}
KVGATE=${KVGATE:-./target/release/kvgate}
GW_PORT=${GW_PORT:-8194}
TENANTS=${TENANTS:-4}
ROUNDS=${ROUNDS:-4}
GW=http://127.0.0.1:$GW_PORT
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

curl -fsS "$VLLM/health" >/dev/null || { echo "no vLLM at $VLLM (see ../shared/real-vllm)"; exit 2; }
curl -fsS -X POST "$VLLM/reset_prefix_cache" >/dev/null || true
"$KVGATE" serve --port "$GW_PORT" --model tiny --policy kv_aware --block-size 32 \
  --tokenizer "$TOKENIZER" --worker "$VLLM" --kv-events "$VLLM=$VLLM_EVENTS" \
  >/tmp/kvgate-predictions-gw.log 2>&1 & pids+=($!)
for _ in $(seq 100); do curl -fsS "$GW/ready" >/dev/null 2>&1 && break; sleep 0.1; done

metric() {
  curl -fsS "$GW/metrics" | awk -v n="$1" 'index($1, n "{") == 1 || $1 == n {s += $2} END {print s + 0}'
}
system_prompt() { # tenant -> about 600 tokens of its own text
  printf 'You are assistant number %s. ' "$1"
  for i in $(seq 60); do printf 'Rule %s of tenant %s: answer briefly and politely. ' "$i" "$1"; done
}
batches_before=0
for round in $(seq "$ROUNDS"); do
  for t in $(seq "$TENANTS"); do
    body=$(printf '{"model":"tiny","max_tokens":2,"messages":[{"role":"system","content":"%s"},{"role":"user","content":"question %s of round %s"}]}' \
      "$(system_prompt "$t")" "$t" "$round")
    curl -fsS "$GW/v1/chat/completions" -H 'content-type: application/json' -d "$body" \
      | grep -o '"cached_tokens":[0-9]*' | sed "s/^/round $round tenant $t: /" || true
    # The next request is predicted on this one's events: wait for them.
    for _ in $(seq 50); do
      b=$(metric kvgate_kv_events_batches_total)
      [ "${b%.*}" -gt "$batches_before" ] && break
      sleep 0.1
    done
    batches_before=$(metric kvgate_kv_events_batches_total)
    batches_before=${batches_before%.*}
  done
done

predicted=$(metric kvgate_predicted_cached_tokens_total)
reported=$(metric kvgate_reported_cached_tokens_total)
echo "predicted cached tokens ${predicted}, reported by vLLM ${reported}"
[ "${reported%.*}" -gt 0 ] || { echo "FAIL: vLLM reported no cached tokens"; exit 1; }
ratio=$(echo "scale=4; $predicted / $reported" | bc)
echo "predicted / reported = $ratio"
[ "$(echo "$ratio >= 0.99 && $ratio <= 1.01" | bc)" = "1" ] || { echo "FAIL: predictions are off"; exit 1; }
echo "OK"
