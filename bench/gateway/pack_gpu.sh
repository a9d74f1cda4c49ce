#!/usr/bin/env bash
# Pack what the GPU machine lacks for the gateway benchmark beyond vLLM (.gpu/ has that): the test
# control plane's kube-apiserver and etcd, the EPP, Envoy's binary, the InferencePool CRD and the
# API server's throwaway service-account key pair. One tar, zstd -19 (the GPU machine has no zstd
# binary; the zstandard wheel .gpu/stage.sh installs into /tmp/zs decompresses), split into parts.
#
#   bash bench/gateway/build_parts.sh                 # once: EPP, Envoy, CRD, key pair
#   bash bench/gateway/pack_gpu.sh /work/main/.gwp    # writes gw.part00.., gw.count, gw.sha256, sizes.txt
#
# A device call carries at most 64 MiB in all: the tracked working tree (~4 MiB) plus what `carry`
# names. PART_MIB (default 56) leaves room for the tree and the small files each call also carries.
set -euo pipefail
dest=${1:?destination folder, e.g. /work/main/.gwp}
src=${GATEWAY_CACHE:-$HOME/.cache/flashmodel/gateway}
testbin=${FLASHMODEL_TESTBIN:-$(ls -d "$HOME"/.cache/flashmodel/testbin/k8s-* | sort | tail -1)}
part_bytes=$(( ${PART_MIB:-56} * 1024 * 1024 ))
for f in "$src/epp" "$src/envoy" "$src/inferencepool.yaml" "$src/sa.key" "$src/sa.pub" \
         "$testbin/kube-apiserver" "$testbin/etcd"; do
  [ -f "$f" ] || { echo "missing $f: run bash bench/gateway/build_parts.sh (and scripts/testbin.sh for the control plane)" >&2; exit 1; }
done
command -v zstd >/dev/null || { echo "zstd is needed here (apt-get install zstd)" >&2; exit 1; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# Hard links or copies, flat: the GPU side unpacks into /tmp/gw and fleet.py --parts /tmp/gw finds them.
for f in "$src/epp" "$src/envoy" "$src/inferencepool.yaml" "$src/sa.key" "$src/sa.pub" \
         "$testbin/kube-apiserver" "$testbin/etcd"; do
  cp "$f" "$stage/"
done
file "$stage/epp" | grep -q "statically linked" && echo static >"$stage/epp.linking" || echo "dynamic (glibc >= 2.34)" >"$stage/epp.linking"
mkdir -p "$dest"
rm -f "$dest"/gw.part* "$dest"/gw.count "$dest"/gw.sha256
t0=$SECONDS
tar -C "$stage" -cf - . | zstd -19 -T0 -q -c | split -b "$part_bytes" -d -a 2 - "$dest/gw.part"
ls "$dest"/gw.part* | wc -l >"$dest/gw.count"
(cd "$dest" && sha256sum gw.part* >gw.sha256)
{
  echo "packed $(date -u +%FT%TZ) in $((SECONDS - t0)) s from $src and $testbin"
  echo "epp linking: $(cat "$stage/epp.linking")"
  du -b "$stage"/* | sed "s|$stage/||"
  ls -l "$dest"/gw.part* | awk '{printf "%s %d bytes (%.1f MiB)\n", $NF, $5, $5/1048576}'
} | tee "$dest/sizes.txt"
