"""vLLM's facts about a model class, baked into the image so that a new pod does not derive them again.

Before it builds its config, vLLM's API server inspects the model class (does it support LoRA,
pipeline parallelism, ...) in a subprocess that imports vLLM a second time, and caches the answer
under $VLLM_CACHE_ROOT/modelinfos/, keyed by a hash of the model's source file. An engine pod's
cache lives on an emptyDir, so every new pod pays that import: most of the API server's start
(docs/benchmarks/engine.md, "Start-up with baked model facts"). The image runs the
same inspection once at build time (`python -m flashmodel_engine bake-modelinfos`); the launcher
copies the answers into vLLM's cache before it spawns vLLM. vLLM checks the hash itself, so a file
baked for another vLLM build is ignored and inspected again, never trusted.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("flashmodel.modelinfos")

SEED_ENV = "FLASHMODEL_VLLM_MODELINFOS"
DEFAULT_SEED = "/opt/flashmodel/vllm-modelinfos"
SUBDIR = "modelinfos"  # vLLM's folder under VLLM_CACHE_ROOT (registry._get_cache_dir)
BAKED_BY = "flashmodel_engine bake-modelinfos"  # an extra key vLLM ignores; shows where a file came from


def vllm_cache_root(env: Mapping[str, str]) -> Path:
    """Where vLLM started with `env` keeps its cache (vllm/envs.py: VLLM_CACHE_ROOT)."""
    if env.get("VLLM_CACHE_ROOT"):
        return Path(env["VLLM_CACHE_ROOT"]).expanduser()
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(env.get("XDG_CACHE_HOME") or os.path.join(home, ".cache")) / "vllm"


def seed_modelinfos(env: Mapping[str, str]) -> list[str]:
    """Copy the baked facts that vLLM's cache lacks; returns the files copied.

    A file already in the cache is left alone (vLLM wrote it, or an earlier start copied it). A
    cache that cannot be written costs only the inspection, so errors are logged, not raised."""
    seed = Path(env.get(SEED_ENV) or DEFAULT_SEED)
    if not seed.is_dir():
        return []
    target = vllm_cache_root(env) / SUBDIR
    copied: list[str] = []
    try:
        for baked in sorted(seed.glob("*.json")):
            if not (target / baked.name).exists():
                target.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(baked, target / baked.name)
                copied.append(baked.name)
    except OSError as e:
        log.warning("event=modelinfos-seed-failed seed=%s target=%s reason=%r", seed, target, str(e))
    if copied:
        log.info("event=modelinfos-seeded target=%s files=%s", target, ",".join(copied))
    return copied


def bake_modelinfos(architectures: list[str], into: Path) -> list[Path]:
    """Run vLLM's own inspection for each architecture and keep its cache files in `into`.

    Imports vLLM (in this process, with VLLM_CACHE_ROOT pointed at a scratch folder first)."""
    before = os.environ.get("VLLM_CACHE_ROOT")
    try:
        with tempfile.TemporaryDirectory() as scratch:
            os.environ["VLLM_CACHE_ROOT"] = scratch
            return _bake(architectures, Path(scratch), into)
    finally:
        if before is None:
            os.environ.pop("VLLM_CACHE_ROOT", None)
        else:
            os.environ["VLLM_CACHE_ROOT"] = before


def _bake(architectures: list[str], scratch: Path, into: Path) -> list[Path]:
    from vllm.model_executor.models.registry import ModelRegistry

    unknown = [a for a in architectures if a not in ModelRegistry.models]
    if unknown:
        raise ValueError(f"vLLM has no model class for {', '.join(unknown)}")
    for arch in architectures:
        try:
            ModelRegistry.models[arch].inspect_model_cls()
        except Exception as e:  # a family that cannot load on the build host must not cost the others
            log.warning("event=modelinfos-skipped architecture=%s reason=%r", arch, str(e)[-300:])
    into.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for cached in sorted((scratch / SUBDIR).glob("*.json")):
        data = json.loads(cached.read_text())
        data["bakedBy"] = BAKED_BY
        out = into / cached.name
        out.write_text(json.dumps(data, indent=1))
        out.chmod(0o644)  # vLLM writes 0600; pods run as another uid than the image build
        written.append(out)
    if len(written) < len(architectures):
        # vLLM caches only classes whose source file it can hash; the rest it inspects every start.
        log.warning("event=modelinfos-partial architectures=%d files=%d", len(architectures), len(written))
    return written
