"""Distributed autograd over RPC, as torch.distributed.autograd (FAST mode)."""

from shoal.rpc_agent.dist_autograd.engine import (  # noqa: F401
    backward,
    context,
    get_gradients,
    live_context_count,
)
from shoal.rpc_agent.dist_autograd.types import DistAutogradError  # noqa: F401
