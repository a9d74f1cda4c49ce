"""One version for everything that ships together, and the engine image's vLLM in one place.

The copies are where each tool reads its version (pyproject for the wheel, Chart.yaml for Helm, the
engine package for its logs, the engine image's tag in the CRD's default); this test is what keeps
them one.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _version() -> str:
    version: str = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def test_the_chart_the_engine_and_the_default_engine_image_carry_pyprojects_version() -> None:
    version = _version()
    chart = yaml.safe_load((ROOT / "charts" / "flashmodel-operator" / "Chart.yaml").read_text())
    engine_init = (ROOT / "engine" / "flashmodel_engine" / "__init__.py").read_text()
    engine_images = set(
        re.findall(r"ghcr\.io/flashmodel/engine:([\w.-]+)", (ROOT / "crds" / "flashmodel.yaml").read_text())
    )
    assert {
        "Chart.yaml version": chart["version"],
        "Chart.yaml appVersion": chart["appVersion"],
        "flashmodel_engine.__version__": re.search(r'__version__ = "(.+)"', engine_init)[1],  # type: ignore[index]
        "the CRD's engine image tags": ",".join(sorted(engine_images)) or version,
    } == dict.fromkeys(
        ["Chart.yaml version", "Chart.yaml appVersion", "flashmodel_engine.__version__", "the CRD's engine image tags"],
        version,
    )


def test_the_engine_image_builds_on_the_vllm_the_engine_was_made_for() -> None:
    image_vllm = re.search(
        r'^IMAGE_VLLM_VERSION = "(.+)"$',
        (ROOT / "engine" / "flashmodel_engine" / "engine_version.py").read_text(),
        re.MULTILINE,
    )
    dockerfile = re.search(r"^ARG VLLM_VERSION=(.+)$", (ROOT / "Dockerfile.engine").read_text(), re.MULTILINE)
    assert image_vllm and dockerfile and dockerfile[1] == image_vllm[1]
    assert "FROM vllm/vllm-openai:v${VLLM_VERSION}" in (ROOT / "Dockerfile.engine").read_text()


def test_build_images_tags_both_images_with_the_version_and_pins_the_engines_vllm() -> None:
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "scripts" / "build-images.sh"),
            "--dry-run",
            "--builder",
            "buildah",
            "--registry",
            "registry.example.com:5000/ml",
            "--push",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    version = _version()
    commands = [line for line in proc.stderr.splitlines() if not line.startswith("build-images:")]
    assert commands[0].startswith(
        "buildah bud -f Dockerfile.operator -t registry.example.com:5000/ml/operator:" + version
    )
    assert "--build-arg VLLM_VERSION=" in commands[2] and f"ml/engine:{version}" in commands[2]
    assert commands[1].strip() == f"buildah push registry.example.com:5000/ml/operator:{version}"
    assert commands[3].strip() == f"buildah push registry.example.com:5000/ml/engine:{version}"
