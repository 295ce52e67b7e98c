"""core.set_default_dtype / get_default_dtype against torch's: every creator, Python scalar
and integer-to-float rule gives torch's dtype under each allowed default."""

from __future__ import annotations

import pytest
import torch

from shoal import core

_CASES = {
    "tensor of floats": lambda L: L.tensor([1.5, 2.0]),
    "tensor of complex": lambda L: L.tensor([1 + 2j]),
    "zeros": lambda L: L.zeros(2), "ones": lambda L: L.ones(2), "empty": lambda L: L.empty(2),
    "rand": lambda L: L.rand(2), "randn": lambda L: L.randn(2), "eye": lambda L: L.eye(2),
    "full of a float": lambda L: L.full((2,), 1.5),
    "arange of floats": lambda L: L.arange(0, 1, 0.5), "linspace": lambda L: L.linspace(0, 1, 3),
    "int / int": lambda L: L.tensor([1, 2]) / 2, "int + 1.5": lambda L: L.tensor([1]) + 1.5,
    "sqrt of int": lambda L: L.sqrt(L.tensor([4])), "exp of int": lambda L: L.exp(L.tensor([1])),
    "sin of int": lambda L: L.sin(L.tensor([1])), "Linear's weight": lambda L: L.nn.Linear(2, 3).weight,
    "zeros_like of int": lambda L: L.zeros_like(L.tensor([1])),
    "float32 + 1.5": lambda L: L.tensor([1.0], dtype=L.float32) + 1.5,
}


@pytest.fixture
def default(request):
    name = request.param
    torch.set_default_dtype(getattr(torch, name))
    core.set_default_dtype(getattr(core, name))
    yield name
    torch.set_default_dtype(torch.float32)
    core.set_default_dtype(core.float32)


# (a complex Python number under a 16-bit default: torch makes complex32 or refuses; shoal has
# no complex32, so those two pairs are not compared)
_PAIRS = [(d, c) for d in ("float32", "float64", "float16", "bfloat16") for c in _CASES
          if not (d in ("float16", "bfloat16") and c == "tensor of complex")]


@pytest.mark.parametrize(("default", "case"), _PAIRS, indirect=["default"])
def test_dtype_matches_torch(default, case) -> None:
    theirs = str(_CASES[case](torch).dtype).rpartition(".")[2]
    assert str(_CASES[case](core).dtype).rpartition(".")[2] == theirs
    assert str(core.get_default_dtype()).rpartition(".")[2] == default


def test_only_floating_types_can_be_the_default() -> None:
    with pytest.raises(TypeError, match="only floating-point types"):
        core.set_default_dtype(core.int64)
    assert core.get_default_dtype() is core.float32
