"""The methods a RemoteModule installs on itself, `forward_async` and `forward`, and the
function they run on the module's owner: torch's non-scriptable remote-module template,
written out once (torch generates it from a string). Module-level functions, so a
RemoteModule sent over RPC carries them by reference."""

from __future__ import annotations

from typing import Any

from shoal.core.backend import Device
from shoal.core.tensor import Tensor
from shoal.rpc_agent.futures import Future
from shoal.rpc_agent.rpc import rpc_async


def _remote_forward(module_rref: Any, device: str, is_device_map_set: bool, *args: Any,
                    **kwargs: Any) -> Any:
    """On the owner: the module's `forward` (not `__call__`, as torch's template), with CPU
    tensors moved to the module's cuda device first when it has one."""
    module = module_rref.local_value()
    dev = Device(device)
    if dev.type != "cuda":
        return module.forward(*args, **kwargs)
    args = tuple(a.to(dev) if isinstance(a, Tensor) else a for a in args)
    kwargs = {k: v.to(dev) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
    if is_device_map_set:
        return module.forward(*args, **kwargs)
    # No device map to the caller: as torch's template, the output is iterated and its
    # tensors come back on the CPU.
    return tuple(i.cpu() if isinstance(i, Tensor) else i
                 for i in module.forward(*args, **kwargs))


def forward_async(self: Any, *args: Any, **kwargs: Any) -> Future:
    """Run the remote module's forward on its owner; a Future of the result."""
    return rpc_async(self.module_rref.owner(), _remote_forward,
                     (self.module_rref, self.device, self.is_device_map_set) + args, kwargs)


def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Run the remote module's forward on its owner and return the result."""
    return forward_async(self, *args, **kwargs).wait()


# What a RemoteModule installs, by name (torch's template module's `_generated_methods`).
generated_methods = (forward_async, forward)
