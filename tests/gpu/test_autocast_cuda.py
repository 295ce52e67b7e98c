"""core.autocast("cuda") and GradScaler on cupy tensors: torch's CUDA lists (float16 GEMMs;
softmax, log_softmax, sum, exp, layer_norm and losses in float32), float32 master gradients."""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
import shoal.core.nn.functional as F

cp = pytest.importorskip("cupy")

_CASES = {  # op -> (fn of a (4, 4) float32 cuda tensor a and c, dtype torch's CUDA autocast gives)
    "matmul": (lambda a, c: a @ c, core.float16),
    "linear": (lambda a, c: F.linear(a, c, c[0]), core.float16),
    "attention": (lambda a, c: F.scaled_dot_product_attention(a[None], c[None], c[None]),
                  core.float16),
    "softmax": (lambda a, c: (a @ c).softmax(-1), core.float32),
    "log_softmax": (lambda a, c: (a @ c).log_softmax(-1), core.float32),
    "sum": (lambda a, c: (a @ c).sum(), core.float32),
    "exp": (lambda a, c: (a @ c).exp(), core.float32),
    "layer_norm": (lambda a, c: F.layer_norm(a @ c, (4,)), core.float32),
    "cross_entropy": (lambda a, c: F.cross_entropy(a @ c, core.tensor([0, 1, 2, 3], device="cuda")),
                      core.float32),
    "relu": (lambda a, c: (a @ c).relu(), core.float16),  # not listed: its input's dtype
}


@pytest.mark.parametrize("op", sorted(_CASES))
def test_cuda_autocast_output_dtypes(op):
    fn, want = _CASES[op]
    a = core.randn(4, 4, device="cuda")
    c = core.randn(4, 4, device="cuda")
    with core.autocast("cuda"):
        assert fn(a, c).dtype == want
        with core.autocast("cpu", enabled=False):  # the host's region does not touch cuda ops
            assert fn(a, c).dtype == want
    assert fn(a, c).dtype == core.float32


def test_cuda_training_step_with_scaler_keeps_float32_weights_and_gradients():
    model = core.nn.Sequential(core.nn.Linear(8, 16), core.nn.GELU(), core.nn.Linear(16, 3))
    model.to("cuda")
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    scaler = core.amp.GradScaler("cuda", init_scale=2.0**12)
    x = core.randn(32, 8, device="cuda")
    y = core.tensor(np.arange(32) % 3, device="cuda")
    losses = []
    for _ in range(20):
        with core.autocast("cuda"):
            loss = core.nn.CrossEntropyLoss()(model(x), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    assert all(p.dtype == core.float32 and p.grad.dtype == core.float32
               for p in model.parameters())
    assert losses[-1] < losses[0]
