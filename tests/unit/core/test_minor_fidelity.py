"""Small behaviours that must match torch: autocast's device_type check, empty BatchNorm batches."""

import numpy as np
import pytest
import torch

import shoal.core as core


def test_autocast_refuses_a_device_object_with_torchs_error():
    for lib in (core, torch):
        with pytest.raises(ValueError, match="Expected `device_type` of type `str`, got"):
            lib.autocast(device_type=lib.device("cpu"))


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_on_an_empty_batch_returns_an_empty_output(training):
    results = []
    for lib in (core, torch):
        bn = lib.nn.BatchNorm1d(3)
        bn.train(training)
        x = lib.zeros(0, 3, requires_grad=True)
        y = bn(x)
        y.sum().backward()
        results.append((tuple(y.shape), x.grad.shape == x.shape, bn.running_mean.tolist(),
                        bn.running_var.tolist(), int(bn.num_batches_tracked),
                        bn.weight.grad.tolist(), bn.bias.grad.tolist()))
    assert results[0] == results[1]


def test_batchnorm2d_empty_batch_keeps_the_shape():
    mine = core.nn.BatchNorm2d(4)(core.zeros(0, 4, 2, 2))
    theirs = torch.nn.BatchNorm2d(4)(torch.zeros(0, 4, 2, 2))
    assert tuple(mine.shape) == tuple(theirs.shape) and mine.dtype == core.float32
    np.testing.assert_array_equal(mine.detach().numpy(), theirs.detach().numpy())  # both empty
