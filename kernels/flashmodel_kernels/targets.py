"""Compile the tile-attention kernels for a GPU that is not there (the T4, sm_75) and report limits.

Triton compiles to PTX and cubin without a device, so this runs on a CPU-only machine as well as
on any GPU host: it proves the fp16 path fits a T4 (shared memory per block, no bf16 or tf32
instructions) before a T4 ever sees it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

from flashmodel_kernels._triton import INTERPRETING, triton
from flashmodel_kernels.merge import _merge_splits_kernel
from flashmodel_kernels.paged_attention import _paged_attention_kernel
from flashmodel_kernels.plan import PAGE_SIZE, SPLIT_GRANULE, LaunchConfig

__all__ = [
    "T4_SHARED_MEMORY_BYTES",
    "CompileReport",
    "EngineLayout",
    "compile_tile_attention",
    "launch_argument_specialization",
]

T4_SHARED_MEMORY_BYTES = 64 * 1024
"""The most shared memory one block may use on sm_75."""

_TRITON_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_INT_POINTERS = {"block_table_ptr", "seq_lens_ptr", "query_start_loc_ptr", "arrivals_ptr"}
_FP32_POINTERS = {"part_out_ptr", "part_lse_ptr"}


@dataclass(frozen=True)
class CompileReport:
    """What the compiler produced for one kernel at one target."""

    kernel: str
    target: str
    shared_bytes: int
    mma_instructions: int
    """Tensor-core instructions; 0 on sm_75, where Triton lowers tl.dot to fp32 FMA."""
    bf16_instructions: int
    tf32_instructions: int
    ptx_lines: int
    async_copies: int = 0
    """``cp.async`` instructions: the loop's K/V loads were software-pipelined (sm_80 and later)."""
    merge_tail: str = ""
    """The machine code after the kernel's last atomic (the fused merge), run-length coded:
    ``L`` a global load, ``f`` floating-point arithmetic, ``S`` a global store, ``|`` a branch.
    The merge loop in use reads ``|L4f27|``: one split's loads and the arithmetic that waits for
    them, inside a loop run once per split. Empty without an atomic, or where Triton's
    ``nvdisasm`` is missing."""


@dataclass(frozen=True)
class EngineLayout:
    """The sizes a serving engine's tensors have, from which a launch's integer arguments follow.

    Triton specialises every launch on its arguments: an integer equal to 1 becomes a constant,
    one divisible by 16 (and a 16-byte aligned pointer) is marked so, which lets the compiler
    vectorise the K/V loads and pipeline them with ``cp.async``. A compile that leaves these out
    is not the kernel a GPU runs (on sm_90 it has no ``cp.async`` at all), so the report compiles
    with the arguments vLLM's tensors give.
    """

    num_kv_heads: int = 2
    max_model_len: int = 4096
    """Sets the block table's row stride: one entry per 16-token page."""


def launch_argument_specialization(value: int, *, specialize: bool) -> tuple[str, list[list[Any]]]:
    """Triton's rule for one integer argument: its signature type and attributes.

    The type is ``"constexpr"`` for a 1, which the launch then compiles in as a constant.
    ``specialize`` is False for the kernel's ``do_not_specialize`` arguments. The rule is
    Triton's own (``tests/kernels/test_sm75_compile.py`` checks it against the installed Triton).
    """
    kind = "i32" if -(2**31) <= value < 2**31 else "i64"
    if not specialize:
        return kind, []
    if value == 1:
        return "constexpr", []
    return kind, [["tt.divisibility", 16]] if value % 16 == 0 else []


