"""Op table entries for torch's everyday ops of core/ops/everyday.py: the elementwise math
tables, index ops, sorting and searching, scans, products, rearrangements and random fills."""

from __future__ import annotations

import operator

from tests.unit.core.optable.table import (
    FLOATS, HALVES, INTS, NUMERIC, A, S, Seq, binary_samples, op, operator_call, unary_samples,
)

_M = (3, 4)
_NOT_A_TENSOR = (S([1.0, 2.0]), TypeError)  # a list where a tensor goes: torch's TypeError
_DIM = (S(A(_M), 5), IndexError)            # a dim out of range: torch's IndexError
_IDX = A((3, 2), "index")

# -- elementwise: (name, domain, dtypes, aliases)
_UNARY = [
    ("log1p", "pos", FLOATS + HALVES, ()), ("expm1", "real", FLOATS + HALVES, ()),
    ("log2", "pos", FLOATS + HALVES, ()), ("log10", "pos", FLOATS + HALVES, ()),
    ("exp2", "real", FLOATS + HALVES, ()), ("rsqrt", "pos", FLOATS + HALVES, ()),
    ("reciprocal", "pos", FLOATS + HALVES, ()), ("sinh", "real", FLOATS + HALVES, ()),
    ("cosh", "real", FLOATS + HALVES, ()), ("asin", "unit", FLOATS + HALVES, ("arcsin",)),
    ("acos", "unit", FLOATS + HALVES, ("arccos",)), ("atan", "real", FLOATS + HALVES, ("arctan",)),
    ("asinh", "real", FLOATS + HALVES, ("arcsinh",)),
    ("atanh", "unit", FLOATS + HALVES, ("arctanh",)),
    ("deg2rad", "real", FLOATS + HALVES, ()), ("rad2deg", "real", FLOATS + HALVES, ()),
    ("square", "real", FLOATS + HALVES + ("int64",), ()),
    ("floor", "real", FLOATS + HALVES + INTS, ()), ("ceil", "real", FLOATS + HALVES + INTS, ()),
    ("trunc", "real", FLOATS + HALVES + INTS, ("fix",)),
    ("frac", "real", FLOATS + HALVES, ()), ("sign", "real", FLOATS + HALVES + ("int64",), ()),
    ("round", "real", FLOATS + HALVES + ("int64",), ()),
]
UNARY = [
    op(name, unary_samples(domain), dtypes=dts, inplace=name + "_", error=_NOT_A_TENSOR,
       covers=aliases + tuple(a + "_" for a in aliases))
    for name, domain, dts, aliases in _UNARY
] + [
    # acosh's domain is [1, inf): its samples are shifted there
    op("acosh", unary_samples("pos"), forms=("call",), covers=("acosh_", "arccosh", "arccosh_"),
       call=lambda lib, x: lib.acosh(x + 1.5)),
    op("round_decimals", (S(A(_M), decimals=2),), forms=("call",), grad=False,
       call=lambda lib, x, **kw: lib.round(x, **kw)),
]

