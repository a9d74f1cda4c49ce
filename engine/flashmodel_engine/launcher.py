"""The pod's main: preflight, then the shim and the vLLM process, prewarm, drain on SIGTERM, exit code."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from flashmodel_engine.config import EngineConfig
from flashmodel_engine.contract import PREFLIGHT_EXIT_CODE
from flashmodel_engine.engine_process import EngineProcess, exit_code, install_signal_handlers
from flashmodel_engine.engine_version import check_installed_vllm

log = logging.getLogger("flashmodel.launcher")

TERMINATION_LOG_ENV = "FLASHMODEL_TERMINATION_LOG"
"""Where the termination message goes instead of the kubelet's default path (tests and benchmarks)."""


def write_termination_message(message: str, path: str | None = None) -> None:
    """Kubernetes shows this file's content as the container's termination reason."""
    target = Path(path or os.environ.get(TERMINATION_LOG_ENV, "/dev/termination-log"))
    try:
        with target.open("w") as f:
            f.write(message[-4000:])  # the kubelet keeps at most 4096 bytes
    except OSError:
        pass  # not in a pod (or not writable): the log line carries the same text


def process_start_time() -> float:
    """This process's start as a time.time() value (so start-up timing includes interpreter start)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time()


async def launch(config: EngineConfig, *, prewarm_on_start: bool = True) -> int:
    """The pod's main: preflight, shim up, vLLM up, prewarm, supervise; returns the exit status."""
    from flashmodel_engine.preflight import format_report, run_preflight
    from flashmodel_engine.shim import EngineShim

    began = process_start_time()
    if (refusal := check_installed_vllm()) is not None:
        write_termination_message(refusal)
        return PREFLIGHT_EXIT_CODE
    report = await asyncio.to_thread(run_preflight, config)
    for line in format_report(report):
        log.info(line)
    if not report.ok:
        write_termination_message("preflight failed: " + " | ".join(report.failures))
        return PREFLIGHT_EXIT_CODE

    # The checkpoint's quantization as the preflight read it: model.quantization auto becomes an
    # explicit --quantization, so vLLM cannot choose a method the preflight did not check.
    engine = EngineProcess(config, checkpoint_method=report.quantization)
    shim = EngineShim(config, engine)
    await shim.start()
    stop_requested = asyncio.Event()
    install_signal_handlers(asyncio.get_running_loop(), engine, stop_requested.set)
    shim.metrics.startup_seconds.labels(phase="launcher").set(time.time() - began)
    await engine.start()
    engine_exit = asyncio.create_task(engine.wait())
    stop = asyncio.create_task(stop_requested.wait())
    prewarm_task: asyncio.Task[None] | None = None
    try:
        startup = asyncio.create_task(shim.wait_started())
        await asyncio.wait({engine_exit, stop, startup}, return_when=asyncio.FIRST_COMPLETED)
        if startup.done() and not startup.result() and engine.alive() and not stop.done():
            timeout = config.health.startup_timeout_seconds
            msg = f"vLLM did not answer /health within startupTimeoutSeconds={timeout}; raise it or check the log"
            log.error("event=startup-timeout timeout_s=%s", timeout)
            write_termination_message(msg)
            await engine.stop(10)
            return 3
        if startup.done() and startup.result() and prewarm_on_start and config.prewarm.enabled:
            prewarm_task = asyncio.create_task(_prewarm_on_start(shim))
        await asyncio.wait({engine_exit, stop}, return_when=asyncio.FIRST_COMPLETED)
        if stop.done() and engine.alive():
            shim.draining = True
            grace = config.server.drain_timeout_seconds
            log.info("event=drain-start pid=%s drain_timeout_s=%s", engine.pid, grace)
            # vLLM drains itself (--shutdown-timeout); the margin covers its own teardown.
            rc = await engine.stop(grace + 15)
            log.info("event=drain-done rc=%d", rc)
            return exit_code(rc)
        rc = await engine_exit
        tail = " / ".join(list(engine.output_tail)[-5:])
        log.error("event=engine-exited rc=%d", rc)
        write_termination_message(f"vLLM exited with code {rc}: {tail}")
        return exit_code(rc)
    finally:
        for task in (startup, stop, prewarm_task):
            if task is not None:
                task.cancel()
        await shim.stop()


async def _prewarm_on_start(shim: Any) -> None:
    # With LoRA the gate opens once the operator's set is loaded and prewarmed with the base model.
    await shim.await_adapters()
    result = await shim.prewarm()
    shim.metrics.startup_seconds.labels(phase="prewarm").set(result.duration_seconds)
