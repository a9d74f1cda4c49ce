"""Stopping an engine pod ends every process it started: vLLM's engine core and workers are GBs each."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from e2e.harness.kubelet import EngineTree, end_orphaned_engines
from tests.engine.conftest import REPO, STARTUP_TIMEOUT, engine_config, http


def alive(pid: int) -> bool:
    """Checked in /proc: the process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def command(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    return ""


@pytest.mark.slow
@pytest.mark.usefixtures("engine_packages")
def test_stopping_a_pod_past_its_grace_period_ends_vllms_engine_core_and_workers(
    tiny_model: Path, tmp_path: Path
) -> None:
    config = engine_config(tiny_model, prewarm={"enabled": False})
    (tmp_path / "engine.yaml").write_text(yaml.safe_dump(config))
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(REPO / "engine"), str(REPO)])}
    tree = EngineTree(
        [sys.executable, "-m", "flashmodel_engine", "launch", "--config", str(tmp_path / "engine.yaml")],
        env,
        "test/stop",
        log_file=tmp_path / "engine.log",
        cwd=tmp_path,
    )
    shim = f"http://127.0.0.1:{config['server']['shimPort']}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while http_status(shim + "/startupz") != 200:
            assert not tree.exited(), (tmp_path / "engine.log").read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "engine did not start"
            time.sleep(1)
        pids = tree.pids()
        # The real tree: the launcher, vLLM's API server in a session of its own, its engine core.
        assert tree.pid in pids
        assert any("vllm.entrypoints.openai.api_server" in command(p) for p in pids), [command(p) for p in pids]
        cores = [p for p in pids if "EngineCor" in Path(f"/proc/{p}/comm").read_text()]
        assert cores, [command(p) for p in pids]
        assert {os.getsid(p) for p in pids} != {os.getsid(tree.pid)}, "vLLM shares the launcher's session"

        # A grace period too short for vLLM's drain: the kill path, where the launcher dies first.
        tree.stop(grace=1)
        survivors = [f"{p} {command(p)}" for p in pids if alive(p)]
        assert not survivors, f"processes of a stopped engine pod still alive: {survivors}"
        assert not tree.pids()
    finally:
        tree.kill()


def http_status(url: str) -> int:
    with contextlib.suppress(OSError):
        return http("GET", url, timeout=5).status
    return 0


HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from e2e.harness.kubelet import EngineTree
    # Like vLLM: a child in a session of its own, which outlives its parent's process group.
    tree = EngineTree(["bash", "-c", "setsid sleep 300 & exec sleep 300"], {"PATH": "/usr/bin:/bin"},
                      "holder/pod", log_file=Path(sys.argv[1]), cwd=Path(sys.argv[2]))
    while len(tree.pids()) < 2:
        time.sleep(0.05)
    print(" ".join(map(str, tree.pids())), flush=True)
    if sys.argv[3] == "hang":
        time.sleep(300)
""")


def _holder(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "log"), str(tmp_path), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=os.environ | {"FLASHMODEL_CACHE": str(tmp_path / "cache")},
    )
    assert proc.stdout is not None
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) >= 2 and all(alive(p) for p in pids)
    return proc, pids


def test_a_harness_that_exits_without_its_teardown_ends_its_engines(tmp_path: Path) -> None:
    proc, pids = _holder(tmp_path, "exit")
    assert proc.wait(30) == 0
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if alive(p)]


def test_engines_of_a_killed_harness_are_ended_by_the_next_one(tmp_path: Path) -> None:
    proc, pids = _holder(tmp_path, "hang")
    proc.send_signal(signal.SIGKILL)  # no atexit, no teardown
    proc.wait(30)
    survivors = [p for p in pids if alive(p)]
    sessions = tmp_path / "cache" / "engine-sessions"
    try:
        assert survivors, "nothing outlived the killed harness: the test shows nothing"
        killed = end_orphaned_engines(sessions)
        assert set(survivors) <= set(killed)
        assert not [p for p in survivors if alive(p)]
        assert not list(sessions.glob("*.json")), "the record of ended engines stays behind"
    finally:
        for pid in survivors:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_stale_record_never_kills_a_process_that_reuses_a_recorded_pid(tmp_path: Path) -> None:
    # A record of a harness that died long ago: its pids may name other programs by now.
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        ticks = int(Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        sessions = tmp_path / "engine-sessions"
        sessions.mkdir()
        record = {"harness": "1.0", "pod": "gone/pod", "processes": [[bystander.pid, ticks + 1]]}
        (sessions / "1.0-1.json").write_text(json.dumps(record))
        assert end_orphaned_engines(sessions) == []
        assert alive(bystander.pid)
        assert not list(sessions.glob("*.json"))
    finally:
        bystander.kill()
        bystander.wait()
