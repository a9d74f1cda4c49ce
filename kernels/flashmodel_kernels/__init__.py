"""flashmodel's attention kernels: Triton paged attention over vLLM's 16-token KV blocks.

Importing this package needs only torch; Triton is imported through ``_triton`` so a machine
without it (the operator image) can still import everything here.
"""

from flashmodel_kernels.paged_attention import paged_attention
from flashmodel_kernels.plan import LaunchConfig, plan_launch

__all__ = ["LaunchConfig", "paged_attention", "plan_launch"]
