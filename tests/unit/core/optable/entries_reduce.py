"""Op table entries: reductions, softmax, matrix products, convolutions and shape ops."""

from __future__ import annotations

from tests.unit.core.optable.table import (
    ALL, FLOATS, HALVES, INTS, NUMERIC, A, DT, S, Seq, op,
)

_BAD_DIM = S(A((3, 4)), 5)  # a dim out of range: torch's IndexError
_M = (3, 4)


def _reduction(name: str, dtypes: tuple = NUMERIC, grad: bool = True, **kw):
    """A reduction over all elements, one dim, a negative dim with keepdim, and a 0-d input."""
    samples = (S(A(_M)), S(A(_M), 1), S(A((2, 3, 4)), -1, keepdim=True), S(A(_M), dim=0),
               S(A(())))
    xfail = {**kw.pop("xfail", {})}
    return op(name, samples + kw.pop("more", ()), dtypes=dtypes, grad=grad,
              error=(_BAD_DIM, IndexError), xfail=xfail, **kw)


REDUCTIONS = [
    _reduction("sum", more=(S(A((2, 3, 4)), (0, 2)), S(A(_M), dtype=DT("float64")))),
    _reduction("mean", dtypes=FLOATS + HALVES, more=(S(A((2, 3, 4)), (0, 2)),)),
    _reduction("max", dtypes=NUMERIC, more=(S(A(_M), A(_M)),)),
    _reduction("min", dtypes=NUMERIC),
    _reduction("amax", dtypes=NUMERIC, more=(S(A((2, 3, 4)), (0, 2)),)),
    _reduction("amin", dtypes=NUMERIC),
    _reduction("argmax", dtypes=FLOATS + INTS, grad=False),
    _reduction("argmin", dtypes=FLOATS + INTS, grad=False),
    op("var", (S(A(_M)), S(A(_M), 1), S(A(_M), 0, keepdim=True), S(A(_M), 1, correction=0),
               S(A(_M), unbiased=False)),
       error=(_BAD_DIM, IndexError), forms=("method", "function")),
    op("all", (S(A(_M)), S(A(_M), 1), S(A((2, 3, 4)), -1, keepdim=True), S(A(()))),
       dtypes=("bool",) + FLOATS + INTS, grad=False, error=(_BAD_DIM, IndexError)),
    op("any", (S(A(_M)), S(A(_M), 1), S(A((2, 3, 4)), -1, keepdim=True), S(A(()))),
       dtypes=("bool",) + FLOATS + INTS, grad=False, error=(_BAD_DIM, IndexError)),
    op("logsumexp", (S(A(_M), 1), S(A((2, 3, 4)), (0, 2)), S(A(_M), -1, keepdim=True)),
       dtypes=FLOATS + HALVES, error=(_BAD_DIM, IndexError)),
    op("softmax", (S(A(_M), 1), S(A(_M), 0), S(A((2, 3, 4)), -1), S(A(_M), 1, dtype=DT("float64"))),
       dtypes=FLOATS + HALVES, error=(_BAD_DIM, IndexError),
       xfail={"forward": "core.softmax takes no dtype= (torch casts the input first)",
              "backward": "core.softmax takes no dtype= (torch casts the input first)"}),
    op("log_softmax", (S(A(_M), 1), S(A(_M), 0), S(A((2, 3, 4)), -1)),
       dtypes=FLOATS + HALVES, error=(_BAD_DIM, IndexError)),
    op("norm", (S(A(_M)), S(A(_M), 1), S(A(_M), 2, 1), S(A(_M), dim=0, keepdim=True),
                S(A(_M), float("inf"))),
       error=(S(A(_M), 2, 5), IndexError)),
]

