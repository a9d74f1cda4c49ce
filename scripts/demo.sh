#!/usr/bin/env bash
# The main job, locally: a real control plane (etcd, kube-apiserver, controller-manager, scheduler,
# kwok fake T4 nodes), the CRD, the operator and the examples/ FlashModels; then a FlashModel whose
# two pods run real vLLM engines (a tiny random-weight model, on the CPU), one serving a chat
# completion behind the prewarm gate and one prewarmed as a standby; the serving one's memory
# diverges and the standby takes its place while a client keeps sending requests. The driver is
# e2e/harness/demo.py.
#
#   bash scripts/demo.sh                  # everything, then stops (about 2.5 minutes warm on two cores)
#   bash scripts/demo.sh --objects-only   # only the examples' objects, no vLLM (about 25 s warm)
#   bash scripts/demo.sh --keep           # stays up at the end until Ctrl-C; prints the KUBECONFIG
#
# The serving acts need root (each engine pod gets a network namespace, `ip netns`) and the
# engine venv, which this script installs the first time (scripts/setup-engine.sh). The first
# run builds the control plane from Go modules and installs torch and vLLM for the CPU, under
# ~/.cache/flashmodel (the README's Quick start says how long and how much disk); the build's own
# output goes to log files there, and this script prints one line per step.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE="${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}"
export FLASHMODEL_CACHE="$CACHE"
VENV="$CACHE/venv-operator"
ENGINE_VENV="${FLASHMODEL_ENGINE_VENV:-$CACHE/venv-engine}"
export FLASHMODEL_ENGINE_VENV="$ENGINE_VENV"
log() { echo "demo: $*" >&2; }

OBJECTS_ONLY=
for arg in "$@"; do
  case $arg in
    --objects-only) OBJECTS_ONLY=1 ;;
    --keep) ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) log "unknown argument '$arg'; use --objects-only, --keep or --help"; exit 2 ;;
  esac
done

# The operator and the driver need none of torch/vLLM: a small venv of their own, with the
# project's dependencies only. The code itself comes from this checkout (PYTHONPATH), so two
# checkouts sharing the cache never run each other's operator.
t=$(date +%s)
if [[ ! -x "$VENV/bin/python" ]]; then
  log "event=install what=operator-venv path=$VENV"
  python3 -m venv "$VENV"
fi
mapfile -t DEPS < <(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${DEPS[@]}" \
  || { log "event=failed what=operator-venv hint='pip could not install ${DEPS[*]}; check the network, or delete $VENV and retry'"; exit 1; }
log "event=ready what=operator-venv seconds=$(( $(date +%s) - t ))"

t=$(date +%s)
BUILD_LOG="$CACHE/demo-control-plane-build.log"
log "event=check what=control-plane-binaries log=$BUILD_LOG note='the first run builds them from Go modules: minutes, see the log'"
mkdir -p "$CACHE"
BIN=$(bash scripts/testbin.sh --control-plane-only 2>"$BUILD_LOG" | tail -n 1) \
  || { log "event=failed what=control-plane-binaries log=$BUILD_LOG"; tail -n 20 "$BUILD_LOG" >&2; exit 1; }
export FLASHMODEL_TESTBIN="$BIN" PATH="$BIN:$PATH"
log "event=ready what=control-plane-binaries seconds=$(( $(date +%s) - t )) dir=$BIN"

if [[ -z $OBJECTS_ONLY ]]; then
  if ! "$ENGINE_VENV/bin/python" -c 'import importlib.util as u, sys; sys.exit(0 if u.find_spec("vllm") else 1)' 2>/dev/null; then
    t=$(date +%s)
    ENGINE_LOG="$CACHE/demo-engine-setup.log"
    log "event=install what=engine-venv path=$ENGINE_VENV log=$ENGINE_LOG note='torch and vLLM for the CPU, about 5 GB: several minutes on the first run; --objects-only needs none of it'"
    bash scripts/setup-engine.sh >"$ENGINE_LOG" 2>&1 \
      || { log "event=failed what=engine-venv log=$ENGINE_LOG hint='read the log, rerun bash scripts/setup-engine.sh, or use --objects-only'"; tail -n 20 "$ENGINE_LOG" >&2; exit 1; }
    log "event=ready what=engine-venv seconds=$(( $(date +%s) - t ))"
  fi
fi

export PYTHONPATH="$ROOT/operator:$ROOT/engine:$ROOT/kernels:$ROOT"
exec "$VENV/bin/python" -m e2e.harness.demo --engine-python "$ENGINE_VENV/bin/python" "$@"