_BINARY = [
    ("atan2", binary_samples()[:4], FLOATS + HALVES, ("arctan2",)),
    ("hypot", binary_samples()[:4], FLOATS, ()),
    ("logaddexp", binary_samples()[:4], FLOATS, ()),
    ("logaddexp2", binary_samples()[:4], FLOATS, ()),
    ("copysign", binary_samples(), FLOATS, ()),
    ("fmod", binary_samples("pos"), FLOATS + ("int64",), ()),
    ("remainder", binary_samples("pos"), FLOATS + ("int64",), ()),
]
BINARY = [
    op(name, samples, dtypes=dts, error=(S(A(_M), A((2, 4))), RuntimeError),
       inplace=None if name in ("logaddexp", "logaddexp2") else name + "_", covers=aliases)
    for name, samples, dts, aliases in _BINARY
] + [
    op("floor_divide", binary_samples("pos"), dtypes=FLOATS + ("int64",), grad=False,
       inplace="floor_divide_", error=(S(A(_M), A((2, 4))), RuntimeError)),
    op("heaviside", (S(A(_M), A(_M)), S(A(_M), A((4,)))), grad=False, inplace="heaviside_"),
    op("float_power", (S(A(_M, "pos"), A(_M)), S(A(_M, "pos"), 2))),
    op("lerp", (S(A(_M), A(_M), 0.3), S(A(_M), A((4,)), A(_M))), inplace="lerp_"),
    op("addcmul", (S(A(_M), A(_M), A(_M)), S(A(_M), A((4,)), A(_M), value=0.5))),
    op("addcdiv", (S(A(_M), A(_M), A(_M, "pos")), S(A(_M), A((4,)), A(_M, "pos"), value=0.5))),
] + [
    op(name, (S(A(_M, "mask"), A(_M, "mask")), S(A(_M), A((4,)))), dtypes=("int64", "bool"),
       grad=False, inplace=name + "_")
    for name in ("logical_and", "logical_or", "logical_xor")
] + [
    op(name, (S(A(_M), A(_M)), S(A(_M), A((4,)))), dtypes=("int64", "int32", "uint8", "bool"),
       grad=False, inplace=name + "_", error=(S(A(_M, dtype="float32"), A(_M)), RuntimeError))
    for name in ("bitwise_and", "bitwise_or", "bitwise_xor")
] + [
    op(name, (S(A(_M), A(_M)),), dtypes=("int64", "int32"), grad=False, inplace=name + "_")
    for name in ("gcd", "lcm")
] + [
    op("logical_not", (S(A(_M, "mask")), S(A(_M))), dtypes=("float32", "int64"), grad=False,
       inplace="logical_not_"),
    op("bitwise_not", (S(A(_M)),), dtypes=("int64", "bool"), grad=False),
    op("__floordiv__", (S(A(_M), A(_M, "pos")), S(A(_M), 2)), dtypes=FLOATS + ("int64",),
       forms=("call",), grad=False, call=operator_call(operator.floordiv),
       covers=("__rfloordiv__", "__ifloordiv__")),
    op("__mod__", (S(A(_M), A(_M, "pos")), S(A(_M), 2)), dtypes=FLOATS + ("int64",),
       forms=("call",), call=operator_call(operator.mod), covers=("__rmod__", "__imod__")),
    op("__and__", (S(A(_M), A(_M)),), dtypes=("int64", "bool"), forms=("call",), grad=False,
       call=operator_call(operator.and_)),
    op("__invert__", (S(A(_M)),), dtypes=("int64", "bool"), forms=("call",), grad=False,
       call=lambda lib, x: ~x),
    op("multiply", binary_samples(), covers=("subtract", "divide", "true_divide", "negative")),
]

INDEXING = [
    op("gather", (S(A(_M), 1, _IDX), S(A(_M), 0, A((2, 4), "index"))), dtypes=NUMERIC,
       error=(S(A(_M), 1, A((3, 2), dtype="int32")), RuntimeError)),
    op("scatter", (S(A(_M), 1, _IDX, A((3, 2))), S(A(_M), 0, A((2, 4), "index"), 2.5)),
       dtypes=NUMERIC, inplace="scatter_", error=(S(A(_M), 7, _IDX, A((3, 2))), IndexError)),
    op("scatter_add", (S(A(_M), 1, _IDX, A((3, 2))),), dtypes=NUMERIC, inplace="scatter_add_"),
    op("index_select", (S(A(_M), 1, A((2,), "index")), S(A(_M), 0, A((5,), "index"))),
       dtypes=NUMERIC, error=(S(A(_M), 5, A((2,), "index")), IndexError)),
    op("index_add", (S(A(_M), 1, A((2,), "index"), A((3, 2))),), dtypes=FLOATS,
       inplace="index_add_"),
    op("index_copy", (S(A(_M), 1, A((1,), "index"), A((3, 1))),), dtypes=FLOATS,
       inplace="index_copy_"),
    op("index_fill", (S(A(_M), 1, A((2,), "index"), -1.0),), dtypes=FLOATS,
       inplace="index_fill_"),
    op("masked_fill", (S(A(_M), A(_M, "mask"), 0.0), S(A(_M), A((4,), "mask"), 2.0)),
       dtypes=NUMERIC, forms=("method", "function"), inplace="masked_fill_",
       error=(S(A(_M), A(_M, dtype="float32"), 0.0), RuntimeError)),
    op("masked_select", (S(A(_M), A(_M, "mask")), S(A(_M), A((4,), "mask"))), dtypes=NUMERIC),
    op("take", (S(A(_M), A((2, 2), "index")),), dtypes=NUMERIC),
    op("take_along_dim", (S(A(_M), _IDX, 1),), dtypes=FLOATS),
    op("select", (S(A(_M), 1, 2), S(A(_M), 0, -1)), dtypes=NUMERIC, view=True,
       error=(S(A(_M), 0, 7), IndexError)),
]

