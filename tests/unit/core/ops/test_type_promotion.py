"""Type promotion against torch: result dtypes, values and gradients of the ops that mix dtypes.

torch is the oracle: every case builds the same inputs in both libraries, runs the op,
backpropagates the same upstream gradient, and compares the output's dtype and values and each
input's gradient (dtype and values). float64 cases must agree to rounding; bfloat16 ones to its
8-bit mantissa.
"""

import itertools

import numpy as np
import pytest

from shoal import core
import shoal.core.nn.functional as F
from shoal.core.ops._promote import result_dtype

torch = pytest.importorskip("torch")
tf = torch.nn.functional

_DTYPES = {
    "bool": (core.bool, torch.bool), "uint8": (core.uint8, torch.uint8),
    "int8": (core.int8, torch.int8), "int16": (core.int16, torch.int16),
    "int32": (core.int32, torch.int32), "int64": (core.int64, torch.int64),
    "float16": (core.float16, torch.float16), "bfloat16": (core.bfloat16, torch.bfloat16),
    "float32": (core.float32, torch.float32), "float64": (core.float64, torch.float64),
}
_TOL = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _name(dt):
    return str(dt).split(".")[-1]


def _operand(form, dtype, lib):
    """One operand: a dimensioned or 0-d tensor of `dtype`, or a Python number of its kind."""
    values = np.array([1, 0, 1]) if dtype == "bool" else np.array([3, 1, 2])
    if form == "scalar":
        return {"bool": True}.get(dtype, 2.5 if "float" in dtype else 2)
    data = values if form == "dim" else values[0]
    if lib == "torch":
        return torch.tensor(data, dtype=_DTYPES[dtype][1])
    return core.tensor(data, dtype=_DTYPES[dtype][0])


_FORMS = [("dim", "dim"), ("dim", "zero"), ("zero", "dim"), ("zero", "zero"), ("dim", "scalar"),
          ("zero", "scalar")]


@pytest.mark.parametrize("forms", _FORMS, ids="-".join)
def test_add_promotes_every_dtype_pair_as_torch(forms):
    """torch.result_type's three tiers over every pair of core's dtypes, through the op."""
    checked = 0
    for da, db in itertools.product(_DTYPES, repeat=2):
        if forms[1] == "scalar" and db not in ("bool", "int64", "float32"):
            continue  # a Python number has one dtype per kind: bool, int, float
        ta, tb = _operand(forms[0], da, "torch"), _operand(forms[1], db, "torch")
        ca, cb = _operand(forms[0], da, "shoal"), _operand(forms[1], db, "shoal")
        want = ta + tb
        got = ca + cb
        assert _name(got.dtype) == _name(want.dtype), (da, db, forms)
        operand = cb.array if isinstance(cb, core.Tensor) else cb
        assert np.dtype(result_dtype(ca.array, operand)).name == np.dtype(
            got.array.dtype).name
        np.testing.assert_array_equal(got.numpy().astype(np.float64),
                                      want.double().numpy())
        checked += 1
    assert checked >= 30


def _build(spec, lib):
    """A case's inputs in one library: tensors (grad-requiring when floating) or numbers."""
    out = []
    for item in spec:
        if not isinstance(item, tuple):
            out.append(item)  # a Python number or None
            continue
        data, dtype = item
        grad = "float" in dtype
        if lib == "torch":
            t = torch.tensor(data, dtype=_DTYPES[dtype][1], requires_grad=grad)
        else:
            t = core.tensor(data, dtype=_DTYPES[dtype][0], requires_grad=grad)
        out.append(t)
    return out


def _numpy(t):
    if isinstance(t, torch.Tensor):
        return t.detach().double().numpy()
    return t.detach().numpy().astype(np.float64)


def _check_against_torch(fn_core, fn_torch, spec, out_dtype):
    """Run both; compare the output's dtype and values, and each input's gradient."""
    ins_c, ins_t = _build(spec, "shoal"), _build(spec, "torch")
    out_c, out_t = fn_core(*ins_c), fn_torch(*ins_t)
    assert _name(out_t.dtype) == out_dtype  # the case states torch's rule
    assert _name(out_c.dtype) == out_dtype
    tol = _TOL.get(out_dtype, 0)
    np.testing.assert_allclose(_numpy(out_c), _numpy(out_t), rtol=tol, atol=tol)
    if not out_t.requires_grad:
        return
    seed = np.random.default_rng(7).uniform(0.5, 1.5, size=tuple(out_t.shape))
    out_c.backward(core.tensor(seed, dtype=out_c.dtype))
    out_t.backward(torch.tensor(seed, dtype=out_t.dtype))
    for i, (c, t) in enumerate(zip(ins_c, ins_t)):
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            continue
        if t.grad is None:  # used only where no gradient flows (where's condition)
            assert c.grad is None, i
            continue
        assert _name(c.grad.dtype) == _name(t.grad.dtype) == _name(t.dtype), i
        gtol = max(tol, _TOL[_name(t.dtype)])
        np.testing.assert_allclose(_numpy(c.grad), _numpy(t.grad), rtol=gtol, atol=gtol,
                                   err_msg=f"gradient of input {i}")


