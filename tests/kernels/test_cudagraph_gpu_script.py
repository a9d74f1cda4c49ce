"""The GPU proof script's judgements, on the CPU: what it calls a fallback, a rounding flip, a pass."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest

from bench.kernels.cudagraph_gpu import (
    ROOT,
    compare_greedy,
    fallback_lines,
    goodput_at_rates,
    plugin_site,
    summarize_decode,
)

# The issue's line: vLLM 0.26 cutting graphs back for a backend that declared NEVER.
ISSUE_LINE = (
    "WARNING 12-04 10:01:02 [compilation.py:1423] CUDAGraphMode.FULL_AND_PIECEWISE is not supported with "
    "TileAttentionBackend backend (support: AttentionCGSupport.NEVER); setting cudagraph_mode=PIECEWISE"
)


def test_the_issue_log_line_is_a_fallback_and_capture_lines_are_not() -> None:
    log = "\n".join(
        [
            "INFO [gpu_model_runner.py] Capturing CUDA graphs (decode, FULL): 100%",
            "INFO flashmodel tile attention CUDA graphs (uniform decode): max_model_len=4096 sizes=1 splits=32",
            ISSUE_LINE,
        ]
    )
    assert fallback_lines(log) == [ISSUE_LINE]


def completion(tokens: list[str], top: list[dict[str, float]] | None = None) -> dict[str, Any]:
    return {"tokens": tokens, "token_ids": [hash(t) % 1000 for t in tokens], "top_logprobs": top}


def test_greedy_divergence_counts_as_rounding_only_at_a_near_tie() -> None:
    triton = [
        completion(["a", "b", "c"]),
        completion(["a", "x"], [{"a": -0.1, "z": -3.0}, {"x": -1.00, "y": -1.03}]),
        completion(["a", "x"], [{"a": -0.1, "z": -3.0}, {"x": -0.5, "y": -2.0}]),
    ]
    tile = [completion(["a", "b", "c"]), completion(["a", "y"]), completion(["a", "y"])]
    result = compare_greedy(tile, triton)
    assert (result["identical"], result["near_tie"], result["other"]) == (1, 1, 1)
    assert [d["first_difference"] for d in result["details"]] == [1, 1]


def test_a_near_tie_counts_from_either_engines_distribution() -> None:
    # Triton's top tokens cannot hold tile's pick when its text is empty; tile's own distribution
    # shows the tie (Triton's pick 0.002 nats behind). A clear lead on both sides is no tie.
    triton = [
        completion(["a", "x"], [{"a": -0.1}, {"x": -1.000, "y": -1.002}]),
        completion(["a", "x"], [{"a": -0.1}, {"x": -0.5, "y": -2.0}]),
    ]
    tile = [
        completion(["a", ""], [{"a": -0.1}, {"": -1.000, "x": -1.002}]),
        completion(["a", "y"], [{"a": -0.1}, {"y": -0.5, "x": -2.5}]),
    ]
    result = compare_greedy(tile, triton)
    assert (result["near_tie"], result["other"]) == (1, 1)
    assert result["details"][0]["tile_top2_gap_nats"] == pytest.approx(0.002)


def test_decode_summary_flags_a_shape_slower_than_triton_and_the_bandwidth_goal() -> None:
    rows = [
        {
            "model": "m",
            "batch": 32,
            "context": 1024,
            "us": {"tile": 10.0, "tile_graph": 11.0, "vllm_triton": 10.5, "fa3": 9.0},
            "bandwidth_fraction": {"tile": 0.85, "tile_graph": 0.78},
        },
        {
            "model": "m",
            "batch": 4,
            "context": 4096,
            "us": {"tile": 8.0, "tile_graph": 8.0, "vllm_triton": 20.0, "fa3": 12.0},
            "bandwidth_fraction": {"tile": 0.3, "tile_graph": 0.3},
        },
    ]
    summary = summarize_decode(rows)
    assert summary["tile"]["slower_than_triton"] == []
    assert [(s["batch"], round(s["x"], 3)) for s in summary["tile_graph"]["slower_than_triton"]] == [(32, 1.048)]
    assert (summary["tile"]["bandwidth_goal_met"], summary["tile"]["bandwidth_goal_shapes"]) == (1, 1)
    assert summary["tile_graph"]["bandwidth_goal_met"] == 0
    assert [f["batch"] for f in summary["tile"]["fa3_faster"]] == [32]


def test_plugin_site_is_an_installed_vllm_plugin(tmp_path: Path) -> None:
    # vLLM finds general plugins by entry point; the site must carry one, and this checkout's code.
    site = plugin_site(tmp_path / "site")
    points = [
        ep
        for dist in importlib.metadata.distributions(path=[str(site)])
        for ep in dist.entry_points
        if ep.group == "vllm.general_plugins"
    ]
    assert [ep.value for ep in points] == ["flashmodel_kernels.vllm_plugin:register"]
    assert (site / "flashmodel_kernels" / "graph.py").read_text() == (
        ROOT / "kernels" / "flashmodel_kernels" / "graph.py"
    ).read_text()


def test_goodput_at_fixed_rates_needs_most_rounds_at_that_rate_and_every_lower_one() -> None:
    def runs(*passed: bool) -> list[dict[str, Any]]:
        return [{"passed": p} for p in passed]

    trials = {
        # 192 passes in most rounds but 160 does not: a lone pass above a failure is noise.
        "tile": {"128": runs(True, True, True), "160": runs(True, False, False), "192": runs(True, True, False)},
        "triton": {"128": runs(True, True, False), "192": runs(False, True, True), "256": runs(False, False, False)},
        "none": {"128": runs(False, True)},  # a tie is not most rounds
    }
    assert goodput_at_rates(trials) == {"tile": 128.0, "triton": 192.0, "none": None}
