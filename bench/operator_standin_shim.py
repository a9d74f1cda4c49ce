"""A stand-in for every engine pod's health shim at once, for the operator's fleet benchmark.

    python bench/operator_standin_shim.py --control-port 18099 [--no-held-polls]

One process answers the shim's endpoints (SHIM_PORT) on every address of 127.0.0.0/8, which is where
the test control plane's kwok puts pod IPs, so the operator polls "pod 127.16.3.7" over real HTTP and
this process knows which pod it is from the address the connection arrived on. Its /metrics page is
the size of a real one: the flashmodel_* series the engine exports after vLLM's own (histograms per
model), so the operator pays the parse cost it pays in production when it reads that page. It also
answers /health/poll (the operator's one-request poll) from the same state. A steady pod's poll is
held until its pod's fault changes (`?wait=&unless=`), answered at the engine's next recheck; with
--no-held-polls it answers at once without a `state`, and the operator polls every monitorSeconds.

A control port (loopback only) injects faults per pod IP and reports counts:
    POST /fault?ip=127.16.0.9&kind=hung        /readyz answers 503 (/health/poll "ready": false) while /livez
                                               answers 200
    POST /fault?ip=127.16.0.9&kind=diverge     flashmodel_remediation_recommended{reason=memory_divergence} 1
                                               (/health/poll "divergenceRecommended": true)
    POST /fault?ip=127.16.0.9&kind=none        healthy again
    GET  /counts                               requests served, by path
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "engine")]

from flashmodel_engine.contract import (  # noqa: E402
    ENGINE_GENERATION,
    HEALTH_POLL_PATH,
    LIVENESS_PATH,
    MEMORY_DIVERGENCE_RATIO,
    METRICS_PATH,
    PREWARM_PATH,
    PREWARM_SUCCEEDED,
    READINESS_PATH,
    REMEDIATION_RECOMMENDED,
    SHIM_PORT,
    STARTUP_PATH,
    health_poll_state,
    parse_health_poll_wait,
)
from flashmodel_engine.shim import HEALTH_POLL_RECHECK_SECONDS  # noqa: E402

# vLLM's histograms (v0.x/v1 names) with their bucket counts: most of a real page's bytes.
_VLLM_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": 18,
    "vllm:time_per_output_token_seconds": 15,
    "vllm:e2e_request_latency_seconds": 20,
    "vllm:request_queue_time_seconds": 20,
    "vllm:request_inference_time_seconds": 20,
    "vllm:request_prefill_time_seconds": 20,
    "vllm:request_decode_time_seconds": 20,
    "vllm:request_prompt_tokens": 12,
    "vllm:request_generation_tokens": 12,
    "vllm:iteration_tokens_total": 12,
    "vllm:request_max_num_generation_tokens": 12,
    "vllm:request_params_max_tokens": 12,
    "vllm:request_params_n": 6,
}


def vllm_page(model: str) -> str:
    """A page shaped like vLLM's /metrics for one model: gauges, counters and the histograms above."""
    r = CollectorRegistry()
    labels = {"model_name": model, "engine": "0"}
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions",
    ):
        Gauge(name, name, list(labels), registry=r).labels(**labels).set(0)
    for name in (
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:request_success",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
    ):
        PromCounter(name, name, list(labels), registry=r).labels(**labels).inc(1234)
    for name, n in _VLLM_HISTOGRAMS.items():
        buckets = [0.001 * 2**i for i in range(n)]
        h = Histogram(name, name, list(labels), buckets=buckets, registry=r)
        for v in (0.01, 0.1, 1.0):
            h.labels(**labels).observe(v)
    return generate_latest(r).decode()


class Fleet:
    def __init__(self) -> None:
        self.faults: dict[str, str] = {}
        self.generation: dict[str, int] = {}
        self.counts: Counter[str] = Counter()
        self._changed: dict[str, asyncio.Event] = {}
        self.vllm = vllm_page("Qwen/Qwen2.5-0.5B-Instruct")

    def ours(self, ip: str) -> str:
        r = CollectorRegistry()
        Gauge(ENGINE_GENERATION, "engine starts", registry=r).set(self.generation.setdefault(ip, 1))
        Gauge(PREWARM_SUCCEEDED, "prewarm", registry=r).set(1)
        diverging = self.faults.get(ip) == "diverge"
        Gauge(MEMORY_DIVERGENCE_RATIO, "divergence", registry=r).set(0.2 if diverging else 0.0)
        Gauge(REMEDIATION_RECOMMENDED, "remediation", ["reason"], registry=r).labels(reason="memory_divergence").set(
            1 if diverging else 0
        )
        return generate_latest(r).decode()

    def answer(self, ip: str, with_state: bool = True) -> dict[str, object]:
        """The engine's health poll answer (flashmodel_engine.shim.health_poll_answer), from what /metrics shows."""
        hung, diverging = self.faults.get(ip) == "hung", self.faults.get(ip) == "diverge"
        generation = self.generation.setdefault(ip, 1)
        answer: dict[str, object] = {
            "ready": not hung,
            "reason": "one-token generation timed out" if hung else "one-token generation answered in 9 ms",
            "generation": generation,
            "prewarmSucceeded": True,
            "divergenceRatio": 0.2 if diverging else 0.0,
            "divergenceRecommended": diverging,
            "requestsRunning": 0.0,
            "requestsWaiting": 0.0,
        }
        if with_state:
            answer["state"] = health_poll_state(not hung, generation, True, diverging)
        return answer

    def changed(self, ip: str) -> asyncio.Event:
        """Set when the pod's fault changes: what its held polls wait on."""
        return self._changed.setdefault(ip, asyncio.Event())

    def set_fault(self, ip: str, kind: str) -> None:
        if kind == "none":
            self.faults.pop(ip, None)
        else:
            self.faults[ip] = kind
        self._changed.pop(ip, asyncio.Event()).set()


