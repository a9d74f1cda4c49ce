"""The CRD's CEL rules that restate engine tables, generated from them so the two cannot drift.

The engine owns the facts: the accelerator profiles (flashmodel_engine.profiles.PROFILES), the
quantization methods each runs (flashmodel_engine.quantization) and the flags extraArgs may never set
(ENFORCED_FLAGS, ALIASES, CONFIG_FLAG, MEMORY_PLAN_FLAGS, SOURCE_FLAGS, CODE_FLAGS). This module words
them for the API server, which answers before a pod starts; the engine checks the same tables again
at launch. The allow-list itself is not here: the cluster admin extends it in the operator's
configuration, which the CRD cannot see, so the operator refuses the rest (EngineConfigRefused).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flashmodel_engine.profiles import (
    ALIASES,
    CODE_FLAGS,
    CONFIG_FLAG,
    ENFORCED_FLAGS,
    ENFORCED_WHEN_SET,
    MEMORY_PLAN_FLAGS,
    PROFILES,
    SOURCE_FLAGS,
    AcceleratorProfile,
)
from flashmodel_engine.quantization import FIELD as QUANTIZATION_FIELD
from flashmodel_engine.quantization import METHODS, TABLE, refusal, run_dtypes


@dataclass(frozen=True)
class Rule:
    """A CEL rule of the CRD (x-kubernetes-validations): the API server refuses a spec where it is false."""

    rule: str
    message: str
    field_path: str | None = None
    reason: str | None = None

    def crd(self) -> dict[str, str]:
        out = {"rule": self.rule}
        if self.field_path is not None:
            out["fieldPath"] = self.field_path
        if self.reason is not None:
            out["reason"] = self.reason
        out["message"] = self.message
        return out


def _listed(items: Sequence[str]) -> str:
    """a, b or c"""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _cel_list(items: Sequence[str]) -> str:
    return "[" + ", ".join(f"'{i}'" for i in items) + "]"


# --- spec.engine.extraArgs ------------------------------------------------------------------------

# vLLM's parser reads `_` as `-`, keeps only the part before `=` (and before `.` for its dotted dict
# keys) and accepts any unambiguous prefix of a flag, so an entry is refused when that name is a
# prefix of a guarded flag (a prefix of two flags is an error to vLLM anyway). The engine resolves
# the same with vLLM's own parser (flashmodel_engine.vllm_flags); these rules answer before a pod starts.
_FLAG_NAME = "a.split('=')[0].split('.')[0].replace('_', '-')"

# Where a FlashModel sets each engine-config key the enforced flags stand for, where that is not
# `spec.` + the key; None: no field sets it, the operator does.
_SPEC_PATH: dict[str, str | None] = {
    "model.path": "spec.model (pvc, image or hub)",
    "model.revision": "spec.model.hub.revision",
    "auth.apiKeyFile": "spec.auth.apiKeySecretRef",
    "server.host": None,
    "server.enginePort": None,
    "server.drainTimeoutSeconds": None,
    QUANTIZATION_FIELD: QUANTIZATION_FIELD,
}
# Why extraArgs may not set the flags of a key; an `engine.` key not listed is the profile's to enforce.
_WHY: dict[str, str] = {
    "engine.gpuMemoryUtilization": "the profile enforces the memory budget",
    "engine.maxNumBatchedTokens": "the profile enforces them (graphs are captured up to the prefill budget)",
    "engine.enforceEager": "the profile enforces CUDA graphs or eager mode",
    "engine.attentionBackend": "the profile enforces the attention backend",
    "model.path": "the operator mounts and passes the model",
    "model.revision": "the operator pins the weights and remote code to one revision",
    "model.servedName": "the Service and prewarm use it",
    "observability.otlpTracesEndpoint": "the operator sets it with the service name",
    "server.host": "the Service and the health shim need the engine on 0.0.0.0",
    "server.enginePort": "the Service and the health shim expect the engine on port 8000",
    "auth.apiKeyFile": "a key on the command line shows in ps and in status",
    "server.drainTimeoutSeconds": "the engine's drain on pod termination relies on its own value",
    QUANTIZATION_FIELD: "the engine passes the checkpoint's method itself after checking it against the card",
}


def _flag_rule(flags: Sequence[str], message: str) -> Rule:
    return Rule(
        f"!self.exists(a, a.startsWith('--') && size({_FLAG_NAME}) > 2 "
        f"&& {_cel_list(flags)}.exists(f, f.startsWith({_FLAG_NAME})))",
        message,
    )


def _enforced_message(flags: list[str], key: str) -> str:
    spec_path = _SPEC_PATH.get(key, f"spec.{key}")
    instead = "remove it" if spec_path is None else f"set {spec_path} instead"
    one = len(flags) == 1
    why = _WHY.get(key) or ("the profile enforces " + ("it" if one else "them"))
    return f"extraArgs must not set {_listed(flags)} (nor abbreviate {'it' if one else 'them'}), {why}; {instead}"


def _them(flags: Sequence[str]) -> str:
    return "it" if len(flags) == 1 else "them"


def _source_rules() -> list[Rule]:
    """One rule per way of saying what to do instead (SOURCE_FLAGS), then one for the flags that load code."""
    by_instead: dict[str, list[str]] = {}
    for flag, instead in SOURCE_FLAGS.items():
        by_instead.setdefault(instead, []).append(flag)
    rules = [
        _flag_rule(flags, f"extraArgs must not set {_listed(flags)} (nor abbreviate {_them(flags)}), the model's "
                          f"weights, tokenizer, config and code come from spec.model; {instead}")
        for instead, flags in by_instead.items()
    ]
    code = list(CODE_FLAGS)
    rules.append(_flag_rule(
        code,
        f"extraArgs must not set a flag that loads Python code into the engine: {_listed(code)}, nor an "
        "abbreviation of one; remove it (a model's own code is spec.model.trustRemoteCode's, pinned to a revision)",
    ))
    return rules


def extra_args_rules() -> tuple[Rule, ...]:
    """One rule per engine-config key the enforced flags stand for, then --config, the memory plan, the source."""
    by_key: dict[str, list[str]] = {}
    for flag, key in ENFORCED_FLAGS.items():
        by_key.setdefault(key, []).append(flag)
    for flag, target in ALIASES.items():
        by_key[ENFORCED_FLAGS[target]].append(flag)
    memory_plan = list(MEMORY_PLAN_FLAGS)
    return (
        *(_flag_rule(flags, _enforced_message(flags, key)) for key, flags in by_key.items()),
        _flag_rule(
            (CONFIG_FLAG,),
            f"extraArgs must not set {CONFIG_FLAG} (nor abbreviate it), a vLLM config file could override enforced "
            "flags; put its settings into spec.engine instead",
        ),
        _flag_rule(
            memory_plan,
            "extraArgs must not set a flag that changes the memory plan the profile is sized for (one GPU, KV "
            f"cache in the model dtype within gpuMemoryUtilization, weights on the card): {_listed(memory_plan)}, "
            "nor an abbreviation of one; remove it",
        ),
        *_source_rules(),
    )


def when_set_rules() -> tuple[Rule, ...]:
    """spec.engine's rules for the flags a field decides once it is set (ENFORCED_WHEN_SET)."""
    by_key: dict[str, list[str]] = {}
    for flag, key in ENFORCED_WHEN_SET.items():
        by_key.setdefault(key, []).append(flag)
    rules = []
    for key, flags in by_key.items():
        section, field = key.split(".")
        if section != "engine":
            raise ValueError(f"ENFORCED_WHEN_SET key {key}: only spec.engine fields have a rule beside extraArgs")
        rules.append(Rule(
            f"!has(self.{field}) || !has(self.extraArgs) || !self.extraArgs.exists(a, a.startsWith('--') && "
            f"size({_FLAG_NAME}) > 2 && {_cel_list(flags)}.exists(f, f.startsWith({_FLAG_NAME})))",
            f"extraArgs must not set {_listed(flags)} (nor abbreviate {'it' if len(flags) == 1 else 'them'}) while "
            f"spec.engine.{field} is set, which decides it; remove the flag from extraArgs, or remove {field} "
            "to leave it to extraArgs",
            field_path=".extraArgs",
            reason="FieldValueForbidden",
        ))
    return tuple(rules)


