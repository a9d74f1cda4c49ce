"""flashmodel's engine pod: launcher, health shim, prewarm and metrics around a real vLLM."""

__version__ = "0.1.0"