SORTING = [
    op("sort", (S(A(_M)), S(A(_M), 0), S(A(_M), 1, True)), dtypes=FLOATS + ("int64",),
       error=_DIM),  # torch's CPU sort keeps equal keys in order, as core's stable one does
    op("argsort", (S(A(_M)), S(A(_M), 0, True)), dtypes=FLOATS, grad=False),
    op("topk", (S(A(_M), 2), S(A(_M), 1, 0, False)), dtypes=FLOATS,
       error=(S(A(_M), 9), RuntimeError)),
    op("kthvalue", (S(A(_M), 2), S(A(_M), 1, 0, True)), dtypes=FLOATS),
    op("median", (S(A(_M)), S(A(_M), 1), S(A((3, 5)), 1, True)), dtypes=FLOATS),
    op("mode", (S(A(_M, "index")),), dtypes=("int64",), grad=False),
    op("unique", (S(A(_M, "index")),), dtypes=("int64", "float32"), grad=False,
       forms=("function",)),
    op("searchsorted", (S(A((5,), "real"), A(_M)),), dtypes=FLOATS, grad=False,
       forms=("call",), call=lambda lib, s, v: lib.searchsorted(lib.sort(s).values, v)),
    op("bucketize", (S(A(_M), A((5,), "real")),), dtypes=FLOATS, grad=False,
       forms=("call",), call=lambda lib, v, b: lib.bucketize(v, lib.sort(b).values)),
    op("histc", (S(A((20,)), 5), S(A((20,)), 4, -1.0, 1.0)), dtypes=FLOATS, grad=False),
    op("bincount", (S(A((9,), "index")),), dtypes=("int64",), grad=False),
    op("isin", (S(A(_M, "index"), A((2,), "index")),), dtypes=("int64",), grad=False,
       forms=("function",)),
    op("count_nonzero", (S(A(_M, "index")), S(A(_M, "index"), 1)), dtypes=("int64",),
       grad=False),
    op("argwhere", (S(A(_M, "index")),), dtypes=("int64",), grad=False),
]

SCANS = [
    op(name, (S(A(_M), 1), S(A(_M), 0)), dtypes=FLOATS, error=_DIM)
    for name in ("cumsum", "cumprod", "logcumsumexp")
] + [
    op(name, (S(A(_M), 1), S(A(_M), 0)), dtypes=FLOATS, error=_DIM)
    for name in ("cummax", "cummin")
] + [
    op("diff", (S(A(_M)), S(A(_M), 2, 0), S(A(_M), 1, 1, A((3, 1))))),
    op("std", (S(A(_M)), S(A(_M), 1), S(A(_M), 0, keepdim=True, correction=0))),
    op("std_mean", (S(A(_M)), S(A(_M), 1)), forms=("function",)),
    op("var_mean", (S(A(_M)), S(A(_M), 1)), forms=("function",)),
    op("aminmax", (S(A(_M)), S(A(_M), dim=1)), grad=False),
    op("nansum", (S(A(_M)), S(A(_M), 1))),
    op("nanmean", (S(A(_M)), S(A(_M), 1))),
    op("cumsum_", (S(A(_M), 1),), forms=("method",), grad=False, view=True),
]

