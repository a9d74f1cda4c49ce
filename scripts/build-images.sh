#!/usr/bin/env bash
# Builds the operator and engine images with whatever builder this machine has, and pushes them.
#
#   bash scripts/build-images.sh                                   # build both, tagged ghcr.io/flashmodel/*:<version>
#   bash scripts/build-images.sh --registry registry.example.com/ml --push
#   bash scripts/build-images.sh --builder podman --platform linux/amd64 --only engine
#   bash scripts/build-images.sh --dry-run                         # print the commands, run nothing
#
# The version is pyproject.toml's (the chart's appVersion is the same: tests/test_versions.py); the
# engine image's vLLM is engine_version.IMAGE_VLLM_VERSION, passed to Dockerfile.engine as
# VLLM_VERSION, so the image carries the vLLM the engine's option tables and checks were made for.
# Builders, first found wins unless --builder says: docker (BuildKit), podman, buildah. Pushing
# uses the builder's own login (docker login / podman login / buildah login REGISTRY).
#
# Then point the chart at the registry:
#   helm install flashmodel charts/flashmodel-operator --set image.repository=REGISTRY/operator ...
# and pass the engine image as the operator's configuration where the chart has it, or set
# spec.engine.image on the FlashModels (docs/design.md).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log() { echo "build-images: $*" >&2; }
usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; }

registry=ghcr.io/flashmodel builder= platform= push=0 dry=0 only=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --registry) registry=${2:?--registry needs a value}; shift 2 ;;
    --builder) builder=${2:?--builder needs docker, podman or buildah}; shift 2 ;;
    --platform) platform=${2:?--platform needs a value, e.g. linux/amd64}; shift 2 ;;
    --only) only=${2:?--only needs operator or engine}; shift 2 ;;
    --push) push=1; shift ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) log "unknown argument '$1'"; usage >&2; exit 2 ;;
  esac
done
case "$only" in ""|operator|engine) ;; *) log "--only takes operator or engine, not '$only'"; exit 2 ;; esac

version=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
vllm=$(sed -n 's/^IMAGE_VLLM_VERSION = "\(.*\)"$/\1/p' engine/flashmodel_engine/engine_version.py)
[[ -n $vllm ]] || { log "cannot read IMAGE_VLLM_VERSION from engine/flashmodel_engine/engine_version.py"; exit 1; }

if [[ -z $builder ]]; then
  for candidate in docker podman buildah; do
    if command -v "$candidate" >/dev/null; then builder=$candidate; break; fi
  done
  if [[ -z $builder && $dry -eq 0 ]]; then
    log "no docker, podman or buildah on PATH: install one, or pass --dry-run to see the commands"
    exit 1
  fi
  builder=${builder:-docker}
fi
case "$builder" in
  docker|podman) build=("$builder" build) ;;
  buildah) build=(buildah bud) ;;
  *) log "--builder takes docker, podman or buildah, not '$builder'"; exit 2 ;;
esac
[[ -n $platform ]] && build+=(--platform "$platform")

run() {
  printf '%q ' "$@" >&2; echo >&2
  [[ $dry -eq 1 ]] || "$@"
}

for image in operator engine; do
  [[ -z $only || $only == "$image" ]] || continue
  ref="$registry/$image:$version"
  args=(-f "Dockerfile.$image" -t "$ref" --label "org.opencontainers.image.version=$version")
  [[ $image == engine ]] && args+=(--build-arg "VLLM_VERSION=$vllm")
  log "event=build image=$ref builder=$builder${platform:+ platform=$platform}"
  run "${build[@]}" "${args[@]}" .
  if [[ $push -eq 1 ]]; then
    log "event=push image=$ref"
    run "$builder" push "$ref"
  fi
done
