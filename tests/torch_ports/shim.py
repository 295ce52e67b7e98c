"""The import-renaming shim: PyTorch's own distributed test modules, loaded from the installed
torch wheel (never copied here), run against shoal with their imports renamed as a user would
rename them: torch -> shoal.core, torch.distributed -> shoal.collectives, torch.distributed.rpc
-> shoal.rpc_agent, torch.distributed.autograd -> shoal.rpc_agent.dist_autograd.

Only the modules in PORTED see renamed imports: each gets its own `__import__`, so this
process's real torch (and torch's testing machinery, MultiProcessTestCase included) stays
torch. A name shoal lacks becomes a `Missing` placeholder, so one missing name fails the tests
that use it instead of the whole module's import.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import torch

_INTERNAL = "torch.testing._internal."
# Longest prefix first: torch's module -> shoal's.
RENAMES = {
    "torch.distributed.rpc": "shoal.rpc_agent",
    "torch.distributed.autograd": "shoal.rpc_agent.dist_autograd",
    "torch.distributed.optim": "shoal.rpc_agent.optim",
    "torch.distributed.nn": "shoal.rpc_agent.nn",
    "torch.distributed": "shoal.collectives",
    "torch.futures": "shoal.collectives",
    "torch.autograd.profiler_legacy": "shoal.core.profiler",
    "torch.autograd.profiler": "shoal.core.profiler",
    "torch.autograd": "shoal.core.autograd",
    "torch.nn": "shoal.core.nn",
    "torch.optim": "shoal.core.optim",
    "torch.utils.data": "shoal.core.data",
    "torch": "shoal.core",
}
# torch's test machinery: real torch, never renamed.
KEEP = ("torch.testing", "torch.multiprocessing")
# torch's test modules loaded through the shim, by the name our package gives each copy.
PORTED = {
    "torch.testing._internal.dist_utils": "dist_utils",
    _INTERNAL + "distributed.rpc.rpc_agent_test_fixture": "rpc_agent_test_fixture",
    _INTERNAL + "distributed.rpc.tensorpipe_rpc_agent_test_fixture":
        "tensorpipe_rpc_agent_test_fixture",
    _INTERNAL + "distributed.rpc.rpc_test": "rpc_test",
    _INTERNAL + "distributed.rpc.dist_autograd_test": "dist_autograd_test",
    _INTERNAL + "autocast_test_lists": "autocast_test_lists",
    _INTERNAL + "common_nn": "common_nn",
}
PACKAGE = "tests.torch_ports.ported"
_TORCH_DIR = Path(torch.__file__).resolve().parent


class Missing:
    """What the shim hands out for a torch name shoal lacks; any use raises, naming it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"shoal has no counterpart of {self._name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A decorator at import time (@torch.jit.script): the module still loads, and the
        # decorated function fails when a test calls it.
        if len(args) == 1 and not kwargs and callable(args[0]) and hasattr(args[0], "__name__"):
            return self._fail
        return self._fail()

    __enter__ = _fail
    __iter__ = _fail

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Missing(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<missing {self._name}>"


def _shoal_module(torch_name: str) -> Any:
    """The shoal module that answers for a torch module name, most specific first."""
    for prefix, ours in RENAMES.items():
        if torch_name == prefix or torch_name.startswith(prefix + "."):
            rest = torch_name[len(prefix):]
            for candidate in (ours + rest, ours):
                try:
                    return importlib.import_module(candidate)
                except ImportError:
                    continue
    return None


class Renamed(types.ModuleType):
    """torch's module `name` as a ported test sees it: its attributes come from shoal."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        full = f"{self.__name__}.{attr}"
        value = _lookup(full)
        setattr(self, attr, value)
        return value


def _lookup(full: str) -> Any:
    if full in PORTED:
        return importlib.import_module(f"{PACKAGE}.{PORTED[full]}")
    if full.startswith(KEEP):
        return _real(full)
    if full in RENAMES or any(k.startswith(full + ".") for k in RENAMES):
        return Renamed(full)
    parent, _, attr = full.rpartition(".")
    ours = _shoal_module(parent)
    if ours is not None and hasattr(ours, attr):
        value = getattr(ours, attr)
        if isinstance(value, types.ModuleType) and value.__name__.startswith("shoal."):
            # a submodule (torch.nn.functional -> core.nn.functional): renamed too, so a name
            # it lacks is a Missing placeholder rather than an AttributeError at import
            return Renamed(full)
        return value
    try:  # a submodule of shoal's counterpart (torch.distributed.rpc.api -> rpc_agent.api)
        importlib.import_module(f"{ours.__name__}.{attr}")
        return Renamed(full)
    except (ImportError, AttributeError):
        return Missing(full)


def _real(full: str) -> Any:
    try:
        return importlib.import_module(full)
    except ImportError:
        parent, _, attr = full.rpartition(".")
        return getattr(importlib.import_module(parent), attr)


def _renaming_import(name: str, module_globals: Any = None, module_locals: Any = None,
                     fromlist: Any = (), level: int = 0) -> Any:
    """`__import__` for a ported module: torch's names come from shoal (see RENAMES)."""
    if level or not (name == "torch" or name.startswith("torch.")):
        return builtins.__import__(name, module_globals, module_locals, fromlist, level)
    if not fromlist:
        return Renamed("torch")
    if name in PORTED:
        return _lookup(name)
    if name.startswith(KEEP):  # real torch; the real import also loads fromlist submodules
        return builtins.__import__(name, module_globals, module_locals, fromlist, level)
    return Renamed(name)  # `from torch.x import a`: a is looked up, or Missing


class PortFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds `tests.torch_ports.ported.<name>`: torch's file, executed with renamed imports."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        prefix = PACKAGE + "."
        if not fullname.startswith(prefix) or fullname[len(prefix):] not in PORTED.values():
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        short = module.__name__.rpartition(".")[2]
        torch_name = next(k for k, v in PORTED.items() if v == short)
        path = _TORCH_DIR.parent / (torch_name.replace(".", "/") + ".py")
        own = dict(vars(builtins))
        own["__import__"] = _renaming_import
        module.__dict__["__builtins__"] = own
        module.__file__ = str(path)
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)  # noqa: S102


def install() -> None:
    """Put the finder on sys.meta_path once (the ported package does it on import)."""
    _stub_expecttest()
    if not any(isinstance(f, PortFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, PortFinder())


def _stub_expecttest() -> None:
    """torch's common_utils imports expecttest (a test-only package the wheel does not ship)
    for one base class and assertExpectedInline, which no ported test uses."""
    try:
        import expecttest  # noqa: F401 - only to learn whether it is installed
    except ImportError:
        import unittest

        stub = types.ModuleType("expecttest")
        stub.TestCase = unittest.TestCase
        sys.modules["expecttest"] = stub