PRODUCTS = [
    op("matmul", (S(A(_M), A((4, 2))), S(A((4,)), A((4,))), S(A((2, 3, 4)), A((4, 5))),
                  S(A((4,)), A((4, 2))), S(A((2, 1, 3, 4)), A((5, 4, 2)))),
       dtypes=FLOATS + HALVES + ("int64",), error=(S(A(_M), A(_M)), RuntimeError)),
    op("mm", (S(A(_M), A((4, 2))),), dtypes=FLOATS + ("int64",),
       error=(S(A((2, 3, 4)), A((4, 2))), RuntimeError)),
    op("bmm", (S(A((2, 3, 4)), A((2, 4, 5))),), dtypes=FLOATS + ("int64",),
       error=(S(A(_M), A((4, 2))), RuntimeError)),
    op("conv1d", (S(A((2, 3, 8)), A((4, 3, 3))), S(A((2, 3, 8)), A((4, 3, 3)), A((4,)), 2, 1),
                  S(A((2, 4, 8)), A((4, 2, 3)), None, 1, "same", 1, 2)),
       dtypes=FLOATS, forms=("function",), error=(S(A((2, 3, 8)), A((4, 2, 3))), RuntimeError)),
    op("conv2d", (S(A((2, 3, 6, 6)), A((4, 3, 3, 3))),
                  S(A((1, 2, 5, 5)), A((2, 2, 3, 3)), A((2,)), 2, 1, 2)),
       dtypes=FLOATS, forms=("function",),
       error=(S(A((2, 3, 6, 6)), A((4, 2, 3, 3))), RuntimeError)),
    op("multi_dot", (S(Seq((A((3, 4)), A((4, 5)), A((5, 2))))), S(Seq((A((4,)), A((4, 3)))))),
       forms=("call",), call=lambda lib, *a: lib.linalg.multi_dot(*a),
       error=(S(Seq((A((3, 4)),))), RuntimeError)),
]

_VIEWS = dict(dtypes=ALL, view=True)
_READ_ONLY = ("a write into an expanded view raises numpy's ValueError 'assignment destination "
              "is read-only' (torch writes every element: fill_ succeeds)")
