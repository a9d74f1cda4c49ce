"""LoRA adapters at run time: the desired set the operator PUTs, each adapter's checks, and the reconcile.

The contract is flashmodel_engine.contract.ADAPTERS_PATH. An adapter is checked here before vLLM
sees it (its config, rank and weight shapes against the base model, its path inside the allowed
roots, a hub revision pinned to a commit), then loaded through vLLM's runtime API and tried with one
short generation: "loaded" means it answers. One adapter failing leaves the base model and the
others serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

log = logging.getLogger("flashmodel.adapters")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_HEADER_BYTES = 100 * 2**20
COMMIT = re.compile(r"[0-9a-f]{40}")
LLAMA_FAMILY = frozenset({"qwen2", "qwen3", "llama", "mistral"})
"""Model types whose decoder layers are q/k/v/o_proj and gate/up/down_proj with the shapes below."""
_TENSOR = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.\w+\.(\w+)\.(lora_A|lora_B)(?:\.\w+)?\.weight$")


class AdapterSource(BaseModel):
    """One adapter of the desired set: a name clients send as `model`, and where its files are."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    path: str | None = Field(default=None, min_length=1, max_length=1024)
    hub: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][\w.-]*/[\w.-]+$", max_length=200)
    revision: str | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def _one_source(self) -> AdapterSource:
        if (self.path is None) == (self.hub is None):
            raise ValueError(f"adapter {self.name!r} needs exactly one of path or hub")
        if self.hub is not None and (self.revision is None or not COMMIT.fullmatch(self.revision)):
            raise ValueError(f"adapter {self.name!r}: hub {self.hub} needs revision, a full 40-hex commit id "
                             f"(got {self.revision!r}), so every pod serves the same weights")
        if self.path is not None and self.revision is not None:
            raise ValueError(f"adapter {self.name!r}: revision is for hub adapters only")
        return self


class AdapterSet(BaseModel):
    """The body of `PUT /adapters`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapters: list[AdapterSource] = Field(max_length=256)

    @model_validator(mode="after")
    def _unique(self) -> AdapterSet:
        names = [a.name for a in self.adapters]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"adapter names must be unique; repeated: {', '.join(twice)}")
        return self


class BadAdapterSet(ValueError):
    """A PUT /adapters body that cannot be reconciled as sent; the message is the 400 reason."""


def parse_adapter_set(raw: bytes, *, served_name: str, max_adapters: int) -> AdapterSet:
    """The PUT body, checked; BadAdapterSet says what to change."""
    try:
        desired = AdapterSet.model_validate_json(raw)
    except ValidationError as e:
        parts = [f"{'.'.join(str(p) for p in err['loc']) or '<body>'}: {err['msg']}" for err in e.errors()]
        raise BadAdapterSet("; ".join(parts) + ' (send {"adapters": [{"name": N, "path": P} | '
                            '{"name": N, "hub": "org/repo", "revision": "<40 hex>"}]})') from None
    if any(a.name == served_name for a in desired.adapters):
        raise BadAdapterSet(f"adapter name {served_name!r} is the base model's served name; name the adapter otherwise")
    if len(desired.adapters) > max_adapters:
        raise BadAdapterSet(f"{len(desired.adapters)} adapters, but this engine holds at most {max_adapters} "
                            "(lora.maxCpuLoras); raise it or send fewer")
    return desired


def set_hash(desired: AdapterSet) -> str:
    """The `set` of the answer: a digest of the desired set, independent of its order."""
    items = sorted((a.model_dump(exclude_none=True) for a in desired.adapters), key=lambda a: a["name"])
    return hashlib.sha256(json.dumps(items, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


class AdapterError(ValueError):
    """Why one adapter cannot be served; the message is its `reason`."""


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must agree with: the base model's decoder layers and their linear modules."""

    layers: int
    modules: dict[str, tuple[int, int]]
    """Module name -> (in features, out features)."""

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> BaseShapes:
        """From config.json; AdapterError for an architecture whose modules are not known here."""
        kind = str(cfg.get("model_type") or "")
        if kind not in LLAMA_FAMILY:
            raise AdapterError(f"the base model's model_type {kind!r} is not one whose modules the engine knows "
                               f"({', '.join(sorted(LLAMA_FAMILY))}); adapters cannot be checked against it")
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv = int(cfg.get("num_key_value_heads") or heads) * head_dim
        inter = int(cfg["intermediate_size"])
        q = heads * head_dim
        return cls(layers=int(cfg["num_hidden_layers"]), modules={
            "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
        })


