"""An engine venv left half-made by an interrupted set-up is not taken for a complete one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.parts import engine_venv_problem


def test_a_venv_an_interrupted_set_up_left_is_reported_with_what_to_run(tmp_path: Path) -> None:
    # What scripts/setup-engine.sh has made when it is stopped before pip installed anything.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    problem = engine_venv_problem(str(tmp_path / "venv" / "bin" / "python"))
    assert problem is not None and "cannot import vLLM" in problem and "run scripts/setup-engine.sh" in problem


def test_no_venv_at_all_is_reported(tmp_path: Path) -> None:
    problem = engine_venv_problem(str(tmp_path / "venv" / "bin" / "python"))
    assert problem == f"no engine venv at {tmp_path / 'venv'}: run scripts/setup-engine.sh"
