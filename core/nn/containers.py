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
