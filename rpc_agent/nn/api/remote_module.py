"""`RemoteModule`: an nn.Module created on another worker and called through RPC, as
torch.distributed.nn.api.remote_module.RemoteModule.

The module is built on its owner by `remote()` (so a bad `module_cls` surfaces at the first
forward, as in torch); `forward`/`forward_async` run it there, inside the caller's
distributed autograd context when there is one; `remote_parameters()` gives RRefs for a
DistributedOptimizer. A RemoteModule travels over RPC as its few attributes and the RRef of
its module, never by plain pickle. The nn.Module methods that would act on a local copy are
refused with torch's ValueError.
"""

from __future__ import annotations

import logging
import types
from typing import Any, Callable, Optional

from shoal.core import nn
from shoal.rpc_agent import _current, serialization
from shoal.rpc_agent.nn.api import remote_forward
from shoal.rpc_agent.nn.remote_device import _remote_device
from shoal.rpc_agent.rpc import remote, rpc_sync
from shoal.rpc_agent.rref import RRef

logger = logging.getLogger(__name__)

__all__ = ["RemoteModule"]

_REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "generated_methods",
    "module_rref",
)

# What a RemoteModule holds that does not travel: nn.Module's own state (whatever Module's
# constructor sets, so a new field there needs no change here) and the installed methods,
# which the receiver installs again.
_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING = frozenset(vars(nn.Module())) | {
    "forward_async", "forward"}


def _create_module(module_cls: Callable, args: tuple, kwargs: dict, device: str) -> nn.Module:
    """On the owner: build the module and move it to its device."""
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}."
        )
    module.to(device)
    return module


def _param_rrefs(module_rref: RRef, recurse: bool) -> list:
    """On the owner: an RRef to each of the module's parameters."""
    return [RRef(param) for param in module_rref.local_value().parameters(recurse)]


def _not_supported(name: str, hint: str = "") -> Callable:
    """An nn.Module method a RemoteModule refuses, as torch's does, with its ValueError."""
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(f"Method ``{name}`` not supported for RemoteModule{hint}")

    method.__name__ = method.__qualname__ = name
    method.__doc__ = "Not supported for RemoteModule (raises ValueError), as in torch."
    return method


