"""LoRA adapters at run time: the set each pod's shim is given, and what status.adapters says of it.

The spec's adapters are not in the pod template's config hash: the operator PUTs the whole set to
every pod of the model that runs a shim (serving and standby) whenever it changes, and to a new pod
before its prewarm, which then covers them. Each pod's own watch (gating.PodWatch) does its PUT, so
the work stops with the pod; a change of the set wakes the watches whose health poll the shim holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from flashmodel_engine.contract import ADAPTERS_PATH
from prometheus_client import Counter

from flashmodel_operator.model import FlashModel, FlashModelSpec
from flashmodel_operator.pod_context import PodContext
from flashmodel_operator.pod_state import MODELS, AdapterOnPod, DesiredAdapters, ModelState, PodRecord
from flashmodel_operator.render import adapter_path, content_hash
from flashmodel_operator.shim_client import AdaptersAnswer, ShimClient

log = logging.getLogger(__name__)

T = TypeVar("T")

PUT_TIMEOUT_SECONDS = 120.0
"""A PUT waits for the shim to load what is new: a hub adapter is downloaded first."""
PUT_ATTEMPTS_BEFORE_PREWARM = 3
"""A new pod whose shim gave no answer this many times is prewarmed anyway: a shim that cannot answer a
PUT fails its prewarm too, and the prewarm's path replaces the pod; waiting here would hold it forever."""
BACKOFF_SECONDS = 2.0
MAX_BACKOFF_SECONDS = 60.0
ADAPTER_PUTS = Counter("flashmodel_operator_adapter_puts_total", "Adapter set PUTs to engine pods", ["result"])
for _result in ("answered", "refused", "failed"):
    ADAPTER_PUTS.labels(result=_result)


def entry(fm: FlashModel, name: str) -> dict[str, str]:
    """One adapter's entry in the PUT body (engine contract ADAPTERS_PATH): a path in the pod, or a hub id."""
    adapter = next(a for a in fm.spec.adapters if a.name == name)
    path = adapter_path(fm, adapter)
    if path is not None:
        return {"name": name, "path": path}
    assert adapter.hub is not None  # a source that is not mounted is a hub one
    return {"name": name, "hub": adapter.hub.id, "revision": adapter.hub.revision}


def desired(fm: FlashModel) -> DesiredAdapters:
    """The set the spec asks for; its hash changes with any adapter's name or source, and only with them."""
    entries = tuple(entry(fm, a.name) for a in fm.spec.adapters)
    return DesiredAdapters(
        key=(fm.uid, fm.generation),
        on=fm.spec.lora_on,
        entries=entries,
        set_hash=content_hash(sorted(entries, key=lambda e: e["name"])),
        entry_hashes={e["name"]: content_hash(e) for e in entries},
    )


def desired_of(state: ModelState, fm: Mapping[str, Any], spec: FlashModelSpec) -> DesiredAdapters | None:
    """The desired set of the model `fm` with its validated `spec`, kept in its state once per generation.

    None for a spec the operator refuses (the reconcile reports it).
    """
    meta = fm.get("metadata") or {}
    key = (str(meta.get("uid", "")), int(meta.get("generation", 0)))
    if state.adapters is None or state.adapters.key != key:
        if not spec.lora_on:
            state.adapters = DesiredAdapters(key=key, on=False, entries=(), set_hash="", entry_hashes={})
            return state.adapters
        try:
            model = FlashModel(
                name=str(meta.get("name", "")), namespace=str(meta.get("namespace", "")), uid=key[0],
                generation=key[1], spec=spec,
            )
            state.adapters = desired(model)
        except ValueError:  # pydantic's ValidationError too
            return None
    return state.adapters


