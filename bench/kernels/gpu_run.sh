#!/usr/bin/env bash
# Everything the kernels need from the GPU machine, in one command (device time is scarce):
#   bash .gpu/stage.sh && bash bench/kernels/gpu_run.sh
# 1. vLLM 0.26 with tile attention (--attention-backend CUSTOM) serving a random-weight
#    Qwen2.5-1.5B, FLASHMODEL_TILE_VERIFY=1 comparing every call with TRITON_ATTN;
# 2. meanwhile the kernel tests on the GPU (real Triton; includes the sm_75 compile check);
# 3. then, alone on the GPU, correctness at real shapes and the decode/prefill benchmark.
# SKIP_VLLM=1 leaves out step 1 and the wheel it installs into /tmp/site (whose plugin entry point
# would then load into every later vLLM on the machine, "vLLM defaults" included, e.g. the SLO
# cases of a later call); BENCH_ARGS go to bench_attention.py; PREBUILD="7b 1.5b" builds those
# SLO models into /tmp/slo-models on the CPU meanwhile (for a later call on the same machine).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
if [ -n "${PREBUILD:-}" ]; then
  mkdir -p /tmp/slo-models
  ( for s in $PREBUILD; do
      [ -f /tmp/slo-models/$s/config.json ] && continue
      CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=4 nice -n 19 python3 bench/slo/mkmodel.py /tmp/slo-models/$s.partial $s >/dev/null 2>&1 \
        && mv /tmp/slo-models/$s.partial /tmp/slo-models/$s
    done ) &
  BUILDS=$!
fi
if [ "${SKIP_VLLM:-0}" != 1 ]; then
python3 -m pip install -q --no-deps --no-compile --target /tmp/site .gpu/flashmodel-*.whl 2>&1 | tail -2
python3 -c "import vllm, flashmodel_kernels.vllm_plugin as p; print('vllm', vllm.__version__, 'plugin', p.__file__)" 2>&1 | grep -v Warn | tee -a "$OUT/env.txt"
M=/tmp/model-1.5b
[ -d $M ] || python3 .gpu/mk.py $M 1.5b 2>&1 | tail -1
stamp "model ready"
FLASHMODEL_TILE_VERIFY=1 timeout 420 python3 -m vllm.entrypoints.openai.api_server --model $M --served-model-name m \
  --dtype float16 --block-size 16 --max-model-len 4096 --gpu-memory-utilization 0.30 --max-num-seqs 64 \
  --enforce-eager --attention-backend CUSTOM --port 8000 > "$OUT/vllm_tile.log" 2>&1 &
SP=$!
fi
# From the repository root: the root conftest.py puts the kernel tests in the engine tier, which
# needs torch, Triton and vLLM importable here (vLLM from /tmp/site).
PYTHONPATH=/tmp/site:kernels:. timeout 200 python3 -m pytest tests/kernels -q -p no:cacheprovider \
  > "$OUT/pytest_gpu.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
stamp "pytest: $(tail -n 2 "$OUT/pytest_gpu.txt" | tr '\n' ' ')"
if [ "${SKIP_VLLM:-0}" != 1 ]; then
for i in $(seq 1 150); do curl -sf localhost:8000/health >/dev/null && break; kill -0 $SP 2>/dev/null || break; sleep 2; done
stamp "server: $(curl -sf localhost:8000/health >/dev/null && echo up || echo DOWN)"
timeout 120 python3 -m bench.kernels.vllm_requests --port 8000 --out "$OUT/vllm_requests.json" 2>&1 | tail -3
kill $SP 2>/dev/null; wait $SP 2>/dev/null
stamp "vllm done"
grep -E "flashmodel tile attention|Using .*backend|Traceback|Error" "$OUT/vllm_tile.log" | cut -c1-300 | head -12
echo "verify lines: $(grep -c 'tile verify' "$OUT/vllm_tile.log"); worst: $(grep -o 'rel_err_vs_triton_attn=[0-9.e+-]*' "$OUT/vllm_tile.log" | sort -t= -k2 -g | tail -1)"
grep "tile verify" "$OUT/vllm_tile.log" | sed -n '1p;$p' | cut -c1-300
fi
# shellcheck disable=SC2086  # BENCH_ARGS is a list of flags
PYTHONPATH=/tmp/site:kernels:. timeout "${BENCH_TIMEOUT:-300}" python3 -m bench.kernels.bench_attention --out "$OUT" ${BENCH_ARGS:-} \
  > "$OUT/bench_attention.txt" 2>&1
stamp "bench rc=$?"; grep -v "^correctness" "$OUT/bench_attention.txt" | tail -70 | cut -c1-420
if [ -n "${BUILDS:-}" ]; then wait "$BUILDS"; stamp "models: $(ls /tmp/slo-models | tr '\n' ' ')"; fi
