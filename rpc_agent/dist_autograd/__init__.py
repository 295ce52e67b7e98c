"""Distributed autograd over RPC, as torch.distributed.autograd (FAST mode)."""

from shoal.rpc_agent.dist_autograd.container import DistAutogradContext  # noqa: F401
from shoal.rpc_agent.dist_autograd.contexts import (  # noqa: F401
    _current_context,
    _get_debug_info,
    _get_max_id,
    _is_valid_context,
    _new_context,
    _release_context,
    _retrieve_context,
    is_available,
)
from shoal.rpc_agent.dist_autograd.engine import (  # noqa: F401
    backward,
    context,
    get_gradients,
    live_context_count,
)
from shoal.rpc_agent.dist_autograd.types import (  # noqa: F401
    ContextIdTypeError,
    DistAutogradError,
)
