"""Accelerator profiles and the pure function that turns an engine config into vLLM's command line.

Imports nothing heavy: the operator calls `vllm_args` for `status.engineArgs`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

from flashmodel_engine.config import EngineConfig, EngineSettings
from flashmodel_engine.engine_guard import MIDDLEWARE as GUARD_MIDDLEWARE
from flashmodel_engine.engine_version import SUPPORTED_RANGE
from flashmodel_engine.extra_args_allowed import ALLOWED_FLAGS
from flashmodel_engine.quantization import FIELD as QUANTIZATION_FIELD
from flashmodel_engine.quantization import method_problems
from flashmodel_engine.vllm_flags import Options, dest_of
from flashmodel_engine.vllm_flags import resolve as resolve_args
from flashmodel_engine.vllm_options import TABLES

# Flags the profile owns; extraArgs may not set them (docs/design.md, "Enforced flags").
# The value is the engine-config key to use instead.
ENFORCED_FLAGS: dict[str, str] = {
    "--block-size": "engine.blockSize",
    "--dtype": "engine.dtype",
    "--gpu-memory-utilization": "engine.gpuMemoryUtilization",
    "--max-num-seqs": "engine.maxNumSeqs",
    "--max-model-len": "engine.maxModelLen",
    "--max-num-batched-tokens": "engine.maxNumBatchedTokens",
    "--enforce-eager": "engine.enforceEager",
    # The graph pool the memory plan counts is the one for steps up to maxNumBatchedTokens.
    "--max-cudagraph-capture-size": "engine.maxNumBatchedTokens",
    "--cudagraph-capture-sizes": "engine.maxNumBatchedTokens",
    "--compilation-config": "engine.enforceEager",
    # Either would replace the gpuMemoryUtilization budget the memory plan is made for.
    "--kv-cache-memory-bytes": "engine.gpuMemoryUtilization",
    "--attention-backend": "engine.attentionBackend",
    # The launcher passes the checkpoint's method itself, so vLLM cannot pick a kernel the card lacks.
    "--quantization": QUANTIZATION_FIELD,
    "--quantization-config": QUANTIZATION_FIELD,
    "--model": "model.path",
    # The weights and any remote code come from the revision the spec pins (the tokenizer follows
    # --revision in vLLM unless --tokenizer names another repository).
    "--revision": "model.revision",
    "--code-revision": "model.revision",
    "--served-model-name": "model.servedName",
    "--host": "server.host",
    "--port": "server.enginePort",
    "--api-key": "auth.apiKeyFile",
    # The launcher's drain relies on it (vLLM finishes in-flight requests this long on SIGTERM).
    "--shutdown-timeout": "server.drainTimeoutSeconds",
    "--otlp-traces-endpoint": "observability.otlpTracesEndpoint",
    # The LoRA buffers the memory plan counts, and the runtime loading the shim's /adapters relies on.
    "--enable-lora": "lora",
    "--max-loras": "lora.maxLoras",
    "--max-lora-rank": "lora.maxRank",
    "--max-cpu-loras": "lora.maxCpuLoras",
}
# Flags that are not enforced one by one but would set an enforced setting or the whole config.
ALIASES: dict[str, str] = {
    "--no-enforce-eager": "--enforce-eager",
    # vLLM 0.32's other name of --gpu-memory-utilization (the same dest); 0.26 lacks it.
    "--device-memory-utilization": "--gpu-memory-utilization",
    # -O (vLLM rewrites it to --optimization-level) picks the compilation mode, so whether graphs run.
    "--optimization-level": "--enforce-eager",
    # Its backend key would replace the attention backend the profile picked.
    "--attention-config": "--attention-backend",
    "--no-enable-lora": "--enable-lora",
}
# Flags enforced only where the FlashModel sets their field. FlashModels written before the field
# existed may name them in extraArgs and keep doing so; once the field is set, it decides and
# extraArgs may not contradict it. The value is the engine-config key, as in ENFORCED_FLAGS.
ENFORCED_WHEN_SET: dict[str, str] = {
    "--enable-prefix-caching": "engine.enablePrefixCaching",
    "--no-enable-prefix-caching": "engine.enablePrefixCaching",
}
CONFIG_FLAG = "--config"
"""A vLLM YAML config could set any enforced flag behind our back."""

# Flags that change the memory plan the profile's limits are made for (one card, fp16 weights and KV
# cache in gpuMemoryUtilization of it, the graph pool for maxNumBatchedTokens); the value says what to do instead.
MEMORY_PLAN_FLAGS: dict[str, str] = {
    "--num-gpu-blocks-override": "remove it; the KV cache is sized from engine.gpuMemoryUtilization",
    "--swap-space": "remove it; the pod's memory limit does not count CPU swap blocks",
    "--cpu-offload-gb": "remove it; the pod's memory limit does not count offloaded weights",
    "--cpu-offload-params": "remove it; the pod's memory limit does not count offloaded weights",
    "--offload-backend": "remove it; the pod's memory limit does not count offloaded weights",
    "--offload-group-size": "remove it; the pod's memory limit does not count offloaded weights",
    "--offload-num-in-group": "remove it; the pod's memory limit does not count offloaded weights",
    "--offload-params": "remove it; the pod's memory limit does not count offloaded weights",
    "--offload-prefetch-step": "remove it; the pod's memory limit does not count offloaded weights",
    "--kv-offloading-size": "remove it; the pod's memory limit does not count an offloaded KV cache",
    "--kv-offloading-backend": "remove it; the pod's memory limit does not count an offloaded KV cache",
    "--max-seq-len-to-capture": "remove it; the graphs are captured for engine.maxNumBatchedTokens",
    "--tensor-parallel-size": "remove it; a profile pod has one GPU",
    "--pipeline-parallel-size": "remove it; a profile pod has one GPU",
    "--data-parallel-size": "remove it; a profile pod has one GPU (scale with spec.replicas)",
    "--data-parallel-size-local": "remove it; a profile pod has one GPU (scale with spec.replicas)",
    "--decode-context-parallel-size": "remove it; a profile pod has one GPU",
    "--prefill-context-parallel-size": "remove it; a profile pod has one GPU",
    "--kv-cache-dtype": "remove it; fp8 KV cache needs sm_89 and the KV budget is planned for the model dtype",
    "--kv-cache-dtype-skip-layers": "remove it; the KV budget is planned for the model dtype",
    "--speculative-config": "remove it; a draft model's weights and KV cache are outside the memory plan",
    "--spec-method": "remove it; a draft model's weights and KV cache are outside the memory plan",
    "--spec-model": "remove it; a draft model's weights and KV cache are outside the memory plan",
    "--spec-tokens": "remove it; a draft model's weights and KV cache are outside the memory plan",
    "--hf-overrides": "remove it; it can change the context length and layers the memory plan counts",
    "--lora-dtype": "remove it; the LoRA buffers are planned in the model dtype",
    "--specialize-active-lora": "remove it; its extra CUDA graphs per adapter count are outside the memory plan",
}
# Flags that change where the weights, the tokenizer or the model's config come from; the value says what
# to do instead. What runs is what spec.model names, at the revision it pins.
_TRUST = "remove it and set spec.model.trustRemoteCode instead (a hub model pins spec.model.hub.revision to a commit)"
_TOKENIZER = "remove it; the tokenizer comes from the model's own source, at spec.model.hub.revision for a hub model"
_WEIGHTS = "remove it; the engine loads the weights spec.model names, in their own format"
SOURCE_FLAGS: dict[str, str] = {
    "--trust-remote-code": _TRUST,
    "--no-trust-remote-code": _TRUST,
    "--tokenizer": _TOKENIZER,
    "--tokenizer-revision": _TOKENIZER,
    "--load-format": _WEIGHTS,
    "--model-loader-extra-config": _WEIGHTS,
    "--download-dir": "remove it; the hub cache is spec.model.hub.cache",
    "--hf-config-path": "remove it; the model's config comes from its own source",
    "--hf-token": "remove it and set spec.model.hub.tokenSecretRef instead",
    "--allowed-local-media-path": "remove it; requests may not read files of the engine pod",
    # Adapters loaded at start would skip the shim's checks (rank, shapes, paths, pinned revisions).
    "--lora-modules": "remove it and list the adapter in spec.adapters",
}
# Flags that load Python code or plugins into vLLM (from a path, a module or a class name): such code
# runs past every check. Remote code of the model itself is spec.model.trustRemoteCode's, pinned.
CODE_FLAGS: dict[str, str] = {
    flag: "remove it; it loads Python code into the engine"
    for flag in (
        "--middleware", "--logits-processors", "--tool-parser-plugin", "--reasoning-parser-plugin",
        "--io-processor-plugin", "--worker-cls", "--worker-extension-cls", "--scheduler-cls",
    )
}

# vLLM's names for our attentionBackend values on GPUs.
_GPU_ATTENTION: dict[str, str | None] = {"triton": "TRITON_ATTN", "tile": "CUSTOM", "auto": None}


@dataclass(frozen=True)
class AcceleratorProfile:
    """What one accelerator allows and defaults to, and why."""

    name: str
    gpu: bool
    default_block_size: int
    block_size_multiple: int
    fixed_block_size: bool
    default_dtype: str
    allowed_dtypes: tuple[str, ...]
    default_gpu_memory_utilization: float | None
    max_gpu_memory_utilization: float | None
    max_num_seqs: int
    max_model_len: int
    head_size_multiple: int
    min_head_size: int
    card_memory_bytes: int | None
    min_compute_capability: tuple[int, int] | None
    attention_backends: tuple[str, ...]
    default_enforce_eager: bool
    default_max_loras: int
    max_loras: int
    default_max_lora_rank: int
    max_lora_rank: int
    why: dict[str, str]
    """Why a limit above holds, by the engine field it limits (blockSize, dtype, ...): refusals say it."""


PROFILES: dict[str, AcceleratorProfile] = {
    # T4: sm_75, 16 GB (about 15 GiB usable), no bf16; vLLM's Triton attention reads 16-token blocks,
    # 512 sequences run out of memory.
    "t4": AcceleratorProfile(
        name="t4", gpu=True, default_block_size=16, block_size_multiple=16, fixed_block_size=True,
        default_dtype="float16", allowed_dtypes=("float16", "float32", "auto"),
        default_gpu_memory_utilization=0.85, max_gpu_memory_utilization=0.90,
        max_num_seqs=256, max_model_len=4096, head_size_multiple=16, min_head_size=16,
        card_memory_bytes=15 * 1024**3, min_compute_capability=(7, 5),
        attention_backends=("triton", "tile", "auto"),
        # CUDA graphs on: eager decode is many times slower per token and carries far fewer concurrent
        # requests (docs/benchmarks/goodput.md); vLLM's memory profiler counts the graph pool inside
        # gpuMemoryUtilization.
        default_enforce_eager=False,
        default_max_loras=4, max_loras=8, default_max_lora_rank=16, max_lora_rank=64,
        why={
            "blockSize": "the T4 attention kernel reads the KV cache in 16-token blocks",
            "dtype": "the T4 (sm_75) has no bf16 units",
            "gpuMemoryUtilization": "the CUDA context and activations need the rest of the 16 GB card",
            "maxModelLen": "longer contexts leave too little KV cache on a 16 GB card for concurrent requests",
            "maxNumSeqs": "more concurrent sequences run the card out of memory (512 does)",
            # Provisional: the counted buffers at 1.5B (2.3 MB per rank and adapter slot) allow more; the
            # limits stand until serving through them is measured on a T4 (the graph pool with LoRA too).
            "lora.maxLoras": "each adapter slot's buffers and its share of the CUDA graphs come out of the KV cache "
                             "(provisional until measured on a T4)",
            "lora.maxRank": "the buffers grow with the rank (at 1.5B, 64 x 8 slots take 1.1 GiB of the 15 GiB card; "
                            "provisional until measured on a T4)",
        },
    ),
    # vLLM's CPU attention accepts only block sizes that are multiples of 32 and head sizes >= 32.
    "cpu": AcceleratorProfile(
        name="cpu", gpu=False, default_block_size=32, block_size_multiple=32, fixed_block_size=False,
        default_dtype="float32", allowed_dtypes=("float32", "bfloat16", "auto"),
        default_gpu_memory_utilization=None, max_gpu_memory_utilization=None,
        max_num_seqs=256, max_model_len=4096, head_size_multiple=1, min_head_size=32,
        card_memory_bytes=None, min_compute_capability=None,
        attention_backends=("triton", "auto"),
        # No CUDA graphs on a CPU; without eager mode vLLM's CPU backend compiles the model with
        # torch.compile at every start, which a tiny test model does not repay.
        default_enforce_eager=True,
        default_max_loras=4, max_loras=8, default_max_lora_rank=16, max_lora_rank=64,
        why={
            "blockSize": "vLLM's CPU attention supports only such blocks",
            "dtype": "vLLM's CPU backend runs float32 or bfloat16",
            "maxModelLen": "the cpu profile's KV cache is 1 GiB",
            "maxNumSeqs": "the cpu profile's 1 GiB KV cache cannot hold more",
            "attentionBackend": "the tile kernel is a CUDA Triton kernel",
            "lora.maxLoras": "vLLM's CPU punica kernels run every slot's adapter per step; more slows each step",
            "lora.maxRank": "the cpu profile serves small test and development adapters",
        },
    ),
}


class ProfileError(ValueError):
    """The engine config conflicts with its accelerator profile; `problems` has one line per conflict."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class ResolvedEngine:
    """The engine settings after profile defaults were applied and every rule checked."""

    profile: AcceleratorProfile
    block_size: int
    dtype: str
    gpu_memory_utilization: float | None
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    enforce_eager: bool
    enable_prefix_caching: bool | None
    """None: vLLM's default (no flag)."""
    attention_backend: str
    quantization: str
    """spec.model.quantization as written: auto is resolved against the checkpoint by the preflight."""
    lora: ResolvedLora | None = None
    """None: no LoRA (the config has no lora section)."""