_A = np.array([[0.7, -1.2, 2.5], [-0.3, 1.9, -2.2]])
_B = np.array([[1.1, 0.4, -0.6], [2.0, -1.5, 0.8]])
_POS = np.abs(_A) + 0.5
_ZERO = np.array(1.3)


# (id, shoal fn, torch fn, inputs as (data, dtype) or Python numbers, torch's output dtype)
_CASES = [
    ("add_zero_dim_f64", lambda a, b: a + b, None, [(_A, "float32"), (_ZERO, "float64")],
     "float32"),
    ("sub_zero_dim_first", lambda a, b: a - b, None, [(_ZERO, "float64"), (_A, "float32")],
     "float32"),
    ("mul_bf16_zero_dim_f32", lambda a, b: a * b, None, [(_A, "bfloat16"), (_ZERO, "float32")],
     "bfloat16"),
    ("div_zero_dim_f64", lambda a, b: a / b, None, [(_A, "float32"), (_ZERO, "float64")],
     "float32"),
    ("pow_zero_dim_exponent", lambda a, b: a**b, None, [(_POS, "float32"), (_ZERO, "float64")],
     "float32"),
    ("add_f64_with_zero_dim_f32", lambda a, b: a + b, None,
     [(_A, "float64"), (_ZERO, "float32")], "float64"),
    ("add_bf16_python_float", lambda a, b: a + b, None, [(_A, "bfloat16"), 2.5], "bfloat16"),
    ("add_bf16_f32", lambda a, b: a + b, None, [(_A, "bfloat16"), (_B, "float32")], "float32"),
    ("mul_int_python_float", lambda a, b: a * b, None, [(_A * 10, "int64"), 2.5], "float32"),
    ("add_int_f32", lambda a, b: a + b, None, [(_A * 10, "int64"), (_B, "float32")], "float32"),
    ("add_int_zero_dim_f64", lambda a, b: a + b, None, [(_A * 10, "int64"), (_ZERO, "float64")],
     "float64"),
    ("div_int_int", lambda a, b: a / b, None, [(_A * 10, "int64"), (_POS * 3, "int32")],
     "float32"),
    ("div_int_python_int", lambda a, b: a / b, None, [(_A * 10, "int64"), 4], "float32"),
    ("rdiv_python_int_int", lambda a, b: b / a, None, [(_POS * 3, "int64"), 7], "float32"),
    ("pow_int_python_float", lambda a, b: a**b, None, [(_POS * 3, "int64"), 0.5], "float32"),
    ("pow_python_int_base", lambda a, b: b**a, None, [(_POS, "float32"), 2], "float32"),
    ("where_bf16_python_float", lambda c, a, b: core.where(c > 0, a, b),
     lambda c, a, b: torch.where(c > 0, a, b), [(_B, "float64"), (_A, "bfloat16"), 0.0],
     "bfloat16"),
    ("where_zero_dim_f64", lambda c, a, b: core.where(c > 0, a, b),
     lambda c, a, b: torch.where(c > 0, a, b), [(_B, "float64"), (_A, "float32"),
                                                (_ZERO, "float64")], "float32"),
    ("where_two_python_floats", lambda c, a, b: core.where(c > 0, a, b),
     lambda c, a, b: torch.where(c > 0, a, b), [(_B, "float64"), 1.5, -0.5], "float32"),
    ("where_int_python_float", lambda c, a, b: core.where(c > 0, a, b),
     lambda c, a, b: torch.where(c > 0, a, b), [(_B, "float64"), (_A * 10, "int64"), 0.5],
     "float32"),
    ("maximum_zero_dim_f64", lambda a, b: core.maximum(a, b), lambda a, b: torch.maximum(a, b),
     [(_A, "float32"), (np.array(0.7), "float64")], "float32"),
    ("minimum_bf16_zero_dim_f32", lambda a, b: core.minimum(a, b),
     lambda a, b: torch.minimum(a, b), [(_A, "bfloat16"), (_ZERO, "float32")], "bfloat16"),
    ("maximum_bf16_f32", lambda a, b: core.maximum(a, b), lambda a, b: torch.maximum(a, b),
     [(_A, "bfloat16"), (_B, "float32")], "float32"),
    ("clamp_tensor_bounds_f64", lambda a, lo, hi: a.clamp(lo, hi), None,
     # the last column has min > max: max wins, and only max gets the gradient there
     [(_A, "float64"), (np.array([-1.0, -0.5, 1.0]), "float64"),
      (np.array([1.0, 1.5, 0.5]), "float64")], "float64"),
    ("clamp_bf16_f32_min", lambda a, lo: a.clamp(lo, None), None,
     [(_A, "bfloat16"), (_B, "float32")], "float32"),
    ("clamp_f32_zero_dim_f64_max", lambda a, hi: a.clamp(None, hi), None,
     [(_A, "float32"), (np.array(0.5), "float64")], "float32"),
    ("clamp_bf16_python_floats", lambda a: a.clamp(-0.5, 0.5), None, [(_A, "bfloat16")],
     "bfloat16"),
    ("clamp_int_python_float", lambda a: a.clamp(0.5, 4.5), None, [(_A * 3, "int64")],
     "float32"),
    ("cat_int_f32", lambda a, b: core.cat([a, b]), lambda a, b: torch.cat([a, b]),
     [(_A * 10, "int64"), (_B, "float32")], "float32"),
    ("stack_bf16_f32", lambda a, b: core.stack([a, b], 1), lambda a, b: torch.stack([a, b], 1),
     [(_A, "bfloat16"), (_B, "float32")], "float32"),
    ("layer_norm_bf16_f32_affine",
     lambda x, w, b: F.layer_norm(x, (3,), w, b), lambda x, w, b: tf.layer_norm(x, (3,), w, b),
     [(_A * 3, "bfloat16"), (_B[0], "float32"), (_B[1], "float32")], "bfloat16"),
    ("layer_norm_f64_affine",
     lambda x, w, b: F.layer_norm(x, (3,), w, b), lambda x, w, b: tf.layer_norm(x, (3,), w, b),
     [(_A * 3, "float64"), (_B[0], "float64"), (_B[1], "float64")], "float64"),
    ("batch_norm_bf16_f32_affine_training",
     lambda x, w, b: F.batch_norm(x, None, None, w, b, True),
     lambda x, w, b: tf.batch_norm(x, None, None, w, b, True),
     [(np.concatenate([_A, _B]) * 3, "bfloat16"), (_B[0], "float32"), (_B[1], "float32")],
     "bfloat16"),
    ("batch_norm_bf16_f32_running_stats",
     lambda x, m, v: F.batch_norm(x, m, v, training=False),
     lambda x, m, v: tf.batch_norm(x, m.detach(), v.detach(), training=False),
     [(_A.T * 3, "bfloat16"), (np.array([0.3, -0.2]), "float32"),
      (np.array([1.5, 0.7]), "float32")], "bfloat16"),
    ("batch_norm_f64_affine_training",
     lambda x, w, b: F.batch_norm(x, None, None, w, b, True),
     lambda x, w, b: tf.batch_norm(x, None, None, w, b, True),
     [(np.concatenate([_A, _B]) * 3, "float64"), (_B[0], "float64"), (_B[1], "float64")],
     "float64"),
    ("attention_bf16_f32_mask",
     lambda q, m: F.scaled_dot_product_attention(q[None], q[None], q[None], attn_mask=m),
     lambda q, m: tf.scaled_dot_product_attention(q[None], q[None], q[None], attn_mask=m),
     [(_A, "bfloat16"), (_B[:, :2], "float32")], "bfloat16"),
    ("attention_f64_f64_mask",
     lambda q, m: F.scaled_dot_product_attention(q[None], q[None], q[None], attn_mask=m),
     lambda q, m: tf.scaled_dot_product_attention(q[None], q[None], q[None], attn_mask=m),
     [(_A, "float64"), (_B[:, :2], "float64")], "float64"),
]


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_mixed_dtype_op_matches_torch_in_dtype_value_and_gradients(case):
    _, fn_core, fn_torch, spec, out_dtype = case
    _check_against_torch(fn_core, fn_torch or fn_core, spec, out_dtype)


def test_a_gradient_flows_through_a_promoting_op_in_each_input_dtype():
    """A bfloat16 activation added to a float32 tensor gets its gradient in bfloat16 (what its
    own backward then runs in), as in torch; the float32 leaf before it gets float32."""
    seen = {}
    for lib in ("shoal", "torch"):
        mod = core if lib == "shoal" else torch
        w = mod.tensor(_A, dtype=mod.float32, requires_grad=True)
        h = (w * 2).to(mod.bfloat16)

        def record(g, lib=lib):
            seen[lib] = _name(g.dtype)

        h.register_hook(record)
        y = h + mod.tensor(_B, dtype=mod.float32)
        assert _name(y.dtype) == "float32"
        y.sum().backward()
        assert _name(w.grad.dtype) == "float32"
        np.testing.assert_allclose(_numpy(w.grad), np.full(_A.shape, 2.0))
    assert seen == {"shoal": "bfloat16", "torch": "bfloat16"}


def test_clamp_without_bounds_is_refused():
    with pytest.raises(ValueError, match=r"clamp: at least one of min and max must be given, "
                                         r"got both None\."):
        core.tensor(_A).clamp()

