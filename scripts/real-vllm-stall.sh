#!/usr/bin/env bash
# Checks against a real vLLM that a stalled engine core is cut off (issue 18): vLLM's
# API server keeps answering `/health` (200) while its engine process is stopped, so
# only the stall rule (`--stall-timeout-ms`: requests in flight, no answer byte and no
# KV event) takes it out of rotation before the first-byte timeout (600 s).
#
# Needs a real vLLM replica serving model "tiny" with KV events (the CPU build in
# ../shared/real-vllm: `setup.sh` once, then `serve.sh 8101 5601 5701`) and a release
# build (`cargo build --release -p kvgate`). Usage:
# scripts/real-vllm-stall.sh [VLLM_URL] [VLLM_EVENTS] [TOKENIZER_DIR]
#
# What it does: starts a mock engine serving "tiny" (block size 32, its own KV events)
# and kvgate (kv_aware, both workers' events, stall timeout 3 s, first-byte timeout
# left at 600 s; prompts cached nowhere go to the cheaper worker, so some go to vLLM) in front of both; sends requests until vLLM has served some and
# published events; stops vLLM's engine process (SIGSTOP); sends streamed requests
# whose prompts kv_aware routes to vLLM (from /v1/route/explain): each must end whole
# ("data: [DONE]") from the mock engine within 15 s, and kvgate_worker_stalls_total must
# count vLLM once; then continues the engine (SIGCONT) and checks that vLLM serves a
# request through kvgate again (the generation probe brought it back). The engine is
# continued on exit whatever happens. Exits non-zero when a check fails.
set -euo pipefail
VLLM=${1:-http://127.0.0.1:8101}
VLLM_EVENTS=${2:-tcp://127.0.0.1:5601}
TOKENIZER=${3:-$(dirname "$0")/../fixtures/qwen3-tokenizer}
KVGATE=${KVGATE:-./target/release/kvgate}
MOCK_PORT=${MOCK_PORT:-8193}
MOCK_EVENTS=${MOCK_EVENTS:-5693}
GW_PORT=${GW_PORT:-8192}
MOCK=http://127.0.0.1:$MOCK_PORT
GW=http://127.0.0.1:$GW_PORT
pids=()
engine=""
cleanup() {
  [ -n "$engine" ] && kill -CONT "$engine" 2>/dev/null || true
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

curl -fsS "$VLLM/health" >/dev/null || { echo "no vLLM at $VLLM (see ../shared/real-vllm)"; exit 2; }
engine=$(pgrep -f 'VLLM::EngineCore|EngineCore' | head -1 || true)
[ -n "$engine" ] || { echo "no vLLM engine process found (pgrep EngineCore)"; exit 2; }

"$KVGATE" mock-engine --port "$MOCK_PORT" --model tiny --block-size 32 \
  --kv-events-port "$MOCK_EVENTS" --tokenizer "$TOKENIZER" \
  >/tmp/kvgate-stall-mock.log 2>&1 & pids+=($!)
"$KVGATE" serve --port "$GW_PORT" --model tiny --policy kv_aware --block-size 32 \
  --tokenizer "$TOKENIZER" \
  --worker "$VLLM" --kv-events "$VLLM=$VLLM_EVENTS" \
  --worker "$MOCK" --kv-events "$MOCK=tcp://127.0.0.1:$MOCK_EVENTS" \
  --stall-timeout-ms 3000 --log info,kvgate::decision=debug \
  >/tmp/kvgate-stall-gw.log 2>&1 & pids+=($!)
for _ in $(seq 100); do curl -fsS "$GW/ready" >/dev/null 2>&1 && break; sleep 0.1; done

complete() { # prompt, max_tokens, stream -> headers in /tmp/kvgate-stall-h.txt, body on stdout
  curl -sN -m "${4:-30}" -D /tmp/kvgate-stall-h.txt "$GW/v1/completions" \
    -H 'content-type: application/json' \
    -d "{\"model\":\"tiny\",\"prompt\":\"$1\",\"max_tokens\":$2,\"stream\":$3}" || true
}
worker_of_last() {
  awk -F': ' 'tolower($1) == "x-kvgate-worker" {gsub("\r", "", $2); print $2}' /tmp/kvgate-stall-h.txt
}
explain() {
  curl -fsS "$GW/v1/route/explain" -H 'content-type: application/json' \
    -d "{\"model\":\"tiny\",\"prompt\":\"$1\",\"max_tokens\":4}" |
    grep -o '"worker":"[^"]*"' | head -1 | cut -d'"' -f4
}
stalls() {
  curl -fsS "$GW/metrics" | awk -v w="$VLLM" '$1 ~ "^kvgate_worker_stalls_total" && index($1, "worker=\"" w "\"") {print $2}'
}

# Both engines serve and publish events (vLLM's first through kvgate).
long=$(printf 'a shared system prompt of some length %.0s' $(seq 20))
served_vllm=0
for i in $(seq 40); do
  complete "warm $i $long" 4 false >/dev/null
  [ "$(worker_of_last)" = "$VLLM" ] && served_vllm=$((served_vllm + 1))
  [ "$served_vllm" -ge 2 ] && break
done
[ "$served_vllm" -ge 2 ] || { echo "FAIL: kvgate never routed to vLLM while warming up"; exit 1; }
# The stall rule judges an engine once kvgate has seen its KV events.
batches() {
  curl -fsS "$GW/metrics" | awk -v w="$VLLM" '$1 == "kvgate_kv_events_batches_total{worker=\"" w "\"}" {print $2}'
}
for i in $(seq 100); do
  b=$(batches)
  [ "${b:-0}" != "0" ] && break
  complete "events $i $long" 4 false >/dev/null
  sleep 0.2
done
echo "vLLM served $served_vllm warm-up requests through kvgate; its KV event batches seen: $(batches); stalls so far: $(stalls)"

kill -STOP "$engine"
echo "stopped vLLM's engine process $engine"
curl -fsS -m 2 "$VLLM/health" >/dev/null && echo "vLLM's /health still answers 200"

prompts=()
for i in $(seq 200); do
  p="stalled check $i $long"
  [ "$(explain "$p")" = "$VLLM" ] && prompts+=("$p")
  [ "${#prompts[@]}" -ge 3 ] && break
done
[ "${#prompts[@]}" -ge 1 ] || {
  echo "FAIL: no prompt routed to vLLM:"
  curl -fsS "$GW/v1/route/explain" -H 'content-type: application/json' -d "{\"model\":\"tiny\",\"prompt\":\"$p\",\"max_tokens\":4}"
  exit 1
}
fails=0
for p in "${prompts[@]}"; do
  start=$(date +%s.%N)
  out=$(complete "$p" 4 true 30)
  took=$(echo "$(date +%s.%N) - $start" | bc)
  w=$(worker_of_last)
  done_line=$(printf '%s' "$out" | grep -c 'data: \[DONE\]' || true)
  echo "\"${p%% a shared*}\" (kv_aware chose vLLM): answered by ${w:-none} in ${took}s, [DONE] seen: $done_line"
  { [ "$w" = "$MOCK" ] && [ "$done_line" = "1" ] && [ "$(echo "$took < 15" | bc)" = "1" ]; } || fails=$((fails + 1))
done
n=$(stalls)
echo "kvgate_worker_stalls_total for vLLM: ${n:-none}"
[ "${n%.*}" = "1" ] || fails=$((fails + 1))
grep -E 'worker stalled' /tmp/kvgate-stall-gw.log | tail -1 || true

kill -CONT "$engine"
engine=""
echo "continued vLLM's engine process"
back=0
for i in $(seq 60); do
  complete "after $i $long" 4 false >/dev/null
  if [ "$(worker_of_last)" = "$VLLM" ]; then back=1; echo "vLLM serves again (request $i after SIGCONT)"; break; fi
  sleep 0.5
done
[ "$back" = "1" ] || { echo "FAIL: vLLM never came back"; fails=$((fails + 1)); }
grep -E "generates again" /tmp/kvgate-stall-gw.log | tail -1 || true
[ "$fails" = "0" ] || { echo "FAIL: $fails checks"; exit 1; }
echo "OK"
