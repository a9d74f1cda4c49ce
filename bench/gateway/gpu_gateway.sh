#!/usr/bin/env bash
# The fleet gateway benchmark on the GPU machine, as ONE background run (bench/slo/gpu_bg.sh's
# pattern): the gateway parts are staged over two calls, then the run starts in its own process
# session and later calls follow it. From the project root, after vLLM is staged (.gpu/stage.sh
# printed STAGED); bench/gateway/README.md has the exact calls and what each carries:
#
#   bash bench/gateway/gpu_gateway.sh stage               # copy the gw parts this call carried; PARTIAL (exit 3) until all are in
#   bash bench/gateway/gpu_gateway.sh start RUN [fleet.py args...]   # stage the rest, unpack, check, launch, follow
#   bash bench/gateway/gpu_gateway.sh follow RUN          # wait up to FOLLOW_S (default 560 s), copy back every minute
#   bash bench/gateway/gpu_gateway.sh check               # stage and check the binaries only (a dry run)
#
# What comes back, under $OUT/RUN: driver.log, fleet_table.md, fleet_results.json.gz, logs.tar.gz
# (engine, EPP, Envoy and API server logs).
set -uo pipefail
cmd=${1:?stage, start or follow}
run=${2:-gw}
[ $# -ge 2 ] && shift 2 || shift 1
# The *_DIR overrides exist for a dry run of the staging on another machine; the GPU run uses the defaults.
dir=${RUN_DIR:-/tmp/gw-bg}/$run
site=${SITE_DIR:-/tmp/site}         # vLLM, staged by .gpu/stage.sh
parts=${GW_PARTS_DIR:-/tmp/gw-parts}  # every .gwp/gw.part* any call carried (a carried file is gone at the next call)
gw=${GW_DIR:-/tmp/gw}               # unpacked: kube-apiserver etcd epp envoy inferencepool.yaml sa.key sa.pub
models=${MODELS_DIR:-/tmp/slo-models}
zs=${ZS_DIR:-/tmp/zs}               # the zstandard module (.gpu/stage.sh installs it there)
export PYTHONPATH=$site HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0  # flashinfer is not carried

copy_back() {
  mkdir -p "$OUT/$run"
  cp "$dir"/driver.log "$dir"/out/fleet_table.md "$OUT/$run/" 2>/dev/null
  [ -f "$dir/out/fleet_results.json" ] && gzip -c "$dir/out/fleet_results.json" >"$OUT/$run/fleet_results.json.gz"
  [ -d "$dir/out/logs" ] && tar -C "$dir/out" -czf "$OUT/$run/logs.tar.gz" logs 2>/dev/null
  tail -n 4 "$dir/driver.log" 2>/dev/null | cut -c1-400
}

# shellcheck source=bench/slo/gpu_follow.sh
source "$(dirname "${BASH_SOURCE[0]}")/../slo/gpu_follow.sh"

# Copy the parts this call carried; unpack once all are in. 0: unpacked, 3: parts missing, 4: broken.
stage() {
  mkdir -p "$parts"
  for p in .gwp/gw.part*; do [ -f "$p" ] && cp "$p" "$parts/"; done
  [ -f .gwp/gw.count ] && cp .gwp/gw.count .gwp/gw.sha256 "$parts/" 2>/dev/null
  [ -f "$gw/.done" ] && { echo "GW STAGED (already)"; return 0; }
  [ -f "$parts/gw.count" ] || { echo "GW PARTIAL: no gw.count yet (carry .gwp/gw.count with every gateway call)"; return 3; }
  local want have
  want=$(cat "$parts/gw.count")
  have=$(ls "$parts"/gw.part* 2>/dev/null | wc -l)
  if [ "$have" -lt "$want" ]; then echo "GW PARTIAL: $have of $want parts: $(ls "$parts" | tr '\n' ' ')"; return 3; fi
  (cd "$parts" && sha256sum -c --quiet gw.sha256) || { echo "GW BROKEN: a part does not match gw.sha256"; return 4; }
  if ! PYTHONPATH=$zs python3 -c "import zstandard" 2>/dev/null; then
    # .gpu/stage.sh installs it with vLLM's last part; carried again here only if that never ran.
    ls .gpu/zstandard-*.whl >/dev/null 2>&1 || { echo "GW BROKEN: no zstandard in $zs: stage vLLM first (.gpu/stage.sh)"; return 4; }
    python3 -m pip install -q --no-deps --target "$zs" .gpu/zstandard-*.whl
  fi
  mkdir -p "$gw"
  cat "$parts"/gw.part* | PYTHONPATH=$zs python3 -c \
    "import sys,zstandard; zstandard.ZstdDecompressor().copy_stream(sys.stdin.buffer, sys.stdout.buffer)" \
    | tar -C "$gw" -xf - || { echo "GW BROKEN: unpacking failed"; return 4; }
  touch "$gw/.done"
  echo "GW STAGED: $(ls "$gw" | tr '\n' ' ')"
}

# The binaries must run here: the EPP needs glibc >= 2.34 unless it was built static (pack_gpu.sh
# records which), Envoy >= 2.30; kube-apiserver and etcd are static Go builds.
check_binaries() {
  echo "glibc: $(ldd --version 2>&1 | head -1)"
  local ok=0
  "$gw/envoy" --version >/dev/null 2>&1 || { echo "BINARY FAILS: envoy --version: $("$gw/envoy" --version 2>&1 | tail -2) (Envoy 1.36.2 needs glibc >= 2.30)"; ok=1; }
  "$gw/epp" --help >/dev/null 2>&1 || { echo "BINARY FAILS: epp --help: $("$gw/epp" --help 2>&1 | tail -2) (a cgo EPP needs glibc >= 2.34; CGO_ENABLED=0 in scripts/gateway.sh makes it static)"; ok=1; }
  "$gw/kube-apiserver" --version >/dev/null 2>&1 || { echo "BINARY FAILS: kube-apiserver"; ok=1; }
  "$gw/etcd" --version >/dev/null 2>&1 || { echo "BINARY FAILS: etcd"; ok=1; }
  return $ok
}

# The 1.5B-shaped random-weight model, built on the GPU in the background while the next call's
# parts travel (bench/slo/mkmodel.py: the byte-level BPE the load generator's prompts need).
build_model() {
  [ -f "$models/1.5b.done" ] && return 0
  [ -f "$models/build.pid" ] && kill -0 "$(cat "$models/build.pid")" 2>/dev/null && return 0
  mkdir -p "$models"
  # The marker, not config.json: save_pretrained writes the config before the weights.
  setsid nohup sh -c 'echo $$ >"$0/build.pid"; python3 bench/slo/mkmodel.py "$0/1.5b" 1.5b && touch "$0/1.5b.done"' \
    "$models" \
    >"$models/build.log" 2>&1 </dev/null &
  echo "model build started in the background"
}

case $cmd in
stage)
  # Copies the gateway parts whether or not vLLM is in yet, so a small part can ride with a vLLM
  # part's call; the model build needs vLLM's staged packages beside torch, so it waits for them.
  if [ -f "$site/.done" ]; then build_model; else echo "vLLM not staged yet: the model build waits for it"; fi
  stage
  ;;