def inside_roots(raw: str, roots: Iterable[str]) -> Path:
    """The adapter's folder, normalised, symlinks resolved; AdapterError unless it lies in one of `roots`."""
    p = PurePosixPath(raw)
    if not p.is_absolute() or ".." in p.parts:
        raise AdapterError(f"path {raw!r} must be absolute and without '..'")
    real = Path(os.path.realpath(raw))
    for root in roots:
        if real.is_relative_to(os.path.realpath(root)):
            return real
    raise AdapterError(f"path {raw!r} (resolved {real}) is outside the adapter folders {', '.join(roots)}; "
                       "put the adapter on a volume mounted there")


def _header(path: Path) -> dict[str, Any]:
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise AdapterError(f"{path} is shorter than a safetensors header")
        length = int.from_bytes(raw, "little")
        if length > MAX_HEADER_BYTES:
            raise AdapterError(f"{path}: its safetensors header claims {length} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise AdapterError(f"{path} is not a safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{path} is not a safetensors file (its header is not an object)")
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if size < 8 + length + end:
        raise AdapterError(f"{path} is truncated: its header lists {8 + length + end} bytes, the file has {size}")
    return header


def _read_config(folder: Path) -> dict[str, Any]:
    try:
        cfg = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{folder / CONFIG_FILE} is missing; an adapter is a PEFT folder with {CONFIG_FILE} "
                           f"and {WEIGHTS_FILE}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{folder / CONFIG_FILE} cannot be read as JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{folder / CONFIG_FILE} is not a JSON object")
    return cfg


def check_adapter(folder: Path, base: BaseShapes, max_rank: int) -> None:
    """Raise AdapterError unless the adapter in `folder` is a LoRA vLLM can serve on this base model."""
    cfg = _read_config(folder)
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise AdapterError(f"peft_type is {kind!r}; only LORA adapters are served")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{CONFIG_FILE} has r={rank!r}; it must be a positive integer")
    ranks = {"r": rank, **{f"rank_pattern[{k}]": v for k, v in (cfg.get("rank_pattern") or {}).items()}}
    for key, value in ranks.items():
        if not isinstance(value, int) or value > max_rank:
            raise AdapterError(f"{key} is {value}, above lora.maxRank {max_rank}; raise lora.maxRank (the profile "
                               "limits it) or train the adapter with a lower rank")
    for flag in ("use_dora", "lora_bias"):
        if cfg.get(flag):
            raise AdapterError(f"{CONFIG_FILE} sets {flag}; vLLM serves plain LoRA only")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{CONFIG_FILE} has modules_to_save {cfg['modules_to_save']}: vLLM cannot serve fully "
                           "trained modules beside a LoRA; train without them")
    targets = cfg.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if not isinstance(names, list) or not names or not all(isinstance(t, str) for t in names):
        raise AdapterError(f"{CONFIG_FILE} has target_modules={targets!r}; it must name the modules adapted")
    if not isinstance(targets, str):  # a string is a PEFT regex or "all-linear": the weights are checked below
        unknown = sorted(set(names) - set(base.modules))
        if unknown:
            raise AdapterError(f"target_modules {unknown} are not modules of the base model "
                               f"({', '.join(base.modules)}); was it trained for another model?")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        found = (" (adapter_model.bin is a pickle, which can run code: convert it to safetensors)"
                 if (folder / "adapter_model.bin").exists() else "")
        raise AdapterError(f"{weights} is missing{found}")
    try:
        header = _header(weights)
    except OSError as e:
        raise AdapterError(f"{weights} cannot be read ({e.strerror})") from None
    _check_tensors(header, base, max_rank)


