#!/usr/bin/env bash
# Builds the e2e binaries (etcd, kube-*, kwok, helm; KEDA, Prometheus) from Go modules into versioned caches.
#
# Usage: scripts/testbin.sh [--control-plane-only | --print-dir | --print-keda-dir | --print-prometheus-dir]
#   Builds only what is missing in ${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}/testbin/<key>/ (the
#   control plane), .../testbin/keda-<version>/ (KEDA: operator, adapter, crds/) and
#   .../testbin/prometheus-<version>/, and prints the control-plane directory as the last line of
#   stdout. The --print-* options print a directory without building; --control-plane-only builds
#   the control plane alone (the demo runs neither KEDA nor Prometheus).
# Why Go modules: CI and dev machines reach only package registries (no Docker, no GitHub
# releases), see docs/control-plane.md.
set -euo pipefail

K8S_VERSION=v1.34.3
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.7.0
HELM_VERSION=v3.21.4
# v2.21.1's go.mod asks for go 1.27.4, newer than the toolchain here; v2.21.0 needs go 1.26.0.
KEDA_VERSION=v2.21.0
# Prometheus 3.16.0 (its Go module numbers v3.x.y as v0.3xy.z). Not Debian's package: Debian
# builds it without Kubernetes service discovery, which the documented scrape config uses.
PROMETHEUS_VERSION=v0.316.0
PROMETHEUS_RELEASE=3.16.0

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TESTBIN_SRC=$ROOT/e2e/testbin
CACHE=${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}
KEY=k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}_helm-${HELM_VERSION}
BIN_DIR=$CACHE/testbin/$KEY
BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok helm)
KEDA_DIR=$CACHE/testbin/keda-$KEDA_VERSION
# crds/.complete is written last, after every CRD file is in place.
KEDA_FILES=(operator adapter crds/.complete)
PROMETHEUS_DIR=$CACHE/testbin/prometheus-$PROMETHEUS_RELEASE

CONTROL_PLANE_ONLY=0
case ${1:-} in
  --control-plane-only) CONTROL_PLANE_ONLY=1 ;;
  --print-dir) echo "$BIN_DIR"; exit 0 ;;
  --print-keda-dir) echo "$KEDA_DIR"; exit 0 ;;
  --print-prometheus-dir) echo "$PROMETHEUS_DIR"; exit 0 ;;
esac

log() { echo "testbin: $*" >&2; }

