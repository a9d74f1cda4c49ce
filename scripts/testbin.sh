#!/usr/bin/env bash
# Builds the e2e control-plane binaries (etcd, kube-*, kwok, helm) from Go modules into a versioned cache.
#
# Usage: scripts/testbin.sh [--print-dir]
#   Builds only what is missing in ${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}/testbin/<key>/ and
#   prints that directory as the last line of stdout. --print-dir prints it without building.
# Why Go modules: CI and dev machines reach only package registries (no Docker, no GitHub
# releases), see docs/control-plane.md.
set -euo pipefail

K8S_VERSION=v1.34.3
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.7.0
HELM_VERSION=v3.21.4

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TESTBIN_SRC=$ROOT/e2e/testbin
CACHE=${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}
KEY=k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}
BIN_DIR=$CACHE/testbin/$KEY
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok helm)

if [[ ${1:-} == --print-dir ]]; then
  echo "$BIN_DIR"
  exit 0
fi

log() { echo "testbin: $*" >&2; }

missing() {
  local b
  for b in "$@"; do [[ -x $BIN_DIR/$b ]] || return 0; done
  return 1
}

if ! missing "${BINARIES[@]}"; then
  echo "$BIN_DIR"
  exit 0
fi

command -v go >/dev/null || { log "error=go-not-found hint='install Go >= 1.26'"; exit 1; }
mkdir -p "$BIN_DIR"
# One builder at a time: two pytest sessions starting together must not race on the same files.
exec 9>"$BIN_DIR/.lock"
flock 9

# Static binaries like upstream releases; local toolchain only (a download would need the network).
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
STAGE=$BIN_DIR/.stage
rm -rf "$STAGE"
mkdir -p "$STAGE"
START=$(date +%s)

# Builds into the stage dir first and moves into place after, so a killed build never
# leaves a half-written binary that the "missing" check would accept.
install_staged() {
  local b
  for b in "$@"; do
    "$STAGE/$b" --version >/dev/null 2>&1 || "$STAGE/$b" version >/dev/null 2>&1 ||
      { log "error=binary-does-not-run binary=$b"; exit 1; }
    mv -f "$STAGE/$b" "$BIN_DIR/$b"
  done
}

if missing etcd; then
  log "building component=etcd version=$ETCD_VERSION"
  (cd "$TESTBIN_SRC/etcd" && go build -trimpath \
    -ldflags "-s -w" -o "$STAGE/etcd" go.etcd.io/etcd/server/v3)
  install_staged etcd
fi

if missing kube-apiserver kube-controller-manager kube-scheduler; then
  log "building component=kubernetes version=$K8S_VERSION"
  minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  # Without these the binaries report v0.0.0-master, which breaks version-skew checks.
  ldflags="-s -w \
    -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
    -X k8s.io/component-base/version.gitMajor=1 \
    -X k8s.io/component-base/version.gitMinor=$minor \
    -X k8s.io/component-base/version.gitTreeState=clean \
    -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  # One go build for all three: they share most packages, so each compiles once.
  (cd "$TESTBIN_SRC/k8s" && go build -trimpath -ldflags "$ldflags" -o "$STAGE/" \
    ./cmd/kube-apiserver ./cmd/kube-controller-manager ./cmd/kube-scheduler)
  install_staged kube-apiserver kube-controller-manager kube-scheduler
fi

if missing kwok; then
  log "building component=kwok version=$KWOK_VERSION"
  # kwok and helm have no replace directives, so plain `go install pkg@version` works.
  GOBIN=$STAGE go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
  install_staged kwok
fi

if missing helm; then
  log "building component=helm version=$HELM_VERSION"
  GOBIN=$STAGE go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
  install_staged helm
fi

rm -rf "$STAGE"
log "built dir=$BIN_DIR seconds=$(( $(date +%s) - START ))"
"$BIN_DIR/kube-apiserver" --version >&2
echo "$BIN_DIR"
