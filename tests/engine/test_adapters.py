"""The adapter checks and the reconcile of PUT /adapters, against a fake vLLM (fault injection, no engine)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from flashmodel_engine.adapters import (
    AdapterError,
    AdapterRegistry,
    AdapterSet,
    AdapterSource,
    BadAdapterSet,
    BaseShapes,
    check_adapter,
    inside_roots,
    parse_adapter_set,
    set_hash,
)

from tests.support.tiny_adapter import build_tiny_adapter, corrupt_adapter

TINY_CONFIG = {"model_type": "qwen2", "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 256, "num_hidden_layers": 2}
BASE = BaseShapes.from_config(TINY_CONFIG)
SHA = "0123456789abcdef0123456789abcdef01234567"


# -- the body ---------------------------------------------------------------------------------------


def parse(body: object, max_adapters: int = 8) -> AdapterSet:
    return parse_adapter_set(json.dumps(body).encode(), served_name="tiny", max_adapters=max_adapters)


def test_a_set_parses_path_and_hub_adapters() -> None:
    s = parse({"adapters": [{"name": "a", "path": "/adapters/a"}, {"name": "b", "hub": "org/b", "revision": SHA}]})
    assert [a.name for a in s.adapters] == ["a", "b"]


@pytest.mark.parametrize(("body", "says"), [
    ({"adapters": [{"name": "a", "hub": "org/a", "revision": "main"}]}, "40-hex commit"),
    ({"adapters": [{"name": "a", "hub": "org/a"}]}, "40-hex commit"),
    ({"adapters": [{"name": "a"}]}, "exactly one of path or hub"),
    ({"adapters": [{"name": "a", "path": "/x", "hub": "org/a", "revision": SHA}]}, "exactly one of path or hub"),
    ({"adapters": [{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}]}, "repeated: a"),
    ({"adapters": [{"name": "tiny", "path": "/x"}]}, "base model's served name"),
    ({"adapters": [{"name": "../x", "path": "/x"}]}, "name"),
    ({"adapters": [{"name": "a", "path": "/x", "size": 3}]}, "size"),
    ({"adapter": []}, "adapters"),
])
def test_a_malformed_set_is_refused_with_what_to_change(body: object, says: str) -> None:
    with pytest.raises(BadAdapterSet, match=says):
        parse(body)


def test_more_adapters_than_the_engine_holds_are_refused() -> None:
    with pytest.raises(BadAdapterSet, match=r"at most 1 .*maxCpuLoras"):
        parse({"adapters": [{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}]}, max_adapters=1)


def test_the_sets_hash_ignores_order_and_sees_changes() -> None:
    one = parse({"adapters": [{"name": "a", "path": "/a"}, {"name": "b", "path": "/b"}]})
    two = parse({"adapters": [{"name": "b", "path": "/b"}, {"name": "a", "path": "/a"}]})
    three = parse({"adapters": [{"name": "a", "path": "/a"}, {"name": "b", "path": "/c"}]})
    assert set_hash(one) == set_hash(two) != set_hash(three)


# -- one adapter's checks ---------------------------------------------------------------------------


def test_a_tiny_adapter_passes(tmp_path: Path) -> None:
    check_adapter(build_tiny_adapter(tmp_path / "a", target_modules=tuple(BASE.modules)), BASE, max_rank=8)


def edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **changes}))


@pytest.mark.parametrize(("change", "says"), [
    ({"r": 16}, "r is 16, above lora.maxRank 8"),
    ({"rank_pattern": {"q_proj": 32}}, r"rank_pattern\[q_proj\] is 32"),
    ({"target_modules": ["q_proj", "query_key_value"]}, r"\['query_key_value'\] are not modules of the base"),
    ({"peft_type": "IA3"}, "only LORA"),
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"r": "8"}, "positive integer"),
])
def test_a_config_the_engine_cannot_serve_is_refused(tmp_path: Path, change: dict[str, object], says: str) -> None:
    folder = build_tiny_adapter(tmp_path / "a")
    edit_config(folder, **change)
    with pytest.raises(AdapterError, match=says):
        check_adapter(folder, BASE, max_rank=8)


def test_weights_of_another_model_are_refused(tmp_path: Path) -> None:
    folder = build_tiny_adapter(tmp_path / "a", dims={"q_proj": (256, 256)})
    with pytest.raises(AdapterError, match=r"layer 0 q_proj: lora_A \[8, 256\] .* another model"):
        check_adapter(folder, BASE, max_rank=8)


def test_more_layers_than_the_base_are_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="layer 2; the base model has 2 layers"):
        check_adapter(build_tiny_adapter(tmp_path / "a", layers=3), BASE, max_rank=8)


def test_a_truncated_weights_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AdapterError, match="truncated"):
        check_adapter(corrupt_adapter(tmp_path / "a"), BASE, max_rank=8)


def test_missing_files_are_named(tmp_path: Path) -> None:
    folder = build_tiny_adapter(tmp_path / "a")
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    with pytest.raises(AdapterError, match="pickle"):
        check_adapter(folder, BASE, max_rank=8)
    (folder / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"adapter_config\.json is missing"):
        check_adapter(folder, BASE, max_rank=8)


def test_an_unknown_architecture_is_refused() -> None:
    with pytest.raises(AdapterError, match="model_type 'gpt2'"):
        BaseShapes.from_config({**TINY_CONFIG, "model_type": "gpt2"})


def test_paths_stay_inside_the_roots(tmp_path: Path) -> None:
    root = tmp_path / "adapters"
    (root / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "link").symlink_to(tmp_path / "elsewhere")
    assert inside_roots(str(root / "a"), [str(root)]) == root / "a"
    with pytest.raises(AdapterError, match=r"without '\.\.'"):
        inside_roots(f"{root}/a/../../elsewhere", [str(root)])
    with pytest.raises(AdapterError, match="must be absolute"):
        inside_roots("adapters/a", [str(root)])
    with pytest.raises(AdapterError, match="outside the adapter folders"):
        inside_roots(str(root / "link"), [str(root)])


# -- the reconcile ----------------------------------------------------------------------------------


class FakeVllm:
    """vLLM's runtime LoRA API with injectable failures; records every call."""

    def __init__(self) -> None:
        self.loaded: dict[str, Path] = {}
        self.calls: list[str] = []
        self.refuse_load: set[str] = set()
        self.refuse_generate: set[str] = set()
        self.in_flight = 0
        self.most_in_flight = 0

    async def load(self, name: str, path: Path) -> None:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        self.calls.append(f"load {name}")
        if name in self.refuse_load:
            raise AdapterError("vLLM refused to load it (400: boom)")
        self.loaded[name] = path

    async def unload(self, name: str) -> None:
        self.calls.append(f"unload {name}")
        self.loaded.pop(name, None)

    async def generate(self, name: str) -> None:
        self.calls.append(f"generate {name}")
        if name in self.refuse_generate or name not in self.loaded:
            raise AdapterError("a generation through it answered 500")