def _example_arguments(kernel_name: str, head_dim: int, queries_per_kv: int, layout: EngineLayout) -> dict[str, int]:
    """The integer arguments a launch in a serving engine passes (``paged_attention``'s call).

    The query is a view of the fused QKV projection (row stride: all heads of q, k and v), the
    output and the caches are contiguous, the cache is vLLM's [blocks, 16, kv_heads, head_dim].
    """
    kv = layout.num_kv_heads
    q_heads = kv * queries_per_kv
    rows = {
        "num_seqs": 8,
        "num_q_heads": q_heads,
        "num_splits": 2,
        "stride_o_tok": q_heads * head_dim,
        "stride_o_head": head_dim,
    }
    if kernel_name == "_merge_splits_kernel":
        return rows
    cache = {"blk": PAGE_SIZE * kv * head_dim, "tok": kv * head_dim, "head": head_dim, "dim": 1}
    return (
        rows
        | {"stride_q_tok": (q_heads + 2 * kv) * head_dim, "stride_q_head": head_dim}
        | {f"stride_k_{name}": stride for name, stride in cache.items()}
        | {f"stride_v_{name}": stride for name, stride in cache.items()}
        | {"stride_bt_seq": -(-layout.max_model_len // PAGE_SIZE)}
    )


def _jit_function(kernel: Any) -> Any:
    # Under TRITON_INTERPRET=1 ``@triton.jit`` gives an interpreter object; the compiler needs
    # the JIT form of the same Python function.
    from triton.runtime.jit import JITFunction

    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)


_SASS_CLASSES = (
    ("L", re.compile(r"\bLDG\b")),
    ("S", re.compile(r"\bSTG\b")),
    ("f", re.compile(r"\b(FFMA|FMUL|FADD|FMNMX|MUFU)\b")),
    ("|", re.compile(r"\bBRA\b")),
)


def merge_tail(cubin: bytes) -> str:
    """``CompileReport.merge_tail`` of a compiled kernel's cubin (sm_80 and later)."""
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(nvdisasm):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    lines = sass.splitlines()
    atomics = [i for i, line in enumerate(lines) if re.search(r"\b(ATOMG|ATOM|RED)\b", line)]
    if not atomics:
        return ""
    classes = []
    for line in lines[atomics[-1] + 1 :]:
        for letter, pattern in _SASS_CLASSES:
            if pattern.search(line):
                classes.append(letter)
                break
    return re.sub(r"(.)\1+", lambda m: f"{m.group(1)}{len(m.group(0))}", "".join(classes))


def _compile(
    kernel: Any,
    dtype: torch.dtype,
    constexprs: dict[str, int],
    num_warps: int,
    num_stages: int,
    arch: int,
    integers: dict[str, int],
) -> CompileReport:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _jit_function(kernel)
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    constants: dict[str, Any] = dict(constexprs)
    unspecialized = {param.name for param in fn.params if param.do_not_specialize}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            if name in _INT_POINTERS:
                signature[name] = "*i32"
            elif name in _FP32_POINTERS:
                signature[name] = "*fp32"
            else:
                signature[name] = "*" + _TRITON_DTYPE[dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]  # torch's CUDA allocations are 256-byte aligned
        elif name == "qk_scale_log2":
            signature[name] = "fp32"
        else:
            kind, spec = launch_argument_specialization(integers[name], specialize=name not in unspecialized)
            signature[name] = kind
            if kind == "constexpr":
                constants[name] = integers[name]
            elif spec:
                attrs[(index,)] = spec
    compiled = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx: str = compiled.asm["ptx"]
    body = [line for line in ptx.splitlines() if line.strip() and not line.lstrip().startswith("//")]
    return CompileReport(
        kernel=fn.__name__,
        target=f"sm_{arch}",
        shared_bytes=int(compiled.metadata.shared),
        mma_instructions=sum(1 for line in body if re.search(r"\b(mma|wgmma)\.", line)),
        bf16_instructions=sum(1 for line in body if "bf16" in line),
        tf32_instructions=sum(1 for line in body if "tf32" in line),
        ptx_lines=len(body),
        async_copies=sum(1 for line in body if "cp.async" in line),
        merge_tail=merge_tail(compiled.asm["cubin"]) if arch >= 80 else "",
    )


def compile_tile_attention(
    *,
    dtype: torch.dtype,
    head_dim: int,
    queries_per_kv: int,
    config: LaunchConfig,
    arch: int = 75,
    decode: bool = False,
    layout: EngineLayout = EngineLayout(),
) -> list[CompileReport]:
    """Compile the attention kernel (and the split merge, when ``config`` splits) for ``sm_{arch}``.

    ``decode`` compiles the search-free path taken by batches of one new token per sequence.
    The integer arguments are those a launch on ``layout``'s tensors passes, specialised as
    Triton specialises them (``EngineLayout``).

    Under ``TRITON_INTERPRET=1`` Triton's own library functions are interpreter objects that
    the compiler cannot inline, so the compile then runs in a child process without it.
    """
    if INTERPRETING:
        return _compile_in_child(
            dtype=dtype,
            head_dim=head_dim,
            queries_per_kv=queries_per_kv,
            config=config,
            arch=arch,
            decode=decode,
            layout=layout,
        )
    head_dim_pad = triton.next_power_of_2(head_dim)
    attention = dict(
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=PAGE_SIZE,
        QUERIES_PER_KV=queries_per_kv,
        QUERIES_PER_KV_PAD=triton.next_power_of_2(queries_per_kv),
        BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n,
        SHORT_BLOCK_N=config.short_block_n,
        SPLIT_GRANULE=SPLIT_GRANULE,
        SPLIT_KV=int(config.num_splits > 1),
        DECODE=int(decode and config.decode_path),
        FUSE_MERGE=int(config.num_splits > 1 and config.fuse_merge),
        INTERPRETER_BF16=0,
    )
    reports = [
        _compile(
            _paged_attention_kernel,
            dtype,
            attention,
            config.num_warps,
            config.num_stages,
            arch,
            _example_arguments("_paged_attention_kernel", head_dim, queries_per_kv, layout),
        )
    ]
    if config.num_splits > 1 and not config.fuse_merge:
        merge = dict(
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS_PAD=triton.next_power_of_2(config.num_splits),
        )
        integers = _example_arguments("_merge_splits_kernel", head_dim, queries_per_kv, layout)
        reports.append(_compile(_merge_splits_kernel, dtype, merge, 4, 1, arch, integers))
    return reports


def _compile_in_child(
    *,
    dtype: torch.dtype,
    head_dim: int,
    queries_per_kv: int,
    config: LaunchConfig,
    arch: int,
    decode: bool,
    layout: EngineLayout,
) -> list[CompileReport]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The child must import this very package, wherever it was imported from (pytest's pythonpath).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    args = [
        sys.executable,
        "-m",
        "flashmodel_kernels.targets",
        "--dtype",
        str(dtype).removeprefix("torch."),
        "--head-dim",
        str(head_dim),
        "--queries-per-kv",
        str(queries_per_kv),
        "--arch",
        str(arch),
        "--block-q",
        str(config.block_q),
        "--block-n",
        str(config.block_n),
        "--num-splits",
        str(config.num_splits),
        "--num-warps",
        str(config.num_warps),
        "--num-stages",
        str(config.num_stages),
        "--num-kv-heads",
        str(layout.num_kv_heads),
        "--max-model-len",
        str(layout.max_model_len),
        *(["--decode"] if decode else []),
        *(["--fuse-merge"] if config.fuse_merge else []),
        *([] if config.decode_path else ["--search-path"]),
    ]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"compiling for sm_{arch} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return [CompileReport(**row) for row in json.loads(done.stdout.strip().splitlines()[-1])]


def main(argv: list[str] | None = None) -> None:
    """``python -m flashmodel_kernels.targets --head-dim 128 ...``: print the reports as JSON."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16")
    parser.add_argument("--head-dim", type=int, required=True)
    parser.add_argument("--queries-per-kv", type=int, required=True)
    parser.add_argument("--arch", type=int, default=75)
    parser.add_argument("--block-q", type=int, required=True)
    parser.add_argument("--block-n", type=int, required=True)
    parser.add_argument("--num-splits", type=int, default=1)
    parser.add_argument("--num-warps", type=int, default=4)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--decode", action="store_true", help="the one-token-per-sequence path")
    parser.add_argument("--fuse-merge", action="store_true", help="splits merged inside the attention kernel")
    parser.add_argument("--search-path", action="store_true", help="a decode batch on the searching path")
    parser.add_argument("--num-kv-heads", type=int, default=EngineLayout.num_kv_heads)
    parser.add_argument("--max-model-len", type=int, default=EngineLayout.max_model_len)
    a = parser.parse_args(argv)
    config = LaunchConfig(
        a.block_q,
        a.block_n,
        a.num_splits,
        a.num_warps,
        a.num_stages,
        a.fuse_merge,
        decode_path=not a.search_path,
    )
    reports = compile_tile_attention(
        dtype=getattr(torch, a.dtype),
        head_dim=a.head_dim,
        queries_per_kv=a.queries_per_kv,
        config=config,
        arch=a.arch,
        decode=a.decode,
        layout=EngineLayout(num_kv_heads=a.num_kv_heads, max_model_len=a.max_model_len),
    )
    print(json.dumps([dataclasses.asdict(r) for r in reports]))


if __name__ == "__main__":
    main()
