"""torch.distributed.rpc.api's names: the functions of the RPC layer, beside the types they
take (`types`), so that scripts written against `rpc.api` run unchanged."""

from shoal.rpc_agent.rpc import (
    _set_rpc_timeout,
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from shoal.rpc_agent.rref import RRef
from shoal.rpc_agent.types import (
    BackendType,
    RemoteException,
    RpcAuthenticationError,
    RpcBackendOptions,
    RpcError,
    RpcPeerLost,
    RpcTimeout,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
    WorkerNameError,
)

__all__ = [
    "init_rpc", "shutdown", "rpc_sync", "rpc_async", "remote", "get_worker_info",
    "get_rpc_timeout", "_set_rpc_timeout", "RRef", "WorkerInfo", "BackendType", "RpcBackendOptions",
    "TensorPipeRpcBackendOptions", "RpcError", "RpcTimeout", "RpcPeerLost", "RemoteException",
    "RpcAuthenticationError", "WorkerNameError",
]