DEFAULT_MAX_CPU_LORAS = 16
"""Adapters held at once when lora.maxCpuLoras is unset (at least maxLoras): host memory, not the card's."""


@dataclass(frozen=True)
class ResolvedLora:
    """The LoRA limits after the profile's defaults: vLLM's flags and the memory plan's buffers."""

    max_loras: int
    max_rank: int
    max_cpu_loras: int


def _lora(config: EngineConfig, profile: AcceleratorProfile, problems: list[str]) -> ResolvedLora | None:
    lora = config.lora
    if lora is None:
        return None
    max_loras = lora.max_loras if lora.max_loras is not None else profile.default_max_loras
    max_rank = lora.max_rank if lora.max_rank is not None else profile.default_max_lora_rank
    for key, value, limit in (("maxLoras", max_loras, profile.max_loras), ("maxRank", max_rank, profile.max_lora_rank)):
        if value > limit:
            problems.append(f"lora.{key} is {value}; it must be <= {limit} on {profile.name}: "
                            f"{profile.why['lora.' + key]}")
    cpu = lora.max_cpu_loras if lora.max_cpu_loras is not None else max(max_loras, DEFAULT_MAX_CPU_LORAS)
    if cpu < max_loras:
        problems.append(f"lora.maxCpuLoras is {cpu}, below lora.maxLoras {max_loras}: vLLM holds every adapter "
                        f"a batch uses in host memory too; raise it to at least {max_loras}")
    return ResolvedLora(max_loras=max_loras, max_rank=max_rank, max_cpu_loras=cpu)


