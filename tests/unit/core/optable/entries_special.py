"""Op table entries: core.special (torch.special) where the table's tolerances hold. Functions
whose float32 results differ from torch's by more (digamma near its root, logit near 0.5) or
that need inputs in (0, 1) (ndtri, logit) are checked with their own bounds in
tests/unit/core/special/, as are the poles, infinities and polygamma."""

from __future__ import annotations

from tests.unit.core.optable.table import FLOATS, HALVES, A, S, op, unary_samples

_M = (3, 4)
_NOT_A_TENSOR = (S([1.0, 2.0]), TypeError)


def _special(name: str, samples: tuple, **kw):
    """An entry for core.special.<name>, called as lib.special.<name>."""
    kw.setdefault("error", _NOT_A_TENSOR)
    return op(f"special.{name}", samples, forms=("call",),
              call=lambda lib, *a, **k: getattr(lib.special, name)(*a, **k), **kw)


_ANY = FLOATS + HALVES + ("int64",)
SPECIAL = [
    _special("erf", unary_samples(), dtypes=_ANY),
    _special("erfc", unary_samples(), dtypes=_ANY),
    _special("erfcx", unary_samples(), dtypes=FLOATS),
    _special("erfinv", unary_samples("unit"), dtypes=FLOATS + HALVES),
    _special("expit", unary_samples(), dtypes=_ANY),
    _special("i0", unary_samples(), dtypes=_ANY),
    _special("i0e", unary_samples(), dtypes=_ANY),
    _special("i1", unary_samples(), dtypes=_ANY),
    _special("i1e", unary_samples(), dtypes=_ANY),
    _special("gammaln", unary_samples("pos"), dtypes=_ANY),
    _special("ndtr", unary_samples(), dtypes=_ANY),
    _special("log_ndtr", unary_samples(), dtypes=FLOATS),
    _special("sinc", unary_samples(), dtypes=_ANY),
    _special("entr", unary_samples("pos"), dtypes=_ANY),
    _special("expm1", unary_samples(), dtypes=FLOATS + HALVES),
    _special("exp2", unary_samples(), dtypes=FLOATS + HALVES),
    _special("log1p", unary_samples("pos"), dtypes=FLOATS + HALVES),
    _special("xlogy", (S(A(_M), A(_M, "pos")), S(A(_M), 2.5), S(A((3, 1)), A((4,), "pos"))),
             error=(S(A(_M), A((2, 4), "pos")), RuntimeError)),
    _special("xlog1py", (S(A(_M), A(_M, "pos")), S(A(_M), 0.5), S(A((3, 1)), A((4,), "pos")))),
    _special("logsumexp", (S(A(_M), 1), S(A((2, 3, 4)), (0, 2), keepdim=True))),
    _special("softmax", (S(A(_M), 1), S(A(_M), 0))),
    _special("log_softmax", (S(A(_M), 1), S(A(_M), 0))),
]

ENTRIES = SPECIAL
