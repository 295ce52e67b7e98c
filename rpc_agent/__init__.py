"""RPC over gRPC with remote references, after torch.distributed.rpc (TensorPipe backend)."""

from shoal.rpc_agent import context
from shoal.rpc_agent import dist_autograd  # noqa: F401
from shoal.rpc_agent import functions  # noqa: F401
from shoal.rpc_agent.api import (
    RemoteException,
    RpcBackendOptions,
    RpcError,
    RpcPeerLost,
    RpcTimeout,
    WorkerInfo,
)  # noqa: F401
from shoal.rpc_agent.optim import DistributedOptimizer  # noqa: F401
from shoal.rpc_agent.futures import Future, collect_all, wait_all  # noqa: F401
from shoal.rpc_agent.rpc import get_worker_info, init_rpc, remote, rpc_async, rpc_sync, shutdown  # noqa: F401
from shoal.rpc_agent.rref import RRef  # noqa: F401
