"""Root pytest set-up: the parts a test needs (control plane, engine venv) as fixtures, and the test tiers.

A test's tier follows from the fixtures it uses (directly, through other fixtures, or through an
autouse fixture of its folder) and from what its module imports, never from a list:

  unit           neither part: runs in a light venv (the operator's deps) in a minute or two
  control-plane  `testbin` (every cluster fixture builds on it): the real API server, helm, KEDA
  engine         `engine_packages` or `engine_python`, or a module whose import reaches torch,
                 Triton or vLLM: the engine venv (scripts/setup-engine.sh)
  e2e            both: real engines behind the real control plane (self-healing, autoscaling, demo)

`--tier NAME` (repeatable) runs only those tiers. A missing part skips the tests that need it,
saying what to run; with FLASHMODEL_REQUIRE_ALL=1 (scripts/test.sh sets it for the full run) it
fails them instead, so CI cannot pass green with a part absent.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from e2e.harness.cluster import ControlPlane, missing_binaries, testbin_dir
from e2e.harness.kubelet import engine_python as engine_venv_python
from tests.support.parts import engine_venv_problem, missing_part

TIERS = ("unit", "control-plane", "engine", "e2e")
CONTROL_PLANE_FIXTURES = frozenset({"testbin"})
ENGINE_FIXTURES = frozenset({"engine_packages", "engine_python"})
ENGINE_PACKAGES = ("torch", "triton", "vllm")
# Modules of this checkout, followed when looking for what a test module's import reaches.
PROJECT_PACKAGES = frozenset(
    {"flashmodel_operator", "flashmodel_engine", "flashmodel_kernels", "bench", "tests", "e2e"}
)
# Hand-placed markers that say the same as the fixtures, for a test that starts a part itself.
NEEDS_MARKERS = {"e2e": "control-plane", "vllm": "engine"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        action="append",
        choices=TIERS,
        default=[],
        help="run only the tests of this tier (repeatable): " + ", ".join(TIERS),
    )


def _reaches_engine_packages(module: ModuleType, seen: set[str]) -> bool:
    """Whether importing `module` imported torch, Triton or vLLM, following this checkout's modules."""
    for value in vars(module).values():
        try:
            name = value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        except Exception:  # an object whose attributes are computed (a proxy) names no module
            continue
        if not isinstance(name, str) or name in seen:
            continue
        seen.add(name)
        top = name.partition(".")[0]
        if top in ENGINE_PACKAGES:
            return True
        inner = sys.modules.get(name)
        if top in PROJECT_PACKAGES and inner is not None and _reaches_engine_packages(inner, seen):
            return True
    return False


def tier_of(item: pytest.Item) -> str:
    names = set(getattr(item, "fixturenames", ()))
    marked = {NEEDS_MARKERS[m.name] for m in item.iter_markers() if m.name in NEEDS_MARKERS}
    control_plane = bool(CONTROL_PLANE_FIXTURES & names) or "control-plane" in marked
    module = getattr(item, "module", None)
    engine = (
        bool(ENGINE_FIXTURES & names)
        or "engine" in marked
        or (module is not None and _reaches_engine_packages(module, set()))
    )
    if control_plane and engine:
        return "e2e"
    return "control-plane" if control_plane else "engine" if engine else "unit"


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # In the light venv of the unit tier a module that imports torch, Triton or vLLM cannot be
    # imported at all; it belongs to the engine tier, so it is left out here rather than an error.
    report: pytest.CollectReport = yield
    if (
        report.failed
        and collector.config.getoption("tier") == ["unit"]
        and isinstance(collector, pytest.Module | pytest.Package)
    ):
        text = str(report.longrepr)
        for package in ENGINE_PACKAGES:
            if f"No module named '{package}" in text:
                report.outcome = "skipped"
                report.longrepr = (str(collector.path), 0, f"engine tier: imports {package} (the engine venv)")
                break
    return report


