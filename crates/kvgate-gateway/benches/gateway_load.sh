#!/usr/bin/env bash
# Load benchmark of the gateway's own overhead (issue 5): a fast fake engine (instant
# fixed answers), reached directly and through kvgate, vllm-router and sglang-router,
# all on this machine in one run. Reports added latency (p50/p99 at 1 connection) and
# max throughput (many connections) with wrk.
#
# Usage: crates/kvgate-gateway/benches/gateway_load.sh [DURATION_SECS] [CONNECTIONS]
# With KVGATE_BEFORE=PATH (the `serve` example of another build, e.g. before a change),
# that build runs too, as `kvgate-before`, in the same run.
# Needs: wrk (apt-get install -y wrk), vllm-router and sglang-router (pip install
# vllm-router sglang-router), and a release build:
#   cargo build --release -p kvgate-gateway --examples
set -euo pipefail
cd "$(dirname "$0")/../../.."
DUR=${1:-10}
CONNS=${2:-64}
BIN=target/release/examples
HERE=crates/kvgate-gateway/benches
E1=18101; E2=18102; KV=18000; VR=18001; SG=18002; KB=18003
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

BENCH_ENGINE_THREADS=1 $BIN/bench_engine $E1 m & PIDS+=($!)
BENCH_ENGINE_THREADS=1 $BIN/bench_engine $E2 m & PIDS+=($!)
KVGATE_LOG=warn $BIN/serve --host 127.0.0.1 --port $KV --model m \
  --worker http://127.0.0.1:$E1 --worker http://127.0.0.1:$E2 --policy round_robin \
  >/tmp/kvgate-bench.log 2>&1 & PIDS+=($!)
TARGETS=("kvgate $KV")
if [ -n "${KVGATE_BEFORE:-}" ]; then
  KVGATE_LOG=warn "$KVGATE_BEFORE" --host 127.0.0.1 --port $KB --model m \
    --worker http://127.0.0.1:$E1 --worker http://127.0.0.1:$E2 --policy round_robin \
    >/tmp/kvgate-before-bench.log 2>&1 & PIDS+=($!)
  TARGETS+=("kvgate-before $KB")
fi
vllm-router --host 127.0.0.1 --port $VR --worker-urls http://127.0.0.1:$E1 http://127.0.0.1:$E2 \
  --policy round_robin --log-level warning --prometheus-port 29101 >/tmp/vllm-router-bench.log 2>&1 & PIDS+=($!)
sglang-router launch --host 127.0.0.1 --port $SG --worker-urls http://127.0.0.1:$E1 http://127.0.0.1:$E2 \
  --policy round_robin --log-level warn --prometheus-port 29102 >/tmp/sglang-router-bench.log 2>&1 & PIDS+=($!)

# shellcheck source=common.sh
source "$HERE/common.sh"
for t in "x $E1" "x $E2" "${TARGETS[@]}" "x $VR" "x $SG"; do set -- $t; wait_up "$2"; done

run() { # name port script threads conns
  local out
  out=$(wrk -t"$4" -c"$5" -d"${DUR}s" --latency -s "$HERE/$3" "http://127.0.0.1:$2/v1/chat/completions")
  local rps p50 p99 non2xx
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
  printf "| %-14s | %-11s | %5s | %10s | %9s | %9s | %s |\n" "$1" "$3" "$5" "$rps" "$p50" "$p99" "${non2xx:-0}"
}

echo "| target         | workload    | conns |  req/s     | p50       | p99       | non-2xx |"
echo "|----------------|-------------|-------|------------|-----------|-----------|---------|"
for script in chat.lua chat_stream.lua; do
  for t in "direct $E1" "${TARGETS[@]}" "vllm-router $VR" "sglang-router $SG"; do
    set -- $t; run "$1" "$2" $script 1 1
  done
done
for script in chat.lua chat_stream.lua; do
  for t in "direct $E1" "${TARGETS[@]}" "vllm-router $VR" "sglang-router $SG"; do
    set -- $t; run "$1" "$2" $script 2 "$CONNS"
  done
done
