"""core.use_deterministic_algorithms on a real GPU: the one op core has without a deterministic
form (cupyx.scatter_add, behind the backward of indexing and of nn.Embedding) raises naming
itself when the flag is on, warns with warn_only, and runs (adding repeated indices up) when it
is off. On the CPU every op is deterministic, so only a GPU can show this."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.determinism import NondeterministicError

cp = pytest.importorskip("cupy")

_MESSAGE = (r"scatter_add on cuda \(the backward of indexing and embedding\) does not have a "
            r"deterministic implementation, but you set 'core.use_deterministic_algorithms\(True\)'")


@pytest.fixture(autouse=True)
def _flag_off_after():
    yield
    core.use_deterministic_algorithms(False)


def _embedding_backward():
    emb = nn.Embedding(10, 4).to("cuda")
    ids = core.tensor(np.array([1, 3, 3, 7]), device="cuda")
    emb(ids).sum().backward()
    return emb.weight.grad


def test_embedding_backward_on_cuda_raises_naming_the_op_when_the_flag_is_on():
    core.use_deterministic_algorithms(True)
    with pytest.raises(NondeterministicError, match=_MESSAGE):
        _embedding_backward()


def test_indexing_backward_on_cuda_raises_too():
    core.use_deterministic_algorithms(True)
    x = core.randn(6, 3, device="cuda", requires_grad=True)
    with pytest.raises(NondeterministicError, match=_MESSAGE):
        x[core.tensor(np.array([0, 2, 2]), device="cuda")].sum().backward()


def test_warn_only_warns_and_runs_and_off_runs_silently():
    core.use_deterministic_algorithms(True, warn_only=True)
    with pytest.warns(UserWarning, match=_MESSAGE):
        grad = _embedding_backward()
    expected = np.zeros((10, 4))
    expected[[1, 7]] = 1.0
    expected[3] = 2.0  # the repeated index is added up
    np.testing.assert_array_equal(cp.asnumpy(grad.array), expected)
    core.use_deterministic_algorithms(False)
    np.testing.assert_array_equal(cp.asnumpy(_embedding_backward().array), expected)
