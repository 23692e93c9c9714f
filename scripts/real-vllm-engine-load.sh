#!/usr/bin/env bash
# Checks against a real vLLM that kvgate reads the engine's queue from its /metrics and
# counts requests sent to the engine directly (not through kvgate) as its load.
#
# Needs a real vLLM replica serving model "tiny" (the CPU build in ../shared/real-vllm:
# `setup.sh` once, then `serve.sh 8101 5601 5701`) and a release build
# (`cargo build --release -p kvgate`). Usage: scripts/real-vllm-engine-load.sh [VLLM_URL]
#
# What it does: starts a mock engine serving "tiny" as the second worker and kvgate
# (least_loaded, queue read every 200 ms) in front of both; holds DIRECT long streamed
# requests on vLLM without kvgate; waits until kvgate_worker_unseen_requests for vLLM
# shows them; sends ROUTED short requests through kvgate one after the other and counts
# where they went (all should go to the mock engine); then drops the direct requests and
# checks that the gauge returns to 0. Exits non-zero when a check fails.
set -euo pipefail
VLLM=${1:-http://127.0.0.1:8101}
KVGATE=${KVGATE:-./target/release/kvgate}
DIRECT=${DIRECT:-3}
ROUTED=${ROUTED:-8}
MOCK_PORT=${MOCK_PORT:-8191}
GW_PORT=${GW_PORT:-8190}
MOCK=http://127.0.0.1:$MOCK_PORT
GW=http://127.0.0.1:$GW_PORT
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

curl -fsS "$VLLM/health" >/dev/null || { echo "no vLLM at $VLLM (see ../shared/real-vllm)"; exit 2; }
curl -fsS "$VLLM/metrics" | grep -E '^vllm:num_requests_(running|waiting)' | sed 's/^/vLLM reports: /'
"$KVGATE" mock-engine --port "$MOCK_PORT" --model tiny >/tmp/kvgate-check-mock.log 2>&1 & pids+=($!)
"$KVGATE" serve --port "$GW_PORT" --model tiny --policy least_loaded --seed 1 \
  --worker "$VLLM" --worker "$MOCK" --engine-metrics-interval-ms 200 >/tmp/kvgate-check-gw.log 2>&1 & pids+=($!)
for _ in $(seq 100); do curl -fsS "$GW/ready" >/dev/null 2>&1 && break; sleep 0.1; done

unseen() {
  curl -fsS "$GW/metrics" | awk -v s="kvgate_worker_unseen_requests{model=\"tiny\",worker=\"$VLLM\"}" '$1 == s {print $2}'
}
# Polls the gauge (up to 10 s) until it reads $1; leaves the last reading in $seen.
wait_unseen() {
  for _ in $(seq 100); do
    seen=$(unseen)
    [ "$seen" = "$1" ] && return
    sleep 0.1
  done
}

direct=()
for i in $(seq "$DIRECT"); do
  curl -sN "$VLLM/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"tiny\",\"prompt\":\"direct request $i\",\"max_tokens\":1500,\"ignore_eos\":true,\"stream\":true}" \
    >/dev/null & direct+=($!)
done
wait_unseen "$DIRECT"
echo "kvgate_worker_unseen_requests for vLLM with $DIRECT direct requests: ${seen:-none}"
[ "$seen" = "$DIRECT" ] || { echo "FAIL: expected $DIRECT"; exit 1; }

to_vllm=0
for i in $(seq "$ROUTED"); do
  w=$(curl -fsS -D - -o /dev/null "$GW/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\":\"tiny\",\"prompt\":\"routed request $i\",\"max_tokens\":1}" |
    awk -F': ' 'tolower($1) == "x-kvgate-worker" {gsub("\r", "", $2); print $2}')
  [ "$w" = "$VLLM" ] && to_vllm=$((to_vllm + 1))
done
echo "routed requests sent to vLLM while it held the direct ones: $to_vllm of $ROUTED"

kill "${direct[@]}" 2>/dev/null || true
wait_unseen 0
echo "kvgate_worker_unseen_requests for vLLM after the direct requests ended: ${seen:-none}"
[ "$to_vllm" = "0" ] && [ "$seen" = "0" ] || { echo "FAIL"; exit 1; }
echo "OK"
