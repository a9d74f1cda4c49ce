#!/usr/bin/env bash
# The split sweep for issue 5 and the GPU kernel tests, in one command of at most 4 minutes (pytest <= 60 s, bench <= 170 s):
#   bash .gpu/stage.sh && bash bench/kernels/gpu_sweep.sh
# Needs only vLLM 0.26 in /tmp/site (stage.sh); the kernels are imported from this checkout
# (kernels/ first on PYTHONPATH), so no wheel has to be rebuilt for a kernel change.
# $OUT gets: env.txt, pytest_gpu.txt, bench_attention.txt, bench_attention.json, fit_splits.txt.
# Then, here: python3 bench/kernels/fit_splits.py $OUT/bench_attention.json [--search] [--candidate ...]
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=kernels:/tmp/site VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi; python3 -c "import torch, triton, vllm; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__)"; } > "$OUT/env.txt" 2>&1
tail -n 1 "$OUT/env.txt"
timeout 60 python3 -m pytest tests/kernels -q -p no:cacheprovider -o addopts="" \
  --rootdir=tests/kernels -c /dev/null > "$OUT/pytest_gpu.txt" 2>&1; echo "pytest rc=$?" >> "$OUT/pytest_gpu.txt"
stamp "pytest: $(tail -n 2 "$OUT/pytest_gpu.txt" | tr '\n' ' ')"
# The decode sweep stops its optional tiers (power-of-two splits, small key tiles) 80 s into decode;
# every config a candidate rule picks is always timed. The JSON is rewritten after each shape.
timeout 170 python3 bench/kernels/bench_attention.py --out "$OUT" --sweep --sweep-budget-s 80 \
  > "$OUT/bench_attention.txt" 2>&1
stamp "bench rc=$?"
grep -E "^section|budget|failed" "$OUT/bench_attention.txt"
echo "correctness: $(grep -c '"unwritten": 0' "$OUT/bench_attention.txt") cases fully written; worst rel err vs float64:" \
  "$(grep -o '"rel_err_vs_float64": [0-9.e-]*' "$OUT/bench_attention.txt" | sort -t: -k2 -g | tail -1)"
python3 bench/kernels/fit_splits.py "$OUT/bench_attention.json" --best --search > "$OUT/fit_splits.txt" 2>&1
grep "^#" "$OUT/fit_splits.txt" | cut -c1-300; tail -n 16 "$OUT/fit_splits.txt" | cut -c1-300
stamp done
