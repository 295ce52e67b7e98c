"""The gap to torch, printed rather than guessed: torch's public names, namespace by namespace,
that shoal's counterpart lacks. Missing names do not fail the report; a name from issue 35's
must-have list does (one case each, a strict xfail while it is missing, so a landed name shows
up as XPASS and its mark goes)."""

from __future__ import annotations

import importlib
import inspect
import textwrap
from typing import Any

import pytest
import torch

# torch's namespace and the shoal module that answers for it.
NAMESPACES = {
    "torch": "shoal.core",
    "torch.Tensor": "shoal.core.Tensor",
    "torch.nn": "shoal.core.nn",
    "torch.nn.functional": "shoal.core.nn.functional",
    "torch.optim": "shoal.core.optim",
    "torch.optim.lr_scheduler": "shoal.core.optim.lr_scheduler",
    "torch.utils.data": "shoal.core.data",
    "torch.autograd": "shoal.core.autograd",
    "torch.linalg": "shoal.core.linalg",
    "torch.fft": "shoal.core.fft",
    "torch.special": "shoal.core.special",
}


def resolve(path: str) -> Any:
    """The object a dotted path names (modules imported on the way), or None."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            try:
                obj = getattr(obj, name)
            except (AttributeError, ImportError):  # a module __getattr__ may say where it went
                return None
        return obj
    return None


def public_names(obj: Any) -> set[str]:
    """A namespace's public names: its __all__ where it has one, else every name without a
    leading underscore that is not a submodule or a module it imported."""
    names = getattr(obj, "__all__", None) if inspect.ismodule(obj) else None
    if names is None:
        names = [n for n in dir(obj) if not n.startswith("_")]
        names = [n for n in names if not inspect.ismodule(getattr(obj, n, None))]
    return {n for n in names if not n.startswith("_")}


def gap() -> dict[str, list[str]]:
    """torch's public names each shoal counterpart lacks, by torch namespace."""
    out = {}
    for theirs, mine in NAMESPACES.items():
        ours = resolve(mine)
        names = public_names(resolve(theirs))
        out[theirs] = sorted(n for n in names if ours is None or not hasattr(ours, n))
    return out


def _report(config: pytest.Config, capsys: pytest.CaptureFixture,
            lacking: dict[str, list[str]]) -> None:
    """Write the gap to the terminal, one section per namespace (past output capture, so it
    shows whether the test passes or not)."""
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is None:
        return
    with capsys.disabled():
        _write(reporter, lacking)


def _write(reporter: Any, lacking: dict[str, list[str]]) -> None:
    reporter.write_line("")
    reporter.write_sep("-", "torch's public names that shoal lacks")
    for namespace, names in lacking.items():
        total = len(public_names(resolve(namespace)))
        reporter.write_line(f"{namespace} -> {NAMESPACES[namespace]}: "
                            f"{len(names)} of {total} missing")
        for line in textwrap.wrap(", ".join(names), 96):
            reporter.write_line("    " + line)


def test_print_the_gap_to_torch(request: pytest.FixtureRequest,
                                capsys: pytest.CaptureFixture) -> None:
    """Prints the gap; fails only if the listing itself breaks (a namespace torch lacks)."""
    lacking = gap()
    for namespace in NAMESPACES:
        assert resolve(namespace) is not None, f"torch {torch.__version__} has no {namespace}"
    _report(request.config, capsys, lacking)


