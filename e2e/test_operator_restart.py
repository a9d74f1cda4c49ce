"""An operator killed (SIGKILL) midway through 50 new FlashModels, then started again, converges with
no duplicate and no orphaned child.

On a control plane of its own: the session's operator watches every namespace of the shared one,
and two operators there would both reconcile these models.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client, watch

from e2e.harness.cluster import ControlPlane
from e2e.harness.operator_run import ROOT, running_operator

MODELS = 50
# Single-replica models get no PodDisruptionBudget (render.needs_pdb): none may appear.
CHILD_KINDS = ("configmaps", "services", "deployments")


def _items(cp: ControlPlane, kind: str, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(cp.kubectl("get", kind, "-n", ns, "-o", "json").stdout)["items"]
    return items


def _owner(obj: dict[str, Any]) -> str | None:
    refs = [r for r in obj["metadata"].get("ownerReferences") or [] if r.get("kind") == "FlashModel"]
    return refs[0]["name"] if len(refs) == 1 else None


def _deployed(cp: ControlPlane, ns: str) -> int:
    return sum(1 for d in _items(cp, "deployments", ns) if _owner(d))


def _converged(cp: ControlPlane, ns: str) -> bool:
    models = _items(cp, "flashmodels", ns)
    owned = {_owner(d) for d in _items(cp, "deployments", ns)}
    return len(models) == MODELS and all(
        (m.get("status") or {}).get("observedGeneration") == m["metadata"]["generation"]
        and m["metadata"]["name"] in owned
        for m in models
    )


def test_an_operator_killed_midway_converges_after_restart_with_no_duplicate_or_orphan(
    tmp_path: Path, testbin: Path
) -> None:
    # A control plane of its own (not the session's): the operator is killed midway through its work.
    """Slow (33 s measured on two cores): a control plane of its own, fifty models' children written,
    an operator killed midway, and a second one that must converge all fifty."""
    with ControlPlane(testbin) as cp:
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "flashmodel.yaml"))
        cp.wait_established("flashmodels.serving.flashmodel.io")
        ns = cp.create_namespace("restart")
        spec = {"model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}}
        models = yaml.safe_dump_all(
            {"apiVersion": "serving.flashmodel.io/v1alpha1", "kind": "FlashModel",
             "metadata": {"name": f"m-{i:02d}"}, "spec": spec}
            for i in range(MODELS)
        )
        first_log, second_log = tmp_path / "operator-1.log", tmp_path / "operator-2.log"
        api = cp.api_client()
        apps = client.AppsV1Api(api)
        with running_operator(cp.kubeconfig, first_log) as first:
            # The kill is sent on the fifth Deployment's watch event, watched from before the models
            # exist and while kubectl is still creating them: the operator writes a new model's
            # Deployment in a few requests, all fifty faster than a list can be polled.
            before = apps.list_namespaced_deployment(ns).metadata
            assert before is not None
            applying = subprocess.Popen(
                ["kubectl", "apply", "-n", ns, "-f", "-"],
                env=cp.env, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            assert applying.stdin is not None
            applying.stdin.write(models)
            applying.stdin.close()
            deployments = watch.Watch()  # type: ignore[no-untyped-call]
            written: set[str] = set()
            for event in deployments.stream(  # type: ignore[no-untyped-call]
                apps.list_namespaced_deployment, ns, resource_version=before.resource_version, timeout_seconds=120
            ):
                if event["type"] == "ADDED" and event["object"].metadata.owner_references:
                    written.add(event["object"].metadata.name)
                    if len(written) >= 5:
                        break
            # Killed, not stopped: no handler finishes, no progress annotation is written on the way out.
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
            deployments.stop()  # type: ignore[no-untyped-call]
            assert applying.stderr is not None
            errors = applying.stderr.read()
            assert applying.wait(timeout=120) == 0, errors
        api.close()  # type: ignore[no-untyped-call]
        killed_at = _deployed(cp, ns)
        assert 5 <= killed_at < MODELS, f"the kill came when {killed_at} of {MODELS} models had a Deployment"

        started = time.monotonic()
        with running_operator(cp.kubeconfig, second_log) as second:
            while not _converged(cp, ns):
                assert second.poll() is None, second_log.read_text()[-3000:]
                assert time.monotonic() - started < 120, (
                    f"{_deployed(cp, ns)} of {MODELS} models converged 120 s after the restart\n"
                    + second_log.read_text()[-3000:]
                )
                time.sleep(0.25)
            took = time.monotonic() - started
            names = {m["metadata"]["name"] for m in _items(cp, "flashmodels", ns)}
            for kind in CHILD_KINDS:
                owners = Counter(_owner(obj) for obj in _items(cp, kind, ns) if obj["metadata"].get("ownerReferences"))
                duplicates = {o: n for o, n in owners.items() if n > 1}
                orphans = set(owners) - names
                assert not duplicates, f"{kind}: more than one per model: {duplicates}"
                assert not orphans, f"{kind} owned by no FlashModel: {orphans}"
                assert set(owners) == names, f"{kind}: models without one: {sorted(names - set(owners))[:5]}"
            assert not _items(cp, "poddisruptionbudgets", ns), "a single-replica model got a PodDisruptionBudget"
        print(f"killed with {killed_at}/{MODELS} deployed; converged {took:.1f}s after the restart")
