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
        # NAME READY AVAILABLE REPLICAS ACCELERATOR ...
        row = rf"^{name}\s+(True|False)\s+(True|False)\s+\d/\d\s+(t4|cpu)\s"
        assert re.search(row, out, re.MULTILINE), (name, out[-4000:])
        assert f"deployment.apps/{name}" in out and f"service/{name}" in out, out[-4000:]
        assert re.search(rf"^  {name}: --model \S+", out, re.MULTILINE), out[-4000:]
    # Every example pod was placed on a fake T4 node before the listing.
    pods = re.findall(r"^pod/\S+\s+\S+\s+(\S+)\s+\d+\s+\S+\s+\S+\s+(\S+)", out, re.MULTILINE)
    assert len(pods) == len(names) and all(node.startswith("t4-node-") for _, node in pods), pods
    assert "Act 1" not in out, "--objects-only must start no engine"
    # It ends with what to do next, not with a promise of acts it does not run.
    assert "the next acts run real ones" not in out
    assert "Next:" in out and "bash scripts/demo.sh --keep" in out, out[-2000:]


def test_the_script_refuses_an_unknown_argument_and_says_what_it_takes() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "demo.sh"), "--serve-harder"], capture_output=True,
                          text=True, timeout=30, check=False)
    assert proc.returncode == 2
    assert "--objects-only" in proc.stderr and "--keep" in proc.stderr


@pytest.mark.slow
@pytest.mark.usefixtures("testbin")
def test_the_full_demo_answers_and_replaces_a_diverging_pod_without_a_failed_request(engine_python: str) -> None:
    """Slow (about 4 min warm on two cores): the whole demo, a control plane, the operator and two real
    vLLM engines loading at once (one serves, one stands by), then the serving engine's memory grows,
    the standby takes its place and a new standby starts loading."""
    rc, out, seconds = _demo("--engine-python", engine_python, timeout=900)
    print(f"bench: full demo {seconds:.1f}s")
    assert rc == 0, out[-6000:]
    # Act 1: the serving pod's gate opened, the second prewarmed pod waits as the standby, the model
    # is Ready 1/1, and the model answered.
    assert re.search(r"gate serving\.flashmodel\.io/prewarmed: .* -> True \(PrewarmSucceeded", out), out[-6000:]
    assert re.search(r"gate serving\.flashmodel\.io/prewarmed: .* -> False \(Standby: ", out), out[-6000:]
    assert re.search(rf"^{MODEL}\s+True\s+True\s+1/1\s+cpu\s+{MODEL}\s", out, re.MULTILINE), out[-6000:]
    rows = re.findall(r"^  (\S+)\s+True\s+(serving|standby)\s+([\d.]+) ms\s+([\d.]+) ms$", out, re.MULTILINE)
    assert sorted(role for _, role, _, _ in rows) == ["serving", "standby"], rows
    assert all(float(c) > 0 and float(w) > 0 for _, _, c, w in rows), rows
    assert "status.standbyReplicas: 1" in out
    assert re.search(r"^HTTP 200 in \d+ ms: .*\"finish_reason\"", out, re.MULTILINE), out[-6000:]
    assert "The same request without the key: HTTP 401" in out
    # The printed curl works pasted into a shell: $KEY inside double quotes is expanded.
    assert '-H "Authorization: Bearer $KEY"' in out, out[-6000:]
    # Act 2: the act-1 standby promoted before the diverging pod's gate closed, then the eviction,
    # and the client lost nothing.
    (server,) = [name for name, role, _, _ in rows if role == "serving"]
    (standby,) = [name for name, role, _, _ in rows if role == "standby"]
    # The timeline's offsets, not its line order: both gate changes can land in one sample of the
    # watcher, which then prints them in pod-name order.
    def seen_at(line_start: str) -> float:
        found = re.search(rf"^  \+\s*([\d.]+)s  {re.escape(line_start)}", out, re.MULTILINE)
        assert found, (line_start, out[-6000:])
        return float(found[1])

    promoted = seen_at(f"pod {standby}: gate serving.flashmodel.io/prewarmed: False (Standby: ")
    drained = seen_at(f"pod {server}: gate serving.flashmodel.io/prewarmed: True (PrewarmSucceeded: ")
    assert promoted <= drained, out[-6000:]
    # What the order is for: the Service never ran out of ready endpoints while the client sent.
    fewest = re.search(r"fewest-ready-endpoints=(\d+)", out)
    assert fewest and int(fewest[1]) >= 1, out[-6000:]
    assert "-> True (Promoted: standby promoted in place of pod " + server in out, out[-6000:]
    assert re.search(rf"pod {server}: .* -> False \(MemoryDivergence: draining", out), out[-6000:]
    assert "Remediated" in out and "MemoryDivergence" in out, out[-6000:]
    assert re.search(rf"pod {server}: gone \(deleted\)", out), out[-6000:]
    replaced = re.search(r"^Replaced in (\d+)s", out, re.MULTILINE)
    assert replaced, out[-6000:]
    print(f"bench: demo act 2, divergence -> standby serving and diverging pod evicted: {replaced[1]}s")
    counts = re.search(r"accepted=(\d+) completed=(\d+) failed=(\d+)", out)
    assert counts, out[-6000:]
    assert int(counts[3]) == 0 and int(counts[2]) > 10, counts[0]
    assert "Next:" in out and "bash scripts/demo.sh --keep" in out, out[-2000:]


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