# Issue 35's must-have names: (torch's path, shoal's path). None for shoal means the same path
# with torch's namespace mapped by NAMESPACES.
MUST_HAVE = [
    "torch.Generator", "torch.Tensor.repeat", "torch.Tensor.norm", "torch.Tensor.mm",
    "torch.Tensor.bmm", "torch.Tensor.narrow", "torch.Tensor.cos", "torch.Tensor.is_pinned",
    "torch.Tensor.is_sparse", "torch.conv1d", "torch.conv2d", "torch.linalg.multi_dot",
    "torch.autograd.Function", "torch.autograd.grad", "torch.LongTensor", "torch.FloatTensor",
    "torch.IntTensor", "torch.DoubleTensor", "torch.Size", "torch.cuda.is_available",
    "torch.cuda.device_count", "torch.backends", "torch.testing.assert_close",
    "torch.optim.Adagrad", "torch.optim.Adadelta", "torch.optim.RMSprop", "torch.optim.Adamax",
    "torch.optim.Rprop", "torch.optim.NAdam", "torch.optim.RAdam",
    "torch.optim.lr_scheduler.MultiStepLR", "torch.optim.lr_scheduler.ConstantLR",
    "torch.optim.lr_scheduler.LinearLR", "torch.optim.lr_scheduler.PolynomialLR",
    "torch.optim.lr_scheduler.SequentialLR", "torch.optim.lr_scheduler.OneCycleLR",
    "torch.optim.lr_scheduler.CosineAnnealingWarmRestarts",
    "torch.optim.lr_scheduler.ReduceLROnPlateau", "torch.nn.L1Loss", "torch.nn.SmoothL1Loss",
    "torch.nn.RNN", "torch.nn.LSTM", "torch.nn.GRU", "torch.nn.RNNCell", "torch.nn.LSTMCell",
    "torch.nn.GRUCell", "torch.nn.EmbeddingBag", "torch.distributions.Normal",
    "torch.distributions.Categorical", "torch.distributions.Bernoulli",
    "torch.distributions.Uniform", "torch.autograd.profiler.profile",
    "torch.profiler.supported_activities", "torch.autograd.kineto_available",
    "torch.utils.data.ChainDataset", "torch.utils.data.StackDataset",
    "torch.utils.data.WeightedRandomSampler", "torch.utils.data.datapipes.iter.FileLister",
    "torch.utils.data.datapipes.iter.Multiplexer", "torch.utils.data.datapipes.iter.Forker",
    "torch.utils.data.datapipes.iter.Demultiplexer",
    # shoal.collectives.nn says why it is a layer up: it is built on RPC.
    ("torch.distributed.nn.RemoteModule", "shoal.rpc_agent.nn.RemoteModule"),
    ("torch.distributed.autograd.context", "shoal.rpc_agent.dist_autograd.context"),
    ("torch.distributed.autograd.get_gradients", "shoal.rpc_agent.dist_autograd.get_gradients"),
]

# Where shoal's module tree differs from torch's beyond NAMESPACES.
_PREFIXES = {
    "torch.utils.data.datapipes.iter.": "shoal.core.data.datapipes.",
    "torch.distributions.": "shoal.core.distributions.",
    "torch.autograd.profiler.": "shoal.core.profiler.",
    "torch.autograd.kineto_available": "shoal.core.profiler.kineto_available",
    "torch.profiler.": "shoal.core.profiler.",
    "torch.cuda.": "shoal.core.cuda.",
    "torch.testing.": "shoal.core.testing.",
    "torch.backends": "shoal.core.backends",
}

# Names not there when this list was written; other issue-35 work adds them (remove a mark
# when its case XPASSes).
_NOT_YET: dict[str, str] = {}


def shoal_path(torch_path: str) -> str:
    """Where shoal keeps what torch_path names."""
    for prefix, ours in _PREFIXES.items():
        if torch_path.startswith(prefix):
            return ours + torch_path[len(prefix):]
    namespace = max((n for n in NAMESPACES if torch_path.startswith(n + ".")), key=len)
    return NAMESPACES[namespace] + torch_path[len(namespace):]


def _cases():
    for entry in MUST_HAVE:
        theirs, mine = entry if isinstance(entry, tuple) else (entry, shoal_path(entry))
        marks = ([pytest.mark.xfail(strict=True, reason=_NOT_YET[theirs])]
                 if theirs in _NOT_YET else [])
        yield pytest.param(theirs, mine, id=theirs, marks=marks)


@pytest.mark.parametrize("theirs,mine", list(_cases()))
def test_a_must_have_name_exists(theirs: str, mine: str) -> None:
    """Issue 35's everyday names: torch has it (the list is right), and so does shoal."""
    assert resolve(theirs) is not None, f"the list is wrong: torch {torch.__version__} lacks {theirs}"
    assert resolve(mine) is not None, f"shoal lacks {mine} (torch's {theirs})"
