"""Where an engine's start-up time goes, read from vLLM's own log lines as they pass the launcher.

vLLM times its phases itself and logs each once per start: the weights' load, torch.compile, the
CUDA graph capture (with the graph pool's size) and the engine core's whole initialisation
(memory profiling, the KV cache, compile, capture and warm-up). Reading those lines costs one regular
expression per output line during start-up and nothing after; the figures are vLLM's, not ours.
The lines' wording is checked against vLLM 0.26 and 0.32 (tests/engine/test_startup_phases.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

GIB = 1024**3

# phase -> the log line that states its seconds (and, for two of them, GiB of device memory).
PATTERNS: dict[str, re.Pattern[str]] = {
    "weights": re.compile(r"Loading weights took (?P<seconds>\d+(?:\.\d+)?) seconds"),
    "model_load": re.compile(
        r"Model loading took (?P<gib>-?\d+(?:\.\d+)?) GiB(?: memory)? and (?P<seconds>\d+(?:\.\d+)?) seconds"
    ),
    "compile": re.compile(
        r"torch\.compile (?:and initial profiling/warmup run together )?took (?P<seconds>\d+(?:\.\d+)?) s in total"
    ),
    "graph_capture": re.compile(
        r"Graph capturing finished in (?P<seconds>\d+(?:\.\d+)?) secs, took (?P<gib>-?\d+(?:\.\d+)?) GiB"
    ),
    "engine_init": re.compile(
        r"init engine \(profile, create kv cache, warmup model\) took (?P<seconds>\d+(?:\.\d+)?) s"
    ),
}
PHASES = tuple(PATTERNS)
"""The phases vLLM reports, in the order they happen."""


@dataclass
class StartupPhases:
    """The phases one engine process has reported so far."""

    seconds: dict[str, float] = field(default_factory=dict)
    model_memory_bytes: float | None = None
    """The weights on the device, as vLLM's model load reports them."""
    graph_memory_bytes: float | None = None
    """The CUDA graph pool, as vLLM's capture reports it (absent in eager mode)."""

    def observe(self, line: str) -> str | None:
        """Records the phase this log line reports; returns its name, or None for any other line."""
        if "took" not in line and "finished" not in line:
            return None  # most lines: no regular expression at all
        for phase, pattern in PATTERNS.items():
            match = pattern.search(line)
            if match is None:
                continue
            self.seconds[phase] = float(match["seconds"])
            if "gib" in match.groupdict():
                memory = float(match["gib"]) * GIB
                if phase == "graph_capture":
                    self.graph_memory_bytes = memory
                else:
                    self.model_memory_bytes = memory
            return phase
        return None

    def rest_of_engine_init(self) -> float | None:
        """The engine core's initialisation less compile and capture: memory profiling, the KV cache's
        allocation and the warm-up runs, which vLLM does not time one by one."""
        init = self.seconds.get("engine_init")
        if init is None:
            return None
        return max(0.0, init - self.seconds.get("compile", 0.0) - self.seconds.get("graph_capture", 0.0))