def _check_tensors(header: dict[str, Any], base: BaseShapes, max_rank: int) -> None:
    pairs: dict[tuple[int, str], dict[str, list[int]]] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        m = _TENSOR.match(name)
        if m is None:
            raise AdapterError(f"tensor {name} is not a LoRA A/B matrix of a decoder layer; vLLM serves those only")
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in base.modules:
            raise AdapterError(f"tensor {name} adapts {module}, which the base model does not have")
        if layer >= base.layers:
            raise AdapterError(f"tensor {name} is for layer {layer}; the base model has {base.layers} layers")
        pairs.setdefault((layer, module), {})[which] = list(entry.get("shape") or [])
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA matrices")
    for (layer, module), ab in sorted(pairs.items()):
        fan_in, fan_out = base.modules[module]
        a, b = ab.get("lora_A"), ab.get("lora_B")
        where = f"layer {layer} {module}"
        if a is None or b is None:
            raise AdapterError(f"{where} has lora_A without lora_B or the other way round")
        if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b[0] != fan_out or a[0] != b[1]:
            raise AdapterError(f"{where}: lora_A {a} and lora_B {b} do not fit the base model's [{fan_out}, {fan_in}] "
                               f"weight (expected [r, {fan_in}] and [{fan_out}, r]); the adapter is for another model")
        if a[0] > max_rank:
            raise AdapterError(f"{where} has rank {a[0]}, above lora.maxRank {max_rank}")


def fingerprint(folder: Path) -> str:
    """Size and modification time of the adapter's files: a PUT of the same path reloads new files."""
    parts = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (folder / name).stat()
            parts.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
        except OSError:
            parts.append(f"{name}:missing")
    return ",".join(parts)


def download_hub_adapter(repo: str, revision: str, cache_dir: str) -> Path:
    """The hub adapter's files at `revision`, downloaded once into `cache_dir`/<repo>/<revision>."""
    from huggingface_hub import snapshot_download

    target = Path(cache_dir) / repo.replace("/", "--") / revision
    try:
        snapshot_download(repo_id=repo, revision=revision, local_dir=str(target),
                          allow_patterns=[CONFIG_FILE, WEIGHTS_FILE])
    except Exception as e:  # the hub client's errors (network, 404, auth) all end this adapter the same way
        raise AdapterError(f"hub adapter {repo}@{revision} could not be downloaded ({type(e).__name__}: "
                           f"{str(e)[:300]})") from None
    return target


class EngineAdapterAPI(Protocol):
    """vLLM's side of the reconcile (the shim's HTTP calls; a fake in unit tests)."""

    async def load(self, name: str, path: Path) -> None:
        """Load the adapter; raise AdapterError with vLLM's reason."""

    async def unload(self, name: str) -> None:
        """Unload it; an adapter vLLM does not know is not an error."""

    async def generate(self, name: str) -> None:
        """One short generation through the adapter; raise AdapterError when it fails."""


State = Literal["loaded", "failed"]


@dataclass
class AdapterStatus:
    """What the shim knows of one adapter of the set."""

    source: AdapterSource
    state: State
    reason: str
    fingerprint: str
    generation: int
    """The engine process generation it was loaded into: a restarted vLLM has none of them."""

    def to_json(self) -> dict[str, str]:
        return {"name": self.source.name, "state": self.state, "reason": self.reason}


