"""The operator's timings come from its environment once, and a bad value stops it with what to do."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from flashmodel_operator.settings import OperatorSettings


def test_each_setting_is_read_from_its_variable_and_the_rest_keep_their_defaults() -> None:
    s = OperatorSettings.from_environ({"FLASHMODEL_MONITOR_SECONDS": "0.5", "FLASHMODEL_METRICS_PORT": "0"})
    assert (s.monitor_seconds, s.metrics_port) == (0.5, 0)
    assert s.remediation_backoff_seconds == OperatorSettings().remediation_backoff_seconds == 60.0


@pytest.mark.parametrize(("raw", "says"), [("soon", "is not a number"), ("-1", "is negative")])
def test_a_bad_value_names_the_variable_and_the_default(raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=f"FLASHMODEL_REMEDIATION_BACKOFF_SECONDS='{raw}' {says}.*60.0"):
        OperatorSettings.from_environ({"FLASHMODEL_REMEDIATION_BACKOFF_SECONDS": raw})


def test_the_operator_refuses_to_start_on_a_bad_value() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "flashmodel_operator", "--help"],
        env={**os.environ, "FLASHMODEL_METRICS_PORT": "http", "PYTHONPATH": os.pathsep.join(sys.path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "FLASHMODEL_METRICS_PORT='http' is not an integer" in run.stderr, run
