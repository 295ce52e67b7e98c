"""The everyday names issue 35 found missing, each against torch: values, gradients, errors."""

import math

import numpy as np
import pytest
import torch

import shoal.core as core

_X = np.array([[0.5, -2.0, 1.5], [3.0, 4.0, -0.25]], dtype=np.float32)


def _both(fn_mine, fn_theirs, x=_X):
    mine, theirs = core.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    out_m, out_t = fn_mine(mine), fn_theirs(theirs)
    out_m.sum().backward()
    out_t.sum().backward()
    # float32: one rounding per elementary op in each; the composed norms sum 6 terms in a
    # possibly different order, a few ulps.
    np.testing.assert_allclose(out_m.detach().numpy(), out_t.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mine.grad.numpy(), theirs.grad.numpy(), rtol=1e-5, atol=1e-6)
    assert tuple(out_m.shape) == tuple(out_t.shape)


@pytest.mark.parametrize("name", ["sin", "cos", "tan"])
def test_trig(name):
    _both(lambda t: getattr(t, name)(), lambda t: getattr(t, name)())
    _both(getattr(core, name), getattr(torch, name))


@pytest.mark.parametrize("p", ["fro", 2, 1, 3, math.inf, -math.inf])
@pytest.mark.parametrize("dim,keepdim", [(None, False), (1, False), (0, True)])
def test_norm(p, dim, keepdim):
    _both(lambda t: t.norm(p=p, dim=dim, keepdim=keepdim), lambda t: t.norm(p=p, dim=dim, keepdim=keepdim))


def test_mm_bmm_and_their_errors():
    b = np.ones((3, 4), np.float32)
    _both(lambda t: t.mm(core.tensor(b)), lambda t: t.mm(torch.tensor(b)))
    _both(lambda t: core.bmm(t.reshape(1, 2, 3), core.tensor(b).reshape(1, 3, 4)),
          lambda t: torch.bmm(t.reshape(1, 2, 3), torch.tensor(b).reshape(1, 3, 4)))
    for lib in (core, torch):
        with pytest.raises(RuntimeError, match="self must be a matrix"):
            lib.mm(lib.ones(3), lib.ones(3, 3))
        with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied \(2x3 and 2x3\)"):
            lib.mm(lib.ones(2, 3), lib.ones(2, 3))
        with pytest.raises(RuntimeError, match="batch1 must be a 3D tensor"):
            lib.bmm(lib.ones(2, 3), lib.ones(1, 3, 3))


def test_narrow_is_a_view_with_torchs_checks():
    _both(lambda t: t.narrow(1, 1, 2), lambda t: t.narrow(1, 1, 2))
    _both(lambda t: core.narrow(t, -1, 0, 1), lambda t: torch.narrow(t, -1, 0, 1))
    for lib in (core, torch):
        t = lib.zeros(2, 3)
        t.narrow(1, 1, 1).fill_(7)
        assert t.tolist() == [[0, 7, 0], [0, 7, 0]]
        with pytest.raises(RuntimeError, match="exceeds dimension size"):
            t.narrow(1, 2, 2)


@pytest.mark.parametrize("sizes", [(2, 1), (1, 3), (2, 2, 2), ((3, 1),)])
def test_repeat(sizes):
    _both(lambda t: t.repeat(*sizes), lambda t: t.repeat(*sizes))
    for lib in (core, torch):
        with pytest.raises(RuntimeError, match="can not be smaller than number of dimensions"):
            lib.ones(2, 2).repeat(2)


def test_multi_dot_and_top_level_conv():
    a, b, c = (np.arange(n, dtype=np.float64).reshape(s) for n, s in ((6, (2, 3)), (12, (3, 4)), (4, (4,))))
    mine = core.linalg.multi_dot([core.tensor(a), core.tensor(b), core.tensor(c)])
    theirs = torch.linalg.multi_dot([torch.tensor(a), torch.tensor(b), torch.tensor(c)])
    np.testing.assert_array_equal(mine.numpy(), theirs.numpy())  # small integers: exact in float64
    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    np.testing.assert_array_equal(core.conv2d(core.tensor(x), core.tensor(w)).numpy(),
                                  torch.conv2d(torch.tensor(x), torch.tensor(w)).numpy())  # sums of 18 ones
    np.testing.assert_array_equal(core.conv1d(core.tensor(x[:, :, 0]), core.tensor(w[:, :, 0])).numpy(),
                                  torch.conv1d(torch.tensor(x[:, :, 0]), torch.tensor(w[:, :, 0])).numpy())


def test_legacy_constructors_size_and_flags():
    for name, dt in (("LongTensor", "int64"), ("FloatTensor", "float32"), ("IntTensor", "int32"), ("DoubleTensor", "float64")):
        mine, theirs = getattr(core, name)([1, 2]), getattr(torch, name)([1, 2])
        assert mine.tolist() == theirs.tolist() and str(theirs.dtype) == f"torch.{dt}" and mine.dtype == getattr(core, dt)
        assert tuple(getattr(core, name)(2, 3).shape) == tuple(getattr(torch, name)(2, 3).shape)
    assert core.Size([2, 3]) == torch.Size([2, 3]) and core.Size([2, 3]).numel() == torch.Size([2, 3]).numel()
    t, u = core.ones(2), torch.ones(2)
    assert t.is_sparse == u.is_sparse and t.is_pinned() == u.is_pinned()


def test_cuda_and_backends_answer_without_cuda():
    assert core.cuda.is_available() == (core.cuda.device_count() > 0)
    assert core.backends.mps.is_available() is False
    core.backends.cudnn.benchmark = True  # scripts set these flags; shoal keeps them
    assert core.backends.cudnn.benchmark is True
    core.backends.cudnn.benchmark = False
    if not core.cuda.is_available():
        with pytest.raises(RuntimeError, match="no NVIDIA driver|Found no NVIDIA driver"):
            core.cuda.current_device()


def test_assert_close_tolerances_and_message():
    for lib in (core, torch):
        lib.testing.assert_close(lib.tensor([1.0, 2.0]), lib.tensor([1.0, 2.0 + 1e-6]))  # within float32's
        with pytest.raises(AssertionError, match=r"Tensor-likes are not close!\n\nMismatched elements: 1 / 3 \(33.3%\)"):
            lib.testing.assert_close(lib.tensor([1.0, 2.0, 3.0]), lib.tensor([1.0, 2.1, 3.0]))
        with pytest.raises(AssertionError, match="dtype"):
            lib.testing.assert_close(lib.tensor([1.0]), lib.tensor([1.0], dtype=lib.float64))
        with pytest.raises(AssertionError, match=r"Scalars are not equal!\n\nExpected 2 but got 1.\nAbsolute difference: 1\n"):
            lib.testing.assert_close(lib.tensor(1), lib.tensor(2))
