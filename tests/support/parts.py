"""What a test does when a part it needs (the control plane, the engine venv) is absent."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest


def require_all() -> bool:
    """FLASHMODEL_REQUIRE_ALL=1 (scripts/test.sh's full run, so CI): every part must be present."""
    return os.environ.get("FLASHMODEL_REQUIRE_ALL") == "1"


def missing_part(message: str) -> NoReturn:
    """Skips the test saying what to run, or fails it where FLASHMODEL_REQUIRE_ALL=1."""
    if require_all():
        pytest.fail(f"FLASHMODEL_REQUIRE_ALL=1 and {message}", pytrace=False)
    pytest.skip(message)


def engine_venv_problem(python: str) -> str | None:
    """Why this engine venv cannot run engines, or None: an interrupted set-up leaves a venv whose
    bin/python exists without vLLM in it, which must not count as the part being there."""
    venv = Path(python).parents[1]
    if not Path(python).exists():
        return f"no engine venv at {venv}: run scripts/setup-engine.sh"
    probe = subprocess.run([python, "-c", "import vllm, torch"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return (
            f"the engine venv at {venv} cannot import vLLM ({last}): an interrupted set-up? "
            "run scripts/setup-engine.sh"
        )
    return None
