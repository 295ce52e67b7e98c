"""torch.distributed.nn under shoal's renaming (torch.distributed -> shoal.collectives).

torch's RemoteModule is built on RPC, a layer above collectives (docs/design.md#layers:
imports point down only), so it cannot live here: it is `shoal.rpc_agent.nn.RemoteModule`
(torch.distributed.nn.api.remote_module is `shoal.rpc_agent.nn.api.remote_module`). Asking for
it here raises an ImportError that says so, instead of a bare "cannot import name".
"""

_ELSEWHERE = {
    "RemoteModule": "shoal.rpc_agent.nn",
    "api": "shoal.rpc_agent.nn (shoal.rpc_agent.nn.api.remote_module)",
}


def __getattr__(name: str) -> object:
    where = _ELSEWHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # An ImportError, not an AttributeError: `from shoal.collectives.nn import RemoteModule`
    # shows this message only then (Python replaces an AttributeError with its own).
    raise ImportError(
        f"{name} is in {where}, not {__name__}: it is built on RPC, which sits a layer above "
        "collectives, so `from torch.distributed.nn import RemoteModule` becomes "
        "`from shoal.rpc_agent.nn import RemoteModule`.", name=name)
