"""The vLLM process of one pod: its command line and environment, start, signals, wait, stop, exit code."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

from flashmodel_engine.compile_cache import cache_env, cache_key
from flashmodel_engine.config import EngineConfig
from flashmodel_engine.engine_guard import TOKEN_FILE_ENV
from flashmodel_engine.modelinfos import seed_modelinfos
from flashmodel_engine.profiles import vllm_args, vllm_env

# The launcher's component name: the pod log reads as one launcher, and log readers match on it.
log = logging.getLogger("flashmodel.launcher")

VLLM_MODULE = "vllm.entrypoints.openai.api_server"
HOOK_ENV = "FLASHMODEL_TEST_MEMORY_HOG_FILE"
LORA_RESOLVER_ENV = ("VLLM_LORA_RESOLVER_CACHE_DIR", "VLLM_LORA_RESOLVER_HF_REPO_LIST")
"""vLLM's LoRA resolver plugins: with runtime LoRA on, they load any adapter a request's model names."""
HOOK_DIR = Path(__file__).parent / "testhooks"
# Signals passed straight on to vLLM; SIGTERM and SIGINT go through the drain instead.
FORWARDED_SIGNALS = (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # If the launcher is killed hard, vLLM must not live on holding the GPU and the port.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def engine_command(config: EngineConfig, python: str = sys.executable, *,
                   checkpoint_method: str | None = None) -> list[str]:
    """The full argv that starts vLLM for this config (`checkpoint_method`: what the preflight read)."""
    return [python, "-m", VLLM_MODULE, *vllm_args(config, checkpoint_method)]


def engine_environment(
    config: EngineConfig, base: dict[str, str] | None = None, argv: list[str] | None = None
) -> dict[str, str]:
    """vLLM's environment: ours, the profile's variables, the API key, and the test hook if asked.

    With server.compileCacheDir (a claim the model's pods share) and the command line `argv`, the
    compile caches go to that claim's folder for this vLLM, torch, accelerator and command line.
    """
    env = dict(os.environ if base is None else base)
    env.update(vllm_env(config))
    if config.server.compile_cache_dir is not None and argv is not None:
        # The interpreter's path is the image's, not part of what was compiled.
        env.update(cache_env(config.server.compile_cache_dir, cache_key(config.accelerator, argv[1:])))
    # The control routes' guard (engine_guard.ControlRoutes) reads the shim's token from this file;
    # without one it refuses them all, whatever the launcher's own environment held.
    env.pop(TOKEN_FILE_ENV, None)
    if config.server.control_token_file is not None:
        env[TOKEN_FILE_ENV] = config.server.control_token_file
    for name in LORA_RESOLVER_ENV:
        # A resolver loads an adapter a request names from a folder or the hub, past the shim's checks.
        if env.pop(name, None) is not None:
            log.warning("event=env-dropped name=%s reason=adapters are loaded only through the shim", name)
    if config.auth is not None:
        # Through the environment, not --api-key: a flag shows in `ps` and in status.engineArgs.
        env["VLLM_API_KEY"] = Path(config.auth.api_key_file).read_text().strip()
    if env.get(HOOK_ENV):
        # The memory-hog hook loads through sitecustomize only when a test asks for it.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOK_DIR), env.get("PYTHONPATH")) if p)
    return env


class EngineProcess:
    """One vLLM process at a time: start, signal, wait; keeps the tail of its output."""

    def __init__(self, config: EngineConfig, *, python: str = sys.executable,
                 checkpoint_method: str | None = None) -> None:
        self.config = config
        self.argv = engine_command(config, python, checkpoint_method=checkpoint_method)
        self.generation = 0
        self.started_at: float | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self.output_tail: deque[str] = deque(maxlen=20)
        self.on_output: Callable[[str], None] | None = None
        """Called with each line vLLM prints (the shim reads its start-up phases from them)."""

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    async def start(self) -> None:
        """Spawn vLLM in its own session, so signals reach it only through us."""
        env = engine_environment(self.config, argv=self.argv)
        seed_modelinfos(env)  # spares vLLM re-deriving them in a subprocess (flashmodel_engine/modelinfos.py)
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
            limit=1 << 20,
        )
        self.generation += 1
        self.started_at = time.monotonic()
        self._pump = asyncio.create_task(self._copy_output())
        log.info("event=engine-spawned pid=%d generation=%d argv=%r", self._proc.pid, self.generation,
                 " ".join(self.argv[1:]))

    async def _copy_output(self) -> None:
        # vLLM's log goes to our stdout unchanged; the last lines feed the termination message.
        assert self._proc is not None and self._proc.stdout is not None
        out = sys.stdout.buffer
        while True:
            line = await self._proc.stdout.readline()
            if not line:
                return
            out.write(line)
            out.flush()
            text = line.decode(errors="replace").rstrip()
            self.output_tail.append(text)
            if self.on_output is not None:
                self.on_output(text)

    def send_signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)

    async def wait(self) -> int:
        assert self._proc is not None
        exited = asyncio.ensure_future(self._proc.wait())
        while not exited.done():
            await asyncio.wait({exited}, timeout=0.5)
            if not exited.done() and self._proc.returncode is not None:
                # vLLM's main process is gone but its engine core and workers still hold our pipe,
                # and asyncio's wait() returns only once the pipe closes (seen: the API server
                # SIGKILLed, the launcher waiting for ever, the pod never restarted). Without
                # their API server they cannot serve: end them so the pod can restart.
                log.warning("event=engine-orphans-killed pid=%s rc=%s", self._proc.pid, self._proc.returncode)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self._proc.pid, signal.SIGKILL)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(exited), 5)
                break
        rc = self._proc.returncode if self._proc.returncode is not None else await exited
        if self._pump is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._pump, 5)
        return rc

    async def stop(self, timeout: float) -> int:
        """SIGTERM (vLLM drains for --shutdown-timeout), then SIGKILL the session after `timeout`."""
        if self._proc is None:
            return 0
        self.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.wait(), timeout)
        except TimeoutError:
            log.warning("event=engine-kill pid=%s reason=drain-timeout timeout_s=%s", self.pid, timeout)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            return await self.wait()


def exit_code(returncode: int) -> int:
    """A shell-style exit status: a process killed by signal N exits 128+N."""
    return 128 - returncode if returncode < 0 else returncode


def install_signal_handlers(loop: asyncio.AbstractEventLoop, engine: EngineProcess,
                            on_terminate: Callable[[], None]) -> None:
    """SIGTERM/SIGINT start the drain; the rest go to vLLM as they are."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_terminate)
    for sig in FORWARDED_SIGNALS:
        loop.add_signal_handler(sig, engine.send_signal, sig)