# Refused whatever the cluster admin's extension says: the flags the profile, the memory plan, the model's
# source and the engine's code depend on (docs/design.md, "Extra args").
NEVER_ALLOWED: tuple[str, ...] = (
    *ENFORCED_FLAGS, *ALIASES, *ENFORCED_WHEN_SET, CONFIG_FLAG, *MEMORY_PLAN_FLAGS, *SOURCE_FLAGS, *CODE_FLAGS,
)
EXTENSION_FIELD = "engine.extraArgsAllowed"
"""The engine-config key of the admin's extension this model uses (the chart's engineExtraArgs.allowed)."""
_ASK_ADMIN = "ask the cluster admin to add it to the chart's engineExtraArgs.allowed"
# The never-allowed tables whose value says what to do instead, with what a flag of each does.
_GROUPS: tuple[tuple[dict[str, str], str], ...] = (
    (MEMORY_PLAN_FLAGS, "changes the memory plan with"),
    (SOURCE_FLAGS, "changes the model's source with"),
    (CODE_FLAGS, "loads code with"),
)


def _refusals(options: Options, set_keys: frozenset[str] = frozenset()) -> dict[str, tuple[str, str, str]]:
    """dest -> (the flag to name, what it does, what to do instead), for every dest an extra arg must not reach.

    `set_keys`: the ENFORCED_WHEN_SET keys the config sets, whose flags are refused too.
    """
    table: dict[str, tuple[str, str, str]] = {}
    enforced = "sets the enforced flag"
    for flag, field in ENFORCED_FLAGS.items():
        table[dest_of(flag, options)] = (flag, enforced, f"remove it and set {field} instead")
    for flag, field in ENFORCED_WHEN_SET.items():
        if field in set_keys:
            table.setdefault(dest_of(flag, options), (flag, enforced, f"remove it; {field} is set and decides it"))
    for flag, target in ALIASES.items():
        table.setdefault(
            dest_of(flag, options), (target, enforced, f"remove it and set {ENFORCED_FLAGS[target]} instead")
        )
    for flags, verb in _GROUPS:
        for flag, instead in flags.items():
            table.setdefault(dest_of(flag, options), (flag, verb, instead))
    return table


