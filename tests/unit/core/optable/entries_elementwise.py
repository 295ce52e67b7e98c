"""Op table entries: arithmetic, comparisons, unary math and Python's operators."""

from __future__ import annotations

import operator

from tests.unit.core.optable.table import (
    FLOATS, HALVES, INTS, NUMERIC, A, S, binary_samples, op, operator_call,
    unary_samples,
)

_SHAPES = S(A((3, 4)), A((2, 4)))  # shapes that do not broadcast: torch's RuntimeError
_NOT_A_TENSOR = S([1.0, 2.0])      # a list where a tensor goes: torch's TypeError
_NO_LIST_INPUT = "core's unary ops raise AttributeError for a list (torch: TypeError)"
_NO_INPLACE = "core lacks Tensor.{}: torch's in-place variant of every unary op"
_NO_ALPHA = "core.{} takes no alpha= (torch: x + alpha * y), method and function alike"
_NO_ROUNDING = "core.div takes no rounding_mode= (torch's 'floor'/'trunc'), nor does div_"


def _unary(name: str, domain: str = "real", dtypes: tuple = FLOATS + HALVES, **kw):
    """A unary float op with torch's in-place method `name_`, which core may lack."""
    xfail = dict(kw.pop("xfail", {}))
    xfail.setdefault("inplace", _NO_INPLACE.format(name + "_"))
    xfail.setdefault("error", _NO_LIST_INPUT)
    return op(name, unary_samples(domain), dtypes=dtypes, inplace=name + "_",
              error=(_NOT_A_TENSOR, TypeError), xfail=xfail, **kw)


ARITH = [
    op("add", binary_samples() + (S(A((3, 4)), A((3, 4)), alpha=2),), dtypes=NUMERIC,
       inplace="add_", error=(_SHAPES, RuntimeError),
       xfail={"forward": _NO_ALPHA.format("add"), "backward": _NO_ALPHA.format("add")}),
    op("sub", binary_samples() + (S(A((3, 4)), A((3, 4)), alpha=0.5),), dtypes=NUMERIC,
       inplace="sub_", error=(_SHAPES, RuntimeError),
       xfail={"forward": _NO_ALPHA.format("sub"), "backward": _NO_ALPHA.format("sub")}),
    op("mul", binary_samples(), dtypes=NUMERIC, inplace="mul_", error=(_SHAPES, RuntimeError)),
    op("div", binary_samples("pos") + (S(A((3, 4)), A((3, 4), "pos"), rounding_mode="floor"),),
       dtypes=FLOATS + HALVES + ("int64",), inplace="div_", error=(_SHAPES, RuntimeError),
       xfail={"forward": _NO_ROUNDING, "backward": _NO_ROUNDING, "inplace": _NO_ROUNDING}),
    op("pow", (S(A((3, 4), "pos"), A((3, 4))), S(A((3, 4), "pos"), 2),
               S(A((3, 4), "pos"), A(())), S(A((), "pos"), A((4,)))),
       inplace="pow_", error=(_SHAPES, RuntimeError)),
    op("neg", unary_samples(), dtypes=FLOATS + HALVES + ("int64", "int32"), inplace="neg_",
       forms=("method", "function"),
       xfail={"inplace": _NO_INPLACE.format("neg_")}),
    op("maximum", binary_samples()[:4], dtypes=NUMERIC, error=(_SHAPES, RuntimeError)),
    op("minimum", binary_samples()[:4], dtypes=NUMERIC, error=(_SHAPES, RuntimeError)),
]

COMPARISONS = [
    op(name, binary_samples(), dtypes=FLOATS + INTS, grad=False, inplace=name + "_",
       forms=("method", "function"), error=(_SHAPES, RuntimeError),
       xfail={"inplace": f"core lacks Tensor.{name}_ (torch writes 0/1 into the tensor's dtype)"})
    for name in ("eq", "ne", "lt", "le", "gt", "ge")
]

