"""Regenerates the Kubernetes type definitions ($defs) in the chart's values.schema.json.

The chart passes some values straight into the operator's pod (resources, security contexts,
tolerations, affinity, extra env). Their schema is Kubernetes' own, taken from an API server's
OpenAPI v3 document for core/v1, so a value the API server would refuse fails `helm install`
with a message that names the value instead of failing later on the Deployment.

    python -m e2e.harness.cluster up --dir /tmp/cp &   # or any cluster of the chart's target version
    KUBECONFIG=/tmp/cp/kubeconfig python scripts/values_schema_k8s.py
    python scripts/values_schema_k8s.py --openapi core-v1.json   # a saved /openapi/v3/api/v1

Converted for helm's JSON-schema validator (draft-07 here): OpenAPI refs point into $defs,
Kubernetes extensions and defaults are dropped, every object is closed (additionalProperties:
false, as the API server's strict field validation is), and the few rules the API server
enforces in Go rather than in its OpenAPI are added (see VALIDATION_RULES).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "charts" / "flashmodel-operator" / "values.schema.json"
OPENAPI_PREFIX = "#/components/schemas/"
DEFS_PREFIX = "#/$defs/"
CORE = "io.k8s.api.core.v1."
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"

# values key -> the Kubernetes type it holds ("[]" for a list of it).
VALUES_TYPES: dict[str, tuple[str, bool]] = {
    "resources": (CORE + "ResourceRequirements", False),
    "podSecurityContext": (CORE + "PodSecurityContext", False),
    "securityContext": (CORE + "SecurityContext", False),
    "tolerations": (CORE + "Toleration", True),
    "affinity": (CORE + "Affinity", False),
    "extraEnv": (CORE + "EnvVar", True),
}

# The OpenAPI only says a Quantity is a string or a number; its description gives the grammar.
# This is that grammar as a regular expression (the same one controller-gen puts in CRDs).
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)

# What the API server checks in Go (pkg/apis/core/validation) and its OpenAPI does not say.
ID_RANGE = {"minimum": 0, "maximum": 2147483647}  # IsValidUserID / IsValidGroupID
VALIDATION_RULES: dict[tuple[str, str], dict[str, Any]] = {
    (CORE + "PodSecurityContext", "runAsUser"): ID_RANGE,
    (CORE + "PodSecurityContext", "runAsGroup"): ID_RANGE,
    (CORE + "PodSecurityContext", "fsGroup"): ID_RANGE,
    (CORE + "SecurityContext", "runAsUser"): ID_RANGE,
    (CORE + "SecurityContext", "runAsGroup"): ID_RANGE,
}
ID_LIST = (CORE + "PodSecurityContext", "supplementalGroups")
DROPPED_KEYS = {"default", "format"}


def first_paragraph(text: str) -> str:
    return text.split("\n\n", 1)[0].strip()


def convert(node: Any, refs: set[str]) -> Any:
    """An OpenAPI v3 schema node as draft-07 JSON schema; collects the names it refers to."""
    if isinstance(node, list):
        return [convert(item, refs) for item in node]
    if not isinstance(node, dict):
        return node
    # Kubernetes wraps a ref in allOf to give it a default; the default does not validate anything.
    wrapped = node.get("allOf")
    if isinstance(wrapped, list) and len(wrapped) == 1 and set(wrapped[0]) == {"$ref"}:
        return convert(wrapped[0], refs)
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key in DROPPED_KEYS:
            continue
        if key == "$ref":
            name = value.removeprefix(OPENAPI_PREFIX)
            refs.add(name)
            return {"$ref": DEFS_PREFIX + name}
        if key == "description":
            out[key] = first_paragraph(value)
        elif key == "properties":
            out[key] = {prop: convert(child, refs) for prop, child in value.items()}
        else:
            out[key] = convert(value, refs)
    if "properties" in out:
        out["additionalProperties"] = False
    return out


def definitions(schemas: dict[str, Any]) -> dict[str, Any]:
    """$defs for VALUES_TYPES and everything they refer to, by their OpenAPI names."""
    defs: dict[str, Any] = {}
    pending = [name for name, _ in VALUES_TYPES.values()]
    while pending:
        name = pending.pop()
        if name in defs:
            continue
        refs: set[str] = set()
        defs[name] = convert(schemas[name], refs)
        pending.extend(sorted(refs - set(defs)))
    defs[QUANTITY] = {
        "description": first_paragraph(schemas[QUANTITY]["description"]) + " For example 100m, 1.5, 256Mi, 2Gi.",
        # pattern applies to strings only, and names itself in helm's error (a oneOf would not).
        "type": ["string", "number"],
        "pattern": QUANTITY_PATTERN,
    }
    for (type_name, prop), rule in VALIDATION_RULES.items():
        defs[type_name]["properties"][prop].update(rule)
    defs[ID_LIST[0]]["properties"][ID_LIST[1]]["items"].update(ID_RANGE)
    # ValidateResourceQuantityValue: requests and limits must be >= 0 (a Quantity may be negative).
    for field in ("limits", "requests"):
        amounts = defs[CORE + "ResourceRequirements"]["properties"][field]
        amounts["additionalProperties"] = {
            "allOf": [amounts["additionalProperties"]],
            "pattern": "^[^-]",
            "minimum": 0,
        }
    return dict(sorted(defs.items()))


def regenerate(schema: dict[str, Any], openapi: dict[str, Any]) -> dict[str, Any]:
    schemas: dict[str, Any] = openapi["components"]["schemas"]
    for key, (type_name, is_list) in VALUES_TYPES.items():
        ref = {"$ref": DEFS_PREFIX + type_name}
        description = schema["properties"][key].get("description", "")
        if is_list:
            schema["properties"][key] = {"type": "array", "description": description, "items": ref}
        else:
            # draft-07 ignores keywords beside $ref, so the description sits in an allOf wrapper.
            schema["properties"][key] = {"description": description, "allOf": [ref]}
    schema["$defs"] = definitions(schemas)
    return schema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--openapi", type=Path, help="a saved /openapi/v3/api/v1 (default: ask kubectl)")
    args = parser.parse_args(argv)
    if args.openapi:
        openapi = json.loads(args.openapi.read_text())
    else:
        raw = subprocess.run(["kubectl", "get", "--raw", "/openapi/v3/api/v1"], capture_output=True, text=True)
        if raw.returncode != 0:
            print(f"kubectl get --raw /openapi/v3/api/v1 failed: {raw.stderr.strip()}", file=sys.stderr)
            return 1
        openapi = json.loads(raw.stdout)
    schema = regenerate(json.loads(SCHEMA.read_text()), openapi)
    SCHEMA.write_text(json.dumps(schema, indent=2) + "\n")
    print(f"wrote {SCHEMA.relative_to(ROOT)} defs={len(schema['$defs'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
