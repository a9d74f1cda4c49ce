"""The API server's CPU for each kind of request a new model costs, on the test control plane.

    python bench/api_cost_bench.py [--count 300] [--crd crds/flashmodel.yaml] [--json out.json]

A burst of new models on two cores is bound by the API server (see docs/benchmarks/operator.md, "Where a
burst's time goes"): this says which of a model's requests cost it most. No operator runs. Each phase
sends --count requests of one kind, one after another, then waits 2 s for the watchers; the CPU seconds of
the API server, etcd and the controller-manager over the phase (utime + stime in /proc), divided by the
count, are its cost. The FlashModel writes carry what the operator writes: a status from a real first pass
of `reconcile`, a one-entry status.pods, kopf's diff-base annotation. The children are the operator's own
renders, applied as its first pass applies them (server-side apply, `known_absent`).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "engine")]

from flashmodel_operator.apply import Cluster  # noqa: E402
from flashmodel_operator.model import FlashModel  # noqa: E402
from flashmodel_operator.reconcile import reconcile  # noqa: E402
from flashmodel_operator.render import render_children, render_control_secret  # noqa: E402

import e2e.harness.cluster  # noqa: E402
from bench.operator_bench import component_cpu_seconds, progress  # noqa: E402
from e2e.harness.cluster import ControlPlane, testbin_dir  # noqa: E402

GROUP, VERSION, PLURAL = "serving.flashmodel.io", "v1alpha1", "flashmodels"
MEASURED = ("kube-apiserver", "etcd", "kube-controller-manager")


def _renamed(child: dict[str, Any], suffix: str, replicas: int | None = None) -> dict[str, Any]:
    out = copy.deepcopy(child)
    out["metadata"]["name"] += suffix
    if replicas is not None:
        out["spec"]["replicas"] = replicas  # no ReplicaSet or pods: the apply alone
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=300, help="requests per phase")
    parser.add_argument("--crd", type=Path, default=ROOT / "crds" / "flashmodel.yaml")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    count: int = args.count
    results: dict[str, dict[str, float]] = {}
    e2e.harness.cluster.SERVICE_CIDR = "10.0.0.0/16"  # a ClusterIP Service per model; a /24 holds 253
    with ControlPlane(testbin_dir(build=True)) as cp:
        cp.kubectl("apply", "--server-side", "-f", str(args.crd))
        cp.kubectl("wait", "--for=condition=Established", f"crd/{PLURAL}.{GROUP}")
        api = cp.api_client()
        cluster = Cluster(api)
        ns = cp.create_namespace("api-cost")
        time.sleep(5)

        def phase(label: str, request: Callable[[int], object]) -> None:
            before, t0 = component_cpu_seconds({}), time.monotonic()
            for i in range(count):
                request(i)
            sent = time.monotonic() - t0
            time.sleep(2)  # the watchers' share of the last requests
            after = component_cpu_seconds({})
            row = {k: round(1000 * (after[k] - before[k]) / count, 2) for k in MEASURED}
            row["wall_ms"] = round(1000 * sent / count, 2)
            results[label] = row
            progress(f"{label}: " + " ".join(f"{k}={v}" for k, v in row.items()) + " (ms a request)")

        spec = {"model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}, "replicas": 1}
        models = f"/apis/{GROUP}/{VERSION}/namespaces/{ns}/{PLURAL}"

        def create_model(i: int) -> object:
            model = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FlashModel", "spec": spec}
            return cluster.create({**model, "metadata": {"name": f"m-{i}", "namespace": ns}})

        phase("FlashModel POST", create_model)
        created = cluster.get_flashmodel(ns, "m-0")
        assert created is not None
        reconcile(cluster, created)  # a real first pass: the status the operator writes
        written = cluster.get_flashmodel(ns, "m-0")
        assert written is not None
        status = written["status"]
        progress(f"status {len(json.dumps(status))} bytes, object {len(json.dumps(written))} bytes")
        phase("FlashModel status PATCH (a first pass's)", lambda i: cluster.patch_status(ns, f"m-{i}", status))
        pods = [{"name": "p", "prewarmed": True, "prewarmFailures": 0, "coldTTFTMs": 12.5}]
        phase("FlashModel status PATCH (status.pods)", lambda i: cluster.patch_status(ns, f"m-{i}", {"pods": pods}))
        annotation = {"metadata": {"annotations": {f"{GROUP}/last-handled-spec": json.dumps({"spec": spec})}}}
        phase(
            "FlashModel PATCH (kopf's diff base)",
            lambda i: cluster._call(
                "PATCH", f"{models}/m-{i}", body=annotation, content_type="application/merge-patch+json"
            ),
        )
        phase("Event POST", lambda i: cluster.event(written, "Normal", "Applied", f"created {i}"))
        fms = {i: FlashModel.from_body(cluster.get_flashmodel(ns, f"m-{i}") or {}) for i in range(count)}
        children = {i: {c["kind"]: c for c in render_children(fms[i])} for i in range(count)}
        phase("Secret POST", lambda i: cluster.create(_renamed(render_control_secret(fms[i], "token"), "-s")))
        for kind in ("ConfigMap", "Service", "PodDisruptionBudget"):

            def apply_child(i: int, k: str = kind) -> object:
                return cluster.apply(_renamed(children[i][k], "-a"), True)

            phase(f"{kind} apply (create)", apply_child)
        phase("ConfigMap POST (create)", lambda i: cluster.create(_renamed(children[i]["ConfigMap"], "-b")))
        phase(
            "Deployment apply (create, 0 replicas)",
            lambda i: cluster.apply(_renamed(children[i]["Deployment"], "-a", replicas=0), True),
        )
        api.close()  # type: ignore[no-untyped-call]
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
