"""core.autocast against torch.autocast on CPU: each op's output dtype, regions, gradients."""

import numpy as np
import pytest

from shoal import core
import shoal.core.nn.functional as F

torch = pytest.importorskip("torch")
tf = torch.nn.functional

_IDX = [0, 1, 2, 3]


def _ops():
    """(name, shoal fn, torch fn) over two (4, 4) float inputs a and c, for every op core has."""
    ci, ti = core.tensor(_IDX), torch.tensor(_IDX)

    def both(fn_c, fn_t):
        return fn_c, fn_t

    return {
        "add": both(lambda a, c: a + c, lambda a, c: a + c),
        "sub": both(lambda a, c: a - c, lambda a, c: a - c),
        "mul": both(lambda a, c: a * c, lambda a, c: a * c),
        "div": both(lambda a, c: a / c, lambda a, c: a / c),
        "pow": both(lambda a, c: a.abs() ** 2, lambda a, c: a.abs() ** 2),
        "neg": both(lambda a, c: -a, lambda a, c: -a),
        "matmul": both(lambda a, c: a @ c, lambda a, c: a @ c),
        "exp": both(lambda a, c: a.exp(), lambda a, c: a.exp()),
        "log": both(lambda a, c: a.abs().log(), lambda a, c: a.abs().log()),
        "sqrt": both(lambda a, c: a.abs().sqrt(), lambda a, c: a.abs().sqrt()),
        "tanh": both(lambda a, c: a.tanh(), lambda a, c: a.tanh()),
        "sigmoid": both(lambda a, c: a.sigmoid(), lambda a, c: a.sigmoid()),
        "relu": both(lambda a, c: a.relu(), lambda a, c: a.relu()),
        "gelu": both(lambda a, c: F.gelu(a), lambda a, c: tf.gelu(a)),
        "clamp": both(lambda a, c: a.clamp(-0.5, 0.5), lambda a, c: a.clamp(-0.5, 0.5)),
        "sum": both(lambda a, c: a.sum(), lambda a, c: a.sum()),
        "mean": both(lambda a, c: a.mean(dim=1), lambda a, c: a.mean(dim=1)),
        "var": both(lambda a, c: a.var(), lambda a, c: a.var()),
        "amax": both(lambda a, c: a.amax(dim=0), lambda a, c: a.amax(dim=0)),
        "max": both(lambda a, c: a.max(), lambda a, c: a.max()),
        "softmax": both(lambda a, c: a.softmax(-1), lambda a, c: a.softmax(-1)),
        "log_softmax": both(lambda a, c: a.log_softmax(-1), lambda a, c: a.log_softmax(-1)),
        "logsumexp": both(lambda a, c: a.logsumexp(-1), lambda a, c: a.logsumexp(-1)),
        "cat": both(lambda a, c: core.cat([a, c]), lambda a, c: torch.cat([a, c])),
        "stack": both(lambda a, c: core.stack([a, c]), lambda a, c: torch.stack([a, c])),
        "where": both(lambda a, c: core.where(a > 0, a, c), lambda a, c: torch.where(a > 0, a, c)),
        "maximum": both(lambda a, c: core.maximum(a, c), lambda a, c: torch.maximum(a, c)),
        "linear": both(lambda a, c: F.linear(a, c), lambda a, c: tf.linear(a, c)),
        "linear_bias": both(lambda a, c: F.linear(a, c, c[0]), lambda a, c: tf.linear(a, c, c[0])),
        "layer_norm": both(lambda a, c: F.layer_norm(a, (4,)), lambda a, c: tf.layer_norm(a, (4,))),
        "mse_loss": both(lambda a, c: F.mse_loss(a, c), lambda a, c: tf.mse_loss(a, c)),
        "cross_entropy": both(lambda a, c: F.cross_entropy(a, ci), lambda a, c: tf.cross_entropy(a, ti)),
        "cross_entropy_probs": both(lambda a, c: F.cross_entropy(a, c.softmax(-1)),
                                    lambda a, c: tf.cross_entropy(a, c.softmax(-1))),
        "nll_loss": both(lambda a, c: F.nll_loss(a, ci), lambda a, c: tf.nll_loss(a, ti)),
        "dropout": both(lambda a, c: F.dropout(a, 0.5), lambda a, c: tf.dropout(a, 0.5)),
        "embedding": both(lambda a, c: F.embedding(ci, c), lambda a, c: tf.embedding(ti, c)),
        "attention": both(lambda a, c: F.scaled_dot_product_attention(a[None], c[None], c[None]),
                          lambda a, c: tf.scaled_dot_product_attention(a[None], c[None], c[None])),
        "conv1d": both(lambda a, c: F.conv1d(a[None], c[:, :, None]),
                       lambda a, c: tf.conv1d(a[None], c[:, :, None])),
        "conv2d": both(lambda a, c: F.conv2d(a[None, None], c[None, None, :2, :2]),
                       lambda a, c: tf.conv2d(a[None, None], c[None, None, :2, :2])),
        "max_pool2d": both(lambda a, c: F.max_pool2d(a[None, None], 2),
                           lambda a, c: tf.max_pool2d(a[None, None], 2)),
        "avg_pool2d": both(lambda a, c: F.avg_pool2d(a[None, None], 2),
                           lambda a, c: tf.avg_pool2d(a[None, None], 2)),
        "batch_norm": both(lambda a, c: F.batch_norm(a, None, None, training=True),
                           lambda a, c: tf.batch_norm(a, None, None, training=True)),
    }


