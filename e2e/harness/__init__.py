"""The test bed: a real control plane of local processes, engines as pods, the operator, load and faults."""
