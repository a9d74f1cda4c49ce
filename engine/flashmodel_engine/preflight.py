"""Checks run before vLLM starts: model files, settings vs the model and the card, open-file limit."""

from __future__ import annotations

import json
import os
import resource
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flashmodel_engine.config import EngineConfig
from flashmodel_engine.profiles import ProfileError, ResolvedEngine, resolve
from flashmodel_engine.vllm_flags import installed_options

GIB = 1024**3
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# Compute capability each dtype needs (bf16 arrived with Ampere, sm_80).
DTYPE_MIN_CC = {"float16": (5, 3), "bfloat16": (8, 0), "float32": (3, 0)}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Room for the CUDA context, activations and allocator slack on top of weights + KV cache.
RUNTIME_OVERHEAD_BYTES = GIB // 2
# The CUDA-graph pool holds the activations of the largest captured batch: measured 0.28 GiB for
# a 1.5B shape (hidden 1536 + intermediate 8960) captured up to 256 sequences (H200, vLLM 0.26;
# docs/benchmarks.md, "The t4 profile"). Scaled by batch and width for other shapes.
GRAPH_POOL_REFERENCE = (int(0.28 * GIB), 256, 1536 + 8960)


def graph_pool_bytes(hidden: int, intermediate: int, max_capture: int) -> int:
    """The plan's CUDA-graph pool for a model width and the largest captured batch."""
    pool, batch, width = GRAPH_POOL_REFERENCE
    return pool * max_capture * (hidden + intermediate) // (batch * width)
CPU_RUNTIME_OVERHEAD_BYTES = 2 * GIB


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU preflight checks against (from NVML; tests pass one explicitly)."""

    name: str
    compute_capability: tuple[int, int]
    total_memory_bytes: int


@dataclass
class PreflightReport:
    """Outcome of preflight: failures (one line each: what and what to do) and measured facts."""

    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    template_overhead_tokens: int | None = None
    safe_prompt_tokens: int | None = None
    weights_bytes: int | None = None
    kv_bytes_per_token: int | None = None
    graph_pool_bytes: int | None = None
    max_full_length_sequences: int | None = None
    open_files_soft_limit: int | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


def detect_device() -> DeviceInfo | None:
    """First NVIDIA GPU through NVML, or None when there is none (or no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound and friends: no GPU on this machine
        return None
    try:
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        name = pynvml.nvmlDeviceGetName(h)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(h).total)
        return DeviceInfo(name=name if isinstance(name, str) else name.decode(),
                          compute_capability=(int(major), int(minor)), total_memory_bytes=total)
    finally:
        pynvml.nvmlShutdown()


def raise_open_file_limit() -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit to the hard limit; return (before, after).

    At the common default of 1024, about 50 concurrent connections fail with a misleading error.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft
        return soft, target
    return soft, soft


def _check_readable(path: Path, report: PreflightReport) -> bool:
    try:
        with path.open("rb") as f:
            f.read(1)
    except PermissionError:
        st = path.stat()
        report.failures.append(
            f"model file {path} is not readable by uid={os.getuid()} (mode {stat.filemode(st.st_mode)}, "
            f"owner {st.st_uid}:{st.st_gid}); make it readable (chmod a+r) or set the pod's fsGroup"
        )
        return False
    except OSError as e:
        report.failures.append(f"model file {path} cannot be read ({e.strerror}); check the volume")
        return False
    mode = path.stat().st_mode
    if os.getuid() == 0 and not mode & stat.S_IROTH:
        report.notes.append(f"warning=root-only-readable file={path} mode={stat.filemode(mode)} "
                            "fix='chmod a+r: root-only model files make start-up much slower'")
    return True