def _name_refusal(flag: str, set_keys: frozenset[str]) -> tuple[str, str, str] | None:
    """(flag, verb, instead) for a guarded flag judged by its name alone (a table that lacks it)."""
    flag = ALIASES.get(flag, flag)
    if flag in ENFORCED_FLAGS or (flag in ENFORCED_WHEN_SET and ENFORCED_WHEN_SET[flag] in set_keys):
        field = ENFORCED_FLAGS.get(flag) or ENFORCED_WHEN_SET[flag]
        return flag, "sets the enforced flag", f"remove it and set {field} instead"
    for flags, verb in _GROUPS:
        if flag in flags:
            return flag, verb, flags[flag]
    return None


def _guarded_names(set_keys: frozenset[str]) -> list[str]:
    when_set = [flag for flag, key in ENFORCED_WHEN_SET.items() if key in set_keys]
    return [*ENFORCED_FLAGS, *ALIASES, CONFIG_FLAG, *MEMORY_PLAN_FLAGS, *SOURCE_FLAGS, *CODE_FLAGS, *when_set]


def allowed_flags(extension: frozenset[str] = frozenset(), set_keys: frozenset[str] = frozenset()) -> frozenset[str]:
    """The option strings extraArgs may name: the allow-list, the admin's extension, the unset ENFORCED_WHEN_SET."""
    when_unset = {flag for flag, key in ENFORCED_WHEN_SET.items() if key not in set_keys}
    return frozenset(ALLOWED_FLAGS) | extension | when_unset


