"""EngineProcess.wait when vLLM's main process dies and leaves children holding the output pipe."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from flashmodel_engine.config import EngineConfig
from flashmodel_engine.engine_process import EngineProcess

from tests.engine.conftest import engine_config

# Stands in for vLLM: a child that inherits stdout and lives on (like its engine core), then the
# main process dies by a signal (like an API server killed on a CUDA error).
ORPHANING_ENGINE = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print("child", child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


async def test_wait_returns_when_the_main_process_dies_and_ends_its_orphans() -> None:
    config = EngineConfig.model_validate(engine_config(Path("/nonexistent-model")))
    engine = EngineProcess(config)
    engine.argv = [sys.executable, "-c", ORPHANING_ENGINE]
    await engine.start()
    start = time.monotonic()
    rc = await asyncio.wait_for(engine.wait(), 30)
    took = time.monotonic() - start
    assert rc == -9
    assert took < 15, f"wait() took {took:.1f}s: it waited for the orphan to close the pipe"
    child = int(next(line for line in engine.output_tail if line.startswith("child")).split()[1])
    await asyncio.sleep(0.2)
    alive = os.path.exists(f"/proc/{child}") and "zombie" not in Path(f"/proc/{child}/status").read_text().lower()
    assert not alive, "the orphaned child (an engine core without its server) must not keep running"