class Harness:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.vllm = FakeVllm()
        self.gauge: dict[str, float] = {}
        self.generation = 1
        self.registry = AdapterRegistry(
            self.vllm, base=lambda: BASE, max_rank=8, max_adapters=8, roots=[str(root)],
            hub_cache_dir=str(root / "hub"), generation=lambda: self.generation,
            on_change=self.record)

    def record(self, name: str, value: float | None) -> None:
        if value is None:
            self.gauge.pop(name)
        else:
            self.gauge[name] = value

    def put(self, *names: str) -> dict[str, tuple[str, str]]:
        desired = AdapterSet(adapters=[AdapterSource(name=n, path=str(self.root / n)) for n in names])
        answer = asyncio.run(self.registry.reconcile(desired))
        return {a["name"]: (a["state"], a["reason"]) for a in answer["adapters"]}


@pytest.fixture
def harness(tmp_path: Path) -> Harness:
    for seed, name in enumerate(("a", "b", "c"), start=1):
        build_tiny_adapter(tmp_path / name, seed=seed)
    return Harness(tmp_path)


def test_new_adapters_are_loaded_and_tried(harness: Harness) -> None:
    got = harness.put("a", "b")
    assert {n: s for n, (s, _) in got.items()} == {"a": "loaded", "b": "loaded"}
    assert harness.vllm.calls == ["load a", "generate a", "load b", "generate b"]
    assert harness.gauge == {"a": 1, "b": 1}


def test_an_unchanged_set_calls_nothing(harness: Harness) -> None:
    harness.put("a", "b")
    harness.vllm.calls.clear()
    harness.put("b", "a")
    assert harness.vllm.calls == []