def _unknown_problem(where: str, name: str, set_keys: frozenset[str]) -> tuple[bool, str]:
    # A table may lack a guarded flag that another vLLM has: judge it by its name too.
    guarded = [f for f in _guarded_names(set_keys) if f.startswith(name) and len(name) > 2]
    refusal = _name_refusal(guarded[0], set_keys) if guarded else None
    if refusal is None and guarded:  # the config flag
        return False, f"{where}: a vLLM config file could override enforced flags; put its settings into the spec"
    if refusal is not None:
        flag, verb, instead = refusal
        read_as = f" (vLLM reads {name} as {guarded[0]})" if guarded[0] != name else ""
        return False, f"{where}{read_as} {verb} {flag}; {instead}"
    return True, f"{where}: vLLM has no flag {name}; check its spelling (vLLM would refuse to start)"


def _table_problems(
    extra_args: list[str], table: Options, set_keys: frozenset[str] = frozenset(),
    extension: frozenset[str] = frozenset(),
) -> dict[int, tuple[bool, str]]:
    """index -> (whether the only fault is a flag this table lacks, the problem line), against one table."""
    refusals = _refusals(table, set_keys)
    allowed = allowed_flags(extension, set_keys)
    config_dest = dest_of(CONFIG_FLAG, table)
    problems: dict[int, tuple[bool, str]] = {}
    for r in resolve_args(extra_args, table):
        where = f"engine.extraArgs[{r.index}] {r.token!r}"
        read_as = f" (vLLM reads {r.name} as {r.option})" if r.option and r.option != r.name else ""
        if r.kind == "option" and r.dest == config_dest:
            problems[r.index] = (False, f"{where}: a vLLM config file could override enforced flags; "
                                        "put its settings into the FlashModel spec instead")
        elif r.kind == "option" and r.dest in refusals:
            flag, verb, instead = refusals[r.dest]
            problems[r.index] = (False, f"{where}{read_as} {verb} {flag}; {instead}")
        elif r.kind == "option" and r.option not in allowed:
            problems[r.index] = (False, f"{where}{read_as}: {r.option} is not on the allow-list of vLLM flags known "
                                        f"to be safe under the profile; remove it, or {_ASK_ADMIN}")
        elif r.kind == "ambiguous":
            guarded = [c for c in r.candidates if table[c][0] in refusals or table[c][0] == config_dest]
            shown = ", ".join(r.candidates[:4]) + (", ..." if len(r.candidates) > 4 else "")
            problems[r.index] = (False, f"{where} abbreviates several vLLM flags ({shown})"
                                        + (f", among them the enforced {guarded[0]}" if guarded else "")
                                        + "; write the flag in full")
        elif r.kind == "unknown":
            problems[r.index] = _unknown_problem(where, r.name, set_keys)
        elif r.kind == "positional":
            problems[r.index] = (False, f"{where} is not the value of a flag before it, and vLLM would take it "
                                        "for its positional model argument; put each flag and its value in "
                                        "entries of their own (or write --flag=value)")
        elif r.kind == "end":
            problems[r.index] = (False, f"{where}: vLLM would take every entry after it for positional "
                                        "arguments; remove it")
    return problems


