#!/usr/bin/env bash
# The SLO benchmark's command on the GPU machine (run from the project root, after the first call
# `bash .gpu/stage.sh` printed PARTIAL; ../shared/gpu/README.md has the staging steps):
#
#   bash bench/slo/gpu_run.sh --shim [--tile] [--only CASE,...]
#
# Stages vLLM 0.26.0 into /tmp/site, installs the project's wheel (.gpu/slo/flashmodel-*.whl,
# built here with `pip wheel --no-deps . -w .gpu/slo`) into /tmp/fmsite for the tile case only,
# and runs bench/slo/slo_gpu.py within the 10-minute command limit. What comes back: $OUT/slo/
# slo_results.json (every request), slo_table.md, servers.log, driver.log.
set -uo pipefail
bash .gpu/stage.sh || exit 3
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried
if ls .gpu/slo/flashmodel-*.whl >/dev/null 2>&1 && [ ! -d /tmp/fmsite/flashmodel_kernels ]; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/fmsite .gpu/slo/flashmodel-*.whl
fi
mkdir -p "$OUT/slo"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
# SECONDS counts the staging already spent; the script stops starting cases when its budget ends.
python3 bench/slo/slo_gpu.py --out "$OUT/slo" --budget-s "${BUDGET:-$((560 - SECONDS))}" "$@" 2>&1 \
  | tee "$OUT/slo/driver.log"
