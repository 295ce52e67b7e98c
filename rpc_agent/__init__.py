"""RPC over gRPC with remote references, after torch.distributed.rpc (TensorPipe backend)."""

from shoal.rpc_agent import context
from shoal.rpc_agent import dist_autograd  # noqa: F401
from shoal.rpc_agent import functions  # noqa: F401
from shoal.rpc_agent import api  # noqa: F401  (torch's rpc.api)
from shoal.rpc_agent import constants  # noqa: F401  (torch's rpc.constants)
from shoal.rpc_agent.types import (
    BackendType,
    RemoteException,
    RpcAuthenticationError,
    RpcBackendOptions,
    RpcError,
    RpcFunctionNotFound,
    RpcPeerLost,
    RpcTimeout,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
    WorkerNameError,
)
from shoal.rpc_agent.optim import DistributedOptimizer  # noqa: F401
from shoal.rpc_agent.futures import Future, collect_all, wait_all  # noqa: F401
from shoal.rpc_agent.rpc import (  # noqa: F401
    _set_rpc_timeout,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from shoal.rpc_agent.rref import RRef  # noqa: F401