# --- the accelerator profiles -----------------------------------------------------------------------

_DTYPES = ("float16", "bfloat16", "float32", "auto")


def _engine_rule(p: AcceleratorProfile, field: str, holds: str, message: str) -> Rule:
    """A rule on spec.engine.<field> that applies on profile p where the field is set."""
    return Rule(
        f"self.accelerator != '{p.name}' || !has(self.engine) || !has(self.engine.{field}) || {holds}",
        message,
        field_path=f".engine.{field}",
        reason="FieldValueInvalid",
    )


def _forbidden(rule: Rule, field_path: str) -> Rule:
    return Rule(rule.rule, rule.message, field_path=field_path, reason="FieldValueForbidden")


def _at_most(p: AcceleratorProfile, field: str, shown: str, to: str) -> Rule:
    return _engine_rule(
        p, field, f"self.engine.{field} <= {shown}",
        f"{field} must be <= {shown} on {p.name}: {p.why[field]}; set spec.engine.{field} to {to}",
    )


def profile_rules(p: AcceleratorProfile) -> list[Rule]:
    """The engine settings profile p limits (engine: flashmodel_engine.profiles.resolve)."""
    rules: list[Rule] = []
    if p.fixed_block_size:
        rules.append(_engine_rule(
            p, "blockSize", f"self.engine.blockSize == {p.default_block_size}",
            f"blockSize must be {p.default_block_size} on {p.name}: {p.why['blockSize']}; set "
            f"spec.engine.blockSize to {p.default_block_size} or leave it out",
        ))
    else:
        rules.append(_engine_rule(
            p, "blockSize", f"self.engine.blockSize % {p.block_size_multiple} == 0",
            f"blockSize must be a multiple of {p.block_size_multiple} on {p.name}: {p.why['blockSize']}; set "
            f"spec.engine.blockSize to {p.default_block_size} or leave it out",
        ))
    for dtype in (d for d in _DTYPES if d not in p.allowed_dtypes):
        rules.append(_forbidden(_engine_rule(
            p, "dtype", f"self.engine.dtype != '{dtype}'",
            f"dtype {dtype} is not supported on {p.name}: {p.why['dtype']}; set spec.engine.dtype to "
            f"{_listed(p.allowed_dtypes)}, or leave it out",
        ), ".engine.dtype"))
    if p.max_gpu_memory_utilization is not None and p.default_gpu_memory_utilization is not None:
        rules.append(_at_most(
            p, "gpuMemoryUtilization", f"{p.max_gpu_memory_utilization:.2f}",
            f"{p.default_gpu_memory_utilization:.2f}",
        ))
    rules.append(_at_most(p, "maxModelLen", str(p.max_model_len), f"{p.max_model_len} or less"))
    rules.append(_at_most(p, "maxNumSeqs", str(p.max_num_seqs), f"{p.max_num_seqs} or less"))
    allowed = [b for b in ("triton", "tile", "auto") if b in p.attention_backends]
    for backend in (b for b in ("triton", "tile", "auto") if b not in p.attention_backends):
        rules.append(_forbidden(_engine_rule(
            p, "attentionBackend", f"self.engine.attentionBackend != '{backend}'",
            f"attentionBackend {backend} needs a GPU: {p.why['attentionBackend']}; on {p.name} set "
            f"spec.engine.attentionBackend to {_listed(allowed)}",
        ), ".engine.attentionBackend"))
    return rules