UNARY = [
    _unary("exp"),
    _unary("log", "pos"),
    _unary("sqrt", "pos"),
    _unary("tanh"),
    _unary("sigmoid"),
    _unary("sin"),
    _unary("cos"),
    _unary("tan", "unit"),
    _unary("relu", dtypes=FLOATS + HALVES + ("int64",)),
    _unary("abs", dtypes=FLOATS + HALVES + ("int64", "int32")),
    op("gelu", unary_samples() + (S(A((3, 4)), approximate="tanh"),),
       dtypes=FLOATS + HALVES, forms=("call",),
       call=lambda lib, *a, **k: lib.nn.functional.gelu(*a, **k),
       error=(S(A((3,)), approximate="cubic"), RuntimeError),
       xfail={"error": "core's gelu raises ValueError for an unknown approximate= (torch: "
                       "RuntimeError)"}),
    op("clamp", (S(A((3, 4)), -1.0, 1.0), S(A((3, 4)), min=0.0), S(A((3, 4)), max=0.5),
                 S(A((3, 4)), A((3, 4)), A((1, 4)))),
       dtypes=FLOATS + HALVES + ("int64",), inplace="clamp_", covers=("clip",),
       error=(S(A((3,))), RuntimeError),
       xfail={"inplace": _NO_INPLACE.format("clamp_"),
              "error": "core.clamp with neither min nor max raises ValueError (torch: "
                       "RuntimeError)"}),
]

# Python's operators on Tensor, and the reflected forms a number on the left calls.
_OPS = {"__add__": operator.add, "__sub__": operator.sub, "__mul__": operator.mul,
        "__truediv__": operator.truediv, "__pow__": operator.pow}
OPERATORS = [
    op(name, (S(A((3, 4), "pos"), A((3, 4), "pos")), S(A((3, 4), "pos"), 2.0),
              S(A((3, 4), "pos"), A((4,), "pos"))),
       forms=("call",), call=operator_call(fn), error=(S(A((3, 4)), "x"), TypeError))
    for name, fn in _OPS.items()
] + [
    op("__r" + name[2:], (S(A((3, 4), "pos"), 2.0), S(A((), "pos"), 3.0)), forms=("call",),
       call=operator_call(fn, reflected=True), error=(S(A((3, 4)), "x"), TypeError))
    for name, fn in _OPS.items()
] + [
    op("__i" + name[2:], (S(A((3, 4), "pos"), A((3, 4), "pos")), S(A((3, 4), "pos"), 2.0)),
       forms=("call",), grad=False, call=operator_call(fn_i), view=True,
       error=(S(A((3, 4)), A((2, 4))), RuntimeError))
    for (name, _), fn_i in zip(list(_OPS.items())[:4], (operator.iadd, operator.isub,
                                                         operator.imul, operator.itruediv))
] + [
    op("__ipow__", (S(A((3, 4), "pos"), 2.0),), forms=("call",), grad=False, view=True,
       call=operator_call(operator.ipow), error=(S(A((3, 4)), A((2, 4))), RuntimeError)),
    op("__matmul__", (S(A((3, 4)), A((4, 2))), S(A((2, 3, 4)), A((4,)))), forms=("call",),
       call=operator_call(operator.matmul), error=(S(A((3, 4)), A((3, 4))), RuntimeError)),
    op("__rmatmul__", (S(A((3, 4)), A((4, 2))),), forms=("call",),
       call=lambda lib, x, y: y.__rmatmul__(x), error=(S(A((3, 4)), A((3, 4))), RuntimeError)),
    op("__neg__", unary_samples(), dtypes=FLOATS + ("int64",), forms=("call",),
       call=operator_call(operator.neg)),
    op("__pos__", unary_samples(), dtypes=FLOATS + ("int64",), forms=("call",), view=True,
       call=operator_call(operator.pos)),
    op("__abs__", unary_samples(), dtypes=FLOATS + ("int64",), forms=("call",),
       call=operator_call(operator.abs)),
] + [
    op(name, binary_samples(), dtypes=FLOATS + ("int64",), forms=("call",), grad=False,
       call=operator_call(fn), error=(_SHAPES, RuntimeError))
    for name, fn in {"__eq__": operator.eq, "__ne__": operator.ne, "__lt__": operator.lt,
                     "__le__": operator.le, "__gt__": operator.gt,
                     "__ge__": operator.ge}.items()
]

ENTRIES = ARITH + COMPARISONS + UNARY + OPERATORS
