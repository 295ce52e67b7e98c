"""core.autocast against torch.autocast on CPU: each op's output dtype, regions, gradients."""

import numpy as np
import pytest

from shoal import core
import shoal.core.nn.functional as F

torch = pytest.importorskip("torch")
tf = torch.nn.functional

_IDX = [0, 1, 2, 3]


def _setitem(a, c):
    a = a.clone()
    a[1:3] = c[0]  # written in a's dtype, whatever c's is
    return a


def _ops():
    """(name, shoal fn, torch fn) over two (4, 4) float inputs a and c, for every op core has.

    Keys are the ops' own names (test_the_table_covers_every_op_core_has holds the table to
    core's op list); a key with a suffix checks another form of the same op.
    """
    ci, ti = core.tensor(_IDX), torch.tensor(_IDX)

    def both(fn_c, fn_t):
        return fn_c, fn_t

    def same(fn):  # the same spelling works on both libraries' tensors
        return fn, fn

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
        "prod": both(lambda a, c: a.prod(dim=1), lambda a, c: a.prod(dim=1)),
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
        "cross_entropy": both(lambda a, c: F.cross_entropy(a, ci),
                              lambda a, c: tf.cross_entropy(a, ti)),
        "cross_entropy_probs": both(lambda a, c: F.cross_entropy(a, c.softmax(-1)),
                                    lambda a, c: tf.cross_entropy(a, c.softmax(-1))),
        "nll_loss": both(lambda a, c: F.nll_loss(a, ci), lambda a, c: tf.nll_loss(a, ti)),
        "dropout": both(lambda a, c: F.dropout(a, 0.5), lambda a, c: tf.dropout(a, 0.5)),
        "embedding": both(lambda a, c: F.embedding(ci, c), lambda a, c: tf.embedding(ti, c)),
        "scaled_dot_product_attention": both(
            lambda a, c: F.scaled_dot_product_attention(a[None], c[None], c[None]),
            lambda a, c: tf.scaled_dot_product_attention(a[None], c[None], c[None])),
        "scaled_dot_product_attention_causal": both(
            lambda a, c: F.scaled_dot_product_attention(a[None], c[None], c[None], is_causal=True),
            lambda a, c: tf.scaled_dot_product_attention(a[None], c[None], c[None],
                                                         is_causal=True)),
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
        "batch_norm_affine": both(lambda a, c: F.batch_norm(a, None, None, c[0], c[1], True),
                                  lambda a, c: tf.batch_norm(a, None, None, c[0], c[1], True)),
        "adaptive_avg_pool2d": both(lambda a, c: F.adaptive_avg_pool2d(a[None, None], (3, 2)),
                                    lambda a, c: tf.adaptive_avg_pool2d(a[None, None], (3, 2))),
        "one_hot": both(lambda a, c: F.one_hot(ci, 5), lambda a, c: tf.one_hot(ti, 5)),
        "abs": same(lambda a, c: a.abs()),
        "minimum": both(lambda a, c: core.minimum(a, c), lambda a, c: torch.minimum(a, c)),
        "max_with_tensor": same(lambda a, c: a.max(c)),
        "max_dim": same(lambda a, c: a.max(dim=1)),  # (values, indices)
        "min": same(lambda a, c: a.min()),
        "min_dim": same(lambda a, c: a.min(dim=0, keepdim=True)),
        "amin": same(lambda a, c: a.amin(dim=1)),
        "argmax": same(lambda a, c: a.argmax(dim=1)),
        "argmin": same(lambda a, c: a.argmin()),
        "eq": same(lambda a, c: a == c),
        "ne": same(lambda a, c: a != c),
        "lt": same(lambda a, c: a < c),
        "le": same(lambda a, c: a <= c),
        "gt": same(lambda a, c: a > c),
        "ge": same(lambda a, c: a >= c),
        "all": same(lambda a, c: (a > c).all()),
        "any": same(lambda a, c: (a > c).any(dim=0)),
        "equal": both(lambda a, c: core.equal(a, c), lambda a, c: torch.equal(a, c)),
        "isclose": both(lambda a, c: core.isclose(a, c), lambda a, c: torch.isclose(a, c)),
        "allclose": both(lambda a, c: core.allclose(a, c), lambda a, c: torch.allclose(a, c)),
        "nonzero": same(lambda a, c: (a > 0).nonzero()),
        "getitem": same(lambda a, c: a[1:3, ::2]),
        "getitem_index_tensor": both(lambda a, c: a[ci[:2]], lambda a, c: a[ti[:2]]),
        "setitem": same(_setitem),
        "reshape": same(lambda a, c: a.reshape(2, 8)),
        "view": same(lambda a, c: a.view(8, 2)),
        "flatten": same(lambda a, c: a.flatten()),
        "unsqueeze": same(lambda a, c: a.unsqueeze(1)),
        "squeeze": same(lambda a, c: a[None].squeeze(0)),
        "transpose": same(lambda a, c: a.transpose(0, 1)),
        "permute": same(lambda a, c: a[None].permute(2, 0, 1)),
        "t": same(lambda a, c: a.t()),
        "T": same(lambda a, c: a.T),
        "mT": same(lambda a, c: a.mT),
        "expand": same(lambda a, c: a[:1].expand(3, 4)),
        "contiguous": same(lambda a, c: a.T.contiguous()),
        "clone": same(lambda a, c: a.clone()),
        "split": same(lambda a, c: a.split(3)),
        "chunk": same(lambda a, c: a.chunk(2, dim=1)),
        "to": same(lambda a, c: a.to(c.dtype)),
        # Forms with a second dtype in a parameter, a bound, a mask or a scalar-like operand.
        "conv1d_bias": both(lambda a, c: F.conv1d(a[None], c[:, :, None], c[0]),
                            lambda a, c: tf.conv1d(a[None], c[:, :, None], c[0])),
        "conv2d_bias": both(lambda a, c: F.conv2d(a[None, None], c[None, None, :2, :2], c[0, :1]),
                            lambda a, c: tf.conv2d(a[None, None], c[None, None, :2, :2], c[0, :1])),
        "cross_entropy_weight": both(lambda a, c: F.cross_entropy(a, ci, weight=c[0].abs()),
                                     lambda a, c: tf.cross_entropy(a, ti, weight=c[0].abs())),
        "nll_loss_weight": both(lambda a, c: F.nll_loss(a, ci, weight=c[0].abs()),
                                lambda a, c: tf.nll_loss(a, ti, weight=c[0].abs())),
        "pow_tensor_exponent": same(lambda a, c: a.abs() ** c),
        "mul_python_scalar": same(lambda a, c: a * 2.5),
        "sub_reflected": same(lambda a, c: 1 - a),
        "div_reflected": same(lambda a, c: 1 / a),
        "pow_reflected": same(lambda a, c: 2 ** a),
        "sum_bool": same(lambda a, c: (a > 0).sum()),
        "matmul_vector": same(lambda a, c: a @ c[0]),
        "layer_norm_affine": both(lambda a, c: F.layer_norm(a, (4,), c[0], c[1]),
                                  lambda a, c: tf.layer_norm(a, (4,), c[0], c[1])),
        "batch_norm_running_stats": both(
            lambda a, c: F.batch_norm(a, c[0].clone(), c[1].abs(), training=False),
            lambda a, c: tf.batch_norm(a, c[0].clone(), c[1].abs(), training=False)),
        "scaled_dot_product_attention_float_mask": both(
            lambda a, c: F.scaled_dot_product_attention(a[None], a[None], a[None], attn_mask=c),
            lambda a, c: tf.scaled_dot_product_attention(a[None], a[None], a[None], attn_mask=c)),
        "clamp_tensor_bound": same(lambda a, c: a.clamp(c, None)),
        "where_python_scalar": both(lambda a, c: core.where(a > 0, a, 0.0),
                                    lambda a, c: torch.where(a > 0, a, 0.0)),
        "add_zero_dim": same(lambda a, c: a + c[0, 0]),
        "maximum_zero_dim": both(lambda a, c: core.maximum(a, c[0, 0]),
                                 lambda a, c: torch.maximum(a, c[0, 0])),
    }


