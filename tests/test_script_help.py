"""The two commands a newcomer runs first answer --help with their whole usage and start nothing."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("script", "options"),
    [
        ("scripts/test.sh", ["--tier unit", "--tier control-plane", "--setup-only"]),
        ("scripts/demo.sh", ["--objects-only", "--keep"]),
    ],
)
def test_help_prints_the_whole_usage_and_builds_nothing(tmp_path: Path, script: str, options: list[str]) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "FLASHMODEL_CACHE": str(cache)}
    # Its own process group, stopped with SIGTERM on a timeout: a --help that started a run is stopped by
    # its own clean-up (scripts/test.sh's EXIT trap ends the set-up it started in a session of its own).
    proc = subprocess.Popen(["bash", str(ROOT / script), "--help"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=15)  # a usage text takes milliseconds
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        pytest.fail(f"{script} --help was still running after 15 s: it started a run instead of printing its usage")
    assert proc.returncode == 0, stderr
    assert stderr == "", f"--help logged a step, so it started something: {stderr[:500]}"
    assert not cache.exists(), f"--help made {sorted(p.name for p in cache.iterdir())} in the cache"
    for option in options:
        assert f"bash {script} {option}" in stdout, (option, stdout)
    # The comment block whole: its last sentence ends, and no line of the script's code came with it.
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines[-1].rstrip().endswith("."), lines[-1]
    assert not any(line.startswith(("set -", "ROOT=")) for line in lines), lines[-3:]
