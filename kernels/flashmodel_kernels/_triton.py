"""The one place that imports Triton, so a machine without it can still import flashmodel_kernels.

Every kernel module does ``from flashmodel_kernels._triton import tl, triton``. Where Triton is
missing (the operator image, a CPU-only CI runner without the ``kernels`` extra) the names
below still exist, ``@triton.jit`` still decorates, and only launching a kernel fails, with a
message that says which package to install.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

__all__ = ["HAS_TRITON", "INTERPRETING", "tl", "triton"]

INTERPRETING: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when kernels run on the CPU through Triton's interpreter (CI, developer machines)."""

try:
    import triton
    import triton.language as tl

    HAS_TRITON: bool = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    HAS_TRITON = False

    class _NoTritonKernel:
        """Stands in for a ``@triton.jit`` function; launching it says what is missing."""

        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn
            self.__name__ = getattr(fn, "__name__", "kernel")

        def __getitem__(self, grid: object) -> Callable[..., Any]:
            raise RuntimeError(
                f"cannot launch {self.__name__}: Triton is not installed; "
                "install the kernels extra (pip install 'flashmodel[kernels]')"
            )

    class _NoTriton:
        """The subset of the ``triton`` module that kernel modules touch at import time."""

        @staticmethod
        def jit(fn: Callable[..., Any] | None = None, **_: Any) -> Any:
            if fn is None:
                return _NoTritonKernel
            return _NoTritonKernel(fn)

        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

        @staticmethod
        def next_power_of_2(n: int) -> int:
            return 1 if n <= 1 else 1 << (n - 1).bit_length()

    class _NoTritonLanguage:
        """``tl.constexpr`` must exist at import time: kernels use it in their signatures."""

        class constexpr:  # mirrors triton.language.constexpr
            pass

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"triton.language.{name} used without Triton installed")

    triton = _NoTriton()
    tl = _NoTritonLanguage()
