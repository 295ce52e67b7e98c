"""Containers: Sequential (chains its modules) and ModuleList (holds them), as torch.nn."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Iterator

from shoal.core.nn.module import Module


def _index(length: int, idx: int, kind: str) -> int:
    if not -length <= idx < length:
        raise IndexError(f"index {idx} is out of range for a {kind} of length {length}")
    return idx % length


class Sequential(Module):
    """Calls its modules in order, each on the previous one's output."""

    def __init__(self, *args: Any) -> None:
        super().__init__()
        if len(args) == 1 and isinstance(args[0], OrderedDict):
            for name, module in args[0].items():
                self.add_module(name, module)
        else:
            for index, module in enumerate(args):
                self.add_module(str(index), module)

    def forward(self, input: Any) -> Any:  # noqa: A002 - torch's name
        x = input
        for module in self._modules.values():
            x = module(x)
        return x

    def __getitem__(self, idx: int | slice) -> Module:
        if isinstance(idx, slice):
            return Sequential(OrderedDict(list(self._modules.items())[idx]))
        keys = list(self._modules)
        return self._modules[keys[_index(len(keys), idx, "Sequential")]]

    def __setitem__(self, idx: int, module: Module) -> None:
        keys = list(self._modules)
        self.add_module(keys[_index(len(keys), idx, "Sequential")], module)

    def __delitem__(self, idx: int) -> None:
        keys = list(self._modules)
        del self._modules[keys[_index(len(keys), idx, "Sequential")]]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def append(self, module: Module) -> "Sequential":
        """Add a module at the end."""
        self.add_module(str(len(self)), module)
        return self


class ModuleList(Module):
    """A list of modules whose parameters the parent registers; it has no forward of its own."""

    def __init__(self, modules: Iterable[Module] | None = None) -> None:
        super().__init__()
        if modules is not None:
            self.extend(modules)

    def __getitem__(self, idx: int | slice) -> Any:
        values = list(self._modules.values())
        if isinstance(idx, slice):
            return ModuleList(values[idx])
        return values[_index(len(values), idx, "ModuleList")]

    def __setitem__(self, idx: int, module: Module) -> None:
        self.add_module(str(_index(len(self), idx, "ModuleList")), module)

    def __delitem__(self, idx: int) -> None:
        values = list(self._modules.values())
        del values[_index(len(values), idx, "ModuleList")]
        self._modules.clear()
        for i, module in enumerate(values):
            self._modules[str(i)] = module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __iadd__(self, modules: Iterable[Module]) -> "ModuleList":
        return self.extend(modules)

    def append(self, module: Module) -> "ModuleList":
        """Add a module at the end."""
        self.add_module(str(len(self)), module)
        return self

    def extend(self, modules: Iterable[Module]) -> "ModuleList":
        """Add each module at the end."""
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: Module) -> None:
        """Insert a module before position `index`."""
        values = list(self._modules.values())
        values.insert(index, module)
        self._modules.clear()
        for i, m in enumerate(values):
            self.add_module(str(i), m)


class ModuleDict(Module):
    """A dict of modules whose parameters the parent registers, in insertion order."""

    def __init__(self, modules: Any = None) -> None:
        super().__init__()
        if modules is not None:
            self.update(modules)

    def __getitem__(self, key: str) -> Module:
        return self._modules[key]

    def __setitem__(self, key: str, module: Module) -> None:
        self.add_module(key, module)

    def __delitem__(self, key: str) -> None:
        del self._modules[key]

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[str]:
        return iter(self._modules)

    def __contains__(self, key: object) -> bool:
        return key in self._modules

    def keys(self) -> Iterable[str]:
        """The names, in order."""
        return self._modules.keys()

    def items(self) -> Iterable[tuple[str, Module]]:
        """(name, module) pairs, in order."""
        return self._modules.items()

    def values(self) -> Iterable[Module]:
        """The modules, in order."""
        return self._modules.values()

    def pop(self, key: str) -> Module:
        """Remove and return the module under key."""
        return self._modules.pop(key)

    def clear(self) -> None:
        """Remove every module."""
        self._modules.clear()

    def update(self, modules: Any) -> None:
        """Add (name, module) pairs from a mapping or an iterable of pairs."""
        pairs = modules.items() if hasattr(modules, "items") else modules
        for key, module in pairs:
            self[key] = module


class ParameterList(Module):
    """A list of parameters registered under "0", "1", ... (state_dict keys as torch's)."""

    def __init__(self, values: Iterable[Any] | None = None) -> None:
        super().__init__()
        self._size = 0
        for value in values or ():
            self.append(value)

    def __getitem__(self, idx: int) -> Any:
        return getattr(self, str(_index(self._size, idx, "ParameterList")))

    def __setitem__(self, idx: int, value: Any) -> None:
        setattr(self, str(_index(self._size, idx, "ParameterList")), _as_parameter(value))

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(self._size))

    def append(self, value: Any) -> "ParameterList":
        """Add a parameter at the end (a tensor becomes a Parameter)."""
        setattr(self, str(self._size), _as_parameter(value))
        self._size += 1
        return self

    def extend(self, values: Iterable[Any]) -> "ParameterList":
        """Add each parameter at the end."""
        for value in values:
            self.append(value)
        return self


class ParameterDict(Module):
    """A dict of parameters registered under their keys."""

    def __init__(self, parameters: Any = None) -> None:
        super().__init__()
        self._keys: list[str] = []
        if parameters is not None:
            self.update(parameters)

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self._keys:
            self._keys.append(key)
        setattr(self, key, _as_parameter(value))

    def __delitem__(self, key: str) -> None:
        self._keys.remove(key)
        delattr(self, key)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._keys))

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def keys(self) -> Iterable[str]:
        """The names, in order."""
        return list(self._keys)

    def items(self) -> Iterable[tuple[str, Any]]:
        """(name, parameter) pairs, in order."""
        return [(k, self[k]) for k in self._keys]

    def values(self) -> Iterable[Any]:
        """The parameters, in order."""
        return [self[k] for k in self._keys]

    def update(self, parameters: Any) -> None:
        """Add (name, parameter) pairs from a mapping or an iterable of pairs."""
        pairs = parameters.items() if hasattr(parameters, "items") else parameters
        for key, value in pairs:
            self[key] = value


def _as_parameter(value: Any) -> Any:
    from shoal.core.nn.parameter import Parameter  # noqa: PLC0415 - parameter imports tensor ops

    if value is None or isinstance(value, Parameter):
        return value
    return Parameter(value)