class AdapterRegistry:
    """Owns the set of adapters on this engine; one reconcile at a time."""

    def __init__(self, api: EngineAdapterAPI, *, base: Callable[[], BaseShapes], max_rank: int,
                 max_adapters: int, roots: list[str], hub_cache_dir: str,
                 generation: Callable[[], int], on_change: Callable[[str, float | None], None]) -> None:
        self.api = api
        self._base = base
        self.max_rank = max_rank
        self.max_adapters = max_adapters
        self.roots = [*roots, hub_cache_dir]
        self.hub_cache_dir = hub_cache_dir
        self._generation = generation
        self._on_change = on_change
        """Called with (name, 1 loaded | 0 failed | None gone): the gauge."""
        self.adapters: dict[str, AdapterStatus] = {}
        self.desired = AdapterSet(adapters=[])
        self.received = asyncio.Event()
        """Set at the first reconcile: the prewarm at start waits for it (lora.awaitAdaptersSeconds)."""
        self._lock = asyncio.Lock()

    def answer(self) -> dict[str, Any]:
        """The JSON of GET and PUT /adapters, in the desired set's order."""
        self.forget_restarted()
        out = [self.adapters[a.name].to_json() for a in self.desired.adapters if a.name in self.adapters]
        return {"adapters": out, "set": set_hash(self.desired)}

    def forget_restarted(self) -> None:
        """A restarted vLLM holds none of the adapters: their gauges read 0 until the next PUT loads them."""
        now = self._generation()
        for name, status in self.adapters.items():
            if status.state == "loaded" and status.generation != now:
                status.state, status.reason = "failed", "the engine restarted since it was loaded; PUT /adapters again"
                self._on_change(name, 0)

    def loaded(self) -> list[str]:
        now = self._generation()
        return [n for n, s in self.adapters.items() if s.state == "loaded" and s.generation == now]

    def mark_failed(self, name: str, reason: str) -> None:
        status = self.adapters.get(name)
        if status is not None:
            status.state, status.reason = "failed", reason
            self._on_change(name, 0)

    async def prewarm(self) -> None:
        """After the base model's prewarm: one short generation per loaded adapter; one that fails is marked failed."""
        async with self._lock:
            for name in self.loaded():
                try:
                    await self.api.generate(name)
                except AdapterError as e:
                    self.mark_failed(name, f"its prewarm generation failed: {e}")
                    log.warning("event=adapter-prewarm-failed adapter=%s reason=%r", name, str(e))

    async def reconcile(self, desired: AdapterSet) -> dict[str, Any]:
        """Unload what is gone, load what is new or changed; answer the state of each."""
        async with self._lock:
            now = self._generation()
            wanted = {a.name: a for a in desired.adapters}
            for name in [n for n in self.adapters if n not in wanted]:
                await self._unload(name, now)
            for a in desired.adapters:
                await self._ensure(a, now)
            self.desired = desired
            self.received.set()
            return self.answer()

    async def _unload(self, name: str, now: int) -> None:
        status = self.adapters.pop(name)
        if status.state == "loaded" and status.generation == now:
            try:
                await self.api.unload(name)
            except AdapterError as e:
                log.warning("event=adapter-unload-failed adapter=%s reason=%r", name, str(e))
        self._on_change(name, None)
        log.info("event=adapter-unloaded adapter=%s", name)

    async def _ensure(self, source: AdapterSource, now: int) -> None:
        current = self.adapters.get(source.name)
        live = current is not None and current.state == "loaded" and current.generation == now
        folder: Path | None = None
        failure: str | None = None
        print_ = ""
        if live and current is not None and current.source == source and source.hub is not None:
            return  # a pinned commit never changes: no need to ask the hub again
        try:
            folder = await self._fetch(source)
            print_ = await asyncio.to_thread(fingerprint, folder)
        except AdapterError as e:
            failure = str(e)
        if live and current is not None and current.source == source and current.fingerprint == print_:
            return
        if live:
            # Changed (another source, or new files under the same path): vLLM keeps a name's first weights.
            try:
                await self.api.unload(source.name)
            except AdapterError as e:
                log.warning("event=adapter-unload-failed adapter=%s reason=%r", source.name, str(e))
        if failure is None and folder is not None:
            failure = await self._load(source.name, folder)
        state: State = "failed" if failure else "loaded"
        reason = failure or f"loaded from {folder} and answered a generation"
        self.adapters[source.name] = AdapterStatus(source, state, reason, print_, now)
        self._on_change(source.name, 1 if state == "loaded" else 0)
        log.log(logging.INFO if state == "loaded" else logging.WARNING, "event=adapter-%s adapter=%s reason=%r",
                state, source.name, reason)

    async def _fetch(self, source: AdapterSource) -> Path:
        if source.hub is not None and source.revision is not None:
            return await asyncio.to_thread(download_hub_adapter, source.hub, source.revision, self.hub_cache_dir)
        assert source.path is not None
        return inside_roots(source.path, self.roots)

    async def _load(self, name: str, folder: Path) -> str | None:
        """None when loaded and answering, else why not (and nothing of it left in vLLM)."""
        try:
            await asyncio.to_thread(check_adapter, folder, self._base(), self.max_rank)
            await self.api.load(name, folder)
        except AdapterError as e:
            return str(e)
        try:
            await self.api.generate(name)
        except AdapterError as e:
            with contextlib.suppress(AdapterError):
                await self.api.unload(name)
            return f"loaded but its generation failed: {e}"
        return None