SHAPES = [
    # torch's function takes the shape as one tuple; the method takes it spread out too.
    op("reshape", (S(A(_M), (2, 6)), S(A(_M), 2, 6), S(A(_M), (-1,)), S(A(()), 1),
                   S(A((2, 3, 4)), (4, -1))),
       forms=("method", "function"), **_VIEWS, error=(S(A(_M), 5, 5), RuntimeError)),
    op("view", (S(A(_M), 2, 6), S(A(_M), (-1,)), S(A((2, 3, 4)), 6, 4)), forms=("method",),
       **_VIEWS, error=(S(A(_M), 5, 5), RuntimeError)),
    op("flatten", (S(A((2, 3, 4))), S(A((2, 3, 4)), 1), S(A((2, 3, 4)), 0, 1), S(A(()))),
       **_VIEWS, error=(S(A(_M), 3), IndexError)),
    op("unsqueeze", (S(A(_M), 0), S(A(_M), -1), S(A(()), 0)), **_VIEWS,
       error=(S(A(_M), 4), IndexError)),
    op("squeeze", (S(A((3, 1, 4, 1))), S(A((3, 1, 4)), 1), S(A((3, 1, 4)), 0), S(A(())),
                   S(A((1, 3, 1)), (0, 2))),
       **_VIEWS, error=(S(A(_M), 3), IndexError)),
    op("transpose", (S(A(_M), 0, 1), S(A((2, 3, 4)), -1, 0)), **_VIEWS,
       error=(S(A(_M), 0, 2), IndexError)),
    op("permute", (S(A((2, 3, 4)), (2, 0, 1)), S(A((2, 3, 4)), 2, 0, 1)),
       forms=("method", "function"), **_VIEWS, error=(S(A((2, 3, 4)), 0, 1), RuntimeError)),
    op("t", (S(A(_M)), S(A((4,)))), forms=("method", "function"), **_VIEWS,
       error=(S(A((2, 3, 4))), RuntimeError),
       xfail={"forms": "core lacks core.t (torch.t); only Tensor.t"}),
    op("T", (S(A(_M)),), forms=("call",), call=lambda lib, x: x.T, **_VIEWS),
    op("mT", (S(A((2, 3, 4))), S(A(_M))), forms=("call",), call=lambda lib, x: x.mT, **_VIEWS,
       error=(S(A((4,))), RuntimeError)),
    op("expand", (S(A((3, 1)), 3, 4), S(A((1, 4)), (2, 3, 4)), S(A((3, 1)), -1, 5)),
       forms=("method",), **_VIEWS, error=(S(A((3, 2)), 3, 4), RuntimeError),
       xfail={"alias": _READ_ONLY}),
    op("expand_as", (S(A((3, 1)), A(_M)),), forms=("method",), **_VIEWS,
       error=(S(A((3, 2)), A(_M)), RuntimeError), xfail={"alias": _READ_ONLY}),
    op("view_as", (S(A(_M), A((2, 6))),), forms=("method",), **_VIEWS,
       error=(S(A(_M), A((5,))), RuntimeError)),
    op("narrow", (S(A(_M), 1, 1, 2), S(A(_M), 0, 0, 3), S(A(_M), -1, 2, 2)), **_VIEWS,
       error=(S(A(_M), 1, 3, 2), RuntimeError)),
    op("split", (S(A((5, 4)), 2), S(A((5, 4)), (1, 4)), S(A((5, 4)), 3, 1)), **_VIEWS,
       error=(S(A((5, 4)), (1, 1)), RuntimeError)),
    op("chunk", (S(A((5, 4)), 2), S(A((5, 4)), 3, 1), S(A((5, 4)), 5)), **_VIEWS,
       error=(S(A((5, 4)), 0), RuntimeError),
       xfail={"error": "chunk(0) raises ZeroDivisionError (torch: RuntimeError 'chunk expects "
                       "`chunks` to be greater than 0')"}),
    op("contiguous", (S(A(_M)),), forms=("method",), **_VIEWS),
    op("__getitem__", (S(A(_M), 1), S(A(_M), (slice(None), 2)), S(A(_M), (Ellipsis, None, 1)),
                       S(A((2, 3, 4)), (0, slice(1, 3)))),
       forms=("call",), call=lambda lib, x, i: x[i], **_VIEWS,
       error=(S(A(_M), 5), IndexError),
       xfail={"error": "an index out of range raises ShapeError, a ValueError (torch: IndexError)"
                       " (core/ops/shape.py:203 getitem)"}),
    op("__getitem__[index]", (S(A((5, 4)), A((3,), "index")), S(A((5, 4)), A((5,), "mask"))),
       forms=("call",), call=lambda lib, x, i: x[i], dtypes=ALL, covers=(),
       error=(S(A((2, 4)), A((3,), "mask")), IndexError),
       xfail={"error": "a mask of the wrong length raises ShapeError, a ValueError (torch: "
                       "IndexError) (core/ops/shape.py:203 getitem)"}),
    op("clone", (S(A(_M)), S(A(()))), dtypes=ALL),
    op("repeat", (S(A((2, 3)), 2, 2), S(A((3,)), (2, 1, 2)), S(A(()), 3)), forms=("method",),
       dtypes=ALL, error=(S(A((2, 3)), 2), RuntimeError)),
    op("cat", (S(Seq((A((2, 3)), A((4, 3))))), S(Seq((A((2, 3)), A((2, 1)))), dim=1),
               S(Seq((A((2, 3)), A((2, 3)))), -1)),
       forms=("function",), dtypes=ALL, error=(S(Seq((A((2, 3)), A((2, 4))))), RuntimeError)),
    op("stack", (S(Seq((A((2, 3)), A((2, 3))))), S(Seq((A((2, 3)), A((2, 3)))), 2),
                 S(Seq((A(()), A(()))))),
       forms=("function",), dtypes=ALL, error=(S(Seq((A((2, 3)), A((3, 2))))), RuntimeError)),
    op("where", (S(A(_M, "mask"), A(_M), A(_M)), S(A((3, 1), "mask"), A((1, 4)), 0.0),
                 S(A(_M, "mask"), A(_M), A(()))),
       forms=("function",), dtypes=FLOATS + HALVES + ("int64",),
       error=(S(A(_M, "mask"), A((2, 4)), A(_M)), RuntimeError)),
]

ENTRIES = REDUCTIONS + PRODUCTS + SHAPES