# missing DIR FILE...: true if any FILE is not present in DIR (binaries: not executable).
missing() {
  local dir=$1 f
  shift
  for f in "$@"; do
    if [[ $f == */* ]]; then [[ -e $dir/$f ]] || return 0; else [[ -x $dir/$f ]] || return 0; fi
  done
  return 1
}

cp_missing() { missing "$BIN_DIR" "${BINARIES[@]}"; }
keda_missing() { missing "$KEDA_DIR" "${KEDA_FILES[@]}"; }
prometheus_missing() { missing "$PROMETHEUS_DIR" prometheus promtool; }

if ! cp_missing && { [[ $CONTROL_PLANE_ONLY == 1 ]] || { ! keda_missing && ! prometheus_missing; }; }; then
  echo "$BIN_DIR"
  exit 0
fi

command -v go >/dev/null || { log "error=go-not-found hint='install Go >= 1.26'"; exit 1; }

# Static binaries like upstream releases; local toolchain only (a download would need the network).
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
START=$(date +%s)

# Builds into a stage dir first and moves into place after, so a killed build never
# leaves a half-written binary that the "missing" check would accept.
install_staged() {
  local b
  for b in "$@"; do
    "$STAGE/$b" --version >/dev/null 2>&1 || "$STAGE/$b" version >/dev/null 2>&1 ||
      { log "error=binary-does-not-run binary=$b"; exit 1; }
    mv -f "$STAGE/$b" "$BIN_DIR/$b"
  done
}

KEDA_MOD=github.com/kedacore/keda/v2@$KEDA_VERSION
build_control_plane() {
  mkdir -p "$BIN_DIR"
  # One builder at a time: two pytest sessions starting together must not race on the same files.
  exec 9>"$BIN_DIR/.lock"
  flock 9
  STAGE=$BIN_DIR/.stage
  rm -rf "$STAGE"
  mkdir -p "$STAGE"
  if missing "$BIN_DIR" etcd; then
    log "building component=etcd version=$ETCD_VERSION"
    (cd "$TESTBIN_SRC/etcd" && go build -trimpath \
      -ldflags "-s -w" -o "$STAGE/etcd" go.etcd.io/etcd/server/v3)
    install_staged etcd
  fi

  if missing "$BIN_DIR" kube-apiserver kube-controller-manager kube-scheduler; then
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

  if missing "$BIN_DIR" kwok; then
    log "building component=kwok version=$KWOK_VERSION"
    # kwok and helm have no replace directives, so plain `go install pkg@version` works.
    GOBIN=$STAGE go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
    install_staged kwok
  fi

  if missing "$BIN_DIR" helm; then
    log "building component=helm version=$HELM_VERSION"
    GOBIN=$STAGE go install -trimpath \
      -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
      "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
    install_staged helm
  fi

  rm -rf "$STAGE"
  log "built dir=$BIN_DIR seconds=$(( $(date +%s) - START ))"
  "$BIN_DIR/kube-apiserver" --version >&2
  exec 9>&-
}

build_keda() {
  local t0 src
  t0=$(date +%s)
  mkdir -p "$KEDA_DIR"
  exec 8>"$KEDA_DIR/.lock"
  flock 8
  # Another builder may have finished while this one waited for the lock.
  if ! keda_missing; then exec 8>&-; return 0; fi
  STAGE=$KEDA_DIR/.stage
  rm -rf "$STAGE"
  mkdir -p "$STAGE/crds"
  log "building component=keda version=$KEDA_VERSION"
  src=$(go mod download -json "$KEDA_MOD" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $src ]] || { log "error=keda-module-not-downloaded module=$KEDA_MOD"; exit 1; }
  # Downloads apart from compiling, so the log shows what the network cost and what the CPU did.
  (cd "$src" && go list -deps ./cmd/operator ./cmd/adapter >/dev/null)
  log "downloaded component=keda seconds=$(( $(date +%s) - t0 ))"
  # Built inside the downloaded module (read-only; only -o writes): its go.mod has a replace
  # directive, which `go install pkg@version` refuses, and it ships its own go.sum.
  (cd "$src" && go build -trimpath \
    -ldflags "-s -w -X github.com/kedacore/keda/v2/version.Version=$KEDA_VERSION" \
    -o "$STAGE/" ./cmd/operator ./cmd/adapter)
  # Copied so tests need no module cache, which CI may prune after the build.
  cp "$src"/config/crd/bases/*.yaml "$STAGE/crds/"
  chmod u+w "$STAGE"/crds/*.yaml
  # Neither binary has a --version flag; --help exits 0 only if the binary starts.
  for b in operator adapter; do
    "$STAGE/$b" --help >/dev/null 2>&1 || { log "error=binary-does-not-run binary=keda-$b"; exit 1; }
  done
  rm -rf "$KEDA_DIR/crds"
  mv "$STAGE/crds" "$KEDA_DIR/crds"
  touch "$KEDA_DIR/crds/.complete"
  mv -f "$STAGE/operator" "$STAGE/adapter" "$KEDA_DIR/"
  rm -rf "$STAGE"
  log "built dir=$KEDA_DIR seconds=$(( $(date +%s) - t0 )) crds=$(ls "$KEDA_DIR"/crds/*.yaml | wc -l)"
  exec 8>&-
}

build_prometheus() {
  local t0
  t0=$(date +%s)
  mkdir -p "$PROMETHEUS_DIR"
  exec 7>"$PROMETHEUS_DIR/.lock"
  flock 7
  if ! prometheus_missing; then exec 7>&-; return 0; fi
  STAGE=$PROMETHEUS_DIR/.stage
  rm -rf "$STAGE"
  mkdir -p "$STAGE"
  log "building component=prometheus version=$PROMETHEUS_RELEASE"
  # remove_all_sd + enable_kubernetes_sd: of the ~28 service discoveries (each a cloud SDK) only
  # the one e2e uses. No builtinassets: the web UI is not needed, the HTTP API is.
  # promtool checks and unit-tests the chart's alerting rules (tests/chart/test_alerts.py).
  GOBIN=$STAGE go install -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=$PROMETHEUS_RELEASE" \
    "github.com/prometheus/prometheus/cmd/prometheus@$PROMETHEUS_VERSION" \
    "github.com/prometheus/prometheus/cmd/promtool@$PROMETHEUS_VERSION"
  for b in prometheus promtool; do
    "$STAGE/$b" --version >/dev/null 2>&1 || { log "error=binary-does-not-run binary=$b"; exit 1; }
    mv -f "$STAGE/$b" "$PROMETHEUS_DIR/$b"
  done
  rm -rf "$STAGE"
  log "built dir=$PROMETHEUS_DIR seconds=$(( $(date +%s) - t0 ))"
  exec 7>&-
}

# KEDA after the control plane, in this one job: both are CPU-bound compiles, so side by side on
# 2 cores they would only take turns, while scripts/test.sh runs the venv download beside this job.
if cp_missing; then build_control_plane; fi
if [[ $CONTROL_PLANE_ONLY == 0 ]]; then
  if keda_missing; then build_keda; fi
  if prometheus_missing; then build_prometheus; fi
fi
echo "$BIN_DIR"