class _RemoteModule(nn.Module):
    """A module on another worker; see `RemoteModule`. (`_module_interface_cls`, torch's
    TorchScript interface, must be None: shoal has no TorchScript.)"""

    def __init__(self, remote_device: str, module_cls: Callable, args: Optional[tuple] = None,
                 kwargs: Optional[dict] = None, _module_interface_cls: Any = None) -> None:
        super().__init__()
        _prepare_init(self, remote_device, _module_interface_cls)
        args = args if args is not None else ()
        kwargs = kwargs if kwargs is not None else {}
        self.module_rref = remote(self.on, _create_module, (module_cls, args, kwargs,
                                                            self.device))
        _install_generated_methods(self)
        _check_attribute_picklability(self)

    def remote_parameters(self, recurse: bool = True) -> list:
        """RRefs to the remote module's parameters (its submodules' too when `recurse`), for
        a DistributedOptimizer."""
        return rpc_sync(self.on, _param_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef:
        """The RRef of the module on its owner."""
        return self.module_rref

    def train(self, mode: bool = True) -> Any:
        """Set the remote module's training mode; returns what its `train` returns (a copy
        of the module, sent back), as torch's."""
        # torch calls train() without `mode`, so its train(False) trains; `mode` is passed.
        return self.module_rref.rpc_sync().train(mode)

    def eval(self) -> Any:
        """Put the remote module in evaluation mode; returns a copy of it, as torch's."""
        return self.module_rref.rpc_sync().eval()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A RemoteModule refuses hooks, so calling it is its forward (which a RemoteModule
        # received over RPC, built without Module's state, can run too).
        return self.forward(*args, **kwargs)

    def __repr__(self) -> str:
        return f"RemoteModule(on={self.on!r}, device={self.device!r})"

    def __reduce__(self) -> tuple:
        if serialization.destination() is None:
            raise RuntimeError(
                "Cannot pickle RemoteModule in python pickler. RemoteModule can only be "
                "pickled when using RPC"
            )
        attrs = self.__dict__
        for name in attrs:
            if (name not in _REMOTE_MODULE_PICKLED_ATTRIBUTES
                    and name not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING):
                logger.warning(
                    "The new attribute ``%s`` of RemoteModule is ignored during RPC pickling.",
                    name)
        return (_remote_module_receiver,
                ({name: attrs[name] for name in _REMOTE_MODULE_PICKLED_ATTRIBUTES},))

    # Methods that would act on a local copy of the module: refused, as torch refuses them.
    register_buffer = _not_supported("register_buffer")
    register_parameter = _not_supported("register_parameter")
    add_module = _not_supported("add_module")
    apply = _not_supported("apply")
    cuda = _not_supported("cuda")
    ipu = _not_supported("ipu")
    xpu = _not_supported("xpu")
    cpu = _not_supported("cpu")
    type = _not_supported("type")
    float = _not_supported("float")
    double = _not_supported("double")
    half = _not_supported("half")
    bfloat16 = _not_supported("bfloat16")
    to = _not_supported("to")
    register_backward_hook = _not_supported("register_backward_hook")
    register_forward_pre_hook = _not_supported("register_forward_pre_hook")
    register_forward_hook = _not_supported("register_forward_hook")
    state_dict = _not_supported("state_dict")
    load_state_dict = _not_supported("load_state_dict")
    parameters = _not_supported("parameters", ". Please use ``remote_parameters`` instead.")
    named_parameters = _not_supported("named_parameters")
    buffers = _not_supported("buffers")
    named_buffers = _not_supported("named_buffers")
    children = _not_supported("children")
    named_children = _not_supported("named_children")
    modules = _not_supported("modules")
    named_modules = _not_supported("named_modules")
    requires_grad_ = _not_supported("requires_grad_")
    zero_grad = _not_supported("zero_grad")
    share_memory = _not_supported("share_memory")
    extra_repr = _not_supported("extra_repr")

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: RRef,
                              _module_interface_cls: Any = None) -> "RemoteModule":
        """A RemoteModule over an existing module RRef (several may share one module)."""
        remote_module = object.__new__(RemoteModule)
        _prepare_init(remote_module, remote_device, _module_interface_cls)
        remote_module.module_rref = module_rref
        _install_generated_methods(remote_module)
        _check_attribute_picklability(remote_module)
        return remote_module


def _prepare_init(self: _RemoteModule, remote_device: str, module_interface_cls: Any) -> None:
    """Where the module lives: `on` (a worker name or rank), `device`, and whether the
    caller has a device map to that worker."""
    agent = _current.peek()
    if agent is None:
        raise AssertionError("RemoteModule only works in RPC.")
    if module_interface_cls is not None:
        raise ValueError(
            "_module_interface_cls must be None: it names a TorchScript interface, and "
            "shoal has no TorchScript."
        )
    parsed = _remote_device(remote_device)
    self.on = parsed.worker_name() if parsed.worker_name() is not None else parsed.rank()
    self.device = str(parsed.device())
    maps = getattr(agent.options, "device_maps", None) or {}
    self.is_device_map_set = bool(maps.get(agent.worker_info(self.on).name))
    self.is_scriptable = False
    self.generated_methods = remote_forward.generated_methods


def _install_generated_methods(self: _RemoteModule) -> None:
    """Bind `forward_async` and `forward` on the instance, as torch does."""
    for method in self.generated_methods:
        object.__setattr__(self, method.__name__, types.MethodType(method, self))

def _check_attribute_picklability(self: _RemoteModule) -> None:
    """Every attribute is declared as travelling or not (a guard for whoever adds one)."""
    for name in self.__dict__:
        if (name not in _REMOTE_MODULE_PICKLED_ATTRIBUTES
                and name not in _REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING):
            raise AttributeError(
                f"Attribute {name} must be either in ``_REMOTE_MODULE_PICKLED_ATTRIBUTES`` "
                "or ``_REMOTE_MODULE_ATTRIBUTES_IGNORE_FOR_PICKLING``."
            )


class RemoteModule(_RemoteModule):
    """`RemoteModule(remote_device, module_cls, args=None, kwargs=None)`: builds
    `module_cls(*args, **kwargs)` on the worker `remote_device` names ("worker1/cpu",
    "worker1", "rank:1/cpu"), after init_rpc. `forward(*a, **kw)` and
    `forward_async(*a, **kw)` (a Future) run its forward there; `remote_parameters()`
    returns RRefs for a DistributedOptimizer; `get_module_rref()` the module's RRef."""

    def __init__(self, remote_device: str, module_cls: Callable, args: Optional[tuple] = None,
                 kwargs: Optional[dict] = None) -> None:
        super().__init__(remote_device, module_cls, args, kwargs)


def _remote_module_receiver(attrs: dict) -> RemoteModule:
    """Rebuild a RemoteModule that arrived over RPC: its attributes and installed methods."""
    module = object.__new__(RemoteModule)
    module.__dict__.update(attrs)
    _install_generated_methods(module)
    return module
