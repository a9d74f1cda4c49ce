"""End-to-end tests and the real test control plane they run on."""
