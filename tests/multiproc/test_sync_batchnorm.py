"""SyncBatchNorm at W=2 over real tcp processes equals BatchNorm on the concatenated batch.

Ranks hold unequal batches (3 and 5 samples). Compared with one process normalising all 8:
outputs, input gradients, the sum of the ranks' weight/bias gradients and the running
statistics after two training steps, then eval-mode outputs; with momentum=None (a cumulative
average) and torch's default momentum=0.1 (an exponential one, whose running variance takes the
unbiased variance over all 8 samples, not a rank's own). torch's BatchNorm2d on the same batches
checks the reference's running statistics.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.ranks import agent_store, run_ranks

SIZES = (3, 5)
SHAPE = (4, 3, 3)  # C, H, W
STEPS = 2


def _data(step):
    rng = np.random.default_rng(step)
    x = rng.standard_normal((sum(SIZES),) + SHAPE) * 1.5 + 0.5
    g = rng.standard_normal(x.shape)
    return x, g


def _train(module_factory, core, rank=None):
    """Run STEPS training steps; return outputs, input grads, param grads, buffers, eval output."""
    bn = module_factory()
    outs, grads = [], []
    lo = 0 if rank is None else sum(SIZES[:rank])
    hi = sum(SIZES) if rank is None else lo + SIZES[rank]
    for step in range(STEPS):
        x, g = _data(step)
        xt = core.tensor(x[lo:hi], requires_grad=True)
        y = bn(xt)
        (y * core.tensor(g[lo:hi])).sum().backward()
        outs.append(y.detach().numpy().copy())
        grads.append(xt.grad.numpy().copy())
    params = {n: p.grad.numpy().copy() for n, p in bn.named_parameters()}
    buffers = {n: b.numpy().copy() for n, b in bn.named_buffers()}
    bn.eval()
    x, _ = _data(99)
    evals = bn(core.tensor(x[lo:hi])).detach().numpy().copy()
    return outs, grads, params, buffers, evals


def _rank(rank, world, momentum):
    from shoal import collectives, core
    from shoal.core import nn

    collectives.init_process_group("tcp", init_method="env://", timeout=20)
    try:
        def factory():
            model = nn.Sequential(nn.BatchNorm2d(4, momentum=momentum, dtype=core.float64))
            model = collectives.SyncBatchNorm.convert_sync_batchnorm(model)
            assert type(model[0]).__name__ == "SyncBatchNorm"
            return model

        return _train(factory, core, rank)
    finally:
        collectives.destroy_process_group()


def _torch_running_statistics(momentum):
    torch = pytest.importorskip("torch")
    bn = torch.nn.BatchNorm2d(4, momentum=momentum).double()
    for step in range(STEPS):
        bn(torch.tensor(_data(step)[0]))
    return {f"0.{n}": b.numpy() for n, b in bn.named_buffers()}


@pytest.mark.parametrize("momentum", [None, 0.1])
def test_sync_batchnorm_equals_batchnorm_on_the_concatenated_batch(momentum):
    from shoal import core
    from shoal.core import nn

    store, env = agent_store(2)
    try:
        results = run_ranks(_rank, 2, args=(momentum,), timeout=90, env=env)
    finally:
        store.close()
    ref = _train(
        lambda: nn.Sequential(nn.BatchNorm2d(4, momentum=momentum, dtype=core.float64)), core
    )
    outs, grads, params, buffers, evals = ref
    theirs = _torch_running_statistics(momentum)
    assert sorted(buffers) == sorted(theirs)
    for name, value in theirs.items():
        np.testing.assert_allclose(buffers[name], value, atol=1e-12, err_msg=f"torch's {name}")
    assert not np.allclose(buffers["0.running_var"], 1.0)  # the statistics really moved
    for step in range(STEPS):
        np.testing.assert_allclose(np.concatenate([r[0][step] for r in results]), outs[step],
                                   atol=1e-12, err_msg=f"outputs at step {step}")
        np.testing.assert_allclose(np.concatenate([r[1][step] for r in results]), grads[step],
                                   atol=1e-12, err_msg=f"input gradients at step {step}")
    for name, value in params.items():
        np.testing.assert_allclose(results[0][2][name] + results[1][2][name], value, atol=1e-11,
                                   err_msg=name)
    for name, value in buffers.items():
        for r in results:
            np.testing.assert_allclose(r[3][name], value, atol=1e-12, err_msg=name)
    np.testing.assert_allclose(np.concatenate([r[4] for r in results]), evals, atol=1e-12)


def test_without_a_group_it_is_plain_batchnorm():
    from shoal import collectives, core

    torch = pytest.importorskip("torch")
    ours = collectives.SyncBatchNorm(3, dtype=core.float64)
    ref = torch.nn.BatchNorm2d(3).double()
    assert list(ours.state_dict()) == list(ref.state_dict())
    x = np.random.default_rng(0).standard_normal((4, 3, 2, 2))
    np.testing.assert_allclose(ours(core.tensor(x)).detach().numpy(),
                               ref(torch.tensor(x)).detach().numpy(), atol=1e-12)
    with pytest.raises(ValueError, match=r"expected at least 2D input \(got 1D input\)"):
        ours(core.tensor(np.zeros(3)))
