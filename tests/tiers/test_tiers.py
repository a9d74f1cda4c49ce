"""The tiers conftest.py derives: every test in exactly one, each where its fixtures put it, and --tier selects it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# One test of each tier, chosen for the fixture that puts it there.
KNOWN = {
    "tests/operator/test_render.py": "unit",  # no fixture of either part
    "e2e/test_cluster.py": "control-plane",  # control_plane, through testbin
    "tests/engine/test_engine_vllm.py": "engine",  # engine_packages
    "tests/kernels/test_paged_attention.py": "engine",  # the folder's autouse fixture
    "e2e/test_self_healing.py": "e2e",  # control_plane and engine_python
}


def tiers(python: str, *args: str) -> dict[str, str]:
    """node id -> tier, as `pytest --collect-only` in this checkout sees them."""
    proc = subprocess.run(
        [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "tests.support.tier_report", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("TIER "):
            _, tier, nodeid = line.split(" ", 2)
            found[nodeid] = tier
    return found


def test_each_test_has_one_tier_and_the_fixtures_decide_which(engine_python: str) -> None:
    # The engine venv's Python, where every test module can be imported (so this test is engine tier).
    everything = tiers(engine_python, *KNOWN)
    by_file = {path: {t for nodeid, t in everything.items() if nodeid.startswith(path + "::")} for path in KNOWN}
    assert by_file == {path: {tier} for path, tier in KNOWN.items()}, by_file
    unit = tiers(engine_python, "--tier", "unit", *KNOWN)
    assert set(unit) == {n for n, t in everything.items() if t == "unit"}, Counter(everything.values())


def _run_without_the_control_plane(require_all: bool) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "FLASHMODEL_REQUIRE_ALL"}
    env["FLASHMODEL_SKIP_E2E"] = "1"
    if require_all:
        env["FLASHMODEL_REQUIRE_ALL"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rs", "e2e/test_cluster.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_a_missing_control_plane_skips_alone_and_fails_the_full_run() -> None:
    # What a developer without the testbin sees: skips that say what to run.
    alone = _run_without_the_control_plane(require_all=False)
    assert alone.returncode == 0 and " skipped" in alone.stdout, alone.stdout[-3000:]
    assert "FLASHMODEL_SKIP_E2E=1" in alone.stdout, alone.stdout[-3000:]
    # What CI's full run (FLASHMODEL_REQUIRE_ALL=1) sees: a failure, never a green skip.
    full = _run_without_the_control_plane(require_all=True)
    assert full.returncode == 1, full.stdout[-3000:]
    assert "FLASHMODEL_REQUIRE_ALL=1 and FLASHMODEL_SKIP_E2E=1" in full.stdout, full.stdout[-3000:]
