# Shared by the gateway benchmark scripts (sourced, not run).

# Waits until 127.0.0.1:$1 answers a chat completion with 200 (60 s at most).
wait_up() {
  for _ in $(seq 1 300); do
    if curl -s -o /dev/null -w '%{http_code}' -X POST -H 'content-type: application/json' \
      -d '{"model":"m","messages":[{"role":"user","content":"x"}]}' "http://127.0.0.1:$1/v1/chat/completions" | grep -q 200; then
      return 0
    fi
    sleep 0.2
  done
  echo "port $1 never answered" >&2; return 1
}