_DTYPES = {"f32": (core.float32, torch.float32), "bf16": (core.bfloat16, torch.bfloat16),
           "f64": (core.float64, torch.float64)}
_PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16"), ("bf16", "f32"), ("f64", "f32"),
          ("f64", "f64")]


def _name(dt):
    return str(dt).split(".")[-1]


@pytest.mark.parametrize("op", sorted(_ops()))
def test_output_dtype_matches_torch_autocast_on_cpu(op):
    fn_c, fn_t = _ops()[op]
    rng = np.random.default_rng(0)
    a_np, c_np = rng.standard_normal((4, 4)), rng.standard_normal((4, 4))
    checked = 0
    for enabled in (True, False):
        for ka, kc in _PAIRS:
            ta = torch.tensor(a_np, dtype=_DTYPES[ka][1])
            tc = torch.tensor(c_np, dtype=_DTYPES[kc][1])
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled):
                    want = _name(fn_t(ta, tc).dtype)
            except RuntimeError:
                continue  # torch refuses the mix (float64 with a cast-down input): nothing to match
            a = core.tensor(a_np, dtype=_DTYPES[ka][0])
            c = core.tensor(c_np, dtype=_DTYPES[kc][0])
            with core.autocast("cpu", dtype=core.bfloat16, enabled=enabled):
                got = _name(fn_c(a, c).dtype)
            assert got == want, f"{op}({ka}, {kc}) enabled={enabled}: shoal {got}, torch {want}"
            checked += 1
    assert checked >= 8


def test_regions_nest_turn_off_and_decorate():
    a, w = core.randn(2, 3), core.randn(3, 3)
    assert not core.is_autocast_enabled("cpu")
    with core.autocast("cpu"):
        assert core.is_autocast_enabled("cpu") and (a @ w).dtype == core.bfloat16
        with core.autocast("cpu", enabled=False):
            assert not core.is_autocast_enabled("cpu") and (a @ w).dtype == core.float32
            with core.autocast("cpu", dtype=core.float16):
                assert (a @ w).dtype == core.float16
                assert core.get_autocast_dtype("cpu") == core.float16
            assert (a @ w).dtype == core.float32
        assert (a @ w).dtype == core.bfloat16
        with core.autocast("cuda", enabled=False):  # another device type's region: cpu stays on
            assert (a @ w).dtype == core.bfloat16
    assert (a @ w).dtype == core.float32 and not core.is_autocast_enabled("cpu")

    @core.autocast("cpu")
    def forward(x):
        return x @ w

    assert forward(a).dtype == core.bfloat16 and (a @ w).dtype == core.float32
    assert core.amp.autocast is core.autocast


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"autocast: device_type must be one of \('cpu', 'cuda'\), "
                                         r"got 'tpu'\."):
        core.autocast("tpu")
    with pytest.raises(core.DTypeError, match=r"autocast: on cuda the dtype must be one of "
                                              r"\[core.float16\] \(cupy has no bfloat16\), got "
                                              r"core.bfloat16\."):
        core.autocast("cuda", dtype=core.bfloat16)
    with pytest.raises(core.DTypeError, match="autocast: on cpu the dtype must be one of"):
        core.autocast("cpu", dtype=core.float32)


