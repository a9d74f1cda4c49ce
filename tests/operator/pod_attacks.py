"""Specs that try to unmake the enforced engine pod (issue 40's table and more), and the patches that may pass.

Each attack is spec fields on top of a t4 model from a claim, and the words its refusal must hold. The
unit tests (test_pod_policy.py) render them; the control-plane tests (test_reconcile_api.py) reconcile
them against a real API server.
"""

from __future__ import annotations

from typing import Any

ALLOWED_PRIORITY_CLASS = "inference"
"""The priority class the tests' cluster admin allows (pod_policy.PodPolicy)."""


def patch(spec: dict[str, Any] | None = None, **metadata: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"spec": spec or {}}
    if metadata:
        body["metadata"] = metadata
    return {"podTemplatePatch": body}


def engine(**fields: Any) -> dict[str, Any]:
    """A patch of the engine container."""
    return patch({"containers": [{"name": "engine", **fields}]})


def env(name: str, value: str = "1", **more: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": name, **more} if more else {"name": name, "value": value}
    return engine(env=[entry])


def sidecar(**fields: Any) -> dict[str, Any]:
    return patch({"containers": [{"name": "thief", "image": "busybox", **fields}]})


def with_volume(volume: dict[str, Any], **mount: Any) -> dict[str, Any]:
    """A volume of the patch's, mounted in the engine."""
    return patch({"volumes": [volume], "containers": [{"name": "engine", "volumeMounts": [
        {"name": volume["name"], **mount}]}]})


GPU = {"limits": {"nvidia.com/gpu": 1}, "requests": {"nvidia.com/gpu": 1}}

# id -> (spec fields, what the refusal says)
ATTACKS: dict[str, tuple[dict[str, Any], str]] = {
    # issue 40's table
    "engine-image-spec": (
        {"engine": {"image": "example.org/evil/vllm:latest"}},
        "spec.engine.image 'example.org/evil/vllm:latest' is not an engine image this cluster allows",
    ),
    "engine-image-patch": (engine(image="example.org/evil/vllm:latest"), "changes the engine container's image"),
    "ld-preload-and-init-writing-cache": (
        patch({"containers": [{"name": "engine", "env": [{"name": "LD_PRELOAD", "value": "/cache/evil.so"}]}],
               "initContainers": [{"name": "writer", "image": "busybox", "command": ["cp", "/evil.so", "/cache/"],
                                   "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}]}),
        "changes the engine container's env LD_PRELOAD",
    ),
    "init-writing-cache": (
        patch({"initContainers": [{"name": "writer", "image": "busybox",
                                   "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}]}),
        "mounts the engine's volume cache in the init container writer",
    ),
    "pythonpath": (env("PYTHONPATH", "/cache/evil"), "changes the engine container's env PYTHONPATH"),
    "cuda-visible-devices-empty": (env("CUDA_VISIBLE_DEVICES", ""),
                                   "changes the engine container's env CUDA_VISIBLE_DEVICES"),
    "vllm-plugins": (env("VLLM_PLUGINS", "evil"), "changes the engine container's env VLLM_PLUGINS"),
    "env-from-configmap": (engine(envFrom=[{"configMapRef": {"name": "anything"}}]),
                           "changes the engine container's envFrom: it can bring any variable"),
    "sidecar-gpu": (sidecar(resources=GPU), "the container thief's resources.limits[nvidia.com/gpu] asks for "
                    "nvidia.com/gpu: a container beside the engine takes cpu, memory and ephemeral-storage only"),
    "host-network": (patch({"hostNetwork": True}), "sets hostNetwork"),
    "privileged-engine": (engine(securityContext={"privileged": True}),
                          "changes the engine container's securityContext"),
    "root-with-sys-admin": (
        patch({"securityContext": {"runAsUser": 0, "runAsNonRoot": False},
               "containers": [{"name": "engine", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}),
        "changes the pod's securityContext",
    ),
    "hostpath-root-in-engine": (with_volume({"name": "host", "hostPath": {"path": "/"}}, mountPath="/host"),
                                "adds the volume host: a hostPath volume reaches the node's files"),
    "service-account-and-token": (patch({"serviceAccountName": "admin", "automountServiceAccountToken": True}),
                                  "sets serviceAccountName"),
    "automounted-token": (patch({"automountServiceAccountToken": True}), "mounts a service-account token"),
    "scheduler-name": (patch({"schedulerName": "mine"}), "sets schedulerName"),
    "system-node-critical": (patch({"priorityClassName": "system-node-critical"}),
                             "sets priorityClassName 'system-node-critical'"),
    "memory-1mi-patch": (engine(resources={"limits": {"memory": "1Mi"}}),
                         "memory limit 1Mi is below the 4 GiB the t4 profile's host side holds"),
    "memory-1mi-spec": ({"resources": {"limits": {"memory": "1Mi"}}},
                        "spec.resources memory limit 1Mi is below the 4 GiB the t4 profile's host side holds"),
    # more: a GPU, the node or another model's traffic by other ways
    "resource-claims": (patch({"resourceClaims": [{"name": "gpu", "resourceClaimName": "any-gpu"}]}),
                        "sets resourceClaims: dynamic resource allocation"),
    "engine-resource-claim": (engine(resources={"claims": [{"name": "gpu"}]}),
                              "resources.claims asks for a resource claim"),
    "other-vendor-gpu": (engine(resources={"limits": {"amd.com/gpu": 1}}), "limits[amd.com/gpu] asks for amd.com/gpu"),
    "hugepages": (engine(resources={"limits": {"hugepages-2Mi": "1Gi", "memory": "8Gi"}}), "asks for hugepages-2Mi"),
    "node-name": (patch({"nodeName": "gpu-node-1"}), "sets nodeName: it skips the scheduler"),
    "ephemeral-container": (patch({"ephemeralContainers": [{"name": "debug", "image": "busybox"}]}),
                            "sets ephemeralContainers"),
    "sidecar-mounts-model": (sidecar(volumeMounts=[{"name": "model", "mountPath": "/m"}]),
                             "mounts the engine's volume model in the container thief"),
    "sidecar-mounts-control-token": (sidecar(volumeMounts=[{"name": "control", "mountPath": "/t"}]),
                                     "mounts the engine's volume control in the container thief"),
    "volume-named-like-the-models": (patch({"volumes": [{"name": "model", "hostPath": {"path": "/"}}]}),
                                     "changes the volume model, which the engine reads"),
    # Triton's and Inductor's caches hold compiled code the engine loads: a claim someone filled first is code.
    "cache-volume-from-a-claim": (patch({"volumes": [{"name": "cache", "persistentVolumeClaim": {"claimName": "x"}}]}),
                                  "changes the volume cache: the engine's scratch space"),
    "env-lower-case": (env("ld_preload", "/data/evil.so"), "changes the engine container's env ld_preload"),
    "env-proxy-lower-case": (env("https_proxy", "http://evil:3128"), "changes the engine container's env https_proxy"),
    "env-name-with-equals": (env("FOO=BAR"), "is not a plain variable name"),
    "env-reserved-via-field-ref": (env("PYTHONPATH", valueFrom={"fieldRef": {"fieldPath": "metadata.name"}}),
                                   "changes the engine container's env PYTHONPATH"),
    "env-value-from-file": (env("FOO", valueFrom={"fileKeyRef": {"volumeName": "cache", "path": "x", "key": "k"}}),
                            "valueFrom may be one of"),
    "mount-dot-dot": (with_volume({"name": "etc", "configMap": {"name": "x"}}, mountPath="/models/../etc"),
                      "is not normalised"),
    "mount-over-usr": (with_volume({"name": "lib", "configMap": {"name": "x"}}, mountPath="/usr/lib/python3"),
                       "is at, under or above /usr"),
    "mount-over-root": (with_volume({"name": "all", "emptyDir": {}}, mountPath="/"), "is at, under or above"),
    "mount-sub-path-expr": (with_volume({"name": "data", "emptyDir": {}}, mountPath="/data", subPathExpr="$(POD_NAME)"),
                            "subPathExpr"),
    "engine-volume-mounted-again": (engine(volumeMounts=[{"name": "config", "mountPath": "/data"}]),
                                    "the engine's own volumes are mounted where the operator mounts them"),
    "runtime-class": (patch({"runtimeClassName": "nvidia"}), "sets runtimeClassName"),
    "share-process-namespace": (patch({"shareProcessNamespace": True}), "sets shareProcessNamespace"),
    "host-pid": (patch({"hostPID": True}), "sets hostPID"),
    "sidecar-nvidia-visible-devices": (sidecar(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]),
                                       "sets the container thief's env NVIDIA_VISIBLE_DEVICES"),
    "sidecar-privileged": (sidecar(securityContext={"privileged": True}),
                           "sets the container thief's securityContext.privileged"),
    "init-as-root": (patch({"initContainers": [{"name": "root", "image": "busybox",
                                                "securityContext": {"runAsUser": 0}}]}),
                     "sets the init container root's securityContext.runAsUser"),
    "sidecar-host-port": (sidecar(ports=[{"containerPort": 80, "hostPort": 80}]),
                          "gives the container thief a host port"),
    "projected-token": (with_volume({"name": "tok", "projected": {"sources": [
        {"serviceAccountToken": {"path": "token"}}]}}, mountPath="/data"), "a projected serviceAccountToken"),
    "csi-inline": (with_volume({"name": "csi", "csi": {"driver": "secrets-store.csi.k8s.io"}}, mountPath="/data"),
                   "csi is not a volume type a patch may add"),
    "dns-config": (patch({"dnsPolicy": "None", "dnsConfig": {"nameservers": ["203.0.113.9"]}}), "sets dnsConfig"),
    "host-aliases": (patch({"hostAliases": [{"ip": "203.0.113.9", "hostnames": ["huggingface.co"]}]}),
                     "sets hostAliases"),
    "service-links": (patch({"enableServiceLinks": True}), "changes the pod's enableServiceLinks"),
    "other-models-label": (patch(labels={"app.kubernetes.io/instance": "someone-elses"}),
                           "changes the pod label app.kubernetes.io/instance"),
    "operator-annotation": (patch(annotations={"serving.flashmodel.io/prewarmed": "true"}),
                            "sets the pod annotation serving.flashmodel.io/prewarmed"),
    "apparmor-unconfined": (patch(annotations={"container.apparmor.security.beta.kubernetes.io/engine": "unconfined"}),
                            "sets the pod annotation container.apparmor.security.beta.kubernetes.io/engine"),
    "tolerate-every-taint": (patch({"tolerations": [{"operator": "Exists"}]}), "tolerates every taint"),
    "tolerate-control-plane": ({"tolerations": [{"key": "node-role.kubernetes.io/control-plane",
                                                 "operator": "Exists"}]},
                               "spec.tolerations tolerates node-role.kubernetes.io/control-plane"),
    "grace-a-day": (patch({"terminationGracePeriodSeconds": 86400}), "sets terminationGracePeriodSeconds 86400"),
    "gpu-count-label": (patch({"nodeSelector": {"nvidia.com/gpu.count": "8"}}),
                        "changes nodeSelector[nvidia.com/gpu.count]"),
    "engine-port": (engine(ports=[{"name": "debug", "containerPort": 5678}]), "adds the engine container's port 5678"),
    "engine-working-dir": (engine(workingDir="/data"), "changes the engine container's workingDir"),
    "engine-stdin": (engine(stdin=True, tty=True), "changes the engine container's stdin"),
}

# id -> spec fields that must be accepted with the engine intact
CONTROLS: dict[str, dict[str, Any]] = {
    "annotation": patch(annotations={"example.com/team": "search"}),
    "label": patch(labels={"team": "search"}),
    "restricted-sidecar": sidecar(command=["sleep", "infinity"],
                                  securityContext={"allowPrivilegeEscalation": False, "runAsNonRoot": True,
                                                   "capabilities": {"drop": ["ALL"]}}),
    "plain-sidecar": sidecar(),
    "extra-env": env("FOO", "1"),
    "env-from-secret": env("API_TOKEN", valueFrom={"secretKeyRef": {"name": "mine", "key": "token"}}),
    "toleration": patch({"tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]}),
    "affinity": patch({"affinity": {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [
            {"key": "zone", "operator": "In", "values": ["a"]}]}}]}}}),
    "topology-spread": patch({"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone",
                                                             "whenUnsatisfiable": "ScheduleAnyway"}]}),
    "allowed-priority-class": patch({"priorityClassName": ALLOWED_PRIORITY_CLASS}),
    "data-volume": with_volume({"name": "data", "emptyDir": {}}, mountPath="/data"),
    "configmap-volume": with_volume({"name": "extra", "configMap": {"name": "extra"}}, mountPath="/mnt/extra",
                                    readOnly=True),
    "memory-and-cpu": engine(resources={"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "16Gi"}}),
    "grace": patch({"terminationGracePeriodSeconds": 20}),
    "bigger-shm": patch({"volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]}),
}
