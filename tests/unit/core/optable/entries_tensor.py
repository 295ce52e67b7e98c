"""Op table entries: creation, casts and conversions, comparisons of whole tensors, the in-place
methods, and torch ops core lacks (every aspect an expected failure until it lands)."""

from __future__ import annotations

from tests.unit.core.optable.table import (
    ALL, FLOATS, HALVES, NUMERIC, NUMPY_ERROR, A, DT, S, op,
)

_M = (3, 4)
_CAPSULE = ("core.from_dlpack refuses a DLPack capsule (torch takes the legacy capsule "
            "to_dlpack returns; core/ops/interop.py:29)")
_SIZES = (S(2, 3), S((2, 3)), S(2, 3, dtype=DT("*")), S(()), S(0, 3))
_NEGATIVE = (S(-1), RuntimeError)  # a negative size: torch's RuntimeError
_NUMPY = {"error": NUMPY_ERROR}
_LIKE = (S(A(_M)), S(A(_M), dtype=DT("float64")), S(A(())))

CREATION = [
    op(name, _SIZES, dtypes=NUMERIC + ("bool",), forms=("function",), grad=False,
       error=_NEGATIVE, random=name == "empty", xfail=_NUMPY)
    for name in ("zeros", "ones", "empty")
] + [
    op(name, _LIKE, dtypes=ALL, forms=("function",), grad=False, random=name == "empty_like")
    for name in ("zeros_like", "ones_like", "empty_like")
] + [
    op("full", (S((2, 3), 1.5), S((2, 3), 2, dtype=DT("*")), S((), 7), S((2,), True)),
       dtypes=NUMERIC, forms=("function",), grad=False, error=(S((-1,), 1.0), RuntimeError),
       xfail=_NUMPY),
    op("full_like", (S(A(_M), 2.5), S(A(_M), 2, dtype=DT("float64"))), dtypes=ALL,
       forms=("function",), grad=False),
    op("tensor", (S([[1.0, 2.0], [3.0, 4.0]]), S([1, 2, 3]), S(3.5), S([True, False]),
                  S([[1, 2]], dtype=DT("*")), S([])),
       dtypes=NUMERIC, forms=("function",), grad=False, error=(S([[1, 2], [3]]), ValueError)),
    op("as_tensor", (S([1.0, 2.0]), S(A(_M)), S(A(_M), dtype=DT("float64"))), dtypes=ALL,
       forms=("function",), grad=False, view=True),
    # torch has no numpy bfloat16, so no bfloat16 round trip through numpy.
    op("from_numpy", (S(A(_M)),), dtypes=FLOATS + ("float16", "int64", "int32", "uint8", "bool"), forms=("call",), grad=False,
       view=True, call=lambda lib, x: lib.from_numpy(x.numpy())),
    op("eye", (S(3), S(2, 4), S(3, dtype=DT("*"))), dtypes=NUMERIC, forms=("function",),
       grad=False, error=_NEGATIVE, xfail=_NUMPY),
    op("arange", (S(5), S(1, 7, 2), S(0.0, 1.0, 0.25), S(5, dtype=DT("*")), S(4, 0, -1)),
       dtypes=FLOATS + ("int64", "int32"), forms=("function",), grad=False,
       error=(S(0, 10, 0), RuntimeError),
       xfail={"error": "arange with step 0 raises ZeroDivisionError (torch: RuntimeError)"}),
    op("linspace", (S(0, 1, 5), S(-1.0, 2.0, 7, dtype=DT("*")), S(3, 3, 1)), dtypes=FLOATS,
       forms=("function",), grad=False, error=(S(0, 1, -1), RuntimeError), xfail=_NUMPY),
    op("rand", (S(2, 3), S((4,)), S(2, dtype=DT("*"))), dtypes=FLOATS + HALVES,
       forms=("function",), grad=False, random=True, error=_NEGATIVE, xfail=_NUMPY),
    op("randn", (S(2, 3), S((4,)), S(2, dtype=DT("*"))), dtypes=FLOATS + HALVES,
       forms=("function",), grad=False, random=True, error=_NEGATIVE, xfail=_NUMPY),
    op("randint", (S(0, 10, (2, 3)), S(5, (4,)), S(0, 5, (3,), dtype=DT("*"))),
       dtypes=("int64", "int32", "float32"), forms=("function",), grad=False, random=True,
       error=(S(5, 2, (3,)), RuntimeError),
       xfail={"forward": "core.randint(high, size) takes size for high: torch's two-argument "
                         "form fails (core/ops/creation.py randint)", **_NUMPY}),
    op("randperm", (S(5), S(6, dtype=DT("*"))), dtypes=("int64", "int32", "float32"),
       forms=("function",), grad=False, random=True, error=_NEGATIVE,
       xfail={"error": "randperm(-1) returns an empty tensor (torch: RuntimeError)"}),
    op("from_dlpack", (S(A(_M)),), dtypes=NUMERIC + ("bool",), forms=("call",), grad=False,
       view=True, call=lambda lib, x: lib.from_dlpack(x)),
    op("to_dlpack", (S(A(_M)),), dtypes=NUMERIC + ("bool",), forms=("call",), grad=False,
       view=True, call=lambda lib, x: lib.from_dlpack(lib.to_dlpack(x)),
       xfail={"forward": _CAPSULE, "alias": _CAPSULE,
              "forward-bfloat16": "core.to_dlpack refuses bfloat16 (numpy's DLPack has no "
                                  "bfloat16; torch exports it)"}),
]