TIER_KEY = pytest.StashKey[str]()
FAILED_TIER = pytest.StashKey[str]()
DURATIONS = pytest.StashKey[dict[str, dict[str, float]]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = set(config.getoption("tier"))
    selected: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        tier = tier_of(item)
        item.stash[TIER_KEY] = tier
        item.add_marker(pytest.mark.tier(tier))
        # The marks let `-m "not control_plane"` keep a run free of any cluster.
        if tier in ("control-plane", "e2e"):
            item.add_marker(pytest.mark.control_plane)
        if tier in ("engine", "e2e"):
            item.add_marker(pytest.mark.engine)
        (selected if not wanted or tier in wanted else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    # Tier by tier, in TIERS order (stable, so each tier keeps its files' order): one run of several
    # tiers shares the session's control plane and stops at the first tier that fails.
    items[:] = sorted(selected, key=lambda item: TIERS.index(item.stash[TIER_KEY]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, object, object]:
    result = yield
    # Only where tiers were asked for: a plain `pytest PATH` runs all it selected, as pytest does.
    failed = item.config.stash.get(FAILED_TIER, None) if item.config.getoption("tier") else None
    if failed is not None and (nextitem is None or nextitem.stash.get(TIER_KEY, failed) != failed):
        item.session.shouldstop = f"the {failed} tier failed, so the tiers after it do not run"
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    tier = item.stash.get(TIER_KEY, "unit")
    durations = item.config.stash.setdefault(DURATIONS, {})
    tier_durations = durations.setdefault(tier, {})
    tier_durations[item.nodeid] = tier_durations.get(item.nodeid, 0.0) + report.duration
    if report.failed and FAILED_TIER not in item.config.stash:
        item.config.stash[FAILED_TIER] = tier
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # One run of several tiers: the slowest tests of each tier, so each tier's time is read apart.
    durations = terminalreporter.config.stash.get(DURATIONS, {})
    if len(durations) < 2:
        return
    for tier in TIERS:
        if tier not in durations:
            continue
        ranked = sorted(durations[tier].items(), key=lambda kv: kv[1], reverse=True)[:10]
        total = sum(durations[tier].values())
        terminalreporter.write_sep("=", f"tier {tier}: {len(durations[tier])} tests, {total:.0f} s, slowest 10")
        for nodeid, seconds in ranked:
            terminalreporter.write_line(f"{seconds:8.2f}s {nodeid}")


@pytest.fixture(scope="session")
def testbin() -> Path:
    """The control-plane binaries (scripts/testbin.sh): built here where missing, unless FLASHMODEL_SKIP_E2E=1."""
    if os.environ.get("FLASHMODEL_SKIP_E2E") == "1":
        missing_part("FLASHMODEL_SKIP_E2E=1 is set: the real control plane is not started")
    bin_dir = testbin_dir(build=True)
    if missing := missing_binaries(bin_dir):
        missing_part(f"the testbin at {bin_dir} lacks {', '.join(missing)}: run scripts/testbin.sh")
    return bin_dir


@pytest.fixture(scope="session")
def engine_packages() -> None:
    """torch, Triton and vLLM importable in this interpreter: the test runs in the engine venv."""
    absent = [p for p in ENGINE_PACKAGES if importlib.util.find_spec(p) is None]
    if absent:
        missing_part(
            f"{', '.join(absent)} not importable by {sys.executable}: run scripts/setup-engine.sh "
            f"and pytest with {engine_venv_python()}"
        )


@pytest.fixture(scope="session")
def engine_python() -> str:
    """The engine venv's Python, for engines started as subprocesses (EngineKubelet, the demo, the SLO bench)."""
    python = engine_venv_python()
    problem = engine_venv_problem(python)
    if problem is not None:
        missing_part(problem)
    return python


@pytest.fixture(scope="session")
def control_plane(testbin: Path) -> Iterator[ControlPlane]:
    """A started control plane with FLASHMODEL_E2E_T4_NODES (default 3) fake one-GPU T4 nodes."""
    with ControlPlane(testbin) as cp:
        cp.add_t4_nodes(int(os.environ.get("FLASHMODEL_E2E_T4_NODES", "3")))
        yield cp


@pytest.fixture
def k8s_namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test; deleted afterwards, waiting until its pods are gone."""
    name = control_plane.create_namespace(request.node.name)
    yield name
    # Waiting keeps tests independent: pods of a dying namespace still hold fake GPU nodes.
    control_plane.delete_namespace(name)
