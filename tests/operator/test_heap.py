"""The operator's heap trim: glibc's malloc_trim where the C library has it, and the allocator the entry point picks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from flashmodel_operator import heap

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_returns_freed_pages_under_glibcs_allocator() -> None:
    # A child under PYTHONMALLOC=malloc (as the operator runs): 200 MiB of small objects made and
    # freed but for every 64th, which pins glibc's pages the way a fleet's long-lived objects do.
    code = """
import gc
from flashmodel_operator import heap
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024
items = [bytearray(200) for _ in range(1_000_000)]
kept = items[::64]
del items
gc.collect()
before = rss()
released = heap.trim()
print(before, rss(), released, len(kept))
"""
    env = {**os.environ, "PYTHONMALLOC": "malloc", "PYTHONPATH": str(ROOT / "operator")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    before, after, released, _ = out.stdout.split()
    assert heap.can_trim()
    assert released == "True"
    assert int(after) < int(before) - 100, out.stdout


class Exec(Exception):
    """os.execv, stopped where it would replace the process."""


def test_the_entry_point_runs_the_operator_on_glibcs_allocator_unless_told_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from flashmodel_operator import __main__ as entry

    calls: list[list[str]] = []

    def execv(path: str, argv: list[str]) -> None:
        calls.append([path, *argv])
        raise Exec

    monkeypatch.setattr(os, "execv", execv)
    monkeypatch.setattr(sys, "argv", ["flashmodel_operator", "--all-namespaces"])
    monkeypatch.delenv("PYTHONMALLOC", raising=False)
    with pytest.raises(Exec):
        entry.main()
    assert os.environ["PYTHONMALLOC"] == "malloc"
    assert calls == [[sys.executable, sys.executable, "-m", "flashmodel_operator", "--all-namespaces"]]

    # Chosen by whoever starts it: no re-exec, kopf's CLI runs (and stops at a bad option).
    monkeypatch.setenv("PYTHONMALLOC", "pymalloc")
    monkeypatch.setattr(sys, "argv", ["flashmodel_operator", "--no-such-option"])
    with pytest.raises(SystemExit):
        entry.main()
    assert len(calls) == 1


def test_a_full_collection_frees_old_cycles_after_churn_and_not_again_while_nothing_is_promoted() -> None:
    # In a child: the thresholds are the process's. Cycles that lived long enough to reach the old
    # generation, then were dropped: the young collections alone never free them.
    code = """
import gc, weakref
from flashmodel_operator import heap
heap.tune_collector()
assert gc.get_threshold() == heap.COLLECTOR_THRESHOLDS, gc.get_threshold()
class Node:
    pass
def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a
gc.collect()
print(heap.collect_after_churn())
held = [cycle() for _ in range(1000)]
refs = [weakref.ref(n) for n in held]
gc.collect(1)  # what a busy period does: the survivors of a middle-generation collection go old
del held
gc.collect(1)
print(sum(r() is not None for r in refs))
print(heap.collect_after_churn(), sum(r() is not None for r in refs))
print(heap.collect_after_churn())
"""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "operator")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:4] == ["False", "1000", "True 0", "False"], out.stdout
