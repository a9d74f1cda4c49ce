#!/usr/bin/env bash
# The host memory of the engine pod's launcher and shim (one Python process, `python -m flashmodel_engine
# launch`), apart from the vLLM processes it starts: its PSS peak until the shim's /readyz answers, then
# its VmRSS, RssAnon and RssFile after a few requests. Its size does not depend on the model, so the cpu
# profile and the tests' tiny model measure it here (docs/benchmarks/lora.md). From the project root:
#
#   PYTHON=~/.cache/flashmodel/venv-engine/bin/python MODEL=~/.cache/flashmodel/models/qwen2-tiny-v2 \
#     bash bench/engine/launcher_memory.sh
set -u
PYTHON=${PYTHON:-python3} MODEL=${MODEL:?the model directory} WORK=${WORK:-/tmp/launcher-memory}
ENGINE_PORT=${ENGINE_PORT:-18801} SHIM_PORT=${SHIM_PORT:-18802}
mkdir -p "$WORK"
cat >"$WORK/engine.yaml" <<YAML
accelerator: cpu
model: {path: $MODEL, servedName: m}
server: {host: 127.0.0.1, enginePort: $ENGINE_PORT, shimPort: $SHIM_PORT}
YAML
export PYTHONPATH=engine VLLM_CPU_KVCACHE_SPACE=1 FLASHMODEL_TERMINATION_LOG="$WORK/termination-log"
setsid "$PYTHON" -m flashmodel_engine launch --config "$WORK/engine.yaml" >"$WORK/launch.log" 2>&1 &
pid=$!
trap 'kill -TERM -- -$pid 2>/dev/null; sleep 5; kill -KILL -- -$pid 2>/dev/null' EXIT
pss_kib() { awk '/^Pss:/{print $2}' "/proc/$pid/smaps_rollup" 2>/dev/null || echo 0; }
peak=0 ready=""
for i in $(seq 1 240); do
  sleep 0.5
  p=$(pss_kib); [ "${p:-0}" -gt "$peak" ] && peak=$p
  if curl -sf "localhost:$SHIM_PORT/readyz" >/dev/null 2>&1; then ready=$((i / 2)); break; fi
done
[ -n "$ready" ] || { echo "not ready in 120 s; see $WORK/launch.log"; exit 1; }
for _ in 1 2 3 4 5 6; do
  curl -s "localhost:$ENGINE_PORT/v1/completions" -H 'content-type: application/json' \
    -d '{"model":"m","prompt":"hi","max_tokens":8}' >/dev/null
done
p=$(pss_kib); [ "$p" -gt "$peak" ] && peak=$p
echo "launcher+shim pid $pid ready_after_s=$ready pss_now_kib=$p pss_peak_kib=$peak"
grep -E "VmRSS|VmHWM|RssAnon|RssFile" "/proc/$pid/status"