start)
  [ -f "$site/.done" ] || { echo "vLLM not staged: run the .gpu/stage.sh calls first"; exit 3; }
  build_model
  stage || exit $?
  check_binaries || exit 5
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  t0=$SECONDS
  while [ ! -f "$models/1.5b.done" ]; do
    pid=$(cat "$models/build.pid" 2>/dev/null)
    if [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
      sleep 1; [ -f "$models/1.5b.done" ] && break
      echo "model build failed:"; tail -5 "$models/build.log"; exit 4
    fi
    sleep 2
  done
  echo "model ready after ${SECONDS}s (waited $((SECONDS - t0))s)"
  mkdir -p "$dir/out"
  # BUDGET_S: the run's own limit on starting new steps (engine starts included); the default fits
  # ~15 minutes of device time with the staging calls.
  export GW_DIR=$gw MODEL_DIR=$models/1.5b
  setsid nohup sh -c 'echo $$ >"$0/pid"; exec python3 bench/gateway/fleet.py --out "$0/out" --parts "$GW_DIR" \
      --model "$MODEL_DIR" --budget-s "${BUDGET_S:-720}" "$@"' "$dir" "$@" \
    >"$dir/driver.log" 2>&1 </dev/null &
  sleep 1
  echo "started $run pid $(cat "$dir/pid") at ${SECONDS}s"
  follow
  ;;
check)  # stage and check the binaries, launch nothing (a dry run of the staging)
  stage || exit $?
  check_binaries || exit 5
  echo "GW CHECKED"
  ;;
follow) follow ;;
*) echo "stage, start, check or follow" >&2; exit 2 ;;
esac