_CASTS = {"float": "float32", "double": "float64", "half": "float16", "bfloat16": "bfloat16",
          "long": "int64", "int": "int32", "bool": "bool"}
CASTS = [
    op(name, (S(A(_M)), S(A(()))), dtypes=ALL, forms=("method",),
       grad=target in FLOATS + HALVES, view=target == ALL[0])  # returns self when no cast
    for name, target in _CASTS.items()
] + [
    op("to", (S(A(_M), DT("float64")), S(A(_M), "cpu"), S(A(_M), dtype=DT("int64")),
              S(A(_M), A((2,), dtype="float16"))),
       dtypes=ALL, forms=("method",), grad=False, error=(S(A(_M), "nowhere"), RuntimeError)),
    op("type", (S(A(_M), DT("float64")), S(A(_M), DT("int32"))), dtypes=ALL,
       forms=("method",), grad=False),
    op("type_as", (S(A(_M), A(_M, dtype="int64")), S(A(_M), A((), dtype="float64"))),
       dtypes=ALL, forms=("method",), grad=False),
    op("detach", (S(A(_M)),), dtypes=ALL, forms=("method",), grad=False, view=True),
    op("detach_", (S(A(_M)),), dtypes=ALL, forms=("method",), grad=False, view=True),
    op("item", (S(A(())), S(A((1, 1)))), dtypes=ALL, forms=("method",), grad=False,
       error=(S(A(_M)), RuntimeError),
       xfail={"error": "Tensor.item() on many elements raises ValueError (torch: RuntimeError) "
                       "at core/tensor.py Tensor.item"}),
    op("tolist", (S(A(_M)), S(A(()))), dtypes=ALL, forms=("method",), grad=False),
]

LOGICAL = [
    op("equal", (S(A(_M), A(_M)), S(A(_M), A((4,)))), dtypes=ALL, grad=False,
       error=(S(A(_M), 1.0), TypeError),
       xfail={"error": "core.equal(t, 1.0) raises AttributeError (torch: TypeError)"}),
    op("isclose", (S(A(_M), A(_M)), S(A(_M), A((4,)), rtol=0.5, atol=1.0)), dtypes=NUMERIC,
       grad=False, error=(S(A(_M), A((2, 4))), RuntimeError)),
    op("allclose", (S(A(_M), A(_M)), S(A(_M), A(_M), rtol=10.0, atol=10.0)), dtypes=FLOATS,
       grad=False, error=(S(A(_M), A((2, 4))), RuntimeError)),
    op("nonzero", (S(A(_M)), S(A(_M), as_tuple=True), S(A(()))), dtypes=ALL, grad=False),
]

INPLACE = [
    op("zero_", (S(A(_M)), S(A(()))), dtypes=ALL, forms=("method",), grad=False, view=True),
    op("fill_", (S(A(_M), 2.5), S(A(_M), A(())), S(A(_M), -1)), dtypes=ALL,
       forms=("method",), grad=False, view=True, error=(S(A(_M), A((2,))), RuntimeError),
       xfail={"error": "fill_ with a tensor of many elements raises ValueError from item() "
                       "(torch: RuntimeError)"}),
    op("copy_", (S(A(_M), A(_M)), S(A(_M), A((4,))), S(A(_M), A(_M, dtype="float64"))),
       dtypes=ALL, forms=("method",), grad=False, view=True,
       error=(S(A(_M), A((2, 4))), RuntimeError), xfail=_NUMPY),
    op("addcmul_", (S(A(_M), A(_M), A(_M)), S(A(_M), A((4,)), A(_M), value=0.5)),
       dtypes=FLOATS, forms=("method",), grad=False, view=True,
       error=(S(A(_M), A((2, 4)), A(_M)), RuntimeError)),
    op("addcdiv_", (S(A(_M), A(_M), A(_M, "pos")), S(A(_M), A((4,)), A(_M, "pos"), value=0.5)),
       dtypes=FLOATS, forms=("method",), grad=False, view=True,
       error=(S(A(_M), A((2, 4)), A(_M, "pos")), RuntimeError)),
    op("__setitem__", (S(A(_M), 1, 0.5), S(A(_M), (slice(None), 2), A((3,))),
                       S(A(_M), A(_M, "mask"), 0.0), S(A((5, 4)), A((2,), "index"), 1.0)),
       dtypes=NUMERIC, forms=("call",), grad=False, view=True,
       call=lambda lib, x, i, v: (x.__setitem__(i, v), x)[1],
       error=(S(A(_M), 5, 1.0), IndexError)),
]


def _missing(name: str, samples: tuple, dtypes: tuple = FLOATS, **kw):
    """A torch op core lacks: every aspect is an expected failure naming it."""
    return op(name, samples, dtypes=dtypes, missing=f"core lacks {name} (torch.{name})", **kw)


MISSING: list = []  # every op the table knew core to lack has landed

ENTRIES = CREATION + CASTS + LOGICAL + INPLACE + MISSING