def extension_problems(extension: Iterable[str], options: Options | None = None) -> list[str]:
    """Why entries of the admin's allow-list extension cannot be allowed: spelling, unknown, or never allowed.

    Each entry is a vLLM option string in full (`--generation-config`); `options` is one vLLM's table
    (the pod's), else every stored table is asked.
    """
    tables = list(TABLES.values()) if options is None else [options]
    all_keys = frozenset(ENFORCED_WHEN_SET.values())
    problems = []
    for flag in extension:
        if not re.fullmatch(r"--[a-z0-9][a-z0-9-]*", flag):
            problems.append(f"{flag!r} is not a vLLM flag in full (--name, lower case, no value); write it so")
            continue
        having = [t for t in tables if flag in t]
        if flag in NEVER_ALLOWED or any(
            t[flag][0] in _refusals(t, all_keys) or t[flag][0] == dest_of(CONFIG_FLAG, t) for t in having
        ):
            problems.append(
                f"{flag} can never be allowed: it sets what the profile enforces, the memory plan, the model's "
                "source or the engine's code (docs/design.md, \"Extra args\"); remove it from the allow-list"
            )
        elif not having:
            problems.append(f"{flag}: no supported vLLM has this flag; check its spelling (write it in full)")
    return problems


def used_extension(extra_args: list[str], extension: Iterable[str]) -> list[str]:
    """The entries of the admin's extension these extra args name (in any stored vLLM's reading), sorted.

    The operator writes only these into the engine config, so a change to the cluster's list rolls
    only the models that use what changed.
    """
    wanted = set(extension)
    used = {r.option for table in TABLES.values() for r in resolve_args(extra_args, table) if r.option in wanted}
    return sorted(o for o in used if o is not None)


def check_extra_args(
    extra_args: list[str], options: Options | None = None, *, strict: bool = False,
    set_keys: frozenset[str] = frozenset(), extension: Iterable[str] = (),
) -> list[str]:
    """One problem line per extra arg that is not on the allow-list or sets a guarded flag, however it is spelt.

    `set_keys` are the ENFORCED_WHEN_SET keys the config sets (see `set_keys`): their flags count as
    enforced. `extension` is the cluster admin's addition to the allow-list; an entry that may never
    be allowed is a problem line of its own.

    With `options` (one vLLM's table: the installed parser's, in the pod) the args are judged as that
    vLLM reads them, and with `strict` a flag it does not know is refused too. Without `options`
    (the operator, which cannot see the image's vLLM before a pod starts) they are judged against
    every supported version's stored table (vllm_options.TABLES): refused when any version reads
    them as a flag that is not allowed, and a flag is refused unless every stored version has it,
    since a vLLM without it refuses to start and the pod would crash-loop. The message names the
    versions that have it.
    """
    extension = tuple(extension)
    problems = [f"{EXTENSION_FIELD}: {line}" for line in extension_problems(extension, options)]
    allowed = frozenset(extension)
    if options is not None:
        one = _table_problems(extra_args, options, set_keys, allowed)
        return problems + [line for _, (unknown, line) in sorted(one.items()) if strict or not unknown]
    per_version = {v: _table_problems(extra_args, table, set_keys, allowed) for v, table in TABLES.items()}
    for index in sorted({i for at in per_version.values() for i in at}):
        found = {v: per_version[v][index] for v in TABLES if index in per_version[v]}
        refused = [line for unknown, line in found.values() if not unknown]
        if refused:
            problems.append(refused[0])
            continue
        problems.append(_version_problem(extra_args[index], index, list(found)))
    return problems


def _version_problem(token: str, index: int, lacking: list[str]) -> str:
    where = f"engine.extraArgs[{index}] {token!r}"
    having = [v for v in TABLES if v not in lacking]
    if not having:
        return (
            f"{where}: vLLM has no flag {token.split('=')[0]} in any supported version with a stored table "
            f"({', '.join(TABLES)}); check its spelling (vLLM would refuse to start)"
        )
    return (
        f"{where}: only vLLM {', '.join(having)} has this flag, {', '.join(lacking)} does not; the engine "
        f"image may run any supported vLLM ({SUPPORTED_RANGE}) and one without it refuses to start: "
        "remove it, or use a flag every supported version has"
    )


def chunked_prefill(extra_args: list[str], options: Options | None = None) -> bool:
    """Whether the extra args turn on chunked prefill (then the prefill cap may be below maxModelLen)."""
    # Without one vLLM's table: on only where every supported version reads it so.
    tables = list(TABLES.values()) if options is None else [options]
    return all(_chunked_prefill_last(extra_args, table) for table in tables)


def _chunked_prefill_last(extra_args: list[str], table: Options) -> bool:
    # argparse keeps the last of --enable-chunked-prefill and --no-enable-chunked-prefill.
    on = False
    for r in resolve_args(extra_args, table):
        if r.option in ("--enable-chunked-prefill", "--no-enable-chunked-prefill"):
            on = r.option == "--enable-chunked-prefill"
    return on


