#!/usr/bin/env bash
# The SLO benchmark as ONE run that outlives the 10-minute command limit: started in its own
# process session (the device keeps such a process running between calls), then followed by
# calls that wait on it and bring back what it has written so far. Every pair the issue asks
# for then comes from the same script run, in one machine hold. From the project root:
#
#   DEVICE_LEFT_S=N bash bench/slo/gpu_bg.sh start RUN [slo_gpu.py args...]   # stage, wheel, models, launch, follow
#   bash bench/slo/gpu_bg.sh follow RUN                       # wait (up to FOLLOW_S, default 560 s), copy back
#
# `start` needs the staged vLLM (.gpu/stage.sh; exit 3 while parts are missing) and builds the
# models named in MODELS (default "0.5b 1.5b 7b") on the GPU first: the GPU is idle then, and a
# model built on the CPU during a case would take the host the eager engine needs.
# What comes back, under $OUT/RUN: driver.log, servers.log, the script's tables (*.md) and results (*.json.gz).
set -uo pipefail
cmd=${1:?start or follow} run=${2:?run name}
shift 2
dir=/tmp/slo-bg/$run
# SCRIPT: the benchmark to run (bench/slo/goodput_gpu.py: the goodput comparison in a T4 envelope).
export SCRIPT=${SCRIPT:-bench/slo/slo_gpu.py}
# EXTRA_PYTHONPATH: what SCRIPT imports beyond vLLM (the kernel proof: "kernels:.").
export PYTHONPATH=/tmp/site${EXTRA_PYTHONPATH:+:$EXTRA_PYTHONPATH} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried

copy_back() {
  mkdir -p "$OUT/$run"
  cp "$dir"/driver.log "$dir"/*.md "$dir"/*.txt "$dir"/*.gz "$dir"/servers.log "$OUT/$run/" 2>/dev/null
  for f in "$dir"/*.json; do [ -f "$f" ] && gzip -c "$f" >"$OUT/$run/$(basename "$f").gz"; done
  tail -n 4 "$dir/driver.log" 2>/dev/null | cut -c1-400
}

# shellcheck source=bench/slo/gpu_follow.sh
source "$(dirname "${BASH_SOURCE[0]}")/gpu_follow.sh"

case $cmd in
start)
  bash .gpu/stage.sh || exit 3
  if ls .gpu/slo/flashmodel-*.whl >/dev/null 2>&1 && [ ! -d /tmp/fmsite/flashmodel_kernels ]; then
    python3 -m pip install -q --no-deps --no-index --target /tmp/fmsite .gpu/slo/flashmodel-*.whl
  fi
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  builds=()
  for shape in ${MODELS-0.5b 1.5b 7b}; do
    [ -f "/tmp/slo-models/$shape/config.json" ] || builds+=("/tmp/slo-models/$shape" "$shape")
  done
  if [ ${#builds[@]} -gt 0 ]; then  # one process for all: torch's import is paid once
    t0=$SECONDS
    python3 bench/slo/mkmodel.py "${builds[@]}" || { echo "model build failed"; exit 4; }
    echo "models built in $((SECONDS - t0))s"
  fi
  mkdir -p "$dir"
  # DEVICE_LEFT_S (the device time left when this call began) sets the run's budget after the
  # staging and model builds above, less MARGIN_S for the last copy back.
  [ -n "${DEVICE_LEFT_S:-}" ] && set -- --budget-s $((DEVICE_LEFT_S - SECONDS - ${MARGIN_S:-45})) "$@"
  # The script writes its own pid: setsid may fork, and then $! would be a process already gone.
  setsid nohup sh -c 'echo $$ >"$0/pid"; exec python3 "$SCRIPT" --out "$0" "$@"' "$dir" "$@" \
    >"$dir/driver.log" 2>&1 </dev/null &
  sleep 1
  echo "started $run pid $(cat "$dir/pid") at ${SECONDS}s"
  follow
  ;;
follow) follow ;;
*) echo "start or follow" >&2; exit 2 ;;
esac
