"""RPC over gRPC with remote references, after torch.distributed.rpc (TensorPipe backend)."""

from rpc_agent import context, functions  # noqa: F401
from rpc_agent.api import (  # noqa: F401
    RemoteException,
    RpcBackendOptions,
    RpcError,
    RpcPeerLost,
    RpcTimeout,
    WorkerInfo,
)
from rpc_agent.futures import Future, collect_all, wait_all  # noqa: F401
from rpc_agent.rpc import (  # noqa: F401
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from rpc_agent.rref import RRef  # noqa: F401