def quantization_rules(p: AcceleratorProfile) -> list[Rule]:
    """The methods profile p cannot run, and the dtypes each it runs needs (engine: quantization.method_problems)."""
    rules: list[Rule] = []
    q = "self.model.quantization"
    refused: dict[str, list[str]] = {}
    for method in METHODS:
        why = refusal(method, p.name)
        if why is not None:
            refused.setdefault(why, []).append(method)
    for why, methods in refused.items():
        card = "a T4 (sm_75)" if p.name == "t4" else p.name
        rules.append(Rule(
            f"self.accelerator != '{p.name}' || !has({q}) || !({q} in {_cel_list(methods)})",
            f"quantization {_listed(methods)} cannot run on {card}: {why}",
            field_path=".model.quantization",
            reason="FieldValueForbidden",
        ))
    # Methods the profile runs, grouped by the dtypes they run in here. A dtype left out is the
    # profile's default, and auto lets vLLM pick the checkpoint's; both count as the default.
    allowed = tuple(d for d in p.allowed_dtypes if d != "auto")
    by_dtypes: dict[tuple[tuple[str, ...], tuple[str, ...]], list[str]] = {}
    for method in METHODS:
        runs_in = run_dtypes(method, p.allowed_dtypes)
        if refusal(method, p.name) is None and runs_in != allowed:
            by_dtypes.setdefault((runs_in, TABLE[method].act_dtypes), []).append(method)
    dtype = f"(has(self.engine) && has(self.engine.dtype) ? self.engine.dtype : '{p.default_dtype}')"
    for (runs_in, act), methods in by_dtypes.items():
        ok = [*runs_in, "auto"] if p.default_dtype in runs_in else list(runs_in)
        refuses = [d for d in act if d not in p.allowed_dtypes]
        profile_refuses = f", and the {p.name} profile refuses {_listed(refuses)}" if refuses else ""
        leave = " or leave it out" if p.default_dtype in runs_in else f" (the {p.name} default is {p.default_dtype})"
        rules.append(Rule(
            f"self.accelerator != '{p.name}' || !has({q}) || !({q} in {_cel_list(methods)}) || {dtype} in "
            f"{_cel_list(ok)}",
            f"dtype must be {_listed(ok)} for quantization {_listed(methods)} on {p.name}: vLLM runs them in "
            f"{_listed(act)} only{profile_refuses}; set spec.engine.dtype to {runs_in[0]}{leave}",
            field_path=".engine.dtype",
            reason="FieldValueInvalid",
        ))
    return rules


def accelerator_rules() -> tuple[Rule, ...]:
    """Every profile's limits on spec.engine and spec.model.quantization, profile by profile."""
    return tuple(rule for p in PROFILES.values() for rule in (*profile_rules(p), *quantization_rules(p)))
