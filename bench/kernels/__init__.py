"""The tile-attention microbenchmark on a GPU: correctness at real shapes and decode time against vLLM's kernels."""
