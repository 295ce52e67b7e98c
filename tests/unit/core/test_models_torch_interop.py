"""The example GPT and ConvNet: state_dicts load across torch and shoal both ways (through
numpy), and the loaded models agree with torch on outputs and every gradient (float64)."""

import numpy as np
import pytest

from shoal import core
from shoal.core.nn import functional as F
from shoal.examples.train_convnet import ConvNet
from shoal.examples.train_gpt import GPT

torch = pytest.importorskip("torch")
from tests.support.torch_models import TorchConvNet, TorchGPT  # noqa: E402

VOCAB = 23


def _to_numpy(state):
    return {k: (v.detach().numpy() if isinstance(v, torch.Tensor) else v.numpy()).copy()
            for k, v in state.items()}


def _check_same(ours, ref, x, loss_fn_ours, loss_fn_ref, atol):
    out, tout = ours(core.tensor(x)), ref(torch.tensor(x))
    np.testing.assert_allclose(out.detach().numpy(), tout.detach().numpy(), atol=atol)
    loss_fn_ours(out).backward()
    loss_fn_ref(tout).backward()
    tgrads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        np.testing.assert_allclose(p.grad.numpy(), tgrads[name].grad.numpy(), atol=atol,
                                   err_msg=name)


def _gpt_pair():
    core.manual_seed(0)
    torch.manual_seed(0)
    ours = GPT(VOCAB, context=16, d_model=32, n_layer=2, n_head=4).double()
    ref = TorchGPT(VOCAB, context=16, d_model=32, n_layer=2, n_head=4).double()
    assert list(ours.state_dict()) == list(ref.state_dict())
    return ours, ref


def _gpt_inputs():
    rng = np.random.default_rng(0)
    return rng.integers(0, VOCAB, (3, 16)), rng.integers(0, VOCAB, (3 * 16,))


def test_gpt_state_dict_from_torch_to_shoal():
    ours, ref = _gpt_pair()
    ours.load_state_dict({k: core.tensor(v) for k, v in _to_numpy(ref.state_dict()).items()})
    x, y = _gpt_inputs()
    _check_same(ours, ref, x,
                lambda o: F.cross_entropy(o.reshape(-1, VOCAB), core.tensor(y)),
                lambda o: torch.nn.functional.cross_entropy(o.reshape(-1, VOCAB), torch.tensor(y)),
                atol=1e-9)


def test_gpt_state_dict_from_shoal_to_torch():
    ours, ref = _gpt_pair()
    ref.load_state_dict({k: torch.tensor(v) for k, v in _to_numpy(ours.state_dict()).items()})
    assert ref.head.weight is ref.tok.weight  # loading keeps torch's tie
    x, y = _gpt_inputs()
    _check_same(ours, ref, x,
                lambda o: F.cross_entropy(o.reshape(-1, VOCAB), core.tensor(y)),
                lambda o: torch.nn.functional.cross_entropy(o.reshape(-1, VOCAB), torch.tensor(y)),
                atol=1e-9)


@pytest.mark.parametrize("direction", ["torch_to_shoal", "shoal_to_torch"])
def test_convnet_state_dict_round_trips_with_running_stats(direction):
    core.manual_seed(0)
    torch.manual_seed(0)
    ours, ref = ConvNet(width=8).double(), TorchConvNet(width=8).double()
    assert list(ours.state_dict()) == list(ref.state_dict())
    rng = np.random.default_rng(1)
    src, dst = (ref, ours) if direction == "torch_to_shoal" else (ours, ref)
    src.train()
    with torch.no_grad(), core.no_grad():  # move the running statistics off their defaults
        src(torch.tensor(rng.random((6, 1, 8, 8))) if src is ref else core.tensor(rng.random((6, 1, 8, 8))))
    state = _to_numpy(src.state_dict())
    assert state["features.1.num_batches_tracked"] == 1
    if dst is ours:
        ours.load_state_dict({k: core.tensor(v) for k, v in state.items()})
    else:
        ref.load_state_dict({k: torch.tensor(v) for k, v in state.items()})
    for key, value in _to_numpy(dst.state_dict()).items():
        np.testing.assert_array_equal(value, state[key], err_msg=key)
    y = rng.integers(0, 10, 5)
    x = rng.random((5, 1, 8, 8))
    for mode in ("eval", "train"):
        getattr(ours, mode)(), getattr(ref, mode)()
        ours.zero_grad(), ref.zero_grad()
        _check_same(ours, ref, x, lambda o: F.cross_entropy(o, core.tensor(y)),
                    lambda o: torch.nn.functional.cross_entropy(o, torch.tensor(y)), atol=1e-9)