def test_a_removed_adapter_is_unloaded_and_its_series_removed(harness: Harness) -> None:
    harness.put("a", "b")
    harness.vllm.calls.clear()
    assert list(harness.put("a")) == ["a"]
    assert harness.vllm.calls == ["unload b"]
    assert harness.gauge == {"a": 1}


def test_a_changed_adapter_is_reloaded(harness: Harness) -> None:
    harness.put("a")
    harness.vllm.calls.clear()
    build_tiny_adapter(harness.root / "a", seed=42)  # the weekly retrain, same path
    import os
    st = (harness.root / "a" / "adapter_model.safetensors").stat()
    os.utime(harness.root / "a" / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    harness.put("a")
    assert harness.vllm.calls == ["unload a", "load a", "generate a"]


def test_one_failure_leaves_the_others_loaded(harness: Harness) -> None:
    harness.vllm.refuse_load.add("b")
    harness.vllm.refuse_generate.add("c")
    got = harness.put("a", "b", "c")
    assert got["a"][0] == "loaded"
    assert got["b"] == ("failed", "vLLM refused to load it (400: boom)")
    assert got["c"][0] == "failed" and "generation failed" in got["c"][1]
    assert set(harness.vllm.loaded) == {"a"}  # c was unloaded again: nothing half-served
    assert harness.gauge == {"a": 1, "b": 0, "c": 0}


def test_a_failed_adapter_is_tried_again_at_the_next_put(harness: Harness) -> None:
    harness.vllm.refuse_load.add("b")
    harness.put("a", "b")
    harness.vllm.refuse_load.clear()
    assert harness.put("a", "b")["b"][0] == "loaded"


def test_a_restarted_engine_reports_and_reloads(harness: Harness) -> None:
    harness.put("a")
    harness.generation = 2
    answer = harness.registry.answer()
    assert answer["adapters"][0]["state"] == "failed" and "restarted" in answer["adapters"][0]["reason"]
    assert harness.gauge == {"a": 0}
    harness.vllm.calls.clear()
    assert harness.put("a")["a"][0] == "loaded"
    assert harness.vllm.calls == ["load a", "generate a"]


def test_concurrent_puts_run_one_at_a_time(harness: Harness) -> None:
    async def both() -> None:
        one = AdapterSet(adapters=[AdapterSource(name="a", path=str(harness.root / "a"))])
        two = AdapterSet(adapters=[AdapterSource(name="b", path=str(harness.root / "b"))])
        await asyncio.gather(harness.registry.reconcile(one), harness.registry.reconcile(two))

    asyncio.run(both())
    assert harness.vllm.most_in_flight == 1
    assert set(harness.vllm.loaded) == {"b"}  # the later PUT is the set


def test_a_bad_adapter_is_reported_not_loaded(harness: Harness) -> None:
    corrupt_adapter(harness.root / "c")
    got = harness.put("a", "c")
    assert got["c"][0] == "failed" and "truncated" in got["c"][1]
    assert "load c" not in harness.vllm.calls


def test_prewarm_marks_an_adapter_that_stopped_answering_failed(harness: Harness) -> None:
    harness.put("a", "b")
    harness.vllm.refuse_generate.add("b")
    harness.vllm.calls.clear()
    asyncio.run(harness.registry.prewarm())
    assert harness.vllm.calls == ["generate a", "generate b"]
    got = {a["name"]: (a["state"], a["reason"]) for a in harness.registry.answer()["adapters"]}
    assert got["a"][0] == "loaded"
    assert got["b"][0] == "failed" and "prewarm generation failed" in got["b"][1]
    assert harness.gauge == {"a": 1, "b": 0}


def test_a_hub_adapter_that_cannot_be_downloaded_fails_alone(harness: Harness, monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    pytest.importorskip("huggingface_hub")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the real client, refusing at once instead of reaching the hub
    desired = AdapterSet(adapters=[AdapterSource(name="a", path=str(harness.root / "a")),
                                   AdapterSource(name="h", hub="org/weekly", revision=SHA)])
    got = {a["name"]: (a["state"], a["reason"]) for a in asyncio.run(harness.registry.reconcile(desired))["adapters"]}
    assert got["a"][0] == "loaded"
    assert got["h"][0] == "failed" and f"hub adapter org/weekly@{SHA} could not be downloaded" in got["h"][1]
    assert "load h" not in harness.vllm.calls
