"""The e2e kubelet keeps its engines when the API server cannot list its pods, as a real kubelet does."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, cast

import pytest

from e2e.harness.cluster import ControlPlane
from e2e.harness.kubelet import EngineKubelet, EnginePod, KubeletSyncError


class _UnreachableAPIServer:
    """Answers every kubectl call as kubectl does while the API server restarts."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        self.calls.append(args)
        return subprocess.CompletedProcess(
            ["kubectl", *args], 1, "", "The connection to the server 127.0.0.1:6443 was refused"
        )


class _RunningEngine:
    grace = 30.0


def test_a_failed_pod_list_fails_the_pass_and_kills_no_engine(tmp_path: Path) -> None:
    api = _UnreachableAPIServer()
    kubelet = EngineKubelet(cast(ControlPlane, api), "models", tmp_path)
    killed: list[Any] = []
    kubelet._kill = lambda engine_pod, grace: killed.append(engine_pod)  # type: ignore[method-assign]
    engine = cast(EnginePod, _RunningEngine())
    kubelet.pods["qwen-0"] = engine

    with pytest.raises(KubeletSyncError, match="cannot list pods in models"):
        kubelet.sync_once()

    assert killed == []
    assert kubelet.pods == {"qwen-0": engine}
