#!/usr/bin/env bash
# The kernel benchmark alone, with the split sweep (no vLLM server):
#   bash .gpu/stage.sh && bash bench/kernels/gpu_bench.sh
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:kernels VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
timeout 420 python3 bench/kernels/bench_attention.py --out "$OUT" --sweep > "$OUT/bench_attention.txt" 2>&1
echo "bench rc=$?"; grep -v "^correctness" "$OUT/bench_attention.txt" | cut -c1-330 | tail -64
grep -c '"unwritten": 0' "$OUT/bench_attention.txt"; grep -o '"rel_err_vs_float64": [0-9.e-]*' "$OUT/bench_attention.txt" | sort -t: -k2 -g | tail -1
