"""The image's baked vLLM model facts: where the launcher copies them, and that vLLM takes them."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from flashmodel_engine.modelinfos import BAKED_BY, SEED_ENV, seed_modelinfos, vllm_cache_root

from tests.engine.conftest import REPO

NAME = "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json"


def test_the_cache_root_follows_vllms_own_rules() -> None:
    assert vllm_cache_root({"VLLM_CACHE_ROOT": "/x/vllm", "HOME": "/h"}) == Path("/x/vllm")
    assert vllm_cache_root({"XDG_CACHE_HOME": "/xdg", "HOME": "/h"}) == Path("/xdg/vllm")
    # The operator's engine pods: HOME=/cache on an emptyDir, nothing else set.
    assert vllm_cache_root({"HOME": "/cache"}) == Path("/cache/.cache/vllm")


def test_seeding_fills_only_what_the_cache_lacks(tmp_path: Path) -> None:
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / NAME).write_text('{"hash": "baked"}')
    (seed / "other.json").write_text('{"hash": "baked-too"}')
    (seed / "notes.txt").write_text("not a cache file")
    env = {SEED_ENV: str(seed), "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    target = tmp_path / "cache" / "modelinfos"
    target.mkdir(parents=True)
    (target / "other.json").write_text('{"hash": "vllm wrote this"}')

    assert seed_modelinfos(env) == [NAME]
    assert (target / NAME).read_text() == '{"hash": "baked"}'
    assert (target / "other.json").read_text() == '{"hash": "vllm wrote this"}'  # never overwritten
    assert not (target / "notes.txt").exists()
    assert seed_modelinfos(env) == []  # a second start finds everything in place


def test_no_seed_or_an_unwritable_cache_costs_only_the_inspection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert seed_modelinfos({SEED_ENV: str(tmp_path / "absent"), "VLLM_CACHE_ROOT": str(tmp_path)}) == []
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / NAME).write_text("{}")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    with caplog.at_level(logging.WARNING):
        assert seed_modelinfos({SEED_ENV: str(seed), "VLLM_CACHE_ROOT": str(blocked)}) == []
    assert "modelinfos-seed-failed" in caplog.text


# vLLM's registry with its inspection subprocess forbidden: it must answer from the cache or fail.
_INSPECT_FROM_CACHE_ONLY = """
from vllm.model_executor.models import registry
def forbidden(fn):
    raise SystemExit("vLLM inspected the class again: the cache was not used")
registry._run_in_subprocess = forbidden
info = registry.ModelRegistry.models["Qwen2ForCausalLM"].inspect_model_cls()
print(info.architecture)
"""


@pytest.mark.usefixtures("engine_packages")
def test_vllm_takes_the_baked_facts_and_refuses_stale_ones(baked_modelinfos: Path, tmp_path: Path) -> None:
    [baked] = baked_modelinfos.glob("*.json")
    assert baked.name == NAME and baked.stat().st_mode & 0o777 == 0o644
    data = json.loads(baked.read_text())
    assert data["bakedBy"] == BAKED_BY and data["modelinfo"]["architecture"] == "Qwen2ForCausalLM"

    def inspect(cache: Path) -> subprocess.CompletedProcess[str]:
        env = os.environ | {"VLLM_CACHE_ROOT": str(cache), "PYTHONPATH": str(REPO / "engine")}
        return subprocess.run([sys.executable, "-c", _INSPECT_FROM_CACHE_ONLY], env=env, capture_output=True,
                              text=True, timeout=300)

    fresh = tmp_path / "fresh"
    assert seed_modelinfos({SEED_ENV: str(baked_modelinfos), "VLLM_CACHE_ROOT": str(fresh)}) == [NAME]
    taken = inspect(fresh)
    assert taken.returncode == 0, taken.stderr[-2000:]
    assert taken.stdout.strip().splitlines()[-1] == "Qwen2ForCausalLM"

    stale = tmp_path / "stale"
    (stale / "modelinfos").mkdir(parents=True)
    (stale / "modelinfos" / NAME).write_text(json.dumps(data | {"hash": "0" * 32}))
    refused = inspect(stale)
    assert refused.returncode != 0 and "the cache was not used" in refused.stderr


# A bake where one family's class cannot load (as a model module might not on a build host).
_BAKE_WITH_ONE_BROKEN = """
import sys
from pathlib import Path
from vllm.model_executor.models import registry
from flashmodel_engine.modelinfos import bake_modelinfos
class Broken:
    def inspect_model_cls(self):
        raise RuntimeError("this family's module does not import here")
registry.ModelRegistry.models["LlamaForCausalLM"] = Broken()
for path in bake_modelinfos(["LlamaForCausalLM", "Qwen2ForCausalLM"], Path(sys.argv[1])):
    print("baked", path.name)
"""


@pytest.mark.usefixtures("engine_packages")
def test_one_family_that_cannot_load_does_not_cost_the_others(tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(REPO / "engine")}
    done = subprocess.run([sys.executable, "-c", _BAKE_WITH_ONE_BROKEN, str(tmp_path / "baked")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # Some vLLM versions (0.26) log to stdout too: only the script's own lines count.
    baked = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("baked ")]
    assert baked == [NAME]
    assert "modelinfos-skipped architecture=LlamaForCausalLM" in done.stderr