PRODUCTS = [
    op("dot", (S(A((4,)), A((4,))),), error=(S(A((4,)), A((3,))), RuntimeError)),
    op("vdot", (S(A((4,)), A((4,))),)),
    op("inner", (S(A(_M), A((2, 4))), S(A((4,)), A((4,))))),
    op("outer", (S(A((3,)), A((4,))),), covers=("ger",)),
    op("kron", (S(A((2, 3)), A((3, 2))), S(A((2,)), A((2, 2))))),
    op("einsum", (S("ij,jk->ik", A(_M), A((4, 2))), S("ij->j", A(_M)),
                  S("bij,bjk->bik", A((2, 3, 4)), A((2, 4, 5)))), forms=("function",)),
    op("trace", (S(A((4, 4))), S(A(_M)))),
    op("diagonal", (S(A(_M)), S(A((2, 3, 4)), 1, 0, 2)), view=True,
       xfail={"alias": "core.diagonal copies (numpy's diagonal view is read-only); torch "
                       "returns a view"}),
    op("diag", (S(A((4,))), S(A((4, 4))), S(A((3,)), 1))),
    op("diag_embed", (S(A(_M)),), forms=("function",)),
    op("tril", (S(A(_M)), S(A(_M), 1)), inplace="tril_"),
    op("triu", (S(A(_M)), S(A(_M), -1)), inplace="triu_"),
    op("tril_indices", (S(3, 4), S(4, 4, 1)), forms=("function",), grad=False,
       covers=("triu_indices",)),
    op("addmm", (S(A((3, 2)), A(_M), A((4, 2))), S(A((2,)), A(_M), A((4, 2)), beta=0.5, alpha=2))),
    op("addmv", (S(A((3,)), A(_M), A((4,))),)),
    op("baddbmm", (S(A((2, 3, 5)), A((2, 3, 4)), A((2, 4, 5))),)),
    op("addbmm", (S(A((3, 5)), A((2, 3, 4)), A((2, 4, 5))),)),
    op("cdist", (S(A(_M), A((5, 4))), S(A((2, 3, 4)), A((2, 5, 4)), 1.0)), forms=("function",)),
    op("dist", (S(A(_M), A(_M)), S(A(_M), A(_M), 1))),
]

_VIEW_COPIES = {"alias": "core's view here copies (numpy cannot express this view in place)"}
REARRANGE = [
    op("flip", (S(A(_M), (0,)), S(A((2, 3, 4)), (0, 2))), dtypes=NUMERIC),
    op("fliplr", (S(A(_M)),)), op("flipud", (S(A(_M)),)),
    op("roll", (S(A(_M), 1, 1), S(A(_M), (1, -2), (0, 1)), S(A(_M), 3))),
    op("rot90", (S(A(_M)), S(A(_M), 2), S(A((2, 3, 4)), 3, (1, 2)))),
    op("movedim", (S(A((2, 3, 4)), 0, 2), S(A((2, 3, 4)), (0, 1), (2, 0))), view=True,
       covers=("moveaxis",)),
    op("swapaxes", (S(A((2, 3, 4)), 0, 2),), view=True, covers=("swapdims",)),
    op("unbind", (S(A(_M)), S(A(_M), 1)), view=True),
    op("tensor_split", (S(A(_M), 3, 1), S(A(_M), (1, 3), 1)), view=True),
    op("hsplit", (S(A(_M), 2),), view=True, covers=("vsplit", "dsplit")),
    op("tile", (S(A(_M), (2, 1)), S(A(_M), (2,)))),
    op("repeat_interleave", (S(A(_M), 2, 1), S(A(_M), 3))),
    op("unflatten", (S(A((2, 12)), 1, (3, 4)),), view=True),
    op("ravel", (S(A(_M)),), view=True),
    op("broadcast_to", (S(A((4,)), (3, 4)),), view=True,
       xfail={"alias": "core's expand is a read-only broadcast view in numpy"}),
    op("broadcast_tensors", (S(A((3, 1)), A((1, 4))),), forms=("function",), view=True,
       covers=("broadcast_shapes",),
       xfail={"alias": "core's expand is a read-only broadcast view in numpy"}),
    op("meshgrid", (S(A((3,)), A((4,)), indexing="xy"), S(A((3,)), A((4,)), indexing="ij")),
       forms=("function",), view=True,
       xfail={"alias": "core's expand is a read-only broadcast view in numpy"}),
    op("atleast_2d", (S(A((4,))), S(A(()))), forms=("function",), view=True,
       covers=("atleast_1d", "atleast_3d")),
    op("hstack", (S(Seq((A(_M), A((3, 2))))),), forms=("function",),
       covers=("vstack", "row_stack", "dstack", "column_stack")),
    op("block_diag", (S(A((2, 2)), A((1, 3))),), forms=("function",)),
    op("cartesian_prod", (S(A((2,)), A((3,))),), forms=("function",)),
]