def pod_ip(request: web.Request) -> str:
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    return str(sock[0]) if sock else "?"


def shim_app(fleet: Fleet, held_polls: bool = True) -> web.Application:
    def ok(body: dict[str, object], status: int = 200) -> web.Response:
        return web.json_response(body, status=status)

    async def startupz(request: web.Request) -> web.Response:
        fleet.counts["startupz"] += 1
        return ok({"ok": True})

    async def livez(request: web.Request) -> web.Response:
        fleet.counts["livez"] += 1
        return ok({"ok": True})

    async def readyz(request: web.Request) -> web.Response:
        fleet.counts["readyz"] += 1
        if fleet.faults.get(pod_ip(request)) == "hung":
            return ok({"ok": False, "reason": "one-token generation timed out"}, 503)
        return ok({"ok": True})

    async def poll(request: web.Request) -> web.Response:
        fleet.counts["health/poll"] += 1
        if not held_polls:
            return ok(fleet.answer(pod_ip(request), with_state=False))
        try:
            wait, unless = parse_health_poll_wait(request.query)
        except ValueError as e:
            return ok({"ok": False, "reason": str(e)}, 400)
        ip = pod_ip(request)
        answer = fleet.answer(ip)
        if answer["state"] == unless and wait > 0:
            fleet.counts["health/poll held"] += 1
            start = time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fleet.changed(ip).wait(), wait)
            # The engine's shim looks again every HEALTH_POLL_RECHECK_SECONDS while it holds a poll, so
            # a change is answered at its next look, not at once: the same delay here, without 1,000
            # wake-ups a second on the benchmark's shared cores.
            looked = time.monotonic() - start
            if looked < wait:
                tick = HEALTH_POLL_RECHECK_SECONDS
                await asyncio.sleep(min(wait, math.ceil(looked / tick) * tick) - looked)
            answer = fleet.answer(ip)
        return ok(answer)

    async def prewarm(request: web.Request) -> web.Response:
        fleet.counts["prewarm"] += 1
        await request.read()
        return ok({"ok": True, "requests": 5, "coldTTFTMs": 120.0, "warmTTFTMs": 30.0})

    async def metrics(request: web.Request) -> web.Response:
        fleet.counts["metrics"] += 1
        text = fleet.vllm + fleet.ours(pod_ip(request))
        return web.Response(text=text, content_type="text/plain")

    app = web.Application()
    app.add_routes(
        [
            web.get(STARTUP_PATH, startupz),
            web.get(LIVENESS_PATH, livez),
            web.get(READINESS_PATH, readyz),
            web.post(PREWARM_PATH, prewarm),
            web.get(METRICS_PATH, metrics),
            web.get(HEALTH_POLL_PATH, poll),
        ]
    )
    return app


def control_app(fleet: Fleet) -> web.Application:
    async def fault(request: web.Request) -> web.Response:
        ip, kind = request.query["ip"], request.query["kind"]
        fleet.set_fault(ip, kind)
        return web.json_response({"ip": ip, "kind": kind})

    async def counts(request: web.Request) -> web.Response:
        return web.json_response(dict(fleet.counts))

    app = web.Application()
    app.add_routes([web.post("/fault", fault), web.get("/counts", counts)])
    return app


async def serve(control_port: int, held_polls: bool) -> None:
    fleet = Fleet()
    runners = []
    shim = shim_app(fleet, held_polls)
    sites = ((shim, "0.0.0.0", SHIM_PORT), (control_app(fleet), "127.0.0.1", control_port))
    for app, host, port in sites:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, host, port, backlog=1024).start()
        runners.append(runner)
    print(
        json.dumps(
            {
                "shim_port": SHIM_PORT,
                "control_port": control_port,
                "metrics_bytes": len(fleet.vllm + fleet.ours("127.0.0.1")),
                "held_polls": held_polls,
            }
        ),
        flush=True,
    )
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument(
        "--no-held-polls",
        action="store_true",
        help="answer /health/poll at once and without a state: the operator polls every monitorSeconds",
    )
    args = parser.parse_args()
    asyncio.run(serve(args.control_port, held_polls=not args.no_held_polls))


if __name__ == "__main__":
    main()
