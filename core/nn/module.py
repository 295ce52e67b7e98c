"""`Module`: the base of every layer, with torch.nn.Module's registration and state_dict rules.

Assigning a Parameter, a Module, or (for names registered with register_buffer) a Tensor to an
attribute registers it, so parameters(), state_dict(), to() and train() find it without the
layer listing anything.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, namedtuple
from typing import Any, Callable, Iterator

import numpy as np

from shoal.core import autograd
from shoal.core import backend
from shoal.core import dtypes
from shoal.core.errors import ShoalError
from shoal.core.nn.parameter import Parameter
from shoal.core.tensor import Tensor


class StateDictError(ShoalError, RuntimeError):
    """A state_dict that does not fit a module: missing or unexpected keys, wrong shapes."""


IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


class RemovableHandle:
    """Returned by hook registrations; `remove()` unregisters the hook (twice is harmless)."""

    _ids = itertools.count()

    def __init__(self, hooks: dict[int, Callable]) -> None:
        self._hooks = hooks
        self.id = next(RemovableHandle._ids)

    def remove(self) -> None:
        """Unregister the hook."""
        self._hooks.pop(self.id, None)

    def __enter__(self) -> "RemovableHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


class Module:
    """Base class of layers and models; subclasses define `forward` and assign their parts."""

    training: bool

    def __init__(self) -> None:
        # object.__setattr__: our own __setattr__ needs these dicts to exist first.
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent_buffers", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_forward_hooks", OrderedDict())
        object.__setattr__(self, "_forward_pre_hooks", OrderedDict())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The computation; every subclass defines it."""
        raise NotImplementedError(f"Module [{type(self).__name__}] is missing a forward method.")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._forward_pre_hooks:
            for hook in list(self._forward_pre_hooks.values()):
                changed = hook(self, args)
                if changed is not None:
                    args = changed if isinstance(changed, tuple) else (changed,)
        out = self.forward(*args, **kwargs)
        if self._forward_hooks:
            for hook in list(self._forward_hooks.values()):
                changed = hook(self, args, out)
                if changed is not None:
                    out = changed
        return out

    # -- registration ----------------------------------------------------------------------
    def __setattr__(self, name: str, value: Any) -> None:
        # Parameters, then child modules: a value of the kind registers (replacing whatever
        # the name held); a registered name takes only its kind or None.
        for table_name, cls, kind, slot, expected in _REGISTRIES:
            table = self.__dict__.get(table_name)
            if isinstance(value, cls):
                if table is None:
                    raise AttributeError(
                        f"cannot assign {kind} {name!r} before Module.__init__() call"
                    )
                self._forget(name, keep=table_name)
                table[name] = value
                return
            if table is not None and name in table:
                if value is not None:
                    raise TypeError(
                        f"cannot assign {type(value).__name__} as {slot} {name!r} "
                        f"({expected} or None expected)"
                    )
                table[name] = None
                return
        buffers = self.__dict__.get("_buffers")
        if buffers is not None and name in buffers:
            if value is not None and not isinstance(value, Tensor):
                raise TypeError(
                    f"cannot assign {type(value).__name__} as buffer {name!r} "
                    "(core.Tensor or None expected)"
                )
            buffers[name] = value
            return
        object.__setattr__(self, name, value)

    def _forget(self, name: str, keep: str | None = None) -> None:
        # `keep`: the table about to take the name again; leaving the entry there keeps its
        # position, as torch does (a replaced child of a Sequential must stay in its place).
        self.__dict__.pop(name, None)
        for table in ("_parameters", "_buffers", "_modules"):
            if table != keep:
                self.__dict__[table].pop(name, None)
        self._non_persistent_buffers.discard(name)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: look in the registries.
        d = self.__dict__
        for table in ("_parameters", "_buffers", "_modules"):
            entries = d.get(table)
            if entries is not None and name in entries:
                return entries[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __delattr__(self, name: str) -> None:
        for table in ("_parameters", "_buffers", "_modules"):
            if name in self.__dict__[table]:
                del self.__dict__[table][name]
                self._non_persistent_buffers.discard(name)
                return
        object.__delattr__(self, name)

    def __dir__(self) -> list[str]:
        return sorted(
            set(super().__dir__()) | set(self._parameters) | set(self._buffers)
            | set(self._modules)
        )

    def _check_name(self, name: Any, what: str) -> None:
        if not isinstance(name, str):
            raise TypeError(f"{what} name should be a string, got {type(name).__name__}")
        if not name or "." in name:
            raise KeyError(f'{what} name can\'t be empty or contain ".", got: {name!r}')
        if hasattr(self, name) and name not in getattr(self, f"_{what}s", {}):
            raise KeyError(f"attribute {name!r} already exists")

    def register_parameter(self, name: str, param: Parameter | None) -> None:
        """Register a Parameter (or None, a declared but absent parameter) under `name`."""
        if "_parameters" not in self.__dict__:
            raise AttributeError("cannot assign parameter before Module.__init__() call")
        self._check_name(name, "parameter")
        if param is not None and not isinstance(param, Parameter):
            raise TypeError(
                f"cannot assign {type(param).__name__} object to parameter {name!r} "
                "(core.nn.Parameter or None required)"
            )
        self._forget(name, keep="_parameters")
        self._parameters[name] = param

    def register_buffer(self, name: str, tensor: Tensor | None, persistent: bool = True) -> None:
        """Register a non-trainable Tensor (in state_dict unless persistent=False)."""
        if "_buffers" not in self.__dict__:
            raise AttributeError("cannot assign buffer before Module.__init__() call")
        self._check_name(name, "buffer")
        if tensor is not None and not isinstance(tensor, Tensor):
            raise TypeError(
                f"cannot assign {type(tensor).__name__} object to buffer {name!r} "
                "(core.Tensor or None required)"
            )
        self._forget(name, keep="_buffers")
        self._buffers[name] = tensor
        if not persistent:
            self._non_persistent_buffers.add(name)

    def add_module(self, name: str, module: "Module | None") -> None:
        """Register a child module under `name`."""
        if module is not None and not isinstance(module, Module):
            raise TypeError(f"{type(module).__name__} is not a Module subclass")
        self._check_name(name, "module")
        self._forget(name, keep="_modules")
        self._modules[name] = module

    register_module = add_module

    def get_submodule(self, target: str) -> "Module":
        """The submodule at a dotted path such as 'encoder.0'."""
        module = self
        if not target:
            return module
        for part in target.split("."):
            child = module._modules.get(part)
            if child is None:
                raise AttributeError(
                    f"{type(module).__name__} has no submodule {part!r} (in path {target!r})"
                )
            module = child
        return module

    # -- traversal -------------------------------------------------------------------------
    def named_modules(
        self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, "Module"]]:
        """(dotted name, module) for this module and every descendant, pre-order."""
        if memo is None:
            memo = set()
        if remove_duplicate:
            if id(self) in memo:
                return
            memo.add(id(self))
        yield prefix, self
        for name, module in self._modules.items():
            if module is None:
                continue
            sub = f"{prefix}.{name}" if prefix else name
            yield from module.named_modules(memo, sub, remove_duplicate)

    def modules(self) -> Iterator["Module"]:
        """This module and every descendant, pre-order."""
        for _, module in self.named_modules():
            yield module

    def named_children(self) -> Iterator[tuple[str, "Module"]]:
        """(name, module) for each direct child."""
        seen = set()
        for name, module in self._modules.items():
            if module is not None and id(module) not in seen:
                seen.add(id(module))
                yield name, module

    def children(self) -> Iterator["Module"]:
        """Each direct child module."""
        for _, module in self.named_children():
            yield module

    def _named_members(self, table: str, prefix: str, recurse: bool,
                       remove_duplicate: bool = True) -> Iterator[tuple[str, Tensor]]:
        seen = set()
        modules = self.named_modules(prefix=prefix) if recurse else [(prefix, self)]
        for module_prefix, module in modules:
            for name, value in module.__dict__[table].items():
                if value is None or (remove_duplicate and id(value) in seen):
                    continue
                seen.add(id(value))
                yield (f"{module_prefix}.{name}" if module_prefix else name), value

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Parameter]]:
        """(dotted name, parameter) in registration order; shared parameters appear once."""
        return self._named_members("_parameters", prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[Parameter]:
        """Every parameter in registration order."""
        for _, p in self.named_parameters(recurse=recurse):
            yield p

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, Tensor]]:
        """(dotted name, buffer) in registration order."""
        return self._named_members("_buffers", prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[Tensor]:
        """Every buffer in registration order."""
        for _, b in self.named_buffers(recurse=recurse):
            yield b

    # -- modes and gradients ---------------------------------------------------------------
    def train(self, mode: bool = True) -> "Module":
        """Set training mode on this module and every descendant."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        for module in self.modules():
            object.__setattr__(module, "training", mode)
        return self

    def eval(self) -> "Module":
        """Set evaluation mode (train(False))."""
        return self.train(False)

    def requires_grad_(self, requires_grad: bool = True) -> "Module":
        """Turn gradient recording on or off for every parameter."""
        for p in self.parameters():
            p.requires_grad = requires_grad
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset every parameter's gradient: to None (default) or to zeros in place."""
        autograd.zero_grads(self.parameters(), set_to_none)

    def apply(self, fn: Callable[["Module"], Any]) -> "Module":
        """Call fn on every descendant (children first) and then on this module."""
        for module in self.children():
            module.apply(fn)
        fn(self)
        return self

    # -- hooks -----------------------------------------------------------------------------
    def register_forward_pre_hook(self, hook: Callable) -> RemovableHandle:
        """hook(module, args) runs before forward; a non-None result replaces args."""
        handle = RemovableHandle(self._forward_pre_hooks)
        self._forward_pre_hooks[handle.id] = hook
        return handle

    def register_forward_hook(self, hook: Callable) -> RemovableHandle:
        """hook(module, args, output) runs after forward; a non-None result replaces output."""
        handle = RemovableHandle(self._forward_hooks)
        self._forward_hooks[handle.id] = hook
        return handle

    # -- device and dtype ------------------------------------------------------------------
    def to(self, *args: Any, **kwargs: Any) -> "Module":
        """Move (and/or cast floating-point) parameters and buffers in place: m.to('cuda')."""
        device = kwargs.pop("device", None)
        dtype = kwargs.pop("dtype", None)
        kwargs.pop("non_blocking", None)
        if kwargs:
            raise TypeError(f"Module.to() got unexpected keyword arguments {sorted(kwargs)}")
        for arg in args:
            if isinstance(arg, Tensor):
                device, dtype = arg.device, arg.dtype
            elif isinstance(arg, (str, backend.Device)):
                device = arg
            elif arg is not None:
                dtype = arg
        dev = backend.device(device) if device is not None else None
        dt = dtypes.get(dtype) if dtype is not None else None
        if dt is not None and not dt.is_floating_point:
            raise TypeError(f"Module.to only accepts floating point dtypes, but got {dt!r}")
        return self._apply_to(dev, dt)

    def _apply_to(self, dev: Any, dt: Any) -> "Module":
        def convert(arr: Any) -> Any:
            target_dev = dev if dev is not None else backend.device_of(arr)
            out = backend.to_device(arr, target_dev)
            if dt is not None and dtypes.from_np(arr.dtype).is_floating_point:
                np_dt = dtypes.to_np(dt, target_dev.type)
                if out.dtype != np_dt:
                    out = out.astype(np_dt)
            return out

        for t in itertools.chain(self.parameters(), self.buffers()):
            # Keep each Parameter object (optimizers hold it); swap only its array.
            t.array = convert(t.array)
            if t.grad is not None:
                t.grad.array = convert(t.grad.array)
        return self

    def cpu(self) -> "Module":
        """Move everything to the cpu."""
        return self.to("cpu")

    def cuda(self, device: int | None = None) -> "Module":
        """Move everything to a cuda device."""
        return self.to("cuda" if device is None else f"cuda:{device}")

    def float(self) -> "Module":
        """Cast floating-point parameters and buffers to float32."""
        return self.to(dtypes.float32)

    def double(self) -> "Module":
        """Cast floating-point parameters and buffers to float64."""
        return self.to(dtypes.float64)

    def half(self) -> "Module":
        """Cast floating-point parameters and buffers to float16."""
        return self.to(dtypes.float16)

    # -- state_dict ------------------------------------------------------------------------
    def state_dict(
        self, destination: dict | None = None, prefix: str = "", keep_vars: bool = False
    ) -> "OrderedDict[str, Tensor]":
        """Parameters and persistent buffers by dotted name; values share the module's arrays."""
        if destination is None:
            destination = OrderedDict()
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = p if keep_vars else Tensor(p.array)
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers:
                destination[prefix + name] = b if keep_vars else Tensor(b.array)
        for name, module in self._modules.items():
            if module is not None:
                module.state_dict(destination, prefix + name + ".", keep_vars)
        return destination

    def _state_targets(self) -> "OrderedDict[str, Tensor]":
        return self.state_dict(keep_vars=True)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> IncompatibleKeys:
        """Copy values into parameters and buffers in place; checks everything before copying.

        Raises StateDictError naming every missing and unexpected key (when strict) and every
        shape mismatch (always); on error nothing is changed.
        """
        if not hasattr(state_dict, "items"):
            raise StateDictError(
                f"Expected state_dict to be dict-like, got {type(state_dict).__name__}."
            )
        targets = self._state_targets()
        missing = [k for k in targets if k not in state_dict]
        unexpected = [k for k in state_dict if k not in targets]
        errors = []
        if strict and unexpected:
            errors.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
        if strict and missing:
            errors.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
        sources = {}
        for key, target in targets.items():
            if key not in state_dict:
                continue
            value = state_dict[key]
            data = value.array if isinstance(value, Tensor) else value
            if not backend.is_array(data):
                try:
                    data = np.asarray(data)
                except Exception:  # noqa: BLE001 - reported as a sentence below
                    data = None
            if data is None or not hasattr(data, "shape") or data.dtype.kind in "OSU":
                errors.append(f'value for "{key}" is a {type(value).__name__}, not a tensor.')
                continue
            if tuple(data.shape) != tuple(target.shape):
                errors.append(
                    f"size mismatch for {key}: copying a param with shape {tuple(data.shape)} "
                    f"from checkpoint, the shape in current model is {tuple(target.shape)}."
                )
                continue
            sources[key] = data
        if errors:
            raise StateDictError(
                f"Error(s) in loading state_dict for {type(self).__name__}:\n\t"
                + "\n\t".join(errors)
            )
        for key, data in sources.items():
            target = targets[key]
            target.array[...] = backend.to_device(data, backend.device_of(target.array))
        return IncompatibleKeys(missing, unexpected)

    # -- printing --------------------------------------------------------------------------
    def extra_repr(self) -> str:
        """Settings shown inside this module's repr parentheses."""
        return ""

    def __repr__(self) -> str:
        lines = []
        extra = self.extra_repr()
        if extra:
            lines = extra.split("\n")
        for name, module in self._modules.items():
            body = repr(module).replace("\n", "\n  ")
            lines.append(f"({name}): {body}")
        main = type(self).__name__ + "("
        if lines:
            if len(lines) == 1 and not self._modules:
                main += lines[0]
            else:
                main += "\n  " + "\n  ".join(lines) + "\n"
        return main + ")"


# What Module.__setattr__ registers: (table, value type, noun before __init__, noun for a
# registered name, the type named in its error).
_REGISTRIES = (
    ("_parameters", Parameter, "parameter", "parameter", "shoal.core.nn.Parameter"),
    ("_modules", Module, "module", "child module", "shoal.core.nn.Module"),
)
