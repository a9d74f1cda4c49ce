"""The vLLM plugin registers the CUSTOM backend on vLLM 0.26 and stays out of the way elsewhere."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest
from flashmodel_kernels import vllm_plugin


class FakeRegistry(types.ModuleType):
    """Stands in for vllm.v1.attention.backends.registry: records register_backend calls."""

    def __init__(self) -> None:
        super().__init__("vllm.v1.attention.backends.registry")
        self.calls: list[tuple[str, str]] = []
        self.AttentionBackendEnum = types.SimpleNamespace(CUSTOM="CUSTOM")

    def register_backend(self, backend: str, class_path: str | None = None) -> None:
        assert class_path is not None
        self.calls.append((backend, class_path))


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[types.ModuleType, FakeRegistry]]:
    vllm = types.ModuleType("vllm")
    registry = FakeRegistry()
    modules = {
        "vllm": vllm,
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.attention": types.ModuleType("vllm.v1.attention"),
        "vllm.v1.attention.backends": types.ModuleType("vllm.v1.attention.backends"),
        "vllm.v1.attention.backends.registry": registry,
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield vllm, registry


def test_registers_custom_slot_on_vllm_026(
    fake_vllm: tuple[types.ModuleType, FakeRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    vllm, registry = fake_vllm
    vllm.__version__ = "0.26.0"  # type: ignore[attr-defined]
    with caplog.at_level(logging.INFO, logger="vllm.plugins.flashmodel_tile_attention"):
        vllm_plugin.register()
    assert registry.calls == [("CUSTOM", "flashmodel_kernels.vllm_backend.TileAttentionBackend")]
    assert "registered: slot=CUSTOM" in caplog.text


@pytest.mark.parametrize("version", ["0.32.0", "0.25.1", "dev", "1.26.0"])
def test_other_vllm_versions_are_left_alone(
    version: str, fake_vllm: tuple[types.ModuleType, FakeRegistry], caplog: pytest.LogCaptureFixture
) -> None:
    vllm, registry = fake_vllm
    vllm.__version__ = version  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="vllm.plugins.flashmodel_tile_attention"):
        vllm_plugin.register()
    assert registry.calls == []
    assert f"not registered: vllm={version}" in caplog.text


def test_backend_path_names_a_class_in_this_package() -> None:
    module, _, cls = vllm_plugin.BACKEND_CLASS_PATH.rpartition(".")
    assert module == "flashmodel_kernels.vllm_backend" and cls == "TileAttentionBackend"


@pytest.mark.parametrize(
    ("version", "ok"), [("0.26.0", True), ("0.26.3.dev12+g1234", True), ("0.27.0", False), ("0.2", False), ("", False)]
)
def test_version_gate(version: str, ok: bool) -> None:
    assert vllm_plugin.vllm_is_supported(version) is ok
