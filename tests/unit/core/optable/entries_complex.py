"""Op table entries: complex numbers (complex, polar, parts, views, angle, sgn, prod).

The table's samples are real arrays, so an op that needs a complex operand gets one through
view_as_complex on (..., 2) real pairs (a "call" form); complex results are compared through
view_as_real where their values come from libm (polar), so that the float tolerances apply.
tests/unit/core/complex/ checks complex inputs and their gradients in depth.
"""

from __future__ import annotations

from tests.unit.core.optable.table import FLOATS, HALVES, INTS, A, S, op

_M = (3, 4)
_PAIRS = (S(A((3, 4, 2))), S(A((5, 2))), S(A((2,))))
_REAL = (S(A(_M)), S(A((5,))), S(A(())))


def _of_complex(fn):
    """`call` applying fn to the complex tensor made of a (..., 2) sample."""
    return lambda lib, x: fn(lib, lib.view_as_complex(x))


COMPLEX = [
    op("complex", (S(A(_M), A(_M)), S(A((3, 1)), A((4,)))),
       forms=("function",), error=(S(A(_M), A(_M, dtype="int64")), RuntimeError)),
    op("polar", (S(A(_M, "pos"), A(_M)), S(A((3, 1), "pos"), A((4,)))), forms=("call",),
       call=lambda lib, r, t: lib.view_as_real(lib.polar(r, t)),
       error=(S(A(_M, "pos"), A(_M, dtype="float16")), RuntimeError), covers=("polar",)),
    op("view_as_complex", _PAIRS, view=True, forms=("call",),
       call=lambda lib, x: lib.view_as_real(lib.view_as_complex(x)),
       covers=("view_as_complex",), error=(S(A((3,))), RuntimeError)),
    op("view_as_real", _PAIRS, view=True, forms=("call",),
       call=_of_complex(lambda lib, z: lib.view_as_real(z)), covers=("view_as_real",),
       error=(S(A((3, 2), dtype="int64")), RuntimeError)),
    op("real", _REAL + _PAIRS[:1], view=True, forms=("call",),
       call=lambda lib, x: lib.real(x) if x.ndim != 3 else lib.real(lib.view_as_complex(x)),
       covers=("real",)),
    op("imag", _PAIRS, view=True, forms=("call",),
       call=_of_complex(lambda lib, z: lib.imag(z)), covers=("imag",),
       error=(S(A(_M)), RuntimeError)),
    op("conj", _REAL, view=True),
    op("conj_physical", _PAIRS, forms=("call",),
       call=_of_complex(lambda lib, z: lib.view_as_real(lib.conj_physical(z))),
       covers=("conj_physical",)),
    op("resolve_conj", _REAL, view=True),
    op("resolve_neg", _REAL, view=True),
    op("angle", _REAL, dtypes=FLOATS + INTS),
    # No backward here: torch's gradient of a real sgn is a ZeroTensor, which refuses .numpy();
    # tests/unit/core/complex checks sgn's complex gradient.
    op("sgn", _REAL, dtypes=FLOATS + HALVES, grad=False),
    op("is_complex", _REAL + _PAIRS[:1], dtypes=FLOATS, grad=False),
    op("prod", (S(A(_M)), S(A(_M), 1), S(A((2, 3, 4)), -1, keepdim=True), S(A(())),
                S(A(_M), dtype=None)), dtypes=FLOATS + INTS, error=(S(A(_M), 5), IndexError)),
]

ENTRIES = COMPLEX
