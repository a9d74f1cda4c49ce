"""Kernel tests run on a GPU when there is one, else on the CPU through Triton's interpreter."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("torch", reason="engine tier: the kernels need torch and Triton (the engine venv)")
import torch

# Triton reads TRITON_INTERPRET when it is imported and when a kernel is decorated, so this
# must precede the first import of triton (and of flashmodel_kernels) in the session.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="engine tier: the kernels need Triton (the engine venv)")


@pytest.fixture(autouse=True)
def _in_the_engine_venv(engine_packages: None) -> None:
    """Every kernel test needs torch and Triton, so each runs in the engine tier (conftest.py)."""


@pytest.fixture
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def generator() -> torch.Generator:
    """Fresh inputs on every run (the seed is in the failure message of each check)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