RANDOM = [
    op(name, (S(A(_M)),), forms=("method",), grad=False, random=True, view=True)
    for name in ("uniform_", "normal_", "exponential_", "cauchy_", "log_normal_", "random_",
                 "bernoulli_")
] + [
    op("geometric_", (S(A(_M), 0.3),), forms=("method",), grad=False, random=True, view=True),
    op("bernoulli", (S(A(_M, "unit")),), forms=("call",), grad=False, random=True,
       call=lambda lib, p: lib.bernoulli(p.abs())),
    op("multinomial", (S(A((5,), "pos"), 3), S(A((2, 5), "pos"), 4, True)), grad=False,
       random=True),
    op("normal", (S(A(_M), A(_M, "pos")),), forms=("function",), grad=False, random=True),
    op("rand_like", (S(A(_M)),), forms=("function",), grad=False, random=True,
       covers=("randn_like",)),
    op("randint_like", (S(A(_M), 5),), forms=("function",), grad=False, random=True),
    op("new_zeros", (S(A(_M), 2, 3), S(A(_M), (4,))), forms=("method",), grad=False,
       dtypes=NUMERIC, covers=("new_ones", "new_empty")),
    op("new_full", (S(A(_M), (2,), 7),), forms=("method",), grad=False, dtypes=NUMERIC),
    op("new_tensor", (S(A(_M), [1, 2]),), forms=("method",), grad=False, dtypes=NUMERIC),
]

PREDICATES = [
    op(name, unary_samples() + (S(A((4,), "special")),), dtypes=FLOATS + HALVES + ("int64",),
       grad=False, error=_NOT_A_TENSOR)
    for name in ("isnan", "isinf", "isfinite", "isposinf", "isneginf")
] + [
    # no 16-bit dtypes: the table makes torch's bfloat16 input through float32, and torch rounds
    # a NaN to 0xFFFF (sign set) where ml_dtypes keeps 0x7FC0, so the two inputs differ
    op("signbit", unary_samples() + (S(A((4,), "special")),), dtypes=FLOATS + ("int64",),
       grad=False, error=_NOT_A_TENSOR),
] + [
    op("isreal", (S(A(_M)),), grad=False, forms=("function",)),
    op("nan_to_num", (S(A((4,), "special")), S(A((4,), "special"), 1.0, 9.0, -9.0)),
       dtypes=FLOATS + HALVES),
    op("cross", (S(A((4, 3)), A((4, 3)), dim=1), S(A((3, 4)), A((3, 4))))),
] + [
    op(name, unary_samples(domain), dtypes=FLOATS, error=_NOT_A_TENSOR)
    for name, domain in (("erf", "real"), ("erfc", "real"), ("erfinv", "unit"),
                         ("lgamma", "pos"), ("logit", "unit"), ("i0", "real"), ("sinc", "real"))
] + [
    # torch's trigamma and polygamma are accurate to ~5e-10 relative in float64 (scipy's to
    # 1e-15), so the table's double bounds would test torch: digamma's gradient and polygamma's
    # float64 values are checked against mpmath in tests/unit/core/special instead.
    op("digamma", unary_samples("pos"), dtypes=FLOATS, grad=False, error=_NOT_A_TENSOR),
    op("xlogy", (S(A(_M), A(_M, "pos")), S(A(_M), 2.0))),
    op("polygamma", (S(1, A(_M, "pos")), S(2, A(_M, "pos"))), forms=("function",),
       dtypes=("float32",), grad=False),
    op("softplus", (S(A(_M)), S(A(_M), 2.0, 1.0)), forms=("call",),
       call=lambda lib, *a: lib.nn.functional.softplus(*a)),
]

ENTRIES = PREDICATES + UNARY + BINARY + INDEXING + SORTING + SCANS + PRODUCTS + REARRANGE + RANDOM