_DTYPES = {"f32": (core.float32, torch.float32), "bf16": (core.bfloat16, torch.bfloat16),
           "f64": (core.float64, torch.float64)}
_PAIRS = [("f32", "f32"), ("bf16", "bf16"), ("f32", "bf16"), ("bf16", "f32"), ("f64", "f32"),
          ("f64", "f64")]


def _name(dt):
    return str(dt).split(".")[-1]


def _dtypes_of(result):
    """A result's dtype names: a tensor's, each of a tuple's (split, max(dim=...)), or a bool's."""
    if isinstance(result, (tuple, list)):
        return tuple(_dtypes_of(r) for r in result)
    if isinstance(result, bool):
        return "python bool"
    return _name(result.dtype)


# The modules of core/ops that hold ops (the rest create tensors, seed, or share helpers).
_OP_MODULES = ("arith", "attention", "conv", "linalg", "logical", "nn", "norm", "pooling",
               "reduce", "shape", "unary")


def _core_ops():
    """The name of every op function in core/ops that users reach: as core.<name>,
    core.nn.functional.<name>, or a Tensor method or property."""
    import importlib
    import inspect

    from shoal.core.tensor import Tensor

    reachable = set()
    for namespace in (vars(core), vars(F), vars(Tensor)):
        for value in namespace.values():
            reachable.add(id(value.fget if isinstance(value, property) else value))
    names = set()
    for module_name in _OP_MODULES:
        module = importlib.import_module(f"shoal.core.ops.{module_name}")
        for name, fn in vars(module).items():
            if inspect.isfunction(fn) and fn.__module__ == module.__name__ and id(fn) in reachable:
                names.add(name)
    # Operators and methods that bind.py wraps (add's r_or_not, ...) reach the same functions
    # under their own names, already counted through core.<name>; Tensor.to casts by shape.to.
    return names | {"to"}


def test_the_table_covers_every_op_core_has():
    ops = _core_ops()
    assert {"matmul", "conv2d", "adaptive_avg_pool2d", "one_hot", "argmax", "amin"} <= ops
    missing = sorted(ops - set(_ops()))
    assert not missing, f"ops without an entry in the autocast dtype table: {missing}"


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
                    want = _dtypes_of(fn_t(ta, tc))
            except RuntimeError:
                continue  # torch refuses the mix (float64 with a cast-down input): nothing to match
            a = core.tensor(a_np, dtype=_DTYPES[ka][0])
            c = core.tensor(c_np, dtype=_DTYPES[kc][0])
            with core.autocast("cpu", dtype=core.bfloat16, enabled=enabled):
                got = _dtypes_of(fn_c(a, c))
            assert got == want, f"{op}({ka}, {kc}) enabled={enabled}: shoal {got}, torch {want}"
            checked += 1
    assert checked >= 6  # at least the three same-dtype pairs with autocast on and off


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
