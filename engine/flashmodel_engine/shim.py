"""The health shim: probes, /prewarm, /metrics, /health/poll and /adapters beside vLLM, owning the engine process."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from flashmodel_engine.adapters import (
    AdapterError,
    AdapterRegistry,
    BadAdapterSet,
    BaseShapes,
    parse_adapter_set,
)
from flashmodel_engine.config import EngineConfig
from flashmodel_engine.contract import (
    ADAPTERS_PATH,
    HEALTH_POLL_PATH,
    LIVENESS_PATH,
    METRICS_PATH,
    PREWARM_PATH,
    READINESS_PATH,
    STARTUP_PATH,
    health_poll_state,
    parse_health_poll_wait,
)
from flashmodel_engine.engine_guard import CONTROL_HEADER
from flashmodel_engine.engine_process import EngineProcess
from flashmodel_engine.metrics import EngineMetrics, EngineSample, MemoryReader, parse_vllm_metrics
from flashmodel_engine.prewarm import MAX_BATCH_REQUESTS, PrewarmResult, run_prewarm
from flashmodel_engine.profiles import resolve
from flashmodel_engine.startup_phases import StartupPhases

log = logging.getLogger("flashmodel.shim")

# Never an empty prompt: vLLM answers 400 and a probe built on that restarts healthy pods.
READINESS_PROMPT = "ready"
SAMPLE_INTERVAL_ENV = "FLASHMODEL_SAMPLE_INTERVAL_SECONDS"
PREWARM_BODY_KEYS = {"requests", "prompts"}
HEALTH_POLL_RECHECK_SECONDS = 1.0
"""How often a held health poll looks again: the divergence signal moves at each sample (2 s) and
readiness at each HEALTH_POLL_READINESS_SECONDS, so a change waits at most this long to be answered."""
HEALTH_POLL_MAX_HELD = 16
"""Held health polls at once; more are answered at once. The operator holds one per pod, but the shim's
port is also the Service's: nobody may make the shim wake thousands of held polls every second."""
HEALTH_POLL_READINESS_SECONDS = 5.0
"""While a poll is held, a readiness generation at most this often (the operator's default poll period):
holding the poll must not run more generations than polling did, even with readiness_cache_seconds 0."""


