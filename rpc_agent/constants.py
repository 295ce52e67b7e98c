"""torch.distributed.rpc.constants' names, with shoal's values (the defaults live in `types`)."""

from shoal.rpc_agent.types import DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT_S

DEFAULT_RPC_TIMEOUT_SEC = DEFAULT_RPC_TIMEOUT_S
DEFAULT_INIT_METHOD = "env://"
DEFAULT_SHUTDOWN_TIMEOUT = 0.0  # torch's; shoal's shutdown takes `timeout` (types' default)
# rpc_sync/rpc_async/remote with this timeout use the agent's default, as in torch.
UNSET_RPC_TIMEOUT = -1.0

__all__ = ["DEFAULT_RPC_TIMEOUT_SEC", "DEFAULT_INIT_METHOD", "DEFAULT_NUM_WORKER_THREADS",
           "DEFAULT_SHUTDOWN_TIMEOUT", "UNSET_RPC_TIMEOUT"]
