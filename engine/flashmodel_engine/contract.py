"""What the engine pod and the operator both rely on, defined once and imported by both sides."""

from __future__ import annotations

# The launcher exits with EX_CONFIG (sysexits.h) when the preflight or the profile refuses the
# model or its settings; the operator reads it from the container's last state and holds the
# model at zero replicas, since restarting such a pod cannot succeed until the spec changes.
PREFLIGHT_EXIT_CODE = 78
