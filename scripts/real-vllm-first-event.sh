#!/usr/bin/env bash
# Checks against a real vLLM that a stream is committed at its first event, not at its
# head: vLLM's API server sends a stream's response head at once and its first event
# with the first token, so a request whose engine stops in between must still go to
# another worker.
#
# Needs a real vLLM replica serving model "tiny" (the CPU build in ../shared/real-vllm:
# `setup.sh` once, then `serve.sh 8101 5601 5701`) and a release build
# (`cargo build --release -p kvgate`). Usage: scripts/real-vllm-first-event.sh [VLLM_URL]
#
# What it does: stops vLLM's engine process (SIGSTOP; its API server keeps answering),
# sends one streamed request straight to vLLM and checks that the head (200,
# text/event-stream) arrives and no event does; then starts a mock engine serving
# "tiny" and kvgate (round_robin, first-byte timeout 3 s) in front of both and sends
# streamed requests through kvgate: every one must end whole ("data: [DONE]") from the
# mock engine, those that went to vLLM first within the timeout plus a margin. The
# engine is continued (SIGCONT) on exit. Exits non-zero when a check fails.
set -euo pipefail
VLLM=${1:-http://127.0.0.1:8101}
KVGATE=${KVGATE:-./target/release/kvgate}
ROUTED=${ROUTED:-4}
MOCK_PORT=${MOCK_PORT:-8193}
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
kill -STOP "$engine"
echo "stopped vLLM's engine process $engine"

# Straight to vLLM: the head comes, no event does.
direct=$(curl -sN -m 4 -D /tmp/kvgate-first-event-head.txt "$VLLM/v1/completions" \
  -H 'content-type: application/json' \
  -d '{"model":"tiny","prompt":"first event check","max_tokens":4,"stream":true}' || true)
status=$(awk 'NR == 1 {print $2}' /tmp/kvgate-first-event-head.txt)
ctype=$(awk -F': ' 'tolower($1) == "content-type" {gsub("\r", "", $2); print $2}' /tmp/kvgate-first-event-head.txt)
echo "vLLM with its engine stopped: status ${status:-none}, content-type ${ctype:-none}, ${#direct} bytes of events in 4 s"
[ "$status" = "200" ] && [[ "$ctype" == text/event-stream* ]] && [ -z "$direct" ] ||
  { echo "FAIL: expected a 200 event-stream head and no event"; exit 1; }

"$KVGATE" mock-engine --port "$MOCK_PORT" --model tiny >/tmp/kvgate-first-event-mock.log 2>&1 & pids+=($!)
"$KVGATE" serve --port "$GW_PORT" --model tiny --policy round_robin \
  --worker "$VLLM" --worker "$MOCK" --first-byte-timeout-ms 3000 \
  >/tmp/kvgate-first-event-gw.log 2>&1 & pids+=($!)
for _ in $(seq 100); do curl -fsS "$GW/ready" >/dev/null 2>&1 && break; sleep 0.1; done

fails=0
for i in $(seq "$ROUTED"); do
  start=$(date +%s.%N)
  out=$(curl -sN -m 30 -D /tmp/kvgate-first-event-routed.txt "$GW/v1/completions" \
    -H 'content-type: application/json' \
    -d "{\"model\":\"tiny\",\"prompt\":\"routed request $i\",\"max_tokens\":4,\"stream\":true}" || true)
  took=$(echo "$(date +%s.%N) - $start" | bc)
  w=$(awk -F': ' 'tolower($1) == "x-kvgate-worker" {gsub("\r", "", $2); print $2}' /tmp/kvgate-first-event-routed.txt)
  done_line=$(printf '%s' "$out" | grep -c 'data: \[DONE\]' || true)
  echo "routed request $i: worker ${w:-none}, ${took}s, [DONE] seen: $done_line"
  { [ "$w" = "$MOCK" ] && [ "$done_line" = "1" ] && [ "$(echo "$took < 10" | bc)" = "1" ]; } || fails=$((fails + 1))
done
grep -E 'kvgate_retries_total\{model="tiny",reason="first_byte_timeout"\}' <(curl -fsS "$GW/metrics") || true
[ "$fails" = "0" ] || { echo "FAIL: $fails of $ROUTED requests"; exit 1; }
echo "OK"
