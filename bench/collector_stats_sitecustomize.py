"""The collector's counts in the operator's process, as the runs here recorded them (laid out for the linter).

Put on the operator's PYTHONPATH as `sitecustomize.py`; FM_GCSTATS names the file it appends to every 5 s
(per generation: collections, wall s, objects collected, CPU s); FM_GCTHRESH sets the thresholds.
"""

import gc
import json
import os
import threading
import time

_out = os.environ.get("FM_GCSTATS")
if _out:
    _started: dict[str, float] = {}
    _totals = {0: [0, 0.0, 0, 0.0], 1: [0, 0.0, 0, 0.0], 2: [0, 0.0, 0, 0.0]}

    def _callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            _started["cpu"] = time.thread_time()
            _started["wall"] = time.perf_counter()
            return
        total = _totals[info["generation"]]
        total[0] += 1
        total[1] += time.perf_counter() - _started["wall"]
        total[2] += info.get("collected", 0)
        total[3] += time.thread_time() - _started["cpu"]

    gc.callbacks.append(_callback)

    def _dump(path: str) -> None:
        while True:
            time.sleep(5)
            line = {"t": time.time(), "gc": {g: list(v) for g, v in _totals.items()}, "count": gc.get_count()}
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")

    threading.Thread(target=_dump, args=(_out,), daemon=True).start()
if os.environ.get("FM_GCTHRESH"):
    gc.set_threshold(*[int(x) for x in os.environ["FM_GCTHRESH"].split(",")])
