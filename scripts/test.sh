#!/usr/bin/env bash
# The whole test suite: the Rust workspace, then the Python package (kvgate.ray) under
# real Ray Serve. Creates a virtualenv for the Python tests on first use
# (${KVGATE_PY_VENV:-target/py-venv}: ray[serve] 2.60, pytest, aiohttp, maturin from PyPI),
# builds the package into it (maturin develop, debug profile: it shares the Rust
# workspace's build), and runs pytest with the kvgate binary cargo just built.
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET="$(realpath -m "${CARGO_TARGET_DIR:-target}")"
VENV="$(realpath -m "${KVGATE_PY_VENV:-$TARGET/py-venv}")"

echo "== cargo test --workspace"
cargo test --workspace

echo "== cargo test: engines found through the Kubernetes API (--features kubernetes)"
cargo test -p kvgate-gateway --features kubernetes --test kubernetes

echo "== python: kvgate package and kvgate.ray under Ray Serve"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import ray, pytest, aiohttp, maturin" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet "ray[serve]==2.60.*" "pytest>=8" "aiohttp>=3.9" "maturin>=1.7,<2"
fi
(cd crates/kvgate-py && VIRTUAL_ENV="$VENV" PATH="$VENV/bin:$PATH" maturin develop --quiet)
KVGATE_BIN="$TARGET/debug/kvgate" "$VENV/bin/python" -m pytest -q crates/kvgate-py/tests
