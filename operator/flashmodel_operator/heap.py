"""The operator's heap: freed memory handed back to the system, so RSS follows what the fleet needs.

A fleet created at once (1,000 models in a minute) makes the operator parse and hold many watch
events together; when they are done, Python's own small-object allocator keeps the 1 MiB arenas
that any survivor still pins, and glibc keeps freed pages inside its heaps. So the operator runs
on glibc's allocator (`PYTHONMALLOC=malloc`, set by `python -m flashmodel_operator`) and asks glibc
now and then to return its free pages (`malloc_trim`): at 1,000 models created at once, RSS fell
from 688 to 468 MiB with one trim, where the default allocator stayed at 525-535 MiB.

Python's cyclic collector is set for a large heap (`COLLECTOR_THRESHOLDS`), and the periodic trim
first frees the cycles a busy period left in the old generation (`collect_after_churn`).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
from collections.abc import Callable

COLLECTOR_THRESHOLDS = (10_000, 20, 10)
"""Python's cyclic collector: a young collection after 10,000 net new objects instead of 700, a
middle one after 20 young ones instead of 10.

With the defaults a busy operator promotes the objects of the passes in flight (a parsed API
answer lives for its request's milliseconds) to the old generation, and so runs a full
collection, which walks the whole heap of a large fleet, every few seconds: at 1,000 models, 39
full collections of about 0.6 s while the fleet was made and a burst of 300 came, 26-28 s of CPU
in the collector in all. With these thresholds, 6-7 full collections and 9.4-11.7 s (three runs).
With 50,000 the collector's CPU fell as far, but what died in cycles waited longer for a
collection and RSS reached 495-563 MiB, against 376-380 (docs/benchmarks/operator.md, "The collector, and a
first pass's creates at once").
"""


def tune_collector() -> None:
    gc.set_threshold(*COLLECTOR_THRESHOLDS)


def collect_after_churn() -> bool:
    """A full collection if a middle-generation collection ran since the last one; True when it ran.

    With `COLLECTOR_THRESHOLDS` the collector itself reaches the old generation less often, and the
    cycles of what a busy period held for a while end up there; this frees them at most one trim
    period after the churn that made them, and does nothing while nothing is promoted (an idle fleet).
    """
    if gc.get_count()[2] == 0:
        return False
    gc.collect()
    return True


def _glibc_trim() -> Callable[[], bool] | None:
    """glibc's `malloc_trim(0)`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: bool(trim(0))


_trim = _glibc_trim()


def trim() -> bool:
    """Return the heap's free pages to the system; True when glibc released some."""
    return _trim() if _trim is not None else False


def can_trim() -> bool:
    return _trim is not None


async def trim_periodically(period: float) -> None:
    """Every `period` seconds, on the event loop: a full collection after churn, then a trim where glibc has one.

    On the event loop: a trim holds glibc's heap locks while it walks them, and a collection holds
    the interpreter's lock in any thread.
    """
    while True:
        await asyncio.sleep(period)
        collect_after_churn()
        trim()
