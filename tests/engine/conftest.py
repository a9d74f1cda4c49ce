"""Fixtures for engine tests: the tiny model and real engines started through the launcher."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.kubelet import EngineTree
from tests.support.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = float(os.environ.get("FLASHMODEL_TEST_STARTUP_TIMEOUT", "420"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def tiny_model(engine_packages: None) -> Path:
    """The tiny Qwen2 checkpoint; building it takes torch and transformers, so its tests are engine tier."""
    return build_tiny_model()


@pytest.fixture(scope="session")
def baked_modelinfos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What the image's build step bakes: vLLM's inspection of the tiny model's class, run once."""
    into = tmp_path_factory.mktemp("baked") / "modelinfos"
    subprocess.run([sys.executable, "-m", "flashmodel_engine", "bake-modelinfos", "--into", str(into),
                    "Qwen2ForCausalLM"], check=True, capture_output=True, timeout=300,
                   env=os.environ | {"PYTHONPATH": str(REPO / "engine")})
    return into


class Reply:
    """An HTTP answer: status and parsed JSON (or text)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status = status
        self.text = body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.text)


def http(method: str, url: str, body: bytes | None = None, headers: dict[str, str] | None = None,
         timeout: float = 30) -> Reply:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(resp.status, resp.read())
    except urllib.error.HTTPError as e:
        return Reply(e.code, e.read())


def metric(text: str, name: str, labels: str = "") -> float:
    """Sum of a metric's samples in Prometheus text (labels: a substring the label set must contain).

    NaN when absent, so every comparison with a missing metric fails.
    """
    total: float | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        base = head.split("{", 1)[0]
        if base == name and labels in head:
            total = (total or 0.0) + float(value)
    return math.nan if total is None else total


class LaunchedEngine:
    """`python -m flashmodel_engine launch` as a subprocess, the way the pod runs it."""

    def __init__(self, workdir: Path, config: dict[str, Any], extra_args: list[str] | None = None,
                 env_extra: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.config = config
        self.config_path = workdir / "engine.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "launch.log"
        self.hog_file = workdir / "memory-hog"
        self.termination_log = workdir / "termination-log"
        server = config["server"]
        self.shim = f"http://{server['host']}:{server['shimPort']}"
        self.engine = f"http://{server['host']}:{server['enginePort']}"
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(REPO / "engine"), str(REPO)]),
            FLASHMODEL_SAMPLE_INTERVAL_SECONDS="0.5",
            FLASHMODEL_TEST_MEMORY_HOG_FILE=str(self.hog_file),
            FLASHMODEL_TERMINATION_LOG=str(self.termination_log),
        )
        env.update(env_extra or {})
        self.log = self.log_path.open("wb")
        # As the e2e kubelet runs a pod's engine: stopping it ends vLLM's engine core and workers too.
        self.tree = EngineTree(
            [sys.executable, "-m", "flashmodel_engine", "launch", "--config", str(self.config_path),
             *(extra_args or [])], env, workdir.name, log_file=self.log_path, cwd=workdir)
        self.proc = self.tree.proc
        self.started_at = time.monotonic()

    def get(self, path: str, timeout: float = 30) -> Reply:
        return http("GET", self.shim + path, timeout=timeout)

    def post(self, path: str, body: bytes | None = None, timeout: float = 120) -> Reply:
        """POST to the shim as the operator does: with the control token when the config names one."""
        headers = {"Content-Type": "application/json"}
        token_file = self.config["server"].get("controlTokenFile")
        if token_file:
            headers["Authorization"] = "Bearer " + Path(token_file).read_text().strip()
        return http("POST", self.shim + path, body=body, timeout=timeout, headers=headers)

    def metrics(self) -> str:
        return self.get("/metrics").text

    def wait_started(self) -> float:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited {self.proc.returncode}: {self.tail()}")
            with contextlib.suppress(OSError):
                if self.get("/startupz", timeout=5).status == 200:
                    return time.monotonic() - self.started_at
            time.sleep(1)
        raise AssertionError(f"engine not started within {STARTUP_TIMEOUT}s: {self.tail()}")

    def vllm_pid(self) -> int:
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                        return int(d.name)
        raise AssertionError("no vLLM child of the launcher")

    def tail(self, lines: int = 40) -> str:
        self.log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        self.tree.stop(grace=60)
        self.log.close()


def engine_config(model: Path, **overrides: Any) -> dict[str, Any]:
    """A cpu-profile engine config on fresh ports; overrides replace whole top-level blocks."""
    config: dict[str, Any] = {
        "accelerator": "cpu",
        "model": {"path": str(model), "servedName": "tiny"},
        "engine": {"blockSize": 32, "maxModelLen": 4096, "maxNumSeqs": 64},
        "prewarm": {"requests": 5, "maxTokens": 8, "timeoutSeconds": 120},
        "health": {"readinessDeadlineSeconds": 5, "readinessCacheSeconds": 1, "startupTimeoutSeconds": 400},
        "remediation": {"divergenceRatio": 0.01, "divergenceWindowSeconds": 2, "hungReadinessSeconds": 3},
        "server": {"host": "127.0.0.1", "enginePort": free_port(), "shimPort": free_port(),
                   "drainTimeoutSeconds": 30},
    }
    config.update(overrides)
    return config


@contextlib.contextmanager
def launched(workdir: Path, config: dict[str, Any], extra_args: list[str] | None = None,
             env_extra: dict[str, str] | None = None) -> Iterator[LaunchedEngine]:
    engine = LaunchedEngine(workdir, config, extra_args, env_extra)
    try:
        engine.wait_started()
        yield engine
    finally:
        engine.close()
