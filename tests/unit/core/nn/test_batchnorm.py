"""BatchNorm1d/2d and F.batch_norm against torch: outputs, gradients, running statistics."""

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn import functional as F
from tests.support.gradcheck import gradcheck

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("cls, tcls, shape", [
    (nn.BatchNorm2d, torch.nn.BatchNorm2d, (4, 3, 5, 6)),
    (nn.BatchNorm1d, torch.nn.BatchNorm1d, (8, 3)),
    (nn.BatchNorm1d, torch.nn.BatchNorm1d, (4, 3, 7)),
])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_layer_matches_torch_over_steps_and_in_eval(cls, tcls, shape, momentum):
    ours = cls(3, momentum=momentum).double()
    ref = tcls(3, momentum=momentum).double()
    assert list(ours.state_dict()) == list(ref.state_dict())
    rng = np.random.default_rng(0)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(rng.standard_normal(3)))
        ref.bias.copy_(torch.tensor(rng.standard_normal(3)))
    ours.load_state_dict({k: core.tensor(v.numpy()) for k, v in ref.state_dict().items()})
    for _ in range(3):
        x = rng.standard_normal(shape) * 2 + 1
        g = rng.standard_normal(shape)
        xs, xt = core.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
        ys, yt = ours(xs), ref(xt)
        np.testing.assert_allclose(ys.detach().numpy(), yt.detach().numpy(), atol=1e-12)
        (ys * core.tensor(g)).sum().backward()
        (yt * torch.tensor(g)).sum().backward()
        np.testing.assert_allclose(xs.grad.numpy(), xt.grad.numpy(), atol=1e-12)
    np.testing.assert_allclose(ours.weight.grad.numpy(), ref.weight.grad.numpy(), atol=1e-10)
    np.testing.assert_allclose(ours.bias.grad.numpy(), ref.bias.grad.numpy(), atol=1e-10)
    for key, value in ref.state_dict().items():
        np.testing.assert_allclose(ours.state_dict()[key].numpy(), value.numpy(), atol=1e-12,
                                   err_msg=key)
    ours.eval(), ref.eval()
    x = rng.standard_normal(shape)
    xs, xt = core.tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    ys, yt = ours(xs), ref(xt)
    np.testing.assert_allclose(ys.detach().numpy(), yt.detach().numpy(), atol=1e-12)
    ys.sum().backward(), yt.sum().backward()
    np.testing.assert_allclose(xs.grad.numpy(), xt.grad.numpy(), atol=1e-12)


def test_batch_norm_gradients_match_finite_differences():
    rng = np.random.default_rng(1)
    rm, rv = core.zeros(3, dtype=core.float64), core.ones(3, dtype=core.float64)
    gradcheck(lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=True),
              rng.standard_normal((4, 3, 2, 2)), rng.standard_normal(3), rng.standard_normal(3),
              atol=1e-5)


def test_without_running_stats_uses_batch_statistics_in_eval():
    ours, ref = nn.BatchNorm2d(2, track_running_stats=False), torch.nn.BatchNorm2d(2, track_running_stats=False)
    assert list(ours.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    ours.eval(), ref.eval()
    x = np.random.default_rng(2).standard_normal((3, 2, 4, 4)).astype(np.float32)
    np.testing.assert_allclose(ours(core.tensor(x)).detach().numpy(),
                               ref(torch.tensor(x)).detach().numpy(), atol=1e-5)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match=r"expected 4D input \(got 3D input\)"):
        nn.BatchNorm2d(3)(core.randn(2, 3, 4))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        nn.BatchNorm1d(3)(core.randn(1, 3))