def connect_host(bind_host: str) -> str:
    """Where the shim reaches vLLM: a wildcard bind is reached through loopback."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(bind_host, bind_host)


def _reply(status: int, ok: bool, reason: str, **extra: Any) -> web.Response:
    return web.json_response({"ok": ok, "reason": reason, **extra}, status=status)


def health_poll_answer(ready: bool, reason: str, generation: int, prewarm_succeeded: bool,
                       metrics: EngineMetrics, sample: EngineSample | None,
                       startup: dict[str, float] | None = None) -> dict[str, Any]:
    """`GET /health/poll`'s JSON: /readyz's result and the values the operator reads from /metrics.

    The same sources as those two endpoints: `readiness()`, the divergence tracker behind
    flashmodel_memory_divergence_ratio and flashmodel_remediation_recommended{reason="memory_divergence"},
    and vLLM's running and waiting requests from the shim's last sample (every
    FLASHMODEL_SAMPLE_INTERVAL_SECONDS; /metrics reads them live, the drain still reads /metrics).
    The generation is the engine process's own count, which the flashmodel_engine_generation gauge
    copies at each sample. `startup`: the seconds of each start-up phase known so far (the shim's
    and vLLM's, as flashmodel_startup_seconds has them), for the pod's status.
    """
    recommended = metrics.divergence.recommended
    return {
        "ready": ready,
        "reason": reason,
        "generation": generation,
        "prewarmSucceeded": prewarm_succeeded,
        "divergenceRatio": metrics.divergence.ratio,
        "divergenceRecommended": recommended,
        "requestsRunning": sample.running if sample is not None else 0.0,
        "requestsWaiting": sample.waiting if sample is not None else 0.0,
        "state": health_poll_state(ready, generation, prewarm_succeeded, recommended),
        "startupSeconds": dict(startup or {}),
    }


class BadRequest(ValueError):
    """A request to the shim that cannot be served as sent; the message is the 4xx reason."""


def parse_prewarm_body(raw: bytes, default_requests: int) -> tuple[int, list[str] | None]:
    """`POST /prewarm`'s optional body: {"requests": N, "prompts": [...]}."""
    if not raw.strip():
        return default_requests, None
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"body is not JSON ({e}); send {{\"requests\": N, \"prompts\": [...]}} or nothing") from e
    if not isinstance(body, dict):
        raise BadRequest(f"body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - PREWARM_BODY_KEYS)
    if unknown:
        raise BadRequest(f"unknown keys {unknown}; allowed: requests, prompts")
    requests = body.get("requests", default_requests)
    if not isinstance(requests, int) or isinstance(requests, bool) or not 1 <= requests <= 100:
        raise BadRequest(f"requests must be an integer 1..100, got {requests!r}")
    prompts = body.get("prompts")
    if prompts is not None and (not isinstance(prompts, list) or
                                not all(isinstance(p, str) and p.strip() for p in prompts)):
        raise BadRequest("prompts must be a list of non-empty strings (an empty prompt is refused by vLLM)")
    return requests, prompts or None


ADAPTER_GENERATION_TOKENS = 4
"""max_tokens of the one generation that proves an adapter answers (at load and at prewarm)."""
ADAPTER_CALL_SECONDS = 120.0
"""vLLM's load and unload calls and an adapter's generation: a load reads the weights from the volume."""


def base_model_config(config: EngineConfig) -> dict[str, Any]:
    """The base model's config.json (text part): from its folder, or from the hub cache vLLM filled."""
    folder = Path(config.model.path)
    found: Path | None = folder / "config.json" if folder.is_dir() else None
    if found is None:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(config.model.path, "config.json", revision=config.model.revision)
        found = Path(cached) if isinstance(cached, str) else None
    if found is None:
        raise AdapterError(f"the base model's config.json is not at {config.model.path} nor in the hub cache; "
                           "adapters cannot be checked against it")
    try:
        data = json.loads(found.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"the base model's {found} cannot be read ({e})") from None
    text = data.get("text_config") if isinstance(data, dict) else None
    return {**data, **text} if isinstance(text, dict) else dict(data)


class VllmAdapters:
    """vLLM's runtime LoRA API (VLLM_ALLOW_RUNTIME_LORA_UPDATING) as the registry calls it."""

    def __init__(self, shim: EngineShim) -> None:
        self.shim = shim

    async def _post(self, path: str, body: dict[str, Any], *, control: bool = False) -> tuple[int, str]:
        s = self.shim
        headers = dict(s.headers)
        if control and s.control_token is not None:
            # vLLM's loading routes answer only this token (engine_guard): the port is the clients' too.
            headers[CONTROL_HEADER] = s.control_token
        try:
            async with s.session.post(s.base_url + path, json=body, headers=headers,
                                      timeout=aiohttp.ClientTimeout(total=ADAPTER_CALL_SECONDS)) as resp:
                return resp.status, await resp.text()
        except (TimeoutError, aiohttp.ClientError) as e:
            raise AdapterError(f"vLLM {path} did not answer ({type(e).__name__}: {e})") from None

    async def load(self, name: str, path: Path) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        status, text = await self._post("/v1/load_lora_adapter", body, control=True)
        if status == 400 and "already been loaded" in text:
            # vLLM still holds the name (an unload that failed): the set's files replace it.
            await self.unload(name)
            status, text = await self._post("/v1/load_lora_adapter", body, control=True)
        if status != 200:
            raise AdapterError(f"vLLM refused to load it ({status}: {_vllm_message(text)})")

    async def unload(self, name: str) -> None:
        status, text = await self._post("/v1/unload_lora_adapter", {"lora_name": name}, control=True)
        if status not in (200, 404):
            raise AdapterError(f"vLLM refused to unload it ({status}: {_vllm_message(text)})")

    async def generate(self, name: str) -> None:
        s = self.shim
        body = {"model": name, "prompt": READINESS_PROMPT, "max_tokens": ADAPTER_GENERATION_TOKENS, "temperature": 0}
        s._own_requests += 1
        status, text = await self._post("/v1/completions", body)
        if status != 200:
            raise AdapterError(f"a generation through it answered {status}: {_vllm_message(text)}")
        with contextlib.suppress(ValueError, AttributeError):
            s._own_tokens += float((json.loads(text).get("usage") or {}).get("completion_tokens") or 0)


def _vllm_message(text: str) -> str:
    """vLLM's error message out of its JSON answer, else the text, short."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(json.loads(text)["error"]["message"])[:300]
    return text[:300]


class EngineShim:
    """Owns the vLLM process for the probes: startup, readiness, prewarm, metrics, drain state."""

    def __init__(self, config: EngineConfig, engine: EngineProcess) -> None:
        self.config = config
        self.engine = engine
        self.base_url = f"http://{connect_host(config.server.host)}:{config.server.engine_port}"
        if ":" in connect_host(config.server.host):
            self.base_url = f"http://[{connect_host(config.server.host)}]:{config.server.engine_port}"
        self.headers: dict[str, str] = {}
        if config.auth is not None:
            key = Path(config.auth.api_key_file).read_text().strip()
            self.headers["Authorization"] = f"Bearer {key}"
        resolved = resolve(config)
        self.max_model_len = resolved.max_model_len
        self.prewarm_batch = min(MAX_BATCH_REQUESTS, resolved.max_num_seqs)
        """Requests of prewarm's concurrent batch: more than the engine runs at once would only queue."""
        self.control_token: str | None = None
        """What POST /prewarm must carry: the port also serves the kubelet's probes and the Service."""
        if config.server.control_token_file is not None:
            self.control_token = Path(config.server.control_token_file).read_text().strip()
        self.sample_interval_seconds = float(os.environ.get(SAMPLE_INTERVAL_ENV, "2"))
        """How often memory and vLLM's metrics are sampled; read when the pod starts (tests sample faster)."""
        self.metrics = EngineMetrics(config.remediation)
        self.startup_phases = StartupPhases()
        """What vLLM has said of its start-up so far (its engine generation: _phases_generation)."""
        self._phases_generation = engine.generation
        engine.on_output = self._observe_startup
        self.memory = MemoryReader()
        self.started = False
        self.draining = False
        self.closing = False
        self._held_polls = 0
        self.prewarm_result: PrewarmResult | None = None
        self.prewarmed_generation: int | None = None
        """The engine process generation whose prewarm succeeded: a later failed prewarm of the same
        process does not make it cold again, a restarted process must be prewarmed anew."""
        self._prewarm_task: asyncio.Task[PrewarmResult] | None = None
        self._ready: tuple[float, bool, str] | None = None
        self._ready_task: asyncio.Task[tuple[bool, str]] | None = None
        self._own_requests = 0.0
        self._own_tokens = 0.0
        self._real_tokens_seen: float | None = None
        self._failing_since: float | None = None
        self._last_sample: EngineSample | None = None
        """vLLM's metrics at the last sample (None while it is down): /health/poll's request counts."""
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task[None] | None = None
        self.adapters: AdapterRegistry | None = None
        """The LoRA adapters (None: the config has no lora section and vLLM serves none)."""
        if config.lora is not None and resolved.lora is not None:
            self.adapters = AdapterRegistry(
                VllmAdapters(self), base=self._base_shapes, max_rank=resolved.lora.max_rank,
                max_adapters=resolved.lora.max_cpu_loras, roots=list(config.lora.adapter_roots),
                hub_cache_dir=config.lora.hub_cache_dir,
                generation=lambda: self.engine.generation, on_change=self.metrics.set_adapter)
        self._shapes: BaseShapes | None = None

    def _base_shapes(self) -> BaseShapes:
        if self._shapes is None:
            self._shapes = BaseShapes.from_config(base_model_config(self.config))
        return self._shapes

    # -- lifecycle -------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.add_routes([
            web.get(LIVENESS_PATH, self.handle_livez),
            web.get(READINESS_PATH, self.handle_readyz),
            web.get(STARTUP_PATH, self.handle_startupz),
            web.post(PREWARM_PATH, self.handle_prewarm_post),
            web.get(PREWARM_PATH, self.handle_prewarm_get),
            web.get(METRICS_PATH, self.handle_metrics),
            web.get(HEALTH_POLL_PATH, self.handle_health_poll),
            web.put(ADAPTERS_PATH, self.handle_adapters_put),
            web.get(ADAPTERS_PATH, self.handle_adapters_get),
        ])
        return app

    async def start(self) -> None:
        """Listen on the shim port (before vLLM loads, so startup probes get an answer)."""
        self._session = aiohttp.ClientSession()
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.server.host, self.config.server.shim_port)
        await site.start()
        self._sampler = asyncio.create_task(self._sample_loop())
        log.info("event=shim-listening host=%s port=%d engine=%s", self.config.server.host,
                 self.config.server.shim_port, self.base_url)

    async def stop(self) -> None:
        self.closing = True  # a held health poll answers now instead of holding the server's shutdown
        for task in (self._sampler, self._prewarm_task, self._ready_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "EngineShim.start() first"
        return self._session

    async def _get(self, path: str, timeout: float) -> tuple[int, str]:
        async with self.session.get(self.base_url + path, headers=self.headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.text()

    async def wait_started(self) -> bool:
        """Poll vLLM's /health until it answers 200 once; False on timeout or engine exit."""
        deadline = time.monotonic() + self.config.health.startup_timeout_seconds
        while time.monotonic() < deadline and self.engine.alive():
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                status, _ = await self._get("/health", 2)
                if status == 200:
                    self.started = True
                    load = time.monotonic() - (self.engine.started_at or time.monotonic())
                    self.metrics.startup_seconds.labels(phase="engine_load").set(load)
                    log.info("event=engine-started pid=%s load_seconds=%.1f", self.engine.pid, load)
                    return True
            await asyncio.sleep(0.5)
        return False

    def _observe_startup(self, line: str) -> None:
        if self.engine.generation != self._phases_generation:
            # A restarted engine reports its phases anew; the last start's would mislead.
            self._phases_generation = self.engine.generation
            self.startup_phases = StartupPhases()
            self.metrics.clear_startup_phases()
        if self.startup_phases.observe(line) is not None:
            self.metrics.record_startup_phases(self.startup_phases)

    # -- readiness -------------------------------------------------------------------------------

    async def readiness(self, reuse_seconds: float = 0.0) -> tuple[bool, str]:
        """Ready = not draining, loaded, prewarmed (when enabled) and a real generation answers.

        The generation's result is reused for readiness_cache_seconds, or `reuse_seconds` where longer.
        """
        if self.draining:
            return False, "draining: SIGTERM received, finishing in-flight requests"
        if not self.engine.alive():
            return False, f"engine process exited with code {self.engine.returncode}"
        if not self.started:
            return False, "engine is still loading the model"
        if self.config.prewarm.enabled and self.prewarmed_generation != self.engine.generation:
            why = self.prewarm_result.error if self.prewarm_result else "not run yet"
            return False, f"prewarm has not succeeded ({why}); POST /prewarm"
        now = time.monotonic()
        reuse = max(reuse_seconds, self.config.health.readiness_cache_seconds)
        if self._ready is not None and now - self._ready[0] < reuse:
            return self._ready[1], self._ready[2] + " (cached)"
        # One check at a time: a burst of probes must not become a burst of generations.
        if self._ready_task is None or self._ready_task.done():
            self._ready_task = asyncio.create_task(self._check_generation())
        ok, reason = await asyncio.shield(self._ready_task)
        self._ready = (time.monotonic(), ok, reason)
        self._track_hung(ok)
        return ok, reason

    def _track_hung(self, ok: bool) -> None:
        now = time.monotonic()
        if ok:
            self._failing_since = None
        elif self._failing_since is None:
            self._failing_since = now
        hung = (self._failing_since is not None and self.config.remediation.enabled and
                now - self._failing_since >= self.config.remediation.hung_readiness_seconds)
        self.metrics.remediation.labels(reason="hung_readiness").set(1 if hung else 0)

    async def _engine_sample(self, timeout: float) -> EngineSample:
        status, text = await self._get("/metrics", timeout)
        if status != 200:
            raise aiohttp.ClientError(f"vLLM /metrics answered {status}")
        return parse_vllm_metrics(text)

    def _real_progress(self, sample: EngineSample) -> bool:
        """Did vLLM generate tokens for clients since the last look? (Our own tokens subtracted.)"""
        real = sample.generation_tokens_total - self._own_tokens
        seen = self._real_tokens_seen
        # Keep the maximum: vLLM's counter lags our own bookkeeping by a step, which must not
        # read as client traffic once it catches up.
        self._real_tokens_seen = real if seen is None else max(seen, real)
        return seen is not None and real > seen

    async def _check_generation(self) -> tuple[bool, str]:
        deadline = self.config.health.readiness_deadline_seconds
        start = time.perf_counter()
        try:
            async with asyncio.timeout(deadline):
                if self._real_progress(await self._engine_sample(deadline)):
                    return True, "engine is generating tokens for client traffic"
                body = {"model": self.config.model.served_name, "prompt": READINESS_PROMPT,
                        "max_tokens": 1, "temperature": 0}
                self._own_requests += 1
                async with self.session.post(self.base_url + "/v1/completions", json=body,
                                             headers=self.headers) as resp:
                    payload = await resp.text()
                    if resp.status != 200:
                        return False, f"one-token generation answered {resp.status}: {payload[:200]}"
                usage = json.loads(payload).get("usage") or {}
                self._own_tokens += float(usage.get("completion_tokens") or 0)
        except TimeoutError:
            return False, f"one-token generation did not finish within readinessDeadlineSeconds={deadline}"
        except (aiohttp.ClientError, ValueError) as e:
            return False, f"one-token generation failed: {type(e).__name__}: {e}"
        took = time.perf_counter() - start
        self.metrics.probe_latency.observe(took)
        return True, f"one-token generation answered in {took * 1000:.0f} ms"

    # -- prewarm ---------------------------------------------------------------------------------

    async def prewarm(self, requests: int | None = None, prompts: list[str] | None = None) -> PrewarmResult:
        """Run prewarm, or join the one already running (the operator may call while we auto-run)."""
        if self._prewarm_task is None or self._prewarm_task.done():
            self._prewarm_task = asyncio.create_task(self._run_prewarm(
                requests or self.config.prewarm.requests, prompts or self.config.prewarm.prompts))
        return await asyncio.shield(self._prewarm_task)

    async def _run_prewarm(self, requests: int, prompts: list[str]) -> PrewarmResult:
        p = self.config.prewarm
        log.info("event=prewarm-start requests=%d", requests)
        result = await run_prewarm(self.base_url, self.config.model.served_name, requests=requests,
                                   prompts=prompts, max_tokens=p.max_tokens, timeout_seconds=p.timeout_seconds,
                                   max_model_len=self.max_model_len, headers=self.headers,
                                   batch=self.prewarm_batch)
        self._own_requests += result.requests + result.batched
        self._own_tokens += result.completion_tokens
        if result.ok and self.adapters is not None:
            # The base model stays ready whatever an adapter does: a failing one is marked failed.
            await self.adapters.prewarm()
        self.prewarm_result = result
        if result.ok:
            self.prewarmed_generation = self.engine.generation
            self._ready = None
        m = self.metrics
        m.prewarm_succeeded.set(1 if self.prewarmed_generation == self.engine.generation else 0)
        m.prewarm_duration.set(result.duration_seconds)
        m.prewarm_ttft.labels(phase="cold").set(result.cold_ttft_ms / 1000)
        m.prewarm_ttft.labels(phase="warm").set(result.warm_ttft_ms / 1000)
        if result.ok and self.engine.pid is not None:
            # The baseline is memory with the model loaded, the KV cache allocated and the paths warm.
            baseline = self.memory.read(self.engine.pid).used_bytes
            m.set_baseline(baseline)
            log.info("event=prewarm-done ok=true cold_ttft_ms=%.1f warm_ttft_ms=%.1f seconds=%.2f "
                     "baseline_bytes=%d", result.cold_ttft_ms, result.warm_ttft_ms, result.duration_seconds,
                     baseline)
        else:
            log.warning("event=prewarm-done ok=false error=%r", result.error)
        return result

    async def await_adapters(self) -> None:
        """Before the prewarm at start: the operator's first PUT /adapters, for at most lora.awaitAdaptersSeconds."""
        if self.adapters is None or self.config.lora is None:
            return
        wait = self.config.lora.await_adapters_seconds
        try:
            await asyncio.wait_for(self.adapters.received.wait(), wait)
        except TimeoutError:
            log.warning("event=adapters-not-received wait_s=%s effect='prewarm runs for the base model alone'", wait)

    # -- sampling --------------------------------------------------------------------------------

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sample_interval_seconds)
            try:
                await self.sample_once()
            except Exception as e:  # a failed sample must not end sampling for the pod's life
                log.warning("event=sample-failed error=%r", e)

    async def sample_once(self) -> None:
        m = self.metrics
        m.generation.set(self.engine.generation)
        if self.adapters is not None:
            self.adapters.forget_restarted()
        pid = self.engine.pid
        if pid is None or not self.engine.alive():
            m.engine_up.set(0)
            self._last_sample = None
            return
        sample: EngineSample | None = None
        if self.started:
            try:
                sample = await self._engine_sample(2)
                m.engine_up.set(1)
                prewarming = self._prewarm_task is not None and not self._prewarm_task.done()
                m.observe_engine(time.monotonic(), sample, self._own_requests, own_in_flight=prewarming)
            except (TimeoutError, aiohttp.ClientError, ValueError):
                m.engine_up.set(0)
        self._last_sample = sample
        memory = await asyncio.to_thread(self.memory.read, pid)
        m.observe_memory(time.monotonic(), memory, sample)

    # -- handlers --------------------------------------------------------------------------------

    async def handle_livez(self, request: web.Request) -> web.Response:
        if not self.engine.alive():
            return _reply(503, False, f"engine process exited with code {self.engine.returncode}")
        if not self.started:
            return _reply(200, True, "engine process alive, still loading (the startup probe covers this)")
        try:
            status, _ = await self._get("/health", self.config.health.readiness_deadline_seconds)
        except (TimeoutError, aiohttp.ClientError) as e:
            return _reply(503, False, f"vLLM /health did not answer: {type(e).__name__} {e}")
        if status != 200:
            return _reply(503, False, f"vLLM /health answered {status}")
        return _reply(200, True, "engine process alive and /health answers")

    async def handle_readyz(self, request: web.Request) -> web.Response:
        ok, reason = await self.readiness()
        return _reply(200 if ok else 503, ok, reason)

    async def handle_startupz(self, request: web.Request) -> web.Response:
        if self.started:
            return _reply(200, True, "engine finished loading")
        if not self.engine.alive():
            return _reply(503, False, f"engine process exited with code {self.engine.returncode}")
        age = time.monotonic() - (self.engine.started_at or time.monotonic())
        return _reply(503, False, f"engine loading for {age:.0f}s")

    def authorized(self, request: web.Request) -> bool:
        """Whether a state-changing request carries the operator's token (compared in constant time)."""
        if self.control_token is None:
            return True
        sent = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(sent, f"Bearer {self.control_token}".encode())

    async def handle_prewarm_post(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            # The probes on this port stay open to the kubelet; prewarm runs generations and sets readiness.
            return _reply(401, False, "POST /prewarm answers only the operator: send its token as "
                                      "Authorization: Bearer <token> (the model's <name>-shim Secret)")
        try:
            requests, prompts = parse_prewarm_body(await request.read(), self.config.prewarm.requests)
        except BadRequest as e:
            return _reply(400, False, str(e))
        if self.draining:
            return _reply(503, False, "draining: no prewarm during shutdown")
        if not self.started:
            return _reply(503, False, "engine is still loading; retry when /startupz answers 200")
        result = await self.prewarm(requests, prompts)
        return web.json_response(result.to_json(), status=200 if result.ok else 502)

    async def handle_adapters_put(self, request: web.Request) -> web.Response:
        if not self.authorized(request):
            return _reply(401, False, f"PUT {ADAPTERS_PATH} answers only the operator: send its token as "
                                      "Authorization: Bearer <token> (the model's <name>-shim Secret)")
        if self.adapters is None:
            return _reply(404, False, "this engine serves no LoRA adapters: its config has no lora section")
        try:
            desired = parse_adapter_set(await request.read(), served_name=self.config.model.served_name,
                                        max_adapters=self.adapters.max_adapters)
        except BadAdapterSet as e:
            return _reply(400, False, str(e))
        if self.draining:
            return _reply(503, False, "draining: adapters are not loaded during shutdown")
        if not self.started or not self.engine.alive():
            return _reply(503, False, "engine is still loading; retry when /startupz answers 200")
        return web.json_response(await self.adapters.reconcile(desired))

    async def handle_adapters_get(self, request: web.Request) -> web.Response:
        if self.adapters is None:
            return _reply(404, False, "this engine serves no LoRA adapters: its config has no lora section")
        return web.json_response(self.adapters.answer())

    async def handle_prewarm_get(self, request: web.Request) -> web.Response:
        if self.prewarm_result is None:
            return _reply(404, False, "no prewarm has run yet; POST /prewarm")
        return web.json_response(self.prewarm_result.to_json())

    async def handle_metrics(self, request: web.Request) -> web.Response:
        text: str | None = None
        if self.started and self.engine.alive():
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                status, body = await self._get("/metrics", 2)
                text = body if status == 200 else None
        return web.Response(body=self.metrics.render(text), content_type="text/plain",
                            headers={"X-Content-Type-Options": "nosniff"})

    async def health_poll(self, reuse_seconds: float = 0.0) -> dict[str, Any]:
        ok, reason = await self.readiness(reuse_seconds)
        prewarmed = self.prewarmed_generation == self.engine.generation
        return health_poll_answer(ok, reason, self.engine.generation, prewarmed, self.metrics, self._last_sample,
                                  self.metrics.startup_by_phase())

    async def handle_health_poll(self, request: web.Request) -> web.Response:
        # 200 whenever the shim answers: readiness is in the body, and a status other than 200 tells
        # the operator that the poll itself failed.
        try:
            wait, unless = parse_health_poll_wait(request.query)
        except ValueError as e:
            return _reply(400, False, f"{HEALTH_POLL_PATH}: {e}")
        answer = await self.health_poll()
        if answer["state"] != unless or self._held_polls >= HEALTH_POLL_MAX_HELD:
            return web.json_response(answer)
        self._held_polls += 1
        try:
            return web.json_response(await self._hold_health_poll(answer, wait, unless))
        finally:
            self._held_polls -= 1

    async def _hold_health_poll(self, answer: dict[str, Any], wait: float, unless: str | None) -> dict[str, Any]:
        deadline = time.monotonic() + wait
        # Held while nothing the operator decides on changed, looking again every HEALTH_POLL_RECHECK_SECONDS:
        # a change (draining, the engine gone or restarted, divergence, a failed generation) is answered
        # within that. A look runs a readiness generation only where the last is HEALTH_POLL_READINESS_SECONDS
        # old (readiness_cache_seconds where longer), as often as a poll every monitorSeconds asked for one.
        while answer["state"] == unless and not self.closing and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(HEALTH_POLL_RECHECK_SECONDS, left))
            answer = await self.health_poll(HEALTH_POLL_READINESS_SECONDS)
        return answer
