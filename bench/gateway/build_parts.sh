#!/usr/bin/env bash
# The gateway benchmark's parts that are not Python, built or fetched once and cached:
#   ~/.cache/flashmodel/gateway/epp, envoy, inferencepool.yaml   scripts/gateway.sh (the tests' set-up builds the same)
#   ~/.cache/flashmodel/gateway/sa.key, sa.pub                   the benchmark's API server's service-account key pair
# Usage: bash bench/gateway/build_parts.sh        (each part is skipped when already there)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dest=${GATEWAY_CACHE:-$HOME/.cache/flashmodel/gateway}
bash "$ROOT/scripts/gateway.sh" "$dest" >/dev/null
if [ ! -f "$dest/sa.key" ]; then
  # The API server will not start without a service-account signing key; nothing here signs a token
  # anyone uses (a loopback server, an admin token), so one throwaway key travels with the parts.
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$dest/sa.key" 2>/dev/null
  openssl pkey -in "$dest/sa.key" -pubout -out "$dest/sa.pub"
fi
"$dest/envoy" --version | grep version
ls -la "$dest"
