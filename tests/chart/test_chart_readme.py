"""The chart's README is generated from values.yaml (scripts/chart_readme.py) and kept up to date."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_chart_readme_is_what_values_yaml_documents() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "chart_readme.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


def test_every_top_level_value_has_a_row() -> None:
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "flashmodel-operator" / "values.yaml").read_text())
    readme = (ROOT / "charts" / "flashmodel-operator" / "README.md").read_text()
    assert [k for k in values if f"| `{k}` |" not in readme] == []
