"""The stored vLLM option tables: one generated module per supported vLLM version (`vllm_flags.table_source`).

The engine image may run any vLLM in engine_version.SUPPORTED_RANGE; the operator cannot see which
before a pod starts, so its early check of extraArgs reads every table here (profiles.check_extra_args).
"""

from flashmodel_engine.vllm_options_0_26_0 import OPTIONS as OPTIONS_0_26_0
from flashmodel_engine.vllm_options_0_32_0 import OPTIONS as OPTIONS_0_32_0

TABLES: dict[str, dict[str, tuple[str, str]]] = {"0.26.0": OPTIONS_0_26_0, "0.32.0": OPTIONS_0_32_0}
"""vLLM version -> its OpenAI server's option table (option string -> (dest, nargs)), oldest first."""
