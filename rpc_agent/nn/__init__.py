"""torch.distributed.nn's RemoteModule, for shoal: a module on another worker, called over RPC.

It lives here rather than in `shoal.collectives.nn` (torch.distributed.nn renamed) because it
is built on RPC, a layer above collectives (docs/design.md#layers).

`RemoteModule` is imported on first use, not with this package. An owner often receives a
RemoteModule's creation and its first forward in one message (a remote() waits for the calls
that follow it) and unpickles their functions on two threads, one from `api.remote_module`
and one from `api.remote_forward`. Were this package to import remote_module (which imports
remote_forward) as it loads, the thread importing remote_forward would wait for this package
while the other waited for remote_forward, and Python's import raises _DeadlockError.
"""

__all__ = ["RemoteModule"]


def __getattr__(name: str):
    if name == "RemoteModule":
        from shoal.rpc_agent.nn.api.remote_module import RemoteModule  # noqa: PLC0415  (see above)

        return RemoteModule
    raise AttributeError(f"module 'shoal.rpc_agent.nn' has no attribute {name!r}")
