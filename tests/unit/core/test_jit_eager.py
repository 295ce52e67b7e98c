"""core.jit's decorators run the function eagerly with torch's results."""

from __future__ import annotations

import torch

from shoal import core


def test_script_and_trace_return_what_they_were_given_and_it_runs_as_torchs():
    def f(x):
        return x * 2 + 1

    mine = core.jit.script(f)
    theirs = torch.jit.script(f)
    assert mine is f and core.jit.trace(f, (core.ones(2),)) is f
    assert mine(core.tensor([1.0, 2.0])).tolist() == theirs(torch.tensor([1.0, 2.0])).tolist()
    assert core.jit.is_scripting() is False and core.jit.ignore(f) is f
    assert core.jit.unused()(f) is f