def set_keys(config: EngineConfig) -> frozenset[str]:
    """The ENFORCED_WHEN_SET keys (section.camelCaseField) this config sets to something other than None."""
    found = set()
    for key in set(ENFORCED_WHEN_SET.values()):
        section_name, alias = key.split(".")
        section = getattr(config, section_name)
        name = next(n for n, f in type(section).model_fields.items() if (f.alias or n) == alias)
        if getattr(section, name) is not None:
            found.add(key)
    return frozenset(found)


def _block_size(e: EngineSettings, profile: AcceleratorProfile, problems: list[str]) -> int:
    block_size = e.block_size if e.block_size is not None else profile.default_block_size
    where = f"on {profile.name}"
    if profile.fixed_block_size and block_size != profile.default_block_size:
        problems.append(
            f"engine.blockSize is {block_size}; it must be {profile.default_block_size} {where}: "
            f"{profile.why['blockSize']}"
        )
    elif block_size % profile.block_size_multiple:
        problems.append(
            f"engine.blockSize is {block_size}; it must be a multiple of {profile.block_size_multiple} {where}: "
            f"{profile.why['blockSize']} (use {profile.default_block_size})"
        )
    return block_size


def _dtype(e: EngineSettings, profile: AcceleratorProfile, problems: list[str]) -> str:
    dtype = e.dtype or profile.default_dtype
    if dtype not in profile.allowed_dtypes:
        problems.append(
            f"engine.dtype is {dtype}; allowed on {profile.name}: {', '.join(profile.allowed_dtypes)} "
            f"({profile.why['dtype']}; use {profile.default_dtype})"
        )
    return dtype


def _gpu_memory_utilization(e: EngineSettings, profile: AcceleratorProfile, problems: list[str]) -> float | None:
    if not profile.gpu:
        return None
    gmu = e.gpu_memory_utilization if e.gpu_memory_utilization is not None else profile.default_gpu_memory_utilization
    limit = profile.max_gpu_memory_utilization
    if gmu is not None and limit is not None and gmu > limit:
        problems.append(
            f"engine.gpuMemoryUtilization is {gmu}; it must be <= {limit} on {profile.name}: "
            f"{profile.why['gpuMemoryUtilization']} ({profile.default_gpu_memory_utilization} is the tested value)"
        )
    return gmu


def _at_most(field: str, value: int | None, limit: int, profile: AcceleratorProfile, problems: list[str]) -> int:
    """The value or, unset, the profile's limit; a problem line when it is above the limit."""
    if value is None:
        return limit
    if value > limit:
        problems.append(f"engine.{field} is {value}; it must be <= {limit} on {profile.name}: {profile.why[field]}")
    return value


def resolve(config: EngineConfig, options: Options | None = None, *, strict: bool = False) -> ResolvedEngine:
    """Apply the profile's defaults and rules; raise ProfileError listing every conflict.

    `options` and `strict` are for the extra args (see `check_extra_args`).
    """
    profile = PROFILES[config.accelerator]
    e = config.engine
    problems: list[str] = []
    block_size = _block_size(e, profile, problems)
    dtype = _dtype(e, profile, problems)
    gmu = _gpu_memory_utilization(e, profile, problems)
    max_num_seqs = _at_most("maxNumSeqs", e.max_num_seqs, profile.max_num_seqs, profile, problems)
    max_model_len = _at_most("maxModelLen", e.max_model_len, profile.max_model_len, profile, problems)

    mnbt = e.max_num_batched_tokens if e.max_num_batched_tokens is not None else max_model_len
    if mnbt < max_model_len and not chunked_prefill(e.extra_args, options):
        problems.append(
            f"engine.maxNumBatchedTokens is {mnbt}, below maxModelLen {max_model_len}: a full-length prompt "
            "could never be scheduled; raise it or add --enable-chunked-prefill to extraArgs"
        )
    if e.attention_backend not in profile.attention_backends:
        problems.append(
            f"engine.attentionBackend is {e.attention_backend}; allowed on {profile.name}: "
            f"{', '.join(profile.attention_backends)} ({profile.why['attentionBackend']})"
        )
    lora = _lora(config, profile, problems)
    quantization = config.model.quantization
    if quantization not in ("auto", "none"):
        problems.extend(method_problems(quantization, profile.name, dtype))

    problems.extend(check_extra_args(
        e.extra_args, options, strict=strict, set_keys=set_keys(config), extension=e.extra_args_allowed
    ))
    if problems:
        raise ProfileError(problems)
    return ResolvedEngine(
        profile=profile, block_size=block_size, dtype=dtype, gpu_memory_utilization=gmu,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=mnbt,
        enforce_eager=profile.default_enforce_eager if e.enforce_eager is None else e.enforce_eager,
        enable_prefix_caching=e.enable_prefix_caching,
        attention_backend=e.attention_backend, quantization=quantization, lora=lora,
    )


