"""The README's first command works: `--objects-only` shows the examples' objects, the full demo serves."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from e2e.harness.demo import MODEL, engine_log_tail

ROOT = Path(__file__).resolve().parents[1]


def _demo(*args: str, timeout: float) -> tuple[int, str, float]:
    """Runs the driver the way scripts/demo.sh does (this interpreter, this checkout); (rc, output, seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "engine", "kernels", "."))}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "e2e.harness.demo", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout, check=False)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


@pytest.mark.usefixtures("testbin")
def test_objects_only_shows_every_example_and_its_children() -> None:
    rc, out, seconds = _demo("--objects-only", timeout=240)
    print(f"bench: demo --objects-only {seconds:.1f}s")
    assert rc == 0, out[-4000:]
    names = [d["metadata"]["name"] for f in sorted((ROOT / "examples").glob("*.yaml"))
             for d in yaml.safe_load_all(f.read_text()) if d and d.get("kind") == "FlashModel"]
    assert {"qwen-chat", "qwen-mini", "tiny-cpu", "llama-gated"} <= set(names)
    for name in names:
        assert re.search(rf"^{name}\s+(True|False)\s+\d/\d\s+(t4|cpu)\s", out, re.MULTILINE), (name, out[-4000:])
        assert f"deployment.apps/{name}" in out and f"service/{name}" in out, out[-4000:]
        assert re.search(rf"^  {name}: --model \S+", out, re.MULTILINE), out[-4000:]
    # Every example pod was placed on a fake T4 node before the listing.
    pods = re.findall(r"^pod/\S+\s+\S+\s+(\S+)\s+\d+\s+\S+\s+\S+\s+(\S+)", out, re.MULTILINE)
    assert len(pods) == len(names) and all(node.startswith("t4-node-") for _, node in pods), pods
    assert "Act 1" not in out, "--objects-only must start no engine"


def test_the_script_refuses_an_unknown_argument_and_says_what_it_takes() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "--serve-harder"], capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 2
    assert "--objects-only" in proc.stderr and "--keep" in proc.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("testbin")
def test_the_full_demo_answers_and_replaces_a_diverging_pod_without_a_failed_request(engine_python: str) -> None:
    """Slow (about 4 min warm on two cores): the whole demo, a control plane, the operator and two real
    vLLM engines loading at once, then one engine's memory grows and its replacement loads and prewarms."""
    rc, out, seconds = _demo("--engine-python", engine_python, timeout=900)
    print(f"bench: full demo {seconds:.1f}s")
    assert rc == 0, out[-6000:]
    # Act 1: the gate opened on both pods, the model is Ready 2/2, and the model answered.
    assert len(re.findall(r"gate serving\.flashmodel\.io/prewarmed: .* -> True", out)) >= 2, out[-6000:]
    assert re.search(rf"^{MODEL}\s+True\s+2/2\s+cpu\s+{MODEL}\s", out, re.MULTILINE), out[-6000:]
    ttfts = re.findall(r"^  \S+\s+True\s+([\d.]+) ms\s+([\d.]+) ms$", out, re.MULTILINE)
    assert len(ttfts) == 2 and all(float(c) > 0 and float(w) > 0 for c, w in ttfts), ttfts
    assert re.search(r"^HTTP 200 in \d+ ms: .*\"finish_reason\"", out, re.MULTILINE), out[-6000:]
    assert "The same request without the key: HTTP 401" in out
    # Act 2: drained, evicted, replaced, and the client lost nothing.
    assert "Remediated" in out and "MemoryDivergence" in out, out[-6000:]
    assert re.search(r"gone \(deleted\)", out), out[-6000:]
    counts = re.search(r"accepted=(\d+) completed=(\d+) failed=(\d+)", out)
    assert counts, out[-6000:]
    assert int(counts[3]) == 0 and int(counts[2]) > 10, counts[0]


def test_the_heartbeat_names_the_engines_stage_not_a_line_inside_a_dump(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    assert engine_log_tail(log) == "(no log yet)"
    log.write_text(
        "ts=2026-12-04 20:05:52,245 level=INFO component=flashmodel.launcher event=engine-spawned pid=1\n"
        "(APIServer pid=16496) INFO 12-04 20:02:35 [compilation.py:317] Enabled custom fusions: norm_quant\n"
        "(EngineCore pid=17764) INFO 12-04 20:03:11 [ompmultiprocessing.py:185] OpenMP thread binding info: \n"
        "(EngineCore pid=17764) INFO 12-04 20:03:11 [ompmultiprocessing.py:185] \treserved_cpus=[]\n"
        "Triton is installed, but doesn't include CPU backend. Disabling Triton.\n"
    )
    assert engine_log_tail(log) == "OpenMP thread binding info: "


def test_without_an_engine_venv_the_demo_says_to_run_setup_engine_before_starting_anything(tmp_path: Path) -> None:
    rc, out, _ = _demo("--engine-python", str(tmp_path / "venv-engine" / "bin" / "python"), timeout=60)
    assert rc == 1
    assert "run `bash scripts/setup-engine.sh`" in out and "--objects-only" in out, out
    assert "control plane" not in out, "nothing may start before the check"
