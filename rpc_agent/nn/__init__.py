"""torch.distributed.nn's RemoteModule, for shoal: a module on another worker, called over RPC.

It lives here rather than in `shoal.collectives.nn` (torch.distributed.nn renamed) because it
is built on RPC, a layer above collectives (docs/design.md#layers).
"""

from shoal.rpc_agent.nn.api.remote_module import RemoteModule

__all__ = ["RemoteModule"]