def quantization_flag(config: EngineConfig, checkpoint_method: str | None = None) -> str | None:
    """The --quantization value: the spec's method, or for auto the checkpoint's (None: no flag)."""
    q = config.model.quantization
    if q == "none":
        return None
    return checkpoint_method if q == "auto" else q


def vllm_args(config: EngineConfig, checkpoint_method: str | None = None) -> list[str]:
    """vLLM's OpenAI-server flags for this config (without the interpreter and module): extra args, then enforced.

    `checkpoint_method` is the quantization the preflight read from the checkpoint's config.json,
    which is what `model.quantization: auto` becomes (the operator, with no checkpoint to read,
    shows auto without the flag in status.engineArgs). The API key is not a flag: it would show
    in `ps` and in status.engineArgs, so the launcher hands it to vLLM as VLLM_API_KEY (see `vllm_env`).
    """
    r = resolve(config)
    # The extra args first: argparse keeps the last value of a flag, so whatever an extra arg
    # slipped past the checks, the enforced value after it wins.
    args = [
        *config.engine.extra_args,
        "--model", config.model.path,
        "--served-model-name", config.model.served_name,
        "--host", config.server.host,
        "--port", str(config.server.engine_port),
        "--block-size", str(r.block_size),
        "--dtype", r.dtype,
        "--max-num-seqs", str(r.max_num_seqs),
        "--max-model-len", str(r.max_model_len),
        "--max-num-batched-tokens", str(r.max_num_batched_tokens),
        "--shutdown-timeout", str(math.ceil(config.server.drain_timeout_seconds)),
        # Always, LoRA or not: vLLM's port also carries its control routes (runtime LoRA, dev mode,
        # elastic EP), and the Service and the gateway expose that port to every client
        # (engine_guard). --middleware is a CODE_FLAGS flag, so extraArgs cannot add another.
        "--middleware", GUARD_MIDDLEWARE,
    ]
    if r.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(r.gpu_memory_utilization)]
    if r.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if r.enable_prefix_caching else "--no-enable-prefix-caching")
    if r.enforce_eager:
        args.append("--enforce-eager")
    elif r.profile.gpu:
        # Graphs for every step the prefill budget allows, not only pure decodes: a step larger than
        # the largest captured size runs without graphs (vLLM's CudagraphDispatcher), and under load
        # most steps mix decodes with prefill chunks. Capturing up to maxNumBatchedTokens instead of
        # maxNumSeqs raises goodput and cuts TPOT p99 under load, for a larger graph pool and a
        # longer start-up (docs/benchmarks/goodput.md). The memory plan counts that pool.
        args += ["--max-cudagraph-capture-size", str(r.max_num_batched_tokens)]
    if r.profile.gpu:
        backend = _GPU_ATTENTION[r.attention_backend]
        if backend is not None:
            args += ["--attention-backend", backend]
    method = quantization_flag(config, checkpoint_method)
    if method is not None:
        args += ["--quantization", method]
    if config.model.revision is not None:
        args += ["--revision", config.model.revision, "--code-revision", config.model.revision]
    if config.model.trust_remote_code:
        args.append("--trust-remote-code")
    if config.observability.otlp_traces_endpoint is not None:
        args += ["--otlp-traces-endpoint", config.observability.otlp_traces_endpoint]
    if r.lora is not None:
        args += ["--enable-lora", "--max-loras", str(r.lora.max_loras), "--max-lora-rank", str(r.lora.max_rank),
                 "--max-cpu-loras", str(r.lora.max_cpu_loras)]
    return args


def vllm_env(config: EngineConfig) -> dict[str, str]:
    """Environment variables the profile and the tracing set for vLLM (the API key is added by the launcher)."""
    env: dict[str, str] = {}
    if config.accelerator == "cpu":
        # vLLM's CPU backend sizes its KV cache from this, not from gpu-memory-utilization.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.engine.cpu_kv_cache_space_gib)
    if config.observability.otlp_traces_endpoint is not None:
        # vLLM takes the transport only from the environment; the service name tells one model's
        # spans from another's in the collector (the SDK's default is unknown_service).
        env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = config.observability.otlp_traces_protocol
        env["OTEL_SERVICE_NAME"] = config.model.served_name
    if config.lora is not None:
        # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with this; the shim's
        # PUT /adapters calls them (on the engine port, behind the API key when one is set, and
        # answered only with the control token: engine_guard.ControlRoutes).
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env