async def sync(
    ctx: PodContext,
    pod: dict[str, Any],
    fm: Mapping[str, Any],
    spec: FlashModelSpec,
    shim: ShimClient,
    before_prewarm: bool,
) -> float | None:
    """Give the pod's shim the spec's adapter set where it has not answered for it yet.

    None: go on (the pod has the set, LoRA is off, or a serving pod's PUT waits for its back-off, which
    must not hold up its health poll). A number: seconds before the pod's prewarm may be tried, while a
    new pod's PUT has had no answer (a failed adapter is an answer: the base model serves).
    """
    wanted = desired_of(ctx.state, fm, spec)
    if wanted is None or not wanted.on:
        return None
    record = ctx.state.pods.setdefault(ctx.name, PodRecord())
    if record.adapter_set == wanted.set_hash:
        return None
    now = time.monotonic()
    if now < record.adapter_retry_at:
        return record.adapter_retry_at - now if before_prewarm else None
    answer = await shim.put_adapters(list(wanted.entries), PUT_TIMEOUT_SECONDS)
    if answer.status == 200 and answer.states is not None:
        ADAPTER_PUTS.labels(result="answered").inc()
        states = {name: AdapterOnPod(wanted.entry_hashes.get(name, ""), loaded, reason)
                  for name, (loaded, reason) in answer.states.items()}
        missing = [e["name"] for e in wanted.entries if e["name"] not in states]
        for name in missing:
            states[name] = AdapterOnPod(wanted.entry_hashes[name], False, "the shim's answer does not list it")
        await _answered(ctx, pod, record, wanted, states)
        return None
    if answer.status == 401:
        # A model deleted and made again under its name has a new token: read it again.
        ctx.state.control_token = None
    if answer.status in (400, 404, 405):
        # The shim refused the set, or its engine image has no /adapters: asking again gets the same.
        ADAPTER_PUTS.labels(result="refused").inc()
        why = answer.error if answer.status == 400 else (
            f"the engine image's shim has no PUT {ADAPTERS_PATH} (HTTP {answer.status}); use an engine image with LoRA"
        )
        states = {e["name"]: AdapterOnPod(wanted.entry_hashes[e["name"]], False, why) for e in wanted.entries}
        await _answered(ctx, pod, record, wanted, states)
        return None
    ADAPTER_PUTS.labels(result="failed").inc()
    record.adapter_failures += 1
    delay = min(MAX_BACKOFF_SECONDS, BACKOFF_SECONDS * 2.0 ** (record.adapter_failures - 1))
    record.adapter_retry_at = now + delay
    log.warning(
        "event=adapters-put-failed model=%s/%s pod=%s attempt=%d status=%d error=%r retry_in_s=%.0f",
        ctx.namespace, ctx.model, ctx.name, record.adapter_failures, answer.status, answer.error, delay,
    )
    if before_prewarm and record.adapter_failures < PUT_ATTEMPTS_BEFORE_PREWARM:
        return delay
    return None


async def _answered(
    ctx: PodContext,
    pod: dict[str, Any],
    record: PodRecord,
    wanted: DesiredAdapters,
    states: dict[str, AdapterOnPod],
) -> None:
    """Keep the pod's answer; an event for each adapter that failed anew; status.adapters and the condition."""
    before = record.adapters
    record.adapters, record.adapter_set = states, wanted.set_hash
    record.adapter_failures, record.adapter_retry_at = 0, 0.0
    for name, seen in sorted(states.items()):
        if seen.loaded or before.get(name) == seen:
            continue  # news once: the same failure answered again is not another event
        message = f"adapter {name} failed to load: {seen.reason or 'no reason given'}"[:1024]
        await ctx.api(ctx.cluster.event, pod, "Warning", "AdapterFailed", message)
    loaded = sorted(n for n, s in states.items() if s.loaded)
    log.info(
        "event=adapters-set model=%s/%s pod=%s loaded=%s failed=%s",
        ctx.namespace, ctx.model, ctx.name, ",".join(loaded) or "-",
        ",".join(sorted(n for n, s in states.items() if not s.loaded)) or "-",
    )
    await ctx.write_pods_status()
    if {n: (s.loaded, s.reason) for n, s in states.items()} != {n: (s.loaded, s.reason) for n, s in before.items()}:
        # The AdaptersReady condition is the model's pass's to write.
        ctx.request_pass()


def forget_pod_set(record: PodRecord) -> None:
    """The pod's engine restarted: it holds no adapter now, and gets the set again before its prewarm."""
    record.adapter_set = ""
    record.adapters = {}
    record.adapter_failures, record.adapter_retry_at = 0, 0.0


def spec_key(body: Mapping[str, Any]) -> str:
    """What of a FlashModel's body the adapter set depends on (its adapters, lora and model source)."""
    spec = body.get("spec") or {}
    return json.dumps([spec.get("adapters"), spec.get("lora"), spec.get("model")], sort_keys=True, default=str)


def model_event(namespace: str, name: str, body: Mapping[str, Any]) -> None:
    """A FlashModel watch event: where its adapter set changed, wake its pods' held health polls.

    Only a model whose pods are watched has a state to wake. The first event a state sees wakes its
    polls too: the change may have come before it (one early poll, once per model and operator start).
    """
    state = MODELS.get((namespace, name))
    if state is None:
        return
    key = spec_key(body)
    if state.adapter_seen != key:
        for waker in list(state.wakers):
            waker.set()
    state.adapter_seen = key


async def unless_woken(state: ModelState, call: Awaitable[T]) -> tuple[bool, T | None]:
    """(True, its result) of `call`, or (False, None) when the model's adapter set changed first (`call` cancelled)."""
    waker = asyncio.Event()
    state.wakers.add(waker)
    task = asyncio.ensure_future(call)
    woken = asyncio.ensure_future(waker.wait())
    try:
        await asyncio.wait({task, woken}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        state.wakers.discard(waker)
        woken.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return False, None
    return True, task.result()


__all__ = ["AdaptersAnswer", "desired", "desired_of", "forget_pod_set", "model_event", "sync", "unless_woken"]
