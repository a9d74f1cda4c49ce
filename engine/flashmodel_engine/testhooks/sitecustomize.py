"""Test hook: makes vLLM's API-server process really hold memory, on demand, for divergence tests.

Loaded only when FLASHMODEL_TEST_MEMORY_HOG_FILE is set: the launcher then puts this folder on
vLLM's PYTHONPATH, so Python imports this `sitecustomize` at start-up. A daemon thread watches
the file; write a number of MiB into it and the process allocates (and touches) that much;
write 0 (or delete the file) and it lets go. Only vLLM's API-server process (started as
`python -m vllm.entrypoints...`) does this, not its engine-core and worker children, so exactly
one process of the engine's tree grows. Never set in production.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

_PATH = os.environ.get("FLASHMODEL_TEST_MEMORY_HOG_FILE", "")
_held: list[bytes] = []


def _wanted_mib() -> int:
    try:
        with open(_PATH) as f:
            return max(0, int(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0


def _is_api_server() -> bool:
    # vLLM's children are spawned interpreters (`python -c ...`) that inherit our environment.
    argv = sys.orig_argv
    return any(a == "-m" and b.startswith("vllm.entrypoints") for a, b in itertools.pairwise(argv))


CHUNK_MIB = 64  # above glibc's largest mmap threshold, so freed chunks go back to the OS


def _watch() -> None:
    if not _is_api_server():
        return
    current = 0
    while True:
        want = _wanted_mib()
        if want != current:
            _held.clear()
            # bytes * n fills every page, so the resident set really grows (calloc'd zero pages would not).
            for start in range(0, want, CHUNK_MIB):
                _held.append(b"\x01" * (min(CHUNK_MIB, want - start) << 20))
            current = want
            sys.stderr.write(f"flashmodel-test-hook: event=memory-hog pid={os.getpid()} held_mib={current}\n")
            sys.stderr.flush()
        time.sleep(0.2)


if _PATH:
    threading.Thread(target=_watch, name="flashmodel-memory-hog", daemon=True).start()
