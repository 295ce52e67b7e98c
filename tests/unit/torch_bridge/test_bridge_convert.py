"""The bridge's reading of torch's arguments: ReduceOp, timeouts, async flag, tensors in place."""

from __future__ import annotations

import datetime

import pytest

from shoal.collectives.types import ReduceOp

dist = pytest.importorskip("torch.distributed")
torch = pytest.importorskip("torch")
cv = pytest.importorskip("shoal.torch_bridge.convert")


@pytest.mark.parametrize("name", ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"])
def test_every_torch_reduce_op_maps_to_shoals_of_the_same_name(name):
    opts = dist.AllreduceOptions()
    opts.reduceOp = getattr(dist.ReduceOp, name)
    assert cv.reduce_op(opts) is ReduceOp[name]


def test_an_unset_timeout_is_the_groups_and_a_set_one_is_seconds():
    opts = dist.AllreduceOptions()
    assert cv.timeout_of(opts) is None  # torch's "unset" is -1 ms
    opts.timeout = datetime.timedelta(seconds=2.5)
    assert cv.timeout_of(opts) == 2.5
    assert cv.is_async(opts) and cv.is_async(None)
    opts.asyncOp = False
    assert not cv.is_async(opts)


def test_a_parameter_is_used_in_place_below_autograd_as_gloo_does():
    p = torch.nn.Parameter(torch.zeros(3))
    cv.host_array(p, "x")[:] = 2
    assert p.detach().tolist() == [2, 2, 2] and p.requires_grad


def test_a_multi_device_list_is_refused_naming_the_host_only_rule():
    with pytest.raises(ValueError, match=r"^broadcast takes a list of one tensor per device and "
                                         r"the shoal backend drives the host only, got 2 tensors"):
        cv.one([torch.ones(1), torch.ones(1)], "broadcast")
