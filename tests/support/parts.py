"""What a test does when a part it needs (the control plane, the engine venv) is absent."""

from __future__ import annotations

import os
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
