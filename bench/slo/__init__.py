"""Serving benchmarks on a GPU: the load generator, the SLO and goodput drivers, and the models they serve."""