def test_backward_runs_in_the_forward_dtype_and_returns_parameter_dtypes():
    """The matmul's gradient is bfloat16 (its forward's dtype); the weight's is float32."""
    rng = np.random.default_rng(1)
    x_np, w_np, t = rng.standard_normal((5, 4)), rng.standard_normal((3, 4)), [0, 2, 1, 1, 0]
    results = {}
    for lib, F_ in (("shoal", F), ("torch", tf)):
        if lib == "shoal":
            x = core.tensor(x_np, dtype=core.float32)
            w = core.tensor(w_np, dtype=core.float32, requires_grad=True)
            ctx, target = core.autocast("cpu"), core.tensor(t)
        else:
            x = torch.tensor(x_np, dtype=torch.float32)
            w = torch.tensor(w_np, dtype=torch.float32, requires_grad=True)
            ctx, target = torch.autocast("cpu", dtype=torch.bfloat16), torch.tensor(t)
        seen = {}

        def record(g, seen=seen):
            seen["y_grad"] = _name(g.dtype)

        with ctx:
            y = F_.linear(x, w)
            y.register_hook(record)
            loss = F_.cross_entropy(y, target)
        loss.backward()
        results[lib] = (_name(y.dtype), _name(loss.dtype), seen["y_grad"], _name(w.grad.dtype),
                        np.asarray(w.grad.float() if lib == "torch" else w.grad.numpy(),
                                   dtype=np.float64))
    ours, theirs = results["shoal"], results["torch"]
    assert ours[:4] == theirs[:4] == ("bfloat16", "float32", "bfloat16", "float32")
    # bfloat16 keeps 8 bits of mantissa: gradients agree to its precision.
    np.testing.assert_allclose(ours[4], theirs[4], atol=3e-2, rtol=3e-2)


def _train(autocast: bool, steps: int = 60) -> float:
    core.manual_seed(0)
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((256, 8))
    x = core.tensor(x_np, dtype=core.float32)
    y = core.tensor((x_np @ rng.standard_normal(8) > 0).astype(np.int64))
    model = core.nn.Sequential(core.nn.Linear(8, 32), core.nn.GELU(), core.nn.Linear(32, 2))
    opt = core.optim.SGD(model.parameters(), lr=0.2)
    for _ in range(steps):
        with core.autocast("cpu", enabled=autocast):
            loss = core.nn.CrossEntropyLoss()(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.dtype == core.float32 for p in model.parameters())
    with core.no_grad():
        return core.nn.CrossEntropyLoss()(model(x), y).item()


def test_bf16_autocast_training_reaches_the_float32_loss_within_2_percent():
    full, mixed = _train(False), _train(True)
    assert full < 0.3  # it learned something
    assert abs(mixed - full) <= 0.02 * full, (full, mixed)


def test_a_weight_is_cast_once_per_region_and_gradients_add_up_as_torch():
    rng = np.random.default_rng(4)
    w_np, x_np = rng.standard_normal((4, 4)), rng.standard_normal((2, 4))
    w = core.tensor(w_np, dtype=core.float32, requires_grad=True)
    tw = torch.tensor(w_np, dtype=torch.float32, requires_grad=True)
    x, tx = core.tensor(x_np, dtype=core.float32), torch.tensor(x_np, dtype=torch.float32)
    with core.autocast("cpu"):
        h = F.linear(x, w)
        first = core.ops._autocast.STATE.cache[id(w)][1]
        out = F.linear(h, w)  # tied: the same weight again
        assert core.ops._autocast.STATE.cache[id(w)][1] is first  # no second cast
        with core.no_grad():
            F.linear(x, w)  # a no_grad use neither reads nor replaces the graph's copy
        assert core.ops._autocast.STATE.cache[id(w)][1] is first
    assert core.ops._autocast.STATE.cache == {}  # emptied when the outermost region exits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tout = tf.linear(tf.linear(tx, tw), tw)
    out.float().sum().backward()
    tout.float().sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), tw.grad.numpy(), rtol=3e-2, atol=3e-2)
    with core.autocast("cpu", cache_enabled=False):
        F.linear(x, w)
        assert core.ops._autocast.STATE.cache == {}
