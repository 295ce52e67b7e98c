"""RPC over gRPC with remote references, after torch.distributed.rpc (TensorPipe backend)."""

from shoal.rpc_agent import api  # torch's rpc.api
from shoal.rpc_agent import constants  # torch's rpc.constants
from shoal.rpc_agent import context, dist_autograd, functions
# The functions and the types they take, as torch's rpc package re-exports its rpc.api.
from shoal.rpc_agent.api import (
    BackendType,
    RemoteException,
    RpcAuthenticationError,
    RpcBackendOptions,
    RpcError,
    RpcPeerLost,
    RpcTimeout,
    RRef,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
    WorkerNameError,
    _set_rpc_timeout,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from shoal.rpc_agent.futures import Future, collect_all, wait_all
from shoal.rpc_agent.optim import DistributedOptimizer
from shoal.rpc_agent.types import RpcFunctionNotFound

__all__ = [
    # submodules torch's rpc package has too
    "api", "constants", "context", "dist_autograd", "functions",
    # the functions
    "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info",
    "get_rpc_timeout", "_set_rpc_timeout",
    # the types
    "Future", "collect_all", "wait_all", "RRef", "DistributedOptimizer", "BackendType",
    "RpcBackendOptions", "TensorPipeRpcBackendOptions", "WorkerInfo",
    # the errors
    "RpcError", "RpcTimeout", "RpcPeerLost", "RpcAuthenticationError", "RpcFunctionNotFound",
    "RemoteException", "WorkerNameError",
]