def _load_model_config(model_dir: Path, report: PreflightReport) -> dict[str, Any] | None:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        report.failures.append(f"{cfg_path} is missing; the model directory must hold a Hugging Face "
                               "checkpoint (config.json, tokenizer, weights)")
        return None
    if not _check_readable(cfg_path, report):
        return None
    try:
        data = json.loads(cfg_path.read_text())
    except (ValueError, OSError) as e:
        report.failures.append(f"{cfg_path} is not valid JSON ({e}); re-export the checkpoint")
        return None
    if not isinstance(data, dict):
        report.failures.append(f"{cfg_path} is not a JSON object; re-export the checkpoint")
        return None
    # Multimodal checkpoints nest the language model's settings.
    text_cfg = data.get("text_config")
    return {**data, **text_cfg} if isinstance(text_cfg, dict) else data


def _check_files(model_dir: Path, report: PreflightReport) -> int:
    """Tokenizer and weight files present and readable; return the weights' total size in bytes."""
    tokenizer = [model_dir / n for n in TOKENIZER_FILES if (model_dir / n).is_file()]
    if not tokenizer:
        report.failures.append(f"no tokenizer in {model_dir} (looked for {', '.join(TOKENIZER_FILES)}); "
                               "copy the tokenizer that belongs to these weights")
    for extra in ("tokenizer_config.json", "merges.txt"):
        if (model_dir / extra).is_file():
            tokenizer.append(model_dir / extra)
    for p in tokenizer:
        _check_readable(p, report)
    weights = sorted(p for p in model_dir.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    if not weights:
        report.failures.append(f"no weight files (*.safetensors, *.bin) in {model_dir}; "
                               "the checkpoint is incomplete")
    total = 0
    for p in weights:
        if _check_readable(p, report):
            total += p.stat().st_size
    return total


def _template_overhead(model_dir: Path, report: PreflightReport, vocab_size: int | None) -> int | None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        report.notes.append("template_overhead=unknown reason=transformers-not-installed")
        return None
    try:
        tok = AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # any loader error means vLLM would fail the same way, later
        report.failures.append(f"tokenizer in {model_dir} does not load ({type(e).__name__}: {e}); "
                               "ship the tokenizer files that belong to these weights")
        return None
    if vocab_size is not None and len(tok) > vocab_size:
        report.failures.append(
            f"tokenizer has {len(tok)} tokens but the model's vocab_size is {vocab_size}: ids past the "
            "embedding crash the engine; use the tokenizer that belongs to these weights"
        )
    sample = "Inspection ticket 42: the pump on line 3 vibrates."
    ids_sample = list(tok(sample)["input_ids"])
    decoded = str(tok.decode(ids_sample))
    if not ids_sample or decoded.strip() != sample:
        # Seen with transformers 5: a tokenizer rebuilt from the wrong class encodes to nothing,
        # every prompt turns empty and vLLM answers 400 to all of them.
        report.failures.append(
            f"tokenizer in {model_dir} does not round-trip text ({sample!r} -> {ids_sample[:8]} -> "
            f"{decoded!r}; class {type(tok).__name__}); ship a tokenizer.json that matches "
            "the model type"
        )
    if not getattr(tok, "chat_template", None):
        report.notes.append("chat_template=absent effect='chat requests fail; completions work'")
        return 0
    ids: Any = tok.apply_chat_template([{"role": "user", "content": ""}], add_generation_prompt=True,
                                       tokenize=True)
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return len(ids)


def _check_fit(cfg: dict[str, Any], r: ResolvedEngine, config: EngineConfig, weights_bytes: int,
               device: DeviceInfo | None, report: PreflightReport) -> None:
    layers = int(cfg.get("num_hidden_layers", 0))
    heads = int(cfg.get("num_attention_heads", 0))
    hidden = int(cfg.get("hidden_size", 0))
    kv_heads = int(cfg.get("num_key_value_heads", heads) or heads)
    head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
    dtype = r.dtype if r.dtype != "auto" else str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    run_bytes = DTYPE_BYTES.get(dtype, 2)
    ckpt_bytes = DTYPE_BYTES.get(str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16"), 2)
    weights = weights_bytes * run_bytes // ckpt_bytes
    kv_per_token = 2 * layers * kv_heads * head_dim * run_bytes
    report.weights_bytes, report.kv_bytes_per_token = weights, kv_per_token
    seq_bytes = kv_per_token * r.max_model_len
    if r.profile.gpu:
        card = device.total_memory_bytes if device else r.profile.card_memory_bytes or 0
        budget = int(card * (r.gpu_memory_utilization or 0.85))
        graphs = 0 if r.enforce_eager else graph_pool_bytes(
            hidden, int(cfg.get("intermediate_size", 4 * hidden)), r.max_num_seqs)
        report.graph_pool_bytes = graphs
        free_for_kv = budget - weights - RUNTIME_OVERHEAD_BYTES - graphs
        where = f"{card / GIB:.1f} GiB card at gpuMemoryUtilization {r.gpu_memory_utilization}"
    else:
        budget = config.engine.cpu_kv_cache_space_gib * GIB
        free_for_kv = budget
        where = f"cpuKVCacheSpaceGiB {config.engine.cpu_kv_cache_space_gib}"
        host = _host_memory_bytes()
        need = weights + budget + CPU_RUNTIME_OVERHEAD_BYTES
        if host is not None and need > host:
            report.failures.append(
                f"weights {weights / GIB:.2f} GiB + KV cache {budget / GIB:.0f} GiB + runtime need "
                f"{need / GIB:.1f} GiB but the host has {host / GIB:.1f} GiB; lower cpuKVCacheSpaceGiB"
            )
    fits = free_for_kv // seq_bytes if seq_bytes else 0
    report.max_full_length_sequences = int(max(fits, 0))
    if free_for_kv < seq_bytes:
        report.failures.append(
            f"the model does not fit the {where}: weights {weights / GIB:.2f} GiB + runtime "
            + (f"+ CUDA graphs {report.graph_pool_bytes / GIB:.2f} GiB " if report.graph_pool_bytes else "")
            + f"leave {max(free_for_kv, 0) / GIB:.2f} GiB for the KV cache, one {r.max_model_len}-token "
            f"sequence needs {seq_bytes / GIB:.2f} GiB; use a smaller model or lower maxModelLen"
        )


def _host_memory_bytes() -> int | None:
    limit: int | None = None
    try:
        raw = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        limit = int(raw) if raw.isdigit() else None
    except OSError:
        pass
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
                return min(total, limit) if limit else total
    except OSError:
        pass
    return limit


def run_preflight(config: EngineConfig, model_dir: str | Path | None = None, *,
                  device: DeviceInfo | None = None, detect: bool = True,
                  raise_nofile: bool = True) -> PreflightReport:
    """Run every check; never raises for a bad model or config, the report lists the failures.

    `device` overrides NVML detection (tests, or checking a config for a card that is elsewhere).
    """
    report = PreflightReport()
    # The extra args are judged by the parser of the vLLM that will read them, where there is one.
    options = installed_options()
    try:
        r = resolve(config, options, strict=options is not None)
    except ProfileError as e:
        report.failures.extend(e.problems)
        return report
    if device is None and detect and r.profile.gpu:
        device = detect_device()
    if r.profile.gpu:
        if device is None:
            report.failures.append(
                f"no NVIDIA GPU visible through NVML; the {r.profile.name} profile needs one "
                "(check the nvidia.com/gpu resource, or use accelerator: cpu without a GPU)"
            )
        else:
            cc = device.compute_capability
            need = DTYPE_MIN_CC.get(r.dtype, (0, 0))
            if r.profile.min_compute_capability and cc < r.profile.min_compute_capability:
                report.failures.append(f"{device.name} is sm_{cc[0]}{cc[1]}, below the {r.profile.name} "
                                       "profile's sm_75; schedule onto a T4 node")
            if cc < need:
                report.failures.append(f"dtype {r.dtype} needs sm_{need[0]}{need[1]} but {device.name} is "
                                       f"sm_{cc[0]}{cc[1]}; use float16")
            report.notes.append(f"device={device.name.replace(' ', '-')} sm={cc[0]}{cc[1]} "
                                f"memory_gib={device.total_memory_bytes / GIB:.1f}")

    if config.auth is not None:
        key_file = Path(config.auth.api_key_file)
        try:
            if not key_file.read_text().strip():
                report.failures.append(f"auth.apiKeyFile {key_file} is empty; put the API key in the Secret")
        except OSError as e:
            report.failures.append(f"auth.apiKeyFile {key_file} cannot be read ({e.strerror}); "
                                   "mount the Secret named in spec.auth.apiKeySecretRef there")

    path = Path(model_dir) if model_dir is not None else Path(config.model.path)
    if not path.is_dir():
        if model_dir is None and "/" in config.model.path and not config.model.path.startswith("/"):
            report.notes.append(f"model={config.model.path} source=hub file_checks=skipped")
        else:
            report.failures.append(f"model directory {path} does not exist; check model.path and the volume")
        return _finish(report, config, raise_nofile)
    if not os.access(path, os.R_OK | os.X_OK):
        report.failures.append(f"model directory {path} cannot be listed by uid={os.getuid()}; "
                               "chmod a+rx it or set the pod's fsGroup")
        return _finish(report, config, raise_nofile)

    cfg = _load_model_config(path, report)
    weights_bytes = _check_files(path, report)
    if cfg is not None:
        heads = int(cfg.get("num_attention_heads") or 0)
        head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads if heads else 0))
        if head_dim % r.profile.head_size_multiple:
            report.failures.append(
                f"head size {head_dim} is not a multiple of {r.profile.head_size_multiple}, which the "
                f"{r.profile.name} attention kernel needs; this model cannot run on {r.profile.name}"
            )
        if head_dim < r.profile.min_head_size:
            report.failures.append(f"head size {head_dim} is below {r.profile.min_head_size}, the smallest "
                                   f"the {r.profile.name} attention supports; use another model")
        mpe = cfg.get("max_position_embeddings")
        if isinstance(mpe, int) and mpe < r.max_model_len:
            report.failures.append(
                f"engine.maxModelLen is {r.max_model_len} but the model's max_position_embeddings is {mpe}; "
                f"set maxModelLen <= {mpe}"
            )
        if weights_bytes:
            _check_fit(cfg, r, config, weights_bytes, device, report)
        vocab = cfg.get("vocab_size")
        overhead = _template_overhead(path, report, vocab if isinstance(vocab, int) else None)
        if overhead is not None:
            report.template_overhead_tokens = overhead
            report.safe_prompt_tokens = r.max_model_len - overhead - config.prewarm.max_tokens
    return _finish(report, config, raise_nofile)


def _finish(report: PreflightReport, config: EngineConfig, raise_nofile: bool) -> PreflightReport:
    if raise_nofile:
        before, after = raise_open_file_limit()
        report.open_files_soft_limit = after
        report.notes.append(f"open_files_soft_limit={after} raised_from={before}")
    return report


def format_report(report: PreflightReport) -> list[str]:
    """key=value lines for logs: facts first, then each failure."""
    facts = [
        f"template_overhead_tokens={report.template_overhead_tokens}",
        f"safe_prompt_tokens={report.safe_prompt_tokens}",
        f"weights_bytes={report.weights_bytes}",
        f"kv_bytes_per_token={report.kv_bytes_per_token}",
        f"max_full_length_sequences={report.max_full_length_sequences}",
    ]
    lines = ["event=preflight-facts " + " ".join(facts)]
    lines += [f"event=preflight-note {n}" for n in report.notes]
    lines += [f"event=preflight-failure reason={f!r}" for f in report.failures]
    lines.append(f"event=preflight-done ok={str(report.ok).lower()} failures={len(report.failures)}")
    return lines
