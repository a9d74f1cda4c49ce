import gc, os, threading, time, json
_out = os.environ.get("FM_GCSTATS")
if _out:
    _t = {}
    _acc = {0: [0, 0.0, 0, 0.0], 1: [0, 0.0, 0, 0.0], 2: [0, 0.0, 0, 0.0]}
    def _cb(phase, info):
        g = info["generation"]
        if phase == "start":
            _t["c"] = time.thread_time()
            _t["w"] = time.perf_counter()
        else:
            a = _acc[g]; a[0] += 1; a[1] += time.perf_counter() - _t["w"]; a[2] += info.get("collected", 0); a[3] += time.thread_time() - _t["c"]
    gc.callbacks.append(_cb)
    def _dump():
        while True:
            time.sleep(5)
            with open(_out, "a") as f:
                f.write(json.dumps({"t": time.time(), "gc": {g: list(v) for g, v in _acc.items()}, "count": gc.get_count()}) + "\n")
    threading.Thread(target=_dump, daemon=True).start()
if os.environ.get("FM_GCTHRESH"):
    gc.set_threshold(*[int(x) for x in os.environ["FM_GCTHRESH"].split(",")])
