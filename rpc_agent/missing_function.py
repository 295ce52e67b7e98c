"""The error for a call whose function the callee cannot find, as torch reports it: the caller
gets an RpcError (a RuntimeError, as torch's rpc_sync raises) that is also the lookup's own
AttributeError or ModuleNotFoundError, naming the function, its module and the callee."""

from __future__ import annotations

import sys
from typing import Optional

from shoal.rpc_agent.types import (
    RpcFunctionModuleNotFound,
    RpcFunctionNotDefined,
    WorkerInfo,
)

_HINT = ("RPC sends functions by reference (module and name), not their code: define them in a "
         "module that every worker imports, not only in the caller's __main__.")


def _loaded_module(fname: str) -> tuple[Optional[str], str]:
    """The longest prefix of `fname` that is a module loaded here, and the rest (its qualname).
    Only modules the unpickler already imported are looked at: nothing new is imported."""
    parts = fname.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        if module in sys.modules:
            return module, ".".join(parts[i:])
    return None, fname


def _resolves(module: str, qualname: str) -> bool:
    obj = sys.modules[module]
    for part in qualname.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def explain(fname: str, exc: BaseException, worker: WorkerInfo) -> Optional[BaseException]:
    """The error to send back when unpickling the call to `fname` raised `exc` on `worker`, or
    None when the function itself is there (then an argument failed, and `exc` is the answer)."""
    where = f"worker {worker.name!r} (id {worker.id})"
    if isinstance(exc, ImportError):
        missing = exc.name or ""
        if not missing or not (fname == missing or fname.startswith(missing + ".")):
            return None
        return RpcFunctionModuleNotFound(
            f"RPC function {fname} cannot be found on {where}: its module {missing!r} cannot "
            f"be imported there ({exc}). {_HINT}"
        )
    if isinstance(exc, AttributeError):
        module, qualname = _loaded_module(fname)
        if module is None or _resolves(module, qualname):
            return None
        return RpcFunctionNotDefined(
            f"RPC function {fname} cannot be found on {where}: its module {module!r} has no "
            f"{qualname!r} there ({exc}). {_HINT}"
        )
    return None
