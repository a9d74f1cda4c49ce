#!/usr/bin/env bash
# The main job on a local default: a real control plane (etcd, kube-apiserver, controller-manager,
# scheduler, kwok fake T4 nodes), the CRD, the operator, the examples/ FlashModels, `kubectl get fm`.
#
#   bash scripts/demo.sh           # shows the result, then stops everything
#   bash scripts/demo.sh --keep    # stays up until Ctrl-C; prints the KUBECONFIG to use
#
# Pods run on kwok nodes, which start no containers: the demo shows the operator's work
# (children, scheduling onto T4 nodes, status), not a serving engine. The tests put a real
# vLLM behind those pods (e2e/).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
CACHE="${FLASHMODEL_CACHE:-$HOME/.cache/flashmodel}"
export FLASHMODEL_CACHE="$CACHE"
VENV="$CACHE/venv-operator"
KEEP=${1:-}
log() { echo "demo: $*" >&2; }

# The operator needs none of torch/vLLM: a small venv of its own.
if [[ ! -x "$VENV/bin/python" ]]; then python3 -m venv "$VENV"; fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT"
BIN=$(bash scripts/testbin.sh | tail -n 1)
export PATH="$BIN:$PATH"

WORK=$(mktemp -d /tmp/flashmodel-demo.XXXXXX)
cleanup() {
  log "event=stopping"
  [[ -n ${OP_PID:-} ]] && kill "$OP_PID" 2>/dev/null && wait "$OP_PID" 2>/dev/null
  "$VENV/bin/python" -m e2e.cluster down --dir "$WORK/cluster" || true
}
trap cleanup EXIT

log "event=control-plane-starting dir=$WORK/cluster"
"$VENV/bin/python" -m e2e.cluster up --dir "$WORK/cluster" --nodes 3 --no-kwok-taint >"$WORK/cluster.out" 2>"$WORK/cluster.log" &
for _ in $(seq 1 180); do
  grep -q '^KUBECONFIG=' "$WORK/cluster.out" 2>/dev/null && break
  sleep 1
done
grep -q '^KUBECONFIG=' "$WORK/cluster.out" || { tail -30 "$WORK/cluster.log" >&2; exit 1; }
export KUBECONFIG="$WORK/cluster/kubeconfig"
log "event=control-plane-ready kubeconfig=$KUBECONFIG"

kubectl apply --server-side -f crds/flashmodel.yaml >/dev/null
kubectl wait --for=condition=Established crd/flashmodels.serving.flashmodel.io --timeout=60s >/dev/null
FLASHMODEL_RESYNC_SECONDS=10 "$VENV/bin/python" -m flashmodel_operator --all-namespaces --standalone \
  >"$WORK/operator.log" 2>&1 &
OP_PID=$!
log "event=operator-started pid=$OP_PID log=$WORK/operator.log"

# What the examples refer to: their API-key Secrets and model volumes (static PVs here; a real
# cluster has a storage class and a secret store).
for secret in $(grep -h -A1 'apiKeySecretRef:' examples/*.yaml | awk '/name:/ {print $2}' | sort -u); do
  kubectl create secret generic "$secret" --from-literal=api-key="demo-$RANDOM" >/dev/null 2>&1 || true
done
for claim in $(grep -h 'claimName:' examples/*.yaml | awk '{print $2}' | sort -u); do
  kubectl apply -f - >/dev/null <<YAML
apiVersion: v1
kind: PersistentVolume
metadata: {name: demo-$claim}
spec:
  capacity: {storage: 20Gi}
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  hostPath: {path: /models/$claim}
  claimRef: {namespace: default, name: $claim}
---
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $claim, namespace: default}
spec:
  accessModes: [ReadOnlyMany]
  storageClassName: ""
  volumeName: demo-$claim
  resources: {requests: {storage: 20Gi}}
YAML
done
kubectl apply -f examples/
sleep 8
kubectl get fm -o wide
echo
kubectl get deployments,services,configmaps,poddisruptionbudgets,hpa,pods -l app.kubernetes.io/managed-by=flashmodel-operator -o wide
echo
kubectl get fm -o jsonpath='{range .items[*]}{.metadata.name}{": "}{.status.engineArgs}{"\n"}{end}'

if [[ $KEEP == --keep ]]; then
  log "event=up kubeconfig=$KUBECONFIG hint='export KUBECONFIG=$KUBECONFIG; kubectl get fm'; Ctrl-C stops"
  wait "$OP_PID"
fi
