"""`Tensor.data` against torch: a tensor sharing the storage that autograd does not track."""

import numpy as np
import pytest
import torch

import shoal.core as core
from shoal.core import nn

VALUES = np.array([1.0, -2.0, 3.0], dtype=np.float32)


def _pair(requires_grad=True):
    return core.tensor(VALUES, requires_grad=requires_grad), torch.tensor(
        VALUES, requires_grad=requires_grad
    )


def _same(mine, theirs):
    # Exact: every case here is a copy, a zero fill or a power-of-two scaling of float32 values.
    np.testing.assert_array_equal(mine.detach().numpy(), theirs.detach().numpy())


def test_data_is_a_detached_tensor_sharing_storage_with_its_own_version():
    mine, theirs = _pair()
    d_mine, d_theirs = mine.data, theirs.data
    assert isinstance(d_mine, core.Tensor) and isinstance(d_theirs, torch.Tensor)
    for d in (d_mine, d_theirs):
        assert not d.requires_grad and d.grad_fn is None and d.is_leaf and d.grad is None
    assert np.shares_memory(d_mine.numpy(), mine.detach().numpy())
    d_mine.mul_(2.0)
    d_theirs.mul_(2.0)
    _same(mine, theirs)
    # The update counts in the .data tensor's own counter, not in the tensor it came from.
    assert (d_mine._version, mine._version) == (d_theirs._version, theirs._version) == (1, 0)


def test_data_of_a_parameter_and_of_a_graph_output_is_a_plain_leaf():
    p_mine, p_theirs = nn.Parameter(core.tensor(VALUES)), torch.nn.Parameter(torch.tensor(VALUES))
    assert type(p_mine.data) is core.Tensor and type(p_theirs.data) is torch.Tensor
    mine, theirs = _pair()
    y_mine, y_theirs = mine * 2, theirs * 2
    for d in (y_mine.data, y_theirs.data):
        assert not d.requires_grad and d.grad_fn is None and d.is_leaf


def test_data_copy_and_mul_update_a_leaf_that_requires_grad_in_grad_mode():
    mine, theirs = _pair()
    src = np.array([4.0, 5.0, 6.0], dtype=np.float32)
    mine.data.copy_(core.tensor(src))
    theirs.data.copy_(torch.tensor(src))
    _same(mine, theirs)
    mine.data.mul_(0.5)
    theirs.data.mul_(0.5)
    _same(mine, theirs)
    assert mine.requires_grad and mine.is_leaf and mine._version == theirs._version == 0


def test_grad_data_zero_clears_the_gradient_in_place():
    mine, theirs = _pair()
    (mine * mine).sum().backward()
    (theirs * theirs).sum().backward()
    grad_mine, grad_theirs = mine.grad, theirs.grad
    mine.grad.data.zero_()
    theirs.grad.data.zero_()
    assert mine.grad is grad_mine and theirs.grad is grad_theirs
    _same(mine.grad, theirs.grad)


def test_sgd_written_with_data_matches_torch():
    mine, theirs = _pair()
    for _ in range(3):
        (mine * mine).sum().backward()
        (theirs * theirs).sum().backward()
        mine.data -= 0.25 * mine.grad.data
        theirs.data -= 0.25 * theirs.grad.data
        mine.grad.data.zero_()
        theirs.grad.data.zero_()
    _same(mine, theirs)


def test_autograd_does_not_see_updates_through_data():
    mine, theirs = _pair()
    y_mine, y_theirs = (mine * mine).sum(), (theirs * theirs).sum()
    mine.data.mul_(4.0)
    theirs.data.mul_(4.0)
    # No "modified by an inplace operation" error: the saved value is read as it is now.
    y_mine.backward()
    y_theirs.backward()
    _same(mine.grad, theirs.grad)


def test_setting_data_replaces_the_storage_and_keeps_autograd_state():
    mine, theirs = _pair()
    new = np.zeros((2, 2), dtype=np.float64)
    t_mine, t_theirs = core.tensor(new), torch.tensor(new)
    mine.data = t_mine
    theirs.data = t_theirs
    for m, t in ((mine, t_mine), (theirs, t_theirs)):
        assert m.requires_grad and m.is_leaf and tuple(m.shape) == (2, 2)
    assert mine.dtype == core.float64 and theirs.dtype == torch.float64
    t_mine.fill_(7.0)
    t_theirs.fill_(7.0)
    _same(mine, theirs)  # shared with the assigned tensor
    (mine * mine).sum().backward()
    (theirs * theirs).sum().backward()
    _same(mine.grad, theirs.grad)


def test_setting_data_from_a_tensor_that_requires_grad_is_allowed():
    mine, theirs = _pair()
    other_mine, other_theirs = _pair()
    mine.data = other_mine * 3
    theirs.data = other_theirs * 3
    assert mine.requires_grad and mine.is_leaf and theirs.requires_grad and theirs.is_leaf
    _same(mine, theirs)


def test_setting_data_on_a_graph_output_keeps_its_grad_fn():
    mine, theirs = _pair()
    y_mine, y_theirs = mine * 2, theirs * 2
    y_mine.data = core.zeros(3)
    y_theirs.data = torch.zeros(3)
    assert y_mine.grad_fn is not None and y_theirs.grad_fn is not None
    _same(y_mine, y_theirs)


@pytest.mark.parametrize(
    "value, name",
    [(np.ones(3), "numpy.ndarray"), (1, "int"), ([1.0, 2.0, 3.0], "list"), (None, "NoneType")],
    ids=["ndarray", "int", "list", "None"],
)
def test_setting_data_to_anything_but_a_tensor_raises_torchs_type_error(value, name):
    mine, theirs = _pair()
    message = f"^Variable data has to be a tensor, but got {name}$"
    with pytest.raises(TypeError, match=message):
        theirs.data = value
    with pytest.raises(TypeError, match=message):
        mine.data = value


def test_setting_integer_data_on_a_tensor_that_requires_grad_raises():
    mine, theirs = _pair()
    message = "^data set to a tensor that requires gradients must be floating point or complex"
    with pytest.raises(RuntimeError, match=message):
        theirs.data = torch.ones(3, dtype=torch.int64)
    with pytest.raises(RuntimeError, match=message):
        mine.data = core.ones(3, dtype=core.int64)
    _same(mine, theirs)  # unchanged
    plain_mine, plain_theirs = _pair(requires_grad=False)
    plain_mine.data = core.ones(3, dtype=core.int64)
    plain_theirs.data = torch.ones(3, dtype=torch.int64)
    assert plain_mine.dtype == core.int64 and plain_theirs.dtype == torch.int64


def test_numpy_reads_data_without_a_copy():
    mine, theirs = _pair()
    arr_mine, arr_theirs = np.asarray(mine.data), np.asarray(theirs.data)
    np.testing.assert_array_equal(arr_mine, arr_theirs)
    assert np.shares_memory(arr_mine, mine.array)
    assert np.shares_memory(mine.data.numpy(), mine.array)
