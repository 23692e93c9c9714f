#!/usr/bin/env bash
# Side-by-side overhead of two kvgate builds (e.g. before and after a request-path
# change) in one run: the same fast fake engine, reached through each build's
# examples/serve in turn (A B A B), JSON and streaming, 1 and 64 connections, with wrk.
# Besides req/s and latency it reports the gateway's own CPU time per request (from
# /proc), which other load on a shared machine disturbs far less than throughput.
#
# Usage: [PASSES=2] crates/kvgate-gateway/benches/old_vs_new.sh OLD_EXAMPLES_DIR NEW_EXAMPLES_DIR [SECS]
#   (each dir holds a release build's `serve` and `bench_engine` examples:
#    cargo build --release -p kvgate-gateway --examples; for the old build check out
#    the old commit and build with CARGO_TARGET_DIR=/tmp/old-target)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OLD=$1; NEW=$2; DUR=${3:-8}
HERE=crates/kvgate-gateway/benches
E=18101; PORT=18000
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
BENCH_ENGINE_THREADS=1 "$NEW/bench_engine" $E m & PIDS+=($!)

# shellcheck source=common.sh
source "$HERE/common.sh"
wait_up $E

# CPU time the gateway process spent (user + system), in clock ticks.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TICK=$(getconf CLK_TCK)

echo "| build | workload | conns | req/s | p50 | p99 | gateway CPU µs/request |"
echo "|---|---|---:|---:|---:|---:|---:|"
for pass in $(seq 1 "${PASSES:-2}"); do
  for build in old new; do
    dir=$OLD; [ $build = new ] && dir=$NEW
    KVGATE_LOG=warn "$dir/serve" --host 127.0.0.1 --port $PORT --model m \
      --worker http://127.0.0.1:$E --policy round_robin >/tmp/kvgate-old-vs-new.log 2>&1 &
    gw=$!
    wait_up $PORT
    for script in chat.lua chat_stream.lua; do
      for conns in 1 64; do
        threads=1; [ $conns -gt 1 ] && threads=2
        before=$(cpu_ticks $gw)
        out=$(wrk -t$threads -c$conns -d"${DUR}s" --latency -s "$HERE/$script" "http://127.0.0.1:$PORT/v1/chat/completions")
        after=$(cpu_ticks $gw)
        rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
        p50=$(echo "$out" | awk '$1=="50%" {print $2}')
        p99=$(echo "$out" | awk '$1=="99%" {print $2}')
        total=$(echo "$out" | awk '/requests in/ {print $1}')
        cpu=$(awk -v t=$((after - before)) -v n="$total" -v hz="$TICK" 'BEGIN { if (n > 0) printf "%.1f", t / hz * 1e6 / n; else print "n/a" }')
        echo "| $build (pass $pass) | ${script%.lua} | $conns | $rps | $p50 | $p99 | $cpu |"
      done
    done
    kill $gw; wait $gw 2>/dev/null || true
  done
done
