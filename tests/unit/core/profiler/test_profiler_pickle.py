"""Op functions pickle by their real name while the profiler has swapped them for its timing
wrappers (RPC sends functions by reference), as torch's ops pickle inside torch's profiler."""

from __future__ import annotations

import pickle

import torch
import torch.profiler as tp

from shoal import core
from shoal.core import profiler as P
from shoal.core.ops import arith
from shoal.core.profiler import instrument


def test_a_wrapped_op_pickles_as_its_real_name_and_back() -> None:
    original = arith.add
    plain = pickle.dumps(core.add)
    with tp.profile():
        assert pickle.loads(pickle.dumps(torch.add)) is torch.add
    with P.profile() as prof:
        wrapped = core.add
        assert wrapped is not original  # the profiler's wrapper...
        data = pickle.dumps(wrapped)
        assert data == plain  # ...written exactly as the op itself
        assert pickle.loads(data) is wrapped  # the name resolves to what is installed now
        assert instrument.wrapper_for(original) is wrapped
        assert wrapped.__module__ == original.__module__ == "shoal.core.ops.arith"
        wrapped(core.ones(1), 1)
    assert [fe.name for fe in prof.events()].count("add") == 1
    assert pickle.loads(data) is original is arith.add
    assert instrument.wrapper_for(original) is original  # nothing installed: the op itself
